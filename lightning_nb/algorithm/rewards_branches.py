"""What :class:`~lightning_nb.algorithm.lightning_rl.LightningRL` adds from :mod:`lightning_nb.replay`: a reward
function set from a cell (:meth:`RewardAndBranches.set_reward`) and branch groups in every step
(:class:`~lightning_nb.replay.branching.BranchConfig`). :class:`RewardAndBranches` is the algorithm class
LightningRL derives from; it declares what it reads of LightningRL (``adapter``, ``branch``, the task sampler's
``_rng``, ``_reporter`` and ``_finished_rewards``).
"""

from __future__ import annotations

import abc
import math
import random
import warnings
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from lightning_nb.algorithm.credit import CreditAssignment
from lightning_nb.errors import ConfigError
from lightning_nb.replay.branching import draw_branch_points, enqueue_branches
from lightning_nb.replay.rescoring import RewardFn, rescore, score

if TYPE_CHECKING:
    from lightning_nb.adapter import TripletAdapter
    from lightning_nb.replay.branching import BranchConfig
    from lightning_nb.store.base import LightningStore
    from lightning_nb.trainers.base import Trainer
    from lightning_nb.types import Triplet

__all__ = ["RewardAndBranches", "reward_name"]


def reward_name(fn: Any) -> Optional[str]:
    """A reward function's name as the config log shows it (None: the agent's own reward)."""
    if fn is None:
        return None
    inner = getattr(fn, "func", fn)  # functools.partial
    return f"{getattr(inner, '__module__', '?')}.{getattr(inner, '__qualname__', type(inner).__name__)}"


class RewardAndBranches(CreditAssignment):
    """:meth:`set_reward` and the step's branch groups of a trainer-based algorithm (see the module docstring)."""

    store: "LightningStore"
    trainer: "Trainer"
    adapter: "TripletAdapter"
    branch: "Optional[BranchConfig]"
    _rng: random.Random
    reward_fn: Optional[RewardFn]
    _reward_applied: Optional[str]  # the name of the reward function the last step used
    _rescored: dict[str, float]  # the step's rollouts' rewards under reward_fn
    last_branch: dict[str, Any]

    @abc.abstractmethod
    def _reporter(self, phase: str, step: int, n: int, before: int = 0) -> Callable[[int, int], None]:
        """The ``on_progress`` of :meth:`wait_for` that reports ``phase`` of ``step``."""

    @abc.abstractmethod
    def _finished_rewards(self, rollout_ids: Sequence[str]) -> dict[str, float]:
        """Final rewards of the finished rollouts of ``rollout_ids``, keyed by rollout id."""

    def _collect_branches(self, ids: Sequence[str]) -> "list[Triplet]":
        """Enqueue and wait for :attr:`branch`'s groups of the step's episodes ``ids``; their triplets (under
        :attr:`reward_fn` when set). Sets :attr:`last_branch`: branch_groups, branch_groups_with_signal,
        branch_rollouts, branch_reward_mean."""
        cfg = self.branch
        assert cfg is not None, "called with branch set only"
        points = draw_branch_points(self.store.episodes(list(ids)), cfg, self._rng)
        branch_ids: list[str] = []
        for rid, k in points:
            branch_ids += enqueue_branches(self.store, rid, k, cfg.n, cfg.sampling)
        self.last_branch = {"branch_groups": len(points), "branch_groups_with_signal": 0, "branch_rollouts": 0,
                            "branch_reward_mean": math.nan}
        if not branch_ids:
            return []
        self.wait_for(branch_ids, on_progress=self._reporter("branches", self.global_step + 1, len(branch_ids)))
        new = self.adapter.adapt(self.store, branch_ids)
        if self.reward_fn is not None:
            new = self._apply_reward(new, branch_ids)
        rewards = [self._rescored.get(rid, r) for rid, r in self._finished_rewards(branch_ids).items()]
        self.last_branch.update(branch_groups_with_signal=len(self.signal_groups(new)) if new else 0,
                                branch_rollouts=len(branch_ids),
                                branch_reward_mean=sum(rewards) / len(rewards) if rewards else math.nan)
        return new

    def set_reward(self, reward_fn: Optional[RewardFn]) -> None:
        """Train on ``reward_fn(task, episode)`` instead of the agent's reward, from the next step on (None: back to
        the agent's).

        ``reward_fn`` is :func:`~lightning_nb.replay.rescoring.what_if`'s: ``(task, Episode) -> float | dict of
        components`` (a dict's sum is the reward). Each step's finished rollouts are scored with it after the
        runners finish them (:func:`~lightning_nb.replay.rescoring.rescore`: the new reward replaces the recorded one
        and its intermediate rewards in the triplets), so dynamic sampling, the advantages and the step's
        ``reward_mean`` use it; ``reward_recorded_mean`` is then the agent's own reward of the same rollouts. The
        reward spans stay as the agent recorded them, and :meth:`evaluate` still reports the agent's reward (the
        task's measure). Try a function first with ``what_if(reward_fn, algo=algo)``.

        The change is logged at the next step in :attr:`config_changes` (field ``"reward"``, old and new the
        functions' names) and the step's ``config_changes`` column. A checkpoint saves the function's name, not
        the function: :meth:`load` warns when the checkpoint's run used one and none is set.

        Raises:
            ConfigError: the loop is running (call :meth:`pause` first), or ``reward_fn`` is not callable.
        """
        if self.state in ("running", "pausing"):
            raise ConfigError(f"set_reward() while the loop is {self.state}: call algo.pause() first; the new reward "
                              "applies from the next step, after algo.resume()")
        if reward_fn is not None and not callable(reward_fn):
            raise ConfigError(f"set_reward(reward_fn={reward_fn!r}): pass a function (task, episode) -> float | dict, "
                              "or None for the agent's own reward")
        self.reward_fn = reward_fn

    def restore_reward_name(self, name: Optional[str]) -> None:
        """A checkpoint's reward-function name (``state_dict()["reward_fn"]``) becomes the last applied; warns when it
        names a function other than the one set now (functions are not saved)."""
        self._reward_applied = name
        if name is not None and reward_name(self.reward_fn) != name:
            warnings.warn(f"the checkpoint's run trained on reward function {name} (set_reward); a function is not "
                          f"saved, and {'none' if self.reward_fn is None else reward_name(self.reward_fn)} is set "
                          "now: call algo.set_reward(fn) before resuming to keep it, or the next step logs the change",
                          stacklevel=4)

    def _apply_reward(self, triplets: "list[Triplet]", rollout_ids: Sequence[str]) -> "list[Triplet]":
        """``triplets`` of ``rollout_ids`` under :attr:`reward_fn` (succeeded rollouts; a failed one stays 0)."""
        reward_fn = self.reward_fn
        assert reward_fn is not None, "called with a reward function set only"
        rewards = {e.rollout_id: score(reward_fn, e)[0]
                   for e in self.store.episodes(list(rollout_ids)) if e.status == "succeeded"}
        self._rescored.update(rewards)
        return rescore(triplets, rewards)
