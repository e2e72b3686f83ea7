"""The run's checkpoint of an algorithm that trains weights: :func:`save_run` and :func:`load_run`.

``LightningRL.save`` / ``load`` and ``TrafficLearner.save`` / ``load`` are these functions over the algorithm
(:class:`~lightning_nb.algorithm.base.Algorithm`: everything they read is declared there). A checkpoint
holds the algorithm's state (``algo.checkpoint_state()``: its ``state_dict()``, for LightningRL the task
sampler's RNG and ``val_history`` too), the global RNG states, the store's latest resources id and the
trainer's ``state_dict()``, in the trainer's layout (one file for GRPOTrainer, verl's ``global_step_N``
folders for VerlTrainer); the file format is :mod:`lightning_nb.trainers.checkpoint`'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_nb.errors import ConfigError
from lightning_nb.trainers.checkpoint import restore_checkpoint, run_checkpoint, set_rng_state

if TYPE_CHECKING:
    from lightning_nb.algorithm.base import Algorithm
    from lightning_nb.trainers.base import Trainer

__all__ = ["save_run", "load_run"]


def _trainer(algo: "Algorithm") -> "Trainer":
    if algo.trainer is None:
        raise ConfigError(f"{type(algo).__name__} has no trainer: its save()/load() write its own state only")
    return algo.trainer


def save_run(algo: "Algorithm", path: str | Path) -> Path:
    """Write everything a continued run of ``algo`` needs to ``path``; returns what was written.

    The checkpoint holds: the trainer's ``state_dict()`` (model weights, optimizer and LR-scheduler
    state; its update count and config; the weight version; the reference model's
    weights fingerprint and how to rebuild it (the initial weights of the default model); a model
    signature); the torch, numpy and Python RNG states; the algorithm's state (its step counter,
    metrics rows and config log, and its own: ``algo.checkpoint_state()``); the store's
    latest resources id. It loads with ``torch.load(weights_only=True)``. GRPOTrainer writes one file
    (atomically) at ``path``; VerlTrainer writes verl's folder layout under it (``trainer.write_checkpoint``).
    Call it at a step boundary (paused, or after ``wait()``); it takes the trainer's update lock
    (``trainer.frozen()``). Paused inside a step before its update (``between sample rounds``,
    ``before update``), the checkpoint is of the step before, with the algorithm's and RNG states
    from the start of the paused step (``LightningRL.checkpoint_state``), so a continued run redoes that step
    as this one does. Size: weights + 2 × weights for AdamW (about 1.6 GB for SmolLM2-135M in
    float32). With LoRA (``lora_rank > 0``) it holds the adapters and their AdamW state instead of
    the weights (about 60 MB for SmolLM2-135M at rank 32), and a fingerprint of the frozen base
    weights, which :func:`load_run` checks.

    Raises:
        ConfigError: ``algo`` has no trainer, or its loop is paused ``before evaluate`` (the step updated the
            weights, its evaluation and metrics are not done): resume and save at the next pause.
    """
    trainer = _trainer(algo)
    if algo.paused_at == "before evaluate":
        raise ConfigError(f"save(): the loop is paused before step {algo.global_step}'s evaluation, after "
                          "its update; its metrics row and evaluation are not done yet, so a run continued from "
                          "a checkpoint now would differ from this one. algo.resume() and save at the next "
                          "pause, or after algo.wait()")
    with trainer.frozen():
        algorithm_state, rng = algo.checkpoint_state()
        latest = algo.store.get_latest_resources() if algo.store is not None else None
        state = run_checkpoint(trainer, rng=rng, algorithm=algorithm_state,
                               resources_id=latest.resources_id if latest is not None else None)
        return trainer.write_checkpoint(path, state)


def load_run(algo: "Algorithm", path: str | Path, *, keep_config: bool = False, **options: Any) -> None:
    """Restore a :func:`save_run` checkpoint into ``algo``'s trainer, its engine's model and ``algo``.

    The RNG states are restored too, so the continued run samples what the uninterrupted run would
    have. ``resources_id`` of the checkpoint is kept in ``algo.checkpoint_resources_id`` (the
    proxy URL of a new process differs: publish the new one with ``store.add_resources``). The
    trainer's config takes the checkpoint's values unless ``keep_config`` (see the trainer's
    ``load_state_dict``). ``options`` are the trainer's layout's (VerlTrainer: ``resume_mode``).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ConfigError: ``algo`` has no trainer; its loop runs and is not paused; the file is not a lightning-nb
            checkpoint of this format, was saved from another model, or its reference model differs from the
            trainer's and cannot be rebuilt.
    """
    trainer = _trainer(algo)
    if algo.running and algo.state != "paused":
        raise ConfigError("load() while the loop is running: pause() or stop() it first")
    run = restore_checkpoint(trainer, path, keep_config=keep_config, **options)
    if run is None:
        return
    set_rng_state(run["rng"])
    algo.checkpoint_resources_id = run["resources_id"]
    # a checkpoint of an earlier version kept the run's rows with the trainer, and its step counter
    legacy = {"global_step": trainer.updates_applied, "metrics": run.get("metrics") or [],
              "config_changes": run.get("config_changes") or []}
    if run.get("algorithm") is None:  # saved with no algorithm's state: the run's record only
        algo.load_run_record(legacy)
    else:
        algo.load_state_dict({**legacy, **run["algorithm"]})
