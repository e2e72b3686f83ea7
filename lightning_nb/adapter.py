"""Adapters: spans → triplets for RL.

LightningRL credit assignment (Agent Lightning paper, §3.2): every LLM call of
an episode is one transition (prompt tokens → response tokens) and carries the
episode's final reward; episodes of the same task form one GRPO group. Token IDs
come from the LLM proxy's spans and are never re-tokenized.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

import pandas as pd

from lightning_nb.errors import ConfigError
from lightning_nb.proxy import LLM_SPAN_NAME, TOKEN_IDS_MISSING
from lightning_nb.store.base import LightningStore
from lightning_nb.store.rules import final_reward
from lightning_nb.types import Triplet

__all__ = ["TripletAdapter", "triplets_df"]

log = logging.getLogger(__name__)


class TripletAdapter:
    """Turn the latest attempt of each rollout into triplets.

    A rollout gives no triplets, and is counted in :attr:`skipped` (cumulative) and
    :attr:`last_skipped` (the last :meth:`adapt` call) under one reason, when:

    * ``not_succeeded``: it failed or was cancelled;
    * ``no_reward``: it succeeded without a final reward (:func:`lightning_nb.store.rules.final_reward`);
    * ``no_llm_calls``: it succeeded with a reward but made no LLM call through the proxy
      (for example an agent that caught its own error and returned 0.0), so there is nothing to train;
    * ``no_token_ids``: every LLM span of it lacks token IDs (a call that bypassed the proxy).

    Raises:
        ConfigError: an LLM span records that its engine returned no token IDs
            (``lightning_nb.token_ids_missing``, e.g. an :class:`~lightning_nb.endpoint.OpenAIEndpoint`
            to a hosted API): triplets are never built from re-tokenized text.

    LLM spans without token IDs inside an otherwise usable rollout are counted in
    ``llm_spans_without_token_ids`` and dropped.

    Args:
        group_key: rollout metadata key naming the GRPO group (default ``group_id``;
            falls back to the rollout id, i.e. no grouping).
    """

    REASONS = ("not_succeeded", "no_reward", "no_llm_calls", "no_token_ids")

    def __init__(self, group_key: str = "group_id") -> None:
        self.group_key = group_key
        self.skipped: dict[str, int] = {k: 0 for k in (*self.REASONS, "llm_spans_without_token_ids")}
        self.last_skipped: dict[str, int] = dict(self.skipped)

    def adapt(self, store: LightningStore, rollout_ids: Sequence[str]) -> list[Triplet]:
        """Triplets of ``rollout_ids`` (one per LLM call with token IDs, in turn order); see the class docstring."""
        triplets: list[Triplet] = []
        skipped = {k: 0 for k in self.skipped}
        for rollout in store.query_rollouts(rollout_ids=list(rollout_ids)):
            new, reason, missing_ids = self._adapt_one(store, rollout)
            triplets += new
            skipped["llm_spans_without_token_ids"] += missing_ids
            if reason is not None:
                skipped[reason] += 1
        for k, v in skipped.items():
            self.skipped[k] += v
        self.last_skipped = skipped
        return triplets

    def _adapt_one(self, store: LightningStore, rollout: Any) -> tuple[list[Triplet], Optional[str], int]:
        """(triplets, skip reason or None, LLM spans without token IDs) of one rollout."""
        if rollout.status != "succeeded":
            return [], "not_succeeded", 0
        spans = store.query_spans(rollout.rollout_id, "latest")
        reward = final_reward(rollout.status, [s.attributes.get("reward") for s in spans if s.name == "reward"])
        if reward is None:
            return [], "no_reward", 0
        calls = [s for s in spans if s.name == LLM_SPAN_NAME]
        if not calls:
            return [], "no_llm_calls", 0
        group = str(rollout.metadata.get(self.group_key, rollout.rollout_id))
        out: list[Triplet] = []
        for turn, span in enumerate(calls):
            a = span.attributes
            if a.get(TOKEN_IDS_MISSING):
                raise ConfigError(
                    f"rollout {rollout.rollout_id}: LLM span {span.span_id} has no token IDs ({a[TOKEN_IDS_MISSING]}); "
                    "training on re-tokenized text would train on tokens the model never sampled. Serve the policy "
                    "with TransformersEngine or VLLMEngine (or an OpenAIEndpoint whose server honours "
                    "return_token_ids), and keep judge/eval endpoints out of training rollouts")
            if not a.get("completion_token_ids") or not a.get("prompt_token_ids"):
                continue
            out.append(Triplet(
                rollout_id=rollout.rollout_id, attempt_id=span.attempt_id, group_id=group, turn=turn,
                prompt_ids=list(a["prompt_token_ids"]), response_ids=list(a["completion_token_ids"]),
                logprobs=list(a["logprobs"]) if a.get("logprobs") else None, reward=reward,
                temperature=float(a.get("temperature", 1.0)), top_p=float(a.get("top_p", 1.0)),
                weight_version=a.get("weight_version"),
                finish_reason=(a.get("gen_ai.response.finish_reasons") or [None])[0],
                prompt_text=str(a.get("gen_ai.prompt", "")), response_text=str(a.get("gen_ai.completion", "")),
            ))
        missing = len(calls) - len(out)
        return out, (None if out else "no_token_ids"), missing


def triplets_df(triplets: Sequence[Triplet], advantages: Optional[dict[str, float]] = None) -> pd.DataFrame:
    """One row per triplet: ids, turn, reward, advantage (if given), token counts, response text."""
    columns = ["rollout_id", "group_id", "turn", "reward", "advantage", "prompt_tokens", "response_tokens",
               "response_text"]
    rows = []
    for t in triplets:
        rows.append({
            "rollout_id": t.rollout_id, "group_id": t.group_id, "turn": t.turn, "reward": t.reward,
            "advantage": (advantages or {}).get(t.rollout_id), "prompt_tokens": len(t.prompt_ids),
            "response_tokens": len(t.response_ids), "response_text": t.response_text,
        })
    return pd.DataFrame(rows, columns=columns)
