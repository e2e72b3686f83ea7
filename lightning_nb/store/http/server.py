"""Serve any :class:`~lightning_nb.store.base.LightningStore` over HTTP (FastAPI + uvicorn).

Use it to let runners in other processes or machines share one store; they talk to
it through :class:`~lightning_nb.store.http.client.StoreClient`.

Security defaults:

* binds ``127.0.0.1`` (loopback only) unless ``host`` says otherwise;
* a non-loopback ``host`` requires ``token`` (ConfigError otherwise), and with a
  token every request, ``/health`` included, needs ``Authorization: Bearer <token>``
  (401 otherwise; compared in constant time);
* request bodies are capped at ``max_body_bytes`` (4 MiB by default; 413 beyond it,
  411 for chunked bodies without a ``Content-Length``);
* blocking calls (``dequeue``, ``wait``) wait at most ``max_wait_s`` (30 s) per request
  and run in worker threads, so they never block the event loop (short calls of an
  ``InMemoryStore``, and a first look of ``dequeue``/``wait`` without waiting, run on the
  loop itself: cheaper than a thread hand-off);
* errors never leak a traceback: the body is ``{"error": {"type", "message", "field"}}``
  with NotFoundError -> 404, InvalidStatusTransition -> 409, ConfigError and invalid
  requests -> 400 (``field`` is the pydantic ``loc`` path), anything else -> 500.

JSON on the wire allows Python's ``NaN``/``Infinity`` extension so float span
attributes round-trip exactly between Python peers. Responses are serialized by
pydantic's (Rust) JSON serializer. The runners' hot requests (enqueue, dequeue, wait, attempt
updates, spans, the latest resources) are plain Starlette routes (``server_hot``) that skip
FastAPI's dependency solving, with the same validation and the same errors; uvicorn runs on
uvloop when it is installed.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from typing import Any, Callable, Optional

import anyio
from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from lightning_nb._net import ThreadedServer, is_loopback
from lightning_nb.errors import ConfigError
from lightning_nb.store.base import LightningStore
from lightning_nb.store.rules import DEFAULT_WATCHDOG_INTERVAL_S
# the request bodies are module level there, so FastAPI resolves the routes' postponed annotations
from lightning_nb.store.http.bodies import (
    AddResourcesRequest, EnqueueManyRequest, MarkTrainedRequest, QueryRolloutsRequest, QueryTrainedRequest,
    StartAttemptRequest, StartRequest, UpdateRolloutRequest, UpdateWorkerRequest,
)
from lightning_nb.store.http.hot import INLINE_STORES, call_store, hot_routes
from lightning_nb.store.http.responses import (StoreJSONResponse, error_response, exception_response, plain_json,
                                               validation_response)

__all__ = ["StoreServer", "DEFAULT_MAX_BODY_BYTES", "DEFAULT_MAX_WAIT_S"]

log = logging.getLogger(__name__)
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_MAX_WAIT_S = 30.0
_SLICE_S = 0.5  # blocking waits are cut into slices to notice disconnects and shutdown


class _Guard:
    """ASGI middleware: bearer token, then body size, before the app sees the request."""

    def __init__(self, app: Any, token: Optional[str], max_body_bytes: int) -> None:
        self.app, self.token, self.max_body_bytes = app, token, max_body_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        length = headers.get("content-length", "0")
        response = None
        if self.token is not None and not secrets.compare_digest(
            headers.get("authorization", "").encode(), f"Bearer {self.token}".encode()
        ):
            response = error_response(401, "ConfigError", "missing or wrong bearer token; send Authorization: Bearer "
                                                  "<token> (StoreClient(url, token=...))", "token")
        elif "content-length" not in headers and "chunked" in headers.get("transfer-encoding", ""):
            response = error_response(411, "ConfigError", "send the body with a Content-Length header", "body")
        elif length.isdigit() and int(length) > self.max_body_bytes:
            response = error_response(413, "ConfigError", f"request body is {length} bytes; this store server accepts "
                                                  f"at most {self.max_body_bytes} (max_body_bytes)", "body")
        if response is not None:
            return await response(scope, receive, send)
        return await self.app(scope, receive, send)


class StoreServer:
    """Serve ``store`` over HTTP in a background thread.

    Args:
        store: any LightningStore; the server adds no state of its own.
        host: bind address; 127.0.0.1 by default.
        port: 0 picks a free port (read ``.port`` / ``.url`` after :meth:`start`).
        token: bearer token required on every request. Required (ConfigError
            otherwise) when ``host`` is not a loopback address.
        max_body_bytes: largest request body accepted (413 above it).
        max_wait_s: longest a single dequeue/wait request blocks.
        sweep_interval_s: while serving, a background thread runs the store's watchdog
            (``store.sweep_attempts()``) every this many seconds, so attempts of dead
            runners end even when no client calls; None: no background sweep (waiting
            and polling calls still run it, see the contract).

    Use as a context manager or call :meth:`start` / :meth:`stop`.

    Raises:
        ConfigError: a non-loopback ``host`` without ``token``, or a non-positive
            ``max_body_bytes``, ``max_wait_s`` or ``sweep_interval_s``.
    """

    def __init__(self, store: LightningStore, host: str = "127.0.0.1", port: int = 0, token: Optional[str] = None,
                 *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, max_wait_s: float = DEFAULT_MAX_WAIT_S,
                 sweep_interval_s: Optional[float] = DEFAULT_WATCHDOG_INTERVAL_S) -> None:
        if not is_loopback(host) and not token:
            raise ConfigError(
                f"host={host!r} is reachable from other machines, so token is required; "
                f"pass token=secrets.token_urlsafe() (or bind to 127.0.0.1)"
            )
        if max_body_bytes <= 0 or max_wait_s <= 0:
            raise ConfigError("max_body_bytes and max_wait_s must be positive")
        if sweep_interval_s is not None and not sweep_interval_s > 0:
            raise ConfigError(f"sweep_interval_s must be positive seconds or None (no background sweep), "
                              f"got {sweep_interval_s!r}")
        self.store, self.host, self.port, self.token = store, host, port, token
        self.max_body_bytes, self.max_wait_s = max_body_bytes, max_wait_s
        self.sweep_interval_s = sweep_interval_s
        self._server: Any = None
        self._sweeper: Optional[threading.Thread] = None
        self._stopping = threading.Event()
        self._wait_limiter: Optional[anyio.CapacityLimiter] = None

    # ----- lifecycle ------------------------------------------------------------------
    def start(self) -> "StoreServer":
        """Start serving in a background thread; returns once the port is bound."""
        if self._server is not None:
            return self
        self._stopping.clear()
        self._wait_limiter = None  # bound to the previous event loop, if any
        # no Server/Date response headers: nothing reads them, and both sides spend CPU on every one
        server = ThreadedServer(self.app(), self.host, self.port, "store server", timeout_keep_alive=65,
                                timeout_graceful_shutdown=5, server_header=False, date_header=False)
        self.port = server.start()
        self._server = server
        if self.sweep_interval_s is not None:
            self._sweeper = threading.Thread(target=self._sweep_loop, name="store-server-watchdog", daemon=True)
            self._sweeper.start()
        return self

    def stop(self) -> None:
        """Stop serving; pending dequeue/wait requests return within about half a second."""
        self._stopping.set()
        if self._server is not None:
            self._server.stop()
            self._server = None
        if self._sweeper is not None:
            self._sweeper.join()
            self._sweeper = None

    def _sweep_loop(self) -> None:
        """The background watchdog: ``store.sweep_attempts()`` every ``sweep_interval_s`` until :meth:`stop`."""
        while not self._stopping.wait(self.sweep_interval_s):
            try:
                self.store.sweep_attempts()
            except Exception as exc:  # e.g. a closed SqliteStore: keep serving, say why once per sweep
                log.warning("store server watchdog: sweep_attempts failed: %s: %s", type(exc).__name__, exc)

    def __enter__(self) -> "StoreServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def url(self) -> str:
        """Base URL clients use (an unspecified bind address is reached through loopback)."""
        host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(self.host, self.host)
        return f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"

    # ----- calling the store ----------------------------------------------------------
    async def _wait(self, request: Request, budget: float, attempt: Callable[[float], Any],
                    done: Callable[[Any], bool], abandon: Optional[Callable[[Any], Any]] = None) -> StoreJSONResponse:
        """Call ``attempt(slice_s)`` until ``done(result)``, ``budget`` seconds pass, the client leaves or we stop.

        Waiting threads use their own limiter so they never starve quick calls. If the
        client left while a result was being produced, ``abandon(result)`` undoes what it can.
        """
        if self._wait_limiter is None:
            self._wait_limiter = anyio.CapacityLimiter(256)
        deadline = time.monotonic() + min(max(budget, 0.0), self.max_wait_s)
        try:
            if type(self.store) in INLINE_STORES:  # a first look without waiting needs no thread
                result = attempt(0.0)
                if done(result) or budget <= 0:
                    return await self._answer(request, result, done, abandon)
            while True:
                remaining = max(0.0, deadline - time.monotonic())
                result = await anyio.to_thread.run_sync(attempt, min(remaining, _SLICE_S), limiter=self._wait_limiter)
                if done(result) and abandon is not None and await request.is_disconnected():
                    await anyio.to_thread.run_sync(abandon, result)
                    return StoreJSONResponse(None)
                if done(result) or remaining <= _SLICE_S or self._stopping.is_set():
                    return StoreJSONResponse(plain_json(result))
                if await request.is_disconnected():
                    return StoreJSONResponse(plain_json(result))
        except Exception as exc:
            return exception_response(exc)

    async def _answer(self, request: Request, result: Any, done: Callable[[Any], bool],
                      abandon: Optional[Callable[[Any], Any]]) -> StoreJSONResponse:
        """The response to a wait that ended with ``result`` (undone by ``abandon`` if the client left)."""
        if done(result) and abandon is not None and await request.is_disconnected():
            await anyio.to_thread.run_sync(abandon, result)
            return StoreJSONResponse(None)
        return StoreJSONResponse(plain_json(result))

    # ----- HTTP app -------------------------------------------------------------------
    def app(self) -> Any:
        """The ASGI application (token and body-size guard included); see :func:`_store_app`."""
        return _store_app(self)


# ----- the HTTP app: module-level routes that find the server in request.app.state ------------
def _store_app(server: StoreServer) -> Any:
    """The server's ASGI app. Its routes are module-level functions that find the server (and its store)
    in ``request.app.state.server``: FastAPI keeps every route function it has seen in process-wide caches
    (``fastapi.dependencies.models``, up to 4096 each), so a route closing over the server would keep it,
    and through it the store, alive after :meth:`StoreServer.stop`. Only the app (dropped at stop) holds
    the server."""
    # telemetry off (FastAPI >= 0.16x; older ones keep it in .extra): the store's requests are not the agent's
    # trace, and with a global OpenTelemetry provider set each request would become spans (and a check per request)
    api = FastAPI(title="lightning-nb store", redirect_slashes=False, openapi_url=None, docs_url=None,
                  redoc_url=None, telemetry={"tracing": False, "metrics": False, "logs": False})
    api.state.server = server
    api.exception_handler(RequestValidationError)(_invalid)
    api.exception_handler(StarletteHTTPException)(_http_error)
    # the runners' hot requests first: plain Starlette routes, the same answers without FastAPI's dependency solving
    api.router.routes.extend(hot_routes())
    api.get("/health")(_health)
    # rollouts
    api.post("/rollouts/start")(_start)
    api.post("/rollouts/batch")(_enqueue_many)
    api.post("/rollouts/query")(_query_rollouts_post)
    api.get("/rollouts")(_query_rollouts)
    api.get("/rollouts/{rollout_id}")(_get_rollout)
    api.post("/rollouts/{rollout_id}/cancel")(_cancel)
    api.patch("/rollouts/{rollout_id}")(_update_rollout)
    api.post("/rollouts/{rollout_id}/attempts")(_start_attempt)
    # attempts
    api.get("/attempts")(_query_attempts)
    api.post("/attempts/sweep")(_sweep_attempts)
    # workers
    api.post("/workers/{worker_id}")(_update_worker)
    api.get("/workers")(_query_workers)
    # resources
    api.post("/resources")(_add_resources)
    api.get("/resources")(_resources_by_query)
    api.get("/resources/{resources_id:path}")(_resources_by_id)
    # the training record
    api.post("/trained")(_mark_trained)
    api.post("/trained/query")(_query_trained)
    return _Guard(api, server.token, server.max_body_bytes)


def _server(request: Request) -> StoreServer:
    return request.app.state.server


def _store(request: Request) -> LightningStore:
    return request.app.state.server.store


async def _invalid(request: Request, exc: RequestValidationError) -> StoreJSONResponse:
    return validation_response(list(exc.errors()), strip_source=True)


async def _http_error(request: Request, exc: StarletteHTTPException) -> StoreJSONResponse:
    if exc.status_code == 404:
        return error_response(404, "NotFoundError", f"{request.method} {request.url.path}: no such object or "
                                            f"endpoint; check the ids in the path", "path")
    return error_response(exc.status_code, "ConfigError", f"{request.method} {request.url.path}: {exc.detail}")


async def _health(request: Request) -> StoreJSONResponse:
    server = _server(request)
    return StoreJSONResponse({"status": "ok", "store": type(server.store).__name__, "max_wait_s": server.max_wait_s,
                  "max_body_bytes": server.max_body_bytes})


# rollouts
async def _enqueue_many(req: EnqueueManyRequest, request: Request) -> StoreJSONResponse:
    return await call_store(_store(request).enqueue_rollouts, req.inputs, mode=req.mode, resources_id=req.resources_id,
                       config=req.config, metadata=req.metadata)


async def _start(req: StartRequest, request: Request) -> StoreJSONResponse:
    return await call_store(_store(request).start_rollout, req.input, mode=req.mode, resources_id=req.resources_id,
                       config=req.config, metadata=req.metadata, worker_id=req.worker_id)


async def _query_rollouts_post(req: QueryRolloutsRequest, request: Request) -> StoreJSONResponse:
    return await call_store(_store(request).query_rollouts, status=req.status, rollout_ids=req.rollout_ids)


async def _query_rollouts(request: Request, status: Optional[list[str]] = Query(None),
                          ids: Optional[list[str]] = Query(None)) -> StoreJSONResponse:
    return await call_store(_store(request).query_rollouts, status=status, rollout_ids=ids)


async def _get_rollout(rollout_id: str, request: Request) -> StoreJSONResponse:
    return await call_store(_store(request).get_rollout_by_id, rollout_id)


async def _cancel(rollout_id: str, request: Request) -> StoreJSONResponse:
    return await call_store(_store(request).cancel_rollout, rollout_id)


async def _update_rollout(rollout_id: str, req: UpdateRolloutRequest, request: Request) -> StoreJSONResponse:
    return await call_store(_store(request).update_rollout, rollout_id, input=req.input, mode=req.mode,
                       resources_id=req.resources_id, config=req.config, metadata=req.metadata, status=req.status)


async def _start_attempt(rollout_id: str, req: StartAttemptRequest, request: Request) -> StoreJSONResponse:
    return await call_store(_store(request).start_attempt, rollout_id, req.worker_id)


# attempts
async def _query_attempts(request: Request, rollout_id: Optional[str] = None) -> StoreJSONResponse:
    return await call_store(_store(request).query_attempts, rollout_id)


async def _sweep_attempts(request: Request) -> StoreJSONResponse:
    return await call_store(_store(request).sweep_attempts)


# workers
async def _update_worker(worker_id: str, req: UpdateWorkerRequest, request: Request) -> StoreJSONResponse:
    return await call_store(_store(request).update_worker, worker_id, status=req.status,
                       heartbeat_stats=req.heartbeat_stats)


async def _query_workers(request: Request) -> StoreJSONResponse:
    return await call_store(_store(request).query_workers)


# resources
async def _add_resources(req: AddResourcesRequest, request: Request) -> StoreJSONResponse:
    return await call_store(_store(request).add_resources, req.resources, req.resources_id)


async def _resources_by_query(request: Request, resources_id: Optional[str] = None) -> StoreJSONResponse:
    if resources_id is None:
        return await call_store(_store(request).query_resources)
    return await call_store(_store(request).get_resources_by_id, resources_id)


async def _resources_by_id(resources_id: str, request: Request) -> StoreJSONResponse:
    return await call_store(_store(request).get_resources_by_id, resources_id)




# the training record
async def _mark_trained(req: MarkTrainedRequest, request: Request) -> StoreJSONResponse:
    return await call_store(_store(request).mark_trained, req.rollout_ids, learner=req.learner, update=req.update)


async def _query_trained(req: QueryTrainedRequest, request: Request) -> StoreJSONResponse:
    return await call_store(_store(request).query_trained, req.rollout_ids)
