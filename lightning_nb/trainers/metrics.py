"""The metrics row both trainers report about a batch: rewards, episodes, groups, drops, forks (same names, same rules)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Sequence

from lightning_nb.types import Triplet

if TYPE_CHECKING:
    from lightning_nb.trainers.batch import Batch

__all__ = ["mean", "std", "batch_metrics"]


def mean(values: Sequence[float]) -> float:
    """The mean; NaN for no values."""
    return sum(values) / len(values) if values else math.nan


def std(values: Sequence[float]) -> float:
    """The unbiased standard deviation; 0.0 for one value, NaN for none."""
    if len(values) < 2:
        return 0.0 if values else math.nan
    m = mean(values)
    return math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))


def batch_metrics(triplets: Sequence[Triplet], batch: "Batch", signal: set[str],
                  changes: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The columns of an update's metrics row that describe its batch (see ``GRPOTrainer.update``), as
    ``(head, tail)``: a trainer's row is ``step`` and its loss columns, ``head``, its own columns, ``tail``.

    ``head``: ``reward_mean``/``reward_std`` over the kept episodes' rewards as emitted, ``episodes``,
    ``groups``, ``groups_with_signal`` (``len(signal)``), ``groups_dropped``, ``episodes_dropped``,
    ``transitions``, ``stale_episodes_dropped``, ``staleness_max``. ``tail``: ``turn_forks``,
    ``truncated_responses`` (triplets with ``finish_reason == "length"``), ``intermediate_rewards``
    (triplets with ``step_reward != 0``) and ``config_changes`` (``changes`` joined by ``"; "``).
    """
    kept_rewards = [batch.rewards[r] for r in batch.advantages]
    head = {
        "reward_mean": mean(kept_rewards), "reward_std": std(kept_rewards),
        "episodes": len(batch.advantages), "groups": len({batch.groups[r] for r in batch.advantages}),
        "groups_with_signal": len(signal), "groups_dropped": len(batch.dropped),
        "episodes_dropped": sum(batch.dropped.values()), "transitions": len(triplets),
        "stale_episodes_dropped": len(batch.stale), "staleness_max": max(batch.staleness.values(), default=0),
    }
    tail = {
        "turn_forks": batch.forks, "truncated_responses": sum(1 for t in triplets if t.finish_reason == "length"),
        "intermediate_rewards": sum(1 for t in triplets if t.step_reward != 0.0),
        "config_changes": "; ".join(changes),
    }
    return head, tail
