"""One rollout as a user reads it: :class:`Episode`, built from the spans a store already holds.

``store.episode(rollout_id)`` (:meth:`~lightning_nb.store.frames.FrameViews.episode`) gives the task, each LLM
call (its messages, reply text, token IDs, log-probs and ``finish_reason``), the tool calls and their results,
the final reply, the final reward and its components, and the attempt's status. It reads only what every agent
shape writes: the LLM proxy's :data:`~lightning_nb.semconv.LLM_SPAN` spans (one per call whatever the agent:
a plain function, a framework agent, a remote rollout server calling back into the proxy, a gym-style runner),
``tool:`` spans where the agent traced its tools (:func:`lightning_nb.tool_span`), and the reward spans. An
agent that passes its tool results to the model as messages (every agent does) also shows them in the next
call's :attr:`LLMCall.messages`.

A rollout that replays or branches another (:func:`lightning_nb.replay.replay`, :func:`lightning_nb.replay.branch`)
names it in :attr:`Episode.parent_rollout_id` and :attr:`Episode.branch_call`; the calls its proxy answered from
the parent's record carry :attr:`LLMCall.replayed`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from lightning_nb import semconv
from lightning_nb.store.rules import component_sums, final_reward
from lightning_nb.types import (BRANCH_CALL_KEY, GROUP_ID_KEY, PARENT_ROLLOUT_KEY, Attempt, Rollout, Span)

__all__ = ["Episode", "LLMCall", "ToolUse", "build_episode", "llm_calls", "call_spans", "attribute_json"]


@dataclass(repr=False)
class LLMCall:
    """One LLM call of an episode, as the proxy recorded it (its first choice when the request asked for ``n`` > 1).

    Attributes:
        call: the call's number in its attempt, from 1 (``branch(at_call=k)`` replays calls 1..k).
        messages: the request's messages as the agent sent them (OpenAI chat format).
        reply: the sampled text (tool-call markup included); "" for a failed call.
        tool_calls: the reply's OpenAI ``tool_calls`` (parsed by the proxy or the engine); may be empty.
        finish_reason: ``"stop"``, ``"length"`` (cut at ``max_tokens``), ``"tool_calls"``; None when the call failed.
        prompt_ids, completion_ids: the token IDs the engine saw and sampled (None without them).
        logprobs: the engine's log-probability of each completion token, nats (None without them).
        weight_version: the engine's weight version that sampled the reply.
        model: the requested model name; request: the other request fields the proxy recorded (``temperature``,
            ``top_p``, ``max_tokens``, ``seed``, ``stop``, ``tools``, ``tool_choice``; only those the agent set).
        agent_name: the request's ``X-Agent-Name``; error: why the call failed (None when it did not).
        replayed: answered from a parent rollout's record (:func:`lightning_nb.replay.replay`), not sampled.
        span_id: the call's span.
    """

    call: int
    messages: list[dict[str, Any]]
    reply: str
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: Optional[str] = None
    prompt_ids: Optional[list[int]] = None
    completion_ids: Optional[list[int]] = None
    logprobs: Optional[list[float]] = None
    weight_version: Optional[int] = None
    model: Optional[str] = None
    request: dict[str, Any] = field(default_factory=dict)
    agent_name: Optional[str] = None
    error: Optional[str] = None
    replayed: bool = False
    span_id: str = ""

    def __repr__(self) -> str:  # the messages and token IDs are long: the fields one reads first
        tokens = (f"{len(self.prompt_ids)}+{len(self.completion_ids)} tokens"
                  if self.prompt_ids is not None and self.completion_ids is not None else "no token IDs")
        extra = ", replayed" if self.replayed else ""
        extra += f", error={self.error[:60]!r}" if self.error else ""
        return (f"LLMCall(call={self.call}, reply={self.reply[:80]!r}, finish_reason={self.finish_reason!r}, "
                f"{tokens}{extra})")


@dataclass
class ToolUse:
    """One traced tool call (a ``tool:<name>`` span): ``name``, ``input`` and ``output`` as the agent recorded them
    (text; ``output`` None when it set none), ``after_call``: how many LLM calls of the attempt came before it."""

    name: str
    input: Optional[str]
    output: Optional[str]
    after_call: int
    span_id: str = ""


@dataclass(repr=False)
class Episode:
    """One rollout's latest attempt, as a user reads it (see the module docstring).

    Attributes:
        rollout_id, attempt_id: the rollout and the attempt shown (its latest; None before one started).
        task: the rollout's input, as enqueued. mode: ``"train"``, ``"val"`` or ``"test"``.
        status: the rollout's status; attempt_status: the attempt's (``"succeeded"``, ``"failed"``, ...).
        group_id: the rollout's GRPO group (metadata ``group_id``), None without one.
        calls: the LLM calls, in order (:class:`LLMCall`); tools: the traced tool calls (:class:`ToolUse`).
        final_reply: the last call's reply text ("" without calls).
        reward: the final reward by the store's rule (:func:`~lightning_nb.store.rules.final_reward`: 0.0 for a
            failed rollout, None without one); components: the intermediate rewards summed per name
            (``{"calc_uses_all_numbers": 0.2}``), the final reward not among them.
        error: the attempt's error when it failed. parent_rollout_id, branch_call: the rollout this one replays
            or branches and the number of its calls replayed (None for an ordinary rollout).
        divergence: where a replay stopped because the agent's request differed from the record: ``{"call": j,
            "field": ..., "recorded": ..., "requested": ...}`` (None when it did not, or for an ordinary rollout).
    """

    rollout_id: str
    attempt_id: Optional[str]
    task: Any
    mode: str
    status: str
    attempt_status: Optional[str]
    group_id: Optional[str]
    calls: list[LLMCall]
    tools: list[ToolUse]
    final_reply: str
    reward: Optional[float]
    components: dict[str, float]
    error: Optional[str] = None
    parent_rollout_id: Optional[str] = None
    branch_call: Optional[int] = None
    divergence: Optional[dict[str, Any]] = None

    def __repr__(self) -> str:  # the calls hold the messages and token IDs: ep.calls shows them, one per line
        extra = f", branch of {self.parent_rollout_id!r} at call {self.branch_call}" if self.parent_rollout_id else ""
        extra += f", divergence at call {self.divergence.get('call')}" if self.divergence else ""
        return (f"Episode(rollout_id={self.rollout_id!r}, status={self.status!r}, calls={len(self.calls)}, "
                f"tools={len(self.tools)}, reward={self.reward!r}, components={self.components!r}{extra})")

    @property
    def replies(self) -> list[str]:
        """Each call's reply text, in order."""
        return [c.reply for c in self.calls]

    def to_frame(self) -> Any:
        """One row per LLM call: call, reply, finish_reason, prompt_tokens, completion_tokens, tool_calls (names,
        comma-separated), weight_version, replayed, error (a pandas DataFrame)."""
        import pandas as pd

        return pd.DataFrame([{"call": c.call, "reply": c.reply, "finish_reason": c.finish_reason,
                              "prompt_tokens": len(c.prompt_ids) if c.prompt_ids is not None else math.nan,
                              "completion_tokens": len(c.completion_ids) if c.completion_ids is not None else math.nan,
                              "tool_calls": ", ".join(str((t.get("function") or {}).get("name", ""))
                                                      for t in c.tool_calls),
                              "weight_version": c.weight_version, "replayed": c.replayed, "error": c.error}
                             for c in self.calls],
                            columns=["call", "reply", "finish_reason", "prompt_tokens", "completion_tokens",
                                     "tool_calls", "weight_version", "replayed", "error"])

    def _repr_html_(self) -> str:
        import html

        head = (f"<b>episode {html.escape(self.rollout_id)}</b> ({html.escape(self.status)}; reward "
                f"{self.reward if self.reward is not None else '—'}"
                + "".join(f", {html.escape(k)} {v:g}" for k, v in self.components.items())
                + (f"; branch of {html.escape(self.parent_rollout_id)} at call {self.branch_call}"
                   if self.parent_rollout_id else "") + ")")
        task = html.escape(json.dumps(self.task, default=str)[:300])
        return f"<div>{head}<br><code>{task}</code>{self.to_frame().to_html(index=False)}</div>"


def attribute_json(value: Any, default: Any = None) -> Any:
    """A span attribute the proxy writes as JSON text (``gen_ai.prompt``, the tool calls, ...) as its value; a value
    that is not text is returned as it is, None or text that does not parse as ``default``."""
    if value is None:
        return default
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return default
    return value


def call_spans(spans: Sequence[Span]) -> list[list[Span]]:
    """The LLM spans among one attempt's ``spans`` (store order), grouped by call: the proxy writes one span per
    choice, and a span of choice index 0 (or without one) starts a call, a higher index joins the call before it."""
    calls: list[list[Span]] = []
    for s in spans:
        if s.name != semconv.LLM_SPAN:
            continue
        if int(s.attributes.get(semconv.CHOICE_INDEX, 0) or 0) == 0 or not calls:
            calls.append([])
        calls[-1].append(s)
    return calls


#: The request fields an :class:`LLMCall` keeps (the span key -> the OpenAI request name); those the agent set.
REQUEST_FIELDS = {semconv.REQUEST_TEMPERATURE: "temperature", semconv.REQUEST_TOP_P: "top_p",
                  semconv.REQUEST_MAX_TOKENS: "max_tokens", semconv.REQUEST_SEED: "seed",
                  semconv.REQUEST_STOP_SEQUENCES: "stop", semconv.REQUEST_TOOLS: "tools",
                  semconv.REQUEST_TOOL_CHOICE: "tool_choice"}


def llm_calls(spans: Sequence[Span]) -> list[LLMCall]:
    """The LLM calls among one attempt's ``spans`` (store order, :func:`call_spans`), numbered from 1; a call's other
    choices (``n`` > 1) are left out."""
    calls: list[LLMCall] = []
    for s in (group[0] for group in call_spans(spans)):
        a = s.attributes
        request = {name: (attribute_json(a[key], a[key])
                          if key in (semconv.REQUEST_TOOLS, semconv.REQUEST_TOOL_CHOICE) else a[key])
                   for key, name in REQUEST_FIELDS.items() if key in a}
        reasons = a.get(semconv.RESPONSE_FINISH_REASONS) or []
        calls.append(LLMCall(
            call=len(calls) + 1, messages=attribute_json(a.get(semconv.PROMPT), []),
            reply=str(a.get(semconv.COMPLETION, "")),
            tool_calls=attribute_json(a.get(semconv.RESPONSE_TOOL_CALLS), []),
            finish_reason=reasons[0] if reasons else None,
            prompt_ids=list(a[semconv.PROMPT_TOKEN_IDS]) if semconv.PROMPT_TOKEN_IDS in a else None,
            completion_ids=list(a[semconv.COMPLETION_TOKEN_IDS]) if semconv.COMPLETION_TOKEN_IDS in a else None,
            logprobs=list(a[semconv.LOGPROBS]) if semconv.LOGPROBS in a else None,
            weight_version=a.get(semconv.WEIGHT_VERSION), model=a.get(semconv.REQUEST_MODEL), request=request,
            agent_name=a.get(semconv.AGENT_NAME), error=a.get(semconv.ERROR),
            replayed=bool(a.get(semconv.REPLAYED_FROM)), span_id=s.span_id))
    return calls


def build_episode(rollout: Rollout, attempt: Optional[Attempt], spans: Sequence[Span]) -> Episode:
    """The :class:`Episode` of ``rollout`` from its ``attempt`` (its latest, or None) and that attempt's ``spans``."""
    calls = llm_calls(spans)
    starts = {group[0].span_id for group in call_spans(spans)}
    tools, seen = [], 0
    for s in spans:
        if s.span_id in starts:
            seen += 1
        elif s.name.startswith(semconv.TOOL_SPAN_PREFIX):
            out = s.attributes.get(semconv.TOOL_OUTPUT)
            tools.append(ToolUse(name=str(s.attributes.get(semconv.TOOL_NAME, s.name[len(semconv.TOOL_SPAN_PREFIX):])),
                                 input=s.attributes.get(semconv.TOOL_INPUT), output=None if out is None else str(out),
                                 after_call=seen, span_id=s.span_id))
    rewards = [s.attributes.get(semconv.REWARD) for s in spans if s.name == semconv.REWARD_SPAN]
    parent = rollout.metadata.get(PARENT_ROLLOUT_KEY)
    diverged = next((attribute_json(s.attributes[semconv.REPLAY_DIVERGENCE], None) for s in spans
                     if s.name == semconv.LLM_SPAN and semconv.REPLAY_DIVERGENCE in s.attributes), None)
    return Episode(
        rollout_id=rollout.rollout_id, attempt_id=attempt.attempt_id if attempt else None, task=rollout.input,
        mode=rollout.mode, status=rollout.status, attempt_status=attempt.status if attempt else None,
        group_id=rollout.metadata.get(GROUP_ID_KEY), calls=calls, tools=tools,
        final_reply=calls[-1].reply if calls else "", reward=final_reward(rollout.status, rewards),
        components=component_sums(spans), error=attempt.error if attempt is not None else None,
        parent_rollout_id=parent, branch_call=rollout.metadata.get(BRANCH_CALL_KEY) if parent else None,
        divergence=diverged)
