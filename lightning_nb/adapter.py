"""Adapters: spans → triplets for RL.

LightningRL credit assignment (Agent Lightning paper, §3.2): every LLM call of
an episode is one transition (prompt tokens → response tokens) and carries the
episode's final reward; episodes of the same task form one GRPO group. Token IDs
come from the LLM proxy's spans and are never re-tokenized. Intermediate rewards
(:func:`lightning_nb.emit_intermediate_reward`) are attributed to single calls
(``Triplet.step_reward``; see :func:`attribute_intermediate_rewards`).
"""

from __future__ import annotations

import logging
import re
from typing import Any, Optional, Sequence

import pandas as pd

from lightning_nb import semconv
from lightning_nb.errors import ConfigError, SpanSchemaError
from lightning_nb.store.base import LightningStore
from lightning_nb.store.rules import final_reward
from lightning_nb.types import GROUP_ID_KEY, Span, Triplet

__all__ = ["TripletAdapter", "attribute_intermediate_rewards", "triplets_df"]

log = logging.getLogger(__name__)


class TripletAdapter:
    """Turn the latest attempt of each rollout into triplets.

    A rollout gives no triplets, and is counted in :attr:`skipped` (cumulative) and
    :attr:`last_skipped` (the last :meth:`adapt` call) under one reason, when:

    * ``not_succeeded``: it failed or was cancelled;
    * ``no_reward``: it succeeded without a final reward (:func:`lightning_nb.store.rules.final_reward`);
    * ``no_llm_calls``: it succeeded with a reward but made no LLM call through the proxy
      (for example an agent that caught its own error and returned 0.0), so there is nothing to train;
    * ``no_token_ids``: every LLM span of it lacks token IDs (a call that bypassed the proxy);
    * ``no_matching_llm_calls``: ``agent_match`` is set and none of its LLM calls' agent names matches.

    Counted per LLM call or reward, in the same dicts, not as rollout reasons:

    * ``llm_spans_without_token_ids``: LLM spans without token IDs inside an otherwise usable rollout (dropped);
    * ``llm_spans_not_matched``: LLM calls whose agent name ``agent_match`` does not select (no triplet);
    * ``intermediate_rewards_dropped``: intermediate rewards attributed to a call that gave no triplet
      (not matched, or without token IDs). They are dropped, not moved to another call: an
      intermediate reward judges the call just before it (see :func:`attribute_intermediate_rewards`),
      and crediting another agent's or another call's tokens with it would reward what it did not judge.

    Each triplet gets ``step_reward``: the sum of the intermediate rewards attributed to its call,
    ``agent_name``: the call's ``gen_ai.agent.name`` (the request's ``X-Agent-Name`` header), and the
    call's sampling ``temperature`` and ``top_p`` as the engine applied them (the span's
    :data:`~lightning_nb.semconv.APPLIED_TEMPERATURE` and :data:`~lightning_nb.semconv.APPLIED_TOP_P`,
    which the proxy always writes). Neither is ever defaulted: the trainer scores each token at the
    temperature it was sampled at, so a guessed 1.0 would train on the wrong distribution.

    Args:
        group_key: rollout metadata key naming the GRPO group (default ``group_id``;
            falls back to the rollout id, i.e. no grouping).
        agent_match: selective optimisation in a multi-agent system: a regular expression searched
            (``re.search``, as agent-lightning's ``agent_match``) in each LLM call's agent name; only
            matching calls become triplets. ``"solver"`` also matches ``"solver_v2"``; anchor it,
            ``"^solver$"``, for one name exactly. A call without an agent name never matches. None
            (default): every call is trained.

    Raises:
        ConfigError: ``agent_match`` is not a valid regular expression (at construction); or, in
            :meth:`adapt`, an LLM span records that its engine returned no token IDs
            (``lightning_nb.token_ids_missing``, e.g. an :class:`~lightning_nb.engines.endpoint.OpenAIEndpoint`
            to a hosted API): triplets are never built from re-tokenized text. Only calls that
            ``agent_match`` selects are checked, so a judge on a hosted API can be left out by name.
        SpanSchemaError: in :meth:`adapt`, an LLM span with token IDs lacks the applied sampling
            ``temperature`` or ``top_p`` (a span not written by :class:`~lightning_nb.proxy.LLMProxy`);
            the message names the key and the span.
    """

    REASONS = ("not_succeeded", "no_reward", "no_llm_calls", "no_token_ids", "no_matching_llm_calls")
    COUNTS = ("llm_spans_without_token_ids", "llm_spans_not_matched", "intermediate_rewards_dropped")

    def __init__(self, group_key: str = GROUP_ID_KEY, agent_match: Optional[str] = None) -> None:
        self.group_key = group_key
        self.agent_match = agent_match
        try:
            self._agent_re = None if agent_match is None else re.compile(agent_match)
        except (re.error, TypeError) as exc:
            raise ConfigError(f"TripletAdapter(agent_match={agent_match!r}) is not a valid regular expression "
                              f"({exc}); pass one such as '^solver$' (searched in each LLM call's X-Agent-Name), "
                              "or None to train on every LLM call") from None
        self.skipped: dict[str, int] = {k: 0 for k in (*self.REASONS, *self.COUNTS)}
        self.last_skipped: dict[str, int] = dict(self.skipped)

    def adapt(self, store: LightningStore, rollout_ids: Sequence[str]) -> list[Triplet]:
        """Triplets of ``rollout_ids`` (one per LLM call with token IDs, in turn order); see the class docstring."""
        triplets: list[Triplet] = []
        skipped = {k: 0 for k in self.skipped}
        for rollout in store.query_rollouts(rollout_ids=list(rollout_ids)):
            new, reason, counts = self._adapt_one(store, rollout)
            triplets += new
            for k, v in counts.items():
                skipped[k] += v
            if reason is not None:
                skipped[reason] += 1
        for k, v in skipped.items():
            self.skipped[k] += v
        self.last_skipped = skipped
        return triplets

    def _adapt_one(self, store: LightningStore, rollout: Any) -> tuple[list[Triplet], Optional[str], dict[str, int]]:
        """(triplets, skip reason or None, per-call counts of :attr:`COUNTS`) of one rollout."""
        counts = dict.fromkeys(self.COUNTS, 0)
        if rollout.status != "succeeded":
            return [], "not_succeeded", counts
        spans = store.query_spans(rollout.rollout_id, "latest")
        reward = final_reward(rollout.status, [s.attributes.get(semconv.REWARD) for s in spans
                                               if s.name == semconv.REWARD_SPAN])
        if reward is None:
            return [], "no_reward", counts
        calls = [s for s in spans if s.name == semconv.LLM_SPAN]
        if not calls:
            return [], "no_llm_calls", counts
        step_rewards = attribute_intermediate_rewards(spans)
        group = str(rollout.metadata.get(self.group_key, rollout.rollout_id))
        out: list[Triplet] = []
        matched = 0
        for turn, span in enumerate(calls):
            a = span.attributes
            name = a.get(semconv.AGENT_NAME)
            if self._agent_re is not None and (name is None or not self._agent_re.search(str(name))):
                counts["llm_spans_not_matched"] += 1
                counts["intermediate_rewards_dropped"] += len(step_rewards.get(span.span_id, ()))
                continue
            matched += 1
            if a.get(semconv.TOKEN_IDS_MISSING):
                raise ConfigError(
                    f"rollout {rollout.rollout_id}: LLM span {span.span_id} has no token IDs "
                    f"({a[semconv.TOKEN_IDS_MISSING]}); "
                    "training on re-tokenized text would train on tokens the model never sampled. Serve the policy "
                    "with TransformersEngine or VLLMEngine (or an OpenAIEndpoint whose server honours "
                    "return_token_ids), and keep judge/eval endpoints out of training rollouts")
            if not a.get(semconv.COMPLETION_TOKEN_IDS) or not a.get(semconv.PROMPT_TOKEN_IDS):
                counts["llm_spans_without_token_ids"] += 1
                counts["intermediate_rewards_dropped"] += len(step_rewards.get(span.span_id, ()))
                continue
            out.append(_triplet(rollout.rollout_id, span, group, turn, reward,
                                sum(step_rewards.get(span.span_id, ()))))
        if not matched:
            return [], "no_matching_llm_calls", counts
        return out, (None if out else "no_token_ids"), counts


def _triplet(rollout_id: str, span: Span, group: str, turn: int, reward: float, step_reward: float) -> Triplet:
    """The triplet of one LLM span with token IDs.

    Raises:
        SpanSchemaError: the span lacks the applied sampling temperature or top_p (the message names the key).
    """
    a = span.attributes
    for constant, key in _SAMPLING_KEYS:
        if a.get(key) is None:
            raise SpanSchemaError(
                f"rollout {rollout_id}: LLM span {span.span_id} has token IDs but no {key!r} attribute "
                f"(lightning_nb.semconv.{constant}, the sampling {key} the engine applied). The trainer scores each "
                f"token at the sampling it was drawn with, so it is never guessed. LLMProxy writes it on every "
                f"call; a span built by hand must set it, e.g. attributes[semconv.{constant}] = 1.0")
    return Triplet(
        rollout_id=rollout_id, attempt_id=span.attempt_id, group_id=group, turn=turn,
        prompt_ids=list(a[semconv.PROMPT_TOKEN_IDS]), response_ids=list(a[semconv.COMPLETION_TOKEN_IDS]),
        logprobs=list(a[semconv.LOGPROBS]) if a.get(semconv.LOGPROBS) else None, reward=reward,
        step_reward=step_reward, agent_name=a.get(semconv.AGENT_NAME),
        temperature=float(a[semconv.APPLIED_TEMPERATURE]), top_p=float(a[semconv.APPLIED_TOP_P]),
        weight_version=a.get(semconv.WEIGHT_VERSION),
        finish_reason=(a.get(semconv.RESPONSE_FINISH_REASONS) or [None])[0],
        prompt_text=str(a.get(semconv.PROMPT, "")), response_text=str(a.get(semconv.COMPLETION, "")),
        replayed=bool(a.get(semconv.REPLAYED_FROM)),
    )


# the sampling a triplet needs from its span, never defaulted: (semconv name, key)
_SAMPLING_KEYS = (("APPLIED_TEMPERATURE", semconv.APPLIED_TEMPERATURE), ("APPLIED_TOP_P", semconv.APPLIED_TOP_P))


def attribute_intermediate_rewards(spans: Sequence[Span]) -> dict[str, list[float]]:
    """LLM span id -> the intermediate rewards attributed to that call, in emission order.

    The rule (one place; :class:`TripletAdapter` applies it): an ``"intermediate_reward"`` span
    (:func:`lightning_nb.emit_intermediate_reward`) belongs to the LLM call (span :data:`~lightning_nb.semconv.LLM_SPAN`)
    that most recently ended before the reward span started: the call with the largest
    ``(end_time, sequence_id)`` that is below ``(reward start_time, reward sequence_id)``, so a call
    ending at the very instant the reward starts counts as before it when it was stored first. A
    reward emitted before any call ended goes to the first call (by ``(start_time, sequence_id)``).
    Times are the spans' own (seconds); the proxy's and the agent's clocks are the same machine's
    clock here, and with remote runners they must agree to well under the time between calls.

    All LLM calls of ``spans`` take part, whichever agent made them (``agent_match`` filters
    afterwards), so a reward never jumps to a call it does not follow. ``spans`` without LLM
    calls give ``{}`` (their intermediate rewards have no call to go to).
    """
    calls = sorted((s for s in spans if s.name == semconv.LLM_SPAN), key=lambda s: (s.end_time, s.sequence_id))
    if not calls:
        return {}
    first = min(calls, key=lambda s: (s.start_time, s.sequence_id))
    out: dict[str, list[float]] = {}
    for r in sorted((s for s in spans if s.name == semconv.INTERMEDIATE_REWARD_SPAN), key=lambda s: s.sequence_id):
        value = r.attributes.get(semconv.REWARD)
        if value is None:
            continue
        before = [c for c in calls if (c.end_time, c.sequence_id) < (r.start_time, r.sequence_id)]
        owner = before[-1] if before else first
        out.setdefault(owner.span_id, []).append(float(value))
    return out


def triplets_df(triplets: Sequence[Triplet], advantages: Optional[dict[Any, float]] = None) -> pd.DataFrame:
    """One row per triplet: ids, turn, reward, step_reward, agent_name, advantage (if given), token counts, text.

    ``advantages`` is keyed by rollout id (one advantage per episode, ``algo.last_update.advantages``)
    or by ``(rollout_id, turn)`` (one per transition, ``algo.last_update.turn_advantages``); a
    ``(rollout_id, turn)`` key wins over the rollout id.
    """
    columns = ["rollout_id", GROUP_ID_KEY, "turn", "reward", "step_reward", "agent_name", "advantage",
               "prompt_tokens", "response_tokens", "response_text"]
    adv = advantages or {}
    rows = []
    for t in triplets:
        rows.append({
            "rollout_id": t.rollout_id, GROUP_ID_KEY: t.group_id, "turn": t.turn, "reward": t.reward,
            "step_reward": t.step_reward, "agent_name": t.agent_name,
            "advantage": adv.get((t.rollout_id, t.turn), adv.get(t.rollout_id)), "prompt_tokens": len(t.prompt_ids),
            "response_tokens": len(t.response_ids), "response_text": t.response_text,
        })
    return pd.DataFrame(rows, columns=columns)
