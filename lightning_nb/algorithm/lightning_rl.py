"""The algorithm: enqueue rollouts, wait, adapt spans to triplets, ask the trainer to update.

:class:`LightningRL` is the synchronous on-policy loop of the Agent Lightning
paper with GRPO groups: each step draws ``tasks_per_step`` distinct training tasks
(without replacement: one group per task), enqueues each ``group_size``
times (one group id, under the adapter's ``group_key``), waits for the runners,
adapts the spans with :class:`~lightning_nb.adapter.TripletAdapter` and calls the
trainer's ``update`` (:class:`~lightning_nb.trainers.base.Trainer`). It owns the run
(:class:`~lightning_nb.algorithm.base.Algorithm`): the background thread and its step boundaries
(:class:`~lightning_nb.algorithm.control.LoopControl`), the step counter and metrics rows, and the
run's checkpoint (:func:`~lightning_nb.algorithm.checkpoint.save_run`).
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union, overload

from lightning_nb.adapter import TripletAdapter
from lightning_nb.algorithm.checkpoint import load_run, save_run
from lightning_nb.algorithm.control import LoopStopped
from lightning_nb.algorithm.rewards_branches import RewardAndBranches, reward_name
from lightning_nb.algorithm.rl_config import AlgorithmConfig, task_key
from lightning_nb.algorithm.slice_report import SliceReport
from lightning_nb.algorithm.task_draw import TaskDraw
from lightning_nb.errors import ConfigError, LightningNbError
from lightning_nb.loggers import MetricLogger, make_loggers
from lightning_nb.replay.branching import BranchConfig
from lightning_nb.replay.rescoring import RewardFn
from lightning_nb.slices import Slicer, ordered_labels, slice_keys, slicer_name
from lightning_nb.store.base import LightningStore
from lightning_nb.store.rules import reward_or_zero
from lightning_nb.trainers.base import Trainer
from lightning_nb.trainers.edits import ConfigChange, ConfigWatch
from lightning_nb.trainers.checkpoint import rng_state
from lightning_nb.types import SAMPLING_PARAMETERS_KEY, RolloutConfig

__all__ = ["AlgorithmConfig", "LightningRL", "SliceReport", "task_key"]


class LightningRL(RewardAndBranches):
    """Drive GRPO training of ``trainer`` on ``train_tasks`` through ``store``; own the loop and its checkpoints.

    ``start(steps)`` runs :meth:`run` in a background thread that ``pause()`` parks at a step
    boundary, ``resume()`` continues (checking config edits first) and ``stop()`` ends
    (:class:`~lightning_nb.algorithm.base.Algorithm`, the contract). ``global_step`` counts the steps done,
    :meth:`metrics_df` has one row per step (:meth:`step`). :meth:`save` / :meth:`load` checkpoint the run:
    this algorithm's state, the task sampler's, the RNG states and the trainer's ``state_dict()``.

    Runners must be consuming ``store`` (see :func:`~lightning_nb.runners.start_runners`).
    Tasks are usually dicts. A step's rollouts of one task form a GRPO group, whose ``group_id`` is
    ``"<step>.<round>:<task key>"``; the task key is ``task[id_key]`` (the ``"id"`` field by default),
    or for a task without that field (or one that is not a dict) a hash of its content
    (:func:`task_key`: equal tasks share a key, so give tasks an ``id`` when two equal ones must stay
    apart, or when a task's ``repr`` is not its content).

    Args:
        store: the store the runners read.
        trainer: updates weights.
        train_tasks / val_tasks: task inputs handed to the agent.
        config: :class:`AlgorithmConfig`.
        id_key: the task field whose value names the task's GRPO group (see above and :func:`task_key`).
        on_step: optional callback ``on_step(metrics_row)`` after every step (e.g. a progress bar).
        loggers: experiment loggers that get every step's row (:mod:`lightning_nb.loggers`):
            :class:`~lightning_nb.loggers.MetricLogger` objects, or the shorthands
            ``"tensorboard"``, ``"wandb"`` (offline), ``"mlflow"`` with default settings.
            Flushed when :meth:`run` ends, closed by :meth:`close_loggers` (and by :meth:`run`
            when the loop is stopped or fails). Raises MissingDependencyError
            (an ImportError naming the extra) when a logger's package is missing.
        slice_by: a task field name (``"ops"``) or a function ``task -> label``: the periodic
            evaluation of :meth:`step` (``config.val_every``) also records the held-out reward
            per slice, as ``val_reward/<slice>`` columns (``val_reward/ops=1``) beside
            ``val_reward``. Checked against ``val_tasks`` here: raises ConfigError as
            :meth:`evaluate` does for a bad ``by``. Not used by ``evaluate()`` without ``by``.
            ``config.slice_weights`` weighs the training tasks by these labels.
        group_judge: a :class:`~lightning_nb.rewards.GroupJudge` (RULER-style): after each sample round's rollouts
            finish and before the adapter reads their rewards, it scores each group in one judge call
            (:meth:`~lightning_nb.rewards.GroupJudge.judge_rollouts`); a group whose reply does not parse keeps
            the agent's rewards (a warning), counted in the step's ``judge_groups_failed``. Not used by ``evaluate()``.
        branch: a :class:`~lightning_nb.replay.branching.BranchConfig`: each step also branches some of its
            episodes at a branch point (after a tool result) and trains on the branch groups (Tree-GRPO, ARPO);
            the row's ``branch_groups``, ``branch_groups_with_signal``, ``branch_rollouts`` and
            ``branch_reward_mean`` report them. None (default): no branches.

    Raises:
        ConfigError: ``train_tasks`` is empty, ``branch`` is not a BranchConfig, ``slice_by`` fails on a val task, or
            ``config.slice_weights`` is set without ``slice_by``, names a label no training task
            has, or weighs every training task 0 (checked again whenever the config was edited).
    """

    def __init__(self, store: LightningStore, trainer: Trainer, train_tasks: Sequence[Any],
                 val_tasks: Sequence[Any] = (), config: Optional[AlgorithmConfig] = None, *,
                 adapter: Optional[TripletAdapter] = None, id_key: str = "id",
                 on_step: Optional[Callable[[dict], None]] = None,
                 loggers: Sequence[Union[MetricLogger, str]] = (), slice_by: Optional[Slicer] = None,
                 group_judge: Any = None, branch: Optional[BranchConfig] = None) -> None:
        if not train_tasks:
            raise ConfigError("train_tasks is empty; load some with lightning_nb.tasks.calc.load_tasks('train')")
        if slice_by is not None:
            slice_keys(list(val_tasks), slice_by)  # a bad field or function fails here, not after a step
        self.slice_by = slice_by
        super().__init__(store, trainer, config or AlgorithmConfig())
        self.last_report: Optional[SliceReport] = None  # the latest evaluate(by=...) result
        # the latest evaluate()'s final reward per task, in task order (None: cancelled)
        self.last_eval_rewards: list[Optional[float]] = []
        self.train_tasks, self.val_tasks = list(train_tasks), list(val_tasks)
        self.adapter = adapter or TripletAdapter()
        self.id_key = id_key
        self.on_step = on_step
        self.group_judge = group_judge
        self.last_judge: dict[str, int] = {}  # the step's judge counts
        judge_key = getattr(group_judge, "group_key", self.adapter.group_key)
        if judge_key != self.adapter.group_key:
            raise ConfigError(f"group_judge reads the GRPO group from rollout metadata key {judge_key!r} but the "
                              f"adapter from {self.adapter.group_key!r} (TripletAdapter(group_key=...)): the judge "
                              "would score other groups than the trainer's; give both the same group_key")
        self._rng = random.Random(self.config.seed)
        # (state_dict(), global RNG states) at the start of the step in progress, kept until its update
        # begins: what a checkpoint saved inside the step holds (checkpoint_state)
        self._step_start: Optional[tuple[dict[str, Any], dict[str, Any]]] = None
        self.val_history: list[tuple[int, float]] = []
        self.last_sample_rounds = 0
        self.last_groups_with_signal = 0
        self.last_skipped: dict[str, int] = {}
        self.config_watch = ConfigWatch(self.config)  # what the last step applied of the config
        self.task_draw = TaskDraw(self.train_tasks, id_key, slice_by)  # which tasks a sample round enqueues
        if branch is not None and not isinstance(branch, BranchConfig):
            raise ConfigError(f"LightningRL(branch=...) is a {type(branch).__name__}; pass a "
                              "BranchConfig(parents=2, n=4) or None")
        self.branch = branch
        self.last_branch = {}  # the step's branch-group counts (with branch)
        self.reward_fn = None  # set_reward(): the reward from the next step on
        self._reward_applied = None  # the name of the reward function the last step used
        self._rescored = {}  # the step's rollouts' rewards under reward_fn
        self.task_draw.weights(self.config.slice_weights)  # a bad slice_weights fails here
        self.loggers = make_loggers(loggers, config=self._logged_config()) if loggers else []

    config: AlgorithmConfig
    trainer: Trainer

    def default_steps(self) -> int:
        """``config.steps``: what :meth:`start` and :meth:`run` take by default."""
        return self.config.steps

    def check_before_resume(self) -> None:
        """``resume()`` first checks the edits of both configs made while paused (ConfigError if invalid)."""
        super().check_before_resume()
        self._check_tasks_per_step()

    def _check_tasks_per_step(self) -> None:
        """Raise ConfigError when ``tasks_per_step`` exceeds the distinct training tasks (a step draws each once).
        Checked before a step collects and on ``resume()``, not at construction: an algorithm built only to
        :meth:`evaluate` may have fewer training tasks."""
        distinct = len(set(self.task_draw.keys()))
        if self.config.tasks_per_step > distinct:
            raise ConfigError(f"AlgorithmConfig.tasks_per_step={self.config.tasks_per_step}, but train_tasks has "
                              f"{distinct} distinct task(s) (by task_key, id_key={self.id_key!r}) and a step draws "
                              f"each at most once; set tasks_per_step <= {distinct} or add training tasks")

    def _rollout_config(self) -> RolloutConfig:
        return RolloutConfig(max_attempts=self.config.max_attempts, timeout_seconds=self.config.rollout_timeout_s)

    def _enqueue_groups(self, n_tasks: int, round_: int, taken: set[str]) -> list[str]:
        cfg = self.config
        sampling = {"temperature": cfg.temperature, "max_tokens": cfg.max_tokens}
        ids = []
        for i in self.task_draw.draw(n_tasks, taken, cfg.slice_weights, self._rng):
            group = f"{self.global_step + 1}.{round_}:{self.task_draw.keys()[i]}"
            # one call per group: one transaction (and one fsync) in a SqliteStore, one lock in memory
            ids += [r.rollout_id for r in self.store.enqueue_rollouts(
                [self.train_tasks[i]] * cfg.group_size, mode="train", config=self._rollout_config(),
                metadata={self.adapter.group_key: group, SAMPLING_PARAMETERS_KEY: sampling})]
        return ids

    def collect(self) -> tuple[list, list[str]]:
        """Enqueue one step's groups, wait, and return (triplets, rollout_ids).

        With ``dynamic_sampling`` (DAPO, Yu et al. 2025, section 3.2), groups the trainer
        cannot learn from (:meth:`signal_groups`: all advantages 0, e.g. all rewards equal, or fewer
        than ``min_group_size`` episodes left) add nothing, so more tasks are sampled, up to
        ``max_sample_rounds`` rounds, until ``tasks_per_step`` groups carry signal. Unlike
        DAPO the groups without signal are still returned: the trainer skips them, but they
        count in the step's mean train reward. Between rounds the loop passes a step
        boundary (:meth:`~lightning_nb.algorithm.base.Algorithm.at_boundary`), where a pause parks it. Adapter skips of
        every round are summed in :attr:`last_skipped`.
        """
        cfg = self.config
        self._check_tasks_per_step()
        triplets: list = []
        ids: list[str] = []
        with_signal = 0
        skipped: dict[str, int] = {}
        taken: set[str] = set()  # the step's tasks so far: a later round draws the others first
        self.last_sample_rounds, self.last_judge, self._rescored = 0, {}, {}
        for round_ in range(cfg.max_sample_rounds if cfg.dynamic_sampling else 1):
            if round_ > 0:
                self.at_boundary("between sample rounds")
            new_ids = self._enqueue_groups(cfg.tasks_per_step - with_signal, round_, taken)
            rounds = cfg.max_sample_rounds if cfg.dynamic_sampling else 1  # (counted on the bars when > 1)
            self.wait_for(new_ids, on_progress=self._reporter("rollouts", self.global_step + 1, len(new_ids),
                                                              before=len(ids), round_=round_ + 1 if rounds > 1 else 0))
            if self.group_judge is not None:  # the judge's rewards replace the agent's before the adapter reads them
                for k, v in self.group_judge.judge_rollouts(self.store, new_ids).items():
                    self.last_judge[k] = self.last_judge.get(k, 0) + v
            new = self.adapter.adapt(self.store, new_ids)
            if self.reward_fn is not None:  # set_reward(): trains on the new reward; the spans stay as recorded
                new = self._apply_reward(new, new_ids)
            for k, v in self.adapter.last_skipped.items():
                skipped[k] = skipped.get(k, 0) + v
            triplets += new
            ids += new_ids
            self.last_sample_rounds = round_ + 1
            with_signal += len(self.signal_groups(new)) if new else 0
            if with_signal >= cfg.tasks_per_step:
                break
        self.last_groups_with_signal = with_signal
        self.last_skipped = skipped
        if self.branch is not None:  # branch groups of this step's episodes join its batch (not its ids)
            triplets = triplets + self._collect_branches(ids)
        return triplets, ids

    def _reporter(self, phase: str, step: int, n: int, before: int = 0,
                  round_: int = 0) -> Callable[[int, int], None]:
        """The ``on_progress`` of :meth:`wait_for` that reports ``phase`` of ``step`` to the loop
        (:meth:`~lightning_nb.algorithm.base.Algorithm.report_progress`), ``before`` finished rollouts counted ahead of the ``n`` waited
        for (earlier sample rounds of the step; ``round_`` this one's number, 0: not counted); reports 0 of ``n``
        at once."""
        def report(finished: int, total: int) -> None:
            self.report_progress(phase, before + finished, before + total, unit="rollouts", step=step,
                                 sample_round=round_)

        report(0, n)
        return report

    def rollout_rewards(self, rollout_ids: Sequence[str]) -> list[float]:
        """Final rewards of the finished, not cancelled ``rollout_ids``, a failed one (or one without reward) as 0.

        The rule is :func:`lightning_nb.store.rules.final_reward`; ``evaluate()`` and the
        step's ``reward_mean`` both use this.
        """
        return list(self._finished_rewards(rollout_ids).values())

    def _finished_rewards(self, rollout_ids: Sequence[str]) -> dict[str, float]:
        """:meth:`rollout_rewards` keyed by rollout id (in ``rollout_ids`` order)."""
        rewards = self.store.final_rewards(list(rollout_ids))
        status = {r.rollout_id: r.status for r in self.store.query_rollouts(rollout_ids=list(rollout_ids))}
        return {rid: reward_or_zero(rewards[rid]) for rid in rollout_ids if status[rid] in ("succeeded", "failed")}

    @overload
    def evaluate(self, tasks: Optional[Sequence[Any]] = ..., progress: bool = ..., *, by: None = ...) -> float: ...

    @overload
    def evaluate(self, tasks: Optional[Sequence[Any]] = ..., progress: bool = ..., *, by: Slicer) -> SliceReport: ...

    def evaluate(self, tasks: Optional[Sequence[Any]] = None, progress: bool = True, *,
                 by: Optional[Slicer] = None) -> Union[float, SliceReport]:
        """Mean final reward over ``tasks`` (default: val_tasks) with greedy decoding, overall or per slice.

        Every task is enqueued once (mode ``"val"``, temperature 0); rollouts that fail
        (including timeouts) count as reward 0 (:meth:`rollout_rewards`), cancelled ones are
        left out. ``progress`` shows a tqdm.auto bar of finished rollouts (a widget in a notebook).

        Args:
            tasks: the tasks to evaluate; None: ``val_tasks``.
            progress: show the bar.
            by: None (the default): return the mean reward, a float in [0, 1] for 0/1
                rewards (NaN when no rollout finished). A task field name (``"ops"``) or a
                function ``task -> label``: return a :class:`SliceReport` with the same mean
                and, per slice (``"ops=1"``, ``"ops=2"``; for a function, ``str(label)``),
                the mean, the count of finished rollouts and the count with reward 1.0. The
                labels are computed before anything is enqueued, and the rollouts are the
                same as without ``by``: slicing happens afterwards. The report is also kept
                as ``last_report``.

        Each task's reward (in ``tasks`` order; None where its rollout was cancelled) is kept as
        ``last_eval_rewards``: the spread behind the mean (``bench/task_seeds.py`` takes its standard error).

        Raises:
            ConfigError: no tasks; ``by`` names a field a task lacks (the error names the
                field, the first such task's index and its keys); ``by`` raised on a task (the
                error names the task's index and the exception); ``by`` is neither a str nor
                callable. Nothing is enqueued then.
            LoopStopped: the loop was stopped while waiting (the rollouts are cancelled).
        """
        tasks = list(self.val_tasks if tasks is None else tasks)
        if not tasks:
            raise ConfigError("no val tasks to evaluate; pass val_tasks to LightningRL or tasks to evaluate()")
        keys = slice_keys(tasks, by) if by is not None else None
        sampling = {"temperature": 0.0, "max_tokens": self.config.max_tokens}
        ids = [r.rollout_id for r in self.store.enqueue_rollouts(tasks, mode="val", config=self._rollout_config(),
                                                                 metadata={SAMPLING_PARAMETERS_KEY: sampling})]
        self.wait_for(ids, desc="evaluating" if progress else None,
                      on_progress=self._reporter("evaluate", self.global_step, len(ids)))
        finished = self._finished_rewards(ids)
        self.last_eval_rewards = [finished.get(rid) for rid in ids]
        rewards = list(finished.values())
        mean = sum(rewards) / len(rewards) if rewards else math.nan
        if keys is None or by is None:
            return mean
        per: dict[str, list[float]] = {label: [] for label in ordered_labels(keys)}
        for rid, (_, label) in zip(ids, keys):
            if rid in finished:
                per[label].append(finished[rid])
        slices = {label: (sum(r) / len(r) if r else math.nan, len(r), sum(1 for x in r if x == 1.0))
                  for label, r in per.items()}
        self.last_report = SliceReport(by=slicer_name(by), mean=mean, n=len(rewards),
                                       solved=sum(1 for x in rewards if x == 1.0), slices=slices)
        return self.last_report

    def _config_edits(self) -> list[ConfigChange]:
        """Edits of :attr:`config` since the last step (validated first), and of the reward function
        (:meth:`set_reward`: field ``"reward"``)."""
        self.config.validate()
        self.task_draw.weights(self.config.slice_weights)
        edits = self.config_watch.take(self.config)
        name = reward_name(self.reward_fn)
        if name != self._reward_applied:
            edits.append(ConfigChange("reward", self._reward_applied, name))
            self._reward_applied = name
        return edits

    def step(self, progress: Optional[bool] = None) -> dict[str, Any]:
        """One full step: collect → update (→ evaluate when due). Returns the metrics row (the trainer's
        :class:`~lightning_nb.trainers.base.Update` is kept as :attr:`last_update`).

        ``progress``: a tqdm.auto bar of the step's phase while it runs (its rollouts, one count and one clock
        across the sample rounds, the round as a postfix; then the update's micro-batches, then the evaluation when
        due); None (the default): shown in a notebook kernel, not in a script. :meth:`run` (the background loop,
        whose bar is ``wait()``'s) passes False.

        Step boundaries (where ``pause()`` parks the loop and ``stop()``
        ends it): before the step collects, between sample rounds, before the update and
        before an evaluation. The row is the trainer's update row (its ``step`` this algorithm's
        ``global_step``, :meth:`~lightning_nb.algorithm.base.Algorithm.record`) with: ``reward_mean`` (mean
        final reward of every rollout of the step, failed ones as 0: the train reward),
        ``rollouts``, ``rollouts_failed``, ``sample_rounds``, ``skipped_<reason>`` (rollouts
        the adapter could not use, see :class:`TripletAdapter`), ``rollout_seconds``,
        ``step_seconds`` (paused time excluded), ``reward/<component>`` per named intermediate reward (a
        shaping term such as ``reward/calc_uses_all_numbers``: its mean sum per finished rollout of the step,
        0 for a rollout without it; the final reward is not in it), ``val_reward`` when evaluated (with
        ``slice_by``, also ``val_reward/<slice>`` per slice, :meth:`SliceReport.metrics`), and
        ``config_changes`` (edits of either config applied at this step, and a reward function set with
        :meth:`set_reward`: then ``reward_mean`` is under that function and ``reward_recorded_mean`` the agent's own);
        with ``branch``, ``branch_groups``, ``branch_groups_with_signal``, ``branch_rollouts`` and
        ``branch_reward_mean`` (:class:`~lightning_nb.replay.branching.BranchConfig`); with ``group_judge``,
        ``judge_groups``,
        ``judge_groups_failed`` and ``judge_groups_skipped`` (:meth:`~lightning_nb.rewards.GroupJudge.judge_rollouts`).

        While it runs, ``progress`` (:class:`~lightning_nb.algorithm.control.LoopProgress`) says where it is:
        phase ``"rollouts"`` (the step's rollouts finished of those enqueued, every sample round), then
        ``"update"`` (micro-batches done, reported by the trainer), then ``"evaluate"`` when due.

        Raises:
            LightningNbError: no rollout of the step gave a triplet.
        """
        with self.step_bar(progress):
            return self._step()

    def _step(self) -> dict[str, Any]:
        """:meth:`step`'s work."""
        self.report_progress("rollouts", 0, 0, unit="rollouts", step=self.global_step + 1)
        self.at_boundary("before collect")
        self._step_start = (self.state_dict(), rng_state())  # what a checkpoint saved inside this step holds
        edits = self._config_edits()
        t0, paused0 = time.perf_counter(), self.paused_seconds
        triplets, ids = self.collect()
        rollout_seconds = time.perf_counter() - t0 - (self.paused_seconds - paused0)
        if not triplets:
            raise LightningNbError(
                f"no triplets from {len(ids)} rollouts (skipped: {self.last_skipped}); "
                "inspect store.attempts_df() for agent errors")
        self.at_boundary("before update")
        self._step_start = None  # from here on the weights change: a checkpoint is of this step
        update = self.train(triplets, on_progress=self._update_reporter())  # credit, then the trainer's update
        metrics = update.metrics
        row = self.record(dict(metrics), update, edits)  # global_step + 1: the step's row, completed below
        step = row["step"]
        rollouts = self.store.query_rollouts(rollout_ids=ids)
        finished = self._finished_rewards(ids)
        rewards = [self._rescored.get(rid, r) for rid, r in finished.items()]  # set_reward's, else the agent's
        extra: dict[str, Any] = {
            "reward_mean": sum(rewards) / len(rewards) if rewards else math.nan,
            "batch_reward_mean": metrics["reward_mean"], "rollout_seconds": rollout_seconds,
            "rollouts_failed": sum(1 for r in rollouts if r.status != "succeeded"), "rollouts": len(ids),
            "sample_rounds": self.last_sample_rounds,
            **{f"skipped_{k}": v for k, v in self.last_skipped.items()},
            **self._component_means(list(finished)), **self.last_judge,
            **(self.last_branch if self.branch is not None else {}),
        }
        if self.reward_fn is not None:
            recorded = list(finished.values())
            extra["reward_recorded_mean"] = sum(recorded) / len(recorded) if recorded else math.nan
        if edits:
            extra["config_changes"] = "; ".join(filter(None, [metrics.get("config_changes", ""),
                                                              *(_edit_text(c) for c in edits)]))
        if self.config.val_every and step % self.config.val_every == 0 and self.val_tasks:
            self.at_boundary("before evaluate")
            if self.slice_by is None:
                extra["val_reward"] = self.evaluate(progress=False)  # runs on the trainer's thread
            else:
                report = self.evaluate(progress=False, by=self.slice_by)
                extra["val_reward"] = report.mean
                extra.update(report.metrics())
            self.val_history.append((step, extra["val_reward"]))
        extra["step_seconds"] = time.perf_counter() - t0 - (self.paused_seconds - paused0)
        row.update(extra)
        for logger in self.loggers:
            logger.log_row(row)
        if self.on_step:
            self.on_step(row)
        return row

    def max_response_len(self) -> Optional[int]:
        """L_max of the soft overlong penalty (``config.overlong_buffer_len``), tokens: the trainer config's
        ``max_response_len`` when set, else ``config.max_tokens`` (what rollouts sample with)."""
        return super().max_response_len() or self.config.max_tokens

    def _update_reporter(self) -> Callable[[int, int, str], None]:
        """The trainer update's ``on_progress``: reports phase ``"update"`` of the step being updated."""
        step = self.global_step + 1

        def report(done: int, total: int, unit: str) -> None:
            self.report_progress("update", done, total, unit=unit, step=step)

        return report

    def _component_means(self, rollout_ids: Sequence[str]) -> dict[str, float]:
        """``{"reward/<component>": mean}`` of the intermediate rewards of ``rollout_ids`` (see :meth:`step`)."""
        if not rollout_ids:
            return {}
        comps = self.store.reward_components(rollout_ids)
        names = sorted({name for c in comps.values() for name in c})
        return {f"reward/{name}": sum(comps.get(r, {}).get(name, 0.0) for r in rollout_ids) / len(rollout_ids)
                for name in names}

    # ----- experiment loggers ------------------------------------------------------------
    def _logged_config(self) -> dict[str, Any]:
        """Both configs, flat (``algorithm.<field>``, ``trainer.<field>``): the loggers' run config."""
        trainer_config = self.trainer.config
        trainer_fields = asdict(trainer_config) if is_dataclass(trainer_config) else {}
        return {**{f"algorithm.{k}": v for k, v in asdict(self.config).items()},
                **{f"trainer.{k}": v for k, v in trainer_fields.items()}}

    def metrics_added(self, step: int, values: dict[str, Any]) -> None:
        """Log ``values`` added to the row of an already logged ``step`` (:meth:`add_metrics` calls this)."""
        for logger in self.loggers:
            logger.log_added(step, values)

    def close_loggers(self, status: str = "finished") -> None:
        """Close every logger (``status``: finished, stopped or failed); a later row opens them again."""
        for logger in self.loggers:
            logger.close(status)

    def run(self, steps: Optional[int] = None) -> None:
        """Run ``steps`` steps (default ``config.steps``); stops early when stopped (:meth:`stop`).

        When it ends the loggers are flushed; when the loop was stopped or a step failed
        they are closed with that status (:meth:`close_loggers`).
        """
        n = self.config.steps if steps is None else steps
        try:
            for _ in range(n):
                if self.stop_requested:
                    raise LoopStopped(f"stopped at step {self.global_step}")
                self.step(progress=False)
        except BaseException as exc:
            self.close_loggers("stopped" if isinstance(exc, LoopStopped) else "failed")
            raise
        for logger in self.loggers:
            logger.flush()

    def preflight(self, n_tasks: Optional[int] = None, **options: Any) -> Any:
        """One collection round without an update: what would make training useless, each with its fix.

        Returns a :class:`lightning_nb.algorithm.preflight.PreflightReport` (``.ok``, ``.blockers``,
        ``.warnings``, ``.to_frame()``; it renders in a notebook). Leaves the weights, the
        trainer's step and optimizer, and this algorithm's task sampler as they were; see
        :func:`lightning_nb.algorithm.preflight.preflight` for the checks and ``options``.
        """
        from lightning_nb.algorithm.preflight import preflight  # on use: it imports the runner modules

        return preflight(self, n_tasks, **options)

    # ----- the run's checkpoint --------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs from the algorithm: the step counter, metrics rows and config log
        (``run_record()``), the task sampler's RNG state, ``val_history``, the config and the name of the reward
        function the last step trained on (``"reward_fn"``; None: the agent's reward)."""
        return {**self.run_record(), "rng": self._rng.getstate(), "val_history": [list(v) for v in self.val_history],
                "config": asdict(self.config), "reward_fn": self._reward_applied}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (the config is not changed: edits since are yours); warns when the saved run
        trained on a reward function other than the one set now (:meth:`set_reward`)."""
        self.load_run_record(state)
        version, internal, gauss = state["rng"]
        self._rng.setstate((version, tuple(internal), gauss))
        self.val_history = [(int(s), float(v)) for s, v in state["val_history"]]
        self._step_start = None
        self.restore_reward_name(state.get("reward_fn"))

    def checkpoint_state(self) -> tuple[dict[str, Any], Optional[dict[str, Any]]]:
        """``(state_dict, global RNG states or None)`` for a checkpoint of the last step whose update ran.

        Inside a step that has not begun its update (the loop paused ``between sample rounds`` or
        ``before update``, or a step that raised before its update) that is the state at the step's
        start, with the torch, numpy and Python RNG states of that moment
        (:func:`lightning_nb.trainers.checkpoint.rng_state`): the step has drawn its tasks and sampled, but its
        weights are those of the step before, so a run continued from the checkpoint redoes the step
        from its start, as the uninterrupted run did. Otherwise ``(state_dict(), None)``.
        """
        if self._step_start is not None:
            return self._step_start
        return self.state_dict(), None

    def save(self, path: str | Path) -> Path:
        """Write the run's checkpoint (:func:`~lightning_nb.algorithm.checkpoint.save_run`: the trainer's state, this
        algorithm's, the RNG states) to ``path``; returns what was written.

        Raises:
            ConfigError: the loop is paused ``before evaluate``: resume and save at the next pause.
        """
        return save_run(self, path)

    def load(self, path: str | Path, *, keep_config: bool = False, **options: Any) -> None:
        """Continue from a :meth:`save` checkpoint (:func:`~lightning_nb.algorithm.checkpoint.load_run`);
        ``keep_config`` keeps the trainer's config, ``options`` are the trainer layout's (VerlTrainer: ``resume_mode``).

        Raises:
            FileNotFoundError: ``path`` does not exist.
            ConfigError: the loop runs; not a checkpoint of this format or of this model.
        """
        load_run(self, path, keep_config=keep_config, **options)


def _edit_text(change: ConfigChange) -> str:
    """The step row's text of an edit: ``"learning_rate 2e-05 → 1e-05"``; a reward function by its name."""
    if change.field == "reward":
        return f"reward {change.old or 'the agent'!s} → {change.new or 'the agent'!s}"
    return change.text
