"""The spans of :class:`~lightning_nb.store.sqlite.SqliteStore`: how they are written and read back.

:class:`SqliteSpans` is mixed into ``SqliteStore``. Each span is one row of the ``spans``
table (its JSON in ``data``, indexed by attempt, sequence id and span id); a batch is one
transaction, checked whole before it commits, with the contract's span rules
(:func:`~lightning_nb.store.rules.span_sequence_id`, :func:`~lightning_nb.store.rules.same_span`,
a span as a heartbeat). ``spans_df`` parses the stored JSON row by row straight into
columns, and the final rewards come from one query. Every method takes the store's lock
(``_locked``) and uses its connection helpers (``_rows``, ``_tx``, ``_conn``) and its
rollout and attempt lookups (``_rollout``, ``_attempt``, ``_latest_attempt_id``, ``_update``).
"""

from __future__ import annotations

import json
import time
from typing import Any, Iterator, Optional, Sequence

import numpy as np
import pandas as pd
from pydantic_core import from_json

from lightning_nb.errors import AttemptEnded, ConfigError, NotFoundError
from lightning_nb.semconv import LLM_SPAN, REWARD, REWARD_SPAN
from lightning_nb.store.copies import span_with_sequence_id
from lightning_nb.store.rules import check_span_types, check_span_writable, same_span, span_beats, span_sequence_id
from lightning_nb.store.spanframe import CATEGORY_COLUMNS, Flatten, check_flatten, spans_frame
from lightning_nb.store.sqlite.file import to_json
from lightning_nb.store.sqlite.helpers import SqliteHelpers
from lightning_nb.types import Span

__all__ = ["SqliteSpans"]

_SPAN_FIELDS = ("rollout_id", "attempt_id", "sequence_id", "name", "status", "trace_id", "span_id", "parent_id",
                "start_time", "end_time", "attributes")


class SqliteSpans(SqliteHelpers):
    """``add_span``/``add_spans``/``query_spans``, ``spans_df`` and the reward lookup of ``SqliteStore``, whose
    methods these call (declared for the type checker in :class:`~lightning_nb.store.sqlite.helpers.SqliteHelpers`)."""

    def add_span(self, span: Span) -> Span:
        check_span_types([span], batch=False)
        with self._locked(), self._tx():
            return self._add_span(span, [span], {})  # a status change it makes notifies waiters (_update)

    def add_spans(self, spans: Sequence[Span]) -> list[Span]:
        """As :meth:`LightningStore.add_spans`: one transaction (and one commit) for the batch."""
        spans = check_span_types(spans)
        if not spans:
            return []
        with self._locked(), self._tx():  # an error rolls the whole batch back
            attempts: dict[tuple[str, str], list[Any]] = {}
            out = []
            for i, span in enumerate(spans):
                try:
                    out.append(self._add_span(span, spans, attempts))
                except (NotFoundError, ConfigError, AttemptEnded) as exc:
                    raise type(exc)(f"spans[{i}]: {exc}") from None
            return out

    def _add_span(self, span: Span, batch: list[Span], attempts: dict[tuple[str, str], list[Any]]) -> Span:
        """Store one span of ``batch`` inside the caller's transaction (lock held).

        ``attempts`` caches, per (rollout, attempt) of the batch, what the rules need: the attempt's status and
        last heartbeat, its highest sequence id, and its stored spans with the batch's span ids (read once).
        """
        key = (span.rollout_id, span.attempt_id)
        state = attempts.get(key)
        if state is None:
            rows = self._rows("SELECT a.status, json_extract(a.data, '$.last_heartbeat_time'), "
                              "(SELECT COALESCE(MAX(sequence_id), 0) FROM spans WHERE attempt_id = ?1) "
                              "FROM attempts a WHERE a.attempt_id = ?1 AND a.rollout_id = ?2", *reversed(key))
            if not rows:
                self._attempt(*key)  # raises NotFoundError naming the missing id
            ids = list({s.span_id for s in batch if (s.rollout_id, s.attempt_id) == key})
            stored: dict[str, Any] = {}  # span_id -> stored JSON (or this batch's Span)
            for start in range(0, len(ids), 500):  # below SQLite's bound-parameter limit
                chunk = ids[start:start + 500]
                stored.update(self._rows(f"SELECT span_id, data FROM spans WHERE attempt_id = ? AND span_id IN "
                                         f"({', '.join('?' * len(chunk))})", key[1], *chunk))
            state = attempts[key] = [*rows[0], stored]
        status, beat, last, stored = state
        same = stored.get(span.span_id)
        if same is not None:
            return same_span(span, Span.model_validate_json(same) if isinstance(same, str) else same)
        check_span_writable(status, *key)  # a new span: the attempt must not have ended without success
        taken = span.sequence_id > 0 and bool(self._rows(
            "SELECT 1 FROM spans WHERE attempt_id = ? AND sequence_id = ?", span.attempt_id, span.sequence_id))
        new = span_with_sequence_id(span, span_sequence_id(span, last, taken))
        self._rows("INSERT INTO spans (attempt_id, sequence_id, rollout_id, name, span_id, data) "
                   "VALUES (?, ?, ?, ?, ?, ?)", new.attempt_id, new.sequence_id, new.rollout_id,
                   new.name, new.span_id, to_json(new, "span attributes"))
        state[2], stored[span.span_id] = max(last, new.sequence_id), new
        now = time.time()
        if span_beats(status, beat, now):  # a span is a sign of life: preparing -> running, heartbeat stamped
            attempt = self._attempt(*key)
            self._update(attempt, status="running", worker_id=None, error=None, heartbeat=True, now=now)
            state[0], state[1] = attempt.status, attempt.last_heartbeat_time
        return new

    def query_spans(self, rollout_id: Optional[str] = None, attempt_id: Optional[str] = None) -> list[Span]:
        with self._locked():
            return [Span.model_validate_json(data) for (data,) in self._span_rows(rollout_id, attempt_id)]

    def spans_df(self, rollout_id: Optional[str] = None, *, flatten: Flatten = None) -> pd.DataFrame:
        """As :meth:`LightningStore.spans_df`, parsing the stored JSON row by row straight into columns.

        No :class:`Span` objects and no list of every row's JSON text, so memory stays near the frame's own.
        """
        check_flatten(flatten)
        cols: dict[str, list[Any]] = {c: [] for c in _SPAN_FIELDS}
        appends = [(c, cols[c].append) for c in _SPAN_FIELDS]
        loads = from_json  # pydantic's JSON parser: faster than json.loads on span-sized documents
        with self._locked():
            for (data,) in self._span_rows(rollout_id, None):
                span = loads(data)
                for c, append in appends:
                    append(span[c])
        ids = {c: cols[c] for c in CATEGORY_COLUMNS}
        return spans_frame(ids, cols["span_id"], np.array(cols["sequence_id"], dtype=np.int64),
                           np.array(cols["start_time"], dtype=np.float64), np.array(cols["end_time"], dtype=np.float64),
                           cols["attributes"], flatten=flatten, copy=False)  # freshly parsed: the caller's own

    def _span_rows(self, rollout_id: Optional[str], attempt_id: Optional[str]) -> Iterator[tuple[str]]:
        """A cursor over the JSON of the spans :meth:`query_spans` selects, in its order (lock held)."""
        order = " ORDER BY r.seq, a.sequence_id, s.sequence_id"
        # CROSS JOIN fixes the join order (rollouts by seq, their attempts, their spans): rows come out
        # in order from the indexes, instead of SQLite sorting every span's JSON in a temporary b-tree
        sql = ("SELECT s.data FROM rollouts r CROSS JOIN attempts a ON a.rollout_id = r.rollout_id "
               "CROSS JOIN spans s ON s.attempt_id = a.attempt_id")
        if rollout_id is None:
            if attempt_id is not None:
                raise ConfigError("query_spans: attempt_id needs rollout_id; pass both or neither")
            return self._conn().execute(sql + order)
        if attempt_id is None:
            self._rollout(rollout_id)
            return self._conn().execute(sql + " WHERE r.rollout_id = ?" + order, (rollout_id,))
        if attempt_id == "latest":
            attempt_id = self._latest_attempt_id(self._rollout(rollout_id).rollout_id)
        else:
            self._attempt(rollout_id, attempt_id)
        if not attempt_id:
            return iter(())
        return self._conn().execute("SELECT s.data FROM spans s WHERE s.attempt_id = ? ORDER BY s.sequence_id",
                                    (attempt_id,))

    def _latest_attempt_rewards(self, rollout_ids: Sequence[str]) -> dict[str, list[Any]]:
        """One query instead of one per rollout (:meth:`LightningStore._latest_attempt_rewards`, same result)."""
        out: dict[str, list[Any]] = {rid: [] for rid in rollout_ids}
        if not out:
            return out
        with self._locked():
            rows = self._rows(
                "SELECT s.rollout_id, s.data FROM spans s JOIN attempts a ON a.attempt_id = s.attempt_id "
                "WHERE s.name = ? AND a.sequence_id = "
                "(SELECT MAX(sequence_id) FROM attempts WHERE rollout_id = a.rollout_id) "
                "ORDER BY s.rollout_id, s.sequence_id", REWARD_SPAN)
        for rid, data in rows:
            if rid in out:
                out[rid].append(json.loads(data)["attributes"].get(REWARD))
        return out

    def _latest_attempt_llm_calls(self, rollout_ids: Sequence[str]) -> dict[str, int]:
        """Counted in SQL, 500 rollouts a query (:meth:`LightningStore._latest_attempt_llm_calls`, same result)."""
        out = dict.fromkeys(rollout_ids, 0)
        ids = list(out)
        with self._locked():
            for start in range(0, len(ids), 500):  # below SQLite's bound-parameter limit
                chunk = ids[start:start + 500]
                out.update((rid, int(n)) for rid, n in self._rows(
                    "SELECT a.rollout_id, (SELECT COUNT(*) FROM spans s WHERE s.attempt_id = a.attempt_id AND "
                    f"s.name = ?) FROM attempts a WHERE a.rollout_id IN ({', '.join('?' * len(chunk))}) AND "
                    "a.sequence_id = (SELECT MAX(sequence_id) FROM attempts WHERE rollout_id = a.rollout_id)",
                    LLM_SPAN, *chunk))
        return out
        with self._locked():
            rows = self._rows(
                "SELECT s.rollout_id, COUNT(*) FROM spans s JOIN attempts a ON a.attempt_id = s.attempt_id "
                "WHERE s.name = ? AND a.sequence_id = "
                "(SELECT MAX(sequence_id) FROM attempts WHERE rollout_id = a.rollout_id) GROUP BY s.rollout_id",
                LLM_SPAN)
        for rid, n in rows:
            if rid in out:
                out[rid] = int(n)
        return out
