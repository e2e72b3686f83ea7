"""Export spans and triplets to Parquet files (pandas + pyarrow) for offline analysis or training.

Both writers use a fixed Arrow schema, so an empty export and a full one have the
same columns and types, and token IDs come back exactly as they were stored:

* :func:`spans_to_parquet`: one row per span (see :data:`SPAN_SCHEMA`);
* :func:`triplets_to_parquet`: one row per :class:`~lightning_nb.types.Triplet`
  (see :data:`TRIPLET_SCHEMA`).

Read them back with ``pandas.read_parquet(path)`` or ``pyarrow.parquet.read_table(path)``.

:func:`spans_to_otlp` sends stored spans to an OpenTelemetry collector over OTLP/HTTP
(Jaeger, Phoenix, Grafana Tempo, an ``otelcol``) with their original trace, span and
parent ids, so the trees look there as they did when recorded.
"""

from __future__ import annotations

import json
import numbers
import re
from pathlib import Path
from typing import Any, Optional, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from lightning_nb import semconv
from lightning_nb.errors import ConfigError, LightningNbError, MissingDependencyError
from lightning_nb.store.base import LightningStore, span_summary
from lightning_nb.types import GROUP_ID_KEY, Span, Triplet

__all__ = ["spans_to_parquet", "triplets_to_parquet", "spans_to_otlp", "OTLPExportError", "SPAN_SCHEMA",
           "TRIPLET_SCHEMA", "redact_attributes", "live_otlp_exporter"]

_IDS = pa.list_(pa.int64())

#: Columns of :func:`spans_to_parquet`. Times are float seconds since the epoch;
#: ``attributes`` is every span attribute as one JSON object (NaN/Infinity written
#: as Python's ``json`` does); the token-count, reward and token-ID columns are
#: copies of those attributes (:data:`~lightning_nb.semconv.USAGE_INPUT_TOKENS`,
#: ``USAGE_OUTPUT_TOKENS``, ``REWARD``, ``PROMPT_TOKEN_IDS``, ``COMPLETION_TOKEN_IDS``),
#: null where a span lacks them or holds another type. Column names are the file's
#: format and stay as they are whatever the span keys are named.
SPAN_SCHEMA = pa.schema([
    ("rollout_id", pa.string()), ("attempt_id", pa.string()), ("sequence_id", pa.int64()),
    ("name", pa.string()), ("status", pa.string()),
    ("trace_id", pa.string()), ("span_id", pa.string()), ("parent_id", pa.string()),
    ("start_time", pa.float64()), ("end_time", pa.float64()), ("duration_s", pa.float64()),
    ("prompt_tokens", pa.int64()), ("completion_tokens", pa.int64()), ("reward", pa.float64()),
    ("prompt_token_ids", _IDS), ("completion_token_ids", _IDS),
    ("attributes", pa.string()),
])

#: Columns of :func:`triplets_to_parquet`: the Triplet fields, token IDs as list<int64>,
#: ``logprobs`` as list<double> (null when the triplet has none).
TRIPLET_SCHEMA = pa.schema([
    ("rollout_id", pa.string()), ("attempt_id", pa.string()), (GROUP_ID_KEY, pa.string()), ("turn", pa.int64()),
    ("prompt_ids", _IDS), ("response_ids", _IDS), ("logprobs", pa.list_(pa.float64())),
    ("reward", pa.float64()), ("temperature", pa.float64()),
    ("prompt_text", pa.string()), ("response_text", pa.string()),
])


def spans_to_parquet(store: LightningStore, path: str | Path, rollout_id: Optional[str] = None) -> Path:
    """Write the store's spans (all, or one rollout's) to a Parquet file, one row per span.

    Rows are in :meth:`~lightning_nb.store.base.LightningStore.query_spans` order;
    columns are :data:`SPAN_SCHEMA`. Missing parent folders are created and an
    existing file is replaced.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        NotFoundError: ``rollout_id`` is not in the store.
        ConfigError: ``path`` cannot be written (it is a folder, a parent is a file, ...).
    """
    spans = store.query_spans(rollout_id)
    table = pa.Table.from_pylist([_span_row(s) for s in spans], schema=SPAN_SCHEMA)
    return _write(table, path, "spans_to_parquet")


def triplets_to_parquet(triplets: Sequence[Triplet], path: str | Path) -> Path:
    """Write triplets to a Parquet file, one row per triplet (columns: :data:`TRIPLET_SCHEMA`).

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        ConfigError: an item is not a Triplet, or ``path`` cannot be written.
    """
    rows = []
    for i, t in enumerate(triplets):
        if not isinstance(t, Triplet):
            raise ConfigError(f"triplets[{i}] is a {type(t).__name__}; pass lightning_nb.types.Triplet objects "
                              f"(e.g. from TripletAdapter.adapt)")
        rows.append({name: getattr(t, name) for name in TRIPLET_SCHEMA.names})
    table = pa.Table.from_pylist(rows, schema=TRIPLET_SCHEMA)
    return _write(table, path, "triplets_to_parquet")


class OTLPExportError(LightningNbError, ConnectionError):
    """The OTLP collector could not be reached or refused the spans."""


def spans_to_otlp(store: LightningStore, endpoint: str, rollout_id: Optional[str] = None, *,
                  headers: Optional[dict[str, str]] = None, service_name: str = "lightning-nb",
                  timeout_s: float = 10.0, batch_size: int = 512) -> int:
    """Send the store's spans (all, or one rollout's) to an OTLP/HTTP collector; returns how many were sent.

    Each stored span is re-emitted with its stored ``trace_id``, ``span_id``, ``parent_id``,
    name, start/end times (nanoseconds on the wire), status and attributes, plus
    ``lightning_nb.rollout_id``, ``lightning_nb.attempt_id``, ``lightning_nb.sequence_id`` and
    an ``openinference.span.kind`` (LLM, TOOL, EVALUATOR for rewards, CHAIN otherwise) so
    Phoenix shows them by kind. Attribute values OTLP cannot carry (dicts, mixed or nested
    lists) are sent as JSON strings; None values are dropped; credentials are redacted
    (:func:`redact_attributes`). An id that is not hex of the
    OpenTelemetry length (32 digits for traces, 16 for spans) is replaced by a stable hash of it.
    Sending the same spans twice sends duplicates; collectors do not deduplicate.

    Args:
        store: where the spans are read (any backend).
        endpoint: the collector URL, e.g. ``http://127.0.0.1:4318`` (Jaeger, otelcol) or
            ``http://127.0.0.1:6006`` (Phoenix); ``/v1/traces`` is appended when the URL has no path.
        rollout_id: only this rollout's spans; None sends all.
        headers: extra HTTP headers, e.g. ``{"authorization": "Bearer ..."}`` for a hosted collector.
        service_name: the OpenTelemetry ``service.name`` resource attribute.
        timeout_s: seconds per request (the exporter retries within it).
        batch_size: spans per request.

    Raises:
        ConfigError: ``endpoint`` is not an http(s) URL, or ``timeout_s`` / ``batch_size`` not positive.
        NotFoundError: ``rollout_id`` is not in the store.
        MissingDependencyError: opentelemetry-exporter-otlp-proto-http is missing (the ``otlp`` extra).
        OTLPExportError: the collector did not accept a batch (earlier batches stay sent).
    """
    url = _otlp_url(endpoint)
    if not timeout_s > 0 or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"timeout_s must be positive seconds and batch_size an int >= 1, "
                          f"got timeout_s={timeout_s!r}, batch_size={batch_size!r}")
    exporter_cls = _otlp_exporter_class()
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace.export import SpanExportResult

    spans = store.query_spans(rollout_id)
    resource = Resource.create({semconv.SERVICE_NAME: service_name})
    exporter = exporter_cls(endpoint=url, headers=headers, timeout=timeout_s)
    try:
        for start in range(0, len(spans), batch_size):
            batch = [_readable_span(s, resource) for s in spans[start:start + batch_size]]
            if exporter.export(batch) != SpanExportResult.SUCCESS:
                last = start + len(batch) - 1
                raise OTLPExportError(f"the OTLP collector at {url} did not accept spans {start}..{last} of "
                                      f"{len(spans)} (see the opentelemetry exporter's log); is it running?")
    finally:
        exporter.shutdown()
    return len(spans)


def _otlp_url(endpoint: str) -> str:
    from urllib.parse import urlsplit

    if not isinstance(endpoint, str) or not endpoint.startswith(("http://", "https://")):
        raise ConfigError(f"endpoint must be an http:// or https:// URL of an OTLP/HTTP collector such as "
                          f"'http://127.0.0.1:4318', got {endpoint!r}")
    return endpoint.rstrip("/") + "/v1/traces" if urlsplit(endpoint).path in ("", "/") else endpoint


def _otlp_exporter_class() -> Any:
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError as exc:
        raise MissingDependencyError("OTLP export needs opentelemetry-exporter-otlp-proto-http: "
                                     "pip install 'lightning-nb[otlp]'") from exc
    return OTLPSpanExporter


def _otel_id(value: Optional[str], digits: int) -> int:
    """The hex id as an int; a stable hash for ids that are not ``digits`` hex digits (never 0)."""
    import hashlib

    if value and len(value) == digits:
        try:
            n = int(value, 16)
            if n:
                return n
        except ValueError:
            pass
    n = int.from_bytes(hashlib.sha256(str(value).encode()).digest()[: digits // 2], "big")
    return n or 1


def _otel_value(value: Any) -> Any:
    """``value`` as an OTLP attribute value: primitives and homogeneous lists as they are, else JSON."""
    if isinstance(value, (str, bool, float)) or (_is_int(value) and -2**63 <= value < 2**63):
        return value
    if isinstance(value, (list, tuple)) and value:
        kinds = {type(v) for v in value}
        if len(kinds) == 1 and kinds <= {str, bool, int, float} and all(
                not isinstance(v, int) or isinstance(v, bool) or -2**63 <= v < 2**63 for v in value):
            return list(value)
    return json.dumps(value, allow_nan=True, default=repr)


def _span_kind(name: str, attributes: Any) -> str:
    """The OpenInference span kind Phoenix groups by: LLM, TOOL, EVALUATOR (rewards) or CHAIN."""
    if semconv.SYSTEM in attributes or semconv.PROMPT_TOKEN_IDS in attributes:
        return "LLM"
    if name.startswith(semconv.TOOL_SPAN_PREFIX):
        return "TOOL"
    return "EVALUATOR" if name in (semconv.REWARD_SPAN, semconv.JUDGE_SPAN) else "CHAIN"


# an attribute whose name has one of these words (between ., _, - or the ends) holds a credential
_SECRET_KEY = re.compile(r"(?:^|[._-])(?:api[_-]?key|apikey|authorization|auth[_-]?token|access[_-]?token|"
                         r"refresh[_-]?token|bearer|password|passwd|secret|client[_-]?secret|cookie)(?:$|[._-])",
                         re.IGNORECASE)
REDACTED = "[redacted]"


def redact_attributes(attributes: Any) -> dict[str, Any]:
    """A copy of ``attributes`` with credential-named values replaced by ``"[redacted]"``.

    A key is a credential when one of its ``.``/``_``/``-``-separated parts reads ``api_key``,
    ``apikey``, ``authorization``, ``auth_token``, ``access_token``, ``refresh_token``, ``bearer``,
    ``password``, ``passwd``, ``secret``, ``client_secret`` or ``cookie`` (any case), e.g.
    ``llm.api_key`` or ``http.request.header.authorization``; token counts and token IDs
    (``gen_ai.usage.input_tokens``, ``lightning_nb.prompt.token_ids``) are not. Every OTLP export applies it.
    """
    return {k: REDACTED if _SECRET_KEY.search(k) else v for k, v in attributes.items()}


def live_otlp_exporter(endpoint: str, headers: Optional[dict[str, str]] = None, timeout_s: float = 10.0) -> Any:
    """An OpenTelemetry ``SpanExporter`` for live spans (used by ``Tracer(otlp_endpoint=...)``).

    It sends OTel SDK spans to the OTLP/HTTP collector at ``endpoint`` after
    :func:`redact_attributes` and with an ``openinference.span.kind`` added; ``.url`` is the full URL.

    Raises:
        ConfigError: ``endpoint`` is not an http(s) URL.
        MissingDependencyError: opentelemetry-exporter-otlp-proto-http is missing (the ``otlp`` extra).
    """
    from opentelemetry.sdk.trace.export import SpanExporter

    url = _otlp_url(endpoint)
    inner = _otlp_exporter_class()(endpoint=url, headers=headers, timeout=timeout_s)

    class LiveOTLPExporter(SpanExporter):
        def export(self, spans: Sequence[Any]) -> Any:
            return inner.export([_redacted_copy(s) for s in spans])

        def shutdown(self) -> None:
            inner.shutdown()

        def force_flush(self, timeout_millis: int = 30000) -> bool:
            return inner.force_flush(timeout_millis)

    exporter = LiveOTLPExporter()
    exporter.url = url  # type: ignore[attr-defined]
    return exporter


def _redacted_copy(span: Any) -> Any:
    """The finished SDK span with redacted attributes and a span kind, as a new ``ReadableSpan``."""
    from opentelemetry.sdk.trace import ReadableSpan

    attributes = redact_attributes(span.attributes or {})
    attributes.setdefault(semconv.SPAN_KIND, _span_kind(span.name, attributes))
    return ReadableSpan(name=span.name, context=span.context, parent=span.parent, resource=span.resource,
                        attributes=attributes, events=span.events, links=span.links, kind=span.kind,
                        status=span.status, start_time=span.start_time, end_time=span.end_time,
                        instrumentation_scope=span.instrumentation_scope)


def _readable_span(span: Span, resource: Any) -> Any:
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope
    from opentelemetry.trace import SpanContext, Status, StatusCode, TraceFlags

    trace_id = _otel_id(span.trace_id, 32)
    context = SpanContext(trace_id, _otel_id(span.span_id, 16), is_remote=False, trace_flags=TraceFlags(1))
    parent = (SpanContext(trace_id, _otel_id(span.parent_id, 16), is_remote=False, trace_flags=TraceFlags(1))
              if span.parent_id else None)
    attributes = {k: _otel_value(v) for k, v in redact_attributes(span.attributes).items() if v is not None}
    attributes.update({semconv.ROLLOUT_ID: span.rollout_id, semconv.ATTEMPT_ID: span.attempt_id,
                       semconv.SEQUENCE_ID: span.sequence_id})
    attributes.setdefault(semconv.SPAN_KIND, _span_kind(span.name, span.attributes))
    status = Status({"ok": StatusCode.OK, "error": StatusCode.ERROR}.get(span.status, StatusCode.UNSET))
    return ReadableSpan(name=span.name, context=context, parent=parent, resource=resource, attributes=attributes,
                        status=status, start_time=int(span.start_time * 1e9), end_time=int(span.end_time * 1e9),
                        instrumentation_scope=InstrumentationScope("lightning_nb"))


# ----- helpers ----------------------------------------------------------------------------
def _span_row(span: Span) -> dict[str, Any]:
    summary = span_summary(span)
    return {
        "rollout_id": span.rollout_id, "attempt_id": span.attempt_id, "sequence_id": span.sequence_id,
        "name": span.name, "status": span.status,
        "trace_id": span.trace_id, "span_id": span.span_id, "parent_id": span.parent_id,
        "start_time": span.start_time, "end_time": span.end_time, "duration_s": summary["duration_s"],
        "prompt_tokens": _int(summary["prompt_tokens"]),
        "completion_tokens": _int(summary["completion_tokens"]),
        "reward": _float(summary["reward"]),
        "prompt_token_ids": _int_list(span.attributes.get(semconv.PROMPT_TOKEN_IDS)),
        "completion_token_ids": _int_list(span.attributes.get(semconv.COMPLETION_TOKEN_IDS)),
        "attributes": json.dumps(span.attributes, allow_nan=True, default=repr),
    }


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _int(value: Any) -> Optional[int]:
    return int(value) if _is_int(value) else None


def _float(value: Any) -> Optional[float]:
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    return None


def _int_list(value: Any) -> Optional[list[int]]:
    if isinstance(value, (list, tuple)) and all(_is_int(v) for v in value):
        return [int(v) for v in value]
    return None


def _write(table: pa.Table, path: str | Path, what: str) -> Path:
    """Write ``table`` to ``path`` (parents created); ConfigError naming the path if that fails."""
    target = Path(path)
    if target.is_dir():
        raise ConfigError(f"{what}: path {str(target)!r} is a folder; pass a file path such as "
                          f"{str(target / 'out.parquet')!r}")
    for parent in target.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ConfigError(f"{what}: cannot write {str(target)!r} because {str(parent)!r} is a file, "
                                  f"not a folder; choose another path")
            break
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, target)
    except (OSError, pa.ArrowException) as exc:
        raise ConfigError(f"{what}: cannot write {str(target)!r}: {type(exc).__name__}: {exc}") from exc
    return target
