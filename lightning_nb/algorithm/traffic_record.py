"""Traffic trained once per store: how :class:`~lightning_nb.algorithm.traffic.TrafficLearner` reads and writes the
store's training record (:mod:`lightning_nb.store.trained`).

Each update writes one mark per rollout it used, ``(rollout, learner name, update number)``, in one store call
right after the trainer applied it. At each poll a learner looks for marks on the rollouts it has pending: one
that any learner (an earlier one, one running beside it, this one before a kernel restart) trained on is skipped,
counted in ``poll()["skipped"]`` and explained in ``poll()["skipped_why"]``, unless the learner was made with
``retrain=True``. A store the marks could not be written to (a store server down) keeps them here and tries again
at each poll, with one warning.
"""

from __future__ import annotations

import logging
import warnings
from typing import Sequence

from lightning_nb.store.base import LightningStore
from lightning_nb.store.trained import TrainedMark

__all__ = ["first_marks", "skipped_why", "PendingMarks"]

log = logging.getLogger(__name__)


def first_marks(store: LightningStore, rollout_ids: Sequence[str]) -> dict[str, TrainedMark]:
    """rollout id -> the first mark of each of ``rollout_ids`` that some update trained on (the others are left out)."""
    out: dict[str, TrainedMark] = {}
    for mark in store.query_trained(list(rollout_ids)) if rollout_ids else []:
        out.setdefault(mark.rollout_id, mark)
    return out


def skipped_why(skipped: dict[str, TrainedMark]) -> str:
    """One line for ``poll()["skipped_why"]``: how many were skipped, by which learners' updates, and the way out."""
    if not skipped:
        return ""
    by: dict[str, set[int]] = {}
    for mark in skipped.values():
        by.setdefault(mark.learner, set()).add(mark.update)
    where = "; ".join(f"{learner} update{'s' if len(ups) > 1 else ''} {', '.join(map(str, sorted(ups)))}"
                      for learner, ups in by.items())
    return (f"{len(skipped)} labelled or unlabelled traffic rollout(s) skipped: already trained on ({where}; "
            f"store.query_trained() lists them). TrafficLearner(..., retrain=True) trains on them again")


class PendingMarks:
    """Marks of this learner's updates not yet in the store: written at once, kept and retried when the store fails."""

    def __init__(self) -> None:
        self.waiting: list[tuple[list[str], int]] = []  # (rollout ids, update) in update order
        self._warned = False

    def add(self, store: LightningStore, learner: str, rollout_ids: Sequence[str], update: int) -> None:
        """Queue the marks of ``update`` and write every queued one (:meth:`flush`)."""
        self.waiting.append((list(rollout_ids), update))
        self.flush(store, learner)

    def flush(self, store: LightningStore, learner: str) -> None:
        """Write the queued marks, oldest first; on a store error keep them and warn once (``RuntimeWarning``)."""
        while self.waiting:
            ids, update = self.waiting[0]
            try:
                store.mark_trained(ids, learner=learner, update=update)
            except Exception as exc:
                message = (f"TrafficLearner {learner}: could not record in the store which rollouts update {update} "
                           f"trained on ({type(exc).__name__}: {exc}); retrying at each poll. Until then another "
                           f"learner on this store could train on them again")
                if not self._warned:
                    warnings.warn(message, RuntimeWarning, stacklevel=3)
                    self._warned = True
                log.warning("%s", message)
                return
            self.waiting.pop(0)
