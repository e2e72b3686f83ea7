"""The rollout/attempt status machines and resource coercion, shared by every store backend.

Backends hold their own lock and persistence; these functions only decide what
changes (see the status machines in :mod:`lightning_nb.types`).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Mapping, Optional, Sequence

from lightning_nb.errors import AttemptEnded, ConfigError, InvalidStatusTransition, NotFoundError
from lightning_nb.semconv import INTERMEDIATE_REWARD_SPAN, JUDGE_SPAN, REWARD, REWARD_NAME, REWARD_SOURCE, REWARD_SPAN
from lightning_nb.store.copies import construct, deep_copy, put
from lightning_nb.types import (
    ATTEMPT_TERMINAL, ROLLOUT_TERMINAL, Attempt, LLMResource, PromptTemplate, ResourcesUpdate, Rollout, RolloutConfig,
    RolloutMode, Span, Worker, new_id,
)


__all__ = ["ATTEMPT_NEXT", "ACTIVE", "new_rollout", "start_attempt", "apply_attempt_update", "follow_attempt",
           "coerce_resources", "overdue", "SweepClock", "worker_update", "worker_on_dequeue",
           "worker_on_attempt", "DEFAULT_WATCHDOG_INTERVAL_S", "final_reward", "reward_or_zero",
           "updated_rollout", "check_manual_attempt", "span_beats", "span_sequence_id", "same_span",
           "resources_not_found", "check_span_writable", "SPANS_REFUSED",
           "next_resources", "SPAN_BEAT_MIN_S", "reward_component", "counted_reward_spans", "AGENT_REWARD",
           "component_sums"]

ACTIVE = ("preparing", "running")  # attempt statuses the watchdog looks at
_MODES = ("train", "val", "test")
_DEFAULT_CONFIG = RolloutConfig()
_ROLLOUT_GIVEN = {"rollout_id", "input", "mode", "resources_id", "config", "metadata"}  # what new_rollout passes
_ATTEMPT_GIVEN = {"rollout_id", "attempt_id", "sequence_id", "worker_id"}  # what start_attempt passes
DEFAULT_WATCHDOG_INTERVAL_S = 0.5
SPAN_BEAT_MIN_S = 0.25  # a span re-stamps a running attempt's heartbeat at most this often (seconds)
_SETTABLE_STATUSES = ("queuing", "cancelled")  # what update_rollout(status=...) accepts

ATTEMPT_NEXT: dict[str, set[str]] = {
    "preparing": {"running", "succeeded", "failed", "timeout", "unresponsive"},
    "running": {"succeeded", "failed", "timeout", "unresponsive"},
}


def new_rollout(input: Any, *, mode: RolloutMode, resources_id: Optional[str], config: Optional[RolloutConfig],
                metadata: Optional[dict[str, Any]]) -> Rollout:
    """A fresh rollout in ``queuing`` (``enqueue_rollout`` / ``start_rollout`` arguments).

    Raises pydantic's ``ValidationError`` (a ValueError) naming the field for a bad ``mode``,
    ``resources_id``, ``config`` or ``metadata``.
    """
    metadata = dict(metadata or {})
    if mode in _MODES and (resources_id is None or type(resources_id) is str) and \
            (config is None or type(config) is RolloutConfig) and all(type(k) is str for k in metadata):
        # what Rollout(...) would validate is valid already: build it without pydantic's validation
        return construct(Rollout, {"rollout_id": new_id("ro"), "input": input, "mode": mode, "status": "queuing",
                                   "resources_id": resources_id, "config": config or deep_copy(_DEFAULT_CONFIG),
                                   "metadata": metadata, "enqueue_time": time.time(), "start_time": None,
                                   "end_time": None, "num_attempts": 0}, _ROLLOUT_GIVEN.copy())
    return Rollout(rollout_id=new_id("ro"), input=input, mode=mode, resources_id=resources_id,
                   config=config or RolloutConfig(), metadata=metadata)


def start_attempt(rollout: Rollout, worker_id: Optional[str], now: float) -> Attempt:
    """Move ``rollout`` to ``preparing`` in place and return its next attempt (also ``preparing``).

    Shared by ``dequeue_rollout`` and ``start_rollout``; the caller stores both.
    """
    if worker_id is not None and type(worker_id) is not str:  # pydantic's error names the field
        Attempt(rollout_id=rollout.rollout_id, attempt_id="at-", sequence_id=1, worker_id=worker_id)
    put(rollout, "num_attempts", rollout.num_attempts + 1)
    put(rollout, "status", "preparing")
    put(rollout, "start_time", rollout.start_time or now)
    # the store's own values (already valid): no validation; every field given, as Attempt(...) would fill them
    return construct(Attempt, {"rollout_id": rollout.rollout_id, "attempt_id": new_id("at"),
                               "sequence_id": rollout.num_attempts, "status": "preparing", "worker_id": worker_id,
                               "start_time": time.time(), "end_time": None, "last_heartbeat_time": None,
                               "error": None}, _ATTEMPT_GIVEN.copy())


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
    if worker_id is not None and worker_id != attempt.worker_id:
        attempt.worker_id = worker_id  # the caller's value: validated
    if error is not None:
        attempt.error = error
    if heartbeat:
        put(attempt, "last_heartbeat_time", now)
    if changed:
        put(attempt, "status", status)  # checked against ATTEMPT_NEXT above
        if status in ATTEMPT_TERMINAL:
            put(attempt, "end_time", now)
    return changed


def follow_attempt(rollout: Rollout, status: str, now: float) -> bool:
    """Move ``rollout`` after its latest attempt moved to ``status``; True if it must be queued again.

    A non-succeeded terminal ``status`` requeues the rollout when it is listed in
    ``rollout.config.retry_condition`` and attempts remain; otherwise the rollout fails.
    """
    if rollout.status in ROLLOUT_TERMINAL:
        return False
    if status == "running":
        put(rollout, "status", "running")
    elif status == "succeeded":
        put(rollout, "status", "succeeded")
        put(rollout, "end_time", now)
    elif status in ("failed", "timeout", "unresponsive"):
        if status in rollout.config.retry_condition and rollout.num_attempts < rollout.config.max_attempts:
            put(rollout, "status", "requeuing")
            return True
        put(rollout, "status", "failed")
        put(rollout, "end_time", now)
    return False


def updated_rollout(rollout: Rollout, *, input: Any = None, mode: Optional[str] = None,
                    resources_id: Optional[str] = None, config: Optional[RolloutConfig | dict] = None,
                    metadata: Optional[dict[str, Any]] = None, status: Optional[str] = None,
                    now: float) -> tuple[Rollout, bool]:
    """An ``update_rollout`` call applied to a copy of ``rollout``: ``(new rollout, must it join the queue)``.

    None leaves a field as it is. The rules (the contract, :meth:`LightningStore.update_rollout`):

    * ``metadata`` (replaced whole) may change in any status;
    * ``config`` in any status but a terminal one (it applies to the running attempt's
      watchdog and to later attempts), or together with ``status="queuing"``;
    * ``input``, ``mode`` and ``resources_id`` only while the rollout waits in the queue
      (``queuing``/``requeuing``), or together with ``status="queuing"``;
    * ``status="cancelled"`` ends a non-terminal rollout (as ``cancel_rollout``);
      ``status="queuing"`` puts a finished (succeeded, failed, cancelled) rollout back in
      the queue for one more attempt (it becomes ``requeuing`` if it had attempts, and
      its ``end_time`` is cleared); on a queued rollout it changes nothing.

    The caller checks that ``resources_id`` exists.

    Raises:
        ConfigError: an unknown ``status`` or ``mode``, or a bad ``config``/``metadata``
            (nothing is changed).
        InvalidStatusTransition: the change is not allowed in the rollout's status.
    """
    if status is not None and status not in _SETTABLE_STATUSES:
        raise ConfigError(f"update_rollout: status={status!r} cannot be set; use 'cancelled' (end it) or 'queuing' "
                          f"(run it again); attempts move a rollout through its other statuses")
    if mode is not None and mode not in ("train", "val", "test"):
        raise ConfigError(f"update_rollout: mode={mode!r} is not a rollout mode; use 'train', 'val' or 'test'")
    if metadata is not None and not isinstance(metadata, dict):
        raise ConfigError(f"update_rollout: metadata must be a dict, got {type(metadata).__name__}")
    if config is not None and not isinstance(config, RolloutConfig):
        if not isinstance(config, dict):
            raise ConfigError(f"update_rollout: config must be a RolloutConfig or a dict of its fields, "
                              f"got {type(config).__name__}")
        try:
            config = RolloutConfig(**config)
        except ValueError as exc:
            raise ConfigError(f"update_rollout: config: {exc}") from None
    rid, current = rollout.rollout_id, rollout.status
    rerun = status == "queuing" and current in ROLLOUT_TERMINAL
    queued = current in ("queuing", "requeuing")
    if status == "queuing" and not (rerun or queued):
        raise InvalidStatusTransition(f"rollout {rid} is {current!r} with an attempt in flight; end that attempt "
                                      f"(update_attempt) or cancel the rollout before queuing it again")
    if status == "cancelled" and current in ROLLOUT_TERMINAL:
        raise InvalidStatusTransition(f"rollout {rid} is already {current}; only non-terminal rollouts can be "
                                      f"cancelled")
    task_fields = [name for name, value in (("input", input), ("mode", mode), ("resources_id", resources_id))
                   if value is not None]
    if task_fields and not (queued or rerun):
        raise InvalidStatusTransition(f"rollout {rid} is {current!r}: {', '.join(task_fields)} can change only while "
                                      f"it waits in the queue; pass status='queuing' as well to run it again with them")
    if config is not None and current in ROLLOUT_TERMINAL and not rerun:
        raise InvalidStatusTransition(f"rollout {rid} is {current}: config can change only before it ends, or "
                                      f"together with status='queuing'")
    new = rollout.model_copy(deep=True)
    if input is not None:
        new.input = input
    if mode is not None:
        new.mode = mode  # type: ignore[assignment]
    if resources_id is not None:
        new.resources_id = resources_id
    if config is not None:
        new.config = config.model_copy(deep=True)
    if metadata is not None:
        new.metadata = dict(metadata)
    if status == "cancelled":
        new.status, new.end_time = "cancelled", now
    if rerun:
        new.status, new.end_time = ("requeuing" if new.num_attempts else "queuing"), None
    return new, rerun


def check_manual_attempt(rollout: Rollout, latest: Optional[Attempt]) -> None:
    """Refuse ``start_attempt`` on a rollout whose latest attempt is still in flight.

    Raises:
        InvalidStatusTransition: naming the attempt in flight.
    """
    if latest is not None and latest.status in ACTIVE:
        raise InvalidStatusTransition(
            f"rollout {rollout.rollout_id} has attempt {latest.attempt_id} still {latest.status!r}; end it "
            f"(update_attempt) before starting another one")


def span_beats(status: str, last_heartbeat_time: Optional[float], now: float) -> bool:
    """Whether a span arriving for an attempt in ``status`` must update it (spans are heartbeats).

    True for an attempt still ``preparing`` (the span moves it to ``running``) and for a
    ``running`` one whose ``last_heartbeat_time`` is older than :data:`SPAN_BEAT_MIN_S`;
    never for a terminal attempt (a late span revives nothing; one for an attempt that did not succeed is
    refused, :func:`check_span_writable`).
    """
    if status == "preparing":
        return True
    if status != "running":
        return False
    return last_heartbeat_time is None or now - last_heartbeat_time >= SPAN_BEAT_MIN_S


#: attempt statuses whose attempt takes no new span: it ended without succeeding (a late span would be the record
#: of an abandoned agent's work). A ``succeeded`` attempt still takes late spans: a label, a judge's reward.
SPANS_REFUSED = ("failed", "timeout", "unresponsive")


def check_span_writable(status: str, rollout_id: str, attempt_id: str) -> None:
    """Refuse a new span for an attempt in ``status`` when that is one of :data:`SPANS_REFUSED`.

    Raises:
        AttemptEnded: naming the attempt and its status (the store is unchanged).
    """
    if status in SPANS_REFUSED:
        raise AttemptEnded(f"attempt {attempt_id} of rollout {rollout_id} already ended {status!r}: a span written "
                           f"after that (e.g. a late answer of an abandoned agent or rollout server) is refused, "
                           f"never stored on it; the rollout's retry (if any) is a new attempt")


def resources_not_found(resources_id: str) -> NotFoundError:
    """The error every backend raises for an unknown ``resources_id``."""
    return NotFoundError(f"resources_id {resources_id!r} is not in the store; add it with add_resources() "
                         f"or list the stored ones with store.resources_df()")


def span_sequence_id(span: Span, last: int, taken: bool) -> int:
    """The sequence id a new span is stored with: the next one, or the caller's explicit one.

    Args:
        span: the span to store; ``sequence_id`` 0 (the default) asks the store for the next id.
        last: the highest sequence id of the attempt so far (0 without spans).
        taken: whether another span of the attempt already has ``span.sequence_id``.

    Raises:
        ConfigError: a negative ``sequence_id``, or one another span of the attempt has.
    """
    seq = span.sequence_id
    if seq == 0:
        return last + 1
    if seq < 0 or taken:
        why = "is negative" if seq < 0 else f"is taken by another span of attempt {span.attempt_id}"
        raise ConfigError(f"span {span.span_id!r}: sequence_id={seq} {why}; leave sequence_id at 0 to let the store "
                          f"assign the next one (it would be {last + 1})")
    return seq


def check_span_types(spans: Sequence[Any], *, batch: bool = True) -> list[Span]:
    """``spans`` as a list, every item a :class:`Span` (``add_spans``; ``batch=False``: ``add_span``'s one).

    Raises:
        ConfigError: naming the first item that is not (``spans[i]``), before anything is stored.
    """
    spans = list(spans)
    for i, span in enumerate(spans):
        if not isinstance(span, Span):
            raise ConfigError(f"{f'spans[{i}]' if batch else 'span'} must be a lightning_nb.types.Span, got "
                              f"{type(span).__name__}")
    return spans


def same_span(new: Span, stored: Span) -> Span:
    """The rule for a second ``add_span`` with a ``span_id`` the attempt already has.

    An identical span (every field but ``sequence_id``, unless that was given
    explicitly) is a repeat of the same write, e.g. a retried request: ``stored`` is
    returned and nothing is written. A different span with the same id is refused.

    Raises:
        ConfigError: naming the span id (the store is unchanged).
    """
    keep = {"sequence_id"} if new.sequence_id == 0 else set()
    if new.model_dump_json(exclude=keep) == stored.model_dump_json(exclude=keep):
        return stored
    raise ConfigError(f"span_id {new.span_id!r} is already stored for attempt {new.attempt_id} "
                      f"(sequence_id {stored.sequence_id}) with other content; span ids are unique within an "
                      f"attempt: give each span its own span_id (an OpenTelemetry tracer does)")


def next_resources(update: ResourcesUpdate, previous: Optional[ResourcesUpdate], now: float) -> ResourcesUpdate:
    """``update`` (a new write of its ``resources_id``) with its version and times set from the previous write."""
    if previous is None:
        return update.model_copy(update={"version": 1, "create_time": now, "update_time": now})
    return update.model_copy(update={"version": previous.version + 1, "create_time": previous.create_time,
                                     "update_time": now})


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
            try:
                out[name] = PromptTemplate(**value)
            except ConfigError as exc:
                raise ConfigError(f"resources[{name!r}]: {exc}") from None
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
    worker = _shallow_copy(worker) if worker is not None else Worker(worker_id=worker_id, first_seen_time=now)
    put(worker, "last_heartbeat_time", now)
    if status is not None:
        put(worker, "status", status)  # checked above
        if status in ("idle", "stopped"):
            put(worker, "current_rollout_id", None)
            put(worker, "current_attempt_id", None)
    if heartbeat_stats is not None:
        worker.heartbeat_stats = dict(heartbeat_stats)
    return worker


def worker_on_dequeue(worker: Optional[Worker], attempt: Attempt, now: float) -> Worker:
    """The worker took ``attempt`` (``dequeue_rollout`` / ``start_rollout``): busy with it."""
    worker = worker_update(worker, attempt.worker_id or "", now, status="busy")
    put(worker, "current_rollout_id", attempt.rollout_id)
    put(worker, "current_attempt_id", attempt.attempt_id)
    put(worker, "last_dequeue_time", now)
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
        worker = _shallow_copy(worker)  # type: ignore[arg-type]
        put(worker, "status", "unresponsive" if attempt.status == "unresponsive" else "idle")
        put(worker, "current_rollout_id", None)
        put(worker, "current_attempt_id", None)
        if heartbeat:
            put(worker, "last_heartbeat_time", now)
        return worker
    if heartbeat and attempt.status not in ATTEMPT_TERMINAL:
        worker = worker_update(worker, attempt.worker_id, now)
        put(worker, "status", "busy")
        put(worker, "current_rollout_id", attempt.rollout_id)
        put(worker, "current_attempt_id", attempt.attempt_id)
        return worker
    return None


def _shallow_copy(worker: Worker) -> Worker:
    """``worker.model_copy()``: a new record to change (its ``heartbeat_stats`` dict shared, as that does)."""
    return construct(Worker, dict(worker.__dict__), set(worker.__pydantic_fields_set__))


#: ``rewards_df``'s component of a final-reward span that does not count and has no
#: :data:`~lightning_nb.semconv.REWARD_SOURCE`: the agent's own reward (e.g. one a judge's later reward replaced).
AGENT_REWARD = "agent"


def reward_component(span: Span, counts: bool = True) -> Optional[str]:
    """The reward component a span records, None for a span that records none:

    * a final reward span (:data:`~lightning_nb.semconv.REWARD_SPAN`): ``"final"`` when it is the one that counts
      (``counts``, see :func:`counted_reward_spans`); otherwise who gave it: its
      :data:`~lightning_nb.semconv.REWARD_SOURCE` (``"group_judge"``, ``"human"``...) or :data:`AGENT_REWARD`;
    * an intermediate reward: its :data:`~lightning_nb.semconv.REWARD_NAME` (``"intermediate"`` when unnamed);
    * an LLM judge's span (:data:`~lightning_nb.semconv.JUDGE_SPAN`) with a score: its
      :data:`~lightning_nb.semconv.REWARD_NAME` (``"judge"`` when unnamed); without a score (an unparsable
      verdict) None.
    """
    if span.name == REWARD_SPAN:
        return "final" if counts else str(span.attributes.get(REWARD_SOURCE, AGENT_REWARD))
    if span.name == INTERMEDIATE_REWARD_SPAN:
        return str(span.attributes.get(REWARD_NAME, "intermediate"))
    if span.name == JUDGE_SPAN and span.attributes.get(REWARD) is not None:
        return str(span.attributes.get(REWARD_NAME, JUDGE_SPAN))
    return None


def counted_reward_spans(spans: Sequence[Span], latest_attempt: Mapping[str, str],
                         rollout_status: Mapping[str, str]) -> set[tuple[str, str]]:
    """``(attempt_id, span_id)`` of each rollout's reward span that counts, among ``spans`` (in store order).

    :func:`final_reward`'s rule: the last final-reward span with a ``reward`` of the rollout's latest attempt
    (``latest_attempt``: rollout id -> attempt id), unless the rollout failed (its reward is 0) or was cancelled
    (none); of a rollout still running, the last one so far. Every other reward span is superseded.
    """
    last: dict[str, tuple[str, str]] = {}
    for s in spans:
        if s.name == REWARD_SPAN and s.attributes.get(REWARD) is not None \
                and latest_attempt.get(s.rollout_id) == s.attempt_id:
            last[s.rollout_id] = (s.attempt_id, s.span_id)
    return {key for rid, key in last.items() if rollout_status.get(rid) not in ("failed", "cancelled")}


def component_sums(spans: Sequence[Span]) -> dict[str, float]:
    """``{component: sum of its rewards}`` over the intermediate rewards among ``spans`` (the final reward left out)."""
    out: dict[str, float] = {}
    for s in spans:
        if s.name == INTERMEDIATE_REWARD_SPAN:
            name = reward_component(s) or "intermediate"  # (an intermediate reward always names one)
            out[name] = out.get(name, 0.0) + float(s.attributes.get(REWARD, 0.0))
    return out


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
