"""What the LLM proxy records: one :data:`~lightning_nb.semconv.LLM_SPAN` span per choice of a call.

Each span holds what was requested (OpenTelemetry GenAI ``gen_ai.request.*`` keys), the sampling
the engine applied, and what was sampled: the text, the prompt and completion token IDs, their
log-probs and the weight version. A call the engine failed gives one span with the error. Every
key is a :mod:`lightning_nb.semconv` constant, documented there.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Optional

from lightning_nb import semconv
from lightning_nb.engines import Engine
from lightning_nb.proxy.request import ChatCompletionRequest
from lightning_nb.proxy.response import Choice
from lightning_nb.tracing.tracer import Tracer

__all__ = ["record_call", "record_error", "requested_attributes", "choice_attributes"]

# the applied sampling (OpenAI request names, lightning_nb.proxy.request.applied_sampling) -> span key
_APPLIED_KEYS = {"max_tokens": semconv.APPLIED_MAX_TOKENS, "temperature": semconv.APPLIED_TEMPERATURE,
                 "top_p": semconv.APPLIED_TOP_P, "seed": semconv.APPLIED_SEED, "stop": semconv.APPLIED_STOP}


def requested_attributes(req: ChatCompletionRequest, messages: list[dict[str, Any]], applied: dict[str, Any],
                         not_applied: list[str], engine: Engine, version: int, version_after: int,
                         agent_name: Optional[str]) -> dict[str, Any]:
    """The attributes every choice's span of one call shares: the request, the applied sampling, the engine.

    ``messages``: the request's messages as the client sent them; ``applied``/``not_applied``: from
    :func:`~lightning_nb.proxy.request.applied_sampling`; ``version``/``version_after``: the weight
    version sampled with and the engine's version once the call returned.
    """
    requested_sampling = ((semconv.REQUEST_TEMPERATURE, req.temperature), (semconv.REQUEST_TOP_P, req.top_p),
                          (semconv.REQUEST_MAX_TOKENS, req.max_completion_tokens or req.max_tokens),
                          (semconv.REQUEST_SEED, req.seed))
    return {
        semconv.SYSTEM: "lightning_nb", semconv.REQUEST_MODEL: req.model,
        **({semconv.AGENT_NAME: agent_name} if agent_name else {}),
        **{k: v for k, v in requested_sampling if v is not None},
        **({semconv.REQUEST_STOP_SEQUENCES: [req.stop] if isinstance(req.stop, str) else req.stop}
           if req.stop else {}),
        **({semconv.REQUEST_TOOLS: json.dumps(req.tools)} if req.tools else {}),
        **({semconv.REQUEST_TOOL_CHOICE: json.dumps(req.tool_choice)} if req.tool_choice is not None else {}),
        **({semconv.REQUEST_USER: req.user} if req.user else {}),
        **({semconv.REQUEST_METADATA: json.dumps(req.metadata)} if req.metadata else {}),
        **({semconv.REQUEST_RESPONSE_MASK: list(req.response_mask)} if req.response_mask is not None else {}),
        semconv.PROMPT: json.dumps(messages),
        semconv.ENGINE: type(engine).__name__,
        **{_APPLIED_KEYS[k]: v for k, v in applied.items() if k != "stop"},
        **({semconv.APPLIED_STOP: applied["stop"]} if "stop" in applied else {}),
        **({semconv.SAMPLING_NOT_APPLIED: not_applied} if not_applied else {}),
        **({semconv.WEIGHTS_CHANGED_DURING_CALL: [version, version_after]} if version_after != version else {}),
    }


def choice_attributes(ch: Choice, n: int, response_id: Optional[str], prompt_ids: Optional[list[int]],
                      version: int, engine: Engine) -> dict[str, Any]:
    """The attributes of one choice's span: the reply, its token IDs and log-probs, or why it has no token IDs."""
    attrs: dict[str, Any] = {
        semconv.RESPONSE_ID: response_id or "", semconv.CHOICE_INDEX: ch.index, semconv.CHOICES: n,
        semconv.RESPONSE_FINISH_REASONS: [ch.finish_reason], semconv.COMPLETION: ch.text,
        semconv.WEIGHT_VERSION: version,
    }
    if ch.tool_calls:
        attrs[semconv.RESPONSE_TOOL_CALLS] = json.dumps(ch.tool_calls)
    if prompt_ids and ch.token_ids:
        attrs.update({semconv.PROMPT_TOKEN_IDS: prompt_ids, semconv.COMPLETION_TOKEN_IDS: ch.token_ids,
                      semconv.USAGE_INPUT_TOKENS: len(prompt_ids),
                      semconv.USAGE_OUTPUT_TOKENS: len(ch.token_ids)})
        lps = ch.logprob_values
        if len(lps) == len(ch.token_ids):
            attrs[semconv.LOGPROBS] = lps
    else:
        attrs[semconv.TOKEN_IDS_MISSING] = (f"{type(engine).__name__} at {engine.base_url} returned no token IDs"
                                            if not engine.returns_token_ids else "the engine's reply lacked token IDs")
    return attrs


async def record_call(tracer: Tracer, rollout_id: str, attempt_id: str, start_ns: int, requested: dict[str, Any],
                      per_choice: list[dict[str, Any]]) -> None:
    """Write one LLM span per choice: ``requested`` (:func:`requested_attributes`) with each of ``per_choice``
    (:func:`choice_attributes`), started at ``start_ns`` (nanoseconds since the epoch) and ended now."""
    spans = []
    for attrs in per_choice:
        span = tracer.start_span(semconv.LLM_SPAN, rollout_id, attempt_id, requested, start_time=start_ns)
        span.set_attributes(attrs)
        spans.append(span)

    def end_all() -> None:
        for span in spans:
            span.end()

    await asyncio.to_thread(end_all)  # ending a span writes it to the store: off the event loop


async def record_error(tracer: Tracer, rollout_id: str, attempt_id: str, model: str, message: str,
                       agent_name: Optional[str]) -> None:
    """Write the LLM span of a call the engine failed: the requested ``model``, the agent name and the error
    (``message``, its first 2000 characters)."""
    span = tracer.start_span(semconv.LLM_SPAN, rollout_id, attempt_id,
                             {semconv.REQUEST_MODEL: model, semconv.ERROR: message[:2000],
                              **({semconv.AGENT_NAME: agent_name} if agent_name else {})})
    await asyncio.to_thread(span.end)
