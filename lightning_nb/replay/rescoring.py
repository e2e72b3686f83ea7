"""What-if rewards: re-score stored episodes with another reward function, without the agent or the model.

:func:`what_if` runs ``reward_fn(task, episode)`` over episodes already in the store
(:class:`~lightning_nb.store.episode.Episode`) and sets the new reward beside the recorded one, with the advantage
each would give under the algorithm's own estimator (its ``credit``, group normalisation, group-size rule:
:func:`lightning_nb.credit.advantages`) and whether each GRPO group carries signal under each.
:func:`rescore` is the same substitution on a step's triplets, which
:meth:`LightningRL.set_reward <lightning_nb.algorithm.lightning_rl.LightningRL.set_reward>` applies from its next
step on.

A reward function returns a float (the episode's reward) or a dict of named components, whose sum is the episode's
reward (``{"correct": 1.0, "uses_all_numbers": 0.2}``). Either replaces the recorded reward *and* the recorded
intermediate rewards: what the trainer normalises is then exactly what the function returned (credited to the
episode as its final reward; with ``credit="reward_to_go"`` every turn's return is that reward). The stored reward
spans are never changed.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Sequence, Union

import pandas as pd

from lightning_nb.errors import ConfigError
from lightning_nb.slices import slice_labels
from lightning_nb.store.episode import Episode
from lightning_nb.credit import CREDIT_FIELDS, CreditRule, advantages, episodes_of
from lightning_nb.types import GROUP_ID_KEY, Triplet

__all__ = ["what_if", "what_if_groups", "what_if_slices", "rescore", "score", "RewardFn"]

#: ``reward_fn(task, episode) -> float | {component: float}``: a reward written over a stored episode.
RewardFn = Callable[[Any, Episode], Union[float, dict]]


def score(reward_fn: RewardFn, episode: Episode) -> tuple[float, dict[str, float]]:
    """``(reward, components)`` of ``reward_fn(episode.task, episode)``: a float is the reward with no components;
    a dict's values are the components and their sum the reward.

    Raises:
        ConfigError: the function returned something else, or a value that is not a finite number (naming the
            rollout and the fix).
    """
    value = reward_fn(episode.task, episode)
    if isinstance(value, dict):
        parts = value
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        parts = None
    else:
        raise ConfigError(f"reward_fn returned {type(value).__name__} {value!r} for rollout {episode.rollout_id!r}; "
                          "return a float, or a dict {component name: float} whose sum is the reward")
    items = parts.items() if parts is not None else [("reward", value)]
    for name, v in items:
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(float(v)):
            raise ConfigError(f"reward_fn gave {name}={v!r} for rollout {episode.rollout_id!r}; every reward "
                              "(and every component of a dict) must be a finite number")
    if parts is None:
        return float(value), {}
    comps = {str(k): float(v) for k, v in parts.items()}
    return sum(comps.values()), comps


def rescore(triplets: Sequence[Triplet], rewards: dict[str, float]) -> list[Triplet]:
    """``triplets`` with each episode's ``reward`` replaced by ``rewards[rollout_id]`` and its intermediate rewards
    (``step_reward``) set to 0, so that the reward the trainer normalises is exactly the new one. Episodes not in
    ``rewards`` are left out."""
    return [t.model_copy(update={"reward": rewards[t.rollout_id], "step_reward": 0.0})
            for t in triplets if t.rollout_id in rewards]


def _resolve(algo: Any, store: Any, config: Any, by: Any, group_key: Optional[str]
             ) -> tuple[Any, CreditRule, Any, str, Any]:
    rule: Optional[CreditRule] = None
    if algo is not None:
        store = store if store is not None else algo.store
        if config is None and callable(getattr(algo, "credit_rule", None)):
            rule = algo.credit_rule()
        elif config is None:
            config = getattr(getattr(algo, "trainer", None), "config", None)
        by = by if by is not None else getattr(algo, "slice_by", None)
        adapter = getattr(algo, "adapter", None)
        group_key = group_key or getattr(adapter, "group_key", None)
    if store is None:
        raise ConfigError("what_if needs the store the episodes are in: pass algo=... (its store and trainer config) "
                          "or store=...")
    if rule is None and config is not None and not all(hasattr(config, f) for f in CREDIT_FIELDS):
        raise ConfigError(f"what_if(config=...) is a {type(config).__name__}; pass a config with the credit fields "
                          "(AlgorithmConfig, or a trainer config of earlier versions) or algo=...")
    if rule is None:
        rule = CreditRule.from_config(config) if config is not None else CreditRule()
    from lightning_nb.adapter import TripletAdapter

    # a copy of the algorithm's adapter (its group key and agent_match): a what-if is not a step, so the
    # algorithm's adapter keeps its running skip counts as they were
    agent_match = getattr(getattr(algo, "adapter", None), "agent_match", None) if algo is not None else None
    adapter = TripletAdapter(group_key=group_key or GROUP_ID_KEY, agent_match=agent_match)
    return store, rule, by, group_key or GROUP_ID_KEY, adapter


def what_if(reward_fn: RewardFn, episodes: Optional[Sequence[Union[Episode, str]]] = None, algo: Any = None, *,
            store: Any = None, config: Any = None, by: Any = None,
            group_key: Optional[str] = None) -> pd.DataFrame:
    """Re-score stored episodes with ``reward_fn`` and compare rewards, advantages and group signal, old and new.

    Nothing is sampled and nothing stored changes: the agent and the model are not called.

    Args:
        reward_fn: ``reward_fn(task, episode) -> float | dict`` (:func:`score`); ``task`` is the rollout's input,
            ``episode`` its :class:`~lightning_nb.store.episode.Episode`.
        episodes: Episodes or rollout ids; None: every finished ``train`` rollout of the store.
        algo: a LightningRL (or any algorithm with ``store``, ``credit_rule()``, ``adapter`` and ``slice_by``):
            its store, its credit (``algo.credit_rule()``: ``credit``, ``norm_adv_by_std``, ``min_group_size``,
            ``gamma``, the soft overlong penalty), its adapter's group key and its slices.
        store, config, by, group_key: each instead of ``algo``'s (``config``: any config with the credit fields,
            ``AlgorithmConfig``; default: those fields' defaults; ``by``:
            a task field or ``task -> label`` function adding a ``slice`` column; ``group_key``: the rollout
            metadata key of the group, default ``group_id``).

    Returns:
        One row per episode: rollout_id, group_id, [slice], status, old_reward (the recorded final reward),
        old_shaping (the sum of its recorded intermediate rewards), new_reward (the function's), ``new:<name>``
        per component when it returns a dict, old_advantage and new_advantage (the mean over the episode's turns
        with ``credit="reward_to_go"``; NaN for an episode the trainer would not train: failed, no token IDs, or
        in a group the group-size rule drops), old_signal and new_signal (whether the episode's group carries
        signal: a non-zero advantage on any of its turns), trained (whether it gives triplets).
        :func:`what_if_groups` and :func:`what_if_slices` summarise it; ``widgets.what_if_figure`` plots it.

    Raises:
        ConfigError: no store or a wrong config; ``reward_fn`` returned a non-number (:func:`score`).
        NotFoundError: a rollout id is not in the store.
    """
    store, rule, by, group_key, adapter = _resolve(algo, store, config, by, group_key)
    if episodes is None:
        eps = store.episodes(mode="train")
    else:
        eps = [e if isinstance(e, Episode) else store.episode(str(e)) for e in episodes]
    ids = [e.rollout_id for e in eps]
    triplets = adapter.adapt(store, ids) if ids else []
    new = {}
    comps: dict[str, dict[str, float]] = {}
    for e in eps:
        new[e.rollout_id], comps[e.rollout_id] = score(reward_fn, e)
    old_adv, old_signal = _advantages(rule, triplets)
    new_adv, new_signal = _advantages(rule, rescore(triplets, new))
    trained = {t.rollout_id for t in triplets}
    groups = {t.rollout_id: t.group_id for t in triplets}
    names = sorted({k for c in comps.values() for k in c})
    rows = []
    for e in eps:
        group = groups.get(e.rollout_id, e.group_id if e.group_id is not None else e.rollout_id)
        rows.append({"rollout_id": e.rollout_id, GROUP_ID_KEY: group, "status": e.status,
                     "old_reward": math.nan if e.reward is None else e.reward,
                     "old_shaping": sum(e.components.values()), "new_reward": new[e.rollout_id],
                     **{f"new:{k}": comps[e.rollout_id].get(k, math.nan) for k in names},
                     "old_advantage": old_adv.get(e.rollout_id, math.nan),
                     "new_advantage": new_adv.get(e.rollout_id, math.nan),
                     "old_signal": group in old_signal, "new_signal": group in new_signal,
                     "trained": e.rollout_id in trained})
    columns = ["rollout_id", GROUP_ID_KEY, "status", "old_reward", "old_shaping", "new_reward",
               *(f"new:{k}" for k in names), "old_advantage", "new_advantage", "old_signal", "new_signal", "trained"]
    df = pd.DataFrame(rows, columns=columns)
    for col in ("old_reward", "old_shaping", "new_reward", "old_advantage", "new_advantage"):
        df[col] = df[col].astype("float64")
    for col in ("old_signal", "new_signal", "trained"):
        df[col] = df[col].astype("bool")
    if by is not None:
        labels = slice_labels([e.task for e in eps], by, what="rollout", names=ids)
        df.insert(2, "slice", pd.Series(labels, index=df.index, dtype="object"))
    return df


def _advantages(rule: CreditRule, triplets: Sequence[Triplet]) -> tuple[dict[str, float], set[str]]:
    """(episode -> advantage, groups with signal) under ``rule`` (the algorithm's credit)."""
    if not triplets:
        return {}, set()
    episodes = episodes_of(triplets)
    groups = {r: ts[0].group_id for r, ts in episodes.items()}
    per_episode, by_turn, _ = advantages(rule, episodes, groups)
    signal = {groups[r] for r, advs in by_turn.items() if any(a != 0.0 for a in advs.values())}
    return per_episode, signal


def what_if_groups(df: pd.DataFrame) -> pd.DataFrame:
    """One row per group of a :func:`what_if` table: group_id, episodes, old_signal, new_signal, and ``change``:
    ``"gains signal"``, ``"loses signal"``, ``"keeps signal"`` or ``"no signal"``; then the groups' old and new
    mean reward."""
    g = df.groupby(GROUP_ID_KEY, sort=False).agg(episodes=("rollout_id", "size"), old_signal=("old_signal", "first"),
                                                new_signal=("new_signal", "first"), old_reward=("old_reward", "mean"),
                                                new_reward=("new_reward", "mean")).reset_index()
    g.insert(4, "change", [("keeps signal" if o else "gains signal") if n else ("loses signal" if o else "no signal")
                           for o, n in zip(g["old_signal"], g["new_signal"])])
    return g


def what_if_slices(df: pd.DataFrame, by: str = "slice") -> pd.DataFrame:
    """Per slice (the ``slice`` column, or another column ``by``) of a :func:`what_if` table: episodes, mean old and
    new reward, and how many groups gain or lose signal (a group counts in the slice of its first episode).

    Raises:
        ConfigError: the table has no such column (pass ``by=`` or ``algo=`` with ``slice_by`` to :func:`what_if`).
    """
    if by not in df.columns:
        raise ConfigError(f"the what_if table has no {by!r} column; call what_if(..., by='ops') (a task field) or "
                          "with an algo that has slice_by")
    groups = what_if_groups(df).set_index(GROUP_ID_KEY)["change"]
    first = df.drop_duplicates(GROUP_ID_KEY).set_index(GROUP_ID_KEY)[by]
    changes = pd.DataFrame({by: first, "change": groups.reindex(first.index)})
    out = df.groupby(by, sort=True).agg(episodes=("rollout_id", "size"), old_reward=("old_reward", "mean"),
                                         new_reward=("new_reward", "mean"))
    for what in ("gains signal", "loses signal"):
        out["groups_" + what.replace(" signal", "")] = (changes[changes["change"] == what].groupby(by).size()
                                                       .reindex(out.index, fill_value=0))
    return out.reset_index()
