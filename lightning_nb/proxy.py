"""LLM proxy: an OpenAI-compatible ``/v1/chat/completions`` on 127.0.0.1, built on LiteLLM.

Agents call ``{proxy}/rollout/{rollout_id}/attempt/{attempt_id}/v1`` (the runner
hands them that base URL as their :class:`~lightning_nb.types.LLMResource`), so
every call is attributed to its attempt. The proxy routes the request through
``litellm.acompletion`` to the in-process engine (a LiteLLM ``CustomLLM``
provider named ``lightning_nb``) and records one span per call with the request,
the response text, the prompt and completion token IDs and the logprobs. Like
vLLM's ``return_token_ids``, the response also carries ``prompt_token_ids`` and
``choices[0].token_ids``.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import threading
import uuid
from typing import Any, Literal, Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from lightning_nb._net import ThreadedServer, is_loopback
from lightning_nb.engine import Generation, TransformersEngine
from lightning_nb.errors import ConfigError, NotFoundError
from lightning_nb.store.base import LightningStore
from lightning_nb.tracer import Tracer
from lightning_nb.types import LLMResource

__all__ = ["LLMProxy", "ChatCompletionRequest", "LLM_SPAN_NAME"]

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # never fetch the cost map at import
LLM_SPAN_NAME = "llm.chat.completions"
_PROVIDER = "lightning_nb"
_ENGINES: dict[str, TransformersEngine] = {}
_RESULTS: dict[str, Generation] = {}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"] = Field(
        description="'developer' (OpenAI's newer name for system instructions) is rendered as 'system'.")
    content: Union[str, list[dict[str, Any]], None] = None


class ChatCompletionRequest(BaseModel):
    """The subset of the OpenAI chat request the engine honours (other fields are ignored).

    ``logprobs=true`` returns ``choices[0].logprobs`` in the OpenAI shape (``token``,
    ``bytes``, ``logprob``, ``top_logprobs``); without it the field is null, as OpenAI
    does. Token IDs are always in ``prompt_token_ids`` and ``choices[0].token_ids``.
    """

    model_config = ConfigDict(extra="allow")
    model: str = Field(min_length=1)
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = Field(None, ge=1, le=4096)
    max_completion_tokens: Optional[int] = Field(None, ge=1, le=4096)
    temperature: float = Field(1.0, ge=0.0, le=5.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=1, description="only n=1 is supported")
    stream: bool = Field(False, description="streaming is not supported")
    logprobs: Optional[bool] = Field(False, description="return choices[0].logprobs in the OpenAI shape")
    top_logprobs: Optional[int] = Field(None, ge=0, le=20, description="only 0 is supported")


def _custom_llm_class() -> type:
    import litellm
    from litellm import CustomLLM, ModelResponse

    class _EngineLLM(CustomLLM):
        """LiteLLM provider that completes with a TransformersEngine in this process."""

        async def acompletion(self, model: str, messages: list, api_base: str, model_response: ModelResponse,
                              optional_params: dict, **kwargs: Any) -> ModelResponse:
            engine = _ENGINES[api_base]
            params = optional_params or {}
            prompt_ids = engine.apply_chat_template(messages)
            gen: Generation = await asyncio.wrap_future(
                engine.submit(
                    prompt_ids,
                    max_tokens=int(params.get("max_tokens") or params.get("max_completion_tokens") or 256),
                    temperature=float(params.get("temperature", 1.0)),
                    top_p=float(params.get("top_p", 1.0)),
                )
            )
            response_id = f"chatcmpl-{uuid.uuid4().hex}"
            _RESULTS[response_id] = gen
            return litellm.ModelResponse(
                id=response_id,
                model=model,
                choices=[{"index": 0, "finish_reason": gen.finish_reason,
                          "message": {"role": "assistant", "content": gen.text}}],
                usage={"prompt_tokens": len(gen.prompt_ids), "completion_tokens": len(gen.completion_ids),
                       "total_tokens": len(gen.prompt_ids) + len(gen.completion_ids)},
            )

    return _EngineLLM


_REGISTER_LOCK = threading.Lock()


def _register_provider() -> None:
    import litellm

    with _REGISTER_LOCK:
        litellm.telemetry = False
        if not any(p.get("provider") == _PROVIDER for p in litellm.custom_provider_map):
            litellm.custom_provider_map.append({"provider": _PROVIDER, "custom_handler": _custom_llm_class()()})
            from litellm.utils import custom_llm_setup

            custom_llm_setup()



class LLMProxy:
    """Serve ``engine`` behind an OpenAI-compatible endpoint and trace every call into ``store``.

    Args:
        engine: the inference engine to forward to.
        store: where LLM-call spans go.
        host: bind address; 127.0.0.1 by default.
        port: 0 picks a free port.
        api_key: bearer token required on every request. Required (ConfigError
            otherwise) when ``host`` is not a loopback address.

    Use as a context manager or call :meth:`start` / :meth:`stop`.
    """

    def __init__(self, engine: TransformersEngine, store: LightningStore, *, host: str = "127.0.0.1",
                 port: int = 0, api_key: Optional[str] = None, tracer: Optional[Tracer] = None) -> None:
        if not is_loopback(host) and not api_key:
            raise ConfigError(
                f"host={host!r} is reachable from other machines, so api_key is required; "
                f"pass api_key=secrets.token_urlsafe() (or bind to 127.0.0.1)"
            )
        self.engine, self.store = engine, store
        self.host, self.port = host, port
        self.api_key = api_key
        self.tracer = tracer or Tracer(store)
        self._key = f"{_PROVIDER}://{secrets.token_hex(8)}"
        self._server: Any = None

    # ----- lifecycle ------------------------------------------------------------------
    def start(self) -> "LLMProxy":
        """Start serving in a background thread; returns once the port is bound."""
        if self._server is not None:
            return self
        _register_provider()
        _ENGINES[self._key] = self.engine
        self._server = ThreadedServer(self._app(), self.host, self.port, "LLM proxy")
        self.port = self._server.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None
        _ENGINES.pop(self._key, None)

    def __enter__(self) -> "LLMProxy":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def endpoint(self, rollout_id: Optional[str] = None, attempt_id: Optional[str] = None) -> str:
        """Base URL (ending in /v1) for the OpenAI SDK; attributed when ids are given."""
        if rollout_id and attempt_id:
            return f"{self.url}/rollout/{rollout_id}/attempt/{attempt_id}/v1"
        return f"{self.url}/v1"

    def as_resource(self, **sampling_parameters: Any) -> LLMResource:
        """This proxy as the ``main_llm`` resource agents receive."""
        return LLMResource(endpoint=self.endpoint(), model=self.engine.model_name,
                           sampling_parameters=sampling_parameters, api_key=self.api_key or "not-needed")

    # ----- HTTP app -------------------------------------------------------------------
    def _app(self) -> Any:
        app = FastAPI(title="lightning-nb LLM proxy")

        def error(status: int, message: str, param: Optional[str] = None) -> JSONResponse:
            body = {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": status}}
            return JSONResponse(body, status_code=status)

        @app.middleware("http")
        async def auth(request: Request, call_next: Any) -> Any:
            if self.api_key and request.headers.get("authorization") != f"Bearer {self.api_key}":
                return error(401, "missing or wrong bearer token; send Authorization: Bearer <api_key>")
            return await call_next(request)

        @app.get("/health")
        async def health() -> dict:
            return {"status": "ok", "model": self.engine.model_name, "weight_version": self.engine.weight_version}

        @app.get("/v1/models")
        async def models() -> dict:
            return {"object": "list", "data": [{"id": self.engine.model_name, "object": "model"}]}

        async def handle(request: Request, rollout_id: Optional[str], attempt_id: Optional[str]) -> Any:
            try:
                body = await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError):
                return error(400, "request body is not valid JSON; send a JSON chat completion request")
            try:
                req = ChatCompletionRequest.model_validate(body)
            except ValidationError as exc:
                first = exc.errors()[0]
                field = ".".join(str(p) for p in first["loc"]) or "body"
                return error(400, f"invalid field '{field}': {first['msg']}", param=field)
            if req.stream:
                return error(400, "invalid field 'stream': streaming is not supported; set stream=false", "stream")
            if req.top_logprobs:
                return error(400, "invalid field 'top_logprobs': this engine returns only the sampled token's "
                                  "log-prob; use logprobs=true with top_logprobs=0 (or omit it)", "top_logprobs")
            enforced: dict[str, Any] = {}
            if rollout_id is not None:
                try:  # store calls may block (SQLite fsync, HTTP): off the event loop
                    rollout = await asyncio.to_thread(self.store.get_rollout_by_id, rollout_id)
                    attempts = {a.attempt_id for a in await asyncio.to_thread(self.store.query_attempts, rollout_id)}
                except NotFoundError as exc:
                    return error(404, str(exc), "rollout_id")
                if attempt_id not in attempts:
                    return error(404, f"attempt_id {attempt_id!r} is not an attempt of rollout {rollout_id!r}",
                                 "attempt_id")
                enforced = dict(rollout.metadata.get("sampling_parameters") or {})
            return await self._complete(req, rollout_id, attempt_id, enforced)

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Any:
            return await handle(request, None, None)

        @app.post("/rollout/{rollout_id}/attempt/{attempt_id}/v1/chat/completions")
        async def chat_attributed(rollout_id: str, attempt_id: str, request: Request) -> Any:
            return await handle(request, rollout_id, attempt_id)

        return app

    async def _complete(self, req: ChatCompletionRequest, rollout_id: Optional[str], attempt_id: Optional[str],
                        enforced: Optional[dict[str, Any]] = None) -> Any:
        """Complete ``req`` with the rollout's sampling parameters (``enforced``) applied over the request's.

        Framework clients never read ``llm.sampling_parameters``, so the proxy applies the
        rollout's ``temperature`` and ``top_p`` (they replace the request's) and its
        ``max_tokens`` (a cap on the request's). The span records what was requested
        (``gen_ai.request.*``) and what was applied (``temperature``, ``top_p``, ``max_tokens``),
        so the log-probs always belong to the distribution that was sampled; keys of the
        rollout's sampling parameters that the proxy does not apply are listed in
        ``lightning_nb.sampling_not_applied``.
        """
        import litellm

        enforced = enforced or {}
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        for m in messages:
            if m["role"] == "developer":
                m["role"] = "system"
        requested_max = req.max_completion_tokens or req.max_tokens
        cap = enforced.get("max_tokens")
        max_tokens = min(int(requested_max or cap), int(cap)) if cap else (requested_max or 256)
        temperature = float(enforced.get("temperature", req.temperature))
        top_p = float(enforced.get("top_p", req.top_p))
        not_applied = sorted(set(enforced) - {"temperature", "top_p", "max_tokens"})
        span = None
        if rollout_id and attempt_id:
            span = self.tracer.start_span(LLM_SPAN_NAME, rollout_id, attempt_id, {
                "gen_ai.system": _PROVIDER,
                "gen_ai.request.model": req.model,
                "gen_ai.request.temperature": req.temperature,
                "gen_ai.request.top_p": req.top_p,
                **({"gen_ai.request.max_tokens": requested_max} if requested_max else {}),
                "max_tokens": max_tokens,
                "gen_ai.prompt": json.dumps(messages),
                **({"lightning_nb.sampling_not_applied": not_applied} if not_applied else {}),
            })
        try:
            response = await litellm.acompletion(
                model=f"{_PROVIDER}/{self.engine.model_name}", messages=messages, api_base=self._key,
                max_tokens=max_tokens, temperature=temperature, top_p=top_p,
            )
        except Exception as exc:
            if span is not None:
                span.set_attribute("error", repr(exc))
                await asyncio.to_thread(span.end)  # ending it writes to the store
            return JSONResponse({"error": {"message": f"engine error: {exc}", "type": "server_error"}}, status_code=500)
        gen = _RESULTS.pop(response.id)
        if span is not None:
            span.set_attributes({
                "gen_ai.response.id": response.id,
                "gen_ai.response.finish_reasons": [gen.finish_reason],
                "gen_ai.usage.input_tokens": len(gen.prompt_ids),
                "gen_ai.usage.output_tokens": len(gen.completion_ids),
                "gen_ai.completion": gen.text,
                "prompt_token_ids": gen.prompt_ids,
                "completion_token_ids": gen.completion_ids,
                "logprobs": gen.logprobs,
                "temperature": gen.temperature,
                "top_p": top_p,
                "weight_version": gen.weight_version,
            })
            await asyncio.to_thread(span.end)  # ending it writes to the store: off the event loop
        payload = response.model_dump()
        payload["prompt_token_ids"] = gen.prompt_ids
        payload["choices"][0]["token_ids"] = gen.completion_ids
        payload["choices"][0]["logprobs"] = self._openai_logprobs(gen) if req.logprobs else None
        return payload

    def _openai_logprobs(self, gen: Generation) -> dict[str, Any]:
        """``choices[i].logprobs`` in the OpenAI shape: one entry per completion token, no alternatives.

        ``token`` is the token decoded alone, ``bytes`` its UTF-8 bytes; the stop token is
        included (its log-prob was sampled too). Token IDs travel in ``choices[i].token_ids``.
        """
        tokens = [self.engine.tokenizer.decode([t]) for t in gen.completion_ids]
        return {"content": [{"token": tok, "bytes": list(tok.encode("utf-8")), "logprob": lp, "top_logprobs": []}
                            for tok, lp in zip(tokens, gen.logprobs)], "refusal": None}
