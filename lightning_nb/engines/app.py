"""The OpenAI-compatible HTTP app a :class:`~lightning_nb.engines.transformers.TransformersEngine` serves at its ``base_url``.

``POST /v1/chat/completions`` (with vLLM's ``return_token_ids``), ``GET /v1/models`` and ``GET /health``,
as the :class:`~lightning_nb.engines.base.Engine` contract asks. A request is validated strictly (any field
this engine does not honour: a 400 naming it), rendered with the engine's chat template and queued on its
batching thread (:meth:`~lightning_nb.engines.transformers.TransformersEngine.submit`). The JSON fields
``prompt_token_ids``, ``logprobs`` and ``weight_version`` here are the OpenAI/vLLM response's, not span keys.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Optional, Union

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from lightning_nb.engines.base import Generation, chat_completion_payload
from lightning_nb.errors import ConfigError

if TYPE_CHECKING:
    from lightning_nb.engines.transformers import TransformersEngine

__all__ = ["engine_app"]


class _EngineMessage(BaseModel):
    """One chat message of an :class:`_EngineRequest` (any other field: a 400 naming it)."""

    model_config = ConfigDict(extra="forbid")
    role: str
    content: Any = None
    name: Optional[str] = None

class _EngineRequest(BaseModel):
    """The chat request a TransformersEngine endpoint takes (any other field: a 400 naming it)."""

    model_config = ConfigDict(extra="forbid")
    model: str
    messages: list[_EngineMessage] = Field(min_length=1)
    max_tokens: Optional[int] = Field(None, ge=1, le=4096)
    max_completion_tokens: Optional[int] = Field(None, ge=1, le=4096)
    temperature: float = Field(1.0, ge=0.0, le=5.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=16)
    seed: Optional[int] = None
    stop: Union[str, list[str], None] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=0)
    return_token_ids: bool = False
    stream: bool = False
    response_format: Optional[dict[str, Any]] = None


def engine_app(engine: "TransformersEngine") -> Any:
    """The OpenAI-compatible endpoint of a :class:`TransformersEngine` (vLLM's ``return_token_ids`` included).

    Its routes are module-level functions that find the engine through a weak reference in
    ``request.app.state.engine``: FastAPI keeps every route function it has seen in process-wide
    caches (``fastapi.dependencies.models``), so a route closing over the engine would keep it, its
    model and its tokenizer alive for good, and a strong reference would let the server thread keep an
    engine dropped without :meth:`~TransformersEngine.close` (whose finalizer then stops the server).
    """
    from fastapi import FastAPI

    app = FastAPI(title="lightning-nb TransformersEngine")
    app.state.engine = weakref.ref(engine)
    app.get("/health")(_engine_health)
    app.get("/v1/models")(_engine_models)
    app.post("/v1/chat/completions")(_engine_chat)
    return app


def _engine_error(status: int, message: str, param: Optional[str] = None) -> Any:
    from fastapi.responses import JSONResponse

    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status)


def _served_engine(request: Request) -> "TransformersEngine":
    engine = request.app.state.engine()
    if engine is None or engine.closed:
        raise _EngineHTTPError(503, "this TransformersEngine is closed")
    return engine


class _EngineHTTPError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


async def _engine_health(request: Request) -> Any:
    try:
        return {"status": "ok", "weight_version": _served_engine(request).weight_version}
    except _EngineHTTPError as exc:
        return _engine_error(exc.status, exc.message)


async def _engine_models(request: Request) -> Any:
    try:
        name = _served_engine(request).model_name
    except _EngineHTTPError as exc:
        return _engine_error(exc.status, exc.message)
    return {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "lightning-nb"}]}


async def _engine_chat(request: Request) -> Any:
    """``POST /v1/chat/completions``: the request's ``n`` completions, decoded by the engine's batching thread."""
    import asyncio

    try:
        engine = _served_engine(request)
        body = _engine_request(engine, await _json_body(request))
        prompt_ids = engine.apply_chat_template([m.model_dump() for m in body.messages])
        stop = [body.stop] if isinstance(body.stop, str) else body.stop
        futures = [engine.submit(prompt_ids, max_tokens=body.max_completion_tokens or body.max_tokens or 256,
                                 temperature=body.temperature, top_p=body.top_p, stop=stop,
                                 seed=None if body.seed is None else body.seed + i) for i in range(body.n)]
    except _EngineHTTPError as exc:
        return _engine_error(exc.status, exc.message, exc.param)
    except ConfigError as exc:
        return _engine_error(400, str(exc))
    gens: list[Generation] = list(await asyncio.gather(*(asyncio.wrap_future(f) for f in futures)))
    return chat_completion_payload(gens, engine.tokenizer, engine.model_name, logprobs=body.logprobs,
                                   token_ids=body.return_token_ids)


async def _json_body(request: Request) -> Any:
    try:
        return await request.json()
    except ValueError:
        raise _EngineHTTPError(400, "request body is not valid JSON") from None


def _engine_request(engine: "TransformersEngine", raw: Any) -> _EngineRequest:
    """``raw`` validated as a chat request this engine can answer; a 400 (404 for another model) otherwise."""
    try:
        body = _EngineRequest.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        hint = " (TransformersEngine does not take this parameter)" if first["type"] == "extra_forbidden" else ""
        raise _EngineHTTPError(400, f"invalid field '{where}': {first['msg']}{hint}", where) from None
    if body.model != engine.model_name:
        raise _EngineHTTPError(404, f"model {body.model!r} is not served here; this engine serves "
                                    f"{engine.model_name!r}", "model")
    if body.stream:
        raise _EngineHTTPError(400, "invalid field 'stream': this endpoint answers whole completions; the LLM "
                                    "proxy streams (stream=true there)", "stream")
    if body.response_format and body.response_format.get("type", "text") != "text":
        raise _EngineHTTPError(400, "invalid field 'response_format': TransformersEngine has no constrained "
                                    "decoding; use {'type': 'text'} or serve with VLLMEngine", "response_format")
    for i, m in enumerate(body.messages):
        if m.role not in ("system", "developer", "user", "assistant"):
            raise _EngineHTTPError(400, f"invalid field 'messages.{i}.role': {m.role!r}; tool turns are rendered "
                                        "as text by the LLM proxy (lightning_nb.engines.chat_format.render_tools)",
                                   f"messages.{i}.role")
    return body
