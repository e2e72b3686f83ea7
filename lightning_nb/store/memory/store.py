"""Thread-safe in-memory store (the default), with an optional bound on the spans it keeps in memory.

This module holds the rollouts, attempts, workers and resources; the spans (how a batch is
stored, the memory policy that spills or evicts them, the fast span views) are in
:mod:`lightning_nb.store.memory.spans`.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from pathlib import Path
from typing import Any, Optional, Sequence

from lightning_nb._notebook import show_progress
from lightning_nb.errors import ConfigError, InvalidStatusTransition, NotFoundError
from lightning_nb.store.base import LightningStore
from lightning_nb.store.copies import construct, deepen, snapshot
from lightning_nb.store.copies import deep_copy as _deep_copy
from lightning_nb.store.memory.locks import RunningThreadLock
from lightning_nb.store.memory.spans import InMemorySpans
from lightning_nb.store.rules import (
    ACTIVE, DEFAULT_WATCHDOG_INTERVAL_S, SweepClock, apply_attempt_update, check_manual_attempt, coerce_resources,
    follow_attempt, new_rollout, next_resources, overdue, resources_not_found, start_attempt, updated_rollout,
    worker_on_attempt, worker_on_dequeue, worker_update,
)
from lightning_nb.store.memory.spantable import SpanSpill, SpanTable
from lightning_nb.store.trained import TrainedMark, new_marks
from lightning_nb.types import (
    ROLLOUT_TERMINAL,
    Attempt,
    AttemptedRollout,
    AttemptStatus,
    ResourcesUpdate,
    Rollout,
    RolloutConfig,
    RolloutMode,
    Worker,
    new_id,
)

__all__ = ["InMemoryStore"]


class InMemoryStore(InMemorySpans, LightningStore):
    """All tables in process memory behind one lock, with two ``threading.Condition``s on it.

    Calls never block on I/O while holding the lock; ``dequeue_rollout`` and
    ``wait_for_rollouts`` wait on a condition, which releases the lock. The lock is a
    :class:`~lightning_nb.store.memory.locks.RunningThreadLock`: with many runner threads busy in store
    calls, a released lock is taken by a thread that runs, not handed to one still waiting for
    the GIL (which made every store call a GIL hand-over: 0.89–0.93 s against 0.74–0.79 s with 32
    runner threads on agent-lightning's benchmark workload, bench/README.md).

    Every rollout, attempt, span, worker and resources object the store hands out is
    a deep copy, and what it is given (inputs, config, metadata, span attributes,
    resources, worker stats) is copied in: changing a returned object, or the object you passed,
    never changes the store, and neither does changing a dict of ``spans_df``'s ``attributes``
    column.

    Spans are stored as columns (:mod:`lightning_nb.store.memory.spantable`), so
    ``spans_df()`` over a million spans builds in about a second, and over 100k spans
    whose attribute keys never repeat in well under two.

    Memory policy (bounded RSS over long runs): with ``max_spans`` set, once more than
    ``max_spans`` spans are held in memory, spans of rollouts that may leave memory,
    oldest first, leave it until at most 80 % of ``max_spans`` remain. A rollout's
    spans may leave memory once it is finished (succeeded, failed, cancelled) **and**
    either its spans were read with ``query_spans(rollout_id, ...)`` after it
    finished (the adapter reads every rollout it trains on this way), or it finished
    at least ``min_span_age_s`` seconds ago (rollouts nobody reads: failed ones, val
    rollouts). So the adapter finds the spans of a rollout it adapts within
    ``min_span_age_s`` of its end.

    * with ``spill_path``: they are written to that SQLite file (created fresh) and
      stay readable: ``query_spans``, ``spans_df``, ``rewards_df`` read them back
      (slower), so nothing is lost;
    * without ``spill_path``: they are evicted (dropped); ``evicted_spans`` counts
      them, and the span views (``query_spans``, ``spans_df``, ``rewards_df``) no
      longer show them.

    Either way rollouts and attempts are always kept (a few hundred bytes each), and
    so are the reward values of each shed rollout's latest attempt, so
    ``final_reward``, ``final_rewards`` and ``rollouts_df`` still show its reward.

    Spans of rollouts still queued or running are never spilled or evicted, nor are
    those of recently finished unread ones, so ``max_spans`` is a soft limit. Spilling
    runs inside ``add_span`` with the store's lock held (one batch write per spill).
    Call :meth:`close` (or use the store as a context manager) to close the spill file.

    Args:
        watchdog_interval_s: how often (seconds) waiting callers run the watchdog
            (:meth:`sweep_attempts`).
        max_spans: spans kept in memory before spilling/evicting; None: no limit.
        spill_path: SQLite file for spilled spans; None: evict instead.
        min_span_age_s: seconds a finished rollout's spans stay in memory unless they
            were read after it finished (see above); 0 lets every finished rollout's
            spans leave at once.

    Raises:
        ConfigError: a non-positive ``watchdog_interval_s`` or ``max_spans``, a negative
            ``min_span_age_s``, or ``spill_path`` without ``max_spans``.
    """

    def __init__(self, *, watchdog_interval_s: float = DEFAULT_WATCHDOG_INTERVAL_S, max_spans: Optional[int] = None,
                 spill_path: Optional[str | Path] = None, min_span_age_s: float = 300.0) -> None:
        if max_spans is not None and (not isinstance(max_spans, int) or max_spans < 1):
            raise ConfigError(f"max_spans must be a positive int or None (no limit), got {max_spans!r}")
        if spill_path is not None and max_spans is None:
            raise ConfigError("spill_path needs max_spans: pass max_spans=N to say when spans spill to the file")
        if not isinstance(min_span_age_s, (int, float)) or isinstance(min_span_age_s, bool) or \
                not min_span_age_s >= 0:
            raise ConfigError(f"min_span_age_s must be seconds >= 0, got {min_span_age_s!r}")
        self._clock = SweepClock(watchdog_interval_s)
        self.max_spans = max_spans
        self.min_span_age_s = float(min_span_age_s)
        self.evicted_spans = 0  # dropped for good (no spill_path)
        self._spill = SpanSpill(spill_path) if spill_path is not None else None
        self._table = SpanTable()
        self._span_counts: dict[str, int] = {}  # attempt_id -> highest sequence id so far (spilled ones included)
        self._span_ids: dict[str, dict[str, int]] = {}  # attempt_id -> span_id -> sequence_id (spans ever added)
        self._rank: dict[str, int] = {}  # rollout_id -> enqueue order
        self._span_rollouts: OrderedDict[str, None] = OrderedDict()  # rollouts with spans in memory, oldest first
        self._spilled_rollouts: set[str] = set()
        self._read_finished: set[str] = set()  # finished rollouts whose spans query_spans(rollout_id) handed out
        self._shed_rewards: dict[str, list[Any]] = {}  # rollout_id -> latest attempt's rewards of shed spans
        self._shed_llm_calls: dict[str, int] = {}  # rollout_id -> latest attempt's LLM calls among shed spans
        self._active: dict[str, Attempt] = {}  # attempt_id -> attempt still preparing/running
        self._workers: OrderedDict[str, Worker] = OrderedDict()
        # one lock, two conditions: runners waiting in dequeue_rollout are woken only when a rollout
        # is queued (one per rollout), callers of wait_for_rollouts only when a rollout's status changes
        # (RunningThreadLock: under contention only a running thread takes it; see lightning_nb/store/memory/locks.py)
        self._locks = RunningThreadLock()
        # (RunningThreadLock has what Condition uses of an RLock: acquire, release, _is_owned, _release_save...)
        self._queued = threading.Condition(self._locks)  # type: ignore[arg-type]
        self._changed = threading.Condition(self._locks)  # type: ignore[arg-type]
        self._rollouts: OrderedDict[str, Rollout] = OrderedDict()
        self._queue: deque[str] = deque()
        self._attempts: dict[str, list[Attempt]] = {}
        self._resources: OrderedDict[str, ResourcesUpdate] = OrderedDict()
        self._trained: list[TrainedMark] = []  # mark_trained, oldest first (marks are frozen: handed out as they are)

    @property
    def _lock(self) -> Any:
        """The store's lock for ``with``, per thread (:meth:`RunningThreadLock.for_this_thread`)."""
        return self._locks.for_this_thread()

    def close(self) -> None:
        """Close the spill file, if any (idempotent; without ``spill_path`` there is nothing to close).

        The file is checkpointed first, so no ``-wal``/``-shm`` file is left next to it.
        Afterwards, on a store with ``spill_path``, :meth:`add_span` and reads that need
        spilled spans (``query_spans``, ``spans_df``, ``rewards_df``) raise
        :class:`~lightning_nb.errors.LightningNbError`; rollouts, attempts, workers,
        resources and final rewards (``rollouts_df``) stay readable.
        """
        with self._lock:
            if self._spill is not None:
                self._spill.close()

    def __enter__(self) -> InMemoryStore:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ----- rollouts -------------------------------------------------------------------
    def enqueue_rollout(
        self,
        input: Any,
        *,
        mode: RolloutMode = "train",
        resources_id: Optional[str] = None,
        config: Optional[RolloutConfig] = None,
        metadata: Optional[dict[str, Any]] = None,
    ) -> Rollout:
        rollout = _own_rollout(input, mode=mode, resources_id=resources_id, config=config, metadata=metadata)
        with self._lock:
            self._add_rollout(rollout)
            self._queue.append(rollout.rollout_id)
            self._queued.notify()
            copy = snapshot(rollout)  # its own fields now; its input, config and metadata copied after the lock
        return deepen(copy)

    def start_rollout(
        self,
        input: Any,
        *,
        mode: RolloutMode = "train",
        resources_id: Optional[str] = None,
        config: Optional[RolloutConfig] = None,
        metadata: Optional[dict[str, Any]] = None,
        worker_id: Optional[str] = None,
    ) -> AttemptedRollout:
        rollout = _own_rollout(input, mode=mode, resources_id=resources_id, config=config, metadata=metadata)
        with self._lock:
            self._add_rollout(rollout)  # never put in self._queue
            item = self._start_attempt(rollout, worker_id)
        return _deepened(item)

    def dequeue_rollout(self, worker_id: Optional[str] = None, timeout: float = 0.0) -> Optional[AttemptedRollout]:
        deadline = time.monotonic() + max(timeout, 0.0)
        with self._lock:
            item = self._dequeue(worker_id, deadline)
        return None if item is None else _deepened(item)

    def _dequeue(self, worker_id: Optional[str], deadline: float) -> Optional[AttemptedRollout]:
        """``dequeue_rollout`` with the lock held, waiting on the queue's condition until ``deadline``."""
        while True:
            while self._queue:
                rollout = self._rollouts[self._queue.popleft()]
                if rollout.status not in ("queuing", "requeuing"):
                    continue  # cancelled while queued
                return self._start_attempt(rollout, worker_id)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            self._queued.wait(min(remaining, self._clock.interval_s))
            if self._clock.due():
                self._sweep()

    def get_rollout_by_id(self, rollout_id: str) -> Rollout:
        with self._lock:
            self._poll_sweep()
            copy = snapshot(self._rollout(rollout_id))
        return deepen(copy)

    def query_rollouts(
        self, *, status: Optional[Sequence[str]] = None, rollout_ids: Optional[Sequence[str]] = None
    ) -> list[Rollout]:
        with self._lock:
            self._poll_sweep()
            if rollout_ids is not None:
                items = [self._rollout(rid) for rid in rollout_ids]
            else:
                items = list(self._rollouts.values())
            copies = [snapshot(r) for r in items if status is None or r.status in status]
        return [deepen(r) for r in copies]

    def wait_for_rollouts(self, rollout_ids: Sequence[str], timeout: Optional[float] = None,
                          progress: Optional[bool] = None) -> list[Rollout]:
        if show_progress(progress):
            return self._wait_with_progress(rollout_ids, timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            for rid in rollout_ids:
                self._rollout(rid)
            while True:
                done = [r for r in map(self._rollouts.__getitem__, rollout_ids) if r.status in ROLLOUT_TERMINAL]
                remaining = None if deadline is None else deadline - time.monotonic()
                if len(done) == len(rollout_ids) or (remaining is not None and remaining <= 0):
                    copies = [snapshot(r) for r in done]
                    break
                # wake up periodically so a KeyboardInterrupt in a notebook is honoured promptly
                wake = min(0.5, self._clock.interval_s)
                self._changed.wait(wake if remaining is None else min(remaining, wake))
                if self._clock.due():
                    self._sweep()
        return [deepen(r) for r in copies]

    def cancel_rollout(self, rollout_id: str) -> Rollout:
        with self._lock:
            rollout = self._rollout(rollout_id)
            if rollout.status in ROLLOUT_TERMINAL:
                raise InvalidStatusTransition(
                    f"rollout {rollout_id} is already {rollout.status}; only non-terminal rollouts can be cancelled"
                )
            rollout.status = "cancelled"
            rollout.end_time = time.time()
            self._changed.notify_all()
            return _deep_copy(rollout)

    def update_rollout(self, rollout_id: str, *, input: Any = None, mode: Optional[RolloutMode] = None,
                       resources_id: Optional[str] = None, config: Optional[RolloutConfig | dict] = None,
                       metadata: Optional[dict[str, Any]] = None, status: Optional[str] = None) -> Rollout:
        input, config, metadata = _deep_copy(input), _deep_copy(config), _deep_copy(metadata)
        with self._lock:
            rollout = self._rollout(rollout_id)
            if resources_id is not None:
                self._resources_by_id(resources_id)
            new, requeue = updated_rollout(rollout, input=input, mode=mode, resources_id=resources_id, config=config,
                                           metadata=metadata, status=status, now=time.time())
            self._rollouts[rollout_id] = new
            if requeue:
                self._queue.append(rollout_id)
                self._queued.notify()
            self._changed.notify_all()
            return _deep_copy(new)

    # ----- attempts -------------------------------------------------------------------
    def update_attempt(
        self,
        rollout_id: str,
        attempt_id: str,
        *,
        status: Optional[AttemptStatus] = None,
        worker_id: Optional[str] = None,
        error: Optional[str] = None,
        heartbeat: bool = False,
    ) -> Attempt:
        with self._lock:
            rollout = self._rollout(rollout_id)
            attempt = self._attempt(rollout_id, attempt_id)
            self._update(rollout, attempt, status=status, worker_id=worker_id, error=error, heartbeat=heartbeat,
                         now=time.time())
            return _deep_copy(attempt)

    def _update(self, rollout: Rollout, attempt: Attempt, *, status: Optional[str], worker_id: Optional[str],
                error: Optional[str], heartbeat: bool, now: float, by_worker: bool = True) -> None:
        """Apply one attempt update and let the rollout and worker follow (lock held).

        A status change counts as a sign of life of the attempt's worker only when the
        worker made it (``by_worker``); the watchdog passes False, so a silent worker
        keeps its real ``last_heartbeat_time``.
        """
        changed = apply_attempt_update(attempt, status=status, worker_id=worker_id, error=error,
                                       heartbeat=heartbeat, now=now)
        if attempt.status not in ACTIVE:
            self._active.pop(attempt.attempt_id, None)
        is_latest = self._attempts[rollout.rollout_id][-1].attempt_id == attempt.attempt_id
        if changed and is_latest and follow_attempt(rollout, attempt.status, now):
            self._queue.append(rollout.rollout_id)
            self._queued.notify()
        if attempt.worker_id:
            worker = worker_on_attempt(self._workers.get(attempt.worker_id), attempt, now,
                                       heartbeat=heartbeat or (changed and by_worker))
            if worker is not None:
                self._workers[worker.worker_id] = worker
        if changed and is_latest:
            self._changed.notify_all()

    def start_attempt(self, rollout_id: str, worker_id: Optional[str] = None) -> AttemptedRollout:
        with self._lock:
            rollout = self._rollout(rollout_id)
            attempts = self._attempts[rollout_id]
            check_manual_attempt(rollout, attempts[-1] if attempts else None)
            rollout.end_time = None  # a finished rollout runs again; a queued one is skipped by dequeue from now on
            item = self._start_attempt(rollout, worker_id)
        return _deepened(item)

    def sweep_attempts(self) -> list[Attempt]:
        with self._lock:
            return self._sweep()

    def _poll_sweep(self) -> None:
        """The watchdog for callers that poll instead of waiting, when it is due (lock held)."""
        if self._active and self._clock.due():
            self._sweep()

    def _sweep(self) -> list[Attempt]:
        """The watchdog (lock held): end overdue attempts; copies of those ended."""
        now = time.time()
        ended = []
        for attempt in list(self._active.values()):
            rollout = self._rollouts[attempt.rollout_id]
            verdict = overdue(rollout, attempt, now)
            if verdict is not None:
                self._update(rollout, attempt, status=verdict[0], worker_id=None, error=verdict[1],
                             heartbeat=False, now=now, by_worker=False)
                ended.append(_deep_copy(attempt))
        return ended

    # ----- workers --------------------------------------------------------------------
    def update_worker(self, worker_id: str, *, status: Optional[str] = None,
                      heartbeat_stats: Optional[dict[str, Any]] = None) -> Worker:
        with self._lock:
            worker = worker_update(self._workers.get(worker_id), worker_id, time.time(), status=status,
                                   heartbeat_stats=_deep_copy(heartbeat_stats))
            self._workers[worker_id] = worker
            return _deep_copy(worker)

    def query_workers(self) -> list[Worker]:
        with self._lock:
            return [_deep_copy(w) for w in self._workers.values()]

    def query_attempts(self, rollout_id: Optional[str] = None) -> list[Attempt]:
        with self._lock:
            self._poll_sweep()
            if rollout_id is not None:
                self._rollout(rollout_id)
                return [_deep_copy(a) for a in self._attempts[rollout_id]]
            return [_deep_copy(a) for rid in self._rollouts for a in self._attempts[rid]]

    # ----- resources ------------------------------------------------------------------
    def add_resources(self, resources: dict[str, Any], resources_id: Optional[str] = None) -> ResourcesUpdate:
        update = ResourcesUpdate(resources_id=resources_id or new_id("res"),
                                 resources=_deep_copy(coerce_resources(resources)))  # not the caller's objects
        with self._lock:
            update = next_resources(update, self._resources.get(update.resources_id), time.time())
            self._resources[update.resources_id] = update
            self._resources.move_to_end(update.resources_id)
            return _deep_copy(update)

    def query_resources(self) -> list[ResourcesUpdate]:
        with self._lock:
            return [_deep_copy(u) for u in self._resources.values()]

    def get_latest_resources(self) -> Optional[ResourcesUpdate]:
        with self._lock:
            if not self._resources:
                return None
            return _deep_copy(next(reversed(self._resources.values())))

    def get_resources_by_id(self, resources_id: str) -> ResourcesUpdate:
        # no lock: one dict read, and a stored set is never changed in place (add_resources stores a new one)
        return _deep_copy(self._resources_by_id(resources_id))

    def _resources_by_id(self, resources_id: str) -> ResourcesUpdate:
        """The stored set (no copy; the lock need not be held: one dict read); NotFoundError naming the id."""
        try:
            return self._resources[resources_id]
        except KeyError:
            raise resources_not_found(resources_id) from None

    # ----- training record ------------------------------------------------------------
    def mark_trained(self, rollout_ids: Sequence[str], *, learner: str, update: int) -> list[TrainedMark]:
        marks = new_marks(list(rollout_ids), learner, update)
        with self._lock:
            for mark in marks:  # all known before any is stored
                self._rollout(mark.rollout_id)
            self._trained += marks
            return marks

    def query_trained(self, rollout_ids: Optional[Sequence[str]] = None) -> list[TrainedMark]:
        with self._lock:
            if rollout_ids is None:
                return list(self._trained)
            wanted = set(rollout_ids)
            return [m for m in self._trained if m.rollout_id in wanted]

    # ----- helpers (lock held) --------------------------------------------------------
    def _add_rollout(self, rollout: Rollout) -> None:
        """Register a new rollout (not queued), pinned to the latest resources if it names none.

        Raises NotFoundError for an unknown resources_id.
        """
        if rollout.resources_id is not None:
            self._resources_by_id(rollout.resources_id)
        elif self._resources:
            rollout.resources_id = next(reversed(self._resources))
        self._rollouts[rollout.rollout_id] = rollout
        self._attempts[rollout.rollout_id] = []
        self._rank[rollout.rollout_id] = len(self._rank)

    def _start_attempt(self, rollout: Rollout, worker_id: Optional[str]) -> AttemptedRollout:
        """Move the rollout to ``preparing`` with a fresh attempt; copies to hand out, :func:`_deepened` after
        releasing the lock."""
        now = time.time()
        attempt = start_attempt(rollout, worker_id, now)
        self._attempts[rollout.rollout_id].append(attempt)
        self._active[attempt.attempt_id] = attempt
        if worker_id:
            self._workers[worker_id] = worker_on_dequeue(self._workers.get(worker_id), attempt, now)
        self._span_counts[attempt.attempt_id] = 0
        self._span_ids[attempt.attempt_id] = {}
        return construct(AttemptedRollout, {"rollout": snapshot(rollout), "attempt": snapshot(attempt)})

    def _rollout(self, rollout_id: str) -> Rollout:
        """The stored rollout (not a copy); raise NotFoundError naming the id."""
        try:
            return self._rollouts[rollout_id]
        except KeyError:
            raise NotFoundError(
                f"rollout_id {rollout_id!r} is not in the store; list ids with store.rollouts_df()"
            ) from None

    def _attempt(self, rollout_id: str, attempt_id: str) -> Attempt:
        for attempt in self._attempts[self._rollout(rollout_id).rollout_id]:
            if attempt.attempt_id == attempt_id:
                return attempt
        raise NotFoundError(f"attempt_id {attempt_id!r} is not an attempt of rollout {rollout_id!r}")


def _deepened(item: AttemptedRollout) -> AttemptedRollout:
    """:meth:`InMemoryStore._start_attempt`'s copies made whole (after releasing the lock)."""
    deepen(item.rollout)
    deepen(item.attempt)
    return item


def _own_rollout(input: Any, *, mode: RolloutMode, resources_id: Optional[str], config: Optional[RolloutConfig],
                 metadata: Optional[dict[str, Any]]) -> Rollout:
    """``new_rollout`` holding deep copies of the caller's input, config and metadata."""
    return new_rollout(_deep_copy(input), mode=mode, resources_id=resources_id,
                       config=None if config is None else _deep_copy(config), metadata=_deep_copy(metadata))
