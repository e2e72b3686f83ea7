"""The store contract every backend implements.

Implementations must be safe to call from many threads at once (runners, the
LLM proxy, the algorithm and a notebook cell), must not call ``asyncio.run``
(a Jupyter kernel already runs an event loop), and must never drop data that a
call already acknowledged: a bad call raises and leaves the store unchanged.

Attempts, retries and the watchdog (the rules live once in
:mod:`lightning_nb.store.rules`; every backend applies them the same way).
Implementations must:

* requeue a rollout whose latest attempt ends in a status listed in its
  ``config.retry_condition`` while ``num_attempts < config.max_attempts``, and fail
  it otherwise (``follow_attempt``);
* run the watchdog (:meth:`sweep_attempts`, verdicts from ``rules.overdue``) at
  least every ``watchdog_interval_s`` seconds while any caller waits in
  :meth:`dequeue_rollout` or :meth:`wait_for_rollouts`, so a timed-out or silent
  attempt ends (``timeout`` / ``unresponsive``) and its rollout is requeued per its
  retry policy without any extra thread; a store server's store does this for its
  clients;
* also run the watchdog, at most every ``watchdog_interval_s`` seconds, from the calls a
  polling caller makes (``query_rollouts``, ``get_rollout_by_id``, ``query_attempts``,
  so :meth:`completed_since` too), so a caller that polls instead of waiting still sees
  a dead runner's attempt end; :class:`~lightning_nb.store.http.server.StoreServer` also
  sweeps in the background while it serves;
* keep one :class:`~lightning_nb.types.Worker` record per ``worker_id``:
  created or stamped by ``dequeue_rollout``/``start_rollout`` with a worker id,
  by ``update_attempt(..., heartbeat=True)`` on an attempt that has a worker, by a
  span of such an attempt, and by :meth:`update_worker` (rules
  ``worker_on_dequeue``/``worker_on_attempt``/``worker_update``).

Late updates to an ended attempt (the rule for ``unresponsive`` and ``timeout``):
an attempt the watchdog ended is terminal like any other and is never revived. A
late status change raises :class:`~lightning_nb.errors.InvalidStatusTransition`; a
late heartbeat changes nothing and returns the attempt, whose ``status`` tells the
runner to stop. A late span for an attempt that ended ``failed``, ``timeout`` or
``unresponsive`` is refused with :class:`~lightning_nb.errors.AttemptEnded` (an
``InvalidStatusTransition``, HTTP 409) and nothing is stored
(``rules.check_span_writable``): the late answer of an abandoned agent, e.g. a rollout
server's ``/rollout`` answer after a timeout, would otherwise add tool, reward and
agent spans to a record of something that did not happen as stored. A late span for a
``succeeded`` attempt (a label, a judge's reward) is stored and moves nothing. The
rollout has meanwhile been requeued or failed per its retry policy, so reviving the
attempt could run the task twice at once.

Spans (:meth:`add_span`): a span is a sign of life. A span for a ``preparing``
attempt moves it (and its rollout) to ``running``; any span for a running attempt
stamps its ``last_heartbeat_time`` and its worker's (at most every
:data:`~lightning_nb.store.rules.SPAN_BEAT_MIN_S` seconds per attempt). A span's
identity is its ``span_id`` within its attempt: adding the same span again (a retried
write) returns the stored one and writes nothing; a different span with a stored
``span_id`` raises ConfigError. ``sequence_id`` 0 (the default) gets the attempt's next
id; a positive one given by the caller is kept if no other span of the attempt has it
(ConfigError otherwise), and later automatic ids continue after the highest.

Resources: each ``add_resources`` write gets a ``version`` (1 for a new id, +1 for each
rewrite of the same id) and ``update_time``; the most recently written set is the
latest. A rollout enqueued (or started) without ``resources_id`` is pinned at that moment
to the latest set's id, if any, so it runs with the resources current when it was
enqueued, not when a runner picks it up; one enqueued before any resources exist keeps
``resources_id=None`` and its runner uses the latest set at its start.

Training record: which update of which learner trained on each rollout (``mark_trained``, ``query_trained``;
the rules are in :mod:`lightning_nb.store.trained`), so traffic is trained on once per store.

The DataFrame views (``rollouts_df`` ...) are built from the query methods by
:class:`~lightning_nb.store.frames.FrameViews`, which this contract mixes in, so every
backend gets them.
"""

from __future__ import annotations

import math
import numbers
import time
import uuid
from abc import ABC, abstractmethod
from typing import Any, Iterable, Optional, Sequence

from lightning_nb.errors import ConfigError, InvalidRewardError, NotFoundError
from lightning_nb.semconv import LLM_SPAN, REWARD, REWARD_NOTE, REWARD_SOURCE, REWARD_SPAN
from lightning_nb.store.frames import FrameViews
from lightning_nb.store.otel import otel_spans
from lightning_nb.store.rules import component_sums, final_reward
from lightning_nb.store.spanframe import KNOWN_ATTRIBUTES
from lightning_nb.store.trained import TrainingRecord
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
    Worker,
    html_view,
)

__all__ = ["LightningStore", "span_summary"]


class LightningStore(FrameViews, TrainingRecord, ABC):
    """Contract for rollout queue + attempt, span and resources storage.

    Status machines are documented in :mod:`lightning_nb.types`. The DataFrame views
    (``rollouts_df``, ``attempts_df``, ``resources_df``, ``workers_df``, ``episodes_df``,
    ``spans_df``, ``rewards_df``) come from :class:`~lightning_nb.store.frames.FrameViews`.
    """

    # ----- rollouts -------------------------------------------------------------------
    @abstractmethod
    def enqueue_rollout(
        self,
        input: Any,
        *,
        mode: RolloutMode = "train",
        resources_id: Optional[str] = None,
        config: Optional[RolloutConfig] = None,
        metadata: Optional[dict[str, Any]] = None,
    ) -> Rollout:
        """Add a task to the queue in status ``queuing`` and return it.

        Without ``resources_id`` the rollout is pinned to the latest resources set, if
        any (see the module docstring). Implementations must raise
        :class:`~lightning_nb.errors.NotFoundError` if ``resources_id`` is given and unknown.
        """

    @abstractmethod
    def dequeue_rollout(self, worker_id: Optional[str] = None, timeout: float = 0.0) -> Optional[AttemptedRollout]:
        """Pop the oldest ``queuing``/``requeuing`` rollout and create its next attempt.

        Waits up to ``timeout`` seconds for one to arrive; returns None if none did.
        Implementations must hand each queued rollout to exactly one caller, move it
        to ``preparing`` and create an attempt in ``preparing``.
        """

    @abstractmethod
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
        """Create a rollout and its first attempt for a caller that runs it now (online mode).

        Implementations must create the rollout and its first attempt directly in
        ``preparing`` (as one atomic write), without passing through the queue, so no
        other runner can dequeue it; the attempt records ``worker_id``. The caller then
        drives the attempt with :meth:`update_attempt` as a runner would. If that
        attempt fails while attempts remain (``config.max_attempts`` > 1) the rollout
        is requeued like any other and a runner may pick the retry up.

        Implementations must raise :class:`~lightning_nb.errors.NotFoundError` if
        ``resources_id`` is given and unknown (nothing is created then).
        """

    @abstractmethod
    def get_rollout_by_id(self, rollout_id: str) -> Rollout:
        """Return the rollout; raise NotFoundError (naming the id) if unknown."""

    @abstractmethod
    def query_rollouts(
        self, *, status: Optional[Sequence[str]] = None, rollout_ids: Optional[Sequence[str]] = None
    ) -> list[Rollout]:
        """Rollouts in enqueue order, optionally filtered by status and ids."""

    @abstractmethod
    def wait_for_rollouts(self, rollout_ids: Sequence[str], timeout: Optional[float] = None,
                          progress: Optional[bool] = None) -> list[Rollout]:
        """Block until every listed rollout is terminal or ``timeout`` seconds pass.

        Returns the rollouts that are terminal (all of them unless it timed out).
        Raises NotFoundError for an unknown id before waiting. ``progress``: a tqdm.auto bar of the finished
        rollouts, with the others' queued and running counts; None (the default): shown in a notebook kernel's
        cell, not in a script nor on another thread (:func:`lightning_nb._notebook.show_progress`).
        Implementations must delegate to :meth:`_wait_with_progress` when ``show_progress(progress)`` holds;
        the kit's own waits pass ``progress=False``.
        """

    @abstractmethod
    def cancel_rollout(self, rollout_id: str) -> Rollout:
        """Move a non-terminal rollout to ``cancelled``; a queued one is never dequeued."""

    @abstractmethod
    def update_rollout(self, rollout_id: str, *, input: Any = None, mode: Optional[RolloutMode] = None,
                       resources_id: Optional[str] = None, config: Optional[RolloutConfig | dict] = None,
                       metadata: Optional[dict[str, Any]] = None, status: Optional[str] = None) -> Rollout:
        """Change a rollout; returns it as stored. None leaves a field as it is.

        What may change when (:func:`lightning_nb.store.rules.updated_rollout`):
        ``metadata`` (replaced whole) always; ``config`` until the rollout ends (it
        applies to the running attempt's watchdog and to later attempts); ``input``,
        ``mode`` and ``resources_id`` while it waits in the queue. ``status="cancelled"``
        cancels it; ``status="queuing"`` puts a finished rollout back in the queue for one
        more attempt, and then every field may change in the same call. A call that raises leaves the store
        unchanged.

        Raises:
            NotFoundError: unknown ``rollout_id`` or ``resources_id``.
            ConfigError: an unknown ``status``/``mode`` or a bad ``config``/``metadata``.
            InvalidStatusTransition: the change is not allowed in the rollout's status.
        """

    # ----- attempts -------------------------------------------------------------------
    @abstractmethod
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
        """Change an attempt's status (and its rollout's, per the status machine).

        Implementations must raise InvalidStatusTransition when leaving a terminal
        status and NotFoundError for unknown ids. Ending the latest attempt in a status
        listed in ``config.retry_condition`` requeues the rollout while
        ``num_attempts < max_attempts``; any other non-success ends it ``failed``.
        ``heartbeat=True`` stamps ``last_heartbeat_time`` (epoch seconds) on the attempt
        and on its worker's record; a heartbeat on a terminal attempt changes nothing
        else, and the returned attempt's ``status`` tells the runner it was ended
        (e.g. by the watchdog).
        """

    @abstractmethod
    def start_attempt(self, rollout_id: str, worker_id: Optional[str] = None) -> AttemptedRollout:
        """Start a new attempt of an existing rollout now, for the caller (a manual retry).

        Works on a queued rollout (it leaves the queue, as if this caller dequeued it)
        and on a finished one (succeeded, failed or cancelled: its ``end_time`` is
        cleared), also past ``config.max_attempts``. The rollout and the attempt move to
        ``preparing``; the caller then drives the attempt with :meth:`update_attempt`.

        Raises:
            NotFoundError: unknown ``rollout_id``.
            InvalidStatusTransition: the rollout's latest attempt is still
                ``preparing``/``running`` (nothing is changed).
        """

    @abstractmethod
    def sweep_attempts(self) -> list[Attempt]:
        """Run the watchdog once now; return the attempts it ended.

        Implementations must end every ``preparing``/``running`` attempt that
        ``rules.overdue`` condemns (``timeout`` past ``timeout_seconds`` since its
        start, ``unresponsive`` past ``unresponsive_seconds`` since its last
        heartbeat), with the verdict as ``error``, and let its rollout follow exactly as
        :meth:`update_attempt` would (requeue per ``retry_condition``/``max_attempts``).
        Each ended attempt is one atomic write. Safe to call at any time from any thread.
        """

    # ----- workers --------------------------------------------------------------------
    @abstractmethod
    def update_worker(self, worker_id: str, *, status: Optional[str] = None,
                      heartbeat_stats: Optional[dict[str, Any]] = None) -> Worker:
        """Record a heartbeat from ``worker_id`` (created if new) and return its record.

        ``status`` is ``'idle'``, ``'busy'`` or ``'stopped'`` (``idle``/``stopped`` clear
        the current rollout); ``heartbeat_stats`` replaces the free-form stats dict.
        Implementations must raise ConfigError (store unchanged) for an empty
        ``worker_id`` or an unknown ``status``.
        """

    @abstractmethod
    def query_workers(self) -> list[Worker]:
        """Every worker record, first seen first."""

    @abstractmethod
    def query_attempts(self, rollout_id: Optional[str] = None) -> list[Attempt]:
        """Attempts of one rollout (or of all), oldest first."""

    # ----- spans ----------------------------------------------------------------------
    @abstractmethod
    def add_span(self, span: Span) -> Span:
        """Store a finished span and return it with its ``sequence_id`` assigned.

        Sequence ids increase by one per attempt, starting at 1, unless the caller gives
        one. The span is a heartbeat of its attempt, and a repeated ``span_id`` is either
        the same write again or refused (the rules are in the module docstring).

        Raises:
            NotFoundError: the rollout or attempt is unknown.
            ConfigError: a different span with this ``span_id`` is stored for the attempt,
                or an explicit ``sequence_id`` is negative or taken.
            AttemptEnded: a new span for an attempt that ended ``failed``, ``timeout`` or
                ``unresponsive`` (module docstring); a repeat of a stored span is still returned.
        """

    def add_spans(self, spans: Sequence[Span]) -> list[Span]:
        """Store several finished spans at once, as :meth:`add_span` would one by one, in order.

        All or nothing: every span is checked (its attempt exists; a repeated ``span_id``,
        also within ``spans``, is the same span again) before any is stored, so on an error
        the store is unchanged. One lock, transaction or request for the batch instead of
        one per span: :class:`~lightning_nb.tracing.tracer.Tracer` writes an attempt's spans this way.

        Returns:
            The stored spans, ``len(spans)`` of them, each with its ``sequence_id``.

        Raises:
            NotFoundError, ConfigError, AttemptEnded: as :meth:`add_span`; the message names the span's
                index in ``spans``.

        The three backends here are all-or-nothing; this default (for a backend of your own)
        calls :meth:`add_span` one by one, so an error leaves the spans before it stored.
        """
        return [self.add_span(s) for s in spans]  # a backend of its own: one by one, not all-or-nothing

    def add_otel_spans(self, rollout_id: str, attempt_id: str, spans: Sequence[Any]) -> list[int]:
        """Store finished OpenTelemetry spans of one attempt, as :meth:`add_spans` stores them converted.

        Each ``opentelemetry.sdk.trace.ReadableSpan`` becomes a :class:`~lightning_nb.types.Span` of
        ``rollout_id``/``attempt_id`` as :func:`lightning_nb.store.otel.span_from_otel` makes it (hex ids,
        epoch-second times, tuple attribute values as lists, the tracer's own id attributes left out), and
        the batch is stored with :meth:`add_spans`' rules (all or nothing, repeated span ids, sequence ids,
        spans as heartbeats). Nothing the caller holds is kept: the store keeps its own copy of every
        attribute. The runners' :class:`~lightning_nb.tracing.tracer.Tracer` writes an open attempt's spans
        this way; agent-lightning's store has ``add_otel_span`` for one span.

        This default converts and calls :meth:`add_spans` (one lock, transaction or request);
        ``InMemoryStore`` fills its span table straight from the OpenTelemetry spans (one attribute copy,
        no intermediate ``Span``).

        Returns:
            The ``sequence_id`` of each span, in order (a repeat of a stored span: the stored one's).

        Raises:
            ConfigError: an item of ``spans`` is not a finished OpenTelemetry span (naming ``spans[i]``),
                or as :meth:`add_spans`.
            NotFoundError: the rollout or attempt is unknown.
        """
        return [s.sequence_id for s in self.add_spans(otel_spans(rollout_id, attempt_id, spans))]

    @abstractmethod
    def query_spans(self, rollout_id: Optional[str] = None, attempt_id: Optional[str] = None) -> list[Span]:
        """Spans ordered by (rollout enqueue order, attempt, sequence_id).

        ``attempt_id="latest"`` selects the latest attempt of ``rollout_id``.
        """

    # ----- resources ------------------------------------------------------------------
    @abstractmethod
    def add_resources(self, resources: dict[str, Any], resources_id: Optional[str] = None) -> ResourcesUpdate:
        """Store a resources set; it becomes the latest. Returns the stored update.

        A new ``resources_id`` (or None: a fresh id) gets ``version`` 1; writing an existing
        id again replaces its resources and raises its ``version`` by one (rollouts pinned
        to that id run with the new content from then on).
        """

    @abstractmethod
    def query_resources(self) -> list[ResourcesUpdate]:
        """Every stored resources set, least recently written first (the last one is the latest)."""

    @abstractmethod
    def get_latest_resources(self) -> Optional[ResourcesUpdate]:
        """The most recently added resources, or None."""

    @abstractmethod
    def get_resources_by_id(self, resources_id: str) -> ResourcesUpdate:
        """Raise NotFoundError if unknown."""

    # ----- rewards and helpers (shared by all backends, built on the methods above) -----
    def reward_components(self, rollout_ids: Sequence[str]) -> dict[str, dict[str, float]]:
        """rollout_id -> {component name: sum} of the intermediate rewards (shaping terms) of its latest attempt.

        Rollouts without any are left out. Raises NotFoundError for an unknown id.
        """
        sums = {rid: component_sums(self.query_spans(rid, "latest")) for rid in rollout_ids}
        return {rid: comps for rid, comps in sums.items() if comps}

    def final_rewards(self, rollout_ids: Optional[Sequence[str]] = None) -> dict[str, Optional[float]]:
        """rollout_id -> final reward (:func:`lightning_nb.store.rules.final_reward`) of every rollout, or of ``rollout_ids``.

        None means no final reward (cancelled, not yet finished, or succeeded without a
        reward span); ``failed`` rollouts are 0.0. Raises NotFoundError for an unknown id.
        """
        rollouts = self.query_rollouts(rollout_ids=None if rollout_ids is None else list(rollout_ids))
        if rollout_ids is not None and len(rollouts) != len(set(rollout_ids)):
            missing = sorted(set(rollout_ids) - {r.rollout_id for r in rollouts})
            raise NotFoundError(f"rollout_id {missing[0]!r} is not in the store; list ids with store.rollouts_df()")
        values = self._latest_attempt_rewards([r.rollout_id for r in rollouts if r.status == "succeeded"])
        return {r.rollout_id: final_reward(r.status, values.get(r.rollout_id, [])) for r in rollouts}

    def _latest_attempt_rewards(self, rollout_ids: Sequence[str]) -> dict[str, list[Any]]:
        """rollout_id -> ``reward`` attributes of the reward spans of its latest attempt, in span order.

        Backends may override this for speed; the rule applied to it stays :func:`final_reward`.
        """
        out: dict[str, list[Any]] = {}
        for rid in rollout_ids:
            out[rid] = [s.attributes.get(REWARD) for s in self.query_spans(rid, "latest") if s.name == REWARD_SPAN]
        return out

    def llm_call_counts(self, rollout_ids: Optional[Sequence[str]] = None) -> dict[str, int]:
        """rollout_id -> how many LLM calls (:data:`~lightning_nb.semconv.LLM_SPAN` spans) its latest attempt made,
        for every rollout or for ``rollout_ids``.

        A ``succeeded`` rollout with 0 is one whose agent never called the model (``rollouts_df``'s ``no_llm_call``):
        nothing in it can be trained on. Raises NotFoundError for an unknown id.
        """
        rollouts = self.query_rollouts(rollout_ids=None if rollout_ids is None else list(rollout_ids))
        if rollout_ids is not None and len(rollouts) != len(set(rollout_ids)):
            missing = sorted(set(rollout_ids) - {r.rollout_id for r in rollouts})
            raise NotFoundError(f"rollout_id {missing[0]!r} is not in the store; list ids with store.rollouts_df()")
        return self._latest_attempt_llm_calls([r.rollout_id for r in rollouts])

    def _latest_attempt_llm_calls(self, rollout_ids: Sequence[str]) -> dict[str, int]:
        """rollout_id -> LLM spans of its latest attempt (0 without attempts); backends may override this for speed."""
        return {rid: sum(s.name == LLM_SPAN for s in self.query_spans(rid, "latest")) for rid in rollout_ids}

    def final_reward(self, rollout_id: str) -> Optional[float]:
        """Final reward of one rollout (see :meth:`final_rewards`). Raises NotFoundError for an unknown id."""
        return self.final_rewards([rollout_id])[rollout_id]

    def label(self, rollout_id: str, reward: float, *, source: str = "human", note: Optional[str] = None) -> Span:
        """Give a finished rollout its final reward after the fact: a human's label (or a judge's score).

        Writes a final reward span (:data:`~lightning_nb.semconv.REWARD_SPAN`, ``reward`` = ``reward``,
        :data:`~lightning_nb.semconv.REWARD_SOURCE` = ``source``, :data:`~lightning_nb.semconv.REWARD_NOTE` =
        ``note`` when given) on the rollout's latest attempt. The attempt has ended, so the span is a late span (module docstring):
        stored, moving no status, and counting because its attempt is the latest of a ``succeeded``
        rollout, where the last reward span is the final reward (:func:`lightning_nb.store.rules.final_reward`).
        So ``final_reward``, ``rewards_df`` and :class:`~lightning_nb.adapter.TripletAdapter` all see it, and
        labelling again replaces the earlier label (the earlier span stays stored: the history). The usual
        case is traffic (``Runner.step(task, reward_required=False)``, the proxy's ``/traffic`` route) that
        ended without a reward; a rollout that has one (the agent's) gets the label as its new final reward.
        Built on :meth:`get_rollout_by_id`, :meth:`query_attempts` and :meth:`add_span`, so every backend has it.

        Args:
            rollout_id: a ``succeeded`` rollout of this store.
            reward: a finite real number (reward units, e.g. 0.0 / 1.0).
            source: who gave it (``"human"``; ``"judge"``, ...), a non-empty str.
            note: optional text kept with the label (why this reward).

        Returns:
            The stored reward span (its ``sequence_id`` assigned).

        Raises:
            InvalidRewardError: ``reward`` is not a finite real number (bools are refused).
            ConfigError: ``source`` is not a non-empty str, ``note`` is not a str; the rollout is not
                finished yet, is ``failed`` (its final reward is 0.0 by rule, whatever a label says) or
                ``cancelled`` (no final reward by rule); the message names the status and the fix.
            NotFoundError: ``rollout_id`` is not in the store.

        A call that raises writes nothing.
        """
        if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(float(reward)):
            raise InvalidRewardError(f"reward must be a finite real number such as 0.0 or 1.0, got {reward!r} "
                                     f"({type(reward).__name__}); nothing was labelled")
        if not isinstance(source, str) or not source:
            raise ConfigError(f"source must be a non-empty str naming who gave the reward (e.g. 'human'), got "
                              f"{source!r}; nothing was labelled")
        if note is not None and not isinstance(note, str):
            raise ConfigError(f"note must be a str or None, got {type(note).__name__}; nothing was labelled")
        rollout = self.get_rollout_by_id(rollout_id)
        _check_labellable(rollout)
        attempts = self.query_attempts(rollout_id)
        now = time.time()
        attributes: dict[str, Any] = {REWARD: float(reward), REWARD_SOURCE: source}
        if note is not None:
            attributes[REWARD_NOTE] = note
        return self.add_span(Span(rollout_id=rollout_id, attempt_id=attempts[-1].attempt_id,
                                  trace_id=uuid.uuid4().hex, span_id=uuid.uuid4().hex[:16], name=REWARD_SPAN,
                                  start_time=now, end_time=now, status="ok", attributes=attributes))

    def completed_since(self, after_end_time: float) -> list[Rollout]:
        """Terminal rollouts (succeeded, failed, cancelled) whose ``end_time`` is after ``after_end_time``.

        For the algorithm that polls new completed rollouts: pass 0.0 first, then the
        largest ``end_time`` seen so far. ``after_end_time`` is float seconds since the
        epoch; the comparison is strict. Returns the rollouts oldest ``end_time`` first.
        Built on :meth:`query_rollouts`, so every backend has it.
        """
        done = self.query_rollouts(status=sorted(ROLLOUT_TERMINAL))
        fresh = [r for r in done if r.end_time is not None and r.end_time > after_end_time]
        return sorted(fresh, key=lambda r: r.end_time or 0.0)  # (every end_time is set: filtered above)

    def _wait_with_progress(self, rollout_ids: Sequence[str], timeout: Optional[float]) -> list[Rollout]:
        """:meth:`wait_for_rollouts` in slices of at most 0.5 s, updating a tqdm.auto bar of finished rollouts whose
        postfix, from the first frame, says how many of the others are queued and running (read, and the bar redrawn,
        once a second: tqdm redraws on ``update`` only as often as the rollouts finish)."""
        from tqdm.auto import tqdm

        ids = list(rollout_ids)
        deadline = None if timeout is None else time.monotonic() + timeout
        read = time.monotonic()
        with tqdm(total=len(ids), desc="rollouts", unit="rollout", postfix=self._unfinished(ids)) as bar:
            while True:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                done = self.wait_for_rollouts(ids, timeout=0.5 if left is None else min(0.5, left), progress=False)
                if len(done) == len(ids) or left == 0.0:
                    bar.set_postfix_str("0 queued, 0 running" if len(done) == len(ids) else self._unfinished(ids),
                                        refresh=False)
                    bar.update(len(done) - bar.n)
                    bar.refresh()
                    return done
                bar.update(len(done) - bar.n)
                if time.monotonic() - read >= 1.0:  # redrawn each second, so its clock moves between finishes
                    read = time.monotonic()
                    bar.set_postfix_str(self._unfinished(ids))

    def _unfinished(self, rollout_ids: list[str]) -> str:
        """``"2 queued, 3 running"``: the rollouts of ``rollout_ids`` that wait for a runner, and those one took."""
        statuses = [r.status for r in self.query_rollouts(rollout_ids=rollout_ids)]
        queued = sum(1 for s in statuses if s in ("queuing", "requeuing"))
        running = sum(1 for s in statuses if s in ("preparing", "running"))
        return f"{queued} queued, {running} running"

    def enqueue_rollouts(self, inputs: Iterable[Any], *, mode: RolloutMode = "train",
                         resources_id: Optional[str] = None, config: Optional[RolloutConfig] = None,
                         metadata: Optional[dict[str, Any]] = None) -> list[Rollout]:
        """Enqueue many tasks with the same options, in order; see :meth:`enqueue_rollout`.

        This default calls :meth:`enqueue_rollout` for each input (an unknown ``resources_id`` fails the first,
        so nothing is stored). ``SqliteStore`` enqueues the batch in one transaction (one fsync), ``StoreClient``
        in one request; ``LightningRL`` enqueues each GRPO group with one call.
        """
        return [self.enqueue_rollout(x, mode=mode, resources_id=resources_id, config=config, metadata=metadata)
                for x in inputs]

    def _repr_html_(self) -> Optional[str]:
        return html_view(self)


def _check_labellable(rollout: Rollout) -> None:
    """Raise ConfigError (naming the status and the fix) unless ``rollout`` can take a label: it ``succeeded``."""
    rid, status = rollout.rollout_id, rollout.status
    if status == "succeeded":
        return
    if status == "failed":
        why = ("its final reward is 0.0 by rule (lightning_nb.store.rules.final_reward: a failed rollout scores 0 "
               "whatever reward span it has), so a label would not count; look at its error in "
               f"store.attempts_df(), or run it again (store.start_attempt({rid!r}) or a new rollout) and label "
               "that one")
    elif status == "cancelled":
        why = "a cancelled rollout has no final reward by rule, so a label would not count; label a succeeded one"
    else:
        why = (f"it has not finished; wait for it (store.wait_for_rollouts([{rid!r}])) and label it once it "
               "succeeded")
    raise ConfigError(f"cannot label rollout_id {rid!r}: its status is {status!r}; {why}. Nothing was labelled")


def span_summary(span: Span) -> dict[str, Any]:
    """Values span exports share with :meth:`LightningStore.spans_df`: duration_s, prompt_tokens, completion_tokens, reward.

    ``duration_s`` is float seconds; the others are the raw attribute values
    (:data:`~lightning_nb.store.spanframe.KNOWN_ATTRIBUTES`) or None.
    """
    return {
        "duration_s": span.end_time - span.start_time,
        **{col: span.attributes.get(KNOWN_ATTRIBUTES[col]) for col in ("prompt_tokens", "completion_tokens", "reward")},
    }
