"""The rollout/attempt status machines and resource coercion, shared by every store backend.

Backends hold their own lock and persistence; these functions only decide what
changes (see the status machines in :mod:`lightning_nb.types`).
"""

from __future__ import annotations

from typing import Any, Optional

from lightning_nb.errors import ConfigError, InvalidStatusTransition
from lightning_nb.types import (
    ATTEMPT_TERMINAL, ROLLOUT_TERMINAL, Attempt, LLMResource, PromptTemplate, Rollout, RolloutConfig, RolloutMode,
    new_id,
)

__all__ = ["ATTEMPT_NEXT", "new_rollout", "start_attempt", "apply_attempt_update", "follow_attempt",
           "coerce_resources"]

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
    """Move ``rollout`` after its latest attempt moved to ``status``; True if it must be queued again."""
    if rollout.status in ROLLOUT_TERMINAL:
        return False
    if status == "running":
        rollout.status = "running"
    elif status == "succeeded":
        rollout.status, rollout.end_time = "succeeded", now
    elif status in ("failed", "timeout", "unresponsive"):
        if rollout.num_attempts < rollout.config.max_attempts:
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
