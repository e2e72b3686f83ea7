"""Slicing tasks into groups for per-slice reports: a task field (``"ops"``) or a function ``task -> label``.

Used by the store's frames (a ``slice`` column), the algorithm's per-slice evaluation and the
reward-curve widget.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Optional, Sequence, Union

from lightning_nb.errors import ConfigError

__all__ = ["Slicer", "slice_labels", "ordered_labels", "slice_keys", "slicer_name"]

Slicer = Union[str, Callable[[Any], Any]]
"""What to slice tasks by: a task field name (``"ops"``) or a function ``task -> label``."""


def slicer_name(by: Slicer) -> str:
    return by if isinstance(by, str) else getattr(by, "__name__", None) or type(by).__name__


def slice_keys(items: Sequence[Any], by: Slicer, what: str = "task",
                names: Optional[Sequence[str]] = None) -> list[tuple[Any, str]]:
    """``(raw value, label)`` of each item; see :func:`slice_labels`."""
    def where(i: int) -> str:
        return f"{what} {i}" + (f" ({names[i]})" if names is not None else "")

    if isinstance(by, str):
        for i, item in enumerate(items):
            if not isinstance(item, Mapping) or by not in item:
                keys = list(item) if isinstance(item, Mapping) else f"none: it is a {type(item).__name__}, not a dict"
                raise ConfigError(f"by={by!r}: {where(i)} has no field {by!r} (its keys: {keys}); "
                                  "slice by a field every task has, or pass a function task -> label")
        return [(item[by], f"{by}={item[by]}") for item in items]
    if not callable(by):
        raise ConfigError(f"by must be a task field name (str) or a function task -> label, got {by!r}")
    out = []
    for i, item in enumerate(items):
        try:
            value = by(item)
        except Exception as exc:
            raise ConfigError(f"by={slicer_name(by)}: raised on {where(i)}: {type(exc).__name__}: {exc}") from exc
        out.append((value, str(value)))
    return out


def slice_labels(items: Sequence[Any], by: Slicer, *, what: str = "task",
                 names: Optional[Sequence[str]] = None) -> list[str]:
    """The slice label of each item (a task dict): ``"<field>=<value>"`` for a field name
    (``"ops=2"``), ``str(by(task))`` for a function.

    ``what`` and ``names`` (one per item, e.g. rollout ids) only word the errors.

    Raises:
        ConfigError: ``by`` is a field that an item lacks (naming the field, the first such
            item's index and its keys), ``by`` raised on an item (naming the index and the
            exception), or ``by`` is neither a str nor callable.
    """
    return [label for _, label in slice_keys(items, by, what, names)]


def ordered_labels(keys: Sequence[tuple[Any, str]]) -> list[str]:
    """Distinct labels sorted by their raw values (first appearance when those do not compare)."""
    first: dict[str, Any] = {}
    for value, label in keys:
        first.setdefault(label, value)
    try:
        return sorted(first, key=lambda label: (first[label], label))
    except TypeError:
        return list(first)

