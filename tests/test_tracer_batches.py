"""The tracer writes an open attempt's spans in batches (add_spans): at close, after span_flush_s, at max_batch."""

from __future__ import annotations

import time

import pytest

from lightning_nb.errors import ConfigError
from lightning_nb.store import InMemoryStore, SqliteStore
from lightning_nb.tracing.tracer import StoreSpanProcessor, Tracer


def _counting(base):
    """``base`` recording each write call: ("one", name) per add_span, ("batch", names) per add_spans or
    add_otel_spans (the tracer's batch write; its default implementation calls add_spans: counted once)."""

    class Counting(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.writes = []
            self._in_otel = False

        def add_span(self, span):
            self.writes.append(("one", span.name))
            return super().add_span(span)

        def add_spans(self, spans):
            if not self._in_otel:
                self.writes.append(("batch", [s.name for s in spans]))
            return super().add_spans(spans)

        def add_otel_spans(self, rollout_id, attempt_id, spans):
            self.writes.append(("batch", [s.name for s in spans]))
            self._in_otel = True
            try:
                return super().add_otel_spans(rollout_id, attempt_id, spans)
            finally:
                self._in_otel = False

    return Counting


@pytest.fixture(params=["memory", "sqlite"])
def counting_store(request, tmp_path):
    if request.param == "memory":
        yield _counting(InMemoryStore)()
    else:
        store = _counting(SqliteStore)(tmp_path / "s.db")
        yield store
        store.close()


def _open(store, tracer):
    rid = store.enqueue_rollout("t").rollout_id
    aid = store.dequeue_rollout("w").attempt.attempt_id
    tracer.open_attempt(rid, aid)
    return rid, aid


def test_an_open_attempts_spans_are_written_in_one_batch_when_it_closes(counting_store):
    store = counting_store
    tracer = Tracer(store, span_flush_s=30.0)
    rid, aid = _open(store, tracer)
    with tracer.trace_context(rid, aid):
        for i in range(5):
            tracer.start_span(f"llm{i}", rid, aid, {"i": i}).end()
    assert store.writes == [] and store.query_spans(rid) == []  # buffered
    assert tracer.close_attempt(rid, aid).lost == []
    assert store.writes == [("batch", ["llm0", "llm1", "llm2", "llm3", "llm4", "agent"])]
    assert [(s.sequence_id, s.name) for s in store.query_spans(rid)] == [
        (1, "llm0"), (2, "llm1"), (3, "llm2"), (4, "llm3"), (5, "llm4"), (6, "agent")]
    assert store.query_attempts(rid)[0].status == "running"  # the batch was a heartbeat
    tracer.start_span("late", rid, aid, {}).end()  # after close: written as it ends
    assert store.writes[-1] == ("one", "late")


def test_a_waiting_span_is_written_within_span_flush_s_without_close(counting_store):
    store = counting_store
    tracer = Tracer(store, span_flush_s=0.2)
    rid, aid = _open(store, tracer)
    t0 = time.monotonic()
    tracer.start_span("llm", rid, aid, {}).end()
    while not store.query_spans(rid) and time.monotonic() - t0 < 5:
        time.sleep(0.02)
    waited = time.monotonic() - t0
    assert [s.name for s in store.query_spans(rid)] == ["llm"]
    assert 0.15 <= waited < 1.5, waited  # by the background flush, not at once and not at close
    tracer.close_attempt(rid, aid)
    assert len(store.query_spans(rid)) == 1  # nothing written twice


def test_max_batch_and_span_flush_s_zero():
    store = _counting(InMemoryStore)()
    tracer = Tracer(store, span_flush_s=30.0)
    tracer.processor.max_batch = 3
    rid, aid = _open(store, tracer)
    for i in range(7):
        tracer.start_span(f"s{i}", rid, aid, {}).end()
    assert store.writes == [("batch", ["s0", "s1", "s2"]), ("batch", ["s3", "s4", "s5"])]
    tracer.close_attempt(rid, aid)
    assert store.writes[-1] == ("one", "s6")
    eager = Tracer(store, span_flush_s=0)
    rid, aid = _open(store, eager)
    eager.start_span("now", rid, aid, {}).end()
    assert store.writes[-1] == ("one", "now") and [s.name for s in store.query_spans(rid)] == ["now"]
    eager.close_attempt(rid, aid)


_BAD_FLUSH = r"span_flush_s \(StoreSpanProcessor's flush_s\) must be seconds >= 0"


@pytest.mark.parametrize("kwargs, match", [({"span_flush_s": -1}, _BAD_FLUSH), ({"span_flush_s": "1"}, _BAD_FLUSH)])
def test_bad_span_flush_s_is_refused(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        Tracer(InMemoryStore(), **kwargs)
    with pytest.raises(ConfigError, match="max_batch must be an int >= 1"):
        StoreSpanProcessor(InMemoryStore(), max_batch=0)


def test_span_construct_is_model_construct_without_the_per_field_loop():
    import pickle

    from lightning_nb import types
    from lightning_nb.store import copies

    assert copies.span_construct is copies._span_new  # the import-time check passed on this pydantic
    fields = dict(rollout_id="r", attempt_id="a", sequence_id=3, trace_id="t" * 32, span_id="s" * 16,
                  parent_id=None, name="llm", start_time=1.0, end_time=2.0, status="ok", attributes={"x": [1, 2]})
    span = copies.span_construct(*fields.values())
    assert span == types.Span.model_construct(**fields) == types.Span(**fields)
    assert pickle.loads(pickle.dumps(span)) == span and span.model_copy(update={"sequence_id": 4}).sequence_id == 4
    with pytest.raises(Exception, match="validation error"):
        span.status = "nope"  # validate_assignment still applies
    span.name = "tool"
    assert span.model_dump()["name"] == "tool"

    moved = copies.span_with_sequence_id(span, 9)  # the store's add_spans returns these
    assert moved == span.model_copy(update={"sequence_id": 9}) and moved is not span and span.sequence_id == 3
    assert moved.attributes is span.attributes and moved.sequence_id == 9


def _flushers():
    import threading

    return [t for t in threading.enumerate() if t.name == "lightning-nb-span-flush"]


def test_the_flush_thread_runs_only_while_spans_wait_and_loses_none():
    """An attempt left open keeps no thread: the flush thread starts with a buffered span and ends at the first
    tick with nothing buffered; a later span starts it again; a dropped tracer is freed with no thread left."""
    import gc
    import weakref

    store = _counting(InMemoryStore)()
    tracer = Tracer(store, span_flush_s=0.1)
    before = set(_flushers())
    rid, aid = _open(store, tracer)
    assert set(_flushers()) == before  # opening an attempt starts nothing
    for round_ in range(2):
        tracer.start_span(f"llm{round_}", rid, aid, {}).end()
        assert len(set(_flushers()) - before) == 1
        deadline = time.monotonic() + 5
        while (set(_flushers()) - before or len(store.query_spans(rid)) <= round_) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert set(_flushers()) - before == set(), "the flush thread outlived its last buffered span"
        assert [s.name for s in store.query_spans(rid)] == [f"llm{i}" for i in range(round_ + 1)]  # none lost
    ref = weakref.ref(tracer)
    del tracer
    gc.collect()
    assert ref() is None  # the attempt is still open: nothing pins the tracer
