"""The rollout/attempt status machines and resource coercion, shared by every store backend.

Backends hold their own lock and persistence; these functions only decide what
changes (see the status machines in :mod:`lightning_nb.types`).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Optional, Sequence

from lightning_nb.errors import ConfigError, InvalidStatusTransition
from lightning_nb.types import (
    ATTEMPT_TERMINAL, ROLLOUT_TERMINAL, Attempt, LLMResource, PromptTemplate, Rollout, RolloutConfig, RolloutMode,
    Worker, new_id,
)

__all__ = ["ATTEMPT_NEXT", "ACTIVE", "new_rollout", "start_attempt", "apply_attempt_update", "follow_attempt",
           "coerce_resources", "overdue", "SweepClock", "worker_update", "worker_on_dequeue",
           "worker_on_attempt", "DEFAULT_WATCHDOG_INTERVAL_S", "final_reward", "reward_or_zero"]

ACTIVE = ("preparing", "running")  # attempt statuses the watchdog looks at
DEFAULT_WATCHDOG_INTERVAL_S = 0.5

ATTEMPT_NEXT: dict[str, set[str]] = {
    "preparing": {"running", "succeeded", "failed", "timeout", "unresponsive"},
    "running": {"succeeded", "failed", "timeout", "unresponsive"},
}


def new_rollout(input: Any, *, mode: RolloutMode, resources_id: Optional[str], config: Optional[RolloutConfig],
                metadata: Optional[dict[str, Any]]) -> Rollout:
    """A fresh rollout in ``queuing`` (``enqueue_rollout`` / ``start_rollout`` arguments)."""
    return Rollout(rollout_id=new_id("ro"), input=input, mode=mode, resources_id=resources_id,
                   config=config or RolloutConfig(), metadata=dict(metadata or {}))


def start_attempt(rollout: Rollout, worker_id: Optional[str], now: float) -> Attempt:
    """Move ``rollout`` to ``preparing`` in place and return its next attempt (also ``preparing``).

    Shared by ``dequeue_rollout`` and ``start_rollout``; the caller stores both.
    """
    rollout.num_attempts += 1
    rollout.status = "preparing"
    rollout.start_time = rollout.start_time or now
    return Attempt(rollout_id=rollout.rollout_id, attempt_id=new_id("at"), sequence_id=rollout.num_attempts,
                   worker_id=worker_id)


def apply_attempt_update(attempt: Attempt, *, status: Optional[str], worker_id: Optional[str],
                         error: Optional[str], heartbeat: bool, now: float) -> bool:
    """Validate and apply an ``update_attempt`` call to ``attempt`` in place.

    Returns True when the status changed (the rollout may have to follow).

    Raises:
        InvalidStatusTransition: ``status`` is not reachable from the attempt's status (nothing is changed).
    """
    changed = status is not None and status != attempt.status
    if changed and status not in ATTEMPT_NEXT.get(attempt.status, set()):
        allowed = sorted(ATTEMPT_NEXT.get(attempt.status, set()))
        raise InvalidStatusTransition(
            f"attempt {attempt.attempt_id} cannot move from {attempt.status!r} to {status!r}; "
            f"allowed: {allowed or 'none (terminal)'}"
        )
    if worker_id is not None:
        attempt.worker_id = worker_id
    if error is not None:
        attempt.error = error
    if heartbeat:
        attempt.last_heartbeat_time = now
    if changed:
        attempt.status = status  # type: ignore[assignment]
        if status in ATTEMPT_TERMINAL:
            attempt.end_time = now
    return changed


def follow_attempt(rollout: Rollout, status: str, now: float) -> bool:
    """Move ``rollout`` after its latest attempt moved to ``status``; True if it must be queued again.

    A non-succeeded terminal ``status`` requeues the rollout when it is listed in
    ``rollout.config.retry_condition`` and attempts remain; otherwise the rollout fails.
    """
    if rollout.status in ROLLOUT_TERMINAL:
        return False
    if status == "running":
        rollout.status = "running"
    elif status == "succeeded":
        rollout.status, rollout.end_time = "succeeded", now
    elif status in ("failed", "timeout", "unresponsive"):
        if status in rollout.config.retry_condition and rollout.num_attempts < rollout.config.max_attempts:
            rollout.status = "requeuing"
            return True
        rollout.status, rollout.end_time = "failed", now
    return False


def coerce_resources(resources: dict[str, Any]) -> dict[str, LLMResource | PromptTemplate]:
    """Validate a resources dict (values: LLMResource, PromptTemplate or a dict of one).

    Raises:
        ConfigError: naming the offending entry.
    """
    if not isinstance(resources, dict) or not resources:
        raise ConfigError("resources must be a non-empty dict of name -> LLMResource | PromptTemplate")
    out: dict[str, LLMResource | PromptTemplate] = {}
    for name, value in resources.items():
        if isinstance(value, (LLMResource, PromptTemplate)):
            out[name] = value
        elif isinstance(value, dict) and value.get("kind") == "prompt_template":
            out[name] = PromptTemplate(**value)
        elif isinstance(value, dict):
            out[name] = LLMResource(**value)
        else:
            raise ConfigError(
                f"resources[{name!r}] is a {type(value).__name__}; pass an LLMResource, a PromptTemplate or a dict of one"
            )
    return out


# ----- watchdog -----------------------------------------------------------------------------
def overdue(rollout: Rollout, attempt: Attempt, now: float) -> Optional[tuple[str, str]]:
    """The watchdog's verdict on one attempt: ``(status, error)`` to end it with, or None.

    An attempt still ``preparing``/``running`` is ``timeout`` once ``now - start_time``
    exceeds ``config.timeout_seconds``, else ``unresponsive`` once
    ``now - (last_heartbeat_time or start_time)`` exceeds ``config.unresponsive_seconds``.
    """
    if attempt.status not in ACTIVE:
        return None
    cfg = rollout.config
    if cfg.timeout_seconds is not None and now - attempt.start_time > cfg.timeout_seconds:
        return "timeout", (f"watchdog: attempt ran {now - attempt.start_time:.1f} s, past "
                           f"timeout_seconds={cfg.timeout_seconds}")
    last = attempt.last_heartbeat_time or attempt.start_time
    if cfg.unresponsive_seconds is not None and now - last > cfg.unresponsive_seconds:
        return "unresponsive", (f"watchdog: no heartbeat from worker {attempt.worker_id!r} for {now - last:.1f} s, "
                                f"past unresponsive_seconds={cfg.unresponsive_seconds}")
    return None


class SweepClock:
    """Rate limit for the lazy watchdog: ``due()`` is True at most once per ``interval_s`` seconds.

    Stores call ``sweep_attempts`` from their waiting loops (``dequeue_rollout``,
    ``wait_for_rollouts``) when it is due, so no extra thread is needed.
    """

    def __init__(self, interval_s: float = DEFAULT_WATCHDOG_INTERVAL_S) -> None:
        if not interval_s > 0:
            raise ConfigError(f"watchdog_interval_s must be positive seconds, got {interval_s!r}")
        self.interval_s = float(interval_s)
        self._next = 0.0
        self._lock = threading.Lock()

    def due(self) -> bool:
        now = time.monotonic()
        with self._lock:
            if now < self._next:
                return False
            self._next = now + self.interval_s
            return True


# ----- workers ------------------------------------------------------------------------------
def worker_update(worker: Optional[Worker], worker_id: str, now: float, *, status: Optional[str] = None,
                  heartbeat_stats: Optional[dict[str, Any]] = None) -> Worker:
    """An ``update_worker`` call: create the record if needed, stamp the heartbeat, set status/stats.

    Raises:
        ConfigError: ``worker_id`` is empty or ``status`` is not a worker status (nothing is changed).
    """
    if not isinstance(worker_id, str) or not worker_id:
        raise ConfigError(f"worker_id must be a non-empty string, got {worker_id!r}")
    if status is not None and status not in ("idle", "busy", "stopped", "unresponsive"):
        raise ConfigError(f"status={status!r} is not a worker status; use 'idle', 'busy' or 'stopped'")
    worker = worker.model_copy() if worker is not None else Worker(worker_id=worker_id, first_seen_time=now)
    worker.last_heartbeat_time = now
    if status is not None:
        worker.status = status  # type: ignore[assignment]
        if status in ("idle", "stopped"):
            worker.current_rollout_id = worker.current_attempt_id = None
    if heartbeat_stats is not None:
        worker.heartbeat_stats = dict(heartbeat_stats)
    return worker


def worker_on_dequeue(worker: Optional[Worker], attempt: Attempt, now: float) -> Worker:
    """The worker took ``attempt`` (``dequeue_rollout`` / ``start_rollout``): busy with it."""
    worker = worker_update(worker, attempt.worker_id or "", now, status="busy")
    worker.current_rollout_id, worker.current_attempt_id = attempt.rollout_id, attempt.attempt_id
    worker.last_dequeue_time = now
    return worker


def worker_on_attempt(worker: Optional[Worker], attempt: Attempt, now: float, *, heartbeat: bool) -> Optional[Worker]:
    """Follow an attempt update on its worker's record; None when nothing changes.

    A heartbeat stamps the worker; an attempt ending ``unresponsive`` marks the worker
    ``unresponsive``, any other end makes it ``idle`` (if that was its current attempt).
    """
    if not attempt.worker_id:
        return None
    is_current = worker is not None and worker.current_attempt_id == attempt.attempt_id
    if attempt.status in ATTEMPT_TERMINAL and is_current:
        worker = worker.model_copy()  # type: ignore[union-attr]
        worker.status = "unresponsive" if attempt.status == "unresponsive" else "idle"
        worker.current_rollout_id = worker.current_attempt_id = None
        if heartbeat:
            worker.last_heartbeat_time = now
        return worker
    if heartbeat and attempt.status not in ATTEMPT_TERMINAL:
        worker = worker_update(worker, attempt.worker_id, now)
        worker.status = "busy"
        worker.current_rollout_id, worker.current_attempt_id = attempt.rollout_id, attempt.attempt_id
        return worker
    return None


def final_reward(rollout_status: str, latest_attempt_rewards: Sequence[Any]) -> Optional[float]:
    """The one definition of a rollout's final reward; every view, metric and adapter calls this.

    Args:
        rollout_status: the rollout's status.
        latest_attempt_rewards: the ``reward`` attribute of each reward span of the
            rollout's *latest* attempt, in span order (spans of earlier attempts, for
            example ones an abandoned agent thread wrote late, never count).

    Returns:
        * ``succeeded``: the last reward span's value (a float), or None when the
          attempt has no reward span (the adapter skips such a rollout as ``no_reward``);
        * ``failed`` (including attempts that ended ``timeout``/``unresponsive`` or were
          aborted, with no retry left): ``0.0``, even if a reward span was written before
          the crash;
        * ``cancelled`` or not yet terminal: None (no final reward).

    Aggregates over finished rollouts (``evaluate()``, the step's ``reward_mean``, the
    store's HTML summary, the widgets) use :func:`reward_or_zero`, so a rollout without a
    final reward counts as 0, and skip ``cancelled`` rollouts.
    """
    if rollout_status == "failed":
        return 0.0
    if rollout_status != "succeeded":
        return None
    values = [v for v in latest_attempt_rewards if v is not None]
    return float(values[-1]) if values else None


def reward_or_zero(reward: Optional[float]) -> float:
    """A :func:`final_reward` as counted in means over finished rollouts: None counts 0.0."""
    return 0.0 if reward is None else float(reward)
