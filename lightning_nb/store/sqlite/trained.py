"""The training record of :class:`~lightning_nb.store.sqlite.SqliteStore` (:mod:`lightning_nb.store.trained`):
one row of the ``trained`` table per mark (its JSON in ``data``, indexed by rollout), the marks of one call in one
transaction, so they survive reopening the file like the rollouts they name."""

from __future__ import annotations

from typing import Optional, Sequence

from lightning_nb.store.sqlite.helpers import SqliteHelpers
from lightning_nb.store.trained import TrainedMark, new_marks

__all__ = ["SqliteTrained"]


class SqliteTrained(SqliteHelpers):
    """``mark_trained``/``query_trained`` of ``SqliteStore``, whose helpers these call (declared in
    :class:`~lightning_nb.store.sqlite.helpers.SqliteHelpers`)."""

    def mark_trained(self, rollout_ids: Sequence[str], *, learner: str, update: int) -> list[TrainedMark]:
        marks = new_marks(list(rollout_ids), learner, update)
        with self._locked(), self._tx():  # an unknown id rolls the whole call back
            for mark in marks:
                if not self._rows("SELECT 1 FROM rollouts WHERE rollout_id = ?", mark.rollout_id):
                    self._rollout(mark.rollout_id)  # raises NotFoundError naming it
                self._rows("INSERT INTO trained (rollout_id, data) VALUES (?, ?)", mark.rollout_id,
                           mark.model_dump_json())
            return marks

    def query_trained(self, rollout_ids: Optional[Sequence[str]] = None) -> list[TrainedMark]:
        with self._locked():
            if rollout_ids is None:
                rows = self._rows("SELECT data FROM trained ORDER BY seq")
            else:
                ids, rows = list(rollout_ids), []
                for i in range(0, len(ids), 500):  # below SQLite's bound-parameter limit
                    chunk = ids[i:i + 500]
                    rows += self._rows(f"SELECT seq, data FROM trained WHERE rollout_id IN "
                                       f"({', '.join('?' * len(chunk))})", *chunk)
                rows = [(data,) for _, data in sorted(rows)]
            return [TrainedMark.model_validate_json(data) for (data,) in rows]
