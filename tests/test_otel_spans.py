"""store.add_otel_spans on every backend (conftest.STORE_BACKENDS): finished OpenTelemetry spans stored as
add_spans stores them converted, copies in and out, all or nothing; and the tracer's batches through it."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.trace import SpanContext, Status, StatusCode

from lightning_nb import semconv
from lightning_nb.errors import ConfigError, NotFoundError
from lightning_nb.store import InMemoryStore
from lightning_nb.store.otel import span_from_otel
from lightning_nb.tracing.tracer import Tracer
from lightning_nb.types import Span


class _Keep(SpanProcessor):
    """A span processor keeping the finished spans, as the SDK hands them to processors."""

    def __init__(self):
        self.spans = []

    def on_end(self, span):
        self.spans.append(span)


def _finished(rid, aid):
    keep = _Keep()
    provider = TracerProvider()
    provider.add_span_processor(keep)
    otel = provider.get_tracer("test")
    ids = {semconv.ROLLOUT_ID: rid, semconv.ATTEMPT_ID: aid}
    with otel.start_as_current_span("agent", attributes={"ids": [1, 2, 3], "who": "me", **ids}):
        with otel.start_as_current_span("tool:calc", attributes={semconv.TOOL_INPUT: "1+1"}) as child:
            child.set_status(Status(StatusCode.ERROR, "boom"))
        with otel.start_as_current_span(semconv.REWARD_SPAN, attributes={semconv.REWARD: 1.5}):
            pass
    return keep.spans  # tool:calc, reward, agent (in the order they ended)


def _started(store):
    store.enqueue_rollout("task")
    item = store.dequeue_rollout("w")
    return item.rollout.rollout_id, item.attempt.attempt_id


def _dumps(spans):
    return [s.model_dump(exclude={"rollout_id", "attempt_id"}) for s in spans]


def test_add_otel_spans_stores_what_add_spans_stores_of_the_converted_spans(store):
    rid, aid = _started(store)
    spans = _finished(rid, aid)
    assert store.add_otel_spans(rid, aid, spans) == [1, 2, 3]
    stored = store.query_spans(rid)
    expected = [span_from_otel(s, rid, aid).model_copy(update={"sequence_id": k}) for k, s in enumerate(spans, 1)]
    assert [s.model_dump() for s in stored] == [s.model_dump() for s in expected]
    assert [s.name for s in stored] == ["tool:calc", semconv.REWARD_SPAN, "agent"]
    assert stored[0].status == "error" and stored[0].parent_id == stored[2].span_id and stored[2].parent_id is None
    assert stored[2].attributes == {"ids": [1, 2, 3], "who": "me"}  # the tracer's id tags left out; tuples as lists
    assert len(stored[2].trace_id) == 32 and len(stored[2].span_id) == 16
    assert store.query_attempts(rid)[0].status == "running"  # the spans were a sign of life
    store.update_attempt(rid, aid, status="succeeded")
    assert store.final_reward(rid) == 1.5
    # the same spans through add_spans, converted by the caller: the same stored values
    rid2, aid2 = _started(store)
    store.add_spans([span_from_otel(s, rid2, aid2) for s in spans])
    assert _dumps(store.query_spans(rid2)) == _dumps(stored)


def test_the_store_keeps_no_object_the_caller_holds_and_hands_out_copies(store):
    rid, aid = _started(store)
    ids = [7, 8]
    span = ReadableSpan(name="plain", context=SpanContext(trace_id=5, span_id=6, is_remote=False),
                        attributes={"ids": ids, "n": 1}, start_time=1_000_000_000, end_time=2_000_000_000)
    store.add_otel_spans(rid, aid, [span])
    ids.append(9)  # the caller's list, changed after the write
    got = store.query_spans(rid)[0]
    assert got.attributes == {"ids": [7, 8], "n": 1} and (got.start_time, got.end_time) == (1.0, 2.0)
    got.attributes["ids"].append(10)
    assert store.query_spans(rid)[0].attributes == {"ids": [7, 8], "n": 1}


def test_a_repeated_batch_is_the_same_write_and_a_refused_one_stores_nothing(store):
    rid, aid = _started(store)
    spans = _finished(rid, aid)
    assert store.add_otel_spans(rid, aid, spans[:2]) == [1, 2]
    assert store.add_otel_spans(rid, aid, spans) == [1, 2, 3]  # the first two again: their stored sequence ids
    assert [s.sequence_id for s in store.query_spans(rid)] == [1, 2, 3]
    assert store.add_otel_spans(rid, aid, []) == []
    before = [s.model_dump() for s in store.query_spans()]
    other = _finished(rid, aid)
    with pytest.raises(ConfigError, match=r"spans\[1\] must be a finished OpenTelemetry span.*got str"):
        store.add_otel_spans(rid, aid, [other[0], "not a span"])
    with pytest.raises(NotFoundError, match="at-missing"):
        store.add_otel_spans(rid, "at-missing", other)
    with pytest.raises(NotFoundError, match="ro-missing"):
        store.add_otel_spans("ro-missing", aid, other)
    with pytest.raises(ConfigError, match="add_otel_spans: attempt_id must be a str"):
        store.add_otel_spans(rid, 3, other)
    assert [s.model_dump() for s in store.query_spans()] == before


def test_the_tracer_writes_an_open_attempts_batch_with_add_otel_spans_and_loses_only_a_bad_span(store):
    tracer = Tracer(store, span_flush_s=30.0)
    rid, aid = _started(store)
    tracer.open_attempt(rid, aid)
    with tracer.trace_context(rid, aid):
        tracer.start_span("llm", rid, aid, {"tokens": [1, 2]}).end()
    bad = ReadableSpan(name="broken", context=None, attributes={semconv.ROLLOUT_ID: rid, semconv.ATTEMPT_ID: aid})
    tracer.processor.on_end(bad)  # no span context: cannot be converted
    assert store.query_spans(rid) == []  # buffered until the attempt closes
    result = tracer.close_attempt(rid, aid)
    assert [s.name for s in store.query_spans(rid)] == ["llm", "agent"]
    assert store.query_spans(rid)[0].attributes == {"tokens": [1, 2]}
    assert len(result.lost) == 1 and "span 'broken' could not be recorded" in result.lost[0]


def test_the_proxys_spans_of_an_attempt_a_runner_buffers_are_stored_in_the_order_they_ended(store):
    """The LLM proxy has its own Tracer; its span of a call the runner's attempt made joins the runner's buffer, so
    the store does not number it before the runner's earlier spans (the GEM runner's LLM, step-score, LLM order)."""
    runner, proxy = Tracer(store, span_flush_s=30.0), Tracer(store, span_flush_s=30.0)
    rid, aid = _started(store)
    runner.open_attempt(rid, aid)
    proxy.start_span("llm-1", rid, aid, {}).end()
    with runner.trace_context(rid, aid):
        runner.start_span("step-1", rid, aid, {}).end()
        proxy.start_span("llm-2", rid, aid, {}).end()
        runner.start_span("step-2", rid, aid, {}).end()
    assert store.query_spans(rid) == []  # all four wait in the runner's buffer
    runner.close_attempt(rid, aid)
    proxy.start_span("late", rid, aid, {}).end()  # closed: written as it ends
    assert [s.name for s in store.query_spans(rid)] == ["llm-1", "step-1", "llm-2", "step-2", "agent", "late"]
    # a tracer of another store object writes to that store (here: refused, no such rollout), never into this buffer
    runner.open_attempt(rid, aid)
    Tracer(InMemoryStore(), span_flush_s=30.0).start_span("elsewhere", rid, aid, {}).end()
    runner.close_attempt(rid, aid)
    assert "elsewhere" not in [s.name for s in store.query_spans(rid)]
    # an attempt never closed (an abandoned runner) keeps no tracer alive
    import gc
    import weakref

    from lightning_nb.tracing import tracer as tracing

    abandoned = Tracer(store, span_flush_s=30.0)
    abandoned.open_attempt(rid, "at-never-closed")
    gone = weakref.ref(abandoned.processor)
    del abandoned
    gc.collect()
    assert gone() is None and (id(store), rid, "at-never-closed") not in tracing._BUFFERING


def test_sequence_ids_given_out_of_order_still_read_in_order():
    store = InMemoryStore()
    rid, aid = _started(store)

    def span(name, seq):
        return Span(rollout_id=rid, attempt_id=aid, sequence_id=seq, trace_id="t" * 32, span_id=name * 16,
                    name=name, start_time=1.0, end_time=2.0)

    store.add_spans([span("a", 5), span("b", 2)])
    store.add_span(span("c", 1))
    store.add_otel_spans(rid, aid, _finished(rid, aid)[:1])  # the store numbers it: 6
    assert [(s.name, s.sequence_id) for s in store.query_spans(rid)] == [("c", 1), ("b", 2), ("a", 5),
                                                                          ("tool:calc", 6)]
    assert list(store.spans_df(rid)["name"]) == ["c", "b", "a", "tool:calc"]


def test_add_otel_spans_keeps_the_memory_policy():
    store = InMemoryStore(max_spans=4, min_span_age_s=0)
    first, aid = _started(store)
    store.add_otel_spans(first, aid, _finished(first, aid))
    store.update_attempt(first, aid, status="succeeded")
    rid, aid = _started(store)
    store.add_otel_spans(rid, aid, _finished(rid, aid))  # 6 spans > 4: the finished rollout's spans leave
    assert store.evicted_spans == 3 and store.query_spans(first) == [] and len(store.query_spans(rid)) == 3
    assert store.final_reward(first) == 1.5  # kept when its spans left
