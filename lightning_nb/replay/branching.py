"""Exact replay of a stored rollout, and branching it at call k (Tree-GRPO, ARPO), from a cell.

:func:`replay` re-runs the agent on a rollout's task with every LLM call answered by the proxy from the recorded
completion (the same text, token IDs and log-probs); :func:`branch` replays calls 1..k and samples anew from call
k + 1, ``n`` times, with the current weights, other sampling or another resources set. Each is a new rollout of
its own, run by the runners like any other (start them first), linked to its parent (metadata
``parent_rollout_id`` and ``branch_call``: ``store.episodes_df()`` columns, ``Episode.parent_rollout_id``) and
never editing it. The proxy's side (what is compared, the 409 on a divergence) is
:mod:`lightning_nb.proxy.replay`.

The branches of one parent at one call share the GRPO group ``branch:<parent>:<k>`` (:func:`branch_group`), so
an update over their triplets computes advantages relative within the group; only the calls sampled after the
branch point are trained (:attr:`~lightning_nb.types.Triplet.replayed` calls are context, response mask 0). The
scheme is Tree-GRPO's (Ji et al. 2025, "Tree Search for LLM Agent Reinforcement Learning", arXiv 2509.21240:
sibling branches from a shared prefix as the group) and ARPO's (Dong et al. 2025, "Agentic Reinforced Policy
Optimization", arXiv 2507.19849: branching after tool calls).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any, Optional

from lightning_nb.errors import ConfigError, LightningNbError
from lightning_nb.store.episode import Episode, call_spans
from lightning_nb.types import (BRANCH_CALL_KEY, GROUP_ID_KEY, PARENT_ROLLOUT_KEY, REPLAY_KEY, ROLLOUT_TERMINAL,
                                SAMPLING_PARAMETERS_KEY, Rollout)

__all__ = ["replay", "branch", "branch_group", "branch_tree", "BranchConfig", "branch_points", "enqueue_branches",
           "draw_branch_points", "branch_family"]

#: The sampling a branch may set (the proxy applies them from call k + 1 on, over the rollout's).
BRANCH_SAMPLING = ("temperature", "top_p", "max_tokens", "seed", "stop")


@dataclass
class BranchConfig:
    """Branch groups in the training loop (``LightningRL(..., branch=BranchConfig(...))``): Tree-GRPO's and ARPO's
    per-step credit from sibling continuations of one shared prefix.

    After each step's rollouts finish, ``parents`` of its succeeded episodes that have a branch point are drawn
    (the algorithm's task sampler RNG), one branch point each; ``n`` branches of each replay the parent's calls up to
    it and sample the rest (:func:`branch`'s rollouts, group ``branch:<parent>:<k>``). Their triplets join the step's
    batch: the group's advantages are relative within it, and only the calls sampled after the branch point carry a
    response mask (the replayed calls are the parent's, trained once with the parent's own group). The step's row
    reports ``branch_groups``, ``branch_groups_with_signal`` and ``branch_reward_mean``; the step's ``reward_mean``
    stays that of its ordinary rollouts.

    Sources: Tree-GRPO (Ji et al. 2025, arXiv 2509.21240) and ARPO (Dong et al. 2025, arXiv 2507.19849), which
    branch after tool calls; here the branch points are chosen from the episodes' records.
    """

    parents: int = field(default=2, metadata={"help": "Episodes of each step branched (fewer when fewer qualify)."})
    n: int = field(default=4, metadata={"help": "Branches per branch point: the branch group's size (>= 2)."})
    at: str = field(default="tool", metadata={
        "help": "'tool': after a tool result (a call k whose reply made a tool call, or after which a tool span ran, "
                "with a call after it); 'any': any call 1..calls-1 (a turn boundary)."})
    sampling: dict[str, Any] = field(default_factory=dict, metadata={
        "help": "temperature, top_p, max_tokens, seed, stop of the branches' calls after the branch point "
                "(empty: the step's own)."})

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ConfigError naming the first field out of range."""
        if not isinstance(self.parents, int) or self.parents < 1:
            raise ConfigError(f"BranchConfig.parents must be an int >= 1, got {self.parents!r}")
        if not isinstance(self.n, int) or self.n < 2:
            raise ConfigError(f"BranchConfig.n must be an int >= 2 (a group compares branches), got {self.n!r}")
        if self.at not in ("tool", "any"):
            raise ConfigError(f"BranchConfig.at must be 'tool' or 'any', got {self.at!r}")
        unknown = sorted(set(self.sampling) - set(BRANCH_SAMPLING))
        if unknown:
            raise ConfigError(f"BranchConfig.sampling has {unknown}; a branch samples with {list(BRANCH_SAMPLING)}")


def branch_points(episode: Episode, at: str = "tool") -> list[int]:
    """The calls k (1..calls − 1) after which ``episode`` can branch with something left to sample: with
    ``at="tool"`` those whose reply made a tool call or after which a traced tool ran; ``"any"``: every one."""
    last = len(episode.calls)
    if at == "any":
        return list(range(1, last))
    after_tool = {t.after_call for t in episode.tools}
    return [c.call for c in episode.calls[:-1] if c.tool_calls or c.call in after_tool]


def enqueue_branches(store: Any, rollout_id: str, at_call: int, n: int, sampling: Optional[dict[str, Any]] = None
                     ) -> list[str]:
    """Enqueue :func:`branch`'s ``n`` rollouts without waiting for them; returns their ids (the algorithm waits)."""
    parent, attempt, _ = _parent(store, rollout_id)
    return _enqueue(store, parent, attempt, at_call, n, exact=False, sampling=dict(sampling or {}), resources_id=None)


def draw_branch_points(episodes: list[Episode], config: BranchConfig, rng: random.Random) -> list[tuple[str, int]]:
    """``(rollout_id, k)`` for up to ``config.parents`` of ``episodes`` (succeeded, with a branch point), drawn with
    ``rng``; one branch point each, drawn among the episode's :func:`branch_points`."""
    able = [(e.rollout_id, points) for e in episodes if e.status == "succeeded"
            for points in [branch_points(e, config.at)] if points]
    chosen = rng.sample(able, min(config.parents, len(able)))
    return [(rid, rng.choice(points)) for rid, points in chosen]


def branch_group(parent_rollout_id: str, at_call: int) -> str:
    """The GRPO group of the branches of ``parent_rollout_id`` at ``at_call``: ``"branch:<parent>:<k>"``."""
    return f"branch:{parent_rollout_id}:{at_call}"


def _store_of(store: Any, algo: Any) -> Any:
    if store is None and algo is not None:
        store = algo.store
    if store is None:
        raise ConfigError("pass store=... (the store the rollout is in, whose runners will run the replay) or algo=...")
    return store


def _parent(store: Any, rollout_id: str) -> tuple[Rollout, str, int]:
    """The parent rollout, its latest attempt id and its number of recorded LLM calls."""
    parent = store.get_rollout_by_id(rollout_id)
    attempts = store.query_attempts(rollout_id)
    if parent.status not in ("succeeded", "failed") or not attempts:
        raise ConfigError(f"rollout {rollout_id!r} is {parent.status!r}: only a finished rollout (succeeded or failed) "
                          "has a record to replay; wait for it (store.wait_for_rollouts) first")
    attempt = attempts[-1].attempt_id
    return parent, attempt, len(call_spans(store.query_spans(rollout_id, attempt)))


def _enqueue(store: Any, parent: Rollout, attempt_id: str, calls: int, n: int, *, exact: bool,
             sampling: dict[str, Any], resources_id: Optional[str]) -> list[str]:
    meta = {REPLAY_KEY: {"rollout_id": parent.rollout_id, "attempt_id": attempt_id, "calls": calls,
                         "exact": exact, "sampling": sampling, "compare_model": resources_id is None},
            PARENT_ROLLOUT_KEY: parent.rollout_id, BRANCH_CALL_KEY: calls,
            GROUP_ID_KEY: ("replay:" + parent.rollout_id) if exact else branch_group(parent.rollout_id, calls)}
    if parent.metadata.get(SAMPLING_PARAMETERS_KEY):  # the agent sends what it sent then
        meta[SAMPLING_PARAMETERS_KEY] = dict(parent.metadata[SAMPLING_PARAMETERS_KEY])
    return [store.enqueue_rollout(parent.input, mode=parent.mode, resources_id=resources_id or parent.resources_id,
                                  metadata=json.loads(json.dumps(meta))).rollout_id for _ in range(n)]


def _wait(store: Any, ids: list[str], timeout: float, what: str) -> list[Episode]:
    done = store.wait_for_rollouts(ids, timeout=timeout, progress=None if len(ids) > 1 else False)
    if len(done) < len(ids):
        raise LightningNbError(f"{what}: {len(ids) - len(done)} of {len(ids)} rollouts did not finish in {timeout:g} s "
                               f"(ids {ids}); are runners running on this store (start_runners(agent, store))? They "
                               "stay queued and will run when runners start")
    return [store.episode(rid) for rid in ids]


def replay(rollout_id: str, *, store: Any = None, algo: Any = None, timeout: float = 300.0) -> Episode:
    """Re-run the agent on a stored rollout's task with every LLM call answered from the record, and return the new
    episode.

    The new rollout (same input, mode, resources set and sampling parameters as the parent) is run by the store's
    runners; the proxy answers its call j with the parent's recorded call j (text, tool calls, token IDs, log-probs,
    finish reason) when the agent's request equals the recorded one (messages, tools, tool_choice, sampling, n,
    model). Where it differs, the replay stops at j: the proxy answers 409 naming the call and the field, the attempt
    fails, and the episode's :attr:`~lightning_nb.store.episode.Episode.divergence` holds the call, the field and
    both values. A deterministic agent with deterministic tools replays to the same calls, tokens and reward.

    Args:
        rollout_id: a finished rollout (succeeded or failed): its latest attempt is replayed.
        store: the store it is in (runners must be running on it); or ``algo`` (its store).
        timeout: seconds to wait for the replay to finish.

    Returns:
        The replay's :class:`~lightning_nb.store.episode.Episode` (``parent_rollout_id`` the parent,
        ``branch_call`` its number of calls; every call ``replayed``).

    Raises:
        ConfigError: no store, or the rollout has not finished. NotFoundError: unknown rollout.
        LightningNbError: the replay did not finish within ``timeout`` (no runners?).
    """
    store = _store_of(store, algo)
    parent, attempt, calls = _parent(store, rollout_id)
    ids = _enqueue(store, parent, attempt, calls, 1, exact=True, sampling={}, resources_id=None)
    return _wait(store, ids, timeout, f"replay of {rollout_id!r}")[0]


def branch(rollout_id: str, at_call: int, n: int = 4, *, sampling: Optional[dict[str, Any]] = None,
           resources: Any = None, store: Any = None, algo: Any = None, timeout: float = 600.0) -> list[Episode]:
    """``n`` new rollouts that replay calls 1..``at_call`` of a stored rollout from its record, then sample anew.

    From call ``at_call`` + 1 the proxy samples with the engine's current weights, with ``sampling`` over the
    rollout's own sampling parameters, on the resources set the branches are pinned to. ``at_call`` = the number of
    the parent's calls replays the whole episode (each branch equals the parent when the agent is deterministic);
    ``at_call=0`` replays nothing: a fresh rollout of the same task (still linked to the parent). Calls 1..k are
    compared with the record as in :func:`replay` (a request that differs stops that branch with a 409 and its
    :attr:`~lightning_nb.store.episode.Episode.divergence`); with ``resources`` the model name is not compared, so
    the calls after k can go to another model the proxy serves. A prompt template that changes the messages of calls
    1..k makes the branches diverge at the first of them: branch at call 0 to try a template from the start.

    The ``n`` branches share the GRPO group :func:`branch_group` (``"branch:<parent>:<k>"``), linked to the parent by
    ``parent_rollout_id`` and ``branch_call``; ``trainer.update(adapter.adapt(store, [e.rollout_id for e in
    branches]))`` trains one step on them as a group (only the calls after k carry a response mask).

    Args:
        rollout_id: a finished rollout (its latest attempt is the record).
        at_call: k, how many of its LLM calls to replay (0..number of calls).
        n: branches (>= 1).
        sampling: ``temperature``, ``top_p``, ``max_tokens``, ``seed``, ``stop`` for the calls after k (None: the
            rollout's own).
        resources: a resources set for the branches: the id of one in the store, or a dict of resources (stored
            with ``store.add_resources``; the set that was the latest is written again after it, so it stays the
            latest for everything else, its version one higher). None: the parent's set.
        store, algo: the store (runners must be running on it), or an algorithm holding it.
        timeout: seconds to wait for all branches.

    Returns:
        The ``n`` branches' :class:`~lightning_nb.store.episode.Episode` objects, in enqueue order.

    Raises:
        ConfigError: ``at_call`` outside 0..calls, ``n`` < 1, an unknown ``sampling`` key, an unfinished parent, no
            store. NotFoundError: unknown rollout or resources id. LightningNbError: not finished within ``timeout``.
    """
    store = _store_of(store, algo)
    parent, attempt, calls = _parent(store, rollout_id)
    if not isinstance(at_call, int) or isinstance(at_call, bool) or not 0 <= at_call <= calls:
        raise ConfigError(f"branch(at_call={at_call!r}): rollout {rollout_id!r} made {calls} LLM calls; pass an int in "
                          f"0..{calls} (0: a fresh rollout of the task, {calls}: replay all of them)")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ConfigError(f"branch(n={n!r}): pass the number of branches, an int >= 1")
    sampling = dict(sampling or {})
    unknown = sorted(set(sampling) - set(BRANCH_SAMPLING))
    if unknown:
        raise ConfigError(f"branch(sampling=...) has {unknown}; a branch samples with {list(BRANCH_SAMPLING)} only")
    resources_id = None
    if isinstance(resources, dict):
        latest = store.get_latest_resources()
        resources_id = store.add_resources(resources).resources_id
        if latest is not None:  # the set everything else runs with stays the latest
            store.add_resources(dict(latest.resources), resources_id=latest.resources_id)
    elif resources is not None:
        resources_id = str(getattr(resources, "resources_id", resources))
        store.get_resources_by_id(resources_id)  # NotFoundError for an unknown id, before anything is enqueued
    ids = _enqueue(store, parent, attempt, at_call, n, exact=False, sampling=sampling, resources_id=resources_id)
    return _wait(store, ids, timeout, f"branches of {rollout_id!r} at call {at_call}")


def branch_family(store: Any, rollout_id: str) -> list[dict[str, Any]]:
    """The replay/branch family of ``rollout_id``: its root (following ``parent_rollout_id`` up) and every rollout
    below it, depth first, a parent's branches by call, then enqueue time. One dict each: rollout_id, depth (0 for
    the root), branch_call (None for the root), status, reward (None until finished). Just the root for an
    ordinary rollout. Reads the rollouts and the family's final rewards, no spans (the SpanBrowser polls it)."""
    rollouts = {r.rollout_id: r for r in store.query_rollouts()}
    root = rollout_id
    while rollouts.get(root) is not None and rollouts[root].metadata.get(PARENT_ROLLOUT_KEY) in rollouts:
        root = rollouts[root].metadata[PARENT_ROLLOUT_KEY]
    return _below(store, rollouts, root)


def _below(store: Any, rollouts: dict[str, Rollout], start: str) -> list[dict[str, Any]]:
    """:func:`branch_family`'s rows for ``start`` and every rollout below it (``start`` at depth 0)."""
    children: dict[str, list[str]] = {}
    for rid, r in rollouts.items():
        parent = r.metadata.get(PARENT_ROLLOUT_KEY)
        if parent:
            children.setdefault(parent, []).append(rid)
    out: list[dict[str, Any]] = []

    def walk(rid: str, depth: int) -> None:
        r = rollouts.get(rid)
        if r is None or depth > 50:
            return
        out.append({"rollout_id": rid, "depth": depth, "status": r.status,
                    "branch_call": r.metadata.get(BRANCH_CALL_KEY) if depth else None})
        for child in sorted(children.get(rid, []), key=lambda c: (rollouts[c].metadata.get(BRANCH_CALL_KEY) or 0,
                                                                    rollouts[c].enqueue_time)):
            walk(child, depth + 1)

    walk(start, 0)
    rewards = store.final_rewards([row["rollout_id"] for row in out]) if out else {}
    for row in out:
        row["reward"] = rewards.get(row["rollout_id"]) if row["status"] in ROLLOUT_TERMINAL else None
    return out


def branch_tree(store: Any, rollout_id: str) -> Any:
    """The branches of ``rollout_id`` (and theirs, recursively) as a DataFrame: rollout_id, parent_rollout_id,
    branch_call, depth (1 for a direct branch), status, reward (NaN until finished), calls (LLM calls of the latest
    attempt); ``rollout_id`` first, then :func:`branch_family`'s order.

    Raises:
        NotFoundError: ``rollout_id`` is not in the store.
    """
    import pandas as pd

    store.get_rollout_by_id(rollout_id)
    rollouts = {r.rollout_id: r for r in store.query_rollouts()}
    rows = _below(store, rollouts, rollout_id)
    for row in rows:
        rid = row["rollout_id"]
        row["parent_rollout_id"] = rollouts[rid].metadata.get(PARENT_ROLLOUT_KEY) if row["depth"] else None
        row["calls"] = len(call_spans(store.query_spans(rid, "latest")))
    df = pd.DataFrame(rows, columns=["rollout_id", "parent_rollout_id", "branch_call", "depth", "status", "reward",
                                     "calls"])
    return df.astype({"reward": "float64"})
