"""Durable store in one SQLite file: what a call acknowledged survives a crash.

This module holds the store's rollouts, attempts and workers, and how a write
becomes durable (one transaction per call, the WAL fsync shared by concurrent commits).
Its spans are in :mod:`lightning_nb.store.sqlite.spans`, its resources in :mod:`lightning_nb.store.sqlite.resources`,
its training record in :mod:`lightning_nb.store.sqlite.trained`; the file's schema
(:data:`MIGRATIONS`) and its one-writer lock in :mod:`lightning_nb.store.sqlite.file`.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
import weakref
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Sequence

from lightning_nb._notebook import show_progress
from lightning_nb.errors import ConfigError, InvalidStatusTransition, LightningNbError, NotFoundError
from lightning_nb.store.base import LightningStore
from lightning_nb.store.rules import (
    DEFAULT_WATCHDOG_INTERVAL_S, SweepClock, apply_attempt_update, check_manual_attempt, follow_attempt,
    new_rollout, overdue, start_attempt, updated_rollout,
    worker_on_attempt, worker_on_dequeue, worker_update,
)
from lightning_nb.store.sqlite.file import MIGRATIONS, lock_file, statements, to_json
from lightning_nb.store.sqlite.resources import SqliteResources
from lightning_nb.store.sqlite.spans import SqliteSpans
from lightning_nb.store.sqlite.trained import SqliteTrained
from lightning_nb.types import (
    ROLLOUT_TERMINAL, Attempt, AttemptedRollout, AttemptStatus, Rollout, RolloutConfig, RolloutMode, Worker,
)

__all__ = ["SqliteStore", "MIGRATIONS"]


class SqliteStore(SqliteSpans, SqliteTrained, SqliteResources, LightningStore):
    """All tables in one SQLite file; same behaviour as :class:`InMemoryStore`.

    Durability: the file is in WAL mode and every public write is one transaction,
    committed before the call returns; a write that raised left the file unchanged.
    ``synchronous`` says how far an acknowledged write is safe:

    * ``"FULL"`` (default): on disk. Before a call that wrote returns, the WAL file is
      ``fdatasync``-ed past its commit, so the write survives a crash of the process and
      of the machine or a power loss (as far as the disk honours fsync). This is SQLite's
      ``synchronous=FULL`` guarantee; it is implemented as SQLite's ``NORMAL`` plus that
      sync, done outside the store's lock so that threads committing at the same time
      share one fsync (group commit). A call that only reads also waits until what it
      read is on disk, so nothing not yet durable is ever handed out.
    * ``"NORMAL"``: in the operating system. A write that returned survives a crash or
      ``kill -9`` of the process (it is in the WAL, in the OS page cache) but the writes
      since the last checkpoint may be lost if the *machine* crashes or loses power
      before the OS writes them out; the file stays consistent either way (SQLite's
      ``synchronous=NORMAL`` in WAL mode). Several times faster when fsync is slow.

    FULL stays the default: a notebook that trains for hours should not lose finished
    rollouts to a host reboot, and group commit keeps its cost low with several runners.

    One writer per file: opening takes an exclusive lock on ``<file>.lock`` (a tiny
    file left next to the database, holding the holder's process id; ``flock`` on
    POSIX, ``msvcrt.locking`` on Windows), held until :meth:`close`, or
    until the store object is garbage-collected or its process dies (the operating
    system releases it, so a ``kill -9`` never leaves the file locked; a child made by
    ``os.fork`` without ``exec``, e.g. by multiprocessing's fork start method, shares
    the lock until it exits too). A second
    ``SqliteStore`` on the same file, in this process or another one, raises
    :class:`~lightning_nb.errors.ConfigError` naming the file, and changes nothing
    in it. To use one file from several places, share one store object, or serve it
    with :class:`~lightning_nb.store.http.server.StoreServer` and connect with
    :class:`~lightning_nb.store.http.client.StoreClient`.

    Recovery: opening an existing file (the lock proves no live store has it) marks
    every attempt still ``preparing`` or ``running`` as ``unresponsive`` (the process
    running it died), which requeues its rollout while ``num_attempts <
    config.max_attempts`` and fails it otherwise, exactly as a ``timeout`` would. The
    workers of those attempts are marked ``stopped``; their ``last_heartbeat_time``
    stays the last one they sent.

    Watchdog: callers waiting in ``dequeue_rollout``/``wait_for_rollouts`` run
    :meth:`sweep_attempts` every ``watchdog_interval_s`` seconds (see the contract).

    Thread-safe: one connection guarded by a ``threading.Condition``;
    ``dequeue_rollout`` and ``wait_for_rollouts`` wait on it without holding the lock.
    Rollout inputs, metadata and span attributes must be JSON-serializable (NaN and
    infinities come back as None).
    Use as a context manager, or call :meth:`close`.

    Raises:
        ConfigError: a bad ``synchronous``, or the file is already open in another
            ``SqliteStore`` (this process or another one).
    """

    def __init__(self, path: str | Path, *, synchronous: str = "FULL",
                 watchdog_interval_s: float = DEFAULT_WATCHDOG_INTERVAL_S) -> None:
        if synchronous not in ("FULL", "NORMAL"):
            raise ConfigError(f"synchronous must be 'FULL' (writes on disk before a call returns) or 'NORMAL' "
                              f"(writes survive a process crash, not a power loss), got {synchronous!r}")
        self._clock = SweepClock(watchdog_interval_s)
        self.path = Path(path)
        self.synchronous = synchronous
        # one lock, two conditions: runners waiting in dequeue_rollout wake when a rollout is queued (by
        # this process; other processes' rollouts are seen at the next poll), wait_for_rollouts callers
        # when a rollout's status changes
        lock = threading.RLock()
        self._cond, self._queued = threading.Condition(lock), threading.Condition(lock)
        # group commit (FULL): _commits counts COMMITs, _synced how many of them the last WAL fsync covered
        self._commits = self._synced = self._resources_commit = 0
        self._sync_lock = threading.Lock()
        self._wal_fd: Optional[int] = None
        self._db: Optional[sqlite3.Connection] = None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # one writer per file, before anything reads or writes it (a refused open changes nothing)
        self._unlock = weakref.finalize(self, os.close, lock_file(self.path))
        # isolation_level=None: no implicit transactions; _tx() issues BEGIN IMMEDIATE / COMMIT itself
        try:
            self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None, timeout=30.0)
            with self._locked():
                # SQLite's NORMAL in both modes; FULL adds our own WAL fsync per commit (see _locked)
                for pragma in ("journal_mode=WAL", "synchronous=NORMAL", "foreign_keys=ON"):
                    self._rows(f"PRAGMA {pragma}")
                if synchronous == "FULL":
                    self._open_wal()
                self._migrate()
                self._recover()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Close the file and release its lock (idempotent); later calls raise LightningNbError."""
        with self._cond, self._sync_lock:  # no fsync of the WAL is running while its fd closes
            if self._wal_fd is not None:
                if self._synced < self._commits:
                    _fdatasync(self._wal_fd)
                    self._synced = self._commits
                os.close(self._wal_fd)
                self._wal_fd = None
            if self._db is not None:
                self._db.close()
                self._db = None
            self._unlock()  # after the connection closed: the next opener finds the file at rest
            self._cond.notify_all()
            self._queued.notify_all()

    def __enter__(self) -> SqliteStore:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        extra = "" if self.synchronous == "FULL" else f", synchronous={self.synchronous!r}"
        return f"SqliteStore({str(self.path)!r}{extra})"

    # ----- rollouts -------------------------------------------------------------------
    def enqueue_rollout(self, input: Any, *, mode: RolloutMode = "train", resources_id: Optional[str] = None,
                        config: Optional[RolloutConfig] = None,
                        metadata: Optional[dict[str, Any]] = None) -> Rollout:
        rollout = new_rollout(input, mode=mode, resources_id=resources_id, config=config, metadata=metadata)
        data = to_json(rollout, "the rollout input and metadata")
        with self._locked(), self._tx():
            self._insert_rollout(rollout, data, queued=True)
            self._queued.notify()
            return rollout.model_copy()

    def enqueue_rollouts(self, inputs: Iterable[Any], *, mode: RolloutMode = "train",
                         resources_id: Optional[str] = None, config: Optional[RolloutConfig] = None,
                         metadata: Optional[dict[str, Any]] = None) -> list[Rollout]:
        """Enqueue many tasks with the same options in one transaction, in order: one commit (and with
        ``synchronous="FULL"`` one fsync) for the whole batch instead of one per task.

        All or none: an input JSON cannot carry raises ConfigError naming its index, and an unknown
        ``resources_id`` NotFoundError, before anything is stored.
        """
        rollouts = [new_rollout(x, mode=mode, resources_id=resources_id, config=config, metadata=metadata)
                    for x in inputs]
        data = [to_json(r, f"inputs[{i}] (the rollout input and metadata)") for i, r in enumerate(rollouts)]
        if not rollouts:
            return []
        with self._locked(), self._tx():
            for rollout, text in zip(rollouts, data):
                self._insert_rollout(rollout, text, queued=True)
            self._queued.notify(len(rollouts))
            return [r.model_copy() for r in rollouts]

    def start_rollout(self, input: Any, *, mode: RolloutMode = "train", resources_id: Optional[str] = None,
                      config: Optional[RolloutConfig] = None, metadata: Optional[dict[str, Any]] = None,
                      worker_id: Optional[str] = None) -> AttemptedRollout:
        rollout = new_rollout(input, mode=mode, resources_id=resources_id, config=config, metadata=metadata)
        data = to_json(rollout, "the rollout input and metadata")
        with self._locked(), self._tx():  # one transaction: nobody ever sees it queued
            self._insert_rollout(rollout, data, queued=False)
            return self._start_attempt(rollout.rollout_id, worker_id)

    def _insert_rollout(self, rollout: Rollout, data: str, *, queued: bool) -> None:
        """Insert a new rollout, at the back of the queue or outside it (lock and transaction held)."""
        if rollout.resources_id is not None:
            self._check_resources(rollout.resources_id)
        else:  # pinned to the latest set at enqueue (the contract)
            latest = self._rows("SELECT resources_id FROM resources ORDER BY seq DESC LIMIT 1")
            if latest:
                rollout.resources_id = latest[0][0]
                data = rollout.model_dump_json()
        self._rows(f"INSERT INTO rollouts (rollout_id, status, queue_pos, data) "
                   f"VALUES (?, ?, {_BACK if queued else 'NULL'}, ?)", rollout.rollout_id, rollout.status, data)

    def dequeue_rollout(self, worker_id: Optional[str] = None, timeout: float = 0.0) -> Optional[AttemptedRollout]:
        deadline = time.monotonic() + max(timeout, 0.0)
        with self._locked():
            while True:
                head = self._rows(_HEAD_SQL)  # look first: an empty poll writes nothing
                if head:  # still the head inside the transaction: the lock is held and the file is ours
                    with self._tx():
                        return self._start_attempt(head[0][0], worker_id)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._queued.wait(min(remaining, self._clock.interval_s))
                if self._clock.due():
                    self._sweep()

    def _start_attempt(self, rollout_id: str, worker_id: Optional[str]) -> AttemptedRollout:
        """Move the rollout to ``preparing`` with a fresh attempt, out of the queue (lock and transaction held)."""
        rollout = self._rollout(rollout_id)
        attempt = start_attempt(rollout, worker_id, time.time())
        self._rows("INSERT INTO attempts (attempt_id, rollout_id, sequence_id, status, data) VALUES (?, ?, ?, ?, ?)",
                   attempt.attempt_id, rollout_id, attempt.sequence_id, attempt.status, attempt.model_dump_json())
        self._save_rollout(rollout, queued=False)
        if worker_id:
            self._save_worker(worker_on_dequeue(self._worker(worker_id), attempt, time.time()))
        return AttemptedRollout(rollout=rollout, attempt=attempt)

    def get_rollout_by_id(self, rollout_id: str) -> Rollout:
        with self._locked():
            self._poll_sweep()
            return self._rollout(rollout_id)

    def query_rollouts(
        self, *, status: Optional[Sequence[str]] = None, rollout_ids: Optional[Sequence[str]] = None
    ) -> list[Rollout]:
        with self._locked():
            self._poll_sweep()
            if rollout_ids is not None:
                items = [self._rollout(rid) for rid in rollout_ids]
            else:
                items = [Rollout.model_validate_json(data) for (data,) in self._rows(
                    "SELECT data FROM rollouts ORDER BY seq")]
            return [r for r in items if status is None or r.status in status]

    def wait_for_rollouts(self, rollout_ids: Sequence[str], timeout: Optional[float] = None,
                          progress: Optional[bool] = None) -> list[Rollout]:
        if show_progress(progress):
            return self._wait_with_progress(rollout_ids, timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        ids = list(rollout_ids)
        with self._locked():
            status = self._statuses(ids)
            for rid in ids:
                if rid not in status:
                    self._rollout(rid)  # raises NotFoundError naming it
            while True:
                done = [rid for rid in ids if status[rid] in ROLLOUT_TERMINAL]
                remaining = None if deadline is None else deadline - time.monotonic()
                if len(done) == len(rollout_ids) or (remaining is not None and remaining <= 0):
                    return [self._rollout(rid) for rid in done]
                # wake up periodically so a KeyboardInterrupt in a notebook is honoured promptly
                wake = min(0.5, self._clock.interval_s)
                self._cond.wait(wake if remaining is None else min(remaining, wake))
                if self._clock.due():
                    self._sweep()
                status = self._statuses(ids)

    def _statuses(self, rollout_ids: list[str]) -> dict[str, str]:
        """rollout_id -> status of the known ones among ``rollout_ids`` (lock held; no JSON parsed)."""
        out: dict[str, str] = {}
        for i in range(0, len(rollout_ids), 500):  # below SQLite's bound-parameter limit
            chunk = rollout_ids[i:i + 500]
            out.update(self._rows(f"SELECT rollout_id, status FROM rollouts WHERE rollout_id IN "
                                  f"({', '.join('?' * len(chunk))})", *chunk))
        return out

    def cancel_rollout(self, rollout_id: str) -> Rollout:
        with self._locked(), self._tx():
            rollout = self._rollout(rollout_id)
            if rollout.status in ROLLOUT_TERMINAL:
                raise InvalidStatusTransition(f"rollout {rollout_id} is already {rollout.status}; "
                                              "only non-terminal rollouts can be cancelled")
            rollout.status = "cancelled"
            rollout.end_time = time.time()
            self._save_rollout(rollout, queued=False)
            self._cond.notify_all()
            return rollout

    def update_rollout(self, rollout_id: str, *, input: Any = None, mode: Optional[RolloutMode] = None,
                       resources_id: Optional[str] = None, config: Optional[RolloutConfig | dict] = None,
                       metadata: Optional[dict[str, Any]] = None, status: Optional[str] = None) -> Rollout:
        with self._locked(), self._tx():
            rollout = self._rollout(rollout_id)
            if resources_id is not None:
                self._check_resources(resources_id)
            new, requeue = updated_rollout(rollout, input=input, mode=mode, resources_id=resources_id, config=config,
                                           metadata=metadata, status=status, now=time.time())
            data = to_json(new, "the rollout input and metadata")
            if not requeue and new.status in ("queuing", "requeuing"):  # still waiting: keep its place in the queue
                self._rows("UPDATE rollouts SET status = ?, data = ? WHERE rollout_id = ?", new.status, data,
                           rollout_id)
            else:
                self._save_rollout(new, queued=requeue, data=data)
                if requeue:
                    self._queued.notify()
            self._cond.notify_all()
            return new

    def start_attempt(self, rollout_id: str, worker_id: Optional[str] = None) -> AttemptedRollout:
        with self._locked(), self._tx():
            rollout = self._rollout(rollout_id)
            latest = self._latest_attempt_id(rollout_id)
            check_manual_attempt(rollout, self._attempt(rollout_id, latest) if latest else None)
            if rollout.end_time is not None:  # a finished rollout runs again
                rollout.end_time = None
                self._save_rollout(rollout, queued=False)
            return self._start_attempt(rollout_id, worker_id)

    # ----- attempts -------------------------------------------------------------------
    def update_attempt(self, rollout_id: str, attempt_id: str, *, status: Optional[AttemptStatus] = None,
                       worker_id: Optional[str] = None, error: Optional[str] = None,
                       heartbeat: bool = False) -> Attempt:
        with self._locked(), self._tx():
            attempt = self._attempt(rollout_id, attempt_id)
            now = time.time()
            self._update(attempt, status=status, worker_id=worker_id, error=error, heartbeat=heartbeat, now=now)
            return attempt

    def _update(self, attempt: Attempt, *, status: Optional[str], worker_id: Optional[str], error: Optional[str],
                heartbeat: bool, now: float, by_worker: bool = True) -> None:
        """Apply one attempt update; the rollout and worker follow (lock and transaction held).

        A status change counts as a sign of life of the attempt's worker only when the
        worker made it (``by_worker``); the watchdog and recovery pass False, so a dead
        worker keeps its real ``last_heartbeat_time``.
        """
        changed = apply_attempt_update(attempt, status=status, worker_id=worker_id, error=error,
                                       heartbeat=heartbeat, now=now)
        self._save_attempt(attempt)
        if changed and self._follow(attempt, now):
            self._queued.notify()
        if attempt.worker_id:
            worker = worker_on_attempt(self._worker(attempt.worker_id), attempt, now,
                                       heartbeat=heartbeat or (changed and by_worker))
            if worker is not None:
                self._save_worker(worker)
        if changed:
            self._cond.notify_all()

    def _follow(self, attempt: Attempt, now: float) -> bool:
        """Let the rollout follow its latest attempt's new status (lock and transaction held); True if requeued."""
        rollout = self._rollout(attempt.rollout_id)
        if attempt.sequence_id != rollout.num_attempts:  # not its latest attempt (attempt k is the k-th started)
            return False
        requeue = follow_attempt(rollout, attempt.status, now)
        self._save_rollout(rollout, queued=requeue)
        return requeue

    def sweep_attempts(self) -> list[Attempt]:
        with self._locked():
            return self._sweep()

    def _poll_sweep(self) -> None:
        """The watchdog for callers that poll instead of waiting, when it is due (lock held)."""
        if self._clock.due():
            self._sweep()

    def _sweep(self) -> list[Attempt]:
        """The watchdog (lock held): end overdue attempts, one transaction each."""
        rows = self._rows("SELECT a.data, r.data FROM attempts a JOIN rollouts r ON r.rollout_id = a.rollout_id "
                          "WHERE a.status IN ('preparing', 'running') ORDER BY r.seq, a.sequence_id")
        now = time.time()
        ended = []
        for attempt_data, rollout_data in rows:
            verdict = overdue(Rollout.model_validate_json(rollout_data), Attempt.model_validate_json(attempt_data), now)
            if verdict is None:
                continue
            with self._tx():
                attempt = Attempt.model_validate_json(attempt_data)
                self._update(attempt, status=verdict[0], worker_id=None, error=verdict[1], heartbeat=False, now=now,
                             by_worker=False)
            ended.append(attempt)
        return ended

    # ----- workers --------------------------------------------------------------------
    def update_worker(self, worker_id: str, *, status: Optional[str] = None,
                      heartbeat_stats: Optional[dict[str, Any]] = None) -> Worker:
        with self._locked():
            worker = worker_update(self._worker(worker_id) if isinstance(worker_id, str) else None, worker_id,
                                   time.time(), status=status, heartbeat_stats=heartbeat_stats)
            data = to_json(worker, "heartbeat_stats")
            with self._tx():
                self._save_worker(worker, data)
            return worker

    def query_workers(self) -> list[Worker]:
        with self._locked():
            return [Worker.model_validate_json(d) for (d,) in self._rows("SELECT data FROM workers ORDER BY seq")]

    def _worker(self, worker_id: str) -> Optional[Worker]:
        rows = self._rows("SELECT data FROM workers WHERE worker_id = ?", worker_id)
        return Worker.model_validate_json(rows[0][0]) if rows else None

    def _save_worker(self, worker: Worker, data: Optional[str] = None) -> None:
        self._rows("INSERT INTO workers (worker_id, data) VALUES (?, ?) "
                   "ON CONFLICT(worker_id) DO UPDATE SET data = excluded.data",
                   worker.worker_id, data or worker.model_dump_json())

    def query_attempts(self, rollout_id: Optional[str] = None) -> list[Attempt]:
        with self._locked():
            self._poll_sweep()
            if rollout_id is not None:
                self._rollout(rollout_id)
                rows = self._rows("SELECT data FROM attempts WHERE rollout_id = ? ORDER BY sequence_id", rollout_id)
            else:
                rows = self._rows("SELECT a.data FROM attempts a JOIN rollouts r ON r.rollout_id = a.rollout_id "
                                  "ORDER BY r.seq, a.sequence_id")
            return [Attempt.model_validate_json(data) for (data,) in rows]

    # ----- opening and helpers (lock held) ---------------------------------------------
    def _migrate(self) -> None:
        """Apply the MIGRATIONS not yet recorded in ``_migrations``, in order."""
        self._rows("CREATE TABLE IF NOT EXISTS _migrations (name TEXT PRIMARY KEY, applied_at REAL)")
        for name, sql in MIGRATIONS:
            with self._tx():
                if not self._rows("SELECT 1 FROM _migrations WHERE name = ?", name):
                    for statement in statements(sql):
                        self._rows(statement)
                    self._rows("INSERT INTO _migrations (name, applied_at) VALUES (?, ?)", name, time.time())

    def _recover(self) -> None:
        """Mark attempts left in flight by a dead process ``unresponsive``, their workers ``stopped`` (one transaction).

        The workers keep their ``last_heartbeat_time`` (the last one they sent).
        """
        with self._tx():
            rows = self._rows("SELECT a.data FROM attempts a JOIN rollouts r ON r.rollout_id = a.rollout_id "
                              "WHERE a.status IN ('preparing', 'running') ORDER BY r.seq, a.sequence_id")
            now = time.time()
            dead: dict[str, None] = {}
            for (data,) in rows:
                attempt = Attempt.model_validate_json(data)
                error = (f"the store {str(self.path)!r} was reopened while this attempt was "
                         f"{attempt.status!r}: the process running it died or was killed")
                self._update(attempt, status="unresponsive", worker_id=None, error=error, heartbeat=False, now=now,
                             by_worker=False)
                if attempt.worker_id:
                    dead[attempt.worker_id] = None
            for worker_id in dead:
                worker = self._worker(worker_id)
                if worker is not None:
                    self._save_worker(worker.model_copy(update={
                        "status": "stopped", "current_rollout_id": None, "current_attempt_id": None}))

    def _rows(self, sql: str, *params: Any) -> list[Any]:
        """Run one statement; its result rows."""
        return self._conn().execute(sql, params).fetchall()

    def _conn(self) -> sqlite3.Connection:
        if self._db is None:
            raise LightningNbError(f"{self!r} is closed; open the file again with SqliteStore(path)")
        return self._db

    @contextmanager
    def _tx(self) -> Iterator[None]:
        """One write transaction: committed on success (on disk once :meth:`_locked` exits), rolled back on error."""
        db = self._conn()
        db.execute("BEGIN IMMEDIATE")
        try:
            yield
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise
        self._commits += 1

    @contextmanager
    def _locked(self, resources_only: bool = False) -> Iterator[None]:
        """Hold the lock; once it is released, wait until every commit seen under it is on disk (FULL).

        The fsync runs outside the lock, so threads that committed meanwhile share it (group commit).
        ``resources_only``: the call reads only the resources table, so it waits only for the commit of the
        last ``add_resources`` (a runner's resources lookup does not wait for other runners' span writes).
        """
        seen = 0
        try:
            with self._cond:
                try:
                    yield
                finally:
                    seen = min(self._commits, self._resources_commit) if resources_only else self._commits
        finally:
            if self._wal_fd is not None and seen > self._synced:
                self._sync_wal(seen)

    def _sync_wal(self, seen: int) -> None:
        """fdatasync the WAL so that at least the first ``seen`` commits are on disk."""
        with self._sync_lock:
            if self._synced >= seen or self._wal_fd is None:
                return
            target = self._commits  # every commit counted so far has been written to the WAL
            _fdatasync(self._wal_fd)
            self._synced = target

    def _open_wal(self) -> None:
        """Open the WAL file (SQLite made it with the WAL switch) for our own fsyncs, and sync its folder entry."""
        wal = f"{self.path}-wal"
        self._rows("SELECT COUNT(*) FROM sqlite_master")  # a read in WAL mode creates the -wal file
        self._wal_fd = os.open(wal, os.O_RDONLY)
        if os.name == "posix":  # a new file's name is durable once its folder is synced (SQLite does this too)
            folder = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(folder)
            finally:
                os.close(folder)

    def _rollout(self, rollout_id: str) -> Rollout:
        rows = self._rows("SELECT data FROM rollouts WHERE rollout_id = ?", rollout_id)
        if not rows:
            raise NotFoundError(f"rollout_id {rollout_id!r} is not in the store; list ids with store.rollouts_df()")
        return Rollout.model_validate_json(rows[0][0])

    def _save_rollout(self, rollout: Rollout, *, queued: bool, data: Optional[str] = None) -> None:
        """Write the rollout back; ``queued`` puts it at the back of the queue, else takes it out."""
        self._rows(f"UPDATE rollouts SET status = ?, data = ?, queue_pos = CASE WHEN ? THEN {_BACK} END "
                   "WHERE rollout_id = ?",
                   rollout.status, data or rollout.model_dump_json(), queued, rollout.rollout_id)

    def _attempt(self, rollout_id: str, attempt_id: str) -> Attempt:
        rows = self._rows("SELECT data FROM attempts WHERE attempt_id = ? AND rollout_id = ?", attempt_id, rollout_id)
        if not rows:  # say which id is wrong (a found attempt implies its rollout: foreign key)
            self._rollout(rollout_id)
            raise NotFoundError(f"attempt_id {attempt_id!r} is not an attempt of rollout {rollout_id!r}")
        return Attempt.model_validate_json(rows[0][0])

    def _save_attempt(self, attempt: Attempt) -> None:
        self._rows("UPDATE attempts SET status = ?, data = ? WHERE attempt_id = ?",
                   attempt.status, attempt.model_dump_json(), attempt.attempt_id)

    def _latest_attempt_id(self, rollout_id: str) -> Optional[str]:
        rows = self._rows("SELECT attempt_id FROM attempts WHERE rollout_id = ? ORDER BY sequence_id DESC LIMIT 1",
                          rollout_id)
        return rows[0][0] if rows else None


# a queue position behind every queued one (the WHERE lets MAX read the partial index rollouts_queue)
_BACK = "(SELECT COALESCE(MAX(queue_pos), 0) + 1 FROM rollouts WHERE queue_pos IS NOT NULL)"
_HEAD_SQL = ("SELECT rollout_id FROM rollouts WHERE queue_pos IS NOT NULL "
             "AND status IN ('queuing', 'requeuing') ORDER BY queue_pos LIMIT 1")

_fdatasync = getattr(os, "fdatasync", os.fsync)  # data (and size) only, as SQLite does on Linux
