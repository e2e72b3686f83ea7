"""Columnar span storage for :class:`~lightning_nb.store.memory.InMemoryStore`, and its spill file.

Spans are kept as columns (Python lists and typed ``array`` s), not as one pydantic
object each: that keeps a few hundred bytes per span instead of about 2 KB, and lets
``spans_df()`` build a DataFrame of a million spans in about a second, since the
strings that repeat (ids, names, statuses) are dictionary-encoded and become pandas
``category`` columns without a pass over the strings. Each span's attributes stay one
dict (no per-key index), so memory and ``add_span`` cost follow the data, however
many distinct keys the spans have; the frame's columns are
:mod:`lightning_nb.store.spanframe`'s.

Not thread-safe by itself: the store calls it with its lock held.
"""

from __future__ import annotations

import json
import sqlite3
from array import array
from itertools import compress
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import numpy as np
import pandas as pd

from lightning_nb.errors import LightningNbError
from lightning_nb.store.copies import span_construct
from lightning_nb.store.spanframe import CATEGORY_COLUMNS as _CODED
from lightning_nb.store.spanframe import KNOWN_ATTRIBUTES, NUMBER_COLUMNS, copy_lists, holds_list, known_cells
from lightning_nb.types import Span, SpanAttributes

__all__ = ["SpanTable", "SpanSpill", "span_from_raw", "spans_from_raws", "cells_of", "row_of"]
_KNOWN_KEYS = frozenset(KNOWN_ATTRIBUTES.values())
_NO_CELLS = known_cells({})  # the KNOWN_ATTRIBUTES cells of a span that has none of them


def span_from_raw(raw: tuple[Any, ...]) -> Span:
    """A :class:`Span` from :meth:`SpanTable.raw`, with its own copy of the attributes."""
    *fields, attrs, has_list = raw
    return span_construct(*fields, copy_lists(SpanAttributes(attrs), has_list))  # type: ignore[call-arg]  # the 10 raw fields


def _spilled_span(data: str) -> Span:
    """The :class:`Span` of a spilled span's JSON (stored by this table: valid), its attributes a SpanAttributes."""
    fields = json.loads(data)
    fields["attributes"] = SpanAttributes(fields["attributes"])
    return Span.model_construct(**fields)


def spans_from_raws(raws: list[tuple[Any, ...]]) -> list[Span]:
    """:func:`span_from_raw` of each of ``raws`` (:meth:`SpanTable.raws`)."""
    return [span_construct(rid, aid, seq, trace, span_id, parent, name, start, end, status,
                           copy_lists(SpanAttributes(attrs), True) if has_list else SpanAttributes(attrs))
            for rid, aid, seq, trace, span_id, parent, name, start, end, status, attrs, has_list in raws]


def cells_of(attributes: dict[str, Any]) -> tuple[Any, ...]:
    """:func:`~lightning_nb.store.spanframe.known_cells` of a span's attributes; a span without any well-known
    attribute (most of them: tool calls, agent steps) gets the shared cells of ``{}``."""
    return _NO_CELLS if attributes.keys().isdisjoint(_KNOWN_KEYS) else known_cells(attributes)


def row_of(span: Span, seq: int, prepared: tuple[dict[str, Any], int, tuple[Any, ...]]) -> tuple[Any, ...]:
    """A :meth:`SpanTable.extend` row: ``span``'s fields with sequence id ``seq`` and :meth:`SpanTable.prepare`'s
    result for it."""
    f = span.__dict__
    return (f["trace_id"], f["span_id"], f["parent_id"], f["name"], f["start_time"], f["end_time"], f["status"],
            *prepared, seq)


class SpanTable:
    """Spans as columns; rows are appended and removed in batches (``drop``).

    ``append`` stores a copy of the span's attributes and ``span`` hands out a copy
    (:func:`~lightning_nb.store.spanframe.copy_lists`), so callers never share a list with the table.
    """

    def __init__(self) -> None:
        self.codes: dict[str, array] = {c: array("i") for c in _CODED}  # -1 is None
        self.cats: dict[str, list[str]] = {c: [] for c in _CODED}
        self._lookup: dict[str, dict[str, int]] = {c: {} for c in _CODED}
        self.span_ids: list[str] = []
        self.start, self.end = array("d"), array("d")
        self.rank, self.aseq, self.seq = array("q"), array("q"), array("q")  # sort keys: rollout, attempt, span
        self.attrs: list[dict[str, Any]] = []
        self.has_list = bytearray()  # 1 where the attributes hold a list (token IDs): spans_df copies those lists
        # the spans_df cells of the well-known attributes, kept as each span arrives (spanframe.known_cells)
        self.known: list[Any] = [array("d") if col in NUMBER_COLUMNS else [] for col in KNOWN_ATTRIBUTES]
        self.by_attempt: dict[str, list[int]] = {}
        # attempts whose rows are not in increasing sequence id order (a caller gave sequence ids): only their
        # reads sort; every other attempt's rows are in (rollout, attempt, sequence id) order as written
        self.unordered: set[str] = set()

    def __len__(self) -> int:
        return len(self.attrs)

    @staticmethod
    def prepare(span: Span) -> tuple[dict[str, Any], int, tuple[Any, ...]]:
        """The part of :meth:`extend` that needs no lock: a copy of the attributes and their derived cells."""
        attrs = span.attributes
        has_list = holds_list(attrs)
        attrs = copy_lists(attrs.copy(), has_list) if type(attrs) is dict else copy_lists(dict(attrs), has_list)
        return attrs, has_list, cells_of(attrs)

    def extend(self, rows: list[tuple[Any, ...]], rollout_id: str, attempt_id: str, rank: int, aseq: int) -> None:
        """Add spans of one attempt; ids are the store's own strings, ``rank``/``aseq`` the sort keys of the
        rollout and the attempt. Each row is ``(trace_id, span_id, parent_id, name, start_time, end_time,
        status, attributes, has_list, cells, sequence_id)``: a span's fields, its attributes a dict the table
        may keep, with :meth:`prepare`'s flag and cells (:func:`row_of` makes one from a ``Span``)."""
        if len(rows) == 1:  # a span written alone (add_span): a row append costs less than a column pass
            self._append(rows[0], rollout_id, attempt_id, rank, aseq)
            return
        n, first = len(rows), len(self.attrs)
        trace, span_ids, parent, name, start, end, status, attrs, has_list, cells, seq = zip(*rows)
        self._check_order(attempt_id, seq)
        codes = self.codes
        codes["rollout_id"].extend([self._code_of("rollout_id", rollout_id)] * n)
        codes["attempt_id"].extend([self._code_of("attempt_id", attempt_id)] * n)
        self._code_many("name", name)
        self._code_many("status", status)
        self._code_many("trace_id", trace)
        self._code_many("parent_id", parent)
        self.span_ids.extend(span_ids)
        self.start.extend(start)
        self.end.extend(end)
        self.rank.extend([rank] * n)
        self.aseq.extend([aseq] * n)
        self.seq.extend(seq)
        self.by_attempt.setdefault(attempt_id, []).extend(range(first, first + n))
        self.attrs.extend(attrs)
        self.has_list.extend(has_list)
        for col, column_cells in zip(self.known, zip(*cells)):
            col.extend(column_cells)

    def _append(self, row: tuple[Any, ...], rollout_id: str, attempt_id: str, rank: int, aseq: int) -> None:
        """:meth:`extend` of one row."""
        trace, span_id, parent, name, start, end, status, attrs, has_list, cells, seq = row
        self._check_order(attempt_id, (seq,))
        codes, code_of = self.codes, self._code_of
        codes["rollout_id"].append(code_of("rollout_id", rollout_id))
        codes["attempt_id"].append(code_of("attempt_id", attempt_id))
        codes["name"].append(code_of("name", name))
        codes["status"].append(code_of("status", status))
        codes["trace_id"].append(code_of("trace_id", trace))
        codes["parent_id"].append(-1 if parent is None else code_of("parent_id", parent))
        self.span_ids.append(span_id)
        self.start.append(start)
        self.end.append(end)
        self.rank.append(rank)
        self.aseq.append(aseq)
        self.seq.append(seq)
        self.by_attempt.setdefault(attempt_id, []).append(len(self.attrs))
        self.attrs.append(attrs)
        self.has_list.append(has_list)
        for col, cell in zip(self.known, cells):
            col.append(cell)

    def _check_order(self, attempt_id: str, seqs: tuple[int, ...]) -> None:
        """Note ``attempt_id`` in :attr:`unordered` unless ``seqs`` (about to be appended) keep its rows in
        increasing sequence id order."""
        rows = self.by_attempt.get(attempt_id)
        if (rows and seqs[0] <= self.seq[rows[-1]]) or (len(seqs) > 1 and list(seqs) != sorted(set(seqs))):
            self.unordered.add(attempt_id)

    def in_order(self, attempt_ids: Iterable[str]) -> bool:
        """Whether :meth:`rows` of ``attempt_ids`` (listed in rollout and attempt order) are in (rollout, attempt,
        sequence id) order as they are, i.e. no sort is needed."""
        return not self.unordered or self.unordered.isdisjoint(attempt_ids)

    def _code_of(self, col: str, value: str) -> int:
        """The code of ``value`` in a dictionary-encoded column, added if new."""
        lookup = self._lookup[col]
        c = lookup.get(value)
        if c is None:
            c = lookup[value] = len(self.cats[col])
            self.cats[col].append(value)
        return c

    def _code_many(self, col: str, values: Sequence[Optional[str]]) -> None:
        """Append the codes of ``values`` (None: -1) to a dictionary-encoded column."""
        if values.count(values[0]) == len(values):  # one value (a batch's trace id, name or status)
            self.codes[col].extend([-1 if values[0] is None else self._code_of(col, values[0])] * len(values))
            return
        lookup, cats = self._lookup[col], self.cats[col]
        found = [lookup.get(v) for v in values]  # type: ignore[arg-type]  # (a None value finds None: handled below)
        if None in found:  # a new value (span ids as parent ids are new) or a None
            for i, c in enumerate(found):
                if c is None:
                    value = values[i]
                    if value is None:
                        found[i] = -1
                        continue
                    c = lookup.get(value)
                    if c is None:
                        c = lookup[value] = len(cats)
                        cats.append(value)
                    found[i] = c
        self.codes[col].extend(found)

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
        return span_from_raw(self.raw(row))

    def raw(self, row: int) -> tuple[Any, ...]:
        """Row ``row`` as the fields of a Span, its attributes dict the table's own, and whether that holds a
        list: under the lock, then :func:`span_from_raw` after releasing it (the table never changes a stored
        dict in place)."""
        v = self.value
        return (v("rollout_id", row), v("attempt_id", row), self.seq[row], v("trace_id", row), self.span_ids[row],
                v("parent_id", row), v("name", row), self.start[row], self.end[row], v("status", row),
                self.attrs[row], self.has_list[row])

    def raws(self, rows: list[int]) -> list[tuple[Any, ...]]:
        """:meth:`raw` of each of ``rows``, a column at a time."""
        ids = [self._values(c, rows) for c in ("rollout_id", "attempt_id", "trace_id", "parent_id", "name", "status")]
        seq, span_ids, start, end, attrs, has_list = self.seq, self.span_ids, self.start, self.end, self.attrs, \
            self.has_list
        return [(rid, aid, seq[r], trace, span_ids[r], parent, name, start[r], end[r], status, attrs[r], has_list[r])
                for r, rid, aid, trace, parent, name, status in zip(rows, *ids)]

    def _values(self, col: str, rows: list[int]) -> list[Optional[str]]:
        codes, cats = self.codes[col], self.cats[col]
        return [cats[c] if c >= 0 else None for c in map(codes.__getitem__, rows)]

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
        self.has_list = bytearray(compress(self.has_list, keep_list))
        self.known = [array(col.typecode, np.frombuffer(col, dtype=np.float64)[keep].tobytes())
                      if isinstance(col, array) else list(compress(col, keep_list)) for col in self.known]
        by_attempt: dict[str, list[int]] = {}
        cats = self.cats["attempt_id"]
        for row, code in enumerate(self.codes["attempt_id"]):
            by_attempt.setdefault(cats[code], []).append(row)
        self.by_attempt = by_attempt
        self.unordered &= by_attempt.keys()
        return dropped

    def columns(self, rows: Optional[list[int]] = None) -> dict[str, Any]:
        """The arguments of :func:`~lightning_nb.store.spanframe.spans_frame` for ``rows`` (all when None).

        Sorted by (rollout, attempt, sequence id). Cheap (no per-attribute work), so the
        store calls it with its lock held and builds the frame after releasing it: the
        attribute dicts handed out are never changed in place by the table.
        """
        sel = np.arange(len(self), dtype=np.int64) if rows is None else np.asarray(rows, dtype=np.int64)

        def nums(arr: array) -> np.ndarray:  # a copy: a view would keep the array from growing
            dtype = np.float64 if arr.typecode == "d" else np.int64
            return (np.frombuffer(arr, dtype=dtype) if len(arr) else np.zeros(0, dtype=dtype))[sel]

        order = np.lexsort((nums(self.seq), nums(self.aseq), nums(self.rank)))
        if (order[1:] < order[:-1]).any():
            sel = sel[order]
        codes = {c: (np.frombuffer(self.codes[c], dtype=np.int32) if len(self) else np.zeros(0, np.int32))[sel]
                 for c in _CODED}
        picked = sel.tolist()
        span_ids, attrs = self.span_ids, self.attrs
        has_list = np.frombuffer(self.has_list, dtype=np.uint8) if len(self) else np.zeros(0, np.uint8)
        known = [nums(col) if isinstance(col, array) else _pick(col, sel) for col in self.known]
        return {"ids": {c: _recode(codes[c], self.cats[c]) for c in _CODED},
                "span_id": [span_ids[r] for r in picked], "sequence_id": nums(self.seq),
                "start": nums(self.start), "end": nums(self.end), "attributes": [attrs[r] for r in picked],
                "known": dict(zip(KNOWN_ATTRIBUTES, known)), "lists_at": np.flatnonzero(has_list[sel]).tolist()}


def _pick(values: list, sel: np.ndarray) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out[sel]


def _recode(codes: np.ndarray, cats: list[str]) -> pd.Categorical:
    """Table codes (-1: None) as a categorical of the used values only, first seen first (as the generic view)."""
    new, uniq = pd.factorize(codes)
    if (uniq < 0).any():  # the code of None: missing, not a category
        gone = int(np.flatnonzero(uniq < 0)[0])
        new = np.where(new == gone, -1, new - (new > gone))
        uniq = np.delete(uniq, gone)
    return pd.Categorical.from_codes(new, categories=pd.Index([cats[u] for u in uniq.tolist()], dtype=object))


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
        return [(rank, aseq, _spilled_span(data))
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
