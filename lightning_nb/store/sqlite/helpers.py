"""What the parts of :class:`~lightning_nb.store.sqlite.SqliteStore` (its spans, resources and training record,
each in its own module) call on the store: :class:`SqliteHelpers`, declared once for the type checker."""

from __future__ import annotations

import sqlite3
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Optional

from lightning_nb.types import Attempt, Rollout

__all__ = ["SqliteHelpers"]


class SqliteHelpers:
    """The base of SqliteStore's parts: nothing at run time; for mypy, the store's connection helpers (lock held:
    ``_rows``, ``_conn``, ``_tx``; ``_locked`` takes the lock), its lookups and its commit counters."""

    if TYPE_CHECKING:  # SqliteStore's (lightning_nb/store/sqlite/store.py)
        _commits: int
        _resources_commit: int

        def _rows(self, sql: str, *params: Any) -> list[Any]: ...

        def _conn(self) -> sqlite3.Connection: ...

        def _tx(self) -> AbstractContextManager[None]: ...

        def _locked(self, resources_only: bool = False) -> AbstractContextManager[None]: ...

        def _rollout(self, rollout_id: str) -> Rollout: ...

        def _attempt(self, rollout_id: str, attempt_id: str) -> Attempt: ...

        def _latest_attempt_id(self, rollout_id: str) -> Optional[str]: ...

        def _update(self, attempt: Attempt, *, status: Optional[str], worker_id: Optional[str], error: Optional[str],
                    heartbeat: bool, now: float, by_worker: bool = True) -> None: ...
