"""Runners with real OpenTelemetry tracing; agents here are plain functions that do not call a model."""

from __future__ import annotations

import math
import threading
import time
import warnings

import pytest

from lightning_nb import emit_reward, semconv, start_runners, tool_span
from lightning_nb.errors import InvalidRewardError, LightningNbError
from lightning_nb.runners.runner import attributed_llm
from lightning_nb.types import LLMResource, RolloutConfig
from conftest import IDLE_LLM


@pytest.fixture
def resourced(store):
    store.add_resources({"main_llm": LLMResource(endpoint=IDLE_LLM, model="m")})
    return store


def test_agent_reward_and_spans_recorded(resourced):
    store = resourced

    def agent(task, llm):
        assert "/rollout/" in llm.endpoint and llm.endpoint.endswith("/v1")
        with tool_span("calculator", "1 + 2") as span:
            span.set_attribute(semconv.TOOL_OUTPUT, "3")
        emit_reward(0.25, kind="intermediate")
        return float(task)

    ids = [store.enqueue_rollout(x).rollout_id for x in (0.0, 1.0, 0.5)]
    with start_runners(agent, store, n=2):
        done = store.wait_for_rollouts(ids, timeout=30)
    assert [r.status for r in done] == ["succeeded"] * 3
    assert [store.final_reward(i) for i in ids] == [0.0, 1.0, 0.5]
    names = [s.name for s in store.query_spans(ids[1])]
    assert names == ["tool:calculator", "reward", "reward", "agent"]
    spans = store.query_spans(ids[1])
    agent_span = spans[-1]
    assert all(s.parent_id == agent_span.span_id for s in spans[:-1])
    assert spans[0].attributes[semconv.TOOL_OUTPUT] == "3"


def test_failing_agent_marks_attempt_failed_with_traceback(resourced):
    store = resourced

    def agent(task, llm):
        emit_reward(0.5)
        raise RuntimeError("tool exploded")

    rid = store.enqueue_rollout("t", config=RolloutConfig(max_attempts=2)).rollout_id
    with start_runners(agent, store, n=1):
        store.wait_for_rollouts([rid], timeout=30)
    attempts = store.query_attempts(rid)
    assert [a.status for a in attempts] == ["failed", "failed"]
    assert "RuntimeError: tool exploded" in attempts[0].error and "Traceback" in attempts[0].error
    assert store.get_rollout_by_id(rid).status == "failed"
    # the reward emitted before the crash is kept, once per attempt
    assert len([s for s in store.query_spans(rid) if s.name == "reward"]) == 2


def test_hung_agent_times_out_without_blocking_other_runners(resourced):
    store = resourced
    release = threading.Event()

    def agent(task, llm):
        if task == "hang":
            release.wait(60)
        return 1.0

    slow = store.enqueue_rollout("hang", config=RolloutConfig(timeout_seconds=1.0)).rollout_id
    fast = [store.enqueue_rollout(f"ok{i}").rollout_id for i in range(5)]
    t0 = time.monotonic()
    group = start_runners(agent, store, n=2)
    try:
        assert len(store.wait_for_rollouts(fast, timeout=20)) == 5
        store.wait_for_rollouts([slow], timeout=20)
        assert time.monotonic() - t0 < 15
        attempt = store.query_attempts(slow)[0]
        assert attempt.status == "timeout" and "timeout_seconds=1.0" in attempt.error
        assert store.get_rollout_by_id(slow).status == "failed"
        status = group.status()
        # the runner's own deadline ends it (timed_out), or the store's watchdog, swept by wait_for_rollouts, got
        # there first under load and the runner's next heartbeat left the agent behind (abandoned); one of the two
        assert status["timed_out"].sum() + status["abandoned"].sum() == 1 and status["succeeded"].sum() == 5
    finally:
        release.set()
        group.stop()


@pytest.mark.parametrize("bad", [math.nan, math.inf, "1.0", True])
def test_non_finite_reward_fails_attempt_with_clear_error(resourced, bad):
    store = resourced
    rid = store.enqueue_rollout("t").rollout_id
    keep = store.enqueue_rollout("fine").rollout_id
    with start_runners(lambda task, llm: 1.0 if task == "fine" else bad, store, n=1):
        store.wait_for_rollouts([rid, keep], timeout=30)
    attempt = store.query_attempts(rid)[0]
    assert attempt.status == "failed"
    assert "InvalidRewardError" in attempt.error and "reward must be a finite real number" in attempt.error
    assert store.final_reward(keep) == 1.0


def test_emit_reward_validates_before_needing_a_rollout():
    with pytest.raises(InvalidRewardError, match="finite"):
        emit_reward(float("nan"))
    with pytest.raises(LightningNbError, match="outside a rollout"):
        emit_reward(1.0)


def test_missing_llm_resource_fails_with_instructions(store):
    rid = store.enqueue_rollout("t").rollout_id
    with start_runners(lambda task, llm: 1.0, store, n=1):
        store.wait_for_rollouts([rid], timeout=30)
    assert "add_resources" in store.query_attempts(rid)[0].error


def test_attributed_llm_rewrites_proxy_endpoint_only():
    proxy = LLMResource(endpoint="http://127.0.0.1:5/v1", model="m", sampling_parameters={"temperature": 1.0})
    out = attributed_llm(proxy, "ro-1", "at-1", {"temperature": 0.0})
    assert out.endpoint == "http://127.0.0.1:5/rollout/ro-1/attempt/at-1/v1"
    assert out.sampling_parameters == {"temperature": 0.0}
    other = LLMResource(endpoint="https://example.invalid/api", model="m")
    assert attributed_llm(other, "ro-1", "at-1").endpoint == "https://example.invalid/api"


def test_tracer_keeps_no_store_alive():
    """A Tracer without a live exporter registers no atexit hook, which would keep its store (and spans) forever."""
    import gc
    import weakref

    from lightning_nb.store import InMemoryStore
    from lightning_nb.tracing.tracer import Tracer

    store = InMemoryStore()
    tracer = Tracer(store)
    ref = weakref.ref(store)
    del store, tracer
    gc.collect()
    assert ref() is None


def test_agents_that_reseed_the_global_random_mid_episode_lose_no_span(resourced):
    """Environments call random.seed(seed) in their reset (TextArena, gem-llm); episodes of one GRPO group share
    the seed and run at once. Span IDs must not come from that generator: every span of every episode is stored."""
    import random

    store = resourced
    barrier = threading.Barrier(4, timeout=30)

    def agent(task, llm):
        barrier.wait()  # the four runners' episodes overlap
        for step in range(4):
            random.seed(7)  # an environment's reset, mid-episode, on every runner thread
            with tool_span("env.step", str(step)):
                time.sleep(0.001)
        random.seed(7)
        emit_reward(1.0)
        return None

    ids = [store.enqueue_rollout({"seed": 7}).rollout_id for _ in range(8)]
    with start_runners(agent, store, n=4):
        done = store.wait_for_rollouts(ids, timeout=60)
    assert [r.status for r in done] == ["succeeded"] * 8, [a.error for i in ids for a in store.query_attempts(i)]
    for rid in ids:
        spans = store.query_spans(rid)
        assert [s.name for s in spans] == ["tool:env.step"] * 4 + ["reward", "agent"]
        assert len({s.span_id for s in spans}) == 6
        assert store.final_reward(rid) == 1.0


def test_a_rollout_without_llm_call_is_flagged_or_refused_where_the_agent_declares_it(resourced):
    """An agent that never calls the model succeeds, counted in the runner status and flagged in rollouts_df;
    one that declares calls_model=True has such an attempt refused (failed, naming why)."""
    from lightning_nb.agents.remote import callback_url
    from lightning_nb.runners.failures import NO_LLM_CALL_ERROR
    from lightning_nb.types import Span

    store = resourced

    def agent(task, llm):
        if task == "calls":  # one LLM call recorded on the attempt, as the LLM proxy records it (no model needed)
            _, rid, aid = callback_url(llm.endpoint)
            store.add_span(Span(rollout_id=rid, attempt_id=aid, trace_id="t" * 32, span_id="c" * 16,
                                name=semconv.LLM_SPAN, start_time=1.0, end_time=2.0))
        return 1.0

    ids = [store.enqueue_rollout(t).rollout_id for t in ("calls", "silent")]
    with start_runners(agent, store, n=1) as group:
        store.wait_for_rollouts(ids, timeout=30)
        status = group.status()
    assert [store.get_rollout_by_id(i).status for i in ids] == ["succeeded", "succeeded"]
    assert status["no_llm_call"].tolist() == [1] and status["succeeded"].tolist() == [2]
    df = store.rollouts_df().set_index("rollout_id")
    assert df.loc[ids, "no_llm_call"].tolist() == [False, True] and df.loc[ids, "llm_calls"].tolist() == [1, 0]

    agent.calls_model = True  # declared: every rollout calls the model
    ids = [store.enqueue_rollout(t).rollout_id for t in ("calls", "silent")]
    with pytest.warns(RuntimeWarning, match="without calling the model"):
        with start_runners(agent, store, n=1) as group:
            store.wait_for_rollouts(ids, timeout=30)
            status = group.status()
    assert [store.get_rollout_by_id(i).status for i in ids] == ["succeeded", "failed"]
    assert store.query_attempts(ids[1])[0].error == NO_LLM_CALL_ERROR and store.final_reward(ids[1]) == 0.0
    assert status["no_llm_call"].tolist() == [0] and status["failed"].tolist() == [1]


def test_what_an_agent_records_after_its_attempt_timed_out_is_refused_and_logged(resourced, caplog):
    """The agent's late tool span, reward and agent span (a rollout server answering after the timeout) are
    refused by the store and logged; the timed-out attempt keeps what it had before it ended."""
    store = resourced
    released, finished = threading.Event(), threading.Event()

    def agent(task, llm):
        with tool_span("before", "x") as span:
            span.set_attribute(semconv.TOOL_OUTPUT, "recorded before the timeout")
        released.wait(30)
        try:
            with tool_span("rollout_server", "late") as span:
                span.set_attribute(semconv.TOOL_OUTPUT, "the answer, after the timeout")
            return 1.0
        finally:
            finished.set()

    rid = store.enqueue_rollout("t", config=RolloutConfig(timeout_seconds=1.0)).rollout_id
    with caplog.at_level("WARNING", logger="lightning_nb.tracing.tracer"):
        with warnings.catch_warnings(), start_runners(agent, store, n=1) as group:
            warnings.simplefilter("ignore", RuntimeWarning)  # the first timeout warns (tested elsewhere)
            store.wait_for_rollouts([rid], timeout=30)
            (attempt,) = store.query_attempts(rid)
            assert attempt.status == "timeout"
            released.set()
            assert finished.wait(10)
            time.sleep(1.0)  # the agent thread's reward and agent span are written as they end
            status = group.status()
    assert status["succeeded"].sum() == 0 and status["timed_out"].sum() + status["abandoned"].sum() == 1
    assert [s.name for s in store.query_spans(rid)] == ["tool:before"]
    assert store.get_rollout_by_id(rid).status == "failed" and store.final_reward(rid) == 0.0
    refused = [r.getMessage() for r in caplog.records if "already ended 'timeout'" in r.getMessage()]
    assert any("tool:rollout_server" in m for m in refused) and any("'reward'" in m for m in refused), refused

