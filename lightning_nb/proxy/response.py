"""The proxy's reply: the engine's choices with tool calls parsed, as an OpenAI response or its server-sent events.

:func:`parse_choices` reads the engine's (LiteLLM's) response into :class:`Choice` values, the one
form both the reply (:func:`openai_response`, :func:`sse_events`) and the recorded spans
(:mod:`lightning_nb.proxy.spans`) are made from.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional

from lightning_nb.engines.chat_format import parse_tool_calls
from lightning_nb.proxy.request import ChatCompletionRequest

__all__ = ["Choice", "parse_choices", "openai_response", "sse_events", "dropped_before_reply"]


@dataclass
class Choice:
    """One choice of a completion, as the proxy returns and records it.

    Attributes:
        index: the choice's index among the request's ``n``.
        text: the sampled text as the engine returned it (tool-call markup included).
        content: the message content returned: ``text`` without the parsed tool calls; None when it
            is empty and there are tool calls (OpenAI's shape).
        tool_calls: OpenAI ``tool_calls`` (engine-native, or parsed from ``text``); may be empty.
        token_ids: the completion's token IDs, or None when the engine returned none.
        finish_reason: ``"stop"``, ``"length"`` or ``"tool_calls"`` (a reply cut at ``max_tokens`` stays
            ``"length"``, OpenAI's rule, also when a call parsed before the cut: DAPO's overlong filter
            and the truncation counts read it).
        logprobs: the engine's OpenAI ``logprobs`` block (``{"content": [...]}``), None when it had no entries.
    """

    index: int
    text: str
    content: Optional[str]
    tool_calls: list[dict[str, Any]]
    token_ids: Optional[list[int]]
    finish_reason: Optional[str]
    logprobs: Optional[dict[str, Any]]

    @property
    def logprob_values(self) -> list[float]:
        """One log-probability (nats) per entry of :attr:`logprobs` (empty without it)."""
        return [e["logprob"] for e in (self.logprobs or {}).get("content") or []]


def parse_choices(raw_choices: list[dict[str, Any]], tool_names: Optional[list[str]],
                  parallel_tool_calls: Optional[bool]) -> list[Choice]:
    """The engine's response ``choices`` (LiteLLM's ``model_dump()``) as :class:`Choice` values.

    ``tool_names``: parse tool calls written as text (the Hermes format) for these tools; None leaves
    the content as it is (the engine parsed them, or none were asked for). ``parallel_tool_calls=False``
    keeps only the first parsed call.
    """
    choices = []
    for c in raw_choices:
        extra = c.get("provider_specific_fields") or {}
        token_ids = c.get("token_ids") or extra.get("token_ids")
        content = c["message"].get("content") or ""
        calls = list(c["message"].get("tool_calls") or [])
        text = content
        if tool_names is not None:
            parsed, calls = parse_tool_calls(content, tool_names)
            if parallel_tool_calls is False:
                calls = calls[:1]
            content = parsed if calls else content
        lp_block = c.get("logprobs") or {}
        choices.append(Choice(
            index=c["index"], text=text, content=content if content or not calls else None, tool_calls=calls,
            token_ids=token_ids,
            finish_reason="tool_calls" if calls and c.get("finish_reason") != "length" else c.get("finish_reason"),
            logprobs=lp_block if lp_block.get("content") else None))
    return choices


def openai_response(req: ChatCompletionRequest, raw: dict[str, Any], choices: list[Choice],
                    prompt_ids: Optional[list[int]], version: int) -> dict[str, Any]:
    """The OpenAI ``chat.completion`` dict of ``choices``, with ``prompt_token_ids``, ``choices[i].token_ids``
    and ``weight_version``, and, with one choice, a top-level ``token_ids`` (that choice's: where reference doc
    002's rollout server reads the completion's tokens; None with ``n`` > 1). Each choice also carries ``_pieces``
    (its log-prob entries, which :func:`sse_events` cuts the stream from); drop it before sending the dict as
    JSON."""
    usage = raw.get("usage") or {}
    out_choices = []
    for ch in choices:
        message: dict[str, Any] = {"role": "assistant", "content": ch.content}
        if ch.tool_calls:
            message["tool_calls"] = ch.tool_calls
        out_choices.append({"index": ch.index, "message": message, "finish_reason": ch.finish_reason,
                            "logprobs": ch.logprobs if req.logprobs else None,
                            "token_ids": ch.token_ids, "_pieces": (ch.logprobs or {}).get("content")})
    return {"id": raw.get("id") or f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
            "created": raw.get("created") or int(time.time()), "model": req.model, "choices": out_choices,
            "usage": {k: usage.get(k) for k in ("prompt_tokens", "completion_tokens", "total_tokens")},
            "prompt_token_ids": prompt_ids, "token_ids": choices[0].token_ids if len(choices) == 1 else None,
            "weight_version": version}


async def sse_events(completion: dict[str, Any], req: ChatCompletionRequest) -> AsyncIterator[str]:
    """A finished completion (:func:`openai_response`) as OpenAI ``chat.completion.chunk`` server-sent events.

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


def dropped_before_reply(exc: BaseException) -> bool:
    """Whether ``exc`` (a failed ``litellm.acompletion``) is the server closing the connection without a reply.

    That is the race of an idle keep-alive connection: the engine's HTTP server (uvicorn closes connections idle
    for 5 s) closes it as the client reuses it, and the client reads nothing. LiteLLM raises it as an
    ``InternalServerError`` ("Server disconnected") whose cause chain holds aiohttp's ``ServerDisconnectedError``
    (or, with LiteLLM's httpx transport, httpx's ``RemoteProtocolError``). The request is sent again once on a
    new connection, as the OpenAI SDK's own retries do for a connection error.
    """
    import httpx

    names = {"ServerDisconnectedError"}  # aiohttp's, by name: aiohttp is LiteLLM's transport, not our import
    seen: set[int] = set()
    cur: Optional[BaseException] = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, httpx.RemoteProtocolError) or type(cur).__name__ in names:
            return True
        cur = cur.__cause__ or cur.__context__
    return False
