"""OpenTelemetry tracing that writes finished spans into the store.

A runner enters :meth:`Tracer.trace_context` around each attempt; every span the
agent opens inside it (``tool_span``, ``emit_reward``, or any OpenTelemetry
instrumentation using this tracer's provider) is tagged with the rollout and
attempt ids and written to the store by :class:`StoreSpanProcessor` when it ends.
The LLM proxy opens its spans with explicit ids (it serves other threads).
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import math
import numbers
from dataclasses import dataclass
from typing import Any, Iterator, Optional

from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.trace import Span as OtelSpan
from opentelemetry.trace import StatusCode

from lightning_nb.errors import InvalidRewardError, LightningNbError
from lightning_nb.store.base import LightningStore
from lightning_nb.types import Span

__all__ = ["Tracer", "StoreSpanProcessor", "emit_reward", "tool_span", "ROLLOUT_ID", "ATTEMPT_ID"]

log = logging.getLogger(__name__)

ROLLOUT_ID = "lightning_nb.rollout_id"
ATTEMPT_ID = "lightning_nb.attempt_id"


@dataclass(frozen=True)
class _Active:
    tracer: "Tracer"
    rollout_id: str
    attempt_id: str


_ACTIVE: contextvars.ContextVar[Optional[_Active]] = contextvars.ContextVar("lightning_nb_active", default=None)


class StoreSpanProcessor(SpanProcessor):
    """Tags spans with the active rollout/attempt on start and stores them on end."""

    def __init__(self, store: LightningStore) -> None:
        self.store = store

    def on_start(self, span: OtelSpan, parent_context: Optional[Context] = None) -> None:
        active = _ACTIVE.get()
        attrs = getattr(span, "attributes", None) or {}
        if active is not None and ROLLOUT_ID not in attrs:
            span.set_attribute(ROLLOUT_ID, active.rollout_id)
            span.set_attribute(ATTEMPT_ID, active.attempt_id)

    def on_end(self, span: ReadableSpan) -> None:
        attrs = dict(span.attributes or {})
        rollout_id, attempt_id = attrs.pop(ROLLOUT_ID, None), attrs.pop(ATTEMPT_ID, None)
        if rollout_id is None or attempt_id is None:
            return  # not part of a rollout
        ctx = span.get_span_context()
        record = Span(
            rollout_id=str(rollout_id),
            attempt_id=str(attempt_id),
            trace_id=format(ctx.trace_id, "032x"),
            span_id=format(ctx.span_id, "016x"),
            parent_id=format(span.parent.span_id, "016x") if span.parent else None,
            name=span.name,
            start_time=(span.start_time or 0) / 1e9,
            end_time=(span.end_time or 0) / 1e9,
            status={StatusCode.OK: "ok", StatusCode.ERROR: "error"}.get(span.status.status_code, "unset"),
            attributes={k: list(v) if isinstance(v, tuple) else v for k, v in attrs.items()},
        )
        try:
            self.store.add_span(record)
        except LightningNbError as exc:  # e.g. the attempt vanished; never crash the agent
            log.warning("span %s of rollout %s not stored: %s", span.name, rollout_id, exc)

    def shutdown(self) -> None:  # nothing buffered
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


class Tracer:
    """An OpenTelemetry ``TracerProvider`` whose spans land in ``store``."""

    def __init__(self, store: LightningStore) -> None:
        self.store = store
        self.provider = TracerProvider()
        self.provider.add_span_processor(StoreSpanProcessor(store))
        self.otel = self.provider.get_tracer("lightning_nb")

    @contextlib.contextmanager
    def trace_context(self, rollout_id: str, attempt_id: str, name: str = "agent") -> Iterator[OtelSpan]:
        """Tag everything inside with the ids; the root span is named ``name``."""
        token = _ACTIVE.set(_Active(self, rollout_id, attempt_id))
        try:
            with self.otel.start_as_current_span(name) as root:
                yield root
        finally:
            _ACTIVE.reset(token)

    def start_span(self, name: str, rollout_id: str, attempt_id: str, attributes: dict[str, Any]) -> OtelSpan:
        """Start a span for explicit ids (used by the LLM proxy); end it with ``span.end()``."""
        return self.otel.start_span(name, attributes={ROLLOUT_ID: rollout_id, ATTEMPT_ID: attempt_id, **attributes})


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
    with active.tracer.otel.start_as_current_span("reward") as span:
        span.set_attribute("reward", reward)
        for k, v in attributes.items():
            span.set_attribute(k, v if isinstance(v, (str, bool, int, float)) else json.dumps(v, default=str))
    return reward


@contextlib.contextmanager
def tool_span(name: str, tool_input: Any) -> Iterator[OtelSpan]:
    """Trace one tool call. Set the output with ``span.set_attribute("tool.output", ...)``."""
    active = _active_or_raise("tool_span")
    with active.tracer.otel.start_as_current_span(f"tool:{name}") as span:
        span.set_attribute("tool.name", name)
        span.set_attribute("tool.input", tool_input if isinstance(tool_input, str) else json.dumps(tool_input))
        yield span
