"""The runners' hot requests of :class:`~lightning_nb.store.http.server.StoreServer` as plain Starlette routes.

A runner's loop (dequeue, latest resources, attempt updates, spans) and the algorithm's enqueue, wait and span
queries are most of a store server's requests. FastAPI's per-request dependency solving cost about half a request's
server CPU, so these routes are Starlette's own (``starlette.routing.Route``, FastAPI's base): the body is read with
``await request.body()`` and validated by the same pydantic models (``server_bodies``) in JSON mode, and the
answers and errors are the ones the FastAPI routes gave (status codes, ``{"error": {"type", "message", "field"}}``
naming the field). The token and body-size guard wraps the whole app, so it applies here too. The API has no
OpenAPI page (``openapi_url=None``), so nothing is lost from the docs.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Optional

import anyio
from pydantic import TypeAdapter, ValidationError
from starlette.requests import Request
from starlette.routing import Route

from lightning_nb.store.memory.store import InMemoryStore
from lightning_nb.store.http.bodies import DequeueRequest, EnqueueRequest, UpdateAttemptRequest, WaitRequest
from lightning_nb.store.http.responses import (StoreJSONResponse, error_response, exception_response, plain_json,
                                               validation_response)
from lightning_nb.types import AttemptedRollout, Span

__all__ = ["INLINE_STORES", "call_store", "hot_routes"]  # for the store server (store/http/server.py)

INLINE_STORES = (InMemoryStore,)  # exact types whose short calls run on the event loop (_runs_inline)
_INLINE_CALLS = frozenset({
    "enqueue_rollout", "start_rollout", "get_rollout_by_id", "cancel_rollout", "update_rollout", "start_attempt",
    "update_attempt", "update_worker", "add_span", "add_spans", "add_resources", "get_latest_resources",
    "get_resources_by_id"})
_ENQUEUE, _DEQUEUE = TypeAdapter(EnqueueRequest), TypeAdapter(DequeueRequest)
_WAIT, _UPDATE_ATTEMPT = TypeAdapter(WaitRequest), TypeAdapter(UpdateAttemptRequest)
_SPAN, _SPANS = TypeAdapter(Span), TypeAdapter(list[Span])


async def call_store(fn: Callable[..., Any], *args: Any, _reply: Optional[Callable[[Any], Any]] = None,
                **kwargs: Any) -> StoreJSONResponse:
    """Run a store call and turn its result (``_reply(result)`` when given) or error into JSON: in a worker
    thread, or right here when the store never blocks (:func:`_runs_inline`)."""
    try:
        if _runs_inline(fn, args):
            result = fn(*args, **kwargs)
        else:
            result = await anyio.to_thread.run_sync(lambda: fn(*args, **kwargs))
    except Exception as exc:
        return exception_response(exc)
    return StoreJSONResponse(plain_json(result if _reply is None else _reply(result)))


def _runs_inline(fn: Callable[..., Any], args: tuple) -> bool:
    """True for a short call of an :class:`InMemoryStore` (one object, one rollout's spans, a body-sized
    batch): it holds the store's lock for microseconds and never waits for I/O, so running it on the event
    loop costs less than the two thread hand-offs of a worker thread. Listings of the whole store stay in
    threads (other requests go on meanwhile), as do all calls of other stores (a SqliteStore call may wait
    for an fsync)."""
    if type(getattr(fn, "__self__", None)) not in INLINE_STORES:
        return False
    name = fn.__name__
    return name in _INLINE_CALLS or (name == "query_spans" and bool(args) and args[0] is not None)


async def _parse(request: Request, adapter: TypeAdapter) -> tuple[Any, Optional[StoreJSONResponse]]:
    """``(value, None)``: the request's JSON body validated by ``adapter``; ``(None, response)``: a 400 naming the
    field, as FastAPI's body validation gave it (a body that is not JSON, or sent as another content type, names
    ``body``)."""
    content_type = request.headers.get("content-type")
    if content_type and not _is_json(content_type):
        return None, error_response(400, "ValidationError", f"invalid field 'body': send it as JSON (Content-Type: "
                                                    f"application/json), not {content_type!r}", "body")
    body = await request.body()
    try:
        return adapter.validate_json(body), None
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
    if errors[0].get("type") != "json_invalid":
        return None, validation_response(errors, strip_source=False)
    try:  # e.g. an escaped lone surrogate or NaN spelt otherwise: the standard library's reader, as FastAPI's
        data = json.loads(body)
    except ValueError:
        return None, validation_response(errors, strip_source=False)
    try:
        return adapter.validate_python(data), None
    except ValidationError as exc:
        return None, validation_response(exc.errors(include_url=False), strip_source=False)


def _is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def _server(request: Request) -> Any:
    return request.app.state.server


# ----- the routes ----------------------------------------------------------------------------------
async def _enqueue(request: Request) -> StoreJSONResponse:
    req, bad = await _parse(request, _ENQUEUE)
    if bad is not None:
        return bad
    return await call_store(_server(request).store.enqueue_rollout, req.input, mode=req.mode,
                       resources_id=req.resources_id, config=req.config, metadata=req.metadata)


async def _dequeue(request: Request) -> StoreJSONResponse:
    req, bad = await _parse(request, _DEQUEUE)
    if bad is not None:
        return bad
    server = _server(request)
    store = server.store

    def abandon(item: AttemptedRollout) -> None:  # nobody will run it: fail the attempt so it requeues
        store.update_attempt(item.rollout.rollout_id, item.attempt.attempt_id, status="failed",
                             error="the store client disconnected before receiving this attempt")

    return await server._wait(request, req.timeout, lambda s: store.dequeue_rollout(req.worker_id, timeout=s),
                              lambda item: item is not None, abandon)


async def _wait_for_rollouts(request: Request) -> StoreJSONResponse:
    req, bad = await _parse(request, _WAIT)
    if bad is not None:
        return bad
    server = _server(request)
    store = server.store
    budget = server.max_wait_s if req.timeout is None else req.timeout
    return await server._wait(request, budget,
                              lambda s: store.wait_for_rollouts(req.rollout_ids, timeout=s, progress=False),
                              lambda done: len(done) == len(req.rollout_ids))


async def _update_attempt(request: Request) -> StoreJSONResponse:
    req, bad = await _parse(request, _UPDATE_ATTEMPT)
    if bad is not None:
        return bad
    params = request.path_params
    return await call_store(_server(request).store.update_attempt, params["rollout_id"], params["attempt_id"],
                       status=req.status, worker_id=req.worker_id, error=req.error, heartbeat=req.heartbeat)


async def _add_span(request: Request) -> StoreJSONResponse:
    span, bad = await _parse(request, _SPAN)
    return bad if bad is not None else await call_store(_server(request).store.add_span, span)


async def _add_spans(request: Request) -> StoreJSONResponse:
    """``POST /spans/batch``: the stored spans, or with ``?reply=sequence_ids`` only their sequence ids (what
    ``StoreClient.add_otel_spans``, the runners' tracer, needs: no span is rendered and parsed back)."""
    reply = request.query_params.get("reply")
    if reply not in (None, "spans", "sequence_ids"):
        return error_response(400, "ValidationError", f"invalid field 'reply': {reply!r}; use 'spans' (the default) or "
                                              f"'sequence_ids'", "reply")
    spans, bad = await _parse(request, _SPANS)
    if bad is not None:
        return bad
    return await call_store(_server(request).store.add_spans, spans,
                       _reply=_sequence_ids if reply == "sequence_ids" else None)


def _sequence_ids(spans: list[Span]) -> list[int]:
    return [span.sequence_id for span in spans]


async def _query_spans(request: Request) -> StoreJSONResponse:
    query = request.query_params
    return await call_store(_server(request).store.query_spans, query.get("rollout_id"), query.get("attempt_id"))


async def _latest_resources(request: Request) -> StoreJSONResponse:
    return await call_store(_server(request).store.get_latest_resources)


def hot_routes() -> list[Route]:
    """The hot routes, to be matched before the FastAPI ones."""
    return [
        Route("/rollouts", _enqueue, methods=["POST"]),
        Route("/rollouts/dequeue", _dequeue, methods=["POST"]),
        Route("/rollouts/wait", _wait_for_rollouts, methods=["POST"]),
        Route("/rollouts/{rollout_id}/attempts/{attempt_id}", _update_attempt, methods=["PATCH"]),
        Route("/spans", _add_span, methods=["POST"]),
        Route("/spans/batch", _add_spans, methods=["POST"]),
        Route("/spans", _query_spans, methods=["GET"]),
        Route("/resources/latest", _latest_resources, methods=["GET"]),
    ]
