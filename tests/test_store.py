"""The store contract, run against every backend (see conftest.STORE_BACKENDS)."""

from __future__ import annotations

import os
import random
import re
import threading
import uuid
import time

import pandas as pd
import pytest

from lightning_nb import semconv
from lightning_nb.errors import ConfigError, InvalidStatusTransition, NotFoundError
from lightning_nb.types import LLMResource, RolloutConfig, Span, new_id


def _span(rollout_id, attempt_id, name="x", **attrs):
    return Span(rollout_id=rollout_id, attempt_id=attempt_id, trace_id="t" * 32, span_id=uuid.uuid4().hex[:16],
                name=name, start_time=1.0, end_time=2.0, attributes=attrs)


def test_enqueue_dequeue_finish_and_views(store):
    r = store.enqueue_rollout({"q": 1})
    assert store.get_rollout_by_id(r.rollout_id).status == "queuing"
    item = store.dequeue_rollout("w0")
    assert item.rollout.rollout_id == r.rollout_id and item.attempt.sequence_id == 1
    store.update_attempt(r.rollout_id, item.attempt.attempt_id, status="running")
    assert store.get_rollout_by_id(r.rollout_id).status == "running"
    stored = store.add_span(_span(r.rollout_id, item.attempt.attempt_id, "reward", **{semconv.REWARD: 1.0}))
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


def test_enqueue_rollouts_queues_in_order_with_the_options_all_or_none(store):
    res = store.add_resources({"main_llm": LLMResource(endpoint="http://127.0.0.1:1/v1", model="m")})
    cfg = RolloutConfig(max_attempts=2)
    out = store.enqueue_rollouts([{"q": i} for i in range(4)], mode="val", config=cfg, metadata={"group_id": "g"})
    assert [r.input for r in out] == [{"q": i} for i in range(4)]
    assert {(r.mode, r.resources_id, r.config.max_attempts, r.metadata["group_id"], r.status) for r in out} == \
        {("val", res.resources_id, 2, "g", "queuing")}
    assert store.enqueue_rollouts([]) == []
    with pytest.raises(NotFoundError, match="res-nope"):
        store.enqueue_rollouts(["a", "b"], resources_id="res-nope")
    assert len(store.query_rollouts()) == 4  # nothing of the refused batch
    assert [store.dequeue_rollout().rollout.rollout_id for _ in range(4)] == [r.rollout_id for r in out]


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
    store.add_span(_span(rid, aid, "reward", **{semconv.REWARD: 0.5}))
    store.update_attempt(rid, aid, status="succeeded")
    assert store.get_rollout_by_id(rid).status == "succeeded" and store.final_reward(rid) == 0.5
    assert [a.attempt_id for a in store.query_attempts(rid)] == [aid]
    with pytest.raises(NotFoundError, match="res-nope"):
        store.start_rollout("t", resources_id="res-nope")
    assert len(store.query_rollouts()) == 2


def test_runner_step_records_spans_and_reward(store):
    from lightning_nb.runners.runner import Runner
    from lightning_nb.tracing.tracer import Tracer, emit_reward

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
    again = runner.step({"x": 0.25})  # resources=None: pinned to the latest set when it was started
    assert again.status == "succeeded" and again.resources_id == done.resources_id
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


# ----- views: rollouts_df, episodes_df, workers; returned objects are copies --------------
def _llm_span(rollout_id, attempt_id, text):
    from lightning_nb.semconv import LLM_SPAN as LLM_SPAN_NAME

    return Span(rollout_id=rollout_id, attempt_id=attempt_id, trace_id="t" * 32, span_id=uuid.uuid4().hex[:16],
                name=LLM_SPAN_NAME, start_time=1.0, end_time=2.0,
                attributes={"gen_ai.completion": text, semconv.COMPLETION_TOKEN_IDS: [1, 2]})


def test_rollouts_df_times_are_datetimes_and_numbers_are_never_none(store):
    empty = store.rollouts_df()
    assert [str(empty[c].dtype)[:10] for c in ("enqueue_time", "start_time", "end_time")] == ["datetime64"] * 3
    queued = store.enqueue_rollout("queued")
    cancelled = store.enqueue_rollout("cancelled")
    store.cancel_rollout(cancelled.rollout_id)  # ended without ever starting
    done = store.start_rollout("done")
    store.add_span(_span(done.rollout.rollout_id, done.attempt.attempt_id, "reward", **{semconv.REWARD: 0.5}))
    store.update_attempt(done.rollout.rollout_id, done.attempt.attempt_id, status="succeeded")
    failed = store.start_rollout("failed")
    store.update_attempt(failed.rollout.rollout_id, failed.attempt.attempt_id, status="failed", error="boom")
    running = store.start_rollout("running")
    df = store.rollouts_df().set_index("rollout_id")
    assert list(store.rollouts_df().columns) == ["rollout_id", "input", "status", "reward", "llm_calls",
                                                 "no_llm_call", "mode", "num_attempts", "duration_s",
                                                 "resources_id", "enqueue_time", "start_time", "end_time"]
    for col in ("enqueue_time", "start_time", "end_time"):
        assert str(df[col].dtype).startswith("datetime64"), (col, df[col].dtype)
    assert df["reward"].dtype == "float64" and df["duration_s"].dtype == "float64"
    assert df["num_attempts"].dtype == "int64"
    for rollout in store.query_rollouts():  # the datetimes are the stored epoch seconds, in UTC
        got = df.loc[rollout.rollout_id, "enqueue_time"]
        assert abs((got - pd.Timestamp(rollout.enqueue_time, unit="s")).total_seconds()) < 1e-3
    assert pd.isna(df.loc[queued.rollout_id, "start_time"]) and pd.isna(df.loc[queued.rollout_id, "end_time"])
    assert pd.isna(df.loc[cancelled.rollout_id, "start_time"]) and not pd.isna(df.loc[cancelled.rollout_id, "end_time"])
    assert pd.isna(df.loc[running.rollout.rollout_id, "end_time"])
    assert df.loc[done.rollout.rollout_id, "end_time"] >= df.loc[done.rollout.rollout_id, "start_time"]
    rewards = df["reward"].to_dict()
    assert rewards[done.rollout.rollout_id] == 0.5 and rewards[failed.rollout.rollout_id] == 0.0
    assert all(pd.isna(rewards[r]) for r in (queued.rollout_id, cancelled.rollout_id, running.rollout.rollout_id))
    assert df.loc[done.rollout.rollout_id, "duration_s"] >= 0 and pd.isna(df.loc[queued.rollout_id, "duration_s"])
    assert df["reward"].map(type).eq(float).all() and df["duration_s"].map(type).eq(float).all()  # NaN, never None


def test_episodes_df_shows_input_completions_and_reward_side_by_side(store):
    ok = store.start_rollout({"q": "2+2"}, metadata={"group_id": "g1"})
    rid, aid = ok.rollout.rollout_id, ok.attempt.attempt_id
    store.add_span(_llm_span(rid, aid, "let me think"))
    store.add_span(_span(rid, aid, "tool"))
    store.add_span(_llm_span(rid, aid, "4"))
    store.add_span(_span(rid, aid, "reward", **{semconv.REWARD: 0.75}))
    store.update_attempt(rid, aid, status="succeeded")
    retried = store.enqueue_rollout("retried", config=RolloutConfig(max_attempts=2), metadata={"group_id": "g1"})
    first = store.dequeue_rollout("w")
    store.add_span(_llm_span(retried.rollout_id, first.attempt.attempt_id, "old try"))
    store.update_attempt(retried.rollout_id, first.attempt.attempt_id, status="failed", error="first crash")
    second = store.dequeue_rollout("w")
    store.add_span(_llm_span(retried.rollout_id, second.attempt.attempt_id, "new try"))
    store.add_span(_span(retried.rollout_id, second.attempt.attempt_id, "reward", **{semconv.REWARD: 1.0}))
    store.update_attempt(retried.rollout_id, second.attempt.attempt_id, status="succeeded")
    bad = store.start_rollout("bad")
    store.add_span(_llm_span(bad.rollout.rollout_id, bad.attempt.attempt_id, "oops"))
    store.update_attempt(bad.rollout.rollout_id, bad.attempt.attempt_id, status="failed", error="boom")
    val = store.start_rollout("v" * 300, mode="val")  # succeeded without a reward span
    store.update_attempt(val.rollout.rollout_id, val.attempt.attempt_id, status="succeeded")
    store.cancel_rollout(store.enqueue_rollout("cancelled").rollout_id)
    store.start_rollout("running")

    df = store.episodes_df()
    assert list(df.columns) == ["rollout_id", "mode", "status", "group_id", "input", "completions", "llm_calls",
                                "reward", "attempts", "duration_s", "error", "parent_rollout_id", "branch_call"]
    assert df["rollout_id"].tolist() == [rid, retried.rollout_id, bad.rollout.rollout_id, val.rollout.rollout_id]
    rows = df.set_index("rollout_id").to_dict("index")
    assert rows[rid]["completions"] == "let me think\n---\n4" and rows[rid]["llm_calls"] == 2
    assert rows[rid]["reward"] == 0.75 and rows[rid]["group_id"] == "g1" and rows[rid]["input"] == '{"q": "2+2"}'
    assert pd.isna(rows[rid]["error"]) and rows[rid]["duration_s"] >= 0 and rows[rid]["status"] == "succeeded"
    again = rows[retried.rollout_id]  # only the latest attempt counts
    assert (again["completions"], again["llm_calls"], again["reward"], again["attempts"]) == ("new try", 1, 1.0, 2)
    assert pd.isna(again["error"])
    failed = rows[bad.rollout.rollout_id]
    assert (failed["status"], failed["reward"], failed["error"]) == ("failed", 0.0, "boom")
    assert failed["completions"] == "oops"
    assert pd.isna(failed["group_id"])
    v = rows[val.rollout.rollout_id]
    assert v["mode"] == "val" and pd.isna(v["reward"]) and v["llm_calls"] == 0 and v["completions"] == ""
    assert len(v["input"]) == 120 and v["input"].endswith("…")
    assert df["llm_calls"].dtype == "int64" and df["reward"].dtype == "float64" and df["attempts"].dtype == "int64"
    assert store.episodes_df(mode="val")["rollout_id"].tolist() == [val.rollout.rollout_id]
    assert store.episodes_df(mode="test").empty and list(store.episodes_df(mode="test").columns) == list(df.columns)
    with pytest.raises(ConfigError, match="mode"):
        store.episodes_df(mode="eval")


def test_episode_gives_calls_tools_rewards_and_status_of_the_latest_attempt(store):
    """store.episode(): every backend builds it from its spans alike (the LLM calls of the latest attempt only,
    numbered from 1; the tool span between them; the final reward and the shaping component)."""
    import json

    ok = store.start_rollout({"q": "2+2"}, metadata={"group_id": "g1"})
    rid, aid = ok.rollout.rollout_id, ok.attempt.attempt_id
    first = _llm_span(rid, aid, "CALC: 2 + 2")
    first.attributes.update({semconv.PROMPT: json.dumps([{"role": "user", "content": "2+2?"}]),
                             semconv.PROMPT_TOKEN_IDS: [5, 6], semconv.LOGPROBS: [-0.5, -0.25],
                             semconv.RESPONSE_FINISH_REASONS: ["stop"], semconv.REQUEST_TEMPERATURE: 0.7,
                             semconv.WEIGHT_VERSION: 3})
    store.add_span(first)
    store.add_span(_span(rid, aid, "tool:calculator", **{semconv.TOOL_NAME: "calculator", semconv.TOOL_INPUT: "2 + 2",
                                                         semconv.TOOL_OUTPUT: "4"}))
    store.add_span(_span(rid, aid, "intermediate_reward", **{semconv.REWARD: 0.2, semconv.REWARD_NAME: "shaping"}))
    store.add_span(_llm_span(rid, aid, "ANSWER: 4"))
    store.add_span(_span(rid, aid, "reward", **{semconv.REWARD: 1.0}))
    store.update_attempt(rid, aid, status="succeeded")
    ep = store.episode(rid)
    assert (ep.rollout_id, ep.attempt_id, ep.status, ep.attempt_status, ep.group_id) == (rid, aid, "succeeded",
                                                                                          "succeeded", "g1")
    assert ep.task == {"q": "2+2"} and ep.reward == 1.0 and ep.components == {"shaping": 0.2}
    assert [c.call for c in ep.calls] == [1, 2] and ep.replies == ["CALC: 2 + 2", "ANSWER: 4"]
    one = ep.calls[0]
    assert one.messages == [{"role": "user", "content": "2+2?"}] and one.prompt_ids == [5, 6]
    assert one.completion_ids == [1, 2] and one.logprobs == [-0.5, -0.25] and one.finish_reason == "stop"
    assert one.request == {"temperature": 0.7} and one.weight_version == 3 and not one.replayed
    assert [(t.name, t.input, t.output, t.after_call) for t in ep.tools] == [("calculator", "2 + 2", "4", 1)]
    assert ep.final_reply == "ANSWER: 4" and ep.parent_rollout_id is None and ep.branch_call is None
    assert list(ep.to_frame()["call"]) == [1, 2] and "ANSWER: 4" in ep._repr_html_()

    retried = store.enqueue_rollout("retried", config=RolloutConfig(max_attempts=2))
    a1 = store.dequeue_rollout("w")
    store.add_span(_llm_span(retried.rollout_id, a1.attempt.attempt_id, "old try"))
    store.update_attempt(retried.rollout_id, a1.attempt.attempt_id, status="failed", error="first crash")
    a2 = store.dequeue_rollout("w")
    store.add_span(_llm_span(retried.rollout_id, a2.attempt.attempt_id, "new try"))
    store.update_attempt(retried.rollout_id, a2.attempt.attempt_id, status="failed", error="second crash")
    ep = store.episode(retried.rollout_id)
    assert ep.replies == ["new try"] and ep.attempt_id == a2.attempt.attempt_id and ep.status == "failed"
    assert ep.reward == 0.0 and ep.error == "second crash" and ep.group_id is None
    queued = store.enqueue_rollout("queued")
    ep = store.episode(queued.rollout_id)
    assert ep.calls == [] and ep.attempt_id is None and ep.reward is None and ep.final_reply == ""
    assert [e.rollout_id for e in store.episodes()] == [rid, retried.rollout_id]
    with pytest.raises(NotFoundError):
        store.episode("nope")


def test_episodes_df_reads_the_spans_once():
    from lightning_nb.store import InMemoryStore

    class Counting(InMemoryStore):
        calls = 0

        def query_spans(self, *args, **kwargs):
            Counting.calls += 1
            return super().query_spans(*args, **kwargs)

    store = Counting()
    for i in range(50):
        it = store.start_rollout(i)
        store.add_span(_llm_span(it.rollout.rollout_id, it.attempt.attempt_id, str(i)))
        store.add_span(_span(it.rollout.rollout_id, it.attempt.attempt_id, "reward", **{semconv.REWARD: float(i % 2)}))
        store.update_attempt(it.rollout.rollout_id, it.attempt.attempt_id, status="succeeded")
    df = store.episodes_df()
    assert Counting.calls == 1 and len(df) == 50 and df["reward"].tolist() == [float(i % 2) for i in range(50)]


def test_watchdog_leaves_a_silent_workers_last_heartbeat_alone(store):
    rid = store.enqueue_rollout("x", config=RolloutConfig(unresponsive_seconds=0.2)).rollout_id
    store.dequeue_rollout("w-silent")
    (before,) = store.query_workers()
    time.sleep(0.3)
    store.sweep_attempts()  # (a StoreServer's background sweep may have come first)
    (ended,) = store.query_attempts(rid)
    assert ended.status == "unresponsive"
    (after,) = store.query_workers()
    assert after.status == "unresponsive" and after.current_attempt_id is None
    assert after.last_heartbeat_time == before.last_heartbeat_time  # the watchdog is not a sign of life
    assert store.workers_df()["heartbeat_age_s"].iloc[0] >= 0.3


def test_returned_and_given_objects_are_never_shared_with_the_store(store):
    task = {"q": [1, 2]}
    meta = {"group_id": "g", "sampling": {"temperature": 0.7}}
    llm = LLMResource(endpoint="http://127.0.0.1:9/v1", model="m")
    res = store.add_resources({"main_llm": llm})
    r = store.enqueue_rollout(task, metadata=meta, resources_id=res.resources_id)
    task["q"].append(3)  # the caller changes what it passed
    meta["sampling"]["temperature"] = 0.0
    llm.model = "changed"
    r.metadata["sampling"]["temperature"] = 2.0  # ... and what it got back
    r.input["q"].append(4)
    item = store.dequeue_rollout("w")
    item.rollout.metadata["group_id"] = "mutated"
    store.query_rollouts()[0].metadata["extra"] = 1
    store.get_rollout_by_id(r.rollout_id).input["q"].clear()
    got = store.get_rollout_by_id(r.rollout_id)
    assert got.input == {"q": [1, 2]} and got.metadata == {"group_id": "g", "sampling": {"temperature": 0.7}}
    store.get_latest_resources().resources["main_llm"].model = "mutated"
    store.get_resources_by_id(res.resources_id).resources.clear()
    assert store.get_latest_resources().resources["main_llm"].model == "m"
    stats = {"counts": {"ok": 1}}
    w = store.update_worker("w", heartbeat_stats=stats)
    stats["counts"]["ok"] = 97
    w.heartbeat_stats["counts"]["ok"] = 99
    store.query_workers()[0].heartbeat_stats["counts"]["ok"] = 98
    assert store.query_workers()[0].heartbeat_stats == {"counts": {"ok": 1}}
    span = _span(r.rollout_id, item.attempt.attempt_id, "llm", token_ids=[1, 2])
    stored = store.add_span(span)
    span.attributes["token_ids"].append(3)
    stored.attributes["token_ids"].append(4)
    store.query_spans(r.rollout_id)[0].attributes["token_ids"].append(5)
    assert store.query_spans()[0].attributes["token_ids"] == [1, 2]
    new_meta = {"labels": ["a"]}
    updated = store.update_rollout(r.rollout_id, metadata=new_meta)
    new_meta["labels"].append("b")
    updated.metadata["labels"].append("c")
    assert store.get_rollout_by_id(r.rollout_id).metadata == {"labels": ["a"]}
    store.query_resources()[0].resources.clear()
    store.query_resources()[0].resources["main_llm"].model = "mutated"
    assert store.query_resources()[0].resources["main_llm"].model == "m"
    store.update_attempt(r.rollout_id, item.attempt.attempt_id, status="failed")
    retry = store.start_attempt(r.rollout_id)
    retry.rollout.input["q"].append(6)
    retry.attempt.error = "mutated"
    assert store.get_rollout_by_id(r.rollout_id).input == {"q": [1, 2]}
    assert store.query_attempts(r.rollout_id)[-1].error is None


def test_ids_survive_random_seed_and_fork():
    """Rollout, attempt and resources ids come from a private generator: a notebook's random.seed() does not
    make two runs repeat ids (a durable store keeps both runs), and a forked child is reseeded, so it does not
    repeat its parent's next ids."""
    saved = random.getstate()  # leave the global generator as the other tests found it
    try:
        random.seed(0)
        first = [new_id("ro") for _ in range(3)]
        random.seed(0)
        second = [new_id("ro") for _ in range(3)]
    finally:
        random.setstate(saved)
    assert not set(first) & set(second)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next three ids, then leave at once
        os.write(write, " ".join(new_id("ro") for _ in range(3)).encode())
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    child = os.read(read, 1000).decode().split()
    os.close(read)
    parent = [new_id("ro") for _ in range(3)]
    assert len(child) == 3 and not set(child) & set(parent)
    assert all(re.fullmatch(r"ro-[0-9a-f]{12}", i) for i in first + child + parent)


def test_the_training_record_keeps_each_updates_marks_all_or_nothing(store):
    """Issue 53 item 2: which update of which learner trained on each rollout, on every backend."""
    ids = [store.enqueue_rollout(i).rollout_id for i in range(3)]
    marks = store.mark_trained(ids[:2], learner="traffic-a", update=1)
    assert [(m.rollout_id, m.learner, m.update) for m in marks] == [(ids[0], "traffic-a", 1), (ids[1], "traffic-a", 1)]
    assert marks[0].time == pytest.approx(time.time(), abs=60)
    with pytest.raises(NotFoundError, match="rollout_id 'ro-unknown' is not in the store"):
        store.mark_trained([ids[2], "ro-unknown"], learner="traffic-b", update=1)
    for bad, match in ((dict(learner="", update=1), "learner must be a non-empty str"),
                       (dict(learner="b", update=0), "update must be the learner's 1-based update number"),
                       (dict(learner="b", update=True), "update must be")):
        with pytest.raises(ConfigError, match=match):
            store.mark_trained([ids[2]], **bad)
    with pytest.raises(ConfigError, match="repeats an id"):
        store.mark_trained([ids[2], ids[2]], learner="b", update=1)
    assert store.query_trained() == marks  # nothing of the refused calls was stored
    store.mark_trained([ids[1]], learner="traffic-b", update=3)  # trained again (retrain=True): a second mark
    assert [(m.learner, m.update) for m in store.query_trained([ids[1], "ro-unknown"])] == [("traffic-a", 1),
                                                                                         ("traffic-b", 3)]
    assert store.query_trained([ids[2]]) == []
