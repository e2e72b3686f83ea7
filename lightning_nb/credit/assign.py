"""From a batch of triplets to triplets that carry their advantages: the credit step an algorithm runs before each update.

:func:`assign` applies a :class:`CreditRule` (GRPO's group advantage of the episode reward, or of each turn's
reward-to-go; Dr. GRPO without the std; DAPO's soft overlong penalty; a baseline per episode instead of the group)
and returns a :class:`Credit`: the triplets to train, each with :attr:`Triplet.advantages
<lightning_nb.types.Triplet.advantages>` set (one float per response token), and those it left out (groups
under ``min_group_size``). ``Trainer.update(credit.triplets, left_out=credit.left_out)`` trains on them as given.

An algorithm with a credit of its own (RLOO's leave-one-out baseline, a learned value, ...) computes its numbers and
attaches them with :func:`with_advantages`; nothing here or in the trainers needs to change
(``docs/write-an-algorithm.md``, "Bring your own credit").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence, Union

from lightning_nb.credit.returns import group_advantages, overlong_penalty, reward_to_go, transition_advantages
from lightning_nb.errors import ConfigError
from lightning_nb.types import Triplet

__all__ = ["CreditRule", "Credit", "assign", "advantages", "episode_rewards", "episodes_of", "with_advantages",
           "groups_with_signal", "CREDIT_FIELDS"]

#: The options of the credit step (the algorithm's config fields, and TrainerConfig's deprecated ones).
CREDIT_FIELDS = ("credit", "gamma", "norm_adv_by_std", "min_group_size", "overlong_buffer_len",
                 "overlong_penalty_factor")


@dataclass(frozen=True)
class CreditRule:
    """How rewards become advantages (the fields of ``AlgorithmConfig`` of the same names; see their help texts).

    Attributes:
        credit: ``"episode"`` (every turn of episode i gets GRPO's group-normalised ``R_i``, Agent Lightning §3.2) or
            ``"reward_to_go"`` (turn t gets the discounted return ``G_t``, normalised over the group's transitions).
        gamma: discount per turn in (0, 1] of ``"reward_to_go"``.
        norm_adv_by_std: divide by the group std (GRPO) or not (Dr. GRPO).
        min_group_size: groups with fewer episodes are left out (>= 2).
        max_response_len: L_max of the soft overlong penalty, tokens (None: no penalty possible).
        overlong_buffer_len: L_cache of DAPO's soft overlong penalty, tokens; 0 = off.
        overlong_penalty_factor: the largest overlong penalty, reward units.
    """

    credit: str = "episode"
    gamma: float = 1.0
    norm_adv_by_std: bool = True
    min_group_size: int = 2
    max_response_len: Optional[int] = None
    overlong_buffer_len: int = 0
    overlong_penalty_factor: float = 1.0

    @classmethod
    def from_config(cls, config: Any, max_response_len: Optional[int] = None) -> "CreditRule":
        """The rule of any config with the :data:`CREDIT_FIELDS` (``AlgorithmConfig``, ``TrafficConfig``, or a
        ``TrainerConfig``'s deprecated fields); ``max_response_len`` (tokens) unless ``config`` has one set."""
        length = getattr(config, "max_response_len", None)
        return cls(**{f: getattr(config, f) for f in CREDIT_FIELDS},
                   max_response_len=length if length is not None else max_response_len)


@dataclass
class Credit:
    """What :func:`assign` returns: ``triplets`` to train (each with ``advantages``), ``left_out`` (not trained, still
    counted in the update's metrics) and ``dropped`` (group id -> episodes, of the groups left out as undersized)."""

    triplets: list[Triplet]
    left_out: list[Triplet] = field(default_factory=list)
    dropped: dict[str, int] = field(default_factory=dict)


def episodes_of(triplets: Sequence[Triplet]) -> dict[str, list[Triplet]]:
    """``rollout_id -> its triplets`` in the order they come (an episode is the triplets of one rollout)."""
    episodes: dict[str, list[Triplet]] = {}
    for t in triplets:
        episodes.setdefault(t.rollout_id, []).append(t)
    return episodes


def assign(rule: CreditRule, triplets: Sequence[Triplet], *, exclude: Sequence[str] = (),
           baselines: Optional[Mapping[str, float]] = None) -> Credit:
    """The advantages of ``triplets`` under ``rule``, attached to copies of them.

    ``exclude`` names episodes (rollout ids) that take no part (e.g. those the trainer would drop as stale,
    ``Trainer.stale_rollouts``): they go to ``left_out`` and into no group statistic. ``baselines`` maps an episode
    to its baseline (reward units): that episode's advantage is its reward minus the baseline (REINFORCE with a
    baseline, Williams 1992), outside its group's statistics and the group-size rule (TrafficLearner's running
    baseline). Each credited triplet's ``advantages`` holds its turn's advantage once per response token
    (:func:`advantages` gives the numbers). Triplets keep their order within an episode; episodes come in the order
    of the advantages (grouped episodes first, then baselined ones), the order the trainer packs them in.

    Raises:
        ConfigError: ``rule.min_group_size`` < 2, ``rule.credit`` unknown, or a baseline that is not finite.
    """
    excluded = set(exclude)
    episodes = {r: ts for r, ts in episodes_of(triplets).items() if r not in excluded}
    groups = {r: ts[0].group_id for r, ts in episodes.items()}
    per_episode, by_turn, dropped = advantages(rule, episodes, groups, baselines=baselines)
    credited = [t.model_copy(update={"advantages": [a] * len(t.response_ids)})
                for r in per_episode for t, a in _turns(episodes[r], by_turn[r])]
    return Credit(credited, [t for t in triplets if t.rollout_id not in per_episode], dropped)


def _turns(ts: list[Triplet], by_turn: dict[int, float]) -> list[tuple[Triplet, float]]:
    """``(triplet, advantage)`` in the order the triplets come; turn index k counts in turn order."""
    index = {id(t): k for k, t in enumerate(sorted(ts, key=lambda t: t.turn))}
    return [(t, by_turn[index[id(t)]]) for t in ts]


def advantages(rule: CreditRule, episodes: dict[str, list[Triplet]], groups: dict[str, str],
               kl_sums: Optional[dict[str, list[float]]] = None, baselines: Optional[Mapping[str, float]] = None,
               ) -> tuple[dict[str, float], dict[str, dict[int, float]], dict[str, int]]:
    """The advantages of ``episodes`` under ``rule`` (``groups``: episode -> group id).

    * ``"episode"``: :func:`~lightning_nb.credit.returns.group_advantages` of :func:`episode_rewards`
      (minus ``kl_coef`` × each of ``kl_sums[episode]``: the deprecated in-trainer KL penalty, already scaled by
      the caller); every turn gets its episode's.
    * ``"reward_to_go"``: :func:`~lightning_nb.credit.returns.reward_to_go` of the turns' step rewards
      (``Triplet.step_reward`` plus the turn's overlong penalty) and the final reward, with ``gamma``, then
      :func:`~lightning_nb.credit.returns.transition_advantages` over each group's transitions.

    An episode in ``baselines`` takes no part in its group's statistics: its advantage is its reward
    (``"episode"``: the shaped ``R_i``; ``"reward_to_go"``: each turn's return) minus its baseline, not divided by a
    standard deviation (REINFORCE with a baseline, Williams 1992; Sutton & Barto 2018, section 13.4), and no group
    size drops it.

    Returns:
        ``(per_episode, by_turn, dropped)``: kept episode -> advantage (``"reward_to_go"``: the mean over its
        turns, for displays); kept episode -> {turn index 0..T−1 in turn order -> advantage}; undersized
        group -> episodes.

    Raises:
        ConfigError: ``rule.min_group_size`` < 2, an unknown ``rule.credit``, or ``groups`` lacks an episode.
    """
    base = {r: float(baselines[r]) for r in episodes if r in (baselines or {})}  # in the episodes' order
    if rule.credit == "reward_to_go":
        returns: dict[tuple[str, int], float] = {}
        for r, ts in episodes.items():
            ordered = sorted(ts, key=lambda t: t.turn)
            steps = [t.step_reward + overlong_penalty(len(t.response_ids), rule.max_response_len or 0,
                                                      rule.overlong_buffer_len, rule.overlong_penalty_factor)
                     for t in ordered]
            for k, g in enumerate(reward_to_go(steps, ordered[0].reward, rule.gamma)):
                returns[(r, k)] = g
        flat, dropped = transition_advantages({rk: g for rk, g in returns.items() if rk[0] not in base}, groups,
                                              min_group_size=rule.min_group_size, norm_by_std=rule.norm_adv_by_std)
        flat.update({rk: g - base[rk[0]] for rk, g in returns.items() if rk[0] in base})
        by_turn: dict[str, dict[int, float]] = {}
        for (r, k), a in flat.items():
            by_turn.setdefault(r, {})[k] = a
        return {r: sum(v.values()) / len(v) for r, v in by_turn.items()}, by_turn, dropped
    if rule.credit != "episode":
        raise ConfigError(f"credit={rule.credit!r}; use 'episode' or 'reward_to_go'")
    shaped = episode_rewards(rule, episodes)
    for r, kls in (kl_sums or {}).items():
        for kl in kls:  # one subtraction per packed sequence, in order
            shaped[r] -= kl
    per_episode, dropped = group_advantages({r: v for r, v in shaped.items() if r not in base}, groups,
                                            min_group_size=rule.min_group_size, norm_by_std=rule.norm_adv_by_std)
    per_episode.update({r: shaped[r] - b for r, b in base.items()})
    return per_episode, {r: dict.fromkeys(range(len(episodes[r])), a) for r, a in per_episode.items()}, dropped


def episode_rewards(rule: CreditRule, episodes: dict[str, list[Triplet]]) -> dict[str, float]:
    """Each episode's final reward plus its turns' intermediate rewards (``Triplet.step_reward``) and the
    soft overlong penalty of its responses (0 unless overlong_buffer_len > 0); reward units."""
    shaped = {r: ts[0].reward + sum(t.step_reward for t in ts) for r, ts in episodes.items()}
    if rule.overlong_buffer_len == 0:
        return shaped
    return {r: shaped[r] + sum(overlong_penalty(len(t.response_ids), rule.max_response_len or 0,
                                                rule.overlong_buffer_len, rule.overlong_penalty_factor)
                               for t in ts) for r, ts in episodes.items()}


def with_advantages(triplets: Sequence[Triplet],
                    advantages: Mapping[Union[str, tuple[str, int]], Union[float, Sequence[float]]]) -> list[Triplet]:
    """Copies of ``triplets`` carrying ``advantages``: keyed by ``rollout_id`` (every turn of the episode) or by
    ``(rollout_id, Triplet.turn)`` (one turn); a value is one float (given to every response token) or one float per
    response token. Triplets without an entry are left out of the result (not trained).

    Raises:
        ValueError: a per-token list whose length is not the triplet's response length (from :class:`Triplet`).
    """
    out = []
    for t in triplets:
        key: Union[str, tuple[str, int]] = t.rollout_id if t.rollout_id in advantages else (t.rollout_id, t.turn)
        if key not in advantages:
            continue
        a = advantages[key]
        values = [float(a)] * len(t.response_ids) if isinstance(a, (int, float)) else [float(v) for v in a]
        out.append(Triplet.model_validate({**t.model_dump(), "advantages": values}))
    return out


def groups_with_signal(triplets: Sequence[Triplet]) -> set[str]:
    """Group ids of ``triplets`` in which some triplet carries a non-zero advantage (what an update learns from)."""
    return {t.group_id for t in triplets if t.advantages is not None and any(a != 0.0 for a in t.advantages)}
