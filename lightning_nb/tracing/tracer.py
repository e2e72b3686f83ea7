"""OpenTelemetry tracing that writes finished spans into the store.

A runner enters :meth:`Tracer.trace_context` around each attempt; every span the
agent opens inside it (``tool_span``, ``emit_reward``, or any OpenTelemetry
instrumentation using this tracer's provider) is tagged with the rollout and
attempt ids and written to the store by :class:`StoreSpanProcessor`: in batches
while the runner has the attempt open (when it closes, and at most ``span_flush_s``
after a span ends), otherwise as it ends. The LLM proxy opens its spans with
explicit ids (it serves other threads).

Lost spans
----------
A span the store refuses with a transient error (a ``StoreClient`` whose server is
briefly unreachable, a locked database, ...) is written again, ``span_tries`` times in
all with a short backoff; errors that cannot heal (``NotFoundError``, ``ConfigError``)
are not retried. A batch of spans is retried the same way, then written span by span,
each with its own tries, so one span the store refuses does not take the batch with
it. A span still not stored is never raised into the agent: it is
logged and, if its attempt is open in the tracer's :class:`SpanLedger` (the runner
opens each attempt it runs with :meth:`Tracer.open_attempt`), recorded there, so the
runner ends that attempt ``failed`` with the span's name and the reason instead of
``succeeded`` with data missing. The ledger also counts the reward spans stored per
open attempt (how the runner tells an agent that forgot its reward).
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import math
import numbers
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.trace import Span as OtelSpan

from lightning_nb import semconv
from lightning_nb.errors import (ConfigError, InvalidRewardError, InvalidStatusTransition, LightningNbError,
                                 NotFoundError)
from lightning_nb.store.base import LightningStore
from lightning_nb.store.otel import span_from_otel
from lightning_nb.tracing.ids import PrivateIdGenerator

__all__ = ["Tracer", "StoreSpanProcessor", "SpanLedger", "AttemptSpans", "emit_reward", "emit_intermediate_reward",
           "tool_span", "attempt_span", "span_from_otel"]

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class _Active:
    tracer: "Tracer"
    rollout_id: str
    attempt_id: str


_ACTIVE: contextvars.ContextVar[Optional[_Active]] = contextvars.ContextVar("lightning_nb_active", default=None)


@dataclass
class AttemptSpans:
    """What the tracer saw of one attempt's spans (:meth:`SpanLedger.close`).

    Attributes:
        rewards_stored: final-reward spans (:data:`~lightning_nb.semconv.REWARD_SPAN`) written to the store.
        judge_errors: LLM-judge spans (:data:`~lightning_nb.semconv.JUDGE_SPAN`) written with an error (a verdict
            without a usable score, a failed judge call): the judge gave no score.
        lost: one line per span that could not be stored, naming the span and the reason.
    """

    rewards_stored: int = 0
    judge_errors: int = 0
    lost: list[str] = field(default_factory=list)


class SpanLedger:
    """Thread-safe record of the spans of the attempts a runner has open: ``(rollout_id, attempt_id) -> AttemptSpans``.

    Only open attempts are recorded (:meth:`open` ... :meth:`close`), so spans written
    for anything else (the LLM proxy's, an abandoned agent's late ones) never pile up here.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[tuple[str, str], AttemptSpans] = {}

    def open(self, rollout_id: str, attempt_id: str) -> None:
        with self._lock:
            self._open.setdefault((rollout_id, attempt_id), AttemptSpans())

    def close(self, rollout_id: str, attempt_id: str) -> AttemptSpans:
        """Stop recording the attempt and return what was recorded (empty if it was not open)."""
        with self._lock:
            return self._open.pop((rollout_id, attempt_id), None) or AttemptSpans()

    def stored(self, rollout_id: str, attempt_id: str, name: str, attributes: Any = None) -> None:
        """Count a span written to the store: a final reward, or a judge span with an error."""
        with self._lock:
            rec = self._open.get((rollout_id, attempt_id))
            if rec is None:
                return
            if name == semconv.REWARD_SPAN:
                rec.rewards_stored += 1
            elif name == semconv.JUDGE_SPAN and attributes and semconv.ERROR in attributes:
                rec.judge_errors += 1

    def lost(self, rollout_id: str, attempt_id: str, reason: str) -> bool:
        """Record a lost span; False when the attempt is not open (nobody will look)."""
        with self._lock:
            rec = self._open.get((rollout_id, attempt_id))
            if rec is not None:
                rec.lost.append(reason)
            return rec is not None

    def __len__(self) -> int:
        with self._lock:
            return len(self._open)


# Errors a retry cannot heal: the attempt is gone, or the span itself is invalid.
_PERMANENT = (NotFoundError, ConfigError, InvalidStatusTransition)  # AttemptEnded: a late span is refused

# (id(store), rollout_id, attempt_id) -> the processor buffering that open attempt's spans. A span another processor
# of this process ends for the attempt (the LLM proxy's, whose Tracer is its own) joins that buffer, so the store
# numbers the attempt's spans (sequence_id) in the order they ended, as when every span was written as it ended.
# Weak values: an attempt never closed (an abandoned runner) keeps no tracer, or its store, alive.
_BUFFERING: "weakref.WeakValueDictionary[tuple[int, str, str], StoreSpanProcessor]" = weakref.WeakValueDictionary()
_BUFFERING_LOCK = threading.Lock()


class _Batch:
    """The finished OpenTelemetry spans of one open attempt not yet written, and the lock its writes hold."""

    __slots__ = ("lock", "spans", "since")

    def __init__(self) -> None:
        self.lock = threading.Lock()  # held while this attempt's spans are written: close waits for a flush
        self.spans: list[ReadableSpan] = []
        self.since = 0.0  # time.monotonic() of the oldest buffered span


class StoreSpanProcessor(SpanProcessor):
    """Tags spans with the active rollout/attempt on start and stores them on end.

    The spans of an attempt opened with :meth:`open` (a runner's attempts) are kept as the
    finished OpenTelemetry spans and written in batches with
    :meth:`LightningStore.add_otel_spans` (which converts them: ``InMemoryStore`` builds its rows
    straight from them), as OpenTelemetry's ``BatchSpanProcessor`` exports: when :meth:`close`
    ends the attempt, when ``max_batch`` spans wait, and at most ``flush_s`` seconds after a
    span ended (by the next span or a background thread). A batch of one span, and each span
    of a batch the store refused, is converted here and written with ``add_span``.
    One lock, SQLite commit or HTTP request per batch instead of per span. A span another
    processor of this process ends for an attempt open here, on the same store object (the
    LLM proxy's spans of a runner's call), joins this attempt's buffer, so the store still
    numbers an attempt's spans (``sequence_id``) in the order they ended. Every other span
    (late ones, those of attempts run in another process) is written as it ends.
    ``flush_s=0`` writes every span as it ends.

    The background thread (``lightning-nb-span-flush``) runs only while spans wait: a span
    buffered when none runs starts it, and it ends at the first tick (every ``flush_s``) that
    finds nothing buffered, or at :meth:`shutdown`. So an attempt left open, or a tracer
    nobody uses any more, keeps no thread, and no buffered span is left without one.

    Args:
        store: where spans go.
        ledger: where stored reward spans and lost spans of open attempts are recorded.
        span_tries: writes per span (or batch) before it counts as lost (transient errors only).
        retry_backoff_s: seconds before the second write, doubled before each later one.
        flush_s: seconds a span of an open attempt may wait before it is written (>= 0).
        max_batch: spans written in one batch at most (>= 1).

    Raises:
        ConfigError: a bad ``span_tries``, ``flush_s`` or ``max_batch``.
    """

    def __init__(self, store: LightningStore, ledger: Optional[SpanLedger] = None, *, span_tries: int = 3,
                 retry_backoff_s: float = 0.1, flush_s: float = 0.5, max_batch: int = 256) -> None:
        if not (isinstance(span_tries, int) and span_tries >= 1):
            raise ConfigError(f"span_tries must be an int >= 1, got {span_tries!r}")
        if isinstance(flush_s, bool) or not isinstance(flush_s, (int, float)) or not flush_s >= 0:
            raise ConfigError(f"span_flush_s (StoreSpanProcessor's flush_s) must be seconds >= 0 (0: write each span "
                              f"as it ends), got {flush_s!r}")
        if not (isinstance(max_batch, int) and not isinstance(max_batch, bool) and max_batch >= 1):
            raise ConfigError(f"max_batch must be an int >= 1, got {max_batch!r}")
        self.store = store
        self.ledger = ledger if ledger is not None else SpanLedger()
        self.span_tries, self.retry_backoff_s = span_tries, float(retry_backoff_s)
        self.flush_s, self.max_batch = float(flush_s), max_batch
        self._lock = threading.Lock()
        self._batches: dict[tuple[str, str], _Batch] = {}
        self._flusher: Optional[threading.Thread] = None
        self._wake = threading.Event()

    # ----- open attempts ----------------------------------------------------------------
    def open(self, rollout_id: str, attempt_id: str) -> None:
        """Buffer the attempt's spans from now on (a no-op with ``flush_s=0``)."""
        if self.flush_s <= 0:
            return
        with self._lock:
            self._batches.setdefault((rollout_id, attempt_id), _Batch())
        with _BUFFERING_LOCK:
            _BUFFERING[(id(self.store), rollout_id, attempt_id)] = self

    def _ensure_flusher(self) -> None:
        """Start the background flush unless it runs (call with ``_lock`` held, after buffering a span)."""
        if self._flusher is None:
            self._wake.clear()
            self._flusher = threading.Thread(target=self._flush_loop, name="lightning-nb-span-flush", daemon=True)
            self._flusher.start()

    def close(self, rollout_id: str, attempt_id: str) -> None:
        """Write the attempt's buffered spans now (waiting for a flush under way); later ones are written as they end."""
        with _BUFFERING_LOCK:
            if _BUFFERING.get((id(self.store), rollout_id, attempt_id)) is self:
                del _BUFFERING[(id(self.store), rollout_id, attempt_id)]
        with self._lock:
            batch = self._batches.pop((rollout_id, attempt_id), None)
        if batch is not None:
            self._flush(rollout_id, attempt_id, batch, force=True)

    def _flush(self, rollout_id: str, attempt_id: str, batch: _Batch, *, force: bool) -> None:
        """Write ``batch``'s spans if ``force`` or they are due (``flush_s`` old or ``max_batch`` of them)."""
        with batch.lock:
            with self._lock:
                due = force or len(batch.spans) >= self.max_batch or \
                    (batch.spans and time.monotonic() - batch.since >= self.flush_s)
                if not due or not batch.spans:
                    return
                spans, batch.spans = batch.spans, []
            for start in range(0, len(spans), self.max_batch):
                self._write_batch(spans[start:start + self.max_batch], rollout_id, attempt_id)

    def _flush_loop(self) -> None:
        """The background flush: every ``flush_s``, write the batches that are due; ends when nothing is buffered
        (the next buffered span starts it again; both under ``_lock``, so no span is left waiting unwatched)."""
        while not self._wake.wait(self.flush_s):
            with self._lock:
                items = [(key, batch) for key, batch in self._batches.items() if batch.spans]
                if not items:
                    self._flusher = None
                    return
            for (rollout_id, attempt_id), batch in items:
                self._flush(rollout_id, attempt_id, batch, force=False)
        with self._lock:
            self._flusher = None

    # ----- OpenTelemetry ----------------------------------------------------------------
    def on_start(self, span: OtelSpan, parent_context: Optional[Context] = None) -> None:
        active = _ACTIVE.get()
        attrs = getattr(span, "attributes", None) or {}
        if active is not None and semconv.ROLLOUT_ID not in attrs:
            span.set_attribute(semconv.ROLLOUT_ID, active.rollout_id)
            span.set_attribute(semconv.ATTEMPT_ID, active.attempt_id)

    def on_end(self, span: ReadableSpan) -> None:
        attrs = span.attributes or {}
        rollout_id, attempt_id = attrs.get(semconv.ROLLOUT_ID), attrs.get(semconv.ATTEMPT_ID)
        if rollout_id is None or attempt_id is None:
            return  # not part of a rollout
        rollout_id, attempt_id = str(rollout_id), str(attempt_id)
        if self._buffer(span, rollout_id, attempt_id):
            return
        owner = _BUFFERING.get((id(self.store), rollout_id, attempt_id))  # no lock: _buffer checks it is open
        if owner is not None and owner is not self and owner._buffer(span, rollout_id, attempt_id):
            return  # e.g. the proxy's span of a runner's call: stored in order with the runner's spans
        self._write_one(span, rollout_id, attempt_id)

    def _buffer(self, span: ReadableSpan, rollout_id: str, attempt_id: str) -> bool:
        """Add the ended span to its attempt's batch and write the batch if it is due; False if the attempt is
        not open here."""
        key = (rollout_id, attempt_id)
        batch = self._batches.get(key)  # no lock for spans of attempts not open here (the proxy's, late ones)
        if batch is None:
            return False
        with self._lock:
            if self._batches.get(key) is not batch:  # closed meanwhile
                return False
            if not batch.spans:
                batch.since = time.monotonic()
            batch.spans.append(span)  # the ended span no longer changes
            due = len(batch.spans) >= self.max_batch or time.monotonic() - batch.since >= self.flush_s
            self._ensure_flusher()
        if due:
            self._flush(rollout_id, attempt_id, batch, force=False)
        return True

    def _write_batch(self, spans: list[ReadableSpan], rollout_id: str, attempt_id: str) -> None:
        """Store buffered spans of one attempt with one :meth:`LightningStore.add_otel_spans` (which converts
        them), retrying transient errors; a batch still refused (or of one span) is then written span by span,
        each with its own tries, so only the spans the store refuses (or that cannot be converted) are lost."""
        if len(spans) > 1:
            tries, exc = self._tries(lambda: self.store.add_otel_spans(rollout_id, attempt_id, spans))
            if exc is None:
                for span in spans:
                    self.ledger.stored(rollout_id, attempt_id, span.name, span.attributes)
                if tries > 1:
                    log.info("%d span(s) of rollout %s stored at try %d", len(spans), rollout_id, tries)
                return
            # then span by span (a span a failed batch did store is the same write: stored once)
        for span in spans:
            self._write_one(span, rollout_id, attempt_id)

    def _write_one(self, span: ReadableSpan, rollout_id: str, attempt_id: str) -> None:
        """Convert one span and store it with :meth:`LightningStore.add_span`, retrying transient errors."""
        try:
            record = span_from_otel(span, rollout_id, attempt_id)
        except Exception as exc:  # a span the store cannot hold: never crash the agent
            self._lose(span.name, rollout_id, attempt_id, f"span {span.name!r} could not be recorded: "
                                                          f"{type(exc).__name__}: {exc}")
            return
        tries, exc = self._tries(lambda: self.store.add_span(record))
        if exc is not None:
            self._lose(record.name, rollout_id, attempt_id,
                       f"span {record.name!r} could not be stored after {tries} "
                       f"{'try' if tries == 1 else 'tries'}: {type(exc).__name__}: {_first_line(exc)}")
            return
        self.ledger.stored(rollout_id, attempt_id, record.name, record.attributes)
        if tries > 1:
            log.info("span %r of rollout %s stored at try %d", record.name, rollout_id, tries)

    def _tries(self, write: Callable[[], Any]) -> tuple[int, Optional[Exception]]:
        """Call ``write`` until it returns, at most ``span_tries`` times, sleeping ``retry_backoff_s`` (doubled each
        time) between tries; a permanent error (NotFoundError, ConfigError) is not retried. Returns ``(tries, the
        last error or None)``: the agent never sees the error."""
        tries = 0
        while True:
            tries += 1
            try:
                write()
                return tries, None
            except Exception as exc:  # never crash the agent; transient errors are retried
                if tries < self.span_tries and not isinstance(exc, _PERMANENT):
                    time.sleep(self.retry_backoff_s * 2 ** (tries - 1))
                    continue
                return tries, exc

    def _lose(self, name: str, rollout_id: str, attempt_id: str, reason: str) -> None:
        tracked = self.ledger.lost(rollout_id, attempt_id, reason)
        log.warning("rollout %s attempt %s: %s%s", rollout_id, attempt_id, reason,
                    "" if tracked else " (the attempt is not run by this tracer's runners; nothing else records it)")

    def shutdown(self) -> None:
        """Write every buffered span and stop the background flush."""
        self.force_flush()
        self._wake.set()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Write every buffered span now (the attempts stay open)."""
        with self._lock:
            items = list(self._batches.items())
        for (rollout_id, attempt_id), batch in items:
            self._flush(rollout_id, attempt_id, batch, force=True)
        return True


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


class Tracer:
    """An OpenTelemetry ``TracerProvider`` whose spans land in ``store`` (and, optionally, in a collector live).

    Args:
        store: where every finished span of a rollout is written.
        otlp_endpoint: also send every span, as it ends, to this OTLP/HTTP collector
            (Jaeger, Phoenix, Grafana Tempo, an ``otelcol``), e.g. ``http://127.0.0.1:4318/v1/traces``;
            ``/v1/traces`` is appended when the URL has no path. Spans are batched and sent by a
            background thread (OpenTelemetry's ``BatchSpanProcessor``), so a slow or missing collector
            never blocks the agent; call :meth:`force_flush` to send what is buffered now. They carry
            ``lightning_nb.rollout_id``/``attempt_id`` and an ``openinference.span.kind``
            (:data:`~lightning_nb.semconv.ROLLOUT_ID`, ``ATTEMPT_ID``, ``SPAN_KIND``), and attributes
            named like credentials (``api_key``, ``authorization``, ``password``, ...) are sent as
            ``"[redacted]"`` (see :func:`lightning_nb.tracing.export.redact_attributes`).
        otlp_headers: extra HTTP headers for the collector, e.g. ``{"authorization": "Bearer ..."}``;
            they go on the requests only, never into span attributes.
        service_name: the OpenTelemetry ``service.name`` resource attribute the collector shows.
        span_tries: writes per span before it counts as lost (see "Lost spans" in the module docstring).
        span_flush_s: the spans of an attempt a runner opened (:meth:`open_attempt`) are written to
            the store in batches (:meth:`LightningStore.add_spans`): when the attempt closes, and at
            most this many seconds after a span ends, so live views lag by at most that much. 0
            writes each span as it ends (one store call per span). See :class:`StoreSpanProcessor`.

    Attributes:
        ledger: the :class:`SpanLedger` of the attempts open in this tracer (runners read it).

    Raises:
        ConfigError: ``otlp_endpoint`` is not an http(s) URL.
        MissingDependencyError: ``otlp_endpoint`` needs opentelemetry-exporter-otlp-proto-http
            (``pip install 'lightning-nb[otlp]'``).
    """

    def __init__(self, store: LightningStore, *, otlp_endpoint: Optional[str] = None,
                 otlp_headers: Optional[dict[str, str]] = None, service_name: str = "lightning-nb",
                 span_tries: int = 3, span_flush_s: float = 0.5) -> None:
        from opentelemetry.sdk.resources import Resource

        self.store = store
        self.ledger = SpanLedger()
        self.otlp_endpoint: Optional[str] = None
        exporter = None
        if otlp_endpoint is not None:
            from lightning_nb.tracing.export import live_otlp_exporter

            exporter = live_otlp_exporter(otlp_endpoint, otlp_headers)  # raises before anything starts
            self.otlp_endpoint = exporter.url
        # Only a live exporter has anything to flush at exit; an atexit hook would also keep this
        # tracer, and so its store with every span, alive until the interpreter ends.
        # IDs from a private generator: environments re-seed the global random (tracing/ids.py)
        self.provider = TracerProvider(resource=Resource.create({semconv.SERVICE_NAME: service_name}),
                                       shutdown_on_exit=exporter is not None, id_generator=PrivateIdGenerator())
        self.processor = StoreSpanProcessor(store, self.ledger, span_tries=span_tries, flush_s=span_flush_s)
        self.provider.add_span_processor(self.processor)
        if exporter is not None:
            from opentelemetry.sdk.trace.export import BatchSpanProcessor

            self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self.otel = self.provider.get_tracer("lightning_nb")

    def open_attempt(self, rollout_id: str, attempt_id: str) -> None:
        """Start recording the attempt's stored reward spans and lost spans (see :class:`SpanLedger`), and
        batching its spans (``span_flush_s``)."""
        self.ledger.open(rollout_id, attempt_id)
        self.processor.open(rollout_id, attempt_id)

    def close_attempt(self, rollout_id: str, attempt_id: str) -> AttemptSpans:
        """Write the attempt's buffered spans, stop recording it, and return what was recorded since
        :meth:`open_attempt` (empty if never opened)."""
        self.processor.close(rollout_id, attempt_id)
        return self.ledger.close(rollout_id, attempt_id)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Write the spans buffered for the store and send those buffered for ``otlp_endpoint`` now; False if
        that did not finish in time."""
        return self.provider.force_flush(timeout_millis)

    def shutdown(self) -> None:
        """Flush and stop the OTLP exporter's thread (also done at interpreter exit); spans ended later are dropped."""
        self.provider.shutdown()

    def __repr__(self) -> str:
        live = f", otlp_endpoint={self.otlp_endpoint!r}" if self.otlp_endpoint else ""
        return f"Tracer({self.store!r}{live})"

    @contextlib.contextmanager
    def trace_context(self, rollout_id: str, attempt_id: str, name: str = semconv.AGENT_SPAN) -> Iterator[OtelSpan]:
        """Tag everything inside with the ids; the root span is named ``name``."""
        token = _ACTIVE.set(_Active(self, rollout_id, attempt_id))
        try:
            with self.otel.start_as_current_span(name) as root:
                yield root
        finally:
            _ACTIVE.reset(token)

    def start_span(self, name: str, rollout_id: str, attempt_id: str, attributes: dict[str, Any],
                   start_time: Optional[int] = None) -> OtelSpan:
        """Start a span for explicit ids (used by the LLM proxy); end it with ``span.end()``.

        ``start_time``: nanoseconds since the epoch (default: now).
        """
        return self.otel.start_span(name, attributes={semconv.ROLLOUT_ID: rollout_id, semconv.ATTEMPT_ID: attempt_id,
                                                      **attributes}, start_time=start_time)


def _active_or_raise(what: str) -> _Active:
    active = _ACTIVE.get()
    if active is None:
        raise LightningNbError(
            f"{what} was called outside a rollout; call it from an agent run by a runner "
            "(start_runners / Runner.step), which opens the trace context"
        )
    return active


def check_reward(value: Any, field: str = "reward") -> float:
    """Return ``value`` as float; raise InvalidRewardError naming ``field`` unless finite and real."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        raise InvalidRewardError(
            f"{field} must be a finite real number, got {value!r} ({type(value).__name__}); "
            "return a float such as 0.0 or 1.0 from the agent or reward function"
        )
    return float(value)


def emit_reward(value: float, **attributes: Any) -> float:
    """Record a reward span in the current attempt and return the reward.

    Raises:
        InvalidRewardError: ``value`` is not a finite real number (nothing is recorded).
        LightningNbError: called outside a rollout.
    """
    reward = check_reward(value)
    active = _active_or_raise("emit_reward")
    with active.tracer.otel.start_as_current_span(semconv.REWARD_SPAN) as span:
        span.set_attribute(semconv.REWARD, reward)
        for k, v in attributes.items():
            span.set_attribute(k, v if isinstance(v, (str, bool, int, float)) else json.dumps(v, default=str))
    return reward


def emit_intermediate_reward(value: float, name: str = "tool_error", **attributes: Any) -> float:
    """Record an intermediate reward (a reward for one step, not the episode) and return it.

    Automatic Intermediate Rewarding (AIR; Agent Lightning paper, Luo et al. 2025, §3.4): signals
    such as a tool call's success or failure, emitted while the agent runs, that the trainer
    credits to a single LLM call rather than to the whole episode. The span is named
    ``"intermediate_reward"`` (never ``"reward"``: the final reward is the last ``"reward"``
    span, :func:`lightning_nb.store.rules.final_reward`, and this does not change it) and
    carries ``semconv.REWARD`` (float) and ``semconv.REWARD_NAME`` (``name``, e.g. ``"tool_error"``), plus
    ``attributes`` (non-scalar values as JSON).

    :class:`~lightning_nb.adapter.TripletAdapter` attributes it to the LLM call that most
    recently ended before this span started (one emitted before any call goes to the first
    call) and sums it into that call's ``Triplet.step_reward``; ``GRPOConfig.credit`` says how
    the trainer uses it. So emit it after the call whose output it judges, e.g. right after
    running the tool that call asked for.

    Raises:
        InvalidRewardError: ``value`` is not a finite real number (nothing is recorded).
        LightningNbError: called outside a rollout.
    """
    reward = check_reward(value, "intermediate reward")
    active = _active_or_raise("emit_intermediate_reward")
    with active.tracer.otel.start_as_current_span(semconv.INTERMEDIATE_REWARD_SPAN) as span:
        span.set_attribute(semconv.REWARD, reward)
        span.set_attribute(semconv.REWARD_NAME, str(name))
        for k, v in attributes.items():
            span.set_attribute(k, v if isinstance(v, (str, bool, int, float)) else json.dumps(v, default=str))
    return reward


@contextlib.contextmanager
def attempt_span(name: str) -> Iterator[Optional[OtelSpan]]:
    """A span named ``name`` in the current attempt (a child of the span open there); yields None outside a rollout.

    For spans that are neither tools nor rewards, e.g. an LLM judge's call (:data:`~lightning_nb.semconv.JUDGE_SPAN`);
    set attributes with ``span.set_attribute(key, value)`` using :mod:`lightning_nb.semconv` keys.
    """
    active = _ACTIVE.get()
    if active is None:
        yield None
        return
    with active.tracer.otel.start_as_current_span(name) as span:
        yield span


@contextlib.contextmanager
def tool_span(name: str, tool_input: Any) -> Iterator[OtelSpan]:
    """Trace one tool call: a span named ``"tool:" + name`` with ``semconv.TOOL_NAME`` and ``semconv.TOOL_INPUT`` (JSON
    text unless a str). Set the output with ``span.set_attribute(semconv.TOOL_OUTPUT, ...)``
    (``"gen_ai.tool.call.result"``).

    Raises:
        LightningNbError: called outside a rollout.
    """
    active = _active_or_raise("tool_span")
    with active.tracer.otel.start_as_current_span(f"{semconv.TOOL_SPAN_PREFIX}{name}") as span:
        span.set_attribute(semconv.TOOL_NAME, name)
        span.set_attribute(semconv.TOOL_INPUT, tool_input if isinstance(tool_input, str) else json.dumps(tool_input))
        yield span
