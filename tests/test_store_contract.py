"""The store contract's rules for updates, manual retries, resources versions, spans as heartbeats, span identity
and the watchdog for polling callers, on every backend (conftest.STORE_BACKENDS: memory, sqlite, http)."""

from __future__ import annotations

import time
import uuid

import pandas as pd
import pytest

from lightning_nb import semconv
from lightning_nb.errors import AttemptEnded, ConfigError, InvalidStatusTransition, NotFoundError
from lightning_nb.store import InMemoryStore, StoreClient, StoreServer
from lightning_nb.types import LLMResource, RolloutConfig, Span


def _span(rid, aid, name="x", span_id=None, sequence_id=0, **attrs):
    return Span(rollout_id=rid, attempt_id=aid, sequence_id=sequence_id, trace_id="t" * 32,
                span_id=span_id or uuid.uuid4().hex[:16], name=name, start_time=1.0, end_time=2.0, attributes=attrs)


def _llm(port):
    return {"main_llm": LLMResource(endpoint=f"http://127.0.0.1:{port}/v1", model="m")}


def _state(store):
    """Everything a caller can read, to check a refused call changed nothing."""
    return ([r.model_dump() for r in store.query_rollouts()], [a.model_dump() for a in store.query_attempts()],
            [s.model_dump() for s in store.query_spans()], [u.model_dump() for u in store.query_resources()])


# ----- update_rollout -----------------------------------------------------------------------
def test_update_rollout_changes_a_queued_rollout_in_place_in_the_queue(store):
    res = store.add_resources(_llm(9))
    other = store.add_resources(_llm(10))
    first = store.enqueue_rollout({"q": 1}, metadata={"group_id": "g"})
    second = store.enqueue_rollout({"q": 2})
    new = store.update_rollout(first.rollout_id, input={"q": 11}, mode="val", resources_id=res.resources_id,
                               config={"max_attempts": 3, "timeout_seconds": 5.0}, metadata={"group_id": "h"})
    assert (new.input, new.mode, new.resources_id, new.metadata) == ({"q": 11}, "val", res.resources_id,
                                                                      {"group_id": "h"})
    assert new.config == RolloutConfig(max_attempts=3, timeout_seconds=5.0) and new.status == "queuing"
    item = store.dequeue_rollout("w")  # still first in the queue, with the new values
    assert item.rollout.rollout_id == first.rollout_id and item.rollout.input == {"q": 11}
    assert item.rollout.resources_id == res.resources_id and item.rollout.config.max_attempts == 3
    # while it runs: config and metadata may change, the task may not
    store.update_rollout(first.rollout_id, config=RolloutConfig(max_attempts=5), metadata={"note": "slow"})
    assert store.get_rollout_by_id(first.rollout_id).config.max_attempts == 5
    assert store.dequeue_rollout("w").rollout.rollout_id == second.rollout_id
    assert second.resources_id == other.resources_id  # pinned at enqueue to the latest set


def test_refused_rollout_updates_name_the_problem_and_change_nothing(store):
    rid = store.enqueue_rollout("task").rollout_id
    item = store.dequeue_rollout("w")
    before = _state(store)
    for kwargs, error, match in [
        ({"input": "other"}, InvalidStatusTransition, "input can change only while it waits in the queue"),
        ({"status": "succeeded"}, ConfigError, "status='succeeded' cannot be set"),
        ({"status": "queuing"}, InvalidStatusTransition, "with an attempt in flight"),
        ({"mode": "eval"}, ConfigError, "mode='eval' is not a rollout mode"),
        ({"config": {"max_attempts": 0}}, ConfigError, "max_attempts"),
        ({"config": {"no_such_field": 1}}, ConfigError, "no_such_field"),
        ({"resources_id": "res-missing"}, NotFoundError, "res-missing"),
        ({"metadata": ["not", "a", "dict"]}, ConfigError, "metadata must be a dict"),
    ]:
        with pytest.raises(error, match=match):
            store.update_rollout(rid, **kwargs)
    with pytest.raises(NotFoundError, match="ro-missing"):
        store.update_rollout("ro-missing", metadata={})
    assert _state(store) == before
    store.update_attempt(rid, item.attempt.attempt_id, status="succeeded")
    done = _state(store)
    with pytest.raises(InvalidStatusTransition, match="config can change only before it ends"):
        store.update_rollout(rid, config={"max_attempts": 2})
    with pytest.raises(InvalidStatusTransition, match="already succeeded"):
        store.update_rollout(rid, status="cancelled")
    assert _state(store) == done
    assert store.update_rollout(rid, metadata={"label": "checked"}).metadata == {"label": "checked"}


def test_status_cancelled_drops_a_queued_rollout_and_queuing_runs_a_finished_one_again(store):
    gone = store.enqueue_rollout("cancel me").rollout_id
    rid = store.enqueue_rollout("retry me", config=RolloutConfig(max_attempts=1)).rollout_id
    assert store.update_rollout(gone, status="cancelled").status == "cancelled"
    item = store.dequeue_rollout("w")
    assert item.rollout.rollout_id == rid  # the cancelled one is never dequeued
    store.update_attempt(rid, item.attempt.attempt_id, status="failed", error="boom")
    assert store.get_rollout_by_id(rid).status == "failed" and store.final_reward(rid) == 0.0
    again = store.update_rollout(rid, status="queuing", input="retry me, fixed", config={"max_attempts": 2})
    assert again.status == "requeuing" and again.end_time is None and again.num_attempts == 1
    assert store.update_rollout(rid, status="queuing").status == "requeuing"  # already queued: no change
    item = store.dequeue_rollout("w")
    assert item.rollout.rollout_id == rid and item.rollout.input == "retry me, fixed" and item.attempt.sequence_id == 2
    assert store.dequeue_rollout() is None  # queued once, not twice
    store.add_span(_span(rid, item.attempt.attempt_id, "reward", **{semconv.REWARD: 0.5}))
    store.update_attempt(rid, item.attempt.attempt_id, status="succeeded")
    assert store.get_rollout_by_id(rid).status == "succeeded" and store.final_reward(rid) == 0.5


# ----- start_attempt ------------------------------------------------------------------------
def test_start_attempt_is_a_manual_retry_for_the_caller(store):
    rid = store.enqueue_rollout("t", config=RolloutConfig(max_attempts=1)).rollout_id
    first = store.dequeue_rollout("w1").attempt
    with pytest.raises(InvalidStatusTransition, match=f"{first.attempt_id} still 'preparing'"):
        store.start_attempt(rid)
    store.update_attempt(rid, first.attempt_id, status="failed", error="flaky tool")
    assert store.get_rollout_by_id(rid).status == "failed"
    item = store.start_attempt(rid, worker_id="me")  # past max_attempts: it is the caller's call
    assert item.attempt.sequence_id == 2 and item.attempt.status == "preparing" and item.attempt.worker_id == "me"
    assert item.rollout.status == "preparing" and item.rollout.end_time is None and item.rollout.num_attempts == 2
    assert store.dequeue_rollout() is None
    assert [w.current_attempt_id for w in store.query_workers() if w.worker_id == "me"] == [item.attempt.attempt_id]
    store.add_span(_span(rid, item.attempt.attempt_id, "reward", **{semconv.REWARD: 1.0}))
    store.update_attempt(rid, item.attempt.attempt_id, status="succeeded")
    assert store.get_rollout_by_id(rid).status == "succeeded" and store.final_reward(rid) == 1.0
    queued = store.enqueue_rollout("t2").rollout_id
    assert store.start_attempt(queued).rollout.status == "preparing"  # taken out of the queue
    assert store.dequeue_rollout() is None
    with pytest.raises(NotFoundError, match="ro-missing"):
        store.start_attempt("ro-missing")


# ----- resources: versions, query, pinning --------------------------------------------------
def test_resources_have_versions_and_rollouts_are_pinned_at_enqueue(store):
    early = store.enqueue_rollout("before any resources")
    assert early.resources_id is None
    a = store.add_resources(_llm(1), resources_id="a")
    assert (a.version, a.create_time) == (1, a.update_time)
    pinned = store.enqueue_rollout("pinned to a")
    started = store.start_rollout("started with a", worker_id="w")
    b = store.add_resources(_llm(2), resources_id="b")
    time.sleep(0.01)
    a2 = store.add_resources(_llm(3), resources_id="a")  # a rewrite: a new version, the latest again
    assert (a2.version, a2.create_time) == (2, a.create_time) and a2.update_time > a.update_time
    assert [(u.resources_id, u.version) for u in store.query_resources()] == [("b", 1), ("a", 2)]
    assert store.get_latest_resources().resources_id == "a"
    assert pinned.resources_id == "a" and started.rollout.resources_id == "a"
    assert store.enqueue_rollout("pinned to the latest").resources_id == "a"
    store.add_resources(_llm(4), resources_id="c")
    items = [store.dequeue_rollout("w") for _ in range(3)]
    assert [(i.rollout.input, i.rollout.resources_id) for i in items] == [
        ("before any resources", None), ("pinned to a", "a"), ("pinned to the latest", "a")]
    df = store.resources_df()
    assert list(df["resources_id"]) == ["b", "a", "c"] and list(df["version"]) == [1, 2, 1]
    assert list(df["latest"]) == [False, False, True] and list(df["rollouts"]) == [0, 3, 0]
    assert df["llm"].iloc[1] == "m @ http://127.0.0.1:3/v1"
    assert str(df["update_time"].dtype) == "datetime64[ns]" and b.version == 1


def test_a_runner_uses_the_resources_pinned_at_enqueue_not_the_latest(store):
    from lightning_nb.runners.runner import Runner
    from lightning_nb.tracing.tracer import Tracer, emit_reward

    seen = []

    def agent(task, llm):
        seen.append(llm.endpoint.split("/rollout/")[0])
        emit_reward(1.0)

    store.add_resources(_llm(1), resources_id="v1")
    rid = store.enqueue_rollout("t").rollout_id
    store.add_resources(_llm(2), resources_id="v2")
    runner = Runner(agent, store, Tracer(store))
    runner.start()
    try:
        assert store.wait_for_rollouts([rid], timeout=30)[0].status == "succeeded"
    finally:
        runner.stop()
        runner.join(10)
    assert seen == ["http://127.0.0.1:1"] and not runner.alive


# ----- spans ---------------------------------------------------------------------------------
def test_a_span_is_a_heartbeat_and_moves_a_preparing_attempt_to_running(store):
    rid = store.enqueue_rollout("t", config=RolloutConfig(unresponsive_seconds=0.8)).rollout_id
    aid = store.dequeue_rollout("w").attempt.attempt_id
    t0 = time.time()
    store.add_span(_span(rid, aid, "llm"))
    (attempt,) = store.query_attempts(rid)
    assert attempt.status == "running" and attempt.last_heartbeat_time >= t0
    assert store.get_rollout_by_id(rid).status == "running"
    (worker,) = store.query_workers()
    assert worker.status == "busy" and worker.last_heartbeat_time >= t0
    for _ in range(8):  # 1.6 s of spans every 0.2 s, twice unresponsive_seconds: alive
        time.sleep(0.2)
        store.add_span(_span(rid, aid, "tool"))
        assert store.sweep_attempts() == []
    time.sleep(1.0)  # silence
    store.sweep_attempts()  # (a StoreServer's background sweep may have come first)
    (attempt,) = store.query_attempts(rid)
    assert attempt.status == "unresponsive" and "no heartbeat" in attempt.error


def test_late_span_heartbeat_and_status_never_revive_an_unresponsive_attempt(store):
    rid = store.enqueue_rollout("t", config=RolloutConfig(unresponsive_seconds=0.2, max_attempts=2)).rollout_id
    old = store.dequeue_rollout("w-dead").attempt.attempt_id
    time.sleep(0.3)
    (ended,) = store.sweep_attempts()
    assert ended.status == "unresponsive" and store.get_rollout_by_id(rid).status == "requeuing"
    with pytest.raises(AttemptEnded, match="already ended 'unresponsive'"):  # refused: nothing stored on it
        store.add_span(_span(rid, old, "reward", **{semconv.REWARD: 1.0}))
    assert store.query_spans(rid, old) == []
    assert store.update_attempt(rid, old, heartbeat=True).status == "unresponsive"
    with pytest.raises(InvalidStatusTransition, match="'unresponsive' to 'succeeded'"):
        store.update_attempt(rid, old, status="succeeded")
    (attempt,) = store.query_attempts(rid)
    assert attempt.status == "unresponsive" and store.get_rollout_by_id(rid).status == "requeuing"
    retry = store.dequeue_rollout("w2").attempt.attempt_id  # the retry runs; the late reward never counts
    store.add_span(_span(rid, retry, "reward", **{semconv.REWARD: 0.25}))
    store.update_attempt(rid, retry, status="succeeded")
    assert store.final_reward(rid) == 0.25


def test_span_ids_are_unique_per_attempt_and_explicit_sequence_ids_are_kept(store):
    rid = store.enqueue_rollout("t").rollout_id
    aid = store.dequeue_rollout("w").attempt.attempt_id
    first = store.add_span(_span(rid, aid, "llm", span_id="a" * 16, tokens=[1, 2]))
    again = store.add_span(_span(rid, aid, "llm", span_id="a" * 16, tokens=[1, 2]))  # a retried write
    assert again.sequence_id == first.sequence_id == 1 and len(store.query_spans(rid)) == 1
    before = _state(store)
    with pytest.raises(ConfigError, match=f"span_id '{'a' * 16}' is already stored .* with other content"):
        store.add_span(_span(rid, aid, "llm", span_id="a" * 16, tokens=[1, 3]))
    assert _state(store) == before
    assert store.add_span(_span(rid, aid, "x", span_id="e" * 16, sequence_id=5)).sequence_id == 5
    assert store.add_span(_span(rid, aid, "y")).sequence_id == 6  # after the highest
    assert store.add_span(_span(rid, aid, "z", sequence_id=3)).sequence_id == 3  # a free one, out of order
    for seq, match in ((5, "sequence_id=5 is taken"), (-1, "sequence_id=-1 is negative")):
        with pytest.raises(ConfigError, match=match):
            store.add_span(_span(rid, aid, "w", sequence_id=seq))
    assert store.add_span(_span(rid, aid, "x", span_id="e" * 16, sequence_id=5)).sequence_id == 5  # same write
    assert [(s.sequence_id, s.name) for s in store.query_spans(rid)] == [(1, "llm"), (3, "z"), (5, "x"), (6, "y")]
    assert list(store.spans_df(rid)["name"]) == ["llm", "z", "x", "y"]
    other = store.enqueue_rollout("u").rollout_id  # ids are per attempt: another attempt may reuse one
    other_aid = store.dequeue_rollout("w").attempt.attempt_id
    assert store.add_span(_span(other, other_aid, "llm", span_id="a" * 16)).sequence_id == 1


def test_add_spans_stores_a_batch_in_order_as_add_span_would(store):
    rid = store.enqueue_rollout("t").rollout_id
    aid = store.dequeue_rollout("w").attempt.attempt_id
    t0 = time.time()
    first = store.add_span(_span(rid, aid, "llm", span_id="a" * 16, tokens=[1, 2]))
    batch = [_span(rid, aid, "tool", tokens=[3]), _span(rid, aid, "x", sequence_id=9),
             _span(rid, aid, "llm", span_id="a" * 16, tokens=[1, 2]),  # the stored one again: a retried write
             _span(rid, aid, "y"), _span(rid, aid, "reward", span_id="b" * 16, **{semconv.REWARD: 0.5}),
             _span(rid, aid, "reward", span_id="b" * 16, **{semconv.REWARD: 0.5})]  # repeated within the batch
    out = store.add_spans(batch)
    assert [(s.sequence_id, s.name) for s in out] == [(2, "tool"), (9, "x"), (1, "llm"), (10, "y"), (11, "reward"),
                                                      (11, "reward")]
    assert out[2] == first and out[0].attributes == {"tokens": [3]}
    assert [(s.sequence_id, s.name) for s in store.query_spans(rid)] == [
        (1, "llm"), (2, "tool"), (9, "x"), (10, "y"), (11, "reward")]
    (attempt,) = store.query_attempts(rid)
    assert attempt.status == "running" and attempt.last_heartbeat_time >= t0  # a batch is a heartbeat too
    out[0].attributes["tokens"].append(99)  # returned objects are the caller's own
    assert store.query_spans(rid)[1].attributes == {"tokens": [3]}
    assert store.add_spans([]) == []


def test_add_spans_is_all_or_nothing_and_names_the_bad_span(store):
    rid = store.enqueue_rollout("t").rollout_id
    aid = store.dequeue_rollout("w").attempt.attempt_id
    store.add_span(_span(rid, aid, "llm", span_id="a" * 16))
    before = _state(store)
    for batch, error, match in [
        ([_span(rid, aid, "ok"), _span(rid, "at-missing", "bad")], NotFoundError, r"spans\[1\]: .*at-missing"),
        ([_span(rid, aid, "ok"), _span(rid, aid, "llm", span_id="a" * 16, other=1)], ConfigError,
         r"spans\[1\]: span_id '" + "a" * 16 + "' is already stored"),
        ([_span(rid, aid, "p", span_id="c" * 16), _span(rid, aid, "q", span_id="c" * 16)], ConfigError,
         r"spans\[1\]: span_id '" + "c" * 16 + "'"),  # a clash within the batch
        ([_span(rid, aid, "s", sequence_id=4), _span(rid, aid, "t", sequence_id=4)], ConfigError,
         r"spans\[1\]: .*sequence_id=4 is taken"),
        ([_span(rid, aid, "ok"), "not a span"], ConfigError, r"spans\[1\] must be a lightning_nb.types.Span"),
    ]:
        with pytest.raises(error, match=match):
            store.add_spans(batch)
        assert _state(store) == before, match


# ----- the watchdog for polling callers -----------------------------------------------------
def test_a_polling_caller_sees_a_dead_runners_attempt_end(store):
    rid = store.enqueue_rollout("t", config=RolloutConfig(unresponsive_seconds=0.2)).rollout_id
    store.dequeue_rollout("w-dies")  # ... and never reports again
    deadline = time.monotonic() + 10
    done = []
    while not done and time.monotonic() < deadline:  # the loop completed_since's docstring suggests
        done = store.completed_since(0.0)
        time.sleep(0.1)
    assert [(r.rollout_id, r.status) for r in done] == [(rid, "failed")]
    (attempt,) = store.query_attempts(rid)
    assert attempt.status == "unresponsive" and "no heartbeat" in attempt.error


def test_store_server_sweeps_in_the_background_with_no_client_calls():
    class Counting(InMemoryStore):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.ended = []

        def sweep_attempts(self):
            out = super().sweep_attempts()
            self.ended.extend(out)
            return out

    backing = Counting(watchdog_interval_s=3600)  # its own lazy watchdog is never due again
    with StoreServer(backing, sweep_interval_s=0.1) as server, StoreClient(server.url) as client:
        rid = client.enqueue_rollout("t", config=RolloutConfig(unresponsive_seconds=0.2)).rollout_id
        backing.get_rollout_by_id(rid)  # spends the lazy watchdog's first turn
        client.dequeue_rollout("w-dies")
        deadline = time.monotonic() + 10
        while not backing.ended and time.monotonic() < deadline:
            time.sleep(0.05)  # no request reaches the server meanwhile
        assert [(a.rollout_id, a.status) for a in backing.ended] == [(rid, "unresponsive")]
        assert client.get_rollout_by_id(rid).status == "failed"
    with pytest.raises(ConfigError, match="sweep_interval_s"):
        StoreServer(InMemoryStore(), sweep_interval_s=0)


# ----- views ---------------------------------------------------------------------------------
def test_attempt_and_worker_views_have_datetimes_and_useful_columns_first(store):
    rid = store.enqueue_rollout("t").rollout_id
    aid = store.dequeue_rollout("w").attempt.attempt_id
    store.update_attempt(rid, aid, status="failed", error="boom", heartbeat=True)
    store.enqueue_rollout("u")
    store.dequeue_rollout("w")
    df = store.attempts_df()
    assert list(df.columns[:4]) == ["rollout_id", "attempt_id", "sequence_id", "status"]
    for col in ("start_time", "end_time", "last_heartbeat_time"):
        assert str(df[col].dtype) == "datetime64[ns]"
    assert df["end_time"].isna().tolist() == [False, True] and df["duration_s"].iloc[0] >= 0
    assert pd.isna(df["duration_s"].iloc[1]) and df["error"].iloc[0] == "boom" and pd.isna(df["error"].iloc[1])
    assert abs(df["start_time"].iloc[0] - pd.Timestamp.utcnow().tz_localize(None)) < pd.Timedelta(minutes=1)
    workers = store.workers_df()
    for col in ("first_seen_time", "last_heartbeat_time", "last_dequeue_time"):
        assert str(workers[col].dtype) == "datetime64[ns]"


@pytest.mark.parametrize("ending", ["failed", "timeout"])
def test_no_span_is_stored_on_an_attempt_that_ended_without_success(store, ending):
    """A late answer (an abandoned agent's tool, reward and agent spans) is refused on every path: add_span,
    add_spans, add_otel_spans; a repeat of a span stored before the end is still the same write."""
    from opentelemetry.sdk.trace import TracerProvider

    rid = store.enqueue_rollout("t", config=RolloutConfig(max_attempts=2)).rollout_id
    aid = store.dequeue_rollout("w").attempt.attempt_id
    before_end = store.add_span(_span(rid, aid, "tool:rollout_server", span_id="b" * 16))
    store.update_attempt(rid, aid, status=ending, error="ran past timeout_seconds")
    late = [_span(rid, aid, name, **attrs) for name, attrs in
            (("tool:rollout_server", {}), ("reward", {semconv.REWARD: 1.0}), ("agent", {}))]
    with pytest.raises(AttemptEnded, match=f"already ended '{ending}'"):
        store.add_span(late[1])
    with pytest.raises(AttemptEnded, match=r"spans\[0\]: .*already ended"):
        store.add_spans(late)
    with TracerProvider().get_tracer("t").start_as_current_span("agent") as otel:
        pass
    with pytest.raises(InvalidStatusTransition):  # AttemptEnded is one: a runner's except clauses still catch it
        store.add_otel_spans(rid, aid, [otel])
    assert store.add_span(_span(rid, aid, "tool:rollout_server", span_id="b" * 16)).sequence_id == \
        before_end.sequence_id  # a retried write of a span stored before the end
    assert [s.name for s in store.query_spans(rid, aid)] == ["tool:rollout_server"]
    assert store.get_rollout_by_id(rid).status == "requeuing" and store.final_rewards()[rid] is None
    retry = store.dequeue_rollout("w2").attempt.attempt_id  # the retry is a new attempt: it takes spans
    store.add_span(_span(rid, retry, "reward", **{semconv.REWARD: 0.5}))
    store.update_attempt(rid, retry, status="succeeded")
    label = store.label(rid, 1.0)  # a succeeded attempt still takes late spans (a label, a judge)
    assert label.attempt_id == retry and store.final_reward(rid) == 1.0


def test_rollouts_df_flags_a_succeeded_rollout_without_llm_call(store):
    def finish(name, llm_spans, status="succeeded"):
        item = store.start_rollout(name)
        rid, aid = item.rollout.rollout_id, item.attempt.attempt_id
        for _ in range(llm_spans):
            store.add_span(_span(rid, aid, semconv.LLM_SPAN))
        store.add_span(_span(rid, aid, semconv.REWARD_SPAN, **{semconv.REWARD: 1.0}))
        store.update_attempt(rid, aid, status=status)
        return rid

    called, silent, failed = finish("called", 2), finish("silent", 0), finish("failed", 0, "failed")
    running = store.start_rollout("running").rollout.rollout_id
    df = store.rollouts_df().set_index("rollout_id")
    assert df["llm_calls"].to_dict() == {called: 2, silent: 0, failed: 0, running: 0}
    assert df["no_llm_call"].to_dict() == {called: False, silent: True, failed: False, running: False}
    assert df["llm_calls"].dtype == "int64" and df["no_llm_call"].dtype == "bool"
    assert store.llm_call_counts([silent, called]) == {silent: 0, called: 2}
    with pytest.raises(NotFoundError, match="nope"):
        store.llm_call_counts(["nope"])

