"""LLM proxy: an OpenAI-compatible Chat Completions API on 127.0.0.1, routed by LiteLLM to the engines.

Agents call ``{proxy}/rollout/{rollout_id}/attempt/{attempt_id}/v1`` (the runner
hands them that base URL as their :class:`~lightning_nb.types.LLMResource`), so
every call is attributed to its attempt. The proxy routes each request by its
``model`` to an :class:`~lightning_nb.engines.Engine` (round-robin among engines serving
one name)
(every engine serves an OpenAI-compatible endpoint and returns token IDs the way
vLLM's ``return_token_ids`` does) with LiteLLM's ``hosted_vllm`` provider (or the
engine's own provider), and records one span per choice with the
request, the reply, the prompt and completion token IDs, the log-probs and the
weight version they were sampled from (:mod:`lightning_nb.proxy.spans`; the keys are
:mod:`lightning_nb.semconv`'s). Token IDs also travel back to the client in
fields OpenAI clients ignore: ``prompt_token_ids`` and ``choices[i].token_ids``.

What the proxy adds to the engines: tool calls for models that write them as text
(:mod:`lightning_nb.engines.chat_format`), streaming (``stream=true`` is answered as
server-sent events from the finished completion, recorded as one span like any
other call), a 400 naming any parameter that is unknown or that the serving engine
does not honour, a 404 naming the served models (:mod:`lightning_nb.proxy.request`), and,
on a rollout's URL, the rollout's sampling parameters
(:func:`~lightning_nb.proxy.request.applied_sampling`).

This module holds :class:`LLMProxy`: its lifecycle, routing and one completion. The request
model and checks are in :mod:`lightning_nb.proxy.request`, the reply in
:mod:`lightning_nb.proxy.response`, the spans in :mod:`lightning_nb.proxy.spans`, and the HTTP
app in :mod:`lightning_nb.proxy.app`.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
import weakref
from collections import OrderedDict
from typing import Any, Optional, Sequence, Union

from lightning_nb._net import ThreadedServer, is_loopback
from lightning_nb.engines import Engine
from lightning_nb import semconv
from lightning_nb.engines.chat_format import count_sampled_turns, native_prompt_ids, render_tools, sampled_turn_key
from lightning_nb.errors import ConfigError, LightningNbError, NotFoundError
from lightning_nb.proxy.app import ROLLOUT_ID_HEADER, proxy_app
from lightning_nb.proxy.request import (ChatCompletionRequest, ProxyHTTPError, applied_sampling, check_attempt_open,
                                        check_body_rollout_id, check_supported, validate_request)
from lightning_nb.proxy.replay import ReplayPlan, ReplayServing
from lightning_nb.proxy.response import Choice, dropped_before_reply, openai_response, parse_choices
from lightning_nb.proxy.spans import choice_attributes, record_call, record_error, requested_attributes
from lightning_nb.proxy.splice import (ServedCall, can_submit_tokens, generations_response, remember,
                                       splice_previous_reply, submit_kwargs)
from lightning_nb.store.base import LightningStore
from lightning_nb.tracing.tracer import Tracer
from lightning_nb.types import REPLAY_KEY, SAMPLING_PARAMETERS_KEY, TRAFFIC_KEY, LLMResource

__all__ = ["LLMProxy", "ChatCompletionRequest", "TRAFFIC_KEY", "ROLLOUT_ID_HEADER"]

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # never fetch the cost map at import

#: Samples the proxy draws at most per choice to honour ``tool_choice="required"`` or a named tool.
TOOL_CHOICE_TRIES = 4


def _named_tool(tool_choice: Any) -> Optional[str]:
    """The tool a ``{"type": "function", "function": {"name": ...}}`` tool_choice names, else None."""
    if isinstance(tool_choice, dict):
        return (tool_choice.get("function") or {}).get("name")
    return None


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


class LLMProxy(ReplayServing):
    """Serve ``engines`` behind one OpenAI-compatible endpoint and trace every call into ``store``.

    Args:
        engines: an :class:`~lightning_nb.engines.Engine` or several; requests are routed by
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
        # the text of each tool-calling reply served, by its tool-call ids: an echoed assistant turn is
        # rendered as sampled (lightning_nb.engines.chat_format.render_tools); and per attempt the previous
        # call's prompt + completion length, which a rollout server's response_mask is checked against
        self._sampled: "OrderedDict[str, str]" = OrderedDict()
        self._served: "OrderedDict[tuple[str, str], ServedCall]" = OrderedDict()
        # attempts that replay another's record (rollout metadata REPLAY_KEY): their plan, and calls served so far
        self._replays: "OrderedDict[tuple[str, str], ReplayPlan]" = OrderedDict()
        self._calls_seen: "OrderedDict[tuple[str, str], int]" = OrderedDict()

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
            server = ThreadedServer(proxy_app(self), self.host, self.port, "LLM proxy")
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

    def traffic_endpoint(self) -> str:
        """Base URL (ending in /v1) of the opt-in traffic route: every chat completion sent there becomes a one-call
        rollout for learning from traffic, its id in the ``X-Rollout-Id`` response header (:meth:`serve_traffic`).
        The plain :meth:`endpoint` records nothing."""
        return f"{self.url}/traffic/v1"

    def as_resource(self, **sampling_parameters: Any) -> LLMResource:
        """This proxy as the ``main_llm`` resource agents receive (its model: the first engine's)."""
        return LLMResource(endpoint=self.endpoint(), model=self._model_names[0],
                           sampling_parameters=sampling_parameters, api_key=self.api_key or "not-needed")

    # ----- one request ------------------------------------------------------------------
    async def serve_chat(self, body: Any, rollout_id: Optional[str], attempt_id: Optional[str], *,
                         agent_name: Optional[str] = None) -> tuple[ChatCompletionRequest, dict[str, Any]]:
        """Serve one chat completion request body as the HTTP route does: validated, routed, completed and,
        with ``rollout_id`` and ``attempt_id``, recorded.

        Returns:
            The validated request and the completion
            (:func:`~lightning_nb.proxy.response.openai_response`'s dict, ``_pieces`` included).

        Raises:
            ProxyHTTPError: what the route answers instead: 400 (invalid or unsupported request, a body
                ``rollout_id`` that is not the URL's, a wrong ``response_mask``), 404 (unknown model, rollout or
                attempt), 409 (the attempt already ended: nothing is recorded), 502 (the engine failed).
        """
        req = validate_request(body)
        if req.response_mask is not None and not (rollout_id and attempt_id):
            raise ProxyHTTPError(400, "response_mask is checked against an attempt's earlier calls, so it needs an "
                                      "attempt's URL ({proxy}/rollout/{rollout_id}/attempt/{attempt_id}/v1); "
                                      "call that one, or drop response_mask", "response_mask")
        check_body_rollout_id(req, rollout_id)
        engine = self._engine_for(req)
        enforced, replay = await self._rollout_sampling(rollout_id, attempt_id)
        if replay is not None and rollout_id and attempt_id:
            key = (rollout_id, attempt_id)
            call = self._calls_seen.get(key, 0) + 1  # counted before any await: the attempt's calls in arrival order
            remember(self._calls_seen, key, call)
            plan = await self._replay_plan(key, replay)
            if call <= plan.replay or plan.exact:
                completion = await self._replayed(req, engine, key, plan, call, enforced, agent_name)
                return req, completion
            enforced = {**enforced, **plan.sampling}  # a branch's own sampling, from call k + 1
        completion = await self._complete(req, engine, rollout_id, attempt_id, enforced, agent_name=agent_name)
        return req, completion

    async def serve_traffic(self, body: Any, *, agent_name: Optional[str] = None
                            ) -> tuple[str, ChatCompletionRequest, dict[str, Any]]:
        """Serve one request of the ``/traffic`` route: a one-call rollout per request, for learning from traffic.

        The request is checked first (nothing is stored for a 400/404). Then the store gets a rollout
        (``store.start_rollout``: input the request's messages, ``metadata={TRAFFIC_KEY: "proxy"}``), the call is
        completed and recorded on its attempt exactly as on an attempt's URL (with the request's own sampling),
        and the attempt ends ``succeeded`` with no reward: the rollout is unlabelled until
        ``store.label(rollout_id, reward)`` (or a judge) gives it one. An engine error ends it ``failed``.

        Returns:
            ``(rollout_id, request, completion)``, as :meth:`serve_chat` plus the rollout id.

        Raises:
            ProxyHTTPError: as :meth:`serve_chat`; also 400 for ``n`` > 1 (one rollout records one reply).
        """
        req = validate_request(body)
        if req.response_mask is not None:
            raise ProxyHTTPError(400, "response_mask is checked against an attempt's earlier calls; a /traffic request "
                                      "starts a new rollout, so it has none: drop response_mask", "response_mask")
        check_body_rollout_id(req, None)
        if (req.n or 1) > 1:
            raise ProxyHTTPError(400, f"n={req.n}: a /traffic request records one reply as one rollout, so a label "
                                      "rewards one reply; send n=1 (or several requests)", "n")
        engine = self._engine_for(req)
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        item = await asyncio.to_thread(self.store.start_rollout, messages, metadata={TRAFFIC_KEY: "proxy"},
                                       worker_id=None)
        rid, aid = item.rollout.rollout_id, item.attempt.attempt_id
        try:
            completion = await self._complete(req, engine, rid, aid, {}, agent_name=agent_name)
        except BaseException as exc:
            await asyncio.to_thread(self.store.update_attempt, rid, aid, status="failed",
                                    error=f"{type(exc).__name__}: {exc}")
            raise
        await asyncio.to_thread(self.store.update_attempt, rid, aid, status="succeeded")
        return rid, req, completion

    def _engine_for(self, req: ChatCompletionRequest) -> Engine:
        """The engine serving ``req.model`` (taking turns), after checking it honours every parameter set."""
        serving = [e for e in self.engines if e.model_name == req.model]
        engine = None
        if serving:
            turn = self._turn.get(req.model, 0)
            self._turn[req.model] = turn + 1
            engine = serving[turn % len(serving)]
        if engine is None:
            raise ProxyHTTPError(404, f"model {req.model!r} is not served by this proxy; served models: "
                                      f"{self.served_models}", "model")
        check_supported(req, engine)
        return engine

    async def _rollout_sampling(self, rollout_id: Optional[str], attempt_id: Optional[str]
                                ) -> tuple[dict[str, Any], Optional[dict[str, Any]]]:
        """The rollout's ``sampling_parameters`` (empty off a rollout URL) and its replay record (metadata
        :data:`~lightning_nb.types.REPLAY_KEY`, None without one); 404 for unknown ids, 409 for an attempt
        that already ended (:func:`_check_open`)."""
        if rollout_id is None:
            return {}, None
        def lookup() -> tuple[Any, list[Any]]:
            return self.store.get_rollout_by_id(rollout_id), self.store.query_attempts(rollout_id)

        try:  # store calls may block (SQLite fsync, HTTP): off the event loop, in one hop
            rollout, attempts = await asyncio.to_thread(lookup)
        except NotFoundError as exc:
            raise ProxyHTTPError(404, str(exc), "rollout_id") from None
        check_attempt_open(attempts, rollout_id, attempt_id)
        return dict(rollout.metadata.get(SAMPLING_PARAMETERS_KEY) or {}), rollout.metadata.get(REPLAY_KEY)

    async def _check_still_open(self, rollout_id: str, attempt_id: str) -> None:
        """409 when the attempt ended while its call was being served: the call is then not recorded."""
        check_attempt_open(await asyncio.to_thread(self.store.query_attempts, rollout_id), rollout_id, attempt_id)

    # ----- completion -----------------------------------------------------------------
    async def _complete(self, req: ChatCompletionRequest, engine: Engine, rollout_id: Optional[str],
                        attempt_id: Optional[str], enforced: dict[str, Any], *,
                        agent_name: Optional[str] = None) -> dict[str, Any]:
        """Complete ``req`` on ``engine`` and record one span per choice; returns the OpenAI response dict.

        ``agent_name``: the request's ``X-Agent-Name`` header, recorded as ``gen_ai.agent.name``.
        """
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        applied, not_applied = applied_sampling(req, enforced)
        hermes = engine.tool_format == "hermes"
        kwargs = _litellm_kwargs(req, engine, messages, applied, hermes, self._sampled if hermes else None)
        t0 = time.time_ns()
        attempt = (rollout_id, attempt_id) if rollout_id and attempt_id else None
        rendered: Optional[list[int]] = None  # the chat template's render, when the proxy rendered it itself
        if attempt and hermes and attempt in self._served and can_submit_tokens(engine, kwargs):
            rendered = await asyncio.to_thread(engine.apply_chat_template, kwargs["messages"])
            kwargs["prompt_ids"] = splice_previous_reply(rendered, self._served[attempt], engine.tokenizer,
                                                         engine.stop_token_ids)
        before = engine.weight_version  # a reply without its own version was admitted under this one
        raw, choices, resampled = await self._sample_choices(req, engine, kwargs, hermes, attempt, agent_name)
        prompt_ids = raw.get("prompt_token_ids")
        version = raw.get("weight_version", before)
        for ch in choices:
            if ch.tool_calls:
                remember(self._sampled, sampled_turn_key(ch.tool_calls), ch.text)
        if attempt:
            await self._check_still_open(*attempt)  # ended while served (the rollout server answered): not recorded
            await self._check_response_mask(req, engine, prompt_ids, rendered, attempt, agent_name)
            if prompt_ids is not None and choices and choices[0].token_ids is not None:
                remember(self._served, attempt, ServedCall(tuple(prompt_ids), tuple(choices[0].token_ids),
                                                           choices[0].text, tuple(rendered or prompt_ids),
                                                           cut=choices[0].finish_reason == "length",
                                                           n_messages=len(req.messages)))
            requested = requested_attributes(req, messages, applied, not_applied, engine, version,
                                             engine.weight_version, agent_name)
            if hermes and req.tools:
                as_sampled, rewritten = count_sampled_turns(messages, self._sampled)
                requested.update({semconv.ASSISTANT_TURNS_AS_SAMPLED: as_sampled,
                                  semconv.ASSISTANT_TURNS_REWRITTEN: rewritten})
            per_choice = [choice_attributes(ch, len(choices), raw.get("id"), prompt_ids, version, engine)
                          for ch in choices]
            for attrs, n in zip(per_choice, resampled):
                if n:
                    attrs[semconv.TOOL_CHOICE_RESAMPLED] = n
            if kwargs.get("prompt_ids"):
                requested[semconv.PROMPT_SPLICED] = True
            await record_call(self.tracer, rollout_id, attempt_id, t0, requested, per_choice)
        return openai_response(req, raw, choices, prompt_ids, version)

    async def _sample_choices(self, req: ChatCompletionRequest, engine: Engine, kwargs: dict[str, Any], hermes: bool,
                              attempt: Optional[tuple[str, str]],
                              agent_name: Optional[str]) -> tuple[dict[str, Any], list[Choice], list[int]]:
        """Sample ``req``'s choices; with ``tool_choice`` "required" or a named tool, resample each choice without a
        call of it (up to :data:`TOOL_CHOICE_TRIES` samples in all, at temperature > 0 without a seed).

        Returns:
            ``(raw, choices, resampled)``: the engine's first response (LiteLLM's ``model_dump()``), the
            choices (:class:`~lightning_nb.proxy.response.Choice`), and per choice how many replies without
            a call were dropped before it.

        Raises:
            ProxyHTTPError: the engine failed (:meth:`_engine_error`), or a choice still has no call of the
                required tool: a 400 naming ``tool_choice`` (recorded as an error span on an attempt's URL).
        """
        parse_tools = hermes and bool(req.tools) and req.tool_choice != "none"
        tool_names = [t.get("function", {}).get("name") for t in req.tools or []]
        wanted = _named_tool(req.tool_choice)
        if wanted and parse_tools:
            tool_names = [wanted]
        raw = await self._call_engine(kwargs, req, engine, attempt, agent_name)
        choices = parse_choices(raw["choices"], tool_names if parse_tools else None, req.parallel_tool_calls)
        resampled = [0] * len(choices)
        if not (parse_tools and (req.tool_choice == "required" or wanted)):
            return raw, choices, resampled
        can_resample = kwargs.get("temperature", 1.0) > 0 and "seed" not in kwargs
        for _ in range(TOOL_CHOICE_TRIES - 1 if can_resample else 0):
            missing = [i for i, ch in enumerate(choices) if not ch.tool_calls]
            if not missing:
                break
            more_raw = await self._call_engine({**kwargs, "n": len(missing)} if len(missing) > 1 else
                                               {k: v for k, v in kwargs.items() if k != "n"},
                                               req, engine, attempt, agent_name)
            more = parse_choices(more_raw["choices"], tool_names, req.parallel_tool_calls)
            for i, ch in zip(missing, more):
                ch.index = choices[i].index
                choices[i] = ch
                resampled[i] += 1
        failed = [ch for ch in choices if not ch.tool_calls]
        if failed:
            what = f"call of {wanted!r}" if wanted else "tool call"
            how = (f"in {TOOL_CHOICE_TRIES} samples" if can_resample else
                   "and the proxy resamples only at temperature > 0 without a seed")
            message = (f"tool_choice={json.dumps(req.tool_choice)}: the model wrote no parseable {what} {how} "
                       f"(its reply began {failed[0].text[:120]!r}); use tool_choice='auto', or a model that "
                       "follows tool instructions")
            if attempt:
                await record_error(self.tracer, attempt[0], attempt[1], req.model, message, agent_name)
            raise ProxyHTTPError(400, message, "tool_choice")
        return raw, choices, resampled

    async def _call_engine(self, kwargs: dict[str, Any], req: ChatCompletionRequest, engine: Engine,
                           attempt: Optional[tuple[str, str]], agent_name: Optional[str]) -> dict[str, Any]:
        """One ``litellm.acompletion`` call (or, with ``kwargs["prompt_ids"]``, ``n`` token-level
        :meth:`Engine.submit` calls): the response as a dict, or the ProxyHTTPError to answer. A call the engine's
        server dropped without a reply (a stale keep-alive connection, :func:`dropped_before_reply`) is sent once
        more."""
        import litellm

        prompt_ids = kwargs.get("prompt_ids")
        try:
            if prompt_ids:
                sampling = submit_kwargs(kwargs)
                seed = sampling.pop("seed", None)
                futures = [engine.submit(prompt_ids, **sampling, seed=None if seed is None else seed + i)
                           for i in range(kwargs.get("n", 1))]
                gens = await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
                return generations_response(gens, engine.tokenizer, req.model)
            call = {k: v for k, v in kwargs.items() if k != "prompt_ids"}
            try:
                response = await litellm.acompletion(**call)
            except Exception as exc:
                if not dropped_before_reply(exc):
                    raise
                response = await litellm.acompletion(**call)  # once more, on a new connection
        except Exception as exc:  # LiteLLM maps the engine's HTTP errors to exceptions with status_code
            rollout_id, attempt_id = attempt or (None, None)
            raise await self._engine_error(exc, req, engine, rollout_id, attempt_id, agent_name) from None
        return response.model_dump()

    async def _check_response_mask(self, req: ChatCompletionRequest, engine: Engine, prompt_ids: Optional[list[int]],
                                   rendered: Optional[list[int]], attempt: tuple[str, str],
                                   agent_name: Optional[str]) -> None:
        """Check a rollout server's ``response_mask`` (reference doc 002) against the tokens of this call.

        Every entry must be 0: the mask covers the prompt tokens added since the attempt's previous call (tool
        results, chat markup), none of which the model sampled, so a 1 would ask to train on tokens that are not
        the policy's (the proxy's own spans say which tokens were sampled). Its length must be the number of
        those tokens, counted one of three ways: on the tokens served (``prompt_ids``, the earlier replies as
        sampled); on the chat template's render with the tools as the Hermes-format engine shows them
        (``rendered``, less the previous render and completion; differs from the first only after a splice,
        :mod:`lightning_nb.proxy.splice`); or as doc 002's ``RolloutSession`` counts, on the messages and
        ``tools`` the server sent, rendered by the model's own chat template
        (:func:`~lightning_nb.engines.chat_format.native_prompt_ids`; the previous call's messages are the
        first ones of this call's). A wrong one is recorded as an error span and answered with a 400 naming
        ``response_mask`` (a 1: its position).
        """
        mask = req.response_mask
        if mask is None or prompt_ids is None:
            return
        prev = self._served.get(attempt)
        served_before = prev.length if prev is not None else 0
        message = None
        if 1 in mask:
            i = mask.index(1)
            message = (f"response_mask[{i}] is 1, but the {len(mask)} tokens it covers were added to the prompt since "
                       "the previous call (tool results, chat markup) and none was sampled by the model, so none "
                       "can be trained on; send 0 for each (reference doc 002). The proxy marks the sampled "
                       "tokens itself")
        elif len(mask) not in self._added_counts(req, engine, prompt_ids, rendered, prev, len(mask)):
            message = (f"response_mask has {len(mask)} entries, but this prompt adds {len(prompt_ids) - served_before} "
                       f"tokens to the previous call's {served_before} prompt and completion tokens "
                       f"({len(prompt_ids)} prompt tokens now); send one 0 per token added since the previous call "
                       "(reference doc 002), or none on the first call")
        if message is not None:
            await record_error(self.tracer, attempt[0], attempt[1], req.model, message, agent_name)
            raise ProxyHTTPError(400, message, "response_mask")

    @staticmethod
    def _added_counts(req: ChatCompletionRequest, engine: Engine, prompt_ids: list[int], rendered: Optional[list[int]],
                      prev: Optional[ServedCall], wanted: int) -> set[int]:
        """The prompt tokens this call adds to the previous one, counted the ways :meth:`_check_response_mask`
        accepts; the model's own template is rendered only when the other counts miss ``wanted``."""
        served_before = prev.length if prev is not None else 0
        rendered_before = len(prev.rendered_ids) + len(prev.completion_ids) if prev is not None else 0
        counts = {len(prompt_ids) - served_before, len(rendered or prompt_ids) - rendered_before}
        tokenizer = getattr(engine, "tokenizer", None)
        if wanted in counts or prev is None or not prev.n_messages or tokenizer is None:
            return counts
        sent = [m.model_dump(exclude_unset=True) for m in req.messages]  # as the server sent them
        try:
            now = len(native_prompt_ids(tokenizer, sent, req.tools))
            before = len(native_prompt_ids(tokenizer, sent[:prev.n_messages], req.tools))
        except Exception:  # a template that cannot render these messages: no such count
            return counts
        return counts | {now - before - len(prev.completion_ids)}

    async def _engine_error(self, exc: Exception, req: ChatCompletionRequest, engine: Engine,
                            rollout_id: Optional[str], attempt_id: Optional[str],
                            agent_name: Optional[str]) -> ProxyHTTPError:
        """The error to answer for a failed engine call (recorded as a span on a rollout's URL): a 400 when the
        engine refused the request (400, 404, 422), else a 502 naming the engine."""
        status = int(getattr(exc, "status_code", 502) or 502)
        message = str(getattr(exc, "message", exc))
        if rollout_id and attempt_id:
            await record_error(self.tracer, rollout_id, attempt_id, req.model, message, agent_name)
        if status in (400, 404, 422):
            return ProxyHTTPError(400, f"the engine refused the request: {message}")
        return ProxyHTTPError(502, f"engine error ({type(engine).__name__} at {engine.base_url}): {message}")


def _litellm_kwargs(req: ChatCompletionRequest, engine: Engine, messages: list[dict[str, Any]],
                    applied: dict[str, Any], hermes: bool, sampled: Optional[Any] = None) -> dict[str, Any]:
    """The ``litellm.acompletion`` arguments for ``req`` on ``engine`` with the ``applied`` sampling.

    With a Hermes-format engine, the tools are rendered into the messages instead of passed on, and earlier
    tool-calling assistant turns as ``sampled`` holds them (see :func:`~lightning_nb.engines.chat_format.render_tools`).

    Raises:
        ProxyHTTPError: 400 on ``tools`` the chat format cannot render.
    """
    try:
        sent = render_tools(messages, req.tools, req.tool_choice or "auto", sampled) if hermes else messages
    except ConfigError as exc:
        raise ProxyHTTPError(400, str(exc), "tools") from None
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
    return kwargs
