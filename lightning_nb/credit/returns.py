"""Rewards to advantages: GRPO's group advantage, Dr. GRPO, DAPO's overlong penalty, reward-to-go.

Functions of plain dicts and floats (torch only inside :func:`group_advantages`). The algorithm calls them through
:mod:`lightning_nb.credit.assign` before each update (``lightning_nb.trainers.credit`` in earlier versions).
"""

from __future__ import annotations

from typing import Any, Hashable, Sequence, TypeVar

from lightning_nb.errors import ConfigError
from lightning_nb.credit.normalize import group_relative_advantages

#: an item of a group: an episode (rollout id), or a transition (rollout id, turn)
K = TypeVar("K", bound=Hashable)

__all__ = ["overlong_penalty", "group_advantages", "reward_to_go", "transition_advantages"]


def overlong_penalty(length: int, max_len: int, buffer_len: int, factor: float = 1.0) -> float:
    """DAPO's soft overlong punishment of a response of ``length`` tokens (Yu et al. 2025, section 3.4, eq. 13).

    With ``L_max = max_len`` and ``L_cache = buffer_len``::

        0                                       if length <= L_max − L_cache
        ((L_max − L_cache) − length) / L_cache  if L_max − L_cache < length <= L_max
        −1                                      if length > L_max

    times ``factor`` (verl's ``overlong_buffer.penalty_factor``). ``buffer_len`` 0 turns it off (0).
    """
    if buffer_len <= 0:
        return 0.0
    return factor * min(0.0, max(-1.0, (max_len - buffer_len - length) / buffer_len))


def group_advantages(rewards: dict[K, float], groups: dict[K, str], *, min_group_size: int = 2,
                     norm_by_std: bool = True) -> tuple[dict[K, float], dict[str, int]]:
    """GRPO's group-relative outcome advantage per episode, with undersized groups dropped.

    For the episodes ``i`` of a group ``g`` with rewards ``r_i``:
    ``A_i = (r_i - mean_g(r)) / (std_g(r) + 1e-6)`` with the unbiased std (``norm_by_std``;
    GRPO, Shao et al. 2024, "DeepSeekMath", section 4.1.2; computed by verl's
    ``compute_grpo_outcome_advantage``), or ``A_i = r_i - mean_g(r)`` without it (Dr. GRPO,
    Liu et al. 2025). Rewards ``[1, 0, 0, 0]`` give ``[1.5, -0.5, -0.5, -0.5]``.

    A group with fewer than ``min_group_size`` episodes (failures, timeouts and adapter
    skips shrink groups) is dropped: with one episode verl would use mean 0 and std 1,
    training the survivor on its raw reward, and two or three samples make a poor baseline.

    Args:
        rewards: episode (rollout) id -> final reward.
        groups: episode id -> group id (same keys as ``rewards``).
        min_group_size: smallest group kept (>= 2).
        norm_by_std: divide by the group std.

    Returns:
        ``(advantages, dropped)``: episode id -> advantage for the kept episodes, and
        group id -> size for the dropped groups.

    Raises:
        ConfigError: ``min_group_size`` < 2, or ``groups`` lacks an episode of ``rewards``.
    """
    import torch

    dropped = _undersized_groups(rewards, groups, min_group_size)
    kept = [e for e in rewards if groups[e] not in dropped]
    if not kept:
        return {}, dropped
    rewards_E = torch.tensor([rewards[e] for e in kept], dtype=torch.float32)
    adv_E = group_relative_advantages(rewards_E, [groups[e] for e in kept], norm_by_std=norm_by_std)
    return {e: float(a) for e, a in zip(kept, adv_E)}, dropped


def _undersized_groups(episodes: Sequence[K] | dict[K, Any], groups: dict[K, str],
                       min_group_size: int) -> dict[str, int]:
    """Group id -> number of episodes, for the groups of ``episodes`` with fewer than ``min_group_size``.

    Raises:
        ConfigError: ``min_group_size`` < 2, or ``groups`` lacks one of ``episodes``.
    """
    if min_group_size < 2:
        raise ConfigError(f"min_group_size must be >= 2, got {min_group_size}: a group of one has no baseline")
    missing = [e for e in episodes if e not in groups]
    if missing:
        raise ConfigError(f"groups has no group for episode {missing[0]!r}")
    sizes: dict[str, int] = {}
    for e in episodes:
        sizes[groups[e]] = sizes.get(groups[e], 0) + 1
    return {g: n for g, n in sizes.items() if n < min_group_size}


def reward_to_go(step_rewards: Sequence[float], final_reward: float, gamma: float = 1.0) -> list[float]:
    """Discounted return of each turn of one episode (``AlgorithmConfig.credit="reward_to_go"``).

    For turns ``t = 0..T-1`` with step rewards ``s_t`` (intermediate rewards, reward units) and
    the episode's final reward ``R`` (arriving after the last turn)::

        G_t = Σ_{k≥t} γ^(k−t) s_k + γ^(T−1−t) R         (Sutton & Barto 2018, §3.3)

    computed backwards, ``G_{T−1} = s_{T−1} + R`` and ``G_t = s_t + γ G_{t+1}``. Steps ``[0.5, 0, 0]``,
    ``R = 1`` and ``γ = 0.5`` give ``[0.75, 0.5, 1.0]``. ``[]`` gives ``[]``.
    """
    out = [0.0] * len(step_rewards)
    ahead = float(final_reward)
    for t in range(len(step_rewards) - 1, -1, -1):
        out[t] = float(step_rewards[t]) + ahead
        ahead = gamma * out[t]
    return out


def transition_advantages(returns: dict[tuple[str, int], float], groups: dict[str, str], *, min_group_size: int = 2,
                          norm_by_std: bool = True) -> tuple[dict[tuple[str, int], float], dict[str, int]]:
    """GRPO's group-relative advantage per transition, with groups of too few episodes dropped.

    For the transitions ``(i, t)`` (episode i, turn t) of a group ``g`` with returns ``G_it``
    (:func:`reward_to_go`): ``A_it = (G_it − mean_g G) / (std_g G + 1e-6)`` over all of the group's
    transitions (unbiased std; ``norm_by_std=False``: ``G_it − mean_g G``), computed by
    :func:`group_advantages` (verl's ``compute_grpo_outcome_advantage``) with one item per
    transition. An episode with more turns puts more items into the mean and std, so it weighs
    more in the group statistics than under per-episode normalization.

    A group is dropped when it has fewer than ``min_group_size`` **episodes** (not transitions).

    Args:
        returns: ``(episode id, turn index)`` -> return.
        groups: episode id -> group id (every episode of ``returns``).

    Returns:
        ``(advantages, dropped)``: ``(episode, turn)`` -> advantage for the kept groups, and group id -> episodes
        for the dropped ones.

    Raises:
        ConfigError: ``min_group_size`` < 2, or ``groups`` lacks an episode of ``returns``.
    """
    dropped = _undersized_groups(list(dict.fromkeys(e for e, _ in returns)), groups, min_group_size)
    kept = {k: v for k, v in returns.items() if groups[k[0]] not in dropped}
    # every kept group has >= 2 episodes, so >= 2 transitions: group_advantages drops nothing more
    advantages, _ = group_advantages(kept, {k: groups[k[0]] for k in kept}, min_group_size=2, norm_by_std=norm_by_std)
    return advantages, dropped
