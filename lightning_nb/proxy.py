"""LLM proxy: an OpenAI-compatible Chat Completions API on 127.0.0.1, routed by LiteLLM to the engines.

Agents call ``{proxy}/rollout/{rollout_id}/attempt/{attempt_id}/v1`` (the runner
hands them that base URL as their :class:`~lightning_nb.types.LLMResource`), so
every call is attributed to its attempt. The proxy routes each request by its
``model`` to an :class:`~lightning_nb.engine.Engine` (round-robin among engines serving
one name)
(every engine serves an OpenAI-compatible endpoint and returns token IDs the way
vLLM's ``return_token_ids`` does) with LiteLLM's ``hosted_vllm`` provider (or the
engine's own provider), and records one span per choice with the
request, the reply, the prompt and completion token IDs, the log-probs and the
weight version they were sampled from. Token IDs also travel back to the client in
fields OpenAI clients ignore: ``prompt_token_ids`` and ``choices[i].token_ids``.

What the proxy adds to the engines: tool calls for models that write them as text
(:mod:`lightning_nb.chat_format`), streaming (``stream=true`` is answered as
server-sent events from the finished completion, recorded as one span like any
other call), a 400 naming any parameter that is unknown or that the serving engine
does not honour, a 404 naming the served models, and, on a rollout's URL, the
rollout's sampling parameters (see :meth:`LLMProxy._sampling`).
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
import uuid
import weakref
from typing import Any, Literal, Optional, Sequence, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from lightning_nb._net import ThreadedServer, is_loopback
from lightning_nb.chat_format import parse_tool_calls, render_tools
from lightning_nb.engine import Engine
from lightning_nb.errors import ConfigError, LightningNbError, NotFoundError
from lightning_nb.store.base import LightningStore
from lightning_nb.tracer import Tracer
from lightning_nb.types import LLMResource

__all__ = ["LLMProxy", "ChatCompletionRequest", "LLM_SPAN_NAME", "TOKEN_IDS_MISSING", "AGENT_NAME",
           "AGENT_NAME_HEADER"]

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # never fetch the cost map at import
LLM_SPAN_NAME = "llm.chat.completions"
AGENT_NAME_HEADER = "X-Agent-Name"  # request header the proxy records as the span attribute AGENT_NAME
AGENT_NAME = "gen_ai.agent.name"  # OpenTelemetry GenAI semantic conventions
TOKEN_IDS_MISSING = "lightning_nb.token_ids_missing"  # span attribute: why a call has no token IDs
_OPTIONAL = ("stop", "seed", "n", "response_format", "frequency_penalty", "presence_penalty", "top_logprobs")


class ChatMessage(BaseModel):
    """One chat message. Unknown keys are accepted only when null (clients echo ``refusal: null`` and the like)."""

    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"] = Field(
        description="'developer' (OpenAI's newer name for system instructions) is rendered as 'system'.")
    content: Union[str, list[dict[str, Any]], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None
    tool_call_id: Optional[str] = None


class ChatCompletionRequest(BaseModel):
    """The OpenAI Chat Completions request the proxy takes; any other field is a 400 naming it.

    ``logprobs=true`` returns ``choices[i].logprobs`` in the OpenAI shape (``token``,
    ``bytes``, ``logprob``, ``top_logprobs``); without it the field is null, as OpenAI
    does. Token IDs are always in ``prompt_token_ids`` and ``choices[i].token_ids``.
    ``user``, ``metadata`` and ``store`` are recorded on the span (every call is stored).
    """

    model_config = ConfigDict(extra="forbid")
    model: str = Field(min_length=1)
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = Field(None, ge=1, le=4096)
    max_completion_tokens: Optional[int] = Field(None, ge=1, le=4096)
    temperature: Optional[float] = Field(None, ge=0.0, le=5.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    n: Optional[int] = Field(None, ge=1, le=16)
    stream: Optional[bool] = False
    stream_options: Optional[dict[str, Any]] = None
    stop: Union[str, list[str], None] = None
    seed: Optional[int] = None
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: Optional[bool] = None
    response_format: Optional[dict[str, Any]] = None
    frequency_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    presence_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    user: Optional[str] = None
    metadata: Optional[dict[str, Any]] = None
    store: Optional[bool] = None
    return_token_ids: Optional[bool] = None


class _HTTPError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


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


def _register_free_model(engine: Engine) -> None:
    """Tell LiteLLM that a self-hosted model costs nothing, unless it already knows its price.

    Without an entry, LiteLLM searches its cost map by name variants on every call to price
    the reply (about 1 ms per call on a 2-core VM, measured with a canned upstream).
    """
    import litellm

    if engine.litellm_provider != "hosted_vllm":
        return
    key = engine.deployment()["litellm_params"]["model"]
    if key in litellm.model_cost:
        return
    litellm.register_model({key: {"input_cost_per_token": 0.0, "output_cost_per_token": 0.0,
                                  "cache_creation_input_token_cost": 0.0, "cache_read_input_token_cost": 0.0,
                                  "litellm_provider": "hosted_vllm", "mode": "chat"}})


class LLMProxy:
    """Serve ``engines`` behind one OpenAI-compatible endpoint and trace every call into ``store``.

    Args:
        engines: an :class:`~lightning_nb.engine.Engine` or several; requests are routed by
            ``model`` (several engines with one name take turns).
        store: where LLM-call spans go.
        host: bind address; 127.0.0.1 by default.
        port: 0 picks a free port.
        api_key: bearer token required on every request. Required (ConfigError
            otherwise) when ``host`` is not a loopback address.

    Use as a context manager or call :meth:`start` / :meth:`stop`. The proxy holds its
    engines from construction until :meth:`stop`; a stopped proxy only remembers them
    weakly, so it never keeps a closed engine's model (about 540 MB for the default one)
    in memory. See :meth:`start` for starting it again.

    Raises:
        ConfigError: ``engines`` is empty, or ``host`` is not loopback and ``api_key`` is missing.
    """

    def __init__(self, engines: Union[Engine, Sequence[Engine]], store: LightningStore, *, host: str = "127.0.0.1",
                 port: int = 0, api_key: Optional[str] = None, tracer: Optional[Tracer] = None) -> None:
        if not is_loopback(host) and not api_key:
            raise ConfigError(
                f"host={host!r} is reachable from other machines, so api_key is required; "
                f"pass api_key=secrets.token_urlsafe() (or bind to 127.0.0.1)"
            )
        held: list[Engine] = [engines] if isinstance(engines, Engine) else list(engines)
        if not held:
            raise ConfigError("engines is empty; pass at least one Engine (e.g. TransformersEngine.from_default())")
        self._engines: Optional[list[Engine]] = held  # None once stopped: then only the weak references below
        self._engine_refs = [weakref.ref(e) for e in held]
        self._model_names = [e.model_name for e in held]
        self.store = store
        self.host, self.port = host, port
        self.api_key = api_key
        self.tracer = tracer or Tracer(store)
        self._server: Any = None
        self._turn: dict[str, int] = {}
        self._lock = threading.Lock()

    # ----- lifecycle ------------------------------------------------------------------
    def start(self) -> "LLMProxy":
        """Start serving in a background thread; returns once the port is bound (a no-op while serving).

        A stopped proxy can be started again: it serves the same engines if they still exist
        (the caller kept a reference to them) and are not closed.

        Raises:
            LightningNbError: an engine is closed, or (after :meth:`stop`) was freed; the
                message names it and the fix (a new engine and a new ``LLMProxy(engine, store)``).
        """
        with self._lock:
            if self._server is not None:
                return self
            import litellm

            engines = self._engines if self._engines is not None else self._reclaim_engines()
            closed = [f"{type(e).__name__} {e.model_name!r}" for e in engines if e.closed]
            if closed:
                raise LightningNbError(f"cannot start the LLM proxy: {', '.join(closed)} is closed; build a new "
                                       "engine and serve it with a new LLMProxy(engine, store)")
            litellm.telemetry = False
            for engine in engines:
                _register_free_model(engine)
            server = ThreadedServer(_proxy_app(self), self.host, self.port, "LLM proxy")
            self.port = server.start()
            self._server, self._engines = server, engines
            return self

    def _reclaim_engines(self) -> list[Engine]:
        """The engines a stopped proxy served, while they still exist; raises LightningNbError once one was freed."""
        engines = [ref() for ref in self._engine_refs]
        freed = [name for name, e in zip(self._model_names, engines) if e is None]
        if freed:
            raise LightningNbError(
                f"cannot start the LLM proxy again: the engine(s) serving {freed} were freed after LLMProxy.stop() "
                "(a stopped proxy does not keep its engines alive); build a new LLMProxy(engine, store) with a "
                "live engine")
        return [e for e in engines if e is not None]

    def stop(self) -> None:
        """Stop serving and let go of the engines. Idempotent.

        Released: the HTTP server's thread and port (in-flight requests get up to 10 s to finish),
        and the proxy's references to its engines, so an engine nobody else holds is freed with
        its model and tokenizer. The engines keep running: close them yourself
        (``engine.close()``). :attr:`engines` lists those still alive elsewhere; :meth:`start`
        serves them again.
        """
        with self._lock:
            if self._server is not None:
                self._server.stop()
                self._server = None
            self._engines = None

    def __enter__(self) -> "LLMProxy":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def engines(self) -> list[Engine]:
        """The engines served, in the order given; after :meth:`stop`, only those still alive elsewhere."""
        held = self._engines
        if held is not None:
            return held
        return [e for e in (ref() for ref in self._engine_refs) if e is not None]

    @property
    def engine(self) -> Engine:
        """The first engine (whose model :meth:`as_resource` names).

        Raises:
            LightningNbError: the proxy was stopped and that engine freed since.
        """
        held = self._engines
        engine = held[0] if held is not None else self._engine_refs[0]()
        if engine is None:
            raise LightningNbError(f"the engine serving {self._model_names[0]!r} was freed after LLMProxy.stop(); "
                                   "build a new LLMProxy(engine, store)")
        return engine

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def served_models(self) -> list[str]:
        return sorted(set(self._model_names))

    def endpoint(self, rollout_id: Optional[str] = None, attempt_id: Optional[str] = None) -> str:
        """Base URL (ending in /v1) for the OpenAI SDK; attributed when ids are given."""
        if rollout_id and attempt_id:
            return f"{self.url}/rollout/{rollout_id}/attempt/{attempt_id}/v1"
        return f"{self.url}/v1"

    def as_resource(self, **sampling_parameters: Any) -> LLMResource:
        """This proxy as the ``main_llm`` resource agents receive (its model: the first engine's)."""
        return LLMResource(endpoint=self.endpoint(), model=self._model_names[0],
                           sampling_parameters=sampling_parameters, api_key=self.api_key or "not-needed")

    # ----- request checks -------------------------------------------------------------
    def _validate(self, body: Any) -> ChatCompletionRequest:
        if not isinstance(body, dict):
            raise _HTTPError(400, "request body must be a JSON object (an OpenAI chat completion request)")
        try:
            req = ChatCompletionRequest.model_validate(body)
        except ValidationError as exc:
            first = exc.errors()[0]
            field = ".".join(str(p) for p in first["loc"]) or "body"
            if first["type"] == "extra_forbidden":
                raise _HTTPError(400, f"unknown parameter '{field}': the proxy does not take it, and ignoring it "
                                      "would be silent; remove it (the README lists the supported parameters)", field)
            raise _HTTPError(400, f"invalid field '{field}': {first['msg']}", field) from None
        for i, m in enumerate(req.messages):
            for key, value in (m.model_extra or {}).items():
                if value is not None:
                    raise _HTTPError(400, f"unknown message field 'messages.{i}.{key}'; remove it", f"messages.{i}.{key}")
        return req

    def _engine_for(self, req: ChatCompletionRequest) -> Engine:
        """The engine serving ``req.model`` (taking turns), after checking it honours every parameter set."""
        serving = [e for e in self.engines if e.model_name == req.model]
        engine = None
        if serving:
            turn = self._turn.get(req.model, 0)
            self._turn[req.model] = turn + 1
            engine = serving[turn % len(serving)]
        if engine is None:
            raise _HTTPError(404, f"model {req.model!r} is not served by this proxy; served models: "
                                  f"{self.served_models}", "model")
        used = {
            "stop": bool(req.stop), "seed": req.seed is not None, "n": (req.n or 1) > 1,
            "response_format": bool(req.response_format) and req.response_format.get("type", "text") != "text",
            "frequency_penalty": bool(req.frequency_penalty), "presence_penalty": bool(req.presence_penalty),
            "top_logprobs": bool(req.top_logprobs),
        }
        for param in _OPTIONAL:
            if used[param] and param not in engine.supported_params:
                raise _HTTPError(400, f"invalid field '{param}': {type(engine).__name__} serving {req.model!r} does "
                                      f"not support it (it supports {sorted(engine.supported_params)}); remove it",
                                 param)
        if req.tool_choice is not None and not req.tools and req.tool_choice != "none":
            raise _HTTPError(400, "invalid field 'tool_choice': it needs 'tools'", "tool_choice")
        return engine

    async def _rollout_sampling(self, rollout_id: Optional[str], attempt_id: Optional[str]) -> dict[str, Any]:
        """The rollout's ``sampling_parameters`` (empty off a rollout URL); 404 for unknown ids."""
        if rollout_id is None:
            return {}
        def lookup() -> tuple[Any, set[str]]:
            return (self.store.get_rollout_by_id(rollout_id),
                    {a.attempt_id for a in self.store.query_attempts(rollout_id)})

        try:  # store calls may block (SQLite fsync, HTTP): off the event loop, in one hop
            rollout, attempts = await asyncio.to_thread(lookup)
        except NotFoundError as exc:
            raise _HTTPError(404, str(exc), "rollout_id") from None
        if attempt_id not in attempts:
            raise _HTTPError(404, f"attempt_id {attempt_id!r} is not an attempt of rollout {rollout_id!r}",
                             "attempt_id")
        return dict(rollout.metadata.get("sampling_parameters") or {})

    @staticmethod
    def _sampling(req: ChatCompletionRequest, enforced: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
        """The sampling actually applied: the rollout's parameters (``enforced``) over the request's.

        Framework clients never read ``llm.sampling_parameters``, so on a rollout's URL the
        proxy applies the rollout's ``temperature``, ``top_p``, ``seed`` and ``stop``
        (they replace the request's) and its ``max_tokens`` (a cap on the request's).
        Returns ``(applied, keys of enforced it does not apply)``.
        """
        requested_max = req.max_completion_tokens or req.max_tokens
        cap = enforced.get("max_tokens")
        applied: dict[str, Any] = {
            "max_tokens": min(int(requested_max or cap), int(cap)) if cap else (requested_max or 256),
            "temperature": float(enforced.get("temperature", 1.0 if req.temperature is None else req.temperature)),
            "top_p": float(enforced.get("top_p", 1.0 if req.top_p is None else req.top_p)),
        }
        stop = enforced.get("stop", req.stop)
        if stop:
            applied["stop"] = [stop] if isinstance(stop, str) else list(stop)
        seed = enforced.get("seed", req.seed)
        if seed is not None:
            applied["seed"] = int(seed)
        not_applied = sorted(set(enforced) - {"temperature", "top_p", "max_tokens", "stop", "seed"})
        return applied, not_applied

    # ----- completion -----------------------------------------------------------------
    async def _complete(self, req: ChatCompletionRequest, engine: Engine, rollout_id: Optional[str],
                        attempt_id: Optional[str], enforced: dict[str, Any], *,
                        agent_name: Optional[str] = None) -> dict[str, Any]:
        """Complete ``req`` on ``engine`` and record one span per choice; returns the OpenAI response dict.

        ``agent_name``: the request's ``X-Agent-Name`` header, recorded as ``gen_ai.agent.name``.
        """
        import litellm

        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        applied, not_applied = self._sampling(req, enforced)
        hermes = engine.tool_format == "hermes"
        tool_names = [t.get("function", {}).get("name") for t in req.tools or []]
        parse_tools = hermes and bool(req.tools) and req.tool_choice != "none"
        try:
            sent = render_tools(messages, req.tools, req.tool_choice or "auto") if hermes else messages
        except ConfigError as exc:
            raise _HTTPError(400, str(exc), "tools") from None
        kwargs: dict[str, Any] = {**engine.deployment()["litellm_params"], "messages": sent, **applied}
        if (req.n or 1) > 1:
            kwargs["n"] = req.n
        for key in ("response_format", "frequency_penalty", "presence_penalty", "top_logprobs"):
            if getattr(req, key):
                kwargs[key] = getattr(req, key)
        if not hermes:
            for key in ("tools", "tool_choice", "parallel_tool_calls"):
                if getattr(req, key) is not None:
                    kwargs[key] = getattr(req, key)
        if engine.returns_token_ids:
            kwargs["logprobs"] = True
            kwargs["extra_body"] = {"return_token_ids": True}
        elif req.logprobs:
            kwargs["logprobs"] = True
        version_before = engine.weight_version
        t0 = time.time_ns()
        try:
            response = await litellm.acompletion(**kwargs)
        except Exception as exc:  # LiteLLM maps the engine's HTTP errors to exceptions with status_code
            status = int(getattr(exc, "status_code", 502) or 502)
            message = str(getattr(exc, "message", exc))
            if rollout_id and attempt_id:
                span = self.tracer.start_span(LLM_SPAN_NAME, rollout_id, attempt_id,
                                              {"gen_ai.request.model": req.model, "error": message[:2000],
                                               **({AGENT_NAME: agent_name} if agent_name else {})})
                await asyncio.to_thread(span.end)
            if status in (400, 404, 422):
                raise _HTTPError(400, f"the engine refused the request: {message}") from None
            raise _HTTPError(502, f"engine error ({type(engine).__name__} at {engine.base_url}): {message}") from None
        served_by = engine
        raw = response.model_dump()
        prompt_ids = raw.get("prompt_token_ids")
        version = raw.get("weight_version", version_before)
        choices = []
        for c in raw["choices"]:
            extra = c.get("provider_specific_fields") or {}
            token_ids = c.get("token_ids") or extra.get("token_ids")
            content = c["message"].get("content") or ""
            calls = list(c["message"].get("tool_calls") or [])
            text = content
            if parse_tools:
                parsed, calls = parse_tool_calls(content, tool_names)
                if req.parallel_tool_calls is False:
                    calls = calls[:1]
                content = parsed if calls else content
            lp_block = c.get("logprobs") or {}
            choices.append({"index": c["index"], "text": text, "content": content if content or not calls else None,
                            "tool_calls": calls, "token_ids": token_ids,
                            # a reply cut at max_tokens stays "length" (OpenAI's rule), also when a call parsed
                            # before the cut: DAPO's overlong filter and the truncation counts read it
                            "finish_reason": ("tool_calls" if calls and c.get("finish_reason") != "length"
                                              else c.get("finish_reason")),
                            "logprobs_block": lp_block if lp_block.get("content") else None})
        usage = raw.get("usage") or {}
        if rollout_id and attempt_id:
            await self._record(req, messages, applied, not_applied, served_by, raw.get("id"), prompt_ids, choices,
                               version, served_by.weight_version, rollout_id, attempt_id, t0, agent_name)
        out_choices = []
        for ch in choices:
            message: dict[str, Any] = {"role": "assistant", "content": ch["content"]}
            if ch["tool_calls"]:
                message["tool_calls"] = ch["tool_calls"]
            out_choices.append({"index": ch["index"], "message": message, "finish_reason": ch["finish_reason"],
                                "logprobs": ch["logprobs_block"] if req.logprobs else None,
                                "token_ids": ch["token_ids"], "_pieces": (ch["logprobs_block"] or {}).get("content")})
        return {"id": raw.get("id") or f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
                "created": raw.get("created") or int(time.time()), "model": req.model, "choices": out_choices,
                "usage": {k: usage.get(k) for k in ("prompt_tokens", "completion_tokens", "total_tokens")},
                "prompt_token_ids": prompt_ids, "weight_version": version}

    async def _record(self, req: ChatCompletionRequest, messages: list[dict[str, Any]], applied: dict[str, Any],
                      not_applied: list[str], engine: Engine, response_id: Optional[str],
                      prompt_ids: Optional[list[int]], choices: list[dict[str, Any]], version: int, version_after: int,
                      rollout_id: str, attempt_id: str, t0: int, agent_name: Optional[str] = None) -> None:
        """One span per choice: what was requested, what was applied, and what was sampled.

        The request's ``X-Agent-Name`` header (``agent_name``; header names are case-insensitive) is
        recorded as ``gen_ai.agent.name``, which :class:`~lightning_nb.adapter.TripletAdapter`'s
        ``agent_match`` selects on. Agents set it per client, ``OpenAI(default_headers={"X-Agent-Name":
        "solver"})``, or per call, ``extra_headers={"X-Agent-Name": "solver"}``.
        """
        requested = {
            "gen_ai.system": "lightning_nb", "gen_ai.request.model": req.model,
            **({AGENT_NAME: agent_name} if agent_name else {}),
            **{f"gen_ai.request.{k}": v for k, v in (("temperature", req.temperature), ("top_p", req.top_p),
                                                       ("max_tokens", req.max_completion_tokens or req.max_tokens),
                                                       ("seed", req.seed)) if v is not None},
            **({"gen_ai.request.stop_sequences": [req.stop] if isinstance(req.stop, str) else req.stop}
               if req.stop else {}),
            **({"gen_ai.request.tools": json.dumps(req.tools)} if req.tools else {}),
            **({"gen_ai.request.tool_choice": json.dumps(req.tool_choice)} if req.tool_choice is not None else {}),
            **({"gen_ai.request.user": req.user} if req.user else {}),
            **({"gen_ai.request.metadata": json.dumps(req.metadata)} if req.metadata else {}),
            "gen_ai.prompt": json.dumps(messages),
            "engine": type(engine).__name__,
            **{k: v for k, v in applied.items() if k != "stop"},
            **({"stop": applied["stop"]} if "stop" in applied else {}),
            **({"lightning_nb.sampling_not_applied": not_applied} if not_applied else {}),
            **({"lightning_nb.weights_changed_during_call": [version, version_after]}
               if version_after != version else {}),
        }
        spans = []
        for ch in choices:
            span = self.tracer.start_span(LLM_SPAN_NAME, rollout_id, attempt_id, requested, start_time=t0)
            attrs: dict[str, Any] = {
                "gen_ai.response.id": response_id or "", "choice_index": ch["index"], "n": len(choices),
                "gen_ai.response.finish_reasons": [ch["finish_reason"]], "gen_ai.completion": ch["text"],
                "weight_version": version,
            }
            if ch["tool_calls"]:
                attrs["gen_ai.response.tool_calls"] = json.dumps(ch["tool_calls"])
            lps = [e["logprob"] for e in (ch["logprobs_block"] or {}).get("content") or []]
            if prompt_ids and ch["token_ids"]:
                attrs.update({"prompt_token_ids": prompt_ids, "completion_token_ids": ch["token_ids"],
                              "gen_ai.usage.input_tokens": len(prompt_ids),
                              "gen_ai.usage.output_tokens": len(ch["token_ids"])})
                if len(lps) == len(ch["token_ids"]):
                    attrs["logprobs"] = lps
            else:
                attrs[TOKEN_IDS_MISSING] = (f"{type(engine).__name__} at {engine.base_url} returned no token IDs"
                                            if not engine.returns_token_ids else "the engine's reply lacked token IDs")
            span.set_attributes(attrs)
            spans.append(span)

        def end_all() -> None:
            for span in spans:
                span.end()

        await asyncio.to_thread(end_all)  # ending a span writes it to the store: off the event loop


def _error(status: int, message: str, param: Optional[str] = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status)


def _proxy_app(proxy: LLMProxy) -> Any:
    """The proxy's ASGI app. Its routes are module-level functions that find the proxy in
    ``request.app.state.proxy``: FastAPI keeps every route function it has seen in process-wide
    caches (``fastapi.dependencies.models``, up to 4096 each), so a route closing over the proxy
    would keep it, and through it the engines and the store, alive after :meth:`LLMProxy.stop`.
    Only the app (dropped at stop) holds the proxy."""
    app = FastAPI(title="lightning-nb LLM proxy")
    app.state.proxy = proxy
    if proxy.api_key:
        app.add_middleware(_BearerAuth, token=proxy.api_key)
    app.get("/health")(_health)
    for prefix in ("", "/rollout/{rollout_id}/attempt/{attempt_id}"):
        app.get(f"{prefix}/v1/models")(_models)
        app.post(f"{prefix}/v1/responses")(_responses_api)
    app.post("/v1/chat/completions")(_chat)
    app.post("/rollout/{rollout_id}/attempt/{attempt_id}/v1/chat/completions")(_chat_attributed)
    return app


async def _health(request: Request) -> dict:
    proxy: LLMProxy = request.app.state.proxy
    engines = proxy.engines
    return {"status": "ok", "models": proxy.served_models,
            "weight_versions": {e.model_name: e.weight_version for e in engines},
            "weight_version": engines[0].weight_version if engines else None}


async def _models(request: Request) -> dict:
    return {"object": "list", "data": [{"id": m, "object": "model", "owned_by": "lightning-nb"}
                                       for m in request.app.state.proxy.served_models]}


def _responses_api() -> JSONResponse:
    return _error(404, "the Responses API (/v1/responses) is not served; use Chat Completions. With the "
                       "OpenAI Agents SDK: agents.set_default_openai_api('chat_completions'), or "
                       "model=OpenAIChatCompletionsModel(model=llm.model, openai_client=AsyncOpenAI("
                       "base_url=llm.endpoint, api_key=llm.api_key))")


async def _chat(request: Request) -> Any:
    return await _handle(request, None, None)


async def _chat_attributed(rollout_id: str, attempt_id: str, request: Request) -> Any:
    return await _handle(request, rollout_id, attempt_id)


async def _handle(request: Request, rollout_id: Optional[str], attempt_id: Optional[str]) -> Any:
    """One chat completion request: validated, routed, completed, recorded; errors in the OpenAI shape."""
    proxy: LLMProxy = request.app.state.proxy
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return _error(400, "request body is not valid JSON; send a JSON chat completion request")
    try:
        req = proxy._validate(body)
        engine = proxy._engine_for(req)
        enforced = await proxy._rollout_sampling(rollout_id, attempt_id)
        completion = await proxy._complete(req, engine, rollout_id, attempt_id, enforced,
                                           agent_name=request.headers.get(AGENT_NAME_HEADER))
    except _HTTPError as exc:
        return _error(exc.status, exc.message, exc.param)
    if req.stream:
        return StreamingResponse(_sse(completion, req), media_type="text/event-stream")
    for c in completion["choices"]:
        del c["_pieces"]
    # already JSON-safe: skip FastAPI's jsonable_encoder walk over every token ID
    return Response(json.dumps(completion), media_type="application/json")


async def _sse(completion: dict[str, Any], req: ChatCompletionRequest) -> Any:
    """A finished completion as OpenAI ``chat.completion.chunk`` server-sent events.

    Content comes in one chunk per token where the log-probs' token strings add up to
    the content, else in one chunk; tool calls in one chunk each; then the finish
    reason (with ``token_ids``), a usage chunk when ``stream_options.include_usage``,
    and ``[DONE]``.
    """
    base = {"id": completion["id"], "object": "chat.completion.chunk", "created": completion["created"],
            "model": completion["model"]}

    def event(choices: list[dict[str, Any]], **extra: Any) -> str:
        return f"data: {json.dumps({**base, 'choices': choices, **extra})}\n\n"

    yield event([{"index": c["index"], "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                 for c in completion["choices"]], prompt_token_ids=completion["prompt_token_ids"])
    for c in completion["choices"]:
        i, content = c["index"], c["message"]["content"]
        if content:
            entries = c.pop("_pieces") or []
            pieces, joined = [], ""
            for e in entries:  # token pieces up to the content's end (the stop token is not content)
                if joined == content:
                    break
                pieces.append(e["token"])
                joined += e["token"]
            if joined != content:
                pieces, entries = [content], []
            for k, piece in enumerate(pieces):
                if piece:
                    lp = {"content": [entries[k]]} if entries and c["logprobs"] else None
                    yield event([{"index": i, "delta": {"content": piece}, "logprobs": lp, "finish_reason": None}])
        else:
            c.pop("_pieces", None)
        for k, call in enumerate(c["message"].get("tool_calls") or []):
            yield event([{"index": i, "delta": {"tool_calls": [{"index": k, **call}]}, "finish_reason": None}])
        yield event([{"index": i, "delta": {}, "finish_reason": c["finish_reason"], "token_ids": c["token_ids"]}])
    if (req.stream_options or {}).get("include_usage"):
        yield event([], usage=completion["usage"])
    yield "data: [DONE]\n\n"
