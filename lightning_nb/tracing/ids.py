"""Span and trace IDs drawn from a random generator no user code can re-seed.

OpenTelemetry's default ``RandomIdGenerator`` draws IDs from Python's global ``random``. Environments re-seed
that generator in their reset (TextArena 0.7.4's ``core.State.__init__`` and gem-llm's ``Env.reset`` call
``random.seed(seed)``), and a GRPO group runs same-seed episodes at once on several runner threads: one
episode's reset rewinds the generator for the others, they draw span IDs already stored, and the store refuses
the spans (``span_id ... is already stored for attempt ... with other content``), failing the episode.

:class:`PrivateIdGenerator` draws from a ``random.Random`` of its own, seeded from ``os.urandom`` and seeded
again in a forked child (as the global one is), so a re-seed of ``random`` elsewhere cannot touch it.
"""

from __future__ import annotations

import os
import random

from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.trace import INVALID_SPAN_ID, INVALID_TRACE_ID

__all__ = ["PrivateIdGenerator", "ID_RANDOM"]

#: the process's private source of span and trace IDs (``random.Random`` seeded from ``os.urandom``)
ID_RANDOM = random.Random()
if hasattr(os, "register_at_fork"):  # a forked child must not repeat its parent's IDs
    os.register_at_fork(after_in_child=ID_RANDOM.seed)


class PrivateIdGenerator(IdGenerator):
    """OpenTelemetry's random IDs (64-bit span IDs, 128-bit trace IDs, never the invalid 0) from
    :data:`ID_RANDOM` instead of the global ``random`` (module docstring). ``getrandbits`` is one C call, so
    runner threads share the generator safely."""

    def generate_span_id(self) -> int:
        span_id = ID_RANDOM.getrandbits(64)
        while span_id == INVALID_SPAN_ID:
            span_id = ID_RANDOM.getrandbits(64)
        return span_id

    def generate_trace_id(self) -> int:
        trace_id = ID_RANDOM.getrandbits(128)
        while trace_id == INVALID_TRACE_ID:
            trace_id = ID_RANDOM.getrandbits(128)
        return trace_id

    def is_trace_id_random(self) -> bool:
        return True
