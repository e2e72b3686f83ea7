"""Adapters: spans → triplets for RL.

LightningRL credit assignment (Agent Lightning paper, §3.2): every LLM call of
an episode is one transition (prompt tokens → response tokens) and carries the
episode's final reward; episodes of the same task form one GRPO group. Token IDs
come from the LLM proxy's spans and are never re-tokenized.
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

import pandas as pd

from lightning_nb.proxy import LLM_SPAN_NAME
from lightning_nb.store.base import LightningStore
from lightning_nb.types import Triplet

__all__ = ["TripletAdapter", "triplets_df"]

log = logging.getLogger(__name__)


class TripletAdapter:
    """Turn the latest attempt of each rollout into triplets.

    Rollouts that did not succeed or have no reward span are skipped (counted in
    :attr:`skipped`), as are LLM spans without token IDs.

    Args:
        group_key: rollout metadata key naming the GRPO group (default ``group_id``;
            falls back to the rollout id, i.e. no grouping).
    """

    def __init__(self, group_key: str = "group_id") -> None:
        self.group_key = group_key
        self.skipped: dict[str, int] = {"no_reward": 0, "not_succeeded": 0, "no_token_ids": 0}

    def adapt(self, store: LightningStore, rollout_ids: Sequence[str]) -> list[Triplet]:
        triplets: list[Triplet] = []
        for rollout in store.query_rollouts(rollout_ids=list(rollout_ids)):
            if rollout.status != "succeeded":
                self.skipped["not_succeeded"] += 1
                continue
            spans = store.query_spans(rollout.rollout_id, "latest")
            rewards = [s for s in spans if s.name == "reward"]
            if not rewards:
                self.skipped["no_reward"] += 1
                continue
            reward = float(rewards[-1].attributes["reward"])
            group = str(rollout.metadata.get(self.group_key, rollout.rollout_id))
            calls = [s for s in spans if s.name == LLM_SPAN_NAME]
            for turn, span in enumerate(calls):
                a = span.attributes
                if not a.get("completion_token_ids") or not a.get("prompt_token_ids"):
                    self.skipped["no_token_ids"] += 1
                    continue
                triplets.append(Triplet(
                    rollout_id=rollout.rollout_id, attempt_id=span.attempt_id, group_id=group, turn=turn,
                    prompt_ids=list(a["prompt_token_ids"]), response_ids=list(a["completion_token_ids"]),
                    logprobs=list(a["logprobs"]) if a.get("logprobs") else None, reward=reward,
                    temperature=float(a.get("temperature", 1.0)),
                    prompt_text=str(a.get("gen_ai.prompt", "")), response_text=str(a.get("gen_ai.completion", "")),
                ))
        return triplets


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
