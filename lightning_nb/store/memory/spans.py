"""The spans of :class:`~lightning_nb.store.memory.InMemoryStore`: storing them, its memory policy, its span views.

:class:`InMemorySpans` is mixed into ``InMemoryStore``. It applies the span rules of the
contract to a batch (:func:`~lightning_nb.store.rules.span_sequence_id`,
:func:`~lightning_nb.store.rules.same_span`, spans as heartbeats), keeps spans as columns
(:class:`~lightning_nb.store.memory.spantable.SpanTable`), sheds the spans of finished rollouts
past ``max_spans`` (spilled to a :class:`~lightning_nb.store.memory.spantable.SpanSpill` file or
evicted, keeping their final rewards; the policy is in ``InMemoryStore``'s docstring) and
builds ``spans_df`` and the reward lookups straight from the columns.

Every method runs under the store's lock (or takes it), and uses the store's state that
``InMemoryStore.__init__`` sets: the rollouts and attempts (``_rollouts``, ``_attempts``,
``_rank``), the span table and its bookkeeping (``_table``, ``_spill``, ``_span_counts``,
``_span_ids``, ``_span_rollouts``, ``_spilled_rollouts``, ``_read_finished``,
``_shed_rewards``, ``evicted_spans``) and the policy (``max_spans``, ``min_span_age_s``).
"""

from __future__ import annotations

import time
from itertools import count
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Optional, Sequence

import pandas as pd

from lightning_nb.errors import AttemptEnded, ConfigError, NotFoundError
from lightning_nb.semconv import LLM_SPAN, REWARD, REWARD_SPAN
from lightning_nb.store.copies import span_with_sequence_id
from lightning_nb.store.otel import check_ids, otel_rows, span_of_row
from lightning_nb.store.rules import (SPANS_REFUSED, check_span_types, check_span_writable, same_span, span_beats,
                                      span_sequence_id)
from lightning_nb.store.spanframe import Flatten, check_flatten, frame_from_spans, spans_frame
from lightning_nb.store.memory.spantable import SpanSpill, SpanTable, cells_of, row_of, spans_from_raws
from lightning_nb.types import ROLLOUT_TERMINAL, Attempt, Rollout, Span

__all__ = ["InMemorySpans"]


class InMemorySpans:
    """``add_span``/``add_spans``/``add_otel_spans``/``query_spans``, the memory policy and the fast span views of
    ``InMemoryStore``, which sets the attributes below and has the methods declared for the type checker."""

    max_spans: Optional[int]
    min_span_age_s: float
    evicted_spans: int
    _spill: Optional[SpanSpill]
    _table: SpanTable
    _span_counts: dict[str, int]
    _span_ids: dict[str, dict[str, int]]
    _rank: dict[str, int]
    _span_rollouts: OrderedDict[str, None]
    _spilled_rollouts: set[str]
    _read_finished: set[str]
    _shed_rewards: dict[str, list[Any]]
    _shed_llm_calls: dict[str, int]
    _rollouts: OrderedDict[str, Rollout]
    _attempts: dict[str, list[Attempt]]

    if TYPE_CHECKING:  # InMemoryStore's
        @property
        def _lock(self) -> Any: ...

        def _rollout(self, rollout_id: str) -> Rollout: ...

        def _attempt(self, rollout_id: str, attempt_id: str) -> Attempt: ...

        def _update(self, rollout: Rollout, attempt: Attempt, *, status: Optional[str], worker_id: Optional[str],
                    error: Optional[str], heartbeat: bool, now: float, by_worker: bool = True) -> None: ...

    def add_span(self, span: Span) -> Span:
        return self._add_spans(check_span_types([span], batch=False), one=True)[0]

    def add_spans(self, spans: Sequence[Span]) -> list[Span]:
        return self._add_spans(check_span_types(spans), one=False)

    def _add_spans(self, spans: list[Span], one: bool) -> list[Span]:
        """``add_spans``; ``one``: for ``add_span`` (its errors name no index)."""
        prepared = [SpanTable.prepare(s) for s in spans]  # attribute copies and their cells: no lock needed
        with self._lock:
            if self._spill is not None:
                self._spill.check_open()  # it may have to spill: refuse before storing anything
            plan = self._plan_spans(spans, one)  # raises before anything is stored
            now = time.time()
            run: list[tuple[Any, ...]] = []  # consecutive new spans of one attempt (table rows): stored together
            run_attempt: Optional[Attempt] = None
            for span, prep, (attempt, seq, repeat) in zip(spans, prepared, plan):
                if repeat is not None:
                    continue
                if attempt is not run_attempt and run:
                    self._store_run(run_attempt, run, now)  # type: ignore[arg-type]
                    run = []
                run_attempt = attempt
                run.append(row_of(span, seq, prep))
            if run:
                self._store_run(run_attempt, run, now)  # type: ignore[arg-type]
            if self.max_spans is not None and len(self._table) > self.max_spans:
                self._shed()
            # no notify: nobody waits for spans (a status change above notified already)
        # each new span as the caller gave it, with its sequence id (its attributes are the caller's own;
        # the table holds a copy), made after releasing the lock
        return [span_with_sequence_id(span, seq) if repeat is None else repeat
                for span, (_, seq, repeat) in zip(spans, plan)]

    def add_otel_spans(self, rollout_id: str, attempt_id: str, spans: Sequence[Any]) -> list[int]:
        """:meth:`LightningStore.add_otel_spans`: the table's rows built straight from the OpenTelemetry spans (one
        copy of each span's attributes, made before taking the lock; no ``Span`` objects in or out). A batch that
        is not new spans of a known attempt (a repeated span id, an unknown attempt) takes :meth:`add_spans`'
        path, which applies the rules and raises its errors."""
        check_ids(rollout_id, attempt_id)
        rows = otel_rows(spans)
        if not rows:
            return []
        cells = [cells_of(row[7]) for row in rows]
        span_ids = [row[1] for row in rows]
        with self._lock:
            if self._spill is not None:
                self._spill.check_open()  # it may have to spill: refuse before storing anything
            attempt = self._attempt_for_new_spans(rollout_id, attempt_id, span_ids)
            if attempt is not None:
                first = self._span_counts[attempt_id] + 1
                self._store_run(attempt, [(*row, cell, seq) for seq, row, cell in zip(count(first), rows, cells)],
                                time.time())
                if self.max_spans is not None and len(self._table) > self.max_spans:
                    self._shed()
                return list(range(first, first + len(rows)))
        converted = [span_of_row(row, rollout_id, attempt_id) for row in rows]
        return [span.sequence_id for span in self.add_spans(converted)]

    def _store_run(self, attempt: Attempt, run: list[tuple[Any, ...]], now: float) -> None:
        """Store new spans of one attempt, :meth:`SpanTable.extend` rows (lock held); they are a sign of life of
        the attempt (rules.span_beats: one check per run, as the first span's)."""
        aid, rid = attempt.attempt_id, attempt.rollout_id
        self._table.extend(run, rid, aid, self._rank[rid], attempt.sequence_id)
        ids = self._span_ids[aid]
        for row in run:
            ids[row[1]] = row[10]
        self._span_counts[aid] = max(self._span_counts[aid], max(row[10] for row in run))
        self._span_rollouts[rid] = None
        if span_beats(attempt.status, attempt.last_heartbeat_time, now):  # a sign of life: -> running, beat
            self._update(self._rollouts[rid], attempt, status="running", worker_id=None, error=None,
                         heartbeat=True, now=now)

    def _plan_spans(self, spans: list[Span], one: bool) -> list[tuple[Attempt, int, Optional[Span]]]:
        """Check a batch of spans without storing any (lock held): per span ``(attempt, sequence id,
        the stored span when it repeats one)``. Raises as ``add_span``, naming the index for a batch."""
        plan = self._plan_one_attempt(spans)
        if plan is not None:
            return plan
        plan = []
        batch: dict[tuple[str, str], tuple[int, Span]] = {}  # (attempt, span_id) -> planned (seq, span)
        last_of: dict[str, int] = {}  # attempt -> highest sequence id, this batch's included
        found: dict[tuple[str, str], Attempt] = {}  # (rollout_id, attempt_id) -> its attempt
        for i, span in enumerate(spans):
            fields = span.__dict__
            span_id = fields["span_id"]
            try:
                key = (fields["rollout_id"], fields["attempt_id"])
                attempt = found.get(key)
                if attempt is None:
                    attempt = found[key] = self._attempt(*key)
                aid = attempt.attempt_id
                ids = self._span_ids[aid]
                planned = batch.get((aid, span_id))
                if planned is not None:  # repeated within the batch
                    seq = planned[0]
                    same_span(span, span_with_sequence_id(planned[1], seq))
                    plan.append((attempt, seq, span_with_sequence_id(span, seq)))
                    continue
                if span_id in ids:
                    plan.append((attempt, ids[span_id], self._repeated_span(span, attempt, ids[span_id])))
                    continue
                check_span_writable(attempt.status, attempt.rollout_id, aid)  # a new span: the attempt must be open
                last = last_of.get(aid, self._span_counts[aid])
                want = fields["sequence_id"]
                if want == 0:  # the common case: the store assigns the next id
                    seq = last + 1
                else:
                    taken = want > 0 and (any(a == aid and s == want for (a, _), (s, _) in batch.items())
                                          or (want <= self._span_counts[aid] and want in ids.values()))
                    seq = span_sequence_id(span, last, taken)
                last_of[aid] = max(last, seq)
                batch[(aid, span_id)] = (seq, span)
                plan.append((attempt, seq, None))
            except (NotFoundError, ConfigError, AttemptEnded) as exc:
                if one:
                    raise
                raise type(exc)(f"spans[{i}]: {exc}") from None
        return plan

    def _plan_one_attempt(self, spans: list[Span]) -> Optional[list[tuple[Attempt, int, Optional[Span]]]]:
        """:meth:`_plan_spans` for the usual batch (lock held): new spans of one known attempt, distinct span ids,
        every ``sequence_id`` 0 (the store numbers them). None for any other batch (the general plan decides)."""
        if not spans:
            return []
        fields = [span.__dict__ for span in spans]
        rid, aid = fields[0]["rollout_id"], fields[0]["attempt_id"]
        if not all(f["rollout_id"] == rid and f["attempt_id"] == aid and f["sequence_id"] == 0 for f in fields):
            return None
        attempt = self._attempt_for_new_spans(rid, aid, [f["span_id"] for f in fields])
        if attempt is None:
            return None  # the general plan raises or handles repeats
        last = self._span_counts[aid]
        return [(attempt, last + k, None) for k in range(1, len(spans) + 1)]

    def _attempt_for_new_spans(self, rollout_id: str, attempt_id: str, span_ids: list[str]) -> Optional[Attempt]:
        """The attempt when it is known and ``span_ids`` are distinct and new to it (lock held): a batch the fast
        paths store as one run; None otherwise (the general plan raises or handles repeats: an attempt that took no
        new span, rules.check_span_writable, included)."""
        attempts = self._attempts.get(rollout_id)
        attempt = next((a for a in reversed(attempts) if a.attempt_id == attempt_id), None) if attempts else None
        if attempt is None or attempt.status in SPANS_REFUSED or len(set(span_ids)) < len(span_ids) or \
                not self._span_ids[attempt_id].keys().isdisjoint(span_ids):
            return None
        return attempt

    def _repeated_span(self, span: Span, attempt: Attempt, seq: int) -> Span:
        """``add_span`` of a span id the attempt already has (lock held): the stored span, or ConfigError."""
        table = self._table
        found = [table.span(r) for r in table.by_attempt.get(attempt.attempt_id, ()) if table.seq[r] == seq]
        if not found and attempt.rollout_id in self._spilled_rollouts:
            found = [s for _, _, s in self._spill.read(attempt.rollout_id)  # type: ignore[union-attr]
                     if s.attempt_id == attempt.attempt_id and s.sequence_id == seq]
        if not found:  # evicted (no spill_path): nothing left to compare with
            return span_with_sequence_id(span, seq)
        return same_span(span, found[0])

    def _shed(self) -> None:
        """Spill or evict spans of rollouts that may leave memory, oldest first, down to 80 % of max_spans (lock held).

        The reward values and the LLM call count of each shed rollout's latest attempt are kept (``_shed_rewards``,
        ``_shed_llm_calls``).
        """
        target = len(self._table) - int(self.max_spans * 0.8)  # type: ignore[operator]
        now = time.time()
        by_attempt = self._table.by_attempt
        chosen: set[str] = set()
        freed = 0
        for rid in self._span_rollouts:
            if freed >= target:
                break
            if self._may_leave(self._rollouts[rid], now):
                chosen.add(rid)
                freed += sum(len(by_attempt.get(a.attempt_id, ())) for a in self._attempts[rid])
        if not chosen:
            return
        dropped = self._table.drop(chosen)
        for rid in chosen:
            del self._span_rollouts[rid]
        latest = {rid: self._attempts[rid][-1].attempt_id for rid in chosen}
        for _, _, span in sorted(dropped, key=lambda item: (item[0], item[1], item[2].sequence_id)):
            if span.name == REWARD_SPAN and latest[span.rollout_id] == span.attempt_id:
                self._shed_rewards.setdefault(span.rollout_id, []).append(span.attributes.get(REWARD))
            elif span.name == LLM_SPAN and latest[span.rollout_id] == span.attempt_id:
                self._shed_llm_calls[span.rollout_id] = self._shed_llm_calls.get(span.rollout_id, 0) + 1
        if self._spill is not None:
            self._spill.write(dropped)
            self._spilled_rollouts |= chosen
        else:
            self.evicted_spans += len(dropped)

    def _may_leave(self, rollout: Rollout, now: float) -> bool:
        """Whether a rollout's spans may leave memory (see the class docstring; lock held)."""
        if rollout.status not in ROLLOUT_TERMINAL:
            return False
        if rollout.rollout_id in self._read_finished or rollout.end_time is None:
            return True
        return now - rollout.end_time >= self.min_span_age_s

    def query_spans(self, rollout_id: Optional[str] = None, attempt_id: Optional[str] = None) -> list[Span]:
        with self._lock:
            if rollout_id is None:
                if attempt_id is not None:
                    raise ConfigError("query_spans: attempt_id needs rollout_id; pass both or neither")
                attempts = [a for rid in self._rollouts for a in self._attempts[rid]]
            else:
                rollout = self._rollout(rollout_id)
                attempts = self._attempts[rollout_id]
                if attempt_id == "latest":
                    attempts = attempts[-1:]
                elif attempt_id is not None:
                    attempts = [self._attempt(rollout_id, attempt_id)]
                if rollout.status in ROLLOUT_TERMINAL:
                    self._read_finished.add(rollout_id)  # read after it finished: may leave memory now
            table = self._table
            aids = [a.attempt_id for a in attempts]  # in rollout (enqueue) and attempt order
            rows = table.rows(aids)
            raws = table.raws(rows)
            if self._spilled_rollouts and (rollout_id is None or rollout_id in self._spilled_rollouts):
                wanted, spill = set(aids), self._spill
                assert spill is not None  # rollouts are spilled only with a spill file
                spilled = [((rank, aseq, s.sequence_id), s) for rank, aseq, s in spill.read(rollout_id)
                           if s.attempt_id in wanted]
            else:
                spilled = []
            # rows are in write order: the sort order unless a caller gave an attempt's spans sequence ids
            keys = [table.keys(r) for r in rows] if spilled or not table.in_order(aids) else None
        # the copies are made after releasing the lock (the table never changes a stored attribute dict)
        spans = spans_from_raws(raws)
        if keys is None:
            return spans
        items = list(zip(keys, spans)) + spilled
        items.sort(key=lambda item: item[0])
        return [s for _, s in items]

    # ----- fast views -----------------------------------------------------------------
    def spans_df(self, rollout_id: Optional[str] = None, *, flatten: Flatten = None) -> pd.DataFrame:
        """One row per span, as :meth:`LightningStore.spans_df`, built from the span columns.

        The frame is built after the lock is released, so runners are not held up.
        Spilled spans are read back from the spill file and included (slower).
        """
        check_flatten(flatten)  # before any work
        with self._lock:
            if rollout_id is None:
                rows = None
                spilled = self._spill.read() if self._spilled_rollouts else []  # type: ignore[union-attr]
            else:
                rows = self._table.rows(a.attempt_id for a in self._attempts[self._rollout(rollout_id).rollout_id])
                spilled = self._spill.read(rollout_id) if rollout_id in self._spilled_rollouts else []  # type: ignore[union-attr]
            if not spilled:
                columns = self._table.columns(rows)
            else:  # rare and slow anyway: spans as objects, in order
                table = self._table
                items = [(table.keys(r), table.span(r)) for r in (range(len(table)) if rows is None else rows)]
                items += [((rank, aseq, s.sequence_id), s) for rank, aseq, s in spilled]
        if not spilled:
            return spans_frame(**columns, flatten=flatten, copy=True)
        items.sort(key=lambda item: item[0])
        return frame_from_spans([s for _, s in items], flatten=flatten, copy=False)  # spans are copies already

    def _latest_attempt_rewards(self, rollout_ids: Sequence[str]) -> dict[str, list[Any]]:
        """Columnar fast path of :meth:`LightningStore._latest_attempt_rewards`.

        Spilled and evicted rollouts included: their rewards were kept when their spans left memory.
        """
        wanted = set(rollout_ids)
        with self._lock:
            latest = {rid: self._attempts[rid][-1].attempt_id for rid in wanted if self._attempts.get(rid)}
            table = self._table
            rows = table.rows_named(REWARD_SPAN)
            found = [(table.keys(r), table.value("rollout_id", r), table.value("attempt_id", r),
                      table.attrs[r].get(REWARD)) for r in rows]
            out: dict[str, list[Any]] = {rid: list(self._shed_rewards.get(rid, ())) for rid in wanted}
        found.sort(key=lambda item: item[0])
        for _, rid, aid, value in found:
            if rid in wanted and latest.get(rid) == aid:
                out[rid].append(value)  # after the shed ones: a span added later has a higher sequence id
        return out

    def _latest_attempt_llm_calls(self, rollout_ids: Sequence[str]) -> dict[str, int]:
        """Columnar fast path of :meth:`LightningStore._latest_attempt_llm_calls` (shed rollouts' counts kept):
        the latest attempts' rows for a few rollouts (a runner's check), the LLM rows for many (``rollouts_df``)."""
        wanted = set(rollout_ids)
        with self._lock:
            latest = {rid: self._attempts[rid][-1].attempt_id for rid in wanted if self._attempts.get(rid)}
            table, value = self._table, self._table.value
            out = {rid: self._shed_llm_calls.get(rid, 0) for rid in rollout_ids}
            if len(latest) <= 64:
                for rid, aid in latest.items():
                    out[rid] += sum(value("name", r) == LLM_SPAN for r in table.by_attempt.get(aid, ()))
                return out
            for r in table.rows_named(LLM_SPAN):
                row_rollout = value("rollout_id", r)
                if row_rollout in wanted and latest.get(row_rollout) == value("attempt_id", r):
                    out[row_rollout] += 1
        return out
