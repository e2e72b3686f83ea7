"""From a batch of triplets to what one update trains on: kept episodes, packed sequences, per-token advantages.

Both trainers keep episodes by the same rule (:func:`build_batch`: fresh enough for ``max_staleness``,
groups of at least ``min_group_size``, forks counted or refused), so
:class:`~lightning_nb.trainers.grpo.trainer.GRPOTrainer` and
:class:`~lightning_nb.trainers.verl.trainer.VerlTrainer` train on the same episodes and report the same
counts. The advantages follow ``GRPOConfig.credit`` (:func:`advantages`, from :mod:`lightning_nb.trainers.credit`).
It reads the config's shared fields only (:class:`~lightning_nb.trainers.config.TrainerConfig`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from lightning_nb.errors import ConfigError
from lightning_nb.trainers.config import TrainerConfig
from lightning_nb.trainers.credit import group_advantages, overlong_penalty, reward_to_go, transition_advantages
from lightning_nb.trainers.packing import PackedSequence, episodes_of, pack_episode
from lightning_nb.types import Triplet

__all__ = ["Batch", "build_batch", "advantages", "episode_rewards", "per_triplet_turn", "check_batch",
           "signal_groups"]


@dataclass
class Batch:
    """What one update trains on (its kept episodes' sequences) and what its metrics report about the rest."""

    seqs: list[PackedSequence]
    rewards: dict[str, float]  # episode -> reward as emitted (episodes not dropped as stale)
    groups: dict[str, str]  # episode -> group
    advantages: dict[str, float]  # kept episodes only (credit="reward_to_go": the mean over its turns)
    turn_advantages: dict[str, dict[int, float]]  # kept episode -> turn index (0..T-1, in turn order) -> advantage
    dropped: dict[str, int]  # undersized group -> size
    staleness: dict[str, int]  # episode -> weight versions behind
    stale: list[str]
    forks: int


def check_batch(triplets: Sequence[Triplet]) -> None:
    """Refuse a batch no trainer can train on.

    Raises:
        ConfigError: no triplets, a triplet with an empty response, or one sampled with ``top_p < 1``.
    """
    if not triplets:
        raise ConfigError("update() got no triplets; check that rollouts succeeded and emitted rewards")
    bad = [t.rollout_id for t in triplets if not t.response_ids]
    if bad:
        raise ConfigError(f"triplets of rollouts {bad[:3]} have empty response_ids; drop them before update()")
    truncated = [t.rollout_id for t in triplets if t.top_p < 1.0]
    if truncated:
        raise ConfigError(
            f"triplets of rollouts {truncated[:3]} were sampled with top_p < 1; the engine's log-probs are of "
            "the untruncated distribution, so the PPO ratio would be wrong: sample training rollouts with "
            "top_p=1 (the default; do not pass top_p in the agent's training calls)")


def build_batch(cfg: TrainerConfig, triplets: Sequence[Triplet], weight_version: int,
                score_kl: Optional[Callable[[list[PackedSequence]], None]] = None) -> Batch:
    """Episodes → packed sequences carrying per-token advantages (step 1 of ``GRPOTrainer.update``).

    ``weight_version`` is the engine's (``engine.weight_version``): an episode sampled more than
    ``max_staleness`` versions before it is dropped, and each kept sequence's ``staleness`` is set (versions
    between its oldest turn's and this one; 0 on-policy: :mod:`~lightning_nb.trainers.agreement` reads it).
    With ``credit="episode"`` (the default) the reward
    that goes into the group normalization of episode i, whose advantage every token of the episode gets, is::

        R_i = r_i + Σ_turns s_turn                            (intermediate rewards, Triplet.step_reward)
                  + Σ_turns overlong_penalty(|response|)     (overlong_buffer_len > 0)
                  − kl_coef · Σ_t kl_t                       (kl_mode="reward", kl_coef > 0)

    With ``credit="reward_to_go"`` each turn gets its own advantage (:func:`advantages`), and
    the tokens of a packed sequence carry the advantage of the turn they came with.

    * the soft overlong penalty of DAPO (:func:`~lightning_nb.trainers.credit.overlong_penalty`), summed
      over the episode's LLM calls (one call: DAPO's single response);
    * kl_t: the ``kl_penalty`` estimator of ``log π_start(t) − log π_ref(t)`` on each response
      token of the episode, π_start the trainer before this update. That is the per-token
      reward ``−β · kl_t`` of InstructGPT (Ouyang et al. 2022, eq. 2) as verl's
      ``apply_kl_penalty`` adds it to the token-level rewards, which GRPO's outcome
      advantage then sums per sequence (``compute_grpo_outcome_advantage``). ``score_kl(seqs)``
      sets each sequence's ``kl_sum`` (the trainer's forward); needed with ``kl_mode="reward"``.

    Raises:
        ConfigError: ``fail_on_fork`` is set and an episode's turns do not pack into one sequence.
    """
    episodes = episodes_of(triplets)
    packed = {r: pack_episode(ts, 0.0, cfg.pack_turns, mask_truncated=cfg.overlong_filter)
              for r, ts in episodes.items()}
    forks = [s for seqs in packed.values() for s in seqs if s.fork_at is not None]
    if forks and cfg.fail_on_fork:
        f = forks[0]
        raise ConfigError(
            f"rollout {f.rollout_id!r}: the prompt of turn {f.turn} does not extend the previous turn's prompt + "
            f"completion (first differing token at position {f.fork_at}), so it would train as a separate "
            f"sequence ({len(forks)} such fork(s) in this batch; GRPOConfig.fail_on_fork=True). Find the cause "
            "with lightning_nb.inspect.audit's token-fidelity check (the agent rewrote the history, or the reply "
            "re-tokenizes differently), or set fail_on_fork=False to train forks as separate sequences")
    # a replayed turn (Triplet.replayed: a branch's calls from its parent's record) is context, never trained: its
    # age does not make the episode stale
    staleness = {r: max((weight_version - t.weight_version for t in ts if t.weight_version is not None
                         and not t.replayed), default=0) for r, ts in episodes.items()}
    stale = [r for r, age in staleness.items() if age > cfg.max_staleness]
    for r in stale:  # too old to correct by importance weighting
        del episodes[r]
    groups = {r: ts[0].group_id for r, ts in episodes.items()}
    per_episode, by_turn, dropped = advantages(cfg, episodes, groups)
    seqs = [s for r in per_episode for s in packed[r]]
    if cfg.kl_coef > 0 and cfg.kl_mode == "reward" and seqs and score_kl is not None:  # credit="episode" (validated)
        score_kl([s for s in seqs if any(s.mask)])
        kl_sums: dict[str, list[float]] = {}
        for s in seqs:
            kl_sums.setdefault(s.rollout_id, []).append(s.kl_sum)
        per_episode, by_turn, _ = advantages(cfg, {r: episodes[r] for r in per_episode}, groups, kl_sums)
    for s in seqs:
        s.set_advantages(by_turn[s.rollout_id])
        s.staleness = weight_version - s.weight_version if s.weight_version is not None else 0
    return Batch(seqs=seqs, rewards={r: ts[0].reward for r, ts in episodes.items()}, groups=groups,
                 advantages=per_episode, turn_advantages=by_turn, dropped=dropped, staleness=staleness,
                 stale=stale, forks=len(forks))


def advantages(cfg: TrainerConfig, episodes: dict[str, list[Triplet]], groups: dict[str, str],
               kl_sums: Optional[dict[str, list[float]]] = None,
               ) -> tuple[dict[str, float], dict[str, dict[int, float]], dict[str, int]]:
    """The advantages of ``episodes`` under ``cfg.credit`` (one rule for the update and :func:`signal_groups`).

    * ``"episode"``: :func:`~lightning_nb.trainers.credit.group_advantages` of :func:`episode_rewards`
      (minus ``kl_coef`` × each of ``kl_sums[episode]``, the KL penalty of ``kl_mode="reward"``); every turn
      gets its episode's.
    * ``"reward_to_go"``: :func:`~lightning_nb.trainers.credit.reward_to_go` of the turns' step rewards
      (``Triplet.step_reward`` plus the turn's overlong penalty) and the final reward, with ``gamma``, then
      :func:`~lightning_nb.trainers.credit.transition_advantages` over each group's transitions.

    An episode whose triplets carry a ``baseline`` (:attr:`Triplet.baseline`, set by the algorithm) takes no part
    in its group's statistics: its advantage is its reward (``"episode"``: the shaped ``R_i`` of
    :func:`build_batch`; ``"reward_to_go"``: each turn's return) minus that baseline, not divided by a standard
    deviation (REINFORCE with a baseline, Williams 1992; Sutton & Barto 2018, section 13.4), and no group size
    drops it.

    Returns:
        ``(per_episode, per_turn, dropped)``: kept episode -> advantage (``reward_to_go``: the mean over its
        turns, for displays); kept episode -> {turn index 0..T−1 in turn order -> advantage}; undersized
        group -> episodes.
    """
    baselines = {r: ts[0].baseline for r, ts in episodes.items() if ts[0].baseline is not None}
    if cfg.credit == "reward_to_go":
        returns: dict[tuple[str, int], float] = {}
        for r, ts in episodes.items():
            ordered = sorted(ts, key=lambda t: t.turn)
            steps = [t.step_reward + overlong_penalty(len(t.response_ids), cfg.max_response_len or 0,
                                                      cfg.overlong_buffer_len, cfg.overlong_penalty_factor)
                     for t in ordered]
            for k, g in enumerate(reward_to_go(steps, ordered[0].reward, cfg.gamma)):
                returns[(r, k)] = g
        flat, dropped = transition_advantages({rk: g for rk, g in returns.items() if rk[0] not in baselines}, groups,
                                              min_group_size=cfg.min_group_size, norm_by_std=cfg.norm_adv_by_std)
        flat.update({rk: g - baselines[rk[0]] for rk, g in returns.items() if rk[0] in baselines})
        by_turn: dict[str, dict[int, float]] = {}
        for (r, k), a in flat.items():
            by_turn.setdefault(r, {})[k] = a
        return {r: sum(v.values()) / len(v) for r, v in by_turn.items()}, by_turn, dropped
    shaped = episode_rewards(cfg, episodes)
    for r, kls in (kl_sums or {}).items():
        for kl in kls:  # one subtraction per packed sequence, in order
            shaped[r] -= cfg.kl_coef * kl
    per_episode, dropped = group_advantages({r: v for r, v in shaped.items() if r not in baselines}, groups,
                                            min_group_size=cfg.min_group_size, norm_by_std=cfg.norm_adv_by_std)
    per_episode.update({r: shaped[r] - b for r, b in baselines.items()})
    return per_episode, {r: dict.fromkeys(range(len(episodes[r])), a) for r, a in per_episode.items()}, dropped


def episode_rewards(cfg: TrainerConfig, episodes: dict[str, list[Triplet]]) -> dict[str, float]:
    """Each episode's final reward plus its turns' intermediate rewards (``Triplet.step_reward``) and the
    soft overlong penalty of its responses (0 unless overlong_buffer_len > 0)."""
    shaped = {r: ts[0].reward + sum(t.step_reward for t in ts) for r, ts in episodes.items()}
    if cfg.overlong_buffer_len == 0:
        return shaped
    return {r: shaped[r] + sum(overlong_penalty(len(t.response_ids), cfg.max_response_len or 0,
                                                cfg.overlong_buffer_len, cfg.overlong_penalty_factor)
                               for t in ts) for r, ts in episodes.items()}


def signal_groups(cfg: TrainerConfig, triplets: Sequence[Triplet]) -> set[str]:
    """Group ids of ``triplets`` that an update would learn from: kept groups with a non-zero advantage.

    The same rule as the update (:func:`advantages` with ``cfg``: ``credit``, intermediate rewards, the
    soft overlong penalty); a group has signal when any of its turns has a non-zero advantage. Only the KL
    penalty of ``kl_mode="reward"`` is left out (it needs a forward pass); it rarely makes a group's rewards
    all equal or unequal.
    """
    episodes = episodes_of(triplets)
    groups = {r: ts[0].group_id for r, ts in episodes.items()}
    _, by_turn, _ = advantages(cfg, episodes, groups)
    return {groups[r] for r, advs in by_turn.items() if any(a != 0.0 for a in advs.values())}


def per_triplet_turn(triplets: Sequence[Triplet], by_turn: dict[str, dict[int, float]]) -> dict[tuple[str, int], float]:
    """``(rollout_id, Triplet.turn) -> advantage`` from the update's ``episode -> turn index -> advantage``."""
    episodes = episodes_of(triplets)
    return {(r, t.turn): advs[k] for r, advs in by_turn.items()
            for k, t in enumerate(sorted(episodes[r], key=lambda t: t.turn))}

