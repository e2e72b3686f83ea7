"""From a batch of triplets to what one update trains on: kept episodes, packed sequences, per-token advantages.

The advantages are the algorithm's (:mod:`lightning_nb.credit`): each triplet of the batch carries them
(:attr:`Triplet.advantages <lightning_nb.types.Triplet.advantages>`), and :func:`build_batch` packs them with the
tokens, not computing them again. Both trainers keep episodes by the same rule (fresh enough for ``max_staleness``;
forks counted or refused), so :class:`~lightning_nb.trainers.grpo.trainer.GRPOTrainer` and
:class:`~lightning_nb.trainers.verl.trainer.VerlTrainer` train on the same episodes and report the same counts.
For one release a batch whose triplets carry no advantages is credited here as earlier versions did, from the
trainer config's deprecated credit fields (a DeprecationWarning).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from lightning_nb.credit import CreditRule, assign, episodes_of
from lightning_nb.credit import advantages as credit_advantages
from lightning_nb.credit import episode_rewards as credit_episode_rewards
from lightning_nb.errors import ConfigError
from lightning_nb.trainers.config import TrainerConfig
from lightning_nb.trainers.packing import PackedSequence, pack_episode
from lightning_nb.types import Triplet

__all__ = ["Batch", "build_batch", "advantages", "episode_rewards", "per_triplet_turn", "check_batch",
           "signal_groups", "staleness_of"]


@dataclass
class Batch:
    """What one update trains on (its kept episodes' sequences) and what its metrics report about the rest."""

    seqs: list[PackedSequence]
    rewards: dict[str, float]  # episode -> reward as emitted (episodes not dropped as stale)
    groups: dict[str, str]  # episode -> group
    advantages: dict[str, float]  # kept episodes only (per-turn advantages that differ: the mean over its turns)
    turn_advantages: dict[str, dict[int, float]]  # kept episode -> turn index (0..T-1, in turn order) -> advantage
    dropped: dict[str, int]  # group left out by the credit (undersized) -> its episodes
    staleness: dict[str, int]  # episode -> weight versions behind
    stale: list[str]
    forks: int


def check_batch(triplets: Sequence[Triplet], left_out: Sequence[Triplet] = ()) -> None:
    """Refuse a batch no trainer can train on.

    Raises:
        ConfigError: no triplets at all, a triplet with an empty response, one sampled with ``top_p < 1``, or a batch
            where some triplets carry advantages and others do not.
    """
    if not triplets and not left_out:
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
    missing = [t.rollout_id for t in triplets if t.advantages is None]
    if missing and (left_out or len(missing) < len(triplets)):
        raise ConfigError(f"triplets of rollouts {missing[:3]} carry no advantages while others do: give every "
                          "triplet to train its Triplet.advantages (lightning_nb.credit.assign), and pass the ones "
                          "not to train as update(..., left_out=...)")


def staleness_of(triplets: Sequence[Triplet], weight_version: int) -> dict[str, int]:
    """Episode (rollout id) -> weight versions between its oldest sampled turn and ``weight_version`` (0 when none
    recorded one). A replayed turn (:attr:`Triplet.replayed`: a branch's calls from its parent's record) is context,
    never trained: its age does not count."""
    return {r: max((weight_version - t.weight_version for t in ts if t.weight_version is not None
                    and not t.replayed), default=0) for r, ts in episodes_of(triplets).items()}


def build_batch(cfg: TrainerConfig, triplets: Sequence[Triplet], weight_version: int,
                score_kl: Optional[Callable[[list[PackedSequence]], None]] = None,
                left_out: Sequence[Triplet] = ()) -> Batch:
    """Episodes → packed sequences carrying the triplets' per-token advantages (step 1 of ``GRPOTrainer.update``).

    ``triplets`` carry :attr:`Triplet.advantages` (the algorithm's credit, :mod:`lightning_nb.credit`); the tokens
    of a packed sequence get the advantages of the response they belong to (the context tokens between turns, mask
    0, the first of the next turn's). ``left_out`` are triplets of the batch the credit does not train (a group under
    ``min_group_size``): not packed, counted in the metrics (``groups_dropped``, ``episodes_dropped``,
    ``transitions``).

    ``weight_version`` is the engine's (``engine.weight_version``): an episode sampled more than
    ``max_staleness`` versions before it is dropped (``stale``; the algorithm leaves such episodes out of its
    credit first, ``Trainer.stale_rollouts``), and each kept sequence's ``staleness`` is set (versions
    between its oldest turn's and this one; 0 on-policy: :mod:`~lightning_nb.trainers.agreement` reads it).

    Deprecated path (one release): when no triplet carries advantages and ``left_out`` is empty, the advantages are
    computed here as in earlier versions, from ``cfg``'s credit fields and :attr:`Triplet.baseline`, with the KL
    penalty of ``kl_mode="reward"``: ``R_i − kl_coef · Σ_t kl_t``, kl_t the ``kl_penalty`` estimator of
    ``log π_start(t) − log π_ref(t)`` (InstructGPT, Ouyang et al. 2022, eq. 2; verl ``apply_kl_penalty``), which
    ``score_kl(seqs)`` measures by setting each sequence's ``kl_sum`` (the trainer's forward).

    Raises:
        ConfigError: ``fail_on_fork`` is set and an episode's turns do not pack into one sequence; or
            ``kl_mode="reward"`` with ``kl_coef > 0`` on a batch that carries its advantages (the penalty enters the
            rewards before the group statistics, which are the algorithm's now: use ``kl_mode="loss"``).
    """
    if not left_out and triplets and all(t.advantages is None for t in triplets):
        return _legacy_batch(cfg, triplets, weight_version, score_kl)
    if cfg.kl_coef > 0 and cfg.kl_mode == "reward":
        raise ConfigError("GRPOConfig.kl_mode='reward' subtracts the KL penalty from the rewards before the group "
                          "statistics, and these triplets carry the algorithm's advantages already: set "
                          "kl_mode='loss' (the KL term in the loss, per token)")
    staleness = staleness_of(list(triplets) + list(left_out), weight_version)
    stale = [r for r, age in staleness.items() if age > cfg.max_staleness]
    episodes = {r: ts for r, ts in episodes_of(triplets).items() if r not in stale}
    packed, forks = _pack(cfg, episodes_of(list(triplets) + list(left_out)))  # forks counted over the whole batch
    rest = {r: ts for r, ts in episodes_of(left_out).items() if r not in stale and r not in episodes}
    trained_groups = {ts[0].group_id for ts in episodes.values()}
    dropped: dict[str, int] = {}
    for ts in rest.values():
        if ts[0].group_id not in trained_groups:
            dropped[ts[0].group_id] = dropped.get(ts[0].group_id, 0) + 1
    by_turn = {r: {k: _summary(t.advantages or []) for k, t in enumerate(sorted(ts, key=lambda t: t.turn))}
               for r, ts in episodes.items()}
    seqs = [s for r in episodes for s in packed[r]]
    for s in seqs:
        s.summarize_advantages()
        s.staleness = weight_version - s.weight_version if s.weight_version is not None else 0
    kept = {**rest, **episodes}
    return Batch(seqs=seqs, rewards={r: ts[0].reward for r, ts in kept.items()},
                 groups={r: ts[0].group_id for r, ts in kept.items()},
                 advantages={r: _summary(list(v.values())) for r, v in by_turn.items()}, turn_advantages=by_turn,
                 dropped=dropped, staleness=staleness, stale=stale, forks=forks)


def _summary(values: list[float]) -> float:
    """One number for several advantages (a turn's tokens, an episode's turns): the value when all are equal (a
    float mean of n copies can round), else their mean; 0.0 for none."""
    if not values:
        return 0.0
    return values[0] if len(set(values)) == 1 else sum(values) / len(values)


def _pack(cfg: TrainerConfig, episodes: dict[str, list[Triplet]]) -> tuple[dict[str, list[PackedSequence]], int]:
    """Each episode's packed sequences, and the number of forks.

    Raises:
        ConfigError: ``fail_on_fork`` is set and an episode's turns do not pack into one sequence.
    """
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
    return packed, len(forks)


def _legacy_batch(cfg: TrainerConfig, triplets: Sequence[Triplet], weight_version: int,
                  score_kl: Optional[Callable[[list[PackedSequence]], None]]) -> Batch:
    """:func:`build_batch` of earlier versions: the advantages computed from ``cfg``'s credit fields (deprecated)."""
    warnings.warn("Trainer.update() got triplets without advantages and computes them from the trainer config's "
                  "credit fields, as earlier versions did; credit is the algorithm's step now (AlgorithmConfig.credit, "
                  "lightning_nb.credit.assign sets Triplet.advantages): this path goes in the next release",
                  DeprecationWarning, stacklevel=4)
    rule = CreditRule.from_config(cfg)
    all_episodes = episodes_of(triplets)
    packed, forks = _pack(cfg, all_episodes)
    staleness = staleness_of(triplets, weight_version)
    stale = [r for r, age in staleness.items() if age > cfg.max_staleness]
    episodes = {r: ts for r, ts in all_episodes.items() if r not in stale}  # too old to correct by importance weights
    groups = {r: ts[0].group_id for r, ts in episodes.items()}
    baselines = {r: ts[0].baseline for r, ts in episodes.items() if ts[0].baseline is not None}
    per_episode, by_turn, dropped = credit_advantages(rule, episodes, groups, baselines=baselines)
    seqs = [s for r in per_episode for s in packed[r]]
    if cfg.kl_coef > 0 and cfg.kl_mode == "reward" and seqs and score_kl is not None:  # credit="episode" (validated)
        score_kl([s for s in seqs if any(s.mask)])
        kl_sums: dict[str, list[float]] = {}
        for s in seqs:
            kl_sums.setdefault(s.rollout_id, []).append(cfg.kl_coef * s.kl_sum)
        per_episode, by_turn, _ = credit_advantages(rule, {r: episodes[r] for r in per_episode}, groups, kl_sums,
                                                    baselines=baselines)
    for s in seqs:
        s.set_advantages(by_turn[s.rollout_id])
        s.staleness = weight_version - s.weight_version if s.weight_version is not None else 0
    return Batch(seqs=seqs, rewards={r: ts[0].reward for r, ts in episodes.items()}, groups=groups,
                 advantages=per_episode, turn_advantages=by_turn, dropped=dropped, staleness=staleness,
                 stale=stale, forks=forks)


def advantages(cfg: TrainerConfig, episodes: dict[str, list[Triplet]], groups: dict[str, str],
               kl_sums: Optional[dict[str, list[float]]] = None,
               ) -> tuple[dict[str, float], dict[str, dict[int, float]], dict[str, int]]:
    """Deprecated: :func:`lightning_nb.credit.advantages` with ``CreditRule.from_config(cfg)`` (``kl_sums`` here
    unscaled: each is multiplied by ``cfg.kl_coef``; baselines from :attr:`Triplet.baseline`)."""
    warnings.warn("lightning_nb.trainers.batch.advantages moved to lightning_nb.credit.advantages (credit is the "
                  "algorithm's step); the old name goes in the next release", DeprecationWarning, stacklevel=2)
    scaled = {r: [cfg.kl_coef * kl for kl in kls] for r, kls in (kl_sums or {}).items()}
    baselines = {r: ts[0].baseline for r, ts in episodes.items() if ts[0].baseline is not None}
    return credit_advantages(CreditRule.from_config(cfg), episodes, groups, scaled, baselines=baselines)


def episode_rewards(cfg: TrainerConfig, episodes: dict[str, list[Triplet]]) -> dict[str, float]:
    """Deprecated: :func:`lightning_nb.credit.episode_rewards` with ``CreditRule.from_config(cfg)``."""
    warnings.warn("lightning_nb.trainers.batch.episode_rewards moved to lightning_nb.credit.episode_rewards; the old "
                  "name goes in the next release", DeprecationWarning, stacklevel=2)
    return credit_episode_rewards(CreditRule.from_config(cfg), episodes)


def signal_groups(cfg: TrainerConfig, triplets: Sequence[Triplet]) -> set[str]:
    """Group ids of ``triplets`` with a non-zero advantage under the trainer config's (deprecated) credit fields;
    what ``Trainer.signal_groups`` (deprecated: ``algo.signal_groups``) answers."""
    episodes = episodes_of(triplets)
    baselines = {r: ts[0].baseline for r, ts in episodes.items() if ts[0].baseline is not None}
    credit = assign(CreditRule.from_config(cfg), triplets, baselines=baselines)
    return {t.group_id for t in credit.triplets if any(a != 0.0 for a in t.advantages or [])}


def per_triplet_turn(triplets: Sequence[Triplet], by_turn: dict[str, dict[int, float]]) -> dict[tuple[str, int], float]:
    """``(rollout_id, Triplet.turn) -> advantage`` from the update's ``episode -> turn index -> advantage``."""
    episodes = episodes_of(triplets)
    return {(r, t.turn): advs[k] for r, advs in by_turn.items()
            for k, t in enumerate(sorted(episodes[r], key=lambda t: t.turn))}

