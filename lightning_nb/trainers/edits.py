"""Config edits made while a loop is paused: one rule for the trainer's config and the algorithm's.

A user edits ``trainer.config`` or ``algo.config`` (dataclasses) while the loop is paused; the edit takes effect
at the next update (the trainer's) or step (the algorithm's). :class:`ConfigWatch` holds what was last applied
and says what changed since (:meth:`ConfigWatch.take`), as :class:`ConfigChange` records: the trainer returns
its own in :attr:`~lightning_nb.trainers.base.Update.config_changes`, the algorithm adds its own, and
``Algorithm.record`` logs both in ``algo.config_changes`` (``{"step", "config", "field", "old", "new"}``) and
the step row's ``config_changes`` text.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Optional

__all__ = ["ConfigChange", "ConfigWatch", "config_edits"]


@dataclass(frozen=True)
class ConfigChange:
    """One field of a config that changed: ``field``, its ``old`` and ``new`` values."""

    field: str
    old: Any
    new: Any

    @property
    def text(self) -> str:
        """``"learning_rate 2e-05 → 1e-05"``: what the metrics' ``config_changes`` column shows."""
        return f"{self.field} {self.old!r} → {self.new!r}"

    def record(self, step: int, config: str) -> dict[str, Any]:
        """``{"step", "config", "field", "old", "new"}``: the entry of ``algo.config_changes`` (``config``:
        ``"trainer"`` or ``"algorithm"``)."""
        return {"step": step, "config": config, "field": self.field, "old": self.old, "new": self.new}


def changes_between(applied: dict[str, Any], now: dict[str, Any]) -> list[ConfigChange]:
    """A :class:`ConfigChange` for each field of ``now`` that differs from ``applied`` (two ``asdict`` snapshots)."""
    return [ConfigChange(k, applied.get(k), v) for k, v in now.items() if v != applied.get(k)]


def config_edits(applied: dict[str, Any], now: dict[str, Any]) -> list[tuple[str, Any, Any, str]]:
    """``(field, old, new, text)`` for each field of ``now`` that differs from ``applied`` (two ``asdict`` snapshots);
    :func:`changes_between` as tuples (the form of earlier versions)."""
    return [(c.field, c.old, c.new, c.text) for c in changes_between(applied, now)]


class ConfigWatch:
    """What a dataclass config was when its edits were last applied, and what changed since.

    Args:
        config: the config as it applies now (a dataclass instance).
    """

    def __init__(self, config: Any) -> None:
        self.applied: dict[str, Any] = asdict(config)

    def edited(self, config: Any) -> bool:
        """True when ``config`` differs from what was last applied (nothing is taken)."""
        return asdict(config) != self.applied

    def take(self, config: Any) -> list[ConfigChange]:
        """The changes of ``config`` since the last :meth:`take` (or construction), in field order; from now on
        ``config`` as it is counts as applied."""
        now = asdict(config)
        changes = changes_between(self.applied, now)
        self.applied = now
        return changes

    def reset(self, config: Any, applied: Optional[dict[str, Any]] = None) -> None:
        """Count ``config`` as applied (after a load), or ``{**asdict(config), **applied}`` when ``applied`` is given:
        the next :meth:`take` then reports what differs from those values."""
        self.applied = {**asdict(config), **(applied or {})}
