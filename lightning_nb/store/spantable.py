"""Columnar span storage for :class:`~lightning_nb.store.memory.InMemoryStore`, and its spill file.

Spans are kept as columns (Python lists and typed ``array`` s), not as one pydantic
object each: that keeps a few hundred bytes per span instead of about 2 KB, and lets
``spans_df()`` build a DataFrame of a million spans in under a second, since every
attribute is already a column (stored sparsely: row numbers and values) and the
strings that repeat (ids, names, statuses) are dictionary-encoded: ``spans_df()``
returns ``rollout_id``, ``attempt_id``, ``name``, ``status``, ``trace_id`` and
``parent_id`` as pandas ``category`` columns and string attributes as ``object``.

Not thread-safe by itself: the store calls it with its lock held.
"""

from __future__ import annotations

import json
import sqlite3
from array import array
from itertools import compress
from pathlib import Path
from typing import Any, Iterable, Optional

import numpy as np
import pandas as pd

from lightning_nb.errors import LightningNbError
from lightning_nb.types import Span

__all__ = ["SpanTable", "SpanSpill", "frame_from_spans", "copy_attributes"]

_BASE = ("rollout_id", "attempt_id", "sequence_id", "name", "start_time", "end_time", "status",
         "trace_id", "span_id", "parent_id")
_CODED = ("rollout_id", "attempt_id", "name", "status", "trace_id", "parent_id")  # repeat a lot: categorical
_SUMMARY = {"prompt_tokens": "gen_ai.usage.input_tokens", "completion_tokens": "gen_ai.usage.output_tokens",
            "reward": "reward"}


def copy_attributes(attributes: dict[str, Any]) -> dict[str, Any]:
    """A copy of span attributes that shares no list with ``attributes``.

    Attribute values are scalars or flat lists of scalars (OpenTelemetry), so copying
    the lists one level deep is a full copy, and much cheaper than ``copy.deepcopy``.
    """
    return {k: (list(v) if isinstance(v, list) else v) for k, v in attributes.items()}


class SpanTable:
    """Spans as columns; rows are appended and removed in batches (``drop``).

    ``append`` stores a copy of the span's attributes and ``span`` hands out a copy
    (:func:`copy_attributes`), so callers never share a list with the table.
    """

    def __init__(self) -> None:
        self.codes: dict[str, array] = {c: array("i") for c in _CODED}  # -1 is None
        self.cats: dict[str, list[str]] = {c: [] for c in _CODED}
        self._lookup: dict[str, dict[str, int]] = {c: {} for c in _CODED}
        self.span_ids: list[str] = []
        self.start, self.end = array("d"), array("d")
        self.rank, self.aseq, self.seq = array("q"), array("q"), array("q")  # sort keys: rollout, attempt, span
        self.attrs: list[dict[str, Any]] = []
        self.attr_cols: dict[str, tuple[array, list[Any]]] = {}  # key -> (row numbers, values)
        self.by_attempt: dict[str, list[int]] = {}

    def __len__(self) -> int:
        return len(self.attrs)

    def append(self, span: Span, rollout_id: str, attempt_id: str, rank: int, aseq: int) -> None:
        """Add one span (its ``sequence_id`` already assigned); ids are the store's own strings."""
        row = len(self.attrs)
        code = self._code
        code("rollout_id", rollout_id)
        code("attempt_id", attempt_id)
        code("name", span.name)
        code("status", span.status)
        code("trace_id", span.trace_id)
        code("parent_id", span.parent_id)
        self.span_ids.append(span.span_id)
        self.start.append(span.start_time)
        self.end.append(span.end_time)
        self.rank.append(rank)
        self.aseq.append(aseq)
        self.seq.append(span.sequence_id)
        attrs = copy_attributes(span.attributes)
        self.attrs.append(attrs)
        for key, value in attrs.items():
            col = self.attr_cols.get(key)
            if col is None:
                col = self.attr_cols[key] = (array("q"), [])
            col[0].append(row)
            col[1].append(value)
        self.by_attempt.setdefault(attempt_id, []).append(row)

    def _code(self, col: str, value: Optional[str]) -> None:
        if value is None:
            self.codes[col].append(-1)
            return
        lookup = self._lookup[col]
        c = lookup.get(value)
        if c is None:
            c = lookup[value] = len(self.cats[col])
            self.cats[col].append(value)
        self.codes[col].append(c)

    def value(self, col: str, row: int) -> Optional[str]:
        """The value of a dictionary-encoded column (``rollout_id``, ``name``, ...) at ``row``."""
        c = self.codes[col][row]
        return None if c < 0 else self.cats[col][c]

    def rows_named(self, name: str) -> list[int]:
        """Rows whose span name is ``name``."""
        c = self._lookup["name"].get(name)
        if c is None or not len(self):
            return []
        return np.flatnonzero(np.frombuffer(self.codes["name"], dtype=np.int32) == c).tolist()

    def span(self, row: int) -> Span:
        v = self.value
        return Span.model_construct(
            rollout_id=v("rollout_id", row), attempt_id=v("attempt_id", row), sequence_id=self.seq[row],
            trace_id=v("trace_id", row), span_id=self.span_ids[row], parent_id=v("parent_id", row),
            name=v("name", row), start_time=self.start[row], end_time=self.end[row], status=v("status", row),
            attributes=copy_attributes(self.attrs[row]))

    def rows(self, attempt_ids: Iterable[str]) -> list[int]:
        return [r for aid in attempt_ids for r in self.by_attempt.get(aid, ())]

    def keys(self, row: int) -> tuple[int, int, int]:
        return self.rank[row], self.aseq[row], self.seq[row]

    def drop(self, rollout_ids: set[str]) -> list[tuple[int, int, Span]]:
        """Remove every span of ``rollout_ids``; returns them as ``(rank, aseq, span)`` (O(rows) compaction)."""
        rcodes = np.frombuffer(self.codes["rollout_id"], dtype=np.int32)
        doomed = np.array([self._lookup["rollout_id"].get(rid, -2) for rid in rollout_ids], dtype=np.int32)
        keep = ~np.isin(rcodes, doomed)
        gone = np.flatnonzero(~keep)
        dropped = [(self.rank[r], self.aseq[r], self.span(r)) for r in gone.tolist()]
        if not len(gone):
            return dropped
        remap = np.cumsum(keep) - 1
        keep_list = keep.tolist()
        self.span_ids = list(compress(self.span_ids, keep_list))
        for c in _CODED:  # re-encode, forgetting values no kept row uses
            codes = np.frombuffer(self.codes[c], dtype=np.int32)[keep]
            used = np.unique(codes[codes >= 0])
            new = np.full(len(self.cats[c]) + 1, -1, dtype=np.int32)  # the last slot maps -1 to -1
            new[used] = np.arange(len(used), dtype=np.int32)
            self.codes[c] = array("i", new[codes].astype(np.int32).tobytes())
            self.cats[c] = [self.cats[c][i] for i in used.tolist()]
            self._lookup[c] = {v: i for i, v in enumerate(self.cats[c])}
        for name in ("start", "end", "rank", "aseq", "seq"):
            old = getattr(self, name)
            kept = np.frombuffer(old, dtype=np.float64 if old.typecode == "d" else np.int64)[keep]
            setattr(self, name, array(old.typecode, kept.tobytes()))
        self.attrs = list(compress(self.attrs, keep_list))
        for key, (idx, values) in list(self.attr_cols.items()):
            rows = np.frombuffer(idx, dtype=np.int64)
            mask = keep[rows] if len(rows) else np.zeros(0, dtype=bool)
            if not mask.any():
                del self.attr_cols[key]
                continue
            self.attr_cols[key] = (array("q", remap[rows[mask]].tobytes()), list(compress(values, mask.tolist())))
        by_attempt: dict[str, list[int]] = {}
        cats = self.cats["attempt_id"]
        for row, code in enumerate(self.codes["attempt_id"]):
            by_attempt.setdefault(cats[code], []).append(row)
        self.by_attempt = by_attempt
        return dropped

    def frame(self, rows: Optional[list[int]] = None) -> tuple[pd.DataFrame, np.ndarray]:
        """The ``spans_df`` columns for ``rows`` (all when None), unsorted, and their sort keys."""
        n = len(self) if rows is None else len(rows)
        sel = None if rows is None else np.asarray(rows, dtype=np.int64)

        def nums(arr: array) -> np.ndarray:
            out = np.frombuffer(arr, dtype=np.float64 if arr.typecode == "d" else np.int64) if len(arr) else \
                np.zeros(0, dtype=np.float64 if arr.typecode == "d" else np.int64)
            return out.copy() if sel is None else out[sel]

        def objs(values: list) -> pd.Series:
            out = np.empty(len(values), dtype=object)
            out[:] = values
            return pd.Series(out if sel is None else out[sel], dtype=object, copy=False)

        def coded(col: str) -> pd.Categorical:
            codes = np.frombuffer(self.codes[col], dtype=np.int32) if len(self) else np.zeros(0, np.int32)
            cats = pd.Index(self.cats[col], dtype=object)
            return pd.Categorical.from_codes(codes if sel is None else codes[sel], categories=cats)

        start, end = nums(self.start), nums(self.end)
        data: dict[str, Any] = {}
        for c in _BASE:
            if c == "sequence_id":
                data[c] = nums(self.seq)
            elif c == "start_time":
                data[c] = pd.to_datetime(start, unit="s")
            elif c == "end_time":
                data[c] = pd.to_datetime(end, unit="s")
            elif c == "span_id":
                data[c] = objs(self.span_ids)
            else:
                data[c] = coded(c)
        data["duration_s"] = end - start
        attrs = {key: col for key in self.attr_cols if (col := self._attr_column(key, sel, n)) is not None}
        for col, key in _SUMMARY.items():
            data[col] = attrs[key] if key in attrs else pd.Series(np.full(n, None, dtype=object), dtype=object)
        for key, values in attrs.items():
            if key not in data:
                data[key] = values
        keys = np.stack([nums(self.rank), nums(self.aseq), nums(self.seq)]) if n else np.zeros((3, 0), np.int64)
        return pd.DataFrame(data, copy=False), keys

    def _attr_column(self, key: str, sel: Optional[np.ndarray], n: int) -> Optional[pd.Series]:
        """One attribute as a column (NaN where a span lacks it); None if no selected span has it."""
        idx, values = self.attr_cols[key]
        rows = np.frombuffer(idx, dtype=np.int64) if len(idx) else np.zeros(0, dtype=np.int64)
        if sel is not None:  # a few rows: map the selection through a small lookup
            pos = {r: i for i, r in enumerate(rows.tolist())}
            picked = [pos.get(r) for r in sel.tolist()]
            if all(p is None for p in picked):
                return None
            return _series([values[p] if p is not None else np.nan for p in picked])
        series = _series(values)
        if len(rows) == n:
            return series
        if series.dtype.kind in "iuf":
            out = np.full(n, np.nan)
            out[rows] = series.to_numpy(dtype=np.float64)
            return pd.Series(out, copy=False)
        out = np.full(n, np.nan, dtype=object)
        out[rows] = series.to_numpy(dtype=object)
        return pd.Series(out, dtype=object, copy=False)


def _series(values: list) -> pd.Series:
    try:
        return pd.Series(values, dtype=_dtype(values))
    except (TypeError, ValueError):  # the sample missed a value of another type
        return pd.Series(values, dtype=object)


def _dtype(values: list) -> Any:
    """float64 / int64 / bool when every value has that type, else object (lists stay lists)."""
    if not values:
        return object
    kinds = {type(v) for v in values[:1000]} | {type(values[-1])}
    if kinds <= {float, int} and float in kinds:
        return np.float64
    if kinds == {int}:
        return np.int64
    if kinds == {bool}:
        return bool
    return object  # strings stay Python objects: converting a million of them costs more than the rest


def frame_from_spans(items: list[tuple[int, int, Span]]) -> tuple[pd.DataFrame, np.ndarray]:
    """``SpanTable.frame`` for spans held as objects (the spilled ones)."""
    table = SpanTable()
    for rank, aseq, span in items:
        table.append(span, span.rollout_id, span.attempt_id, rank, aseq)
    return table.frame()


class SpanSpill:
    """An SQLite file holding spans evicted from memory; a cache, not a durable store.

    Written with ``synchronous=OFF`` (the in-memory store it extends dies with the
    process anyway); NaN and infinities survive (JSON with Python's extension).
    The file is created fresh (an existing one is replaced). :meth:`close` checkpoints
    and closes it, leaving no ``-wal``/``-shm`` file; later reads and writes raise
    :class:`~lightning_nb.errors.LightningNbError`.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for suffix in ("", "-wal", "-shm"):  # a stale WAL of an older file must not be replayed into the new one
            Path(f"{self.path}{suffix}").unlink(missing_ok=True)
        self._db: Optional[sqlite3.Connection] = sqlite3.connect(str(self.path), check_same_thread=False,
                                                                 isolation_level=None)
        self._db.execute("PRAGMA synchronous=OFF")
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("CREATE TABLE spans (rank INTEGER NOT NULL, aseq INTEGER NOT NULL, seq INTEGER NOT NULL, "
                         "rollout_id TEXT NOT NULL, name TEXT NOT NULL, data TEXT NOT NULL)")
        self._db.execute("CREATE INDEX spans_rollout ON spans(rollout_id)")
        self.count = 0

    @property
    def closed(self) -> bool:
        return self._db is None

    def check_open(self) -> sqlite3.Connection:
        """The connection; raise LightningNbError if :meth:`close` was called."""
        if self._db is None:
            raise LightningNbError(f"the span spill file {str(self.path)!r} was closed (store.close()); spilled spans "
                                   f"can no longer be read and no span can be added. Make a new store to go on")
        return self._db

    def write(self, items: list[tuple[int, int, Span]]) -> None:
        db = self.check_open()
        rows = [(rank, aseq, s.sequence_id, s.rollout_id, s.name,
                 json.dumps(s.model_dump(), allow_nan=True, default=repr)) for rank, aseq, s in items]
        db.execute("BEGIN")
        try:
            db.executemany("INSERT INTO spans VALUES (?, ?, ?, ?, ?, ?)", rows)
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        self.count += len(rows)

    def read(self, rollout_id: Optional[str] = None, name: Optional[str] = None) -> list[tuple[int, int, Span]]:
        """Spilled spans as ``(rank, aseq, span)``, optionally of one rollout / one span name."""
        db = self.check_open()
        where, params = [], []
        if rollout_id is not None:
            where.append("rollout_id = ?")
            params.append(rollout_id)
        if name is not None:
            where.append("name = ?")
            params.append(name)
        sql = "SELECT rank, aseq, data FROM spans" + (" WHERE " + " AND ".join(where) if where else "")
        return [(rank, aseq, Span.model_construct(**json.loads(data)))
                for rank, aseq, data in db.execute(sql + " ORDER BY rank, aseq, seq", params)]

    def close(self) -> None:
        """Checkpoint the WAL into the file and close it (idempotent); no ``-wal``/``-shm`` file remains."""
        if self._db is None:
            return
        db, self._db = self._db, None
        try:
            db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            db.execute("PRAGMA journal_mode=DELETE")  # removes the -wal file; close() removes the -shm one
        finally:
            db.close()
