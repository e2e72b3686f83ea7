"""LightningRL's config and the key that names a task's GRPO group.

:class:`AlgorithmConfig` holds the sampling and scheduling of the RL loop
(:class:`~lightning_nb.algorithm.lightning_rl.LightningRL`), validated on construction and on ``resume()``;
:func:`task_key` names a task's group (also for APO and TrafficLearner).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

from lightning_nb.algorithm.credit_options import CreditOptions
from lightning_nb.errors import ConfigError

__all__ = ["AlgorithmConfig", "task_key"]


def task_key(task: Any, id_key: str = "id") -> str:
    """The key that names ``task``'s GRPO group: ``str(task[id_key])`` when the task is a mapping with that
    field, else a hash of its content.

    The hash is the first 12 hex digits of the SHA-1 of ``json.dumps(task, sort_keys=True, default=repr)``:
    equal tasks get the same key in every process and run (two dicts with the same fields, whatever their
    key order), different ones different keys. Values JSON cannot encode are hashed by their ``repr()``,
    so a task object whose ``repr`` shows its memory address (no ``__repr__`` of its own) gets a key
    that changes between runs: give such tasks an ``id`` field.
    """
    if isinstance(task, Mapping) and id_key in task:
        return str(task[id_key])
    body = dict(task) if isinstance(task, Mapping) else task
    return hashlib.sha1(json.dumps(body, sort_keys=True, default=repr).encode()).hexdigest()[:12]


@dataclass
class AlgorithmConfig(CreditOptions):
    """Sampling and scheduling of the RL loop, and its credit (:class:`~lightning_nb.algorithm.credit.CreditOptions`:
    ``credit``, ``gamma``, ``norm_adv_by_std``, ``min_group_size``, ``overlong_buffer_len``,
    ``overlong_penalty_factor``, keyword-only; L_max of the overlong penalty is ``max_tokens``). Validated on
    construction."""

    steps: int = field(default=10, metadata={"help": "Training steps run() performs by default."})
    tasks_per_step: int = field(default=4, metadata={
        "help": "Distinct training tasks per step, drawn without replacement (tasks with one task_key are one task, "
                "one GRPO group); a dynamic-sampling round draws tasks the step has not run yet first, earlier "
                "ones again (a new group each) only once every task ran. At most the number of distinct training "
                "tasks: a step with more is a ConfigError before it enqueues."})
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
    slice_weights: Optional[dict[str, float]] = field(default=None, metadata={
        "help": "Sampling weight of training tasks per slice, {label: weight} with the labels of LightningRL's "
                "slice_by (e.g. {'ops=2': 3.0}: a two-operation task is drawn 3x as often as another); slices not "
                "listed weigh 1. None: every task equally likely. Needs slice_by; a label no training task has "
                "is refused."})

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ConfigError naming the first field out of range (also run by ``algo.resume()``)."""
        for name in ("steps", "tasks_per_step", "group_size", "max_tokens", "max_attempts", "max_sample_rounds"):
            if getattr(self, name) < 1:
                raise ConfigError(f"AlgorithmConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.group_size < 2:
            raise ConfigError("AlgorithmConfig.group_size must be >= 2: GRPO compares rollouts within a group")
        if not 0 < self.temperature <= 5:
            raise ConfigError(f"AlgorithmConfig.temperature must be in (0, 5], got {self.temperature}")
        if self.val_every < 0 or self.rollout_timeout_s <= 0:
            raise ConfigError("AlgorithmConfig.val_every must be >= 0 and rollout_timeout_s > 0")
        if self.slice_weights is not None:
            if not isinstance(self.slice_weights, dict):
                raise ConfigError("AlgorithmConfig.slice_weights must be a dict {slice label: weight} such as "
                                  f"{{'ops=2': 3.0}}, or None; got {type(self.slice_weights).__name__}")
            for label, w in self.slice_weights.items():
                if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0:
                    raise ConfigError(f"AlgorithmConfig.slice_weights[{label!r}] must be a finite number >= 0, "
                                      f"got {w!r}")
        self.validate_credit(self.max_tokens)
