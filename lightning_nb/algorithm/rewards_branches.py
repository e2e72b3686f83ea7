"""What :class:`~lightning_nb.algorithm.lightning_rl.LightningRL` adds from :mod:`lightning_nb.replay`: a reward
function set from a cell (:meth:`RewardAndBranches.set_reward`) and branch groups in every step
(:class:`~lightning_nb.replay.branching.BranchConfig`). A mixin: it reads the algorithm's ``store``, ``trainer``,
``adapter``, ``branch``, ``_rng``, ``state``, ``wait_for``, ``_reporter`` and ``_finished_rewards``.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Optional, Sequence

from lightning_nb.errors import ConfigError
from lightning_nb.replay.branching import draw_branch_points, enqueue_branches
from lightning_nb.replay.rescoring import RewardFn, rescore, score

__all__ = ["RewardAndBranches", "reward_name"]


def reward_name(fn: Any) -> Optional[str]:
    """A reward function's name as the config log shows it (None: the agent's own reward)."""
    if fn is None:
        return None
    inner = getattr(fn, "func", fn)  # functools.partial
    return f"{getattr(inner, '__module__', '?')}.{getattr(inner, '__qualname__', type(inner).__name__)}"


class RewardAndBranches:
    """:meth:`set_reward` and the step's branch groups (see the module docstring)."""

    reward_fn: Optional[RewardFn]
    _reward_applied: Optional[str]
    _rescored: dict[str, float]
    last_branch: dict[str, Any]

    def _collect_branches(self, ids: Sequence[str]) -> list:
        """Enqueue and wait for :attr:`branch`'s groups of the step's episodes ``ids``; their triplets (under
        :attr:`reward_fn` when set). Sets :attr:`last_branch`: branch_groups, branch_groups_with_signal,
        branch_rollouts, branch_reward_mean."""
        cfg = self.branch
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
        self.last_branch.update(branch_groups_with_signal=len(self.trainer.signal_groups(new)) if new else 0,
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

    def state_dict(self) -> dict[str, Any]:
        """:class:`~lightning_nb.algorithm.checkpoint.RunCheckpoint`'s state, with the name of the reward function
        the last step trained on (``"reward_fn"``; None: the agent's reward)."""
        return {**super().state_dict(), "reward_fn": self._reward_applied}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; warns when the saved run trained on a reward function (:meth:`set_reward`)
        other than the one set now (functions are not saved)."""
        state = dict(state)
        name = state.pop("reward_fn", None)
        super().load_state_dict(state)
        self._reward_applied = name
        if name is not None and reward_name(self.reward_fn) != name:
            warnings.warn(f"the checkpoint's run trained on reward function {name} (set_reward); a function is not "
                          f"saved, and {'none' if self.reward_fn is None else reward_name(self.reward_fn)} is set "
                          "now: call algo.set_reward(fn) before resuming to keep it, or the next step logs the change",
                          stacklevel=2)

    def _apply_reward(self, triplets: list, rollout_ids: Sequence[str]) -> list:
        """``triplets`` of ``rollout_ids`` under :attr:`reward_fn` (succeeded rollouts; a failed one stays 0)."""
        rewards = {e.rollout_id: score(self.reward_fn, e)[0]
                   for e in self.store.episodes(list(rollout_ids)) if e.status == "succeeded"}
        self._rescored.update(rewards)
        return rescore(triplets, rewards)
