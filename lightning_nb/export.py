"""Export spans and triplets to Parquet files (pandas + pyarrow) for offline analysis or training.

Both writers use a fixed Arrow schema, so an empty export and a full one have the
same columns and types, and token IDs come back exactly as they were stored:

* :func:`spans_to_parquet`: one row per span (see :data:`SPAN_SCHEMA`);
* :func:`triplets_to_parquet`: one row per :class:`~lightning_nb.types.Triplet`
  (see :data:`TRIPLET_SCHEMA`).

Read them back with ``pandas.read_parquet(path)`` or ``pyarrow.parquet.read_table(path)``.
"""

from __future__ import annotations

import json
import numbers
from pathlib import Path
from typing import Any, Optional, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from lightning_nb.errors import ConfigError
from lightning_nb.store.base import LightningStore, span_summary
from lightning_nb.types import Span, Triplet

__all__ = ["spans_to_parquet", "triplets_to_parquet", "SPAN_SCHEMA", "TRIPLET_SCHEMA"]

_IDS = pa.list_(pa.int64())

#: Columns of :func:`spans_to_parquet`. Times are float seconds since the epoch;
#: ``attributes`` is every span attribute as one JSON object (NaN/Infinity written
#: as Python's ``json`` does); the token-count, reward and token-ID columns are
#: copies of those attributes, null where a span lacks them or holds another type.
SPAN_SCHEMA = pa.schema([
    ("rollout_id", pa.string()), ("attempt_id", pa.string()), ("sequence_id", pa.int64()),
    ("name", pa.string()), ("status", pa.string()),
    ("trace_id", pa.string()), ("span_id", pa.string()), ("parent_id", pa.string()),
    ("start_time", pa.float64()), ("end_time", pa.float64()), ("duration_s", pa.float64()),
    ("prompt_tokens", pa.int64()), ("completion_tokens", pa.int64()), ("reward", pa.float64()),
    ("prompt_token_ids", _IDS), ("completion_token_ids", _IDS),
    ("attributes", pa.string()),
])

#: Columns of :func:`triplets_to_parquet`: the Triplet fields, token IDs as list<int64>,
#: ``logprobs`` as list<double> (null when the triplet has none).
TRIPLET_SCHEMA = pa.schema([
    ("rollout_id", pa.string()), ("attempt_id", pa.string()), ("group_id", pa.string()), ("turn", pa.int64()),
    ("prompt_ids", _IDS), ("response_ids", _IDS), ("logprobs", pa.list_(pa.float64())),
    ("reward", pa.float64()), ("temperature", pa.float64()),
    ("prompt_text", pa.string()), ("response_text", pa.string()),
])


def spans_to_parquet(store: LightningStore, path: str | Path, rollout_id: Optional[str] = None) -> Path:
    """Write the store's spans (all, or one rollout's) to a Parquet file, one row per span.

    Rows are in :meth:`~lightning_nb.store.base.LightningStore.query_spans` order;
    columns are :data:`SPAN_SCHEMA`. Missing parent folders are created and an
    existing file is replaced.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        NotFoundError: ``rollout_id`` is not in the store.
        ConfigError: ``path`` cannot be written (it is a folder, a parent is a file, ...).
    """
    spans = store.query_spans(rollout_id)
    table = pa.Table.from_pylist([_span_row(s) for s in spans], schema=SPAN_SCHEMA)
    return _write(table, path, "spans_to_parquet")


def triplets_to_parquet(triplets: Sequence[Triplet], path: str | Path) -> Path:
    """Write triplets to a Parquet file, one row per triplet (columns: :data:`TRIPLET_SCHEMA`).

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        ConfigError: an item is not a Triplet, or ``path`` cannot be written.
    """
    rows = []
    for i, t in enumerate(triplets):
        if not isinstance(t, Triplet):
            raise ConfigError(f"triplets[{i}] is a {type(t).__name__}; pass lightning_nb.types.Triplet objects "
                              f"(e.g. from TripletAdapter.adapt)")
        rows.append({name: getattr(t, name) for name in TRIPLET_SCHEMA.names})
    table = pa.Table.from_pylist(rows, schema=TRIPLET_SCHEMA)
    return _write(table, path, "triplets_to_parquet")


# ----- helpers ----------------------------------------------------------------------------
def _span_row(span: Span) -> dict[str, Any]:
    summary = span_summary(span)
    return {
        "rollout_id": span.rollout_id, "attempt_id": span.attempt_id, "sequence_id": span.sequence_id,
        "name": span.name, "status": span.status,
        "trace_id": span.trace_id, "span_id": span.span_id, "parent_id": span.parent_id,
        "start_time": span.start_time, "end_time": span.end_time, "duration_s": summary["duration_s"],
        "prompt_tokens": _int(summary["prompt_tokens"]),
        "completion_tokens": _int(summary["completion_tokens"]),
        "reward": _float(summary["reward"]),
        "prompt_token_ids": _int_list(span.attributes.get("prompt_token_ids")),
        "completion_token_ids": _int_list(span.attributes.get("completion_token_ids")),
        "attributes": json.dumps(span.attributes, allow_nan=True, default=repr),
    }


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _int(value: Any) -> Optional[int]:
    return int(value) if _is_int(value) else None


def _float(value: Any) -> Optional[float]:
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    return None


def _int_list(value: Any) -> Optional[list[int]]:
    if isinstance(value, (list, tuple)) and all(_is_int(v) for v in value):
        return [int(v) for v in value]
    return None


def _write(table: pa.Table, path: str | Path, what: str) -> Path:
    """Write ``table`` to ``path`` (parents created); ConfigError naming the path if that fails."""
    target = Path(path)
    if target.is_dir():
        raise ConfigError(f"{what}: path {str(target)!r} is a folder; pass a file path such as "
                          f"{str(target / 'out.parquet')!r}")
    for parent in target.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ConfigError(f"{what}: cannot write {str(target)!r} because {str(parent)!r} is a file, "
                                  f"not a folder; choose another path")
            break
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, target)
    except (OSError, pa.ArrowException) as exc:
        raise ConfigError(f"{what}: cannot write {str(target)!r}: {type(exc).__name__}: {exc}") from exc
    return target
