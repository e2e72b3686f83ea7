"""The resources of :class:`~lightning_nb.store.sqlite.SqliteStore`: one row of the ``resources`` table per
:class:`~lightning_nb.types.ResourcesUpdate` (its JSON in ``data``; the highest ``seq`` is the latest), written in
one transaction per call; resources reads wait only for the commit of the latest ``add_resources``."""

from __future__ import annotations

import time
from typing import Any, Optional

from lightning_nb.store.rules import coerce_resources, next_resources, resources_not_found
from lightning_nb.store.sqlite.helpers import SqliteHelpers
from lightning_nb.types import ResourcesUpdate, new_id

__all__ = ["SqliteResources"]


class SqliteResources(SqliteHelpers):
    """``add_resources``/``query_resources``/``get_latest_resources``/``get_resources_by_id`` of ``SqliteStore``,
    whose helpers and commit counters these use (declared in
    :class:`~lightning_nb.store.sqlite.helpers.SqliteHelpers`)."""

    def add_resources(self, resources: dict[str, Any], resources_id: Optional[str] = None) -> ResourcesUpdate:
        update = ResourcesUpdate(resources_id=resources_id or new_id("res"), resources=coerce_resources(resources))
        with self._locked(), self._tx():
            rows = self._rows("SELECT data FROM resources WHERE resources_id = ?", update.resources_id)
            update = next_resources(update, ResourcesUpdate.model_validate_json(rows[0][0]) if rows else None,
                                    time.time())
            # delete + insert gives it the highest seq: re-adding an id makes it the latest again
            self._rows("DELETE FROM resources WHERE resources_id = ?", update.resources_id)
            self._rows("INSERT INTO resources (resources_id, data) VALUES (?, ?)",
                       update.resources_id, update.model_dump_json())
            self._resources_commit = self._commits + 1  # this transaction's commit: resources reads wait for it
            return update.model_copy()

    def query_resources(self) -> list[ResourcesUpdate]:
        with self._locked(resources_only=True):
            return [ResourcesUpdate.model_validate_json(d) for (d,) in self._rows(
                "SELECT data FROM resources ORDER BY seq")]

    def get_latest_resources(self) -> Optional[ResourcesUpdate]:
        with self._locked(resources_only=True):
            rows = self._rows("SELECT data FROM resources ORDER BY seq DESC LIMIT 1")
            return ResourcesUpdate.model_validate_json(rows[0][0]) if rows else None

    def get_resources_by_id(self, resources_id: str) -> ResourcesUpdate:
        with self._locked(resources_only=True):
            rows = self._rows("SELECT data FROM resources WHERE resources_id = ?", resources_id)
            if not rows:
                self._check_resources(resources_id)
            return ResourcesUpdate.model_validate_json(rows[0][0])

    def _check_resources(self, resources_id: str) -> None:
        """NotFoundError naming ``resources_id`` if it is not stored (lock held)."""
        if not self._rows("SELECT 1 FROM resources WHERE resources_id = ?", resources_id):
            raise resources_not_found(resources_id)
