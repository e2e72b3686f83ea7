"""The store contract, run against every backend (see conftest.STORE_BACKENDS)."""

from __future__ import annotations

import threading
import time

import pandas as pd
import pytest

from lightning_nb.errors import ConfigError, InvalidStatusTransition, NotFoundError
from lightning_nb.types import LLMResource, RolloutConfig, Span


def _span(rollout_id, attempt_id, name="x", **attrs):
    return Span(rollout_id=rollout_id, attempt_id=attempt_id, trace_id="t" * 32, span_id="s" * 16,
                name=name, start_time=1.0, end_time=2.0, attributes=attrs)


def test_enqueue_dequeue_finish_and_views(store):
    r = store.enqueue_rollout({"q": 1})
    assert store.get_rollout_by_id(r.rollout_id).status == "queuing"
    item = store.dequeue_rollout("w0")
    assert item.rollout.rollout_id == r.rollout_id and item.attempt.sequence_id == 1
    store.update_attempt(r.rollout_id, item.attempt.attempt_id, status="running")
    assert store.get_rollout_by_id(r.rollout_id).status == "running"
    stored = store.add_span(_span(r.rollout_id, item.attempt.attempt_id, "reward", reward=1.0))
    assert stored.sequence_id == 1
    store.update_attempt(r.rollout_id, item.attempt.attempt_id, status="succeeded")
    assert store.get_rollout_by_id(r.rollout_id).status == "succeeded"
    assert store.dequeue_rollout() is None
    df = store.rollouts_df()
    assert list(df["reward"]) == [1.0] and list(df["status"]) == ["succeeded"]
    assert store.spans_df().loc[0, "name"] == "reward"
    assert store.rewards_df()["reward"].tolist() == [1.0]


def test_eight_threads_each_rollout_dequeued_exactly_once(store):
    n = 400
    ids = {store.enqueue_rollout(i).rollout_id for i in range(n)}
    seen: list[str] = []
    lock = threading.Lock()

    def work(wid):
        while (item := store.dequeue_rollout(f"w{wid}")) is not None:
            rid, aid = item.rollout.rollout_id, item.attempt.attempt_id
            store.update_attempt(rid, aid, status="running")
            for k in range(3):
                store.add_span(_span(rid, aid, f"s{k}"))
            store.update_attempt(rid, aid, status="succeeded")
            with lock:
                seen.append(rid)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(seen) == sorted(ids)
    assert len(store.wait_for_rollouts(list(ids), timeout=5)) == n
    spans = store.query_spans()
    assert len(spans) == 3 * n
    for rid in list(ids)[:20]:
        assert [s.sequence_id for s in store.query_spans(rid)] == [1, 2, 3]


def test_failed_attempt_requeues_until_max_attempts(store):
    r = store.enqueue_rollout("t", config=RolloutConfig(max_attempts=2))
    a1 = store.dequeue_rollout().attempt
    store.update_attempt(r.rollout_id, a1.attempt_id, status="failed", error="boom")
    assert store.get_rollout_by_id(r.rollout_id).status == "requeuing"
    a2 = store.dequeue_rollout().attempt
    assert a2.sequence_id == 2
    store.update_attempt(r.rollout_id, a2.attempt_id, status="timeout")
    assert store.get_rollout_by_id(r.rollout_id).status == "failed"
    assert [a.status for a in store.query_attempts(r.rollout_id)] == ["failed", "timeout"]
    assert store.query_attempts(r.rollout_id)[0].error == "boom"


def test_terminal_attempt_cannot_change_and_nothing_is_lost(store):
    r = store.enqueue_rollout("t")
    a = store.dequeue_rollout().attempt
    store.add_span(_span(r.rollout_id, a.attempt_id))
    store.update_attempt(r.rollout_id, a.attempt_id, status="succeeded")
    with pytest.raises(InvalidStatusTransition, match="succeeded"):
        store.update_attempt(r.rollout_id, a.attempt_id, status="running")
    assert store.get_rollout_by_id(r.rollout_id).status == "succeeded"
    assert len(store.query_spans(r.rollout_id)) == 1


def test_unknown_ids_raise_not_found_naming_the_id(store):
    r = store.enqueue_rollout("t")
    with pytest.raises(NotFoundError, match="ro-missing"):
        store.get_rollout_by_id("ro-missing")
    with pytest.raises(NotFoundError, match="ro-missing"):
        store.add_span(_span("ro-missing", "at-x"))
    with pytest.raises(NotFoundError, match="at-missing"):
        store.update_attempt(r.rollout_id, "at-missing", status="running")
    with pytest.raises(NotFoundError, match="ro-missing"):
        store.wait_for_rollouts([r.rollout_id, "ro-missing"], timeout=0.1)
    with pytest.raises(KeyError):  # NotFoundError is also a KeyError
        store.get_resources_by_id("res-missing")
    assert [x.rollout_id for x in store.query_rollouts()] == [r.rollout_id]


def test_cancelled_rollout_is_never_dequeued(store):
    r = store.enqueue_rollout("t")
    store.cancel_rollout(r.rollout_id)
    assert store.dequeue_rollout() is None
    assert store.wait_for_rollouts([r.rollout_id], timeout=0.1)[0].status == "cancelled"


def test_dequeue_waits_for_a_rollout_enqueued_later(store):
    timer = threading.Timer(0.2, lambda: store.enqueue_rollout("late"))
    timer.start()
    item = store.dequeue_rollout(timeout=5)
    assert item is not None and item.rollout.input == "late"


def test_resources_latest_and_by_id(store):
    assert store.get_latest_resources() is None
    first = store.add_resources({"main_llm": LLMResource(endpoint="http://127.0.0.1:1/v1", model="m")})
    second = store.add_resources({"main_llm": {"endpoint": "http://127.0.0.1:2/v1", "model": "m"}})
    assert store.get_latest_resources().resources_id == second.resources_id
    assert store.get_resources_by_id(first.resources_id).resources["main_llm"].endpoint.endswith(":1/v1")
    with pytest.raises(ConfigError, match="resources"):
        store.add_resources({"main_llm": 42})
    with pytest.raises(NotFoundError):
        store.enqueue_rollout("t", resources_id="res-nope")
    assert len(store.query_rollouts()) == 0


def test_empty_views_have_columns(store):
    assert isinstance(store.spans_df(), pd.DataFrame)
    assert {"rollout_id", "name", "prompt_tokens"} <= set(store.spans_df().columns)
    assert "reward" in store.rollouts_df().columns


# ----- online mode: start_rollout, Runner.step, completed_since -------------------------
def test_started_rollout_is_never_dequeued_and_runs_to_success(store):
    queued = store.enqueue_rollout("queued")
    item = store.start_rollout({"q": 2}, mode="val", metadata={"k": "v"}, worker_id="me")
    rid, aid = item.rollout.rollout_id, item.attempt.attempt_id
    assert item.rollout.status == "preparing" and item.attempt.status == "preparing"
    assert item.rollout.num_attempts == 1 and item.attempt.sequence_id == 1 and item.attempt.worker_id == "me"
    got = store.get_rollout_by_id(rid)
    assert got.status == "preparing" and got.mode == "val" and got.metadata == {"k": "v"}
    assert store.dequeue_rollout("w").rollout.rollout_id == queued.rollout_id
    assert store.dequeue_rollout("w", timeout=0.1) is None
    store.update_attempt(rid, aid, status="running")
    store.add_span(_span(rid, aid, "reward", reward=0.5))
    store.update_attempt(rid, aid, status="succeeded")
    assert store.get_rollout_by_id(rid).status == "succeeded" and store.final_reward(rid) == 0.5
    assert [a.attempt_id for a in store.query_attempts(rid)] == [aid]
    with pytest.raises(NotFoundError, match="res-nope"):
        store.start_rollout("t", resources_id="res-nope")
    assert len(store.query_rollouts()) == 2


def test_runner_step_records_spans_and_reward(store):
    from lightning_nb.runner import Runner
    from lightning_nb.tracer import Tracer, emit_reward

    seen = []

    def agent(task, llm):
        seen.append(llm.endpoint)
        emit_reward(float(task["x"]))

    runner = Runner(agent, store, Tracer(store))
    res = {"main_llm": LLMResource(endpoint="http://127.0.0.1:9/v1", model="m")}
    done = runner.step({"x": 0.75}, resources=res)
    assert done.status == "succeeded" and not runner.alive
    assert done.resources_id == store.get_latest_resources().resources_id
    assert store.final_reward(done.rollout_id) == 0.75
    assert [s.name for s in store.query_spans(done.rollout_id)] == ["reward", "agent"]
    assert seen == [f"http://127.0.0.1:9/rollout/{done.rollout_id}/attempt/"
                    f"{store.query_attempts(done.rollout_id)[0].attempt_id}/v1"]
    again = runner.step({"x": 0.25})  # resources=None: the latest set
    assert again.status == "succeeded" and again.resources_id is None
    assert store.final_reward(again.rollout_id) == 0.25
    assert store.dequeue_rollout() is None
    with pytest.raises(ConfigError, match="resources"):
        runner.step({"x": 1.0}, resources="main_llm")


def test_completed_since_returns_only_rollouts_finished_after(store):
    def finish(task):
        item = store.start_rollout(task)
        store.update_attempt(item.rollout.rollout_id, item.attempt.attempt_id, status="succeeded")
        return store.get_rollout_by_id(item.rollout.rollout_id)

    assert store.completed_since(0.0) == []
    first = finish("a")
    time.sleep(0.01)
    second = finish("b")
    running = store.start_rollout("c").rollout.rollout_id
    queued = store.enqueue_rollout("d").rollout_id
    assert [r.rollout_id for r in store.completed_since(0.0)] == [first.rollout_id, second.rollout_id]
    assert [r.rollout_id for r in store.completed_since(first.end_time)] == [second.rollout_id]
    assert store.completed_since(second.end_time) == []
    store.cancel_rollout(queued)
    assert [r.rollout_id for r in store.completed_since(second.end_time)] == [queued]
    assert running not in {r.rollout_id for r in store.completed_since(0.0)}
