"""The LLM proxy's HTTP app: its routes, the bearer-token check, and errors in the OpenAI shape.

Routes: ``GET /health``; ``GET /v1/models``; ``POST /v1/chat/completions`` (not recorded) and
``POST /rollout/{rollout_id}/attempt/{attempt_id}/v1/chat/completions`` (recorded for that attempt);
``POST /traffic/v1/chat/completions`` (opt-in traffic: each request becomes a one-call rollout, unlabelled,
its id in the ``X-Rollout-Id`` response header: ``LLMProxy.serve_traffic``);
``/v1/responses`` is a 404 that says how to use Chat Completions instead.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from lightning_nb import semconv
from lightning_nb.proxy.request import ProxyHTTPError
from lightning_nb.proxy.response import sse_events

__all__ = ["proxy_app", "error_response", "ROLLOUT_ID_HEADER"]

#: Response header of the ``/traffic`` route: the id of the rollout that recorded the call (``store.label`` it).
ROLLOUT_ID_HEADER = "X-Rollout-Id"


class _BearerAuth:
    """ASGI middleware: a 401 unless ``Authorization: Bearer <token>`` (installed only when a key is set)."""

    def __init__(self, app: Any, token: str) -> None:
        self.app, self.expected = app, f"Bearer {token}".encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and dict(scope["headers"]).get(b"authorization") != self.expected:
            error = {"message": "missing or wrong bearer token; send Authorization: Bearer <api_key>",
                     "type": "invalid_request_error", "param": None, "code": 401}
            await JSONResponse({"error": error}, 401)(scope, receive, send)
            return
        await self.app(scope, receive, send)


def error_response(status: int, message: str, param: Optional[str] = None) -> JSONResponse:
    """An OpenAI-shaped error: ``{"error": {"message", "type", "param", "code"}}`` with HTTP ``status``."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status)


def proxy_app(proxy: Any) -> Any:
    """The ASGI app of ``proxy`` (an :class:`~lightning_nb.proxy.LLMProxy`; this module does not import it, which
    imports this one). It reads ``proxy.api_key``, ``engines`` and ``served_models``, and serves chat
    completions with ``proxy.serve_chat``. Its routes are module-level functions that find the proxy in
    ``request.app.state.proxy``: FastAPI keeps every route function it has seen in process-wide
    caches (``fastapi.dependencies.models``, up to 4096 each), so a route closing over the proxy
    would keep it, and through it the engines and the store, alive after :meth:`LLMProxy.stop`.
    Only the app (dropped at stop) holds the proxy."""
    app = FastAPI(title="lightning-nb LLM proxy")
    app.state.proxy = proxy
    if proxy.api_key:
        app.add_middleware(_BearerAuth, token=proxy.api_key)
    app.get("/health")(_health)
    for prefix in ("", "/rollout/{rollout_id}/attempt/{attempt_id}", "/traffic"):
        app.get(f"{prefix}/v1/models")(_models)
        app.post(f"{prefix}/v1/responses")(_responses_api)
    app.post("/v1/chat/completions")(_chat)
    app.post("/rollout/{rollout_id}/attempt/{attempt_id}/v1/chat/completions")(_chat_attributed)
    app.post("/traffic/v1/chat/completions")(_chat_traffic)
    return app


async def _health(request: Request) -> dict:
    proxy = request.app.state.proxy
    engines = proxy.engines
    return {"status": "ok", "models": proxy.served_models,
            "weight_versions": {e.model_name: e.weight_version for e in engines},
            "weight_version": engines[0].weight_version if engines else None}


async def _models(request: Request) -> dict:
    return {"object": "list", "data": [{"id": m, "object": "model", "owned_by": "lightning-nb"}
                                       for m in request.app.state.proxy.served_models]}


def _responses_api() -> JSONResponse:
    return error_response(404, "the Responses API (/v1/responses) is not served; use Chat Completions. With the "
                               "OpenAI Agents SDK: agents.set_default_openai_api('chat_completions'), or "
                               "model=OpenAIChatCompletionsModel(model=llm.model, openai_client=AsyncOpenAI("
                               "base_url=llm.endpoint, api_key=llm.api_key))")


async def _chat(request: Request) -> Any:
    return await _handle(request, None, None)


async def _chat_attributed(rollout_id: str, attempt_id: str, request: Request) -> Any:
    return await _handle(request, rollout_id, attempt_id)


async def _chat_traffic(request: Request) -> Any:
    return await _handle(request, None, None, traffic=True)


async def _handle(request: Request, rollout_id: Optional[str], attempt_id: Optional[str], *,
                  traffic: bool = False) -> Any:
    """One chat completion request: validated, routed, completed, recorded; errors in the OpenAI shape.

    ``traffic``: the ``/traffic`` route (``proxy.serve_traffic``); the rollout id goes in the
    ``X-Rollout-Id`` response header."""
    proxy = request.app.state.proxy
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return error_response(400, "request body is not valid JSON; send a JSON chat completion request")
    agent_name = request.headers.get(semconv.AGENT_NAME_HEADER)
    headers: dict[str, str] = {}
    try:
        if traffic:
            rid, req, completion = await proxy.serve_traffic(body, agent_name=agent_name)
            headers[ROLLOUT_ID_HEADER] = rid
        else:
            req, completion = await proxy.serve_chat(body, rollout_id, attempt_id, agent_name=agent_name)
    except ProxyHTTPError as exc:
        return error_response(exc.status, exc.message, exc.param)
    if req.stream:
        return StreamingResponse(sse_events(completion, req), media_type="text/event-stream", headers=headers)
    for c in completion["choices"]:
        del c["_pieces"]
    # already JSON-safe: skip FastAPI's jsonable_encoder walk over every token ID
    return Response(json.dumps(completion), media_type="application/json", headers=headers)
