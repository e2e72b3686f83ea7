"""Thread-safe in-memory store (the default)."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from typing import Any, Optional, Sequence

from lightning_nb.errors import ConfigError, InvalidStatusTransition, NotFoundError
from lightning_nb.store.base import LightningStore
from lightning_nb.store.rules import (
    apply_attempt_update, coerce_resources, follow_attempt, new_rollout, start_attempt,
)
from lightning_nb.types import (
    ROLLOUT_TERMINAL,
    Attempt,
    AttemptedRollout,
    AttemptStatus,
    ResourcesUpdate,
    Rollout,
    RolloutConfig,
    RolloutMode,
    Span,
    new_id,
)

__all__ = ["InMemoryStore"]

class InMemoryStore(LightningStore):
    """All tables in process memory behind one lock (a ``threading.Condition``).

    Calls never block on I/O while holding the lock; ``dequeue_rollout`` and
    ``wait_for_rollouts`` wait on the condition, which releases the lock.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._rollouts: OrderedDict[str, Rollout] = OrderedDict()
        self._queue: deque[str] = deque()
        self._attempts: dict[str, list[Attempt]] = {}
        self._spans: dict[str, list[Span]] = {}  # attempt_id -> spans
        self._resources: OrderedDict[str, ResourcesUpdate] = OrderedDict()

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
        rollout = new_rollout(input, mode=mode, resources_id=resources_id, config=config, metadata=metadata)
        with self._cond:
            self._add_rollout(rollout)
            self._queue.append(rollout.rollout_id)
            self._cond.notify_all()
            return rollout.model_copy()

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
        rollout = new_rollout(input, mode=mode, resources_id=resources_id, config=config, metadata=metadata)
        with self._cond:
            self._add_rollout(rollout)  # never put in self._queue
            return self._start_attempt(rollout, worker_id)

    def dequeue_rollout(self, worker_id: Optional[str] = None, timeout: float = 0.0) -> Optional[AttemptedRollout]:
        deadline = time.monotonic() + max(timeout, 0.0)
        with self._cond:
            while True:
                while self._queue:
                    rollout = self._rollouts[self._queue.popleft()]
                    if rollout.status not in ("queuing", "requeuing"):
                        continue  # cancelled while queued
                    return self._start_attempt(rollout, worker_id)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._cond.wait(remaining)

    def get_rollout_by_id(self, rollout_id: str) -> Rollout:
        with self._cond:
            return self._rollout(rollout_id).model_copy()

    def query_rollouts(
        self, *, status: Optional[Sequence[str]] = None, rollout_ids: Optional[Sequence[str]] = None
    ) -> list[Rollout]:
        with self._cond:
            if rollout_ids is not None:
                items = [self._rollout(rid) for rid in rollout_ids]
            else:
                items = list(self._rollouts.values())
            return [r.model_copy() for r in items if status is None or r.status in status]

    def wait_for_rollouts(self, rollout_ids: Sequence[str], timeout: Optional[float] = None) -> list[Rollout]:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            for rid in rollout_ids:
                self._rollout(rid)
            while True:
                done = [self._rollouts[rid] for rid in rollout_ids if self._rollouts[rid].status in ROLLOUT_TERMINAL]
                if len(done) == len(rollout_ids):
                    return [r.model_copy() for r in done]
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return [r.model_copy() for r in done]
                # wake up periodically so a KeyboardInterrupt in a notebook is honoured promptly
                self._cond.wait(0.5 if remaining is None else min(remaining, 0.5))

    def cancel_rollout(self, rollout_id: str) -> Rollout:
        with self._cond:
            rollout = self._rollout(rollout_id)
            if rollout.status in ROLLOUT_TERMINAL:
                raise InvalidStatusTransition(
                    f"rollout {rollout_id} is already {rollout.status}; only non-terminal rollouts can be cancelled"
                )
            rollout.status = "cancelled"
            rollout.end_time = time.time()
            self._cond.notify_all()
            return rollout.model_copy()

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
        with self._cond:
            rollout = self._rollout(rollout_id)
            attempt = self._attempt(rollout_id, attempt_id)
            now = time.time()
            changed = apply_attempt_update(attempt, status=status, worker_id=worker_id, error=error,
                                           heartbeat=heartbeat, now=now)
            is_latest = self._attempts[rollout_id][-1].attempt_id == attempt_id
            if changed and is_latest and follow_attempt(rollout, attempt.status, now):
                self._queue.append(rollout_id)
            self._cond.notify_all()
            return attempt.model_copy()

    def query_attempts(self, rollout_id: Optional[str] = None) -> list[Attempt]:
        with self._cond:
            if rollout_id is not None:
                self._rollout(rollout_id)
                return [a.model_copy() for a in self._attempts[rollout_id]]
            return [a.model_copy() for rid in self._rollouts for a in self._attempts[rid]]

    # ----- spans ----------------------------------------------------------------------
    def add_span(self, span: Span) -> Span:
        with self._cond:
            self._attempt(span.rollout_id, span.attempt_id)
            spans = self._spans[span.attempt_id]
            stored = span.model_copy(update={"sequence_id": len(spans) + 1})
            spans.append(stored)
            self._cond.notify_all()
            return stored.model_copy()

    def query_spans(self, rollout_id: Optional[str] = None, attempt_id: Optional[str] = None) -> list[Span]:
        with self._cond:
            if rollout_id is None:
                if attempt_id is not None:
                    raise ConfigError("query_spans: attempt_id needs rollout_id; pass both or neither")
                attempts = [a for rid in self._rollouts for a in self._attempts[rid]]
            else:
                attempts = self._attempts[self._rollout(rollout_id).rollout_id]
                if attempt_id == "latest":
                    attempts = attempts[-1:]
                elif attempt_id is not None:
                    attempts = [self._attempt(rollout_id, attempt_id)]
            return [s.model_copy() for a in attempts for s in self._spans[a.attempt_id]]

    # ----- resources ------------------------------------------------------------------
    def add_resources(self, resources: dict[str, Any], resources_id: Optional[str] = None) -> ResourcesUpdate:
        update = ResourcesUpdate(resources_id=resources_id or new_id("res"), resources=coerce_resources(resources))
        with self._cond:
            self._resources[update.resources_id] = update
            self._resources.move_to_end(update.resources_id)
            return update.model_copy()

    def get_latest_resources(self) -> Optional[ResourcesUpdate]:
        with self._cond:
            if not self._resources:
                return None
            return next(reversed(self._resources.values())).model_copy()

    def get_resources_by_id(self, resources_id: str) -> ResourcesUpdate:
        with self._cond:
            if resources_id not in self._resources:
                raise NotFoundError(f"resources_id {resources_id!r} is not in the store")
            return self._resources[resources_id].model_copy()

    # ----- helpers (lock held) --------------------------------------------------------
    def _add_rollout(self, rollout: Rollout) -> None:
        """Register a new rollout (not queued); raise NotFoundError for an unknown resources_id."""
        if rollout.resources_id is not None and rollout.resources_id not in self._resources:
            raise NotFoundError(f"resources_id {rollout.resources_id!r} is not in the store; "
                                f"add it with add_resources()")
        self._rollouts[rollout.rollout_id] = rollout
        self._attempts[rollout.rollout_id] = []

    def _start_attempt(self, rollout: Rollout, worker_id: Optional[str]) -> AttemptedRollout:
        """Move the rollout to ``preparing`` with a fresh attempt and hand out copies."""
        attempt = start_attempt(rollout, worker_id, time.time())
        self._attempts[rollout.rollout_id].append(attempt)
        self._spans[attempt.attempt_id] = []
        self._cond.notify_all()
        return AttemptedRollout(rollout=rollout.model_copy(), attempt=attempt.model_copy())

    def _rollout(self, rollout_id: str) -> Rollout:
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

