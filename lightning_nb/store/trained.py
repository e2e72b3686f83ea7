"""Which update of which learner trained on each rollout: the store's training record (part of the contract).

An algorithm that trains on rollouts it did not start (:class:`~lightning_nb.algorithm.traffic.TrafficLearner`)
must not train twice on the same labels, also across learners and across a kernel restart on a durable store. So
the store keeps one :class:`TrainedMark` per rollout an update used: ``(rollout_id, learner, update, time)``. A
learner writes the marks of an update in one call (:meth:`TrainingRecord.mark_trained`) and reads them before it
takes a rollout (:meth:`TrainingRecord.query_trained`). A rollout may carry several marks (a learner asked to
train again, ``retrain=True``); marks are never changed or removed (also after an update is undone: its labels
were trained on).

Implementations must store the marks of one call all or nothing (one lock, transaction or request), keep them
as long as the rollouts (a ``SqliteStore`` file keeps them across reopening: table ``trained``), and raise
:class:`~lightning_nb.errors.NotFoundError` naming the first unknown rollout id (nothing is stored then).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import Optional, Sequence

from pydantic import BaseModel, ConfigDict

from lightning_nb.errors import ConfigError

__all__ = ["TrainedMark", "TrainingRecord", "new_marks"]


class TrainedMark(BaseModel):
    """One rollout used by one update: ``learner`` (its name, e.g. ``TrafficLearner.name``), ``update`` (1-based,
    that learner's update number: a row of its ``updates_df()``) and ``time`` (float seconds since the epoch)."""

    model_config = ConfigDict(frozen=True)

    rollout_id: str
    learner: str
    update: int
    time: float


def new_marks(rollout_ids: Sequence[str], learner: str, update: int) -> list[TrainedMark]:
    """The marks :meth:`TrainingRecord.mark_trained` stores, stamped now (every backend builds them here).

    Raises:
        ConfigError: ``rollout_ids`` is not a list of str (or repeats one), ``learner`` is not a non-empty str,
            ``update`` is not an int >= 1.
    """
    if isinstance(rollout_ids, str) or not all(isinstance(r, str) for r in rollout_ids):
        raise ConfigError(f"rollout_ids must be a list of rollout id strings, got {rollout_ids!r}")
    if len(set(rollout_ids)) != len(rollout_ids):
        raise ConfigError(f"rollout_ids repeats an id: {sorted(r for r in set(rollout_ids) if rollout_ids.count(r) > 1)}")
    if not isinstance(learner, str) or not learner:
        raise ConfigError(f"learner must be a non-empty str naming the learner (e.g. TrafficLearner.name), got "
                          f"{learner!r}")
    if isinstance(update, bool) or not isinstance(update, int) or update < 1:
        raise ConfigError(f"update must be the learner's 1-based update number (an int >= 1), got {update!r}")
    now = time.time()
    return [TrainedMark(rollout_id=rid, learner=learner, update=update, time=now) for rid in rollout_ids]


class TrainingRecord(ABC):
    """The training-record part of the store contract (module docstring); :class:`~lightning_nb.store.base.LightningStore`
    mixes it in, so every backend implements it."""

    @abstractmethod
    def mark_trained(self, rollout_ids: Sequence[str], *, learner: str, update: int) -> list[TrainedMark]:
        """Record that update ``update`` of ``learner`` trained on ``rollout_ids``; returns the stored marks, in order.

        All or nothing: one lock, transaction or request for the call.

        Raises:
            NotFoundError: a rollout id is not in the store (the first one is named; nothing is stored).
            ConfigError: as :func:`new_marks` (nothing is stored).
        """

    @abstractmethod
    def query_trained(self, rollout_ids: Optional[Sequence[str]] = None) -> list[TrainedMark]:
        """Every mark (or those of ``rollout_ids``; unknown ids have none), oldest first."""
