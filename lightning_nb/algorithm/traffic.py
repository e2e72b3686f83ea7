"""Learning from the traffic users already send: an algorithm that trains on rollouts it did not start.

Reference doc 000's last section (online / continuous learning): people use the agent through
``Runner.step(task, reward_required=False)`` or the LLM proxy's ``/traffic`` route, every call is
already in the store, and some of those rollouts get a reward later (from the agent itself, a judge,
or a person in a notebook cell: ``store.label(rollout_id, reward)``). :class:`TrafficLearner` polls
the store for them, waits until ``min_labelled`` are labelled, groups them, asks the trainer to update
the weights (which the engine serves at once, so users get the new policy while they keep working),
and records exactly which rollouts each update used (:meth:`TrafficLearner.updates_df`), with a
checkpoint of the weights before it, so an update can be audited and undone (:meth:`TrafficLearner.undo`).

Groups and baselines: each labelled rollout is compared with something, so one labelled request is enough.

* rollouts with an equal input (:func:`~lightning_nb.algorithm.lightning_rl.task_key`: the task's
  ``id`` field, else a hash of its content; for the proxy route, the request's messages) whose rewards
  differ form one GRPO group (group-relative advantage, as LightningRL; GRPO, Shao et al. 2024, §4.1.2);
* every other labelled rollout (a singleton: its input seen once in the batch; or one of a group whose
  rewards are all equal, where the group mean compares nothing) trains against a **running baseline**:
  advantage = reward − b (REINFORCE with a baseline, Williams 1992; Sutton & Barto 2018, §13.4), computed by
  the learner's credit step (:meth:`TrafficLearner.assign_credit`) and carried to the trainer in
  :attr:`~lightning_nb.types.Triplet.advantages`. ``b`` is the mean final reward of the
  earlier rollouts of the same input that updates used; for an input never used before, the mean over
  every rollout updates used; before any update, ``TrafficConfig.baseline_init``
  (:meth:`TrafficLearner.baseline`). Only rewards of earlier updates enter ``b``, never the rollout's own;
* a rollout whose reward equals its baseline has advantage 0 (nothing to learn): it waits, pending, for
  a later batch (its baseline moves with each update). An update runs only when some rollout carries
  signal (:meth:`~lightning_nb.algorithm.credit.CreditAssignment.signal_groups`), so advantages are never
  silently zero.

:meth:`TrafficLearner.waiting_for` says what the learner waits for (labelled of ``min_labelled``,
unlabelled, rewards equal to their baselines); ``wait()`` shows it and warns after a stall
(:meth:`~lightning_nb.algorithm.base.Algorithm.wait`).

Rules: an unlabelled rollout (final reward None) is never trained on; a rollout is used by at most one
update (also after :meth:`TrafficLearner.undo`, which restores weights but keeps the record), of any learner on
the same store: each update marks its rollouts in the store's training record (learner :attr:`TrafficLearner.name`,
update number; ``store.query_trained()``), and a learner skips marked ones, also on a reopened SQLite file after a
kernel restart, unless made with ``retrain=True`` (:mod:`~lightning_nb.algorithm.traffic_record`); only
``succeeded`` rollouts are candidates (a failed one's reward is 0 by rule, and it has no triplets).
A labelled rollout the adapter cannot use (no LLM call, no token IDs) is set aside once and counted.
A labelled rollout sampled more than the trainer's ``max_staleness`` weight versions ago is set aside the same
way (the trainer would drop it, so it is neither trained on nor left pending): label traffic soon after it is sent.
"""

from __future__ import annotations

import math
import shutil
import tempfile
import threading
import time
import weakref
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from lightning_nb.adapter import TripletAdapter
from lightning_nb.algorithm.credit import CreditAssignment
from lightning_nb.algorithm.credit_options import CreditOptions
from lightning_nb.algorithm.checkpoint import load_run, save_run
from lightning_nb.algorithm.control import LoopStopped
from lightning_nb.algorithm.rl_config import task_key
from lightning_nb.algorithm.traffic_record import PendingMarks, first_marks, skipped_why
from lightning_nb.credit import Credit, assign
from lightning_nb.errors import ConfigError
from lightning_nb.store.base import LightningStore
from lightning_nb.store.trained import TrainedMark
from lightning_nb.trainers.base import Trainer
from lightning_nb.trainers.checkpoint import restore_checkpoint
from lightning_nb.types import GROUP_ID_KEY, TRAFFIC_KEY, Rollout, Triplet, new_id

__all__ = ["TrafficConfig", "TrafficLearner", "is_traffic", "TRAFFIC_KEY"]

_NAME_PREFIX = "traffic-learner"  # a learner's default name: traffic-learner-<hex>
UPDATE_COLUMNS = ["update", "learner", "time", "rollout_ids", "n", "groups", "baselined", "reward_mean", "weight_version_before",
                  "weight_version_after", "trainer_step", "checkpoint", "stale_episodes_dropped", "undone"]


def is_traffic(rollout: Rollout) -> bool:
    """The default selection of :class:`TrafficLearner`: whether ``rollout`` is traffic a user started.

    True when its metadata has :data:`~lightning_nb.types.TRAFFIC_KEY`: the proxy's ``/traffic`` route and
    ``Runner.step(task)`` set it; rollouts an algorithm enqueues never do. Pass ``TrafficLearner(select=...)``
    to choose otherwise.
    """
    return TRAFFIC_KEY in rollout.metadata


@dataclass
class TrafficConfig(CreditOptions):
    """When and on what :class:`TrafficLearner` updates, and the credit of its groups
    (:class:`~lightning_nb.algorithm.credit_options.CreditOptions`, keyword-only; ``overlong_buffer_len`` must stay 0:
    traffic has no max_tokens of its own). Validated on construction and before each poll."""

    min_labelled: int = field(default=8, metadata={
        "help": "Labelled, unused rollouts needed before an update (>= 1: one is enough, it trains against its "
                "running baseline; more make an update less noisy and write fewer checkpoints)."})
    max_batch: int = field(default=64, metadata={
        "help": "Most labelled rollouts one update takes, oldest finished first (>= min_labelled)."})
    poll_s: float = field(default=1.0, metadata={"help": "Seconds between polls of the store while waiting (> 0)."})
    keep_checkpoints: int = field(default=3, metadata={
        "help": "Checkpoints (the weights before an update) kept on disk; older ones are deleted, and undo() "
                "past them is refused (>= 1). A GRPOTrainer checkpoint of SmolLM2-135M is ~0.5-1.6 GB."})
    baseline_init: float = field(default=0.5, metadata={
        "help": "The baseline of a reward before any update used a labelled rollout (reward units, finite): the "
                "middle of your label scale (0.5 for 0/1 labels, 0.0 for -1/+1)."})

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ConfigError naming the first field out of range."""
        if isinstance(self.min_labelled, bool) or not isinstance(self.min_labelled, int) or self.min_labelled < 1:
            raise ConfigError(f"TrafficConfig.min_labelled must be an int >= 1 (labelled rollouts per update), "
                              f"got {self.min_labelled!r}")
        if not isinstance(self.max_batch, int) or self.max_batch < self.min_labelled:
            raise ConfigError(f"TrafficConfig.max_batch must be an int >= min_labelled ({self.min_labelled}), "
                              f"got {self.max_batch!r}")
        if not isinstance(self.poll_s, (int, float)) or not math.isfinite(self.poll_s) or self.poll_s <= 0:
            raise ConfigError(f"TrafficConfig.poll_s must be a number of seconds > 0, got {self.poll_s!r}")
        if not isinstance(self.keep_checkpoints, int) or self.keep_checkpoints < 1:
            raise ConfigError(f"TrafficConfig.keep_checkpoints must be an int >= 1, got {self.keep_checkpoints!r}")
        b = self.baseline_init
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b):
            raise ConfigError(f"TrafficConfig.baseline_init must be a finite number of reward units (0.5 for 0/1 "
                              f"labels), got {b!r}")
        self.validate_credit(None)


class TrafficLearner(CreditAssignment):
    """Train ``trainer`` on labelled traffic from ``store`` while users keep sending it (see the module docstring).

    The notebook verbs are every algorithm's (:class:`~lightning_nb.algorithm.base.Algorithm`):
    ``start(updates)`` returns at once and polls in a background thread (``updates`` None: until
    stopped), ``pause()`` parks it at an update boundary, ``resume()``, ``stop()``, ``wait(until_step=k)``
    (``global_step``: updates done). :meth:`step` runs one poll (and an update when one is due) from a cell instead.
    :meth:`save` / :meth:`load` checkpoint the run (trainer state, this learner's record).

    Args:
        store: where the traffic is.
        trainer: updates the weights of the engine that serves the traffic (e.g. ``GRPOTrainer(engine)``).
        config: :class:`TrafficConfig`.
        select: ``rollout -> bool``, which finished rollouts are traffic (default :func:`is_traffic`).
        since: only rollouts that ended after this time (float seconds since the epoch; 0: all in the store).
        checkpoint_dir: where the checkpoint before each update goes (``before_update_<k>.pt``, ~0.5-1.6 GB each
            for SmolLM2-135M; ``keep_checkpoints`` of them). None: a new temporary folder (:attr:`checkpoint_dir`,
            ``lightning_nb_traffic_*`` under the system's temporary directory) that goes with the learner: removed
            by :meth:`stop` and :meth:`close`, when the learner is garbage-collected (with its trainer, which
            holds it) and at interpreter exit; :meth:`undo` needs it, so name a folder to undo after ``stop()``.
            A folder you name is never removed.
        adapter: spans to triplets (default ``TripletAdapter()``).
        id_key: the task field naming a task's group (:func:`task_key`).
        name: this learner's name in the store's training record (:attr:`name`; default a new ``traffic-learner-<hex>``).
            :meth:`load` restores the saved one, so a learner continued after a restart keeps its name.
        retrain: train on rollouts an update (of any learner on this store) already trained on. False (the
            default): :meth:`poll` skips them and says how many (``skipped``) and why (``skipped_why``).

    Raises:
        ConfigError: ``select`` is not callable; ``since`` is not a finite number; ``name`` is not a non-empty str;
            a bad ``config``.
    """

    def __init__(self, store: LightningStore, trainer: Trainer, config: Optional[TrafficConfig] = None, *,
                 select: Optional[Callable[[Rollout], bool]] = None, since: float = 0.0,
                 checkpoint_dir: Optional[str | Path] = None, adapter: Optional[TripletAdapter] = None,
                 id_key: str = "id", name: Optional[str] = None, retrain: bool = False) -> None:
        if name is not None and (not isinstance(name, str) or not name):
            raise ConfigError(f"name must be a non-empty str (this learner's name in the store's training record), "
                              f"got {name!r}")
        if select is not None and not callable(select):
            raise ConfigError(f"select must be a function rollout -> bool, got {type(select).__name__}")
        if isinstance(since, bool) or not isinstance(since, (int, float)) or not math.isfinite(since):
            raise ConfigError(f"since must be float seconds since the epoch (0.0: every rollout), got {since!r}")
        # metrics: one row per update (updates_df() shows its columns)
        super().__init__(store, trainer, config or TrafficConfig())
        self.select = select or is_traffic
        self.adapter = adapter or TripletAdapter()
        self.id_key = id_key
        self._own_dir = checkpoint_dir is None
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else self._temporary_dir()
        self._since = float(since)
        self._seen: set[str] = set()
        self.pending: dict[str, float] = {}  # traffic rollout id -> end_time, not yet used
        self.used: set[str] = set()
        # labelled, but nothing to train: the adapter made no triplet of it, or it was sampled more than the
        # trainer's max_staleness weight versions ago (the trainer would drop it)
        self.unusable: set[str] = set()
        self.reward_sums: dict[str, list[float]] = {}  # task key -> [sum, count] of used rewards (baseline())
        self.last_poll: dict[str, Any] = {}
        self.name = name or new_id(_NAME_PREFIX)  # in the store's training record: which learner's update used a rollout
        self.retrain = bool(retrain)
        self.skipped: dict[str, TrainedMark] = {}  # traffic an update already trained on (store mark), not retrained
        self._marks = PendingMarks()
        self._poll_lock = threading.RLock()  # a cell's poll()/labelled() beside the loop's
        self._baselines: dict[str, float] = {}  # the batch's baselined rollout -> its running baseline (_batch)

    store: LightningStore
    trainer: Trainer
    config: TrafficConfig

    @property
    def updates(self) -> list[dict[str, Any]]:
        """The rows of :meth:`updates_df`, one per update: :attr:`metrics` (the update's step row)."""
        return self.metrics

    def baseline(self, key: Optional[str] = None) -> float:
        """The running baseline a rollout with task key ``key`` trains against (module docstring), reward units.

        The mean final reward of the rollouts with that key that updates used; for a key none used (or
        ``key`` None), the mean over every rollout updates used; before any, ``config.baseline_init``.
        Undone updates still count: their labels were real rewards of the policy of that time.
        """
        sums = self.reward_sums.get(key) if key is not None else None
        if sums is None:
            total = [sum(v[0] for v in self.reward_sums.values()), sum(v[1] for v in self.reward_sums.values())]
            sums = total if total[1] else None
        return sums[0] / sums[1] if sums is not None else float(self.config.baseline_init)

    def waiting_for(self) -> str:
        """What the learner waits for, from :attr:`last_poll` (no store query): ``"3 of 8 labelled,
        5 unlabelled: waiting for 5 more labelled rollouts"``; ``""`` while an update runs. ``wait()`` shows it."""
        poll = self.last_poll
        if not poll:
            return "the first poll of the store"
        if "waiting_for" not in poll:
            return ""
        return (f"{poll['labelled']} of {self.config.min_labelled} labelled, {poll['unlabelled']} unlabelled: "
                f"waiting for {poll['waiting_for']}")

    def stall_advice(self) -> str:
        """Why no update comes, and what to do: no traffic, too few labels, or rewards equal to their baselines."""
        poll = self.last_poll
        if self.progress.phase == "paused" or "waiting_for" not in poll:
            return super().stall_advice()
        if poll["pending"] == 0:
            skipped = f" ({poll['skipped_why']})" if poll.get("skipped_why") else ""
            return ("No unused finished traffic: requests to proxy.traffic_endpoint() or Runner.step(task) are "
                    f"traffic (select= picks which); traffic an update used is never used again{skipped}.")
        if poll["labelled"] < self.config.min_labelled:
            lower = (f"lower TrafficConfig.min_labelled (now {self.config.min_labelled}; 1 is enough: a lone label "
                     "trains against its baseline)")
            ids = [rid for rid, reward in self.store.final_rewards(list(self.pending)).items() if reward is None]
            if not ids:  # nothing to label: only more traffic (or a lower bar) brings the update
                return (f"All {poll['labelled']} unused traffic rollouts are labelled: more traffic is needed "
                        "(requests to proxy.traffic_endpoint() or Runner.step(task)), then its labels, or "
                        f"{lower}.")
            return (f"Label traffic with store.label(rollout_id, reward) ({len(ids)} unlabelled, e.g. {ids[:3]}), "
                    f"or {lower}.")
        return (f"Each labelled reward equals its baseline (learner.baseline(), now {self.baseline():.3g} over all "
                "used traffic), so an update would learn nothing: label more traffic, with rewards that differ.")

    # ----- polling -------------------------------------------------------------------------
    def poll(self) -> dict[str, Any]:
        """Read new finished traffic from the store; returns (and keeps as :attr:`last_poll`) the counts.

        ``{"pending": unused traffic, "labelled": of those, with a final reward, "unlabelled": without,
        "ready": labelled ones an update may take (at most max_batch), "skipped": traffic an update (of any learner
        on this store, per its training record) already trained on, left out unless ``retrain=True``,
        "skipped_why": which learners' updates, in one line ('' when none)}``. Safe beside the running loop.
        """
        with self._poll_lock:
            return self._poll()

    def _poll(self) -> dict[str, Any]:
        self.config.validate()
        self._marks.flush(self.store, self.name)
        for r in self.store.completed_since(self._since - 1.0):  # 1 s back: rollouts that ended at the same time
            if r.rollout_id in self._seen:
                continue
            self._seen.add(r.rollout_id)
            self._since = max(self._since, r.end_time or 0.0)
            if r.status == "succeeded" and self.select(r):
                self.pending[r.rollout_id] = r.end_time or 0.0
        if not self.retrain:  # trained on by an update of some learner on this store (one beside this one too)
            for rid, mark in first_marks(self.store, list(self.pending)).items():
                self.pending.pop(rid, None)
                self.skipped[rid] = mark
        ids = [rid for rid, _ in sorted(self.pending.items(), key=lambda kv: kv[1])]
        rewards = self.store.final_rewards(ids) if ids else {}
        labelled = [rid for rid in ids if rewards[rid] is not None]
        self.last_poll = {"pending": len(ids), "labelled": len(labelled), "unlabelled": len(ids) - len(labelled),
                          "ready": labelled[:self.config.max_batch], "skipped": len(self.skipped),
                          "skipped_why": skipped_why(self.skipped)}
        return self.last_poll

    def labelled(self) -> list[str]:
        """Ids of the labelled traffic rollouts no update has used yet, oldest first (polls the store)."""
        return list(self.poll()["ready"])

    # ----- one update ------------------------------------------------------------------------
    def step(self, progress: Optional[bool] = None) -> Optional[dict[str, Any]]:
        """Poll, and run one update if ``min_labelled`` labelled rollouts with signal are waiting.

        Returns the update's row of :meth:`updates_df` (a dict), or None when it is not due yet
        (:attr:`last_poll` says how many are labelled; ``last_poll["waiting_for"]`` why). Before the
        update the trainer's state is checkpointed to ``checkpoint_dir`` (:meth:`undo` loads it).

        ``progress``: a tqdm.auto bar of the step's phase while it runs (labelled rollouts found, the checkpoint,
        the update's micro-batches); None (the default): shown in a notebook kernel, not in a script. :meth:`run`
        (the background loop, whose bar is ``wait()``'s) passes False.

        Raises:
            ConfigError: called from a cell while the background loop runs (it would use rollouts twice).
        """
        if self.running and not self.loop.in_loop_thread():
            raise ConfigError("the learner's background loop is running and updates by itself; stop() it before "
                              "calling step() from a cell, or read poll() / updates_df()")
        with self.step_bar(progress):
            return self._step()

    def _step(self) -> Optional[dict[str, Any]]:
        """:meth:`step`'s work."""
        with self._poll_lock:
            poll = self._poll()
            ready = poll["ready"]
            self.report_progress("waiting", len(ready), self.config.min_labelled, unit="labelled",
                                 step=self.global_step + 1)
            if len(ready) < self.config.min_labelled:
                poll["waiting_for"] = f"{self.config.min_labelled - len(ready)} more labelled rollouts"
                return None
            triplets, keys = self._batch(ready)
            if not triplets:
                poll["waiting_for"] = "a reward that differs from its baseline (each equals it: nothing to learn)"
                return None
        self.at_boundary("before update")
        k = self.global_step + 1
        self.report_progress("checkpoint", 0, 0, unit="", step=k)  # the weights before it: seconds, ~1 GB
        checkpoint = self._checkpoint(k)
        rollout_ids = list(dict.fromkeys(t.rollout_id for t in triplets))
        rewards = self.store.final_rewards(rollout_ids)
        version_before = self.trainer.engine.weight_version
        update = self.train(triplets, on_progress=self._update_reporter())  # credit, then the trainer's update
        metrics = update.metrics
        with self._poll_lock:
            self._marks.add(self.store, self.name, rollout_ids, k)  # the store's record: trained once per store
            self.used.update(rollout_ids)
            for rid in rollout_ids:
                self.pending.pop(rid, None)
                sums = self.reward_sums.setdefault(keys[rid], [0.0, 0])
                sums[0], sums[1] = sums[0] + float(rewards[rid] or 0.0), sums[1] + 1
        row = {"update": k, "learner": self.name, "time": time.time(), "rollout_ids": rollout_ids, "n": len(rollout_ids),
               "groups": len({t.group_id for t in triplets}),
               "baselined": len({t.rollout_id for t in triplets if t.rollout_id in self._baselines}),
               "reward_mean": sum(r or 0.0 for r in rewards.values()) / len(rewards),
               "weight_version_before": version_before,
               "weight_version_after": self.trainer.engine.weight_version, "trainer_step": metrics["step"],
               "checkpoint": str(checkpoint), "stale_episodes_dropped": metrics.get("stale_episodes_dropped", 0),
               "undone": False}
        row = self.record({**metrics, **row}, update)  # the trainer's update row with this learner's columns
        self._prune_checkpoints()
        return row

    def _batch(self, ready: Sequence[str]) -> tuple[list[Triplet], dict[str, str]]:
        """``(triplets with their update's group ids, rollout id -> task key)``: those with signal.

        Equal inputs (:func:`task_key`) whose rewards differ are one GRPO group; every other rollout trains against
        its :meth:`baseline` (module docstring), kept in ``_baselines`` for :meth:`assign_credit`. Rollouts without signal are left out (they stay pending);
        rollouts the adapter cannot use are set aside.
        """
        k = self.global_step + 1
        triplets = self.adapter.adapt(self.store, ready)
        adapted = set(t.rollout_id for t in triplets)
        for rid in ready:
            if rid not in adapted:  # labelled, but nothing to train (no LLM call, no token IDs)
                self.unusable.add(rid)
                self.pending.pop(rid, None)
        inputs = {r.rollout_id: r.input for r in self.store.query_rollouts(rollout_ids=sorted(adapted))}
        keys = {rid: task_key(inputs[rid], self.id_key) for rid in adapted}
        rewards: dict[str, set[float]] = {}
        for t in triplets:
            rewards.setdefault(keys[t.rollout_id], set()).add(t.reward)
        grouped = {rid for rid, key in keys.items() if len(rewards[key]) > 1}  # a group whose rewards differ: GRPO
        self._baselines = {rid: self.baseline(keys[rid]) for rid in adapted if rid not in grouped}
        regrouped = [t.model_copy(update={GROUP_ID_KEY: f"{k}:{'task' if t.rollout_id in grouped else 'baseline'}:"
                                                        f"{keys[t.rollout_id]}"}) for t in triplets]
        stale = self.trainer.stale_rollouts(regrouped) if regrouped else set()
        for rid in stale:  # the trainer would drop them: set aside, as unusable, rather than pending for ever
            self.unusable.add(rid)
            self.pending.pop(rid, None)
        regrouped = [t for t in regrouped if t.rollout_id not in stale]
        with_signal = self.signal_groups(regrouped) if regrouped else set()
        return [t for t in regrouped if t.group_id in with_signal], keys

    def assign_credit(self, triplets: Sequence[Triplet]) -> Credit:
        """The batch's advantages: GRPO's within its task groups, ``reward − baseline`` for each rollout trained
        against its running :meth:`baseline` (:func:`lightning_nb.credit.assign` with ``baselines``); stale
        episodes left out first."""
        return assign(self.credit_rule(), triplets, exclude=sorted(self.trainer.stale_rollouts(triplets)),
                      baselines=self._baselines)

    def _update_reporter(self) -> Callable[[int, int, str], None]:
        step = self.global_step + 1

        def report(done: int, total: int, unit: str) -> None:
            self.report_progress("update", done, total, unit=unit, step=step)

        return report

    # ----- the loop ----------------------------------------------------------------------------
    def run(self, steps: Optional[int] = None) -> None:
        """Poll and update until ``steps`` updates ran (None: until :meth:`stop`); waits ``poll_s`` between polls."""
        done = 0
        while steps is None or done < steps:
            self.at_boundary("before poll")
            if self.step(progress=False) is not None:
                done += 1
            elif self.loop.sleep(self.config.poll_s):
                raise LoopStopped("stopped while waiting for labelled traffic")

    # ----- audit and undo ------------------------------------------------------------------------
    def updates_df(self) -> Any:
        """One row per update: ``update`` (1-based), ``learner`` (:attr:`name`, as in the store's training record
        ``store.query_trained()``), ``time`` (when it ended: a datetime in UTC, timezone-naive,
        as the store's frames), ``rollout_ids`` (the rollouts it trained on), ``n``, ``groups``, ``baselined``
        (rollouts trained against their running :meth:`baseline`, not in a group), ``reward_mean`` (their
        final rewards), ``weight_version_before`` / ``_after``, ``trainer_step``, ``checkpoint`` (the weights
        before it; None once deleted, see ``keep_checkpoints``), ``stale_episodes_dropped`` (by the trainer),
        ``undone`` (its weights were rolled back by :meth:`undo` / :meth:`load_checkpoint`)."""
        import pandas as pd

        df = pd.DataFrame([dict(r) for r in self.updates], columns=UPDATE_COLUMNS)
        df["time"] = pd.to_datetime(df["time"].astype("float64"), unit="s")  # the rows keep epoch seconds
        return df

    def _checkpoint(self, update: int) -> Path:
        """Save the run (trainer state: the weights before ``update``) to ``checkpoint_dir``; returns the path."""
        if self._own_dir and not self._remove_dir.alive:  # removed by stop()/close(), and started again
            self.checkpoint_dir = self._temporary_dir()
        return self.save(self.checkpoint_dir / f"before_update_{update}.pt")

    def _temporary_dir(self) -> Path:
        """A new temporary checkpoint folder, removed when this learner is collected or the interpreter exits
        (``weakref.finalize``: it holds the path, not the learner) unless :meth:`close` removed it first."""
        folder = tempfile.mkdtemp(prefix="lightning_nb_traffic_")
        self._remove_dir = weakref.finalize(self, shutil.rmtree, folder, True)
        return Path(folder)

    def _prune_checkpoints(self) -> None:
        """Delete the checkpoints older than the last ``keep_checkpoints`` (their rows' ``checkpoint`` becomes None)."""
        for row in self.updates[:-self.config.keep_checkpoints]:
            if row["checkpoint"] is not None:
                path = Path(row["checkpoint"])
                if path.is_dir():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)
                row["checkpoint"] = None

    def load_checkpoint(self, update: int) -> dict[str, Any]:
        """Restore the trainer (weights, optimizer, step) to what it was just before update ``update``.

        That update and every later one are marked ``undone`` in :meth:`updates_df`; their rollouts stay
        used (the record is kept). The engine serves the restored weights at once, with the weight version
        of that moment. Call it while no update runs: the loop paused, stopped or never started.

        Returns:
            The row of ``update``.

        Raises:
            ConfigError: no such update; its checkpoint was deleted (``keep_checkpoints``); the loop is
                running (``pause()`` first).
        """
        if not 1 <= update <= len(self.updates):
            raise ConfigError(f"update must be in 1..{len(self.updates)} (the rows of updates_df()), got {update!r}")
        if self.running and self.state != "paused":
            raise ConfigError("load_checkpoint()/undo() while the learner's loop is running: call pause() (or stop()) "
                              "first, then undo, then resume()")
        row = self.updates[update - 1]
        if row["checkpoint"] is None:
            raise ConfigError(f"the checkpoint before update {update} was deleted (TrafficConfig.keep_checkpoints="
                              f"{self.config.keep_checkpoints} keeps the last ones); raise keep_checkpoints for "
                              "later runs")
        restore_checkpoint(self.trainer, row["checkpoint"])
        for later in self.updates[update - 1:]:
            later["undone"] = True
        return row

    def undo(self) -> dict[str, Any]:
        """Undo the last update not yet undone (:meth:`load_checkpoint` of it); returns its row.

        Raises:
            ConfigError: nothing to undo; as :meth:`load_checkpoint`.
        """
        live = [r for r in self.updates if not r["undone"]]
        if not live:
            raise ConfigError("no update to undo: updates_df() has no update that is not undone yet")
        return self.load_checkpoint(live[-1]["update"])

    # ----- the run's checkpoint -----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This learner's record: its name, the updates, the used and unusable rollout ids, the poll position, the config and
        the used rewards per task key (:meth:`baseline`)."""
        return {**self.run_record(), "name": self.name, "used": sorted(self.used),
                "unusable": sorted(self.unusable), "since": self._since, "config": asdict(self.config),
                "reward_sums": {k: list(v) for k, v in self.reward_sums.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (the config is not changed); pending traffic is read again at the next poll."""
        if "updates" in state:  # saved by an earlier version: the rows were "updates"
            state = {**state, "global_step": len(state["updates"]), "metrics": state["updates"]}
        self.load_run_record(state)
        self.name = state.get("name", self.name)  # (older saves: none) the same learner in the training record
        self.used, self.unusable = set(state["used"]), set(state["unusable"])
        self.reward_sums = {k: list(v) for k, v in state.get("reward_sums", {}).items()}  # (older saves: none)
        self._seen = set(self.used) | set(self.unusable)
        self._since, self.pending, self.skipped = 0.0, {}, {}

    def save(self, path: str | Path) -> Path:
        """Write the run's checkpoint (:func:`~lightning_nb.algorithm.checkpoint.save_run`: the trainer's state and
        this learner's record) to ``path``; returns what was written."""
        return save_run(self, path)

    def load(self, path: str | Path, *, keep_config: bool = False, **options: Any) -> None:
        """Continue from a :meth:`save` checkpoint (:func:`~lightning_nb.algorithm.checkpoint.load_run`).

        Raises:
            FileNotFoundError: ``path`` does not exist.
            ConfigError: the loop runs; not a checkpoint of this format or of this model.
        """
        load_run(self, path, keep_config=keep_config, **options)

    def stop(self, timeout: float = 600.0) -> bool:
        """End the loop (:meth:`Algorithm.stop <lightning_nb.algorithm.base.Algorithm.stop>`); once it ended, delete the temporary ``checkpoint_dir``
        (:meth:`close`; a folder you named stays). Returns True once the loop has ended."""
        ended = super().stop(timeout)
        if ended:
            self.close()
        return ended

    def close(self) -> None:
        """Delete the temporary ``checkpoint_dir`` made when none was given (undo is refused afterwards; a
        folder you named is left as it is). Idempotent."""
        if self._own_dir and self._remove_dir.alive:
            self._remove_dir()
            for row in self.updates:
                row["checkpoint"] = None
