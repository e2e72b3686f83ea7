"""The run's checkpoint, as the algorithm that owns the loop writes and reads it.

:class:`RunCheckpoint` is mixed into :class:`~lightning_nb.algorithm.lightning_rl.LightningRL`. A
checkpoint holds the algorithm's state (the task sampler's RNG, ``val_history``: :meth:`RunCheckpoint.state_dict`),
the global RNG states, the store's latest resources id and the trainer's ``state_dict()``, in the
trainer's layout (one file for GRPOTrainer, verl's ``global_step_N`` folders for VerlTrainer); the
file format is :mod:`lightning_nb.trainers.checkpoint`'s.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

from lightning_nb.errors import ConfigError
from lightning_nb.trainers.checkpoint import restore_checkpoint, run_checkpoint, set_rng_state

__all__ = ["RunCheckpoint"]


class RunCheckpoint:
    """``save`` / ``load`` of a run, and the algorithm's own state in it; mixed into the algorithm.

    The class it is mixed into is an :class:`~lightning_nb.algorithm.base.Algorithm` with a ``trainer`` and
    ``_rng`` (the task sampler), ``val_history``, ``_step_start`` (set at a step's start, cleared when its
    update begins).
    """

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs from the algorithm: the step counter, metrics rows and config log
        (``run_record()``), the task sampler's RNG state, ``val_history``, the config."""
        return {**self.run_record(), "rng": self._rng.getstate(), "val_history": [list(v) for v in self.val_history],
                "config": asdict(self.config)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (the config is not changed: edits since are yours)."""
        self.load_run_record(state)
        version, internal, gauss = state["rng"]
        self._rng.setstate((version, tuple(internal), gauss))
        self.val_history = [(int(s), float(v)) for s, v in state["val_history"]]
        self._step_start = None

    def checkpoint_state(self) -> tuple[dict[str, Any], Optional[dict[str, Any]]]:
        """``(state_dict, global RNG states or None)`` for a checkpoint of the last step whose update ran.

        Inside a step that has not begun its update (the loop paused ``between sample rounds`` or
        ``before update``, or a step that raised before its update) that is the state at the step's
        start, with the torch, numpy and Python RNG states of that moment
        (:func:`lightning_nb.trainers.checkpoint.rng_state`): the step has drawn its tasks and sampled, but its
        weights are those of the step before, so a run continued from the checkpoint redoes the step
        from its start, as the uninterrupted run did. Otherwise ``(state_dict(), None)``: the RNG
        states are the current ones.
        """
        if self._step_start is not None:
            return self._step_start
        return self.state_dict(), None

    def save(self, path: str | Path) -> Path:
        """Write everything a continued run needs to ``path``; returns what was written.

        The checkpoint holds: the trainer's ``state_dict()`` (model weights, optimizer and LR-scheduler
        state; its update count and config; the weight version; the reference model's
        weights fingerprint and how to rebuild it (the initial weights of the default model); a model
        signature); the torch, numpy and Python RNG states; this algorithm's state (its step counter,
        metrics rows and config log, the task sampler RNG, ``val_history``: :meth:`state_dict`); the store's
        latest resources id. It loads with
        ``torch.load(weights_only=True)``. GRPOTrainer writes one file (atomically) at ``path``;
        VerlTrainer writes verl's folder layout under it (``trainer.write_checkpoint``).
        Call it at a step boundary (paused, or after ``wait()``); it takes the trainer's update lock
        (``trainer.frozen()``). Paused inside a step before its update (``between sample rounds``,
        ``before update``), the checkpoint is of the step before, with the algorithm's and RNG states
        from the start of the paused step (:meth:`checkpoint_state`), so a continued run redoes that step
        as this one does. Size: weights + 2 × weights for AdamW (about 1.6 GB for SmolLM2-135M in
        float32). With LoRA (``lora_rank > 0``) it holds the adapters and their AdamW state instead of
        the weights (about 60 MB for SmolLM2-135M at rank 32), and a fingerprint of the frozen base
        weights, which :meth:`load` checks.

        Raises:
            ConfigError: the loop is paused ``before evaluate`` (the step updated the weights, its
                evaluation and metrics are not done): resume and save at the next pause.
        """
        trainer = self.trainer
        if self.paused_at == "before evaluate":
            raise ConfigError(f"save(): the loop is paused before step {self.global_step}'s evaluation, after "
                              "its update; its metrics row and evaluation are not done yet, so a run continued from "
                              "a checkpoint now would differ from this one. algo.resume() and save at the next "
                              "pause, or after algo.wait()")
        with trainer.frozen():
            algorithm_state, rng = self.checkpoint_state()
            latest = self.store.get_latest_resources() if self.store is not None else None
            state = run_checkpoint(trainer, rng=rng, algorithm=algorithm_state,
                                   resources_id=latest.resources_id if latest is not None else None)
            return trainer.write_checkpoint(path, state)

    def load(self, path: str | Path, *, keep_config: bool = False, **options: Any) -> None:
        """Restore a :meth:`save` checkpoint into the trainer, its engine's model and this algorithm.

        The RNG states are restored too, so the continued run samples what the uninterrupted run would
        have. ``resources_id`` of the checkpoint is kept in :attr:`checkpoint_resources_id` (the
        proxy URL of a new process differs: publish the new one with ``store.add_resources``). The
        trainer's config takes the checkpoint's values unless ``keep_config`` (see the trainer's
        ``load_state_dict``). ``options`` are the trainer's layout's (VerlTrainer: ``resume_mode``).

        Raises:
            FileNotFoundError: ``path`` does not exist.
            ConfigError: the file is not a lightning-nb checkpoint of this format, was saved from
                another model, or its reference model differs from the trainer's and cannot be rebuilt.
        """
        if self.running and self.state != "paused":
            raise ConfigError("load() while the loop is running: pause() or stop() it first")
        run = restore_checkpoint(self.trainer, path, keep_config=keep_config, **options)
        if run is None:
            return
        set_rng_state(run["rng"])
        self.checkpoint_resources_id = run["resources_id"]
        # a checkpoint of an earlier version kept the run's rows with the trainer, and its step counter
        legacy = {"global_step": self.trainer.updates_applied, "metrics": run.get("metrics") or [],
                  "config_changes": run.get("config_changes") or []}
        if run.get("algorithm") is None:  # saved with no algorithm's state: the run's record only
            self.load_run_record(legacy)
        else:
            self.load_state_dict({**legacy, **run["algorithm"]})
