"""Tracing: OpenTelemetry spans of each attempt into the store (tracer), and their export (parquet, OTLP)."""

from lightning_nb.tracing.tracer import Tracer, attempt_span, emit_intermediate_reward, emit_reward, tool_span

__all__ = ["Tracer", "attempt_span", "emit_intermediate_reward", "emit_reward", "tool_span"]
