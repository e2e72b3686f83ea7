"""The algorithm: enqueue rollouts, wait, adapt spans to triplets, ask the trainer to update.

:class:`LightningRL` is the synchronous on-policy loop of the Agent Lightning
paper with GRPO groups: each step samples ``tasks_per_step`` training tasks,
enqueues each ``group_size`` times (same ``group_id``), waits for the runners,
adapts the spans with :class:`~lightning_nb.adapter.TripletAdapter` and calls
:meth:`GRPOTrainer.update`.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from lightning_nb.adapter import TripletAdapter
from lightning_nb.errors import ConfigError, LightningNbError
from lightning_nb.store.base import LightningStore
from lightning_nb.trainer import GRPOTrainer, TrainerStopped
from lightning_nb.types import RolloutConfig

__all__ = ["AlgorithmConfig", "LightningRL"]


@dataclass
class AlgorithmConfig:
    """Sampling and scheduling of the RL loop. Validated on construction."""

    steps: int = field(default=10, metadata={"help": "Training steps run() performs by default."})
    tasks_per_step: int = field(default=4, metadata={"help": "Distinct training tasks per step."})
    group_size: int = field(default=4, metadata={"help": "Rollouts per task (the GRPO group)."})
    temperature: float = field(default=0.7, metadata={
        "help": "Sampling temperature of training rollouts (SmolLM2-135M at 1.0 solves ~6% of train tasks, "
                "at 0.7 ~20%, greedy ~40%: 0.7 keeps both signal and exploration)."})
    max_tokens: int = field(default=48, metadata={"help": "Completion token limit per LLM call."})
    val_every: int = field(default=0, metadata={"help": "Evaluate on val every N steps (0: only when asked)."})
    rollout_timeout_s: float = field(default=300.0, metadata={"help": "Per-attempt timeout in seconds."})
    max_attempts: int = field(default=1, metadata={"help": "Attempts per rollout before it is marked failed."})
    seed: int = field(default=0, metadata={"help": "Seed of the task sampler."})
    dynamic_sampling: bool = field(default=True, metadata={
        "help": "DAPO dynamic sampling: when a group's rewards are all equal (no GRPO signal), sample more "
                "tasks until tasks_per_step groups carry signal or max_sample_rounds is reached."})
    max_sample_rounds: int = field(default=3, metadata={
        "help": "Upper bound on collection rounds per step with dynamic_sampling (DAPO's max_num_gen_batches)."})

    def __post_init__(self) -> None:
        for name in ("steps", "tasks_per_step", "group_size", "max_tokens", "max_attempts", "max_sample_rounds"):
            if getattr(self, name) < 1:
                raise ConfigError(f"AlgorithmConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.group_size < 2:
            raise ConfigError("AlgorithmConfig.group_size must be >= 2: GRPO compares rollouts within a group")
        if not 0 < self.temperature <= 5:
            raise ConfigError(f"AlgorithmConfig.temperature must be in (0, 5], got {self.temperature}")
        if self.val_every < 0 or self.rollout_timeout_s <= 0:
            raise ConfigError("AlgorithmConfig.val_every must be >= 0 and rollout_timeout_s > 0")


class LightningRL:
    """Drive GRPO training of ``trainer`` on ``train_tasks`` through ``store``.

    Runners must be consuming ``store`` (see :func:`~lightning_nb.runner.start_runners`).
    Tasks are dicts; ``task[id_key]`` names the GRPO group.

    Args:
        store: the store the runners read.
        trainer: updates weights.
        train_tasks / val_tasks: task inputs handed to the agent.
        config: :class:`AlgorithmConfig`.
        on_step: optional callback ``on_step(metrics_row)`` after every step (e.g. a progress bar).
    """

    def __init__(self, store: LightningStore, trainer: GRPOTrainer, train_tasks: Sequence[Any],
                 val_tasks: Sequence[Any] = (), config: Optional[AlgorithmConfig] = None, *,
                 adapter: Optional[TripletAdapter] = None, id_key: str = "id",
                 on_step: Optional[Callable[[dict], None]] = None) -> None:
        if not train_tasks:
            raise ConfigError("train_tasks is empty; load some with lightning_nb.calc.load_tasks('train')")
        self.store, self.trainer = store, trainer
        self.train_tasks, self.val_tasks = list(train_tasks), list(val_tasks)
        self.config = config or AlgorithmConfig()
        self.adapter = adapter or TripletAdapter()
        self.id_key = id_key
        self.on_step = on_step
        self._rng = random.Random(self.config.seed)
        self.val_history: list[tuple[int, float]] = []
        self.last_sample_rounds = 0
        self.last_groups_with_signal = 0

    def _rollout_config(self) -> RolloutConfig:
        return RolloutConfig(max_attempts=self.config.max_attempts, timeout_seconds=self.config.rollout_timeout_s)

    def _wait(self, rollout_ids: list[str], desc: Optional[str] = None) -> None:
        """Wait for the rollouts (cancel them if the trainer stops); a tqdm.auto bar named ``desc`` if given."""
        bar = None
        if desc:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(rollout_ids), desc=desc, unit="rollout")
        try:
            self._wait_loop(rollout_ids, bar)
        finally:
            if bar is not None:
                bar.close()

    def _wait_loop(self, rollout_ids: list[str], bar: Any) -> None:
        while True:
            done = self.store.wait_for_rollouts(rollout_ids, timeout=1.0)
            if bar is not None:
                bar.update(len(done) - bar.n)
            if len(done) == len(rollout_ids):
                return
            if self.trainer.stop_requested:
                for rid in rollout_ids:
                    try:
                        self.store.cancel_rollout(rid)
                    except LightningNbError:
                        pass  # already terminal
                raise TrainerStopped("stopped while waiting for rollouts")

    def _enqueue_groups(self, n_tasks: int, round_: int) -> list[str]:
        cfg = self.config
        sampling = {"temperature": cfg.temperature, "max_tokens": cfg.max_tokens}
        ids = []
        for _ in range(n_tasks):
            task = self.train_tasks[self._rng.randrange(len(self.train_tasks))]
            key = task.get(self.id_key, id(task)) if isinstance(task, dict) else id(task)
            group = f"{self.trainer.step + 1}.{round_}:{key}"
            for _ in range(cfg.group_size):
                ids.append(self.store.enqueue_rollout(
                    task, mode="train", config=self._rollout_config(),
                    metadata={"group_id": group, "sampling_parameters": sampling}).rollout_id)
        return ids

    def collect(self) -> tuple[list, list[str]]:
        """Enqueue one step's groups, wait, and return (triplets, rollout_ids).

        With ``dynamic_sampling`` (DAPO, Yu et al. 2025, section 3.2), groups whose
        rewards are all equal have zero advantage, so more tasks are sampled, up to
        ``max_sample_rounds`` rounds, until ``tasks_per_step`` groups carry signal.
        Unlike DAPO the all-equal groups are still returned: the trainer skips them
        (advantage 0) but they count in the step's mean train reward, so that reward
        covers every sampled episode, not only the groups that were trained on.
        """
        cfg = self.config
        triplets: list = []
        ids: list[str] = []
        with_signal = 0
        self.last_sample_rounds = 0
        for round_ in range(cfg.max_sample_rounds if cfg.dynamic_sampling else 1):
            new_ids = self._enqueue_groups(cfg.tasks_per_step - with_signal, round_)
            self._wait(new_ids)
            new = self.adapter.adapt(self.store, new_ids)
            triplets += new
            ids += new_ids
            self.last_sample_rounds = round_ + 1
            rewards: dict[str, set] = {}
            for rollout in self.store.query_rollouts(rollout_ids=new_ids):
                reward = self.store.final_reward(rollout.rollout_id)
                rewards.setdefault(rollout.metadata.get("group_id"), set()).add(0.0 if reward is None else reward)
            with_signal += sum(1 for r in rewards.values() if len(r) > 1)
            if with_signal >= cfg.tasks_per_step:
                break
        self.last_groups_with_signal = with_signal
        return triplets, ids

    def evaluate(self, tasks: Optional[Sequence[Any]] = None, progress: bool = True) -> float:
        """Mean final reward over ``tasks`` (default: val_tasks) with greedy decoding.

        Rollouts that fail or time out count as reward 0. ``progress`` shows a
        tqdm.auto bar of finished rollouts (a widget in a notebook).
        """
        tasks = list(self.val_tasks if tasks is None else tasks)
        if not tasks:
            raise ConfigError("no val tasks to evaluate; pass val_tasks to LightningRL or tasks to evaluate()")
        sampling = {"temperature": 0.0, "max_tokens": self.config.max_tokens}
        ids = [self.store.enqueue_rollout(t, mode="val", config=self._rollout_config(),
                                          metadata={"sampling_parameters": sampling}).rollout_id for t in tasks]
        self._wait(ids, desc="evaluating" if progress else None)
        rewards = [self.store.final_reward(rid) for rid in ids]
        return sum(r if r is not None else 0.0 for r in rewards) / len(rewards)

    def step(self) -> dict[str, Any]:
        """One full step: collect → update (→ evaluate when due). Returns the metrics row."""
        t0 = time.perf_counter()
        triplets, ids = self.collect()
        rollout_seconds = time.perf_counter() - t0
        if not triplets:
            raise LightningNbError(
                f"no triplets from {len(ids)} rollouts (skipped: {self.adapter.skipped}); "
                "inspect store.attempts_df() for agent errors")
        metrics = self.trainer.update(triplets)
        step = metrics["step"]
        failed = sum(1 for r in self.store.query_rollouts(rollout_ids=ids) if r.status != "succeeded")
        extra: dict[str, Any] = {"rollout_seconds": rollout_seconds, "rollouts_failed": failed,
                                 "rollouts": len(ids), "sample_rounds": self.last_sample_rounds,
                                 "groups_with_signal": self.last_groups_with_signal}
        if self.config.val_every and step % self.config.val_every == 0 and self.val_tasks:
            extra["val_reward"] = self.evaluate(progress=False)  # runs on the trainer's thread
            self.val_history.append((step, extra["val_reward"]))
        extra["step_seconds"] = time.perf_counter() - t0
        self.trainer.add_metrics(step, **extra)
        row = self.trainer.metrics[-1]
        if self.on_step:
            self.on_step(row)
        return row

    def run(self, steps: Optional[int] = None) -> None:
        """Run ``steps`` steps (default ``config.steps``); stops early if the trainer is stopped."""
        n = self.config.steps if steps is None else steps
        for _ in range(n):
            if self.trainer.stop_requested:
                raise TrainerStopped(f"stopped at step {self.trainer.step}")
            self.step()
