"""Answering a rollout's first calls from another rollout's record: exact replay and branching (the proxy's side).

A rollout whose metadata holds :data:`~lightning_nb.types.REPLAY_KEY` (``{"rollout_id": parent, "attempt_id": its
attempt, "calls": k, ...}``, written by :func:`lightning_nb.replay.replay` and :func:`lightning_nb.replay.branch`)
has its calls 1..k answered by the proxy from the parent attempt's recorded calls (:func:`recorded_calls`): the same
reply text, tool calls, token IDs, log-probs, finish reason and weight version, recorded on the new attempt with
:data:`~lightning_nb.semconv.REPLAYED_FROM`. Each request is first compared with the recorded one
(:func:`divergence`): the messages, the tools and tool_choice, the sampling the agent asked for, ``n``, and the model
(unless the branch runs on other resources). A request that differs is never answered from the record: the proxy
answers 409 naming the call, the field and both values, and writes an :data:`~lightning_nb.semconv.ERROR` span with
:data:`~lightning_nb.semconv.REPLAY_DIVERGENCE`. From call k + 1 on the proxy samples as for any rollout (with the
branch's own sampling over the rollout's, ``"sampling"``).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from lightning_nb import semconv
from lightning_nb.engines import Engine
from lightning_nb.engines.chat_format import parse_tool_calls, sampled_turn_key
from lightning_nb.proxy.request import ChatCompletionRequest, ProxyHTTPError, applied_sampling
from lightning_nb.proxy.response import Choice, openai_response
from lightning_nb.proxy.spans import record_call, requested_attributes
from lightning_nb.proxy.splice import ServedCall, remember
from lightning_nb.store.episode import attribute_json, call_spans
from lightning_nb.types import Span

__all__ = ["RecordedCall", "ReplayPlan", "ReplayServing", "recorded_calls", "divergence", "recorded_choices",
           "replayed_attributes"]

#: The request fields compared with the record, in this order: the span key and the request's value of each.
_SAMPLING = (("temperature", semconv.REQUEST_TEMPERATURE), ("top_p", semconv.REQUEST_TOP_P),
             ("max_tokens", semconv.REQUEST_MAX_TOKENS), ("seed", semconv.REQUEST_SEED))


@dataclass
class RecordedCall:
    """One recorded call of the parent attempt: ``call`` (from 1), ``spans`` (one per choice, index order)."""

    call: int
    spans: list[Span] = field(default_factory=list)

    @property
    def attributes(self) -> dict[str, Any]:
        return self.spans[0].attributes


@dataclass
class ReplayPlan:
    """What the proxy replays on one attempt: the parent's ``calls`` (recorded), how many of them (``replay``: k),
    the sampling applied after them (``sampling``), whether the model name must match (``compare_model``), and
    whether a call past the record is a divergence (``exact``: a replay) or sampled (a branch)."""

    parent_rollout_id: str
    parent_attempt_id: str
    replay: int
    calls: list[RecordedCall]
    sampling: dict[str, Any] = field(default_factory=dict)
    compare_model: bool = True
    exact: bool = False  # a replay: a call past the record is a divergence, not sampled

    @classmethod
    def from_metadata(cls, meta: dict[str, Any], spans: Sequence[Span]) -> "ReplayPlan":
        calls = recorded_calls(spans)
        k = meta.get("calls")
        return cls(parent_rollout_id=str(meta["rollout_id"]), parent_attempt_id=str(meta["attempt_id"]),
                   replay=len(calls) if k is None else int(k), calls=calls, sampling=dict(meta.get("sampling") or {}),
                   compare_model=bool(meta.get("compare_model", True)), exact=bool(meta.get("exact", False)))


def recorded_calls(spans: Sequence[Span]) -> list[RecordedCall]:
    """The LLM calls among one attempt's ``spans``, each with its choices' spans
    (:func:`~lightning_nb.store.episode.call_spans`'s grouping, numbered from 1)."""
    return [RecordedCall(call=k + 1, spans=group) for k, group in enumerate(call_spans(spans))]


def divergence(req: ChatCompletionRequest, messages: list[dict[str, Any]], rec: RecordedCall,
               compare_model: bool = True) -> Optional[tuple[str, Any, Any]]:
    """``(field, recorded, requested)`` of the first field where ``req`` differs from the recorded call, or None.

    Compared: ``model`` (when ``compare_model``), ``messages`` (as the client sent them), ``tools``, ``tool_choice``,
    ``temperature``, ``top_p``, ``max_tokens``, ``seed``, ``stop`` (as the agent requested them, before a
    rollout's own sampling), and ``n``; and a recorded call that failed (``error``: it has no reply to give).
    """
    a = rec.attributes
    requested_max = req.max_completion_tokens or req.max_tokens
    stop = [req.stop] if isinstance(req.stop, str) else req.stop
    checks: list[tuple[str, Any, Any]] = []
    if compare_model:
        checks.append(("model", a.get(semconv.REQUEST_MODEL), req.model))
    checks += [("messages", attribute_json(a.get(semconv.PROMPT)), messages),
               ("tools", attribute_json(a.get(semconv.REQUEST_TOOLS)), req.tools or None),
               ("tool_choice", attribute_json(a.get(semconv.REQUEST_TOOL_CHOICE)), req.tool_choice)]
    requested = {"temperature": req.temperature, "top_p": req.top_p, "max_tokens": requested_max, "seed": req.seed}
    checks += [(name, a.get(key), requested[name]) for name, key in _SAMPLING]
    checks += [("stop", list(a[semconv.REQUEST_STOP_SEQUENCES]) if a.get(semconv.REQUEST_STOP_SEQUENCES) else None,
                list(stop) if stop else None),
               ("n", int(a.get(semconv.CHOICES, 1) or 1), int(req.n or 1))]
    if a.get(semconv.ERROR):
        return "error", a[semconv.ERROR], "a reply (the recorded call failed, so there is none to replay)"
    for name, recorded, asked in checks:
        if recorded != asked:
            return name, recorded, asked
    return None


def recorded_choices(rec: RecordedCall) -> tuple[dict[str, Any], list[Choice], Optional[list[int]], Optional[int]]:
    """``(raw, choices, prompt_ids, weight_version)`` of a recorded call, in the form the proxy's reply and spans are
    made from (:func:`~lightning_nb.proxy.response.openai_response`, :func:`replayed_attributes`)."""
    choices = []
    for s in rec.spans:
        a = s.attributes
        calls = attribute_json(a.get(semconv.RESPONSE_TOOL_CALLS), [])
        text = str(a.get(semconv.COMPLETION, ""))
        ids = a.get(semconv.COMPLETION_TOKEN_IDS)
        lps = a.get(semconv.LOGPROBS)
        content = text
        if calls:  # the content returned without the call markup the proxy parsed: what the client got then
            names = [c.get("function", {}).get("name") for c in calls]
            parsed, again = parse_tool_calls(text, names)
            content = parsed if again else text
        choices.append(Choice(
            index=int(a.get(semconv.CHOICE_INDEX, 0) or 0), text=text,
            content=content if content or not calls else None,
            tool_calls=calls, token_ids=list(ids) if ids is not None else None,
            finish_reason=(a.get(semconv.RESPONSE_FINISH_REASONS) or [None])[0],
            logprobs={"content": [{"token": "", "logprob": float(lp), "bytes": None, "top_logprobs": []} for lp in lps]}
            if lps else None))
    a = rec.attributes
    prompt_ids = list(a[semconv.PROMPT_TOKEN_IDS]) if a.get(semconv.PROMPT_TOKEN_IDS) else None
    usage = {"prompt_tokens": a.get(semconv.USAGE_INPUT_TOKENS),
             "completion_tokens": a.get(semconv.USAGE_OUTPUT_TOKENS)}
    if usage["prompt_tokens"] is not None and usage["completion_tokens"] is not None:
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    raw = {"id": a.get(semconv.RESPONSE_ID) or None, "usage": usage}
    return raw, choices, prompt_ids, a.get(semconv.WEIGHT_VERSION)


def replayed_attributes(rec: RecordedCall) -> list[dict[str, Any]]:
    """Per choice, the recorded reply's attributes to write on the new attempt's span (what was sampled: text, tool
    calls, token IDs, log-probs, finish reason, weight version, and the applied sampling it was sampled with), with
    :data:`~lightning_nb.semconv.REPLAYED_FROM` naming the recorded span."""
    keep = (semconv.RESPONSE_ID, semconv.CHOICE_INDEX, semconv.CHOICES, semconv.RESPONSE_FINISH_REASONS,
            semconv.COMPLETION, semconv.WEIGHT_VERSION, semconv.RESPONSE_TOOL_CALLS, semconv.PROMPT_TOKEN_IDS,
            semconv.COMPLETION_TOKEN_IDS, semconv.USAGE_INPUT_TOKENS, semconv.USAGE_OUTPUT_TOKENS, semconv.LOGPROBS,
            semconv.TOKEN_IDS_MISSING, semconv.ENGINE, *semconv.APPLIED_SAMPLING)
    return [{**{k: s.attributes[k] for k in keep if k in s.attributes}, semconv.REPLAYED_FROM: s.span_id}
            for s in rec.spans]


class ReplayServing:
    """The :class:`~lightning_nb.proxy.LLMProxy` side of a replaying attempt (a mixin: it uses the proxy's ``store``,
    ``tracer``, ``_replays``, ``_served``, ``_sampled`` and ``_check_still_open``)."""

    store: Any
    tracer: Any
    _replays: "OrderedDict[tuple[str, str], ReplayPlan]"
    _served: "OrderedDict[tuple[str, str], ServedCall]"
    _sampled: "OrderedDict[str, str]"

    async def _replay_plan(self, key: tuple[str, str], meta: dict[str, Any]) -> ReplayPlan:
        """The attempt's :class:`~lightning_nb.proxy.replay.ReplayPlan`, read from the parent's spans once."""
        plan = self._replays.get(key)
        if plan is None:
            spans = await asyncio.to_thread(self.store.query_spans, str(meta["rollout_id"]), str(meta["attempt_id"]))
            plan = ReplayPlan.from_metadata(meta, spans)
            remember(self._replays, key, plan)
        return plan

    async def _replayed(self, req: ChatCompletionRequest, engine: Engine, key: tuple[str, str], plan: ReplayPlan,
                        call: int, enforced: dict[str, Any], agent_name: Optional[str]) -> dict[str, Any]:
        """Answer call ``call`` of a replaying attempt from the parent's record, and record it on the attempt.

        Raises:
            ProxyHTTPError: 409 naming the call and the field when the request differs from the record
                (:func:`~lightning_nb.proxy.replay.divergence`) or the record has no such call; an
                :data:`~lightning_nb.semconv.ERROR` span with :data:`~lightning_nb.semconv.REPLAY_DIVERGENCE` is
                written.
        """
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        if call > len(plan.calls):
            diff: Optional[tuple[str, Any, Any]] = ("calls", f"{len(plan.calls)} calls",
                                                    f"call {call} (the agent made more calls than the record has)")
        else:
            diff = divergence(req, messages, plan.calls[call - 1], plan.compare_model)
        if diff is not None:
            name, recorded, asked = diff
            message = (f"replay of rollout {plan.parent_rollout_id!r} (attempt {plan.parent_attempt_id!r}) diverged "
                       f"at call {call}: {name} was {json.dumps(recorded, default=str)[:500]} in the record, the agent "
                       f"sent {json.dumps(asked, default=str)[:500]}. The proxy answers no request from a record it "
                       "differs from; the replay stops here (its calls before this one are recorded on the attempt)")
            span = self.tracer.start_span(semconv.LLM_SPAN, key[0], key[1], {
                semconv.REQUEST_MODEL: req.model, semconv.ERROR: message[:2000],
                semconv.REPLAY_DIVERGENCE: json.dumps({"call": call, "field": name, "recorded": recorded,
                                                       "requested": asked}, default=str),
                **({semconv.AGENT_NAME: agent_name} if agent_name else {})})
            await asyncio.to_thread(span.end)
            raise ProxyHTTPError(409, message, name)
        rec = plan.calls[call - 1]
        t0 = time.time_ns()
        raw, choices, prompt_ids, version = recorded_choices(rec)
        version = engine.weight_version if version is None else int(version)
        await self._check_still_open(*key)
        for ch in choices:
            if ch.tool_calls:
                remember(self._sampled, sampled_turn_key(ch.tool_calls), ch.text)
        if prompt_ids is not None and choices and choices[0].token_ids is not None:
            remember(self._served, key, ServedCall(tuple(prompt_ids), tuple(choices[0].token_ids), choices[0].text,
                                                    tuple(prompt_ids), cut=choices[0].finish_reason == "length",
                                                    n_messages=len(req.messages)))
        applied, not_applied = applied_sampling(req, enforced)
        requested = requested_attributes(req, messages, applied, not_applied, engine, version, version, agent_name)
        await record_call(self.tracer, key[0], key[1], t0, requested, replayed_attributes(rec))
        return openai_response(req, raw, choices, prompt_ids, version)
