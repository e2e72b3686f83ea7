"""The reference rollout server of the remote rollout protocol (reference doc 002): calculator tools, one agent loop.

Start it with one command (127.0.0.1:9000 by default; bound elsewhere it needs ``--api-key``)::

    python -m lightning_nb.agents.rollout_server [--host 127.0.0.1] [--port 9000] [--api-key TOKEN]

or in a notebook, ``with RolloutServer() as server: ... server.url``. Routes:

* ``GET /tools``: doc 002's calculator, ``add``, ``subtract``, ``multiply``, ``divide`` (numbers ``a`` and ``b``),
  as OpenAI function schemas (:data:`CALCULATOR_TOOLS`);
* ``POST /rollout``: one :class:`~lightning_nb.agents.protocol.RolloutRequest`, answered with a
  :class:`~lightning_nb.agents.protocol.RolloutResponse` when the episode ends;
* ``GET /health``.

The agent loop (:func:`run_rollout`, doc 002's ``RolloutSession``): call ``{server_url}/v1/chat/completions``
with the ``rollout_id``, the conversation, the ``tools``, the request's sampling parameters, ``Authorization: Bearer
<callback_api_key>`` and the ``response_mask`` of the tokens added since the previous call
(:class:`~lightning_nb.agents.protocol.MaskTracker`); append the reply; run its ``tool_calls``; append one
``tool`` message per call; repeat until a reply makes no tool call (``finish_reason="stop"``), ``max_turns``
LLM calls were made (``"max_turns"``) or the conversation reached ``max_tokens_total`` tokens
(``"max_tokens"``). A failure anywhere (the trainer refused a call, a callback timed out, a reply without
token IDs) answers doc 002's error format, ``{rollout_id, status: "ERROR", error_message, final_messages: []}``.

To size ``response_mask`` the server renders each prompt as the trainer's Hermes-format engine will
(:func:`~lightning_nb.engines.chat_format.rendered_prompt_ids`, the tools included and each earlier assistant
turn as sampled) with the served model's tokenizer (the default model's unless given), and checks its count
against the ``prompt_token_ids`` the trainer returns. Metrics: ``num_llm_calls``, ``num_tool_calls``,
latencies (ms), ``prompt_tokens`` and ``response_tokens`` (summed over the calls), ``max_context_tokens``
(the longest prompt + completion), and ``metadata_ignored`` (the request's ``metadata`` keys: this server
reads none).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import threading
import time
from typing import Any, Optional, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from lightning_nb._net import ThreadedServer, is_loopback
from lightning_nb.agents.protocol import MaskTracker, RolloutMetrics, RolloutRequest, RolloutResponse, RolloutStatus
from lightning_nb.engines.chat_format import rendered_prompt_ids, sampled_turn_key
from lightning_nb.errors import ConfigError

__all__ = ["RolloutServer", "rollout_server_app", "run_rollout", "run_tool", "CALCULATOR_TOOLS", "main"]


def _tool(name: str, description: str) -> dict[str, Any]:
    number = {"type": "number"}
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": {"a": {**number, "description": "First number"},
                                                        "b": {**number, "description": "Second number"}},
                       "required": ["a", "b"]}}}


#: doc 002's calculator tools as OpenAI function schemas
CALCULATOR_TOOLS = [_tool("add", "Add two numbers: a + b"), _tool("subtract", "Subtract b from a: a - b"),
                    _tool("multiply", "Multiply two numbers: a * b"), _tool("divide", "Divide a by b: a / b")]
_OPS = {"add": lambda a, b: a + b, "subtract": lambda a, b: a - b, "multiply": lambda a, b: a * b,
        "divide": lambda a, b: a / b}


def _number_text(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


async def run_tool(name: str, arguments: Any, delay_s: float = 0.0) -> str:
    """Run one calculator tool call; its result as text, or ``"error: ..."`` text the model reads (an unknown
    tool, arguments that are not two numbers ``a`` and ``b``, a division by zero). ``delay_s``: seconds to
    sleep first (doc 002 simulates tool latency)."""
    if delay_s:
        await asyncio.sleep(delay_s)
    if name not in _OPS:
        return f"error: unknown tool {name!r}; the tools are {sorted(_OPS)}"
    try:
        args = json.loads(arguments) if isinstance(arguments, str) else arguments
        a, b = args["a"], args["b"]
        if isinstance(a, bool) or isinstance(b, bool):
            raise TypeError
        return _number_text(_OPS[name](float(a), float(b)))
    except ZeroDivisionError:
        return "error: division by zero"
    except (ValueError, TypeError, KeyError):
        return f"error: {name} takes two numbers a and b, got {str(arguments)[:200]}"


class _Failed(Exception):
    """The episode cannot go on; the message becomes the response's ``error_message``."""


class _Session:
    """One rollout's state: the conversation, the mask arithmetic, the sampled text of each tool-calling turn."""

    def __init__(self, req: RolloutRequest, tokenizer: Any, token_lock: threading.Lock) -> None:
        self.req, self.tokenizer, self.token_lock = req, tokenizer, token_lock
        self.messages = [m.model_dump(exclude_none=True) for m in req.messages]
        self.tools = [t.model_dump() for t in req.tools]
        self.mask = MaskTracker()
        self.sampled: dict[str, str] = {}  # sampled_turn_key(tool_calls) -> the text the model sampled for that turn
        self.metrics = RolloutMetrics()
        self.headers = {"Authorization": f"Bearer {req.callback_api_key}"} if req.callback_api_key else {}

    def prompt_length(self) -> int:
        """Tokens of the next prompt as the trainer's Hermes-format engine renders it."""
        with self.token_lock:  # a fast tokenizer may not be used by two threads at once
            return len(rendered_prompt_ids(self.tokenizer, self.messages, self.tools or None, "auto", self.sampled))

    def sampled_text(self, token_ids: list[int]) -> str:
        with self.token_lock:
            return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    async def call_llm(self, client: Any, prompt_length: int) -> dict[str, Any]:
        """One ``POST {server_url}/v1/chat/completions``; the first choice with ``token_ids`` and the prompt's length."""
        sp = self.req.sampling_params
        body: dict[str, Any] = {"model": sp.model, "rollout_id": self.req.rollout_id, "messages": self.messages,
                                "temperature": sp.temperature, "top_p": sp.top_p, "max_tokens": sp.max_tokens}
        for key in ("stop", "seed"):
            if getattr(sp, key) is not None:
                body[key] = getattr(sp, key)
        if sp.logprobs:
            body["logprobs"] = True
        if self.tools:
            body["tools"] = self.tools
        mask = self.mask.mask_for(prompt_length)
        if mask is not None:  # doc 002: null (here: absent) on the first call
            body["response_mask"] = mask
        url = f"{self.req.server_url}/v1/chat/completions"
        t0 = time.perf_counter()
        response = await client.post(url, json=body, headers=self.headers)
        self.metrics.llm_latency_ms += (time.perf_counter() - t0) * 1e3
        self.metrics.num_llm_calls += 1
        if response.status_code != 200:
            raise _Failed(f"the trainer answered POST {url} (LLM call {self.metrics.num_llm_calls}) with HTTP "
                          f"{response.status_code}: {_error_text(response)}")
        reply = response.json()
        choice = (reply.get("choices") or [None])[0]
        if not choice or choice.get("token_ids") is None or reply.get("prompt_token_ids") is None:
            raise _Failed(f"the trainer's reply from {url} has no token_ids/prompt_token_ids; the remote rollout "
                          "protocol needs them (the kit's LLMProxy returns them)")
        served = len(reply["prompt_token_ids"])
        if served != prompt_length:
            raise _Failed(f"the trainer's prompt has {served} tokens, this server counted {prompt_length}: its "
                          "tokenizer or chat format is not the served model's, so response_mask cannot be sized; "
                          "start the server with that model's tokenizer")
        self.mask.after_reply(prompt_length, len(choice["token_ids"]))
        self.metrics.prompt_tokens += served
        self.metrics.response_tokens += len(choice["token_ids"])
        self.metrics.max_context_tokens = max(self.metrics.max_context_tokens, self.mask.last_length)
        return choice

    async def run_tools(self, calls: list[dict[str, Any]], delay_s: float) -> None:
        """Run the calls in parallel and append one ``tool`` message per call, in call order."""
        t0 = time.perf_counter()
        results = await asyncio.gather(*(run_tool(c["function"]["name"], c["function"].get("arguments", "{}"),
                                                  delay_s) for c in calls))
        self.metrics.tool_latency_ms += (time.perf_counter() - t0) * 1e3
        self.metrics.num_tool_calls += len(calls)
        for call, result in zip(calls, results):
            self.messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})


def _error_text(response: Any) -> str:
    """The message of an OpenAI-shaped error body (the proxy's), else the body's first 500 characters."""
    try:
        error = response.json()["error"]
        return f"{error['message']}" + (f" (param {error['param']!r})" if error.get("param") else "")
    except Exception:
        return response.text[:500]


async def run_rollout(req: RolloutRequest, tokenizer: Any, *, token_lock: Optional[threading.Lock] = None,
                      tool_delay_s: float = 0.0, callback_timeout_s: float = 300.0) -> RolloutResponse:
    """Run one rollout's agent loop (module docstring) and return its response; never raises for a failed episode
    (doc 002's error format instead)."""
    import httpx

    t0 = time.perf_counter()
    session = _Session(req, tokenizer, token_lock or threading.Lock())
    session.metrics.metadata_ignored = sorted(req.metadata)  # type: ignore[attr-defined]
    finish = "max_turns"
    try:
        async with httpx.AsyncClient(timeout=callback_timeout_s) as client:
            for _ in range(req.max_turns):
                choice = await session.call_llm(client, await asyncio.to_thread(session.prompt_length))
                message = choice["message"]
                calls = message.get("tool_calls") or []
                session.messages.append({"role": "assistant", "content": message.get("content"),
                                         **({"tool_calls": calls} if calls else {})})
                if not calls:
                    finish = "stop"
                    break
                text = await asyncio.to_thread(session.sampled_text, choice["token_ids"])
                session.sampled[sampled_turn_key(calls)] = text
                await session.run_tools(calls, tool_delay_s)
                if session.mask.last_length >= req.max_tokens_total:
                    finish = "max_tokens"
                    break
    except _Failed as exc:
        return _failed(req, str(exc), session.metrics, t0)
    except httpx.HTTPError as exc:
        return _failed(req, f"calling the trainer at {req.server_url} failed: {type(exc).__name__}: {exc}",
                       session.metrics, t0)
    except Exception as exc:  # the reference server answers in the protocol whatever happens
        return _failed(req, f"{type(exc).__name__}: {exc}", session.metrics, t0)
    session.metrics.total_latency_ms = (time.perf_counter() - t0) * 1e3
    return RolloutResponse(rollout_id=req.rollout_id, status=RolloutStatus.COMPLETED, final_messages=session.messages,
                           finish_reason=finish, metrics=session.metrics)


def _failed(req: RolloutRequest, message: str, metrics: RolloutMetrics, t0: float) -> RolloutResponse:
    metrics.total_latency_ms = (time.perf_counter() - t0) * 1e3
    return RolloutResponse.error(req.rollout_id, message, metrics)


# ----- the HTTP app -------------------------------------------------------------------------------------------
def rollout_server_app(tokenizer: Any, *, api_key: Optional[str] = None, tool_delay_s: float = 0.0,
                       callback_timeout_s: float = 300.0) -> FastAPI:
    """The reference rollout server's ASGI app (routes in the module docstring). With ``api_key`` every route but
    ``/health`` answers 401 without ``Authorization: Bearer <api_key>``. Route functions are module-level and find
    their settings in ``request.app.state`` (FastAPI caches route functions process-wide; see
    :func:`lightning_nb.proxy.app.proxy_app`)."""
    app = FastAPI(title="lightning-nb reference rollout server")
    app.state.tokenizer, app.state.api_key = tokenizer, api_key
    app.state.token_lock = threading.Lock()
    app.state.options = {"tool_delay_s": tool_delay_s, "callback_timeout_s": callback_timeout_s}
    app.get("/health")(_health)
    app.get("/tools")(_tools)
    app.post("/rollout")(_rollout)
    return app


def _refused(request: Request) -> Optional[JSONResponse]:
    key = request.app.state.api_key
    if key and request.headers.get("authorization") != f"Bearer {key}":
        return JSONResponse({"error": {"message": "missing or wrong bearer token; send Authorization: Bearer "
                                                  "<api_key>", "param": None, "code": 401}}, 401)
    return None


async def _health() -> dict:
    return {"status": "ok"}


async def _tools(request: Request) -> Any:
    return _refused(request) or {"tools": CALCULATOR_TOOLS}


async def _rollout(request: Request) -> Any:
    refused = _refused(request)
    if refused is not None:
        return refused
    try:
        req = RolloutRequest.model_validate(await request.json())
    except ValueError as exc:  # ValidationError is a ValueError, so is a body that is not JSON
        if isinstance(exc, ValidationError):
            first = exc.errors()[0]
            field = ".".join(str(p) for p in first["loc"]) or "body"
            message = f"invalid RolloutRequest field '{field}': {first['msg']}"
        else:
            field, message = "body", "the body is not JSON; send a RolloutRequest (reference doc 002)"
        return JSONResponse({"error": {"message": message, "param": field, "code": 400}}, 400)
    state = request.app.state
    response = await run_rollout(req, state.tokenizer, token_lock=state.token_lock, **state.options)
    return JSONResponse(response.model_dump(mode="json", exclude_none=True))


def _default_tokenizer() -> Any:
    """The default model's tokenizer (:func:`lightning_nb.models.default.load_default_model`; the weights are dropped)."""
    from lightning_nb.models.default import load_default_model

    _, tokenizer = load_default_model()
    return tokenizer


class RolloutServer:
    """The reference rollout server in a background thread, for notebooks and tests.

    Args:
        host: bind address (127.0.0.1 by default). port: 0 picks a free port.
        api_key: bearer token every route but ``/health`` requires; required when ``host`` is not loopback.
        tokenizer: the served model's tokenizer (sizes ``response_mask``); None loads the default model's
            (about a second from the model cache), a str is a folder or hub id for ``AutoTokenizer``.
        tool_delay_s: seconds each tool call sleeps (doc 002 simulates 10-100 ms); 0 by default.
        callback_timeout_s: seconds one LLM callback may take.

    Use as ``with RolloutServer() as server:`` or :meth:`start` / :meth:`stop`; :attr:`url` is its base URL.

    Raises:
        ConfigError: ``host`` not loopback without ``api_key``, or a negative ``tool_delay_s``.
    """

    def __init__(self, *, host: str = "127.0.0.1", port: int = 0, api_key: Optional[str] = None,
                 tokenizer: Any = None, tool_delay_s: float = 0.0, callback_timeout_s: float = 300.0) -> None:
        if not is_loopback(host) and not api_key:
            raise ConfigError(f"host={host!r} is reachable from other machines, so api_key is required; pass "
                              "api_key=secrets.token_urlsafe() (--api-key), or bind to 127.0.0.1")
        if tool_delay_s < 0 or not callback_timeout_s > 0:
            raise ConfigError(f"tool_delay_s must be >= 0 and callback_timeout_s > 0 seconds, got {tool_delay_s!r} "
                              f"and {callback_timeout_s!r}")
        self.host, self.port, self.api_key = host, port, api_key
        self.tokenizer, self.tool_delay_s, self.callback_timeout_s = tokenizer, tool_delay_s, callback_timeout_s
        self._server: Optional[ThreadedServer] = None

    @property
    def url(self) -> str:
        """``http://host:port`` (the bound port once started)."""
        return f"http://{self.host}:{self.port}"

    @property
    def serving(self) -> bool:
        """Whether the server is started and its thread alive."""
        return self._server is not None and self._server.thread.is_alive()

    def start(self) -> "RolloutServer":
        """Load the tokenizer if needed, bind and serve in a daemon thread; returns once the port is bound."""
        if self._server is not None:
            return self
        if self.tokenizer is None:
            self.tokenizer = _default_tokenizer()
        elif isinstance(self.tokenizer, str):
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(self.tokenizer)
        app = rollout_server_app(self.tokenizer, api_key=self.api_key, tool_delay_s=self.tool_delay_s,
                                 callback_timeout_s=self.callback_timeout_s)
        server = ThreadedServer(app, self.host, self.port, "rollout server")
        self.port = server.start()
        self._server = server
        return self

    def stop(self) -> None:
        """Stop serving (in-flight rollouts get up to 10 s); idempotent."""
        if self._server is not None:
            self._server.stop()
            self._server = None

    def __enter__(self) -> "RolloutServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"RolloutServer({self.url!r}, {'serving' if self._server is not None else 'stopped'})"


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main(argv: Optional[Sequence[str]] = None) -> None:
    """``python -m lightning_nb.agents.rollout_server``: serve until Ctrl-C."""
    parser = argparse.ArgumentParser(prog="python -m lightning_nb.agents.rollout_server",
                                     description="The reference remote rollout server (calculator tools).")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=9000, help="port (default 9000)")
    parser.add_argument("--api-key", default=None, help="bearer token clients must send (required off loopback)")
    parser.add_argument("--tokenizer", default=None, help="the served model's tokenizer folder (default: the kit's)")
    parser.add_argument("--tool-delay-s", type=float, default=0.0, help="seconds each tool call sleeps")
    args = parser.parse_args(argv)
    try:
        server = RolloutServer(host=args.host, port=args.port, api_key=args.api_key, tokenizer=args.tokenizer,
                               tool_delay_s=args.tool_delay_s).start()
    except ConfigError as exc:
        parser.error(str(exc))
    print(f"rollout server on {server.url} (GET /tools, POST /rollout); Ctrl-C stops it", flush=True)
    signal.signal(signal.SIGTERM, _interrupt)  # `kill` stops it as Ctrl-C does: in-flight rollouts finish first
    try:
        while server.serving:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()


if __name__ == "__main__":
    main()
