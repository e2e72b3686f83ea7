"""Finished OpenTelemetry spans as the store's spans: the one conversion, below the tracer.

:func:`span_from_otel` is what :class:`~lightning_nb.tracing.tracer.StoreSpanProcessor` and
``LightningStore.add_otel_spans`` (every backend's default) do with each span; :func:`otel_row` is
its field values without the :class:`~lightning_nb.types.Span` object, for a store that builds its
own rows (``InMemoryStore.add_otel_spans`` fills its span table from them). It lives in the store
layer so the stores can take OpenTelemetry spans without importing the tracing layer above them.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Optional

from opentelemetry.attributes import BoundedAttributes
from opentelemetry.trace import StatusCode

from lightning_nb import semconv
from lightning_nb.errors import ConfigError
from lightning_nb.store.copies import span_construct
from lightning_nb.types import Span

__all__ = ["span_from_otel", "otel_row", "otel_rows", "otel_spans", "span_of_row", "check_ids"]

_OK, _ERROR = StatusCode.OK, StatusCode.ERROR
_OUR_KEYS = (semconv.ROLLOUT_ID, semconv.ATTEMPT_ID)
_SEQUENCES = (tuple, list)


def otel_row(span: Any) -> tuple[str, str, Optional[str], str, float, float, str, dict[str, Any], bool]:
    """A finished OpenTelemetry ``ReadableSpan`` as plain values, without building a :class:`Span`.

    Returns ``(trace_id, span_id, parent_id, name, start_time, end_time, status, attributes, has_list)``:
    ids as lowercase hex (32 digits for the trace, 16 for spans), times float epoch seconds, status
    ``"ok"``/``"error"``/``"unset"``, and the attributes as a new dict (tuple and list values as new lists, the
    tracer's own rollout/attempt id attributes left out), ``has_list`` whether any value is a list.
    One pass over the attributes and no validation: OpenTelemetry already checked their types.
    """
    ctx = span.get_span_context()
    raw: Any = span.attributes  # a read-only proxy of the span's BoundedAttributes (or a plain dict)
    # .copy() of either is a plain dict copy: iterating the Mapping itself costs several times more per key
    attrs: dict[str, Any] = (raw.copy() if type(raw) is MappingProxyType  # type: ignore[assignment]  # plain dicts
                             or isinstance(raw, (BoundedAttributes, dict)) else dict(raw or {}))
    for key in _OUR_KEYS:
        if key in attrs:
            del attrs[key]
    kinds = set(map(type, attrs.values()))  # a C-speed scan; most spans hold no sequence value
    has_list = tuple in kinds or list in kinds  # (OpenTelemetry's are tuples; a plain dict's lists are copied too)
    if has_list:
        attrs = {k: list(v) if type(v) in _SEQUENCES else v for k, v in attrs.items()}
    parent = span.parent
    code = span.status.status_code  # (identity tests: an Enum's hash is a Python call)
    # SpanContext is a tuple (trace_id, span_id, ...): indexing skips two property calls per span
    return ("%032x" % ctx[0], "%016x" % ctx[1], "%016x" % parent[1] if parent else None, span.name,
            (span.start_time or 0) / 1e9, (span.end_time or 0) / 1e9,
            "ok" if code is _OK else "error" if code is _ERROR else "unset", attrs, has_list)


def otel_rows(spans: Any) -> list[tuple[Any, ...]]:
    """:func:`otel_row` of each span of a batch (``add_otel_spans``' ``spans``).

    Raises:
        ConfigError: naming ``spans[i]``, the first item that is not a finished OpenTelemetry span.
    """
    rows = []
    for i, span in enumerate(spans):
        try:
            rows.append(otel_row(span))
        except Exception as exc:  # not a ReadableSpan (or a broken one): refused before anything is stored
            raise ConfigError(f"spans[{i}] must be a finished OpenTelemetry span (opentelemetry.sdk.trace."
                              f"ReadableSpan), got {type(span).__name__}: {type(exc).__name__}: {exc}") from None
    return rows


def otel_spans(rollout_id: Any, attempt_id: Any, spans: Any) -> list[Span]:
    """``add_otel_spans``' arguments as the :class:`~lightning_nb.types.Span` batch to store (sequence ids 0).

    Raises:
        ConfigError: naming ``rollout_id``/``attempt_id`` when not a str, or ``spans[i]``, the first item that
            is not a finished OpenTelemetry span.
    """
    check_ids(rollout_id, attempt_id)
    return [span_of_row(row, rollout_id, attempt_id) for row in otel_rows(spans)]


def check_ids(rollout_id: Any, attempt_id: Any) -> None:
    """``add_otel_spans``' ids must be strings.

    Raises:
        ConfigError: naming the argument that is not.
    """
    for name, value in (("rollout_id", rollout_id), ("attempt_id", attempt_id)):
        if type(value) is not str:
            raise ConfigError(f"add_otel_spans: {name} must be a str (the id the store gave), got "
                              f"{type(value).__name__} {value!r}")


def span_from_otel(span: Any, rollout_id: str, attempt_id: str) -> Span:
    """A finished OpenTelemetry ``ReadableSpan`` as the store's :class:`~lightning_nb.types.Span`.

    Ids become lowercase hex (32 digits for the trace, 16 for spans), times float epoch
    seconds, tuple attribute values lists; the tracer's own rollout/attempt id attributes
    are left out (:func:`otel_row`). No pydantic validation: OpenTelemetry already checked
    the attribute types, and this runs for every span an agent makes.
    """
    return span_of_row(otel_row(span), rollout_id, attempt_id)


def span_of_row(row: tuple[Any, ...], rollout_id: str, attempt_id: str) -> Span:
    """The :class:`~lightning_nb.types.Span` of an :func:`otel_row` (``sequence_id`` 0: the store numbers it)."""
    trace_id, span_id, parent_id, name, start, end, status, attrs, _ = row
    return span_construct(rollout_id, attempt_id, 0, trace_id, span_id, parent_id, name, start, end, status, attrs)
