"""The credit options of an algorithm's config (``AlgorithmConfig``, ``TrafficConfig``): how rewards become advantages.

What the algorithm does with them is :mod:`lightning_nb.algorithm.credit`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from lightning_nb.errors import ConfigError

__all__ = ["CreditOptions"]


@dataclass(kw_only=True)
class CreditOptions:
    """How rewards become advantages: the algorithm's options (fields of ``AlgorithmConfig`` and ``TrafficConfig``).

    Keyword-only, after the config's own fields. :meth:`validate_credit` checks them (the config's ``validate``
    calls it).
    """

    credit: str = field(default="episode", metadata={
        "help": "How rewards become per-turn credit (Triplet.reward = final reward R, Triplet.step_reward = s_t, the "
                "intermediate rewards of turn t, emit_intermediate_reward). 'episode' (LightningRL, Agent Lightning "
                "§3.2): every turn of episode i gets A_i, GRPO's group-normalised R_i = R + Σ_t s_t (+ overlong "
                "penalty). 'reward_to_go': turn t of T gets the discounted return G_t = Σ_{k≥t} γ^(k−t) s_k + "
                "γ^(T−1−t) R (Sutton & Barto §3.3; s_k includes turn k's overlong penalty), normalised over all "
                "transitions (i, t) of the group: A_it = (G_it − mean_g G) / (std_g G + 1e-6) (verl "
                "compute_grpo_outcome_advantage, one item per transition), so episodes with more turns weigh more "
                "in the group statistics; min_group_size still counts episodes. GRPOConfig.credit in earlier "
                "versions."})
    gamma: float = field(default=1.0, metadata={
        "help": "Discount γ in (0, 1] of credit='reward_to_go' per turn (LLM call), not per token; 1 = undiscounted. "
                "credit='episode' refuses any other value."})
    norm_adv_by_std: bool = field(default=True, metadata={
        "help": "Divide group-relative advantages by the group std (GRPO); False: Dr. GRPO (Liu et al. 2025)."})
    min_group_size: int = field(default=2, metadata={
        "help": "Groups with fewer episodes than this (after failures, timeouts, adapter skips and stale episodes) "
                "are left out of the update and counted in groups_dropped; must be >= 2 (a group of one has no "
                "baseline)."})
    overlong_buffer_len: int = field(default=0, metadata={
        "help": "L_cache of DAPO's soft overlong punishment (Yu et al. 2025, eq. 13): responses longer than "
                "L_max − overlong_buffer_len tokens lose up to overlong_penalty_factor of reward, linearly; L_max is "
                "the max_tokens rollouts sample with. 0 = off."})
    overlong_penalty_factor: float = field(default=1.0, metadata={
        "help": "Largest soft overlong penalty (reward units), reached at L_max tokens."})

    def validate_credit(self, max_response_len: Optional[int]) -> None:
        """Raise ConfigError naming the first credit field out of range; ``max_response_len`` is L_max (tokens; None
        where the algorithm has none, and then ``overlong_buffer_len`` must be 0)."""
        name = type(self).__name__
        g = self.gamma
        rules = [
            ("credit", self.credit in ("episode", "reward_to_go"), "'episode' or 'reward_to_go'",
             "use 'episode' (every turn gets its episode's advantage) or 'reward_to_go' (per-turn returns)"),
            ("gamma", isinstance(g, (int, float)) and not isinstance(g, bool) and math.isfinite(g) and 0 < g <= 1,
             "a float in (0, 1]", "use 1.0 for undiscounted returns"),
            ("gamma", g == 1.0 or self.credit == "reward_to_go", "1.0 with credit='episode'",
             "set credit='reward_to_go' to discount per turn (credit='episode' gives every turn the episode's "
             "return, so there is nothing to discount)"),
            ("norm_adv_by_std", isinstance(self.norm_adv_by_std, bool), "True or False", "use False for Dr. GRPO"),
            ("min_group_size", isinstance(self.min_group_size, int) and self.min_group_size >= 2, "an int >= 2",
             "a group of one has no baseline"),
            ("overlong_buffer_len", isinstance(self.overlong_buffer_len, int) and self.overlong_buffer_len >= 0 and (
                self.overlong_buffer_len == 0 or self.overlong_buffer_len < (max_response_len or 0)),
             f"0 (off) or an int in [1, {max_response_len}) (L_max = max_tokens)" if max_response_len else "0",
             "DAPO uses a quarter of max_tokens"),
            ("overlong_penalty_factor", self.overlong_penalty_factor >= 0, ">= 0", "DAPO uses 1.0"),
        ]
        for f, ok, allowed, fix in rules:
            if not ok:
                raise ConfigError(f"{name}.{f}={getattr(self, f)!r} is invalid: it must be {allowed}; {fix}")
