"""The trainer side of the remote rollout protocol (reference doc 002): an agent whose loop runs in another service.

:class:`RemoteRolloutAgent` is an agent like any other, ``agent(task, llm) -> reward``, so
:func:`~lightning_nb.runners.start_runners` runs it on threads or Ray actors unchanged. For each rollout it
POSTs ``/rollout`` (:class:`~lightning_nb.agents.protocol.RolloutRequest`) to a rollout server and waits for
the :class:`~lightning_nb.agents.protocol.RolloutResponse`. The rollout server calls the model back at
``server_url``: the runner's ``llm.endpoint`` without its ``/v1``, i.e. the kit's LLM proxy at
``/rollout/{rollout_id}/attempt/{attempt_id}``, so every LLM call lands on the attempt as an LLM span with its
token IDs, and the proxy checks each call's ``response_mask`` against the tokens it sees itself. The
:class:`~lightning_nb.adapter.TripletAdapter` and the trainers then see an ordinary multi-turn episode.

Cost per rollout over a plain function agent: one more HTTP round trip (trainer -> rollout server) and the
server's own tokenization of each prompt (to size ``response_mask``); the callbacks are the same proxy hops a
plain agent makes. ``bench/remote_rollout.py`` measures it.
"""

from __future__ import annotations

import json
import re
import threading
import warnings
from typing import Any, Callable, Optional
from urllib.parse import urlsplit

from lightning_nb import semconv
from lightning_nb._net import is_loopback
from lightning_nb.agents.protocol import (Message, RolloutRequest, RolloutResponse, RolloutServerError, RolloutStatus,
                                          SamplingParams, parse_rollout_response, parse_tools_response)
from lightning_nb.errors import ConfigError
from lightning_nb.tracing.tracer import tool_span
from lightning_nb.types import LLMResource

__all__ = ["RemoteRolloutAgent", "RolloutServerTimeout", "task_messages", "final_text", "callback_url",
           "PREFLIGHT_TIMEOUT_S", "ROLLOUT_SERVER_SPAN"]

#: seconds :meth:`RemoteRolloutAgent.preflight` waits for ``GET /tools``
PREFLIGHT_TIMEOUT_S = 3.0
#: the name of the span recording each ``POST /rollout`` (``tool:rollout_server``; a tool span, so the trainers
#: and the adapter ignore it): ``semconv.TOOL_INPUT`` the request (without ``callback_api_key``),
#: ``semconv.TOOL_OUTPUT`` the answer
ROLLOUT_SERVER_SPAN = "rollout_server"
_ATTRIBUTED = re.compile(r"^(?P<base>https?://.+)/rollout/(?P<rollout>[^/]+)/attempt/(?P<attempt>[^/]+)/v1/?$")


class RolloutServerTimeout(RolloutServerError, TimeoutError):
    """The rollout server did not answer ``POST /rollout`` within the agent's ``timeout_s``."""


def task_messages(task: Any) -> list[dict[str, Any]]:
    """The conversation a rollout starts from, by default: a ``str`` task, or a dict's ``"messages"`` (a list of
    OpenAI messages), ``"question"`` or ``"prompt"`` (one user message).

    Raises:
        ConfigError: another task shape; pass ``messages_fn=`` to :class:`RemoteRolloutAgent`.
    """
    if isinstance(task, str):
        return [{"role": "user", "content": task}]
    if isinstance(task, dict):
        if isinstance(task.get("messages"), list):
            return list(task["messages"])
        for key in ("question", "prompt"):
            if isinstance(task.get(key), str):
                return [{"role": "user", "content": task[key]}]
    raise ConfigError(f"cannot build the rollout's messages from a {type(task).__name__} task (keys "
                      f"{sorted(task) if isinstance(task, dict) else '-'}): RemoteRolloutAgent takes a str, or a dict "
                      "with 'messages', 'question' or 'prompt'; else pass messages_fn=lambda task: [{'role': 'user', "
                      "'content': ...}]")


def final_text(messages: list[dict[str, Any]]) -> str:
    """The text of the last assistant message of ``messages`` ('' when there is none): what a reward usually reads."""
    for m in reversed(messages):
        if m.get("role") == "assistant":
            content = m.get("content")
            if isinstance(content, list):
                return "".join(p.get("text", "") for p in content if isinstance(p, dict))
            return content or ""
    return ""


def callback_url(endpoint: str) -> tuple[str, str, str]:
    """``(server_url, rollout_id, attempt_id)`` from a runner's attributed ``llm.endpoint``
    (``{proxy}/rollout/{rollout_id}/attempt/{attempt_id}/v1``): ``server_url`` is the endpoint without ``/v1``.

    Raises:
        ConfigError: the endpoint is not attributed to an attempt (not the kit's proxy).
    """
    m = _ATTRIBUTED.match(endpoint)
    if m is None:
        raise ConfigError(f"llm.endpoint {endpoint!r} is not an LLM proxy URL attributed to an attempt "
                          "(.../rollout/{rollout_id}/attempt/{attempt_id}/v1): RemoteRolloutAgent needs the kit's "
                          "LLMProxy as the runners' LLM resource, store.add_resources({'main_llm': proxy.as_resource()})")
    return endpoint.rstrip("/")[: -len("/v1")], m["rollout"], m["attempt"]


def _sampling(llm: LLMResource) -> SamplingParams:
    """The rollout's :class:`SamplingParams` from ``llm.model`` and ``llm.sampling_parameters``.

    Raises:
        ConfigError: a sampling parameter the protocol has no field for, or an invalid value (names it).
    """
    from pydantic import ValidationError

    params = dict(llm.sampling_parameters)
    unknown = sorted(set(params) - (set(SamplingParams.model_fields) - {"model"}))
    if unknown:
        raise ConfigError(f"sampling parameter(s) {unknown} of the LLM resource cannot travel in the remote rollout "
                          f"protocol (its sampling_params take {sorted(set(SamplingParams.model_fields) - {'model'})}); "
                          "remove them from the resource or the rollout's sampling_parameters")
    if isinstance(params.get("stop"), str):
        params["stop"] = [params["stop"]]
    try:
        return SamplingParams(model=llm.model, **params)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"])
        raise ConfigError(f"sampling parameter {field!r}: {first['msg']}") from None


class RemoteRolloutAgent:
    """An agent whose loop runs on a rollout server (reference doc 002); call it as ``agent(task, llm)``.

    Args:
        url: the rollout server's base URL (``http://127.0.0.1:9000``); it serves ``GET /tools`` and ``POST /rollout``.
        reward_fn: ``reward_fn(task, final_messages) -> float``, the episode's final reward (``final_messages``:
            OpenAI message dicts; :func:`final_text` gives the last reply's text). See "Rewards".
        api_key: bearer token sent to the rollout server (``Authorization: Bearer ...``). Required when the
            ``url``'s host is not loopback.
        timeout_s: seconds one ``POST /rollout`` may take (the whole remote episode). Keep it under the rollout's
            ``timeout_seconds`` (runners default to 300 s), else the runner times the attempt out first.
        max_turns: advisory cap on the server's LLM calls (1-100). max_tokens_total: advisory cap on the
            conversation's tokens.
        messages_fn: ``messages_fn(task) -> [OpenAI messages]``; default :func:`task_messages`.
        metadata: hints sent in every request (doc 002's ``metadata``).

    Each rollout: ``POST {url}/rollout`` with the store's ``rollout_id``, the task's ``messages``,
    ``server_url`` (``llm.endpoint`` without ``/v1``), ``sampling_params`` (``llm.model`` and
    ``llm.sampling_parameters``), the tools (``GET {url}/tools``, fetched once per agent object and process,
    thread-safe) and ``callback_api_key=llm.api_key``. The request (without the key) and the answer are
    recorded on the attempt as the span ``tool:rollout_server``.

    Outcomes (the runner records a raised error's traceback on the attempt, which ends ``failed``; what the
    attempt already stored, its LLM spans included, stays):

    * ``COMPLETED`` with ``finish_reason`` ``stop``, ``max_turns`` or ``max_tokens`` and ``final_messages``: the
      reward.
    * ``ERROR``, or ``finish_reason="error"``: :class:`~lightning_nb.agents.protocol.RolloutServerError` with the
      server's ``error_message``.
    * no answer within ``timeout_s``: :class:`RolloutServerTimeout` naming the URL and ``timeout_s``.
    * an answer outside the protocol (not JSON, a missing or unknown field, ``COMPLETED`` without
      ``finish_reason`` or with no ``final_messages``, an unknown ``finish_reason``, another ``rollout_id``, an
      HTTP error): ``RolloutServerError`` naming the field.

    Rewards: ``reward_fn``'s value when ``reward_fn`` is set. Doc 002 leaves rewards to the trainer; a server
    may still send ``reward`` (:class:`~lightning_nb.agents.protocol.RolloutResponse`): without ``reward_fn`` it
    is the reward; with ``reward_fn`` it is not used, stays on the ``tool:rollout_server`` span, and the first
    such rollout warns (``RuntimeWarning``). Neither: the attempt fails, naming ``reward``.

    :meth:`preflight` checks the server before any rollout runs.

    The agent declares ``calls_model = True``: a ``COMPLETED`` answer whose server never called the model back (no
    LLM call reached the attempt) is refused by the runner, and the attempt ends ``failed`` (a reward with nothing to
    train on). An answer arriving after the attempt ended (the rollout's ``timeout_seconds`` passed, the watchdog
    ended it) is refused by the store (:class:`~lightning_nb.errors.AttemptEnded`, logged by the tracer): no
    ``tool:rollout_server``, reward or agent span is stored on the ended attempt.

    Raises:
        ConfigError: ``url`` not http(s), a non-loopback ``url`` without ``api_key``, ``timeout_s`` not positive,
            ``max_turns``/``max_tokens_total`` out of range, or ``reward_fn``/``messages_fn`` not callable.
    """

    #: every rollout calls the model (see :func:`~lightning_nb.runners.calling.declares_model_calls`)
    calls_model = True

    def __init__(self, url: str, *, reward_fn: Optional[Callable[[Any, list[dict[str, Any]]], float]] = None,
                 api_key: Optional[str] = None, timeout_s: float = 240.0, max_turns: int = 5,
                 max_tokens_total: int = 8192, messages_fn: Optional[Callable[[Any], list[dict[str, Any]]]] = None,
                 metadata: Optional[dict[str, Any]] = None) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"url must be the rollout server's http(s) base URL, e.g. 'http://127.0.0.1:9000'; "
                              f"got {url!r}")
        if not is_loopback(parts.hostname) and not api_key:
            raise ConfigError(f"url {url!r} is not a loopback address, so api_key is required (the bearer token the "
                              "rollout server was started with, --api-key); or run the rollout server on 127.0.0.1")
        if not timeout_s > 0:
            raise ConfigError(f"timeout_s must be positive seconds, got {timeout_s!r}")
        if not 1 <= int(max_turns) <= 100:
            raise ConfigError(f"max_turns must be 1-100 LLM calls, got {max_turns!r}")
        if not 1 <= int(max_tokens_total) <= 1_000_000:
            raise ConfigError(f"max_tokens_total must be 1-1,000,000 tokens, got {max_tokens_total!r}")
        for name, fn in (("reward_fn", reward_fn), ("messages_fn", messages_fn)):
            if fn is not None and not callable(fn):
                raise ConfigError(f"{name} must be callable or None, got {type(fn).__name__}")
        self.url = url.rstrip("/")
        self.reward_fn, self.api_key, self.timeout_s = reward_fn, api_key, float(timeout_s)
        self.max_turns, self.max_tokens_total = int(max_turns), int(max_tokens_total)
        self.messages_fn = messages_fn or task_messages
        self.metadata = dict(metadata or {})
        self._init_process_state()

    def _init_process_state(self) -> None:
        self._lock = threading.Lock()  # the state below; never held across a request
        self._discovery = threading.Lock()  # held across GET /tools, so concurrent first rollouts send one
        self._tools: Optional[list[dict[str, Any]]] = None
        self._client: Any = None
        self._warned_reward = False

    def __getstate__(self) -> dict[str, Any]:  # Ray actors get a copy: each process discovers the tools itself
        state = dict(self.__dict__)
        for key in ("_lock", "_discovery", "_tools", "_client", "_warned_reward"):
            state.pop(key, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_process_state()

    def __repr__(self) -> str:
        return f"RemoteRolloutAgent({self.url!r}, timeout_s={self.timeout_s}, max_turns={self.max_turns})"

    def close(self) -> None:
        """Close this process's connections to the rollout server (a later rollout opens new ones); idempotent."""
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()

    # ----- HTTP ---------------------------------------------------------------------------------------
    def _http(self) -> Any:
        """This process's keep-alive client to the rollout server (made on first use)."""
        import httpx

        with self._lock:
            if self._client is None:
                headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
                self._client = httpx.Client(headers=headers, timeout=httpx.Timeout(self.timeout_s,
                                                                                  connect=min(self.timeout_s, 10.0)))
            return self._client

    def _get_json(self, path: str, timeout_s: float) -> Any:
        """``GET {url}{path}`` as parsed JSON. Raises RolloutServerError (HTTP error, not JSON) or httpx errors."""
        response = self._http().get(f"{self.url}{path}", timeout=timeout_s)
        return self._json(response, f"GET {path}")

    def _json(self, response: Any, what: str) -> Any:
        """The JSON body of a 200 answer to ``what``; RolloutServerError for an HTTP error or a body not JSON."""
        if response.status_code == 401:
            raise RolloutServerError(f"the rollout server at {self.url} refused {what} (HTTP 401: missing or wrong "
                                     "bearer token); pass api_key= the token it was started with (--api-key)",
                                     "api_key")
        if response.status_code != 200:
            raise RolloutServerError(f"the rollout server at {self.url} answered {what} with HTTP "
                                     f"{response.status_code}: {response.text[:1000]}", "status_code")
        try:
            return response.json()
        except ValueError:
            raise RolloutServerError(f"the rollout server at {self.url} answered {what} with a body that is not "
                                     f"JSON: {response.text[:200]!r}", "body") from None

    def tools(self) -> list[dict[str, Any]]:
        """The rollout server's tools (OpenAI function dicts): ``GET /tools`` on the first call in this process,
        then the cached list (thread-safe: concurrent first calls send one request).

        Raises:
            RolloutServerError: the server does not answer, or answers outside the protocol (names the field).
        """
        import httpx

        with self._lock:
            if self._tools is not None:
                return self._tools
        with self._discovery:
            if self._tools is None:
                try:
                    body = self._get_json("/tools", min(self.timeout_s, 30.0))
                except httpx.HTTPError as exc:
                    raise RolloutServerError(f"GET {self.url}/tools failed ({type(exc).__name__}: {exc}); is the "
                                             "rollout server running? (python -m lightning_nb.agents.rollout_server)"
                                             ) from exc
                self._tools = parse_tools_response(body, self.url)
            return self._tools

    def preflight(self) -> None:
        """Check that the rollout server answers ``GET /tools`` (at most :data:`PREFLIGHT_TIMEOUT_S` seconds) and
        cache its tools; if it does not, issue one ``RuntimeWarning`` naming the URL and the fix. Never raises:
        rollouts then fail one by one with the reason on each attempt."""
        import httpx

        try:
            body = self._get_json("/tools", PREFLIGHT_TIMEOUT_S)
            tools = parse_tools_response(body, self.url)
        except (httpx.HTTPError, RolloutServerError) as exc:
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            warnings.warn(f"RemoteRolloutAgent: the rollout server at {self.url} does not answer GET /tools "
                          f"({type(exc).__name__}: {reason}); start it (python -m lightning_nb.agents.rollout_server "
                          "--port PORT, or RolloutServer(...).start() in the notebook) or pass its url (and api_key) "
                          "to RemoteRolloutAgent. Until then every rollout fails with this reason on its attempt",
                          RuntimeWarning, stacklevel=2)
            return
        with self._lock:
            self._tools = tools

    # ----- one rollout --------------------------------------------------------------------------------
    def request(self, task: Any, llm: LLMResource) -> RolloutRequest:
        """The :class:`~lightning_nb.agents.protocol.RolloutRequest` of one rollout (discovers the tools if needed).

        Raises:
            ConfigError: ``llm.endpoint`` not attributed to an attempt, a task :attr:`messages_fn` cannot turn into
                messages, or a sampling parameter the protocol cannot carry.
        """
        from pydantic import ValidationError

        server_url, rollout_id, _ = callback_url(llm.endpoint)
        try:
            messages = [Message.model_validate(m) for m in self.messages_fn(task)]
        except ValidationError as exc:
            first = exc.errors()[0]
            raise ConfigError(f"messages_fn(task) gave an invalid message: field {'.'.join(map(str, first['loc']))!r}: "
                              f"{first['msg']}") from None
        return RolloutRequest(rollout_id=rollout_id, messages=messages, server_url=server_url,
                              sampling_params=_sampling(llm), tools=self.tools(), callback_api_key=llm.api_key,
                              max_turns=self.max_turns, max_tokens_total=self.max_tokens_total,
                              metadata=self.metadata)

    def __call__(self, task: Any, llm: LLMResource) -> float:
        """Run one rollout on the rollout server and return its reward (see the class docstring for the errors)."""
        req = self.request(task, llm)
        with tool_span(ROLLOUT_SERVER_SPAN, req.model_dump(mode="json", exclude={"callback_api_key"})) as span:
            answer = self._post_rollout(req)
            span.set_attribute(semconv.TOOL_OUTPUT, answer.text)  # as sent: kept whatever it holds
        response = parse_rollout_response(self._json(answer, "POST /rollout"), self.url)
        return self._reward(task, req, response)

    def _post_rollout(self, req: RolloutRequest) -> Any:
        """POST the request; the HTTP answer (``httpx.Response``). Raises RolloutServerTimeout / RolloutServerError."""
        import httpx

        try:
            return self._http().post(f"{self.url}/rollout", json=req.model_dump(mode="json"))
        except httpx.TimeoutException as exc:
            raise RolloutServerTimeout(f"the rollout server at {self.url} did not answer POST /rollout for rollout "
                                       f"{req.rollout_id} within timeout_s={self.timeout_s:g} s ({type(exc).__name__});"
                                       " raise RemoteRolloutAgent(timeout_s=...) or look at the server") from None
        except httpx.HTTPError as exc:
            raise RolloutServerError(f"POST {self.url}/rollout failed ({type(exc).__name__}: {exc}); is the rollout "
                                     "server running? (python -m lightning_nb.agents.rollout_server)") from exc

    def _reward(self, task: Any, req: RolloutRequest, response: RolloutResponse) -> float:
        """Map the response onto the attempt: its reward, or a RolloutServerError (see the class docstring)."""
        where = f"the rollout server at {self.url}"
        if response.rollout_id != req.rollout_id:
            raise RolloutServerError(f"{where} answered for rollout_id {response.rollout_id!r}, not "
                                     f"{req.rollout_id!r}", "rollout_id")
        if response.status == RolloutStatus.ERROR or response.finish_reason == "error":
            field, value = (("status", "ERROR") if response.status == RolloutStatus.ERROR
                            else ("finish_reason", "error"))
            raise RolloutServerError(f"{where} failed rollout {req.rollout_id} ({field} {value}): "
                                     f"{response.error_message or '(no error_message)'}", field)
        if response.finish_reason is None:
            raise RolloutServerError(f"{where} answered status COMPLETED without field 'finish_reason' (one of stop, "
                                     "max_turns, max_tokens)", "finish_reason")
        if not response.final_messages:
            raise RolloutServerError(f"{where} answered status COMPLETED without field 'final_messages' (the whole "
                                     "conversation at the end: the request's messages, the replies and the tool "
                                     "results; reference doc 002's RolloutResponse)", "final_messages")
        final = [m.model_dump(exclude_none=True) for m in response.final_messages]
        if self.reward_fn is not None:
            if response.reward is not None and not self._warned_reward:
                self._warned_reward = True
                warnings.warn(f"{where} sent reward={response.reward!r} and reward_fn is set: reward_fn's value is the "
                              "reward; the server's stays on the 'tool:rollout_server' span. Drop reward_fn to use "
                              "the server's", RuntimeWarning, stacklevel=3)
            return self.reward_fn(task, final)
        if response.reward is None:
            raise RolloutServerError(f"{where} sent no 'reward' and RemoteRolloutAgent has no reward_fn; pass "
                                     "reward_fn=lambda task, final_messages: ... (e.g. with final_text(final_messages))",
                                     "reward")
        return response.reward

