"""Runner guards against silent failures (issue 8, items 11, 14, 15, 16).

Real stores (InMemoryStore, SqliteStore, StoreServer + StoreClient), real OpenTelemetry,
real threads, the real ``openai`` client; faults are injected (a store whose
``add_span`` raises, a closed port, a socket that never answers), nothing is mocked.
"""

from __future__ import annotations

import gc
import logging
import re
import socket
import threading
import time
import warnings
import weakref

import httpx
import openai
import pytest

from lightning_nb import emit_reward, semconv, start_runners
from lightning_nb.runners import NO_REWARD_ERROR, Runner, live_runner_group, unreachable_endpoint_hint
from lightning_nb.runners.live import LIVE as _LIVE
from lightning_nb.store import InMemoryStore, SqliteStore, StoreClient, StoreServer
from lightning_nb.tracing.tracer import Tracer
from lightning_nb.types import LLMResource, RolloutConfig
from conftest import IDLE_LLM, closed_port


def _resources(store, endpoint=IDLE_LLM):
    store.add_resources({"main_llm": LLMResource(endpoint=endpoint, model="m")})
    return store


@pytest.fixture
def resourced(store):
    return _resources(store)


def _runner_warnings(record):
    return [str(w.message) for w in record if "see store.attempts_df()" in str(w.message)]


# ----- item 11: a span the store cannot take fails the attempt --------------------------------
def _flaky(base):
    """``base`` whose add_span/add_spans/add_otel_spans raise OSError for the first ``fail_rewards`` writes holding
    a reward span (a write is counted once: the base ``add_otel_spans`` calls ``add_spans``)."""

    class Flaky(base):
        fail_rewards = 0
        reward_calls = 0
        _writing = threading.local()

        def _maybe_fail(self, spans):
            if getattr(self._writing, "otel", False):
                return  # add_spans inside add_otel_spans: already counted
            if any(s.name == "reward" for s in spans):
                self.reward_calls += 1
                if self.reward_calls <= self.fail_rewards:
                    raise OSError(f"injected: span store briefly down (call {self.reward_calls})")

        def add_span(self, span):
            self._maybe_fail([span])
            return super().add_span(span)

        def add_spans(self, spans):
            self._maybe_fail(spans)
            return super().add_spans(spans)

        def add_otel_spans(self, rollout_id, attempt_id, spans):
            self._maybe_fail(spans)
            self._writing.otel = True
            try:
                return super().add_otel_spans(rollout_id, attempt_id, spans)
            finally:
                self._writing.otel = False

    return Flaky


@pytest.fixture(params=["memory", "sqlite", "http"])
def flaky(request, tmp_path):
    """``(store the runners use, the flaky store underneath)``: memory, sqlite, or memory behind HTTP."""
    if request.param == "sqlite":
        inner = _flaky(SqliteStore)(tmp_path / "flaky.db")
        yield inner, inner
        inner.close()
    elif request.param == "memory":
        inner = _flaky(InMemoryStore)()
        yield inner, inner
    else:
        inner = _flaky(InMemoryStore)()
        server = StoreServer(inner, host="127.0.0.1", port=0).start()
        client = StoreClient(server.url)
        yield client, inner
        client.close()
        server.stop()


def test_lost_reward_span_fails_the_attempt_naming_span_and_reason(flaky):
    store, inner = flaky
    _resources(store)
    inner.fail_rewards = 10**6  # the store never takes a reward span
    tracer = Tracer(store)
    rid = store.enqueue_rollout("t", config=RolloutConfig(max_attempts=1)).rollout_id
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with start_runners(lambda task, llm: 1.0, store, n=1, tracer=tracer):
            assert store.wait_for_rollouts([rid], timeout=30)
    (attempt,) = store.query_attempts(rid)
    assert attempt.status == "failed", "a lost reward must not pass for a success"
    assert attempt.error.startswith("span 'reward' could not be stored after 3 tries: ")
    assert "injected: span store briefly down" in attempt.error
    assert inner.reward_calls == 6  # retried in its batch, then alone, then given up
    assert store.final_reward(rid) == 0.0
    assert [s.name for s in store.query_spans(rid)] == ["agent"]  # the rest of the attempt is stored
    assert any("span 'reward' could not be stored" in m for m in _runner_warnings(record))
    assert len(tracer.ledger) == 0  # nothing left open in the tracer


def test_transient_span_store_error_is_retried_and_the_attempt_succeeds(flaky):
    store, inner = flaky
    _resources(store)
    inner.fail_rewards = 2  # fails twice, then works: within the 3 tries

    def agent(task, llm):
        emit_reward(0.75)

    rid = store.enqueue_rollout("t", config=RolloutConfig(max_attempts=1)).rollout_id
    with start_runners(agent, store, n=1):
        assert store.wait_for_rollouts([rid], timeout=30)
    (attempt,) = store.query_attempts(rid)
    assert attempt.status == "succeeded", attempt.error
    assert inner.reward_calls == 3
    assert store.final_reward(rid) == 0.75


def test_lost_span_then_retry_attempt_succeeds():
    """A failed attempt for a lost span is retried per the rollout's policy, like any failure."""
    store = _resources(_flaky(InMemoryStore)())
    store.fail_rewards = 6  # the first attempt's three tries in its batch and three alone
    rid = store.enqueue_rollout("t", config=RolloutConfig(max_attempts=2)).rollout_id
    with start_runners(lambda task, llm: 0.5, store, n=1):
        assert store.wait_for_rollouts([rid], timeout=30)
    assert [a.status for a in store.query_attempts(rid)] == ["failed", "succeeded"]
    assert store.final_reward(rid) == 0.5


# ----- item 14: re-running start_runners replaces the group on the same store -----------------
def test_rerunning_start_runners_replaces_the_previous_group(resourced, caplog):
    """Issue 53: replacing the group on a re-run is what re-running is for: an info line, not a warning."""
    store = resourced
    group_a = start_runners(lambda task, llm: 1.0, store, n=2)
    assert group_a.replaced == ""
    try:
        with warnings.catch_warnings(), caplog.at_level(logging.INFO, logger="lightning_nb.runners.group"):
            warnings.simplefilter("error", UserWarning)  # no warning box for a plain replacement
            group_b = start_runners(lambda task, llm: 2.0, store, n=2)
        message = group_b.replaced
        assert re.match(r"start_runners: stopped the previous group of 2 runner\(s\) on this store", message)
        assert all(r.worker_id in message for r in group_a.runners) and "replace=False" in message
        assert message in caplog.messages  # the info line (printed too under a notebook cell)
        try:
            assert not any(r.alive for r in group_a.runners)
            assert all(r.stats.state == "stopped" for r in group_a.runners)
            ids = [store.enqueue_rollout(i).rollout_id for i in range(8)]
            assert len(store.wait_for_rollouts(ids, timeout=30)) == 8
            assert [store.final_reward(i) for i in ids] == [2.0] * 8
            b_ids = {r.worker_id for r in group_b.runners}
            assert {a.worker_id for i in ids for a in store.query_attempts(i)} <= b_ids
        finally:
            group_b.stop()
    finally:
        group_a.stop()


def test_replace_lets_the_old_runner_finish_its_attempt():
    store = _resources(InMemoryStore())
    started = threading.Event()

    def old_agent(task, llm):
        started.set()
        time.sleep(0.5)
        return 1.0

    first = store.enqueue_rollout("in flight").rollout_id
    group_a = start_runners(old_agent, store, n=1)
    assert started.wait(10)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # it finished its attempt: nothing lost, no warning
        group_b = start_runners(lambda task, llm: 2.0, store, n=1)
    try:
        assert "stopped the previous group of 1 runner" in group_b.replaced
        assert store.get_rollout_by_id(first).status == "succeeded"  # finished before start_runners returned
        assert store.final_reward(first) == 1.0
        assert not group_a.runners[0].alive
    finally:
        group_b.stop()


def test_a_replacement_that_ends_an_attempt_in_flight_is_still_a_warning(monkeypatch):
    """Issue 53: the replacement that costs a rollout's attempt stays a warning (the plain one is an info line)."""
    from lightning_nb.runners import group as group_module

    monkeypatch.setattr(group_module, "REPLACE_STOP_TIMEOUT_S", 0.3)  # the old runner's grace, from 60 s
    store = _resources(InMemoryStore())
    started, release = threading.Event(), threading.Event()

    def stuck_agent(task, llm):
        started.set()
        release.wait(30)
        return 1.0

    rid = store.enqueue_rollout("in flight").rollout_id
    group_a = start_runners(stuck_agent, store, n=1)
    assert started.wait(10)
    try:
        with pytest.warns(UserWarning, match=r"stopped the previous group of 1 runner.*1 did not finish their "
                                             r"attempt within 0\.3 s and were aborted") as rec:
            group_b = start_runners(lambda task, llm: 2.0, store, n=1)
        assert group_b.replaced in [str(w.message) for w in rec if w.category is UserWarning]
        assert store.query_attempts(rid)[0].status == "failed"  # the attempt in flight was ended
    finally:
        release.set()
        group_a.stop()
        group_b.stop()


def test_replace_false_keeps_both_groups_and_other_stores_are_untouched():
    store, other = _resources(InMemoryStore()), _resources(InMemoryStore())
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no replacement warning anywhere below
        on_other = start_runners(lambda task, llm: 3.0, other, n=1)
        group_a = start_runners(lambda task, llm: 1.0, store, n=1)
        group_b = start_runners(lambda task, llm: 2.0, store, n=1, replace=False)
        try:
            assert all(r.alive for r in group_a.runners + group_b.runners + on_other.runners)
            group_a.stop()
            group_b.stop()
            group_c = start_runners(lambda task, llm: 2.0, store, n=1)  # the old ones stopped: nothing to replace
            group_c.stop()
            assert on_other.runners[0].alive  # another store's runners are never touched
        finally:
            on_other.stop()


def test_a_store_collected_inside_the_registrys_lock_does_not_deadlock_it():
    """The garbage collector can run a collected store's weakref callback inside the registry's own locked section,
    on the same thread (any allocation in ``start_runners`` can trigger a collection): the callback must not wait
    for that lock. It did, and a CI-shaped run hung in ``test_hooks``."""
    from lightning_nb.runners.live import LiveRunners

    class _Store:  # weakly referenced like a store; a reference cycle, so only the garbage collector frees it
        pass

    live, store = LiveRunners(), _Store()
    store.cycle = store
    with live._lock:
        assert live._entry(store) is not None
    assert len(live) == 1
    del store

    def collect_under_the_lock():
        with live._lock:  # as inside add() or register_group()
            gc.collect()

    worker = threading.Thread(target=collect_under_the_lock, daemon=True)
    worker.start()
    worker.join(10)
    assert not worker.is_alive(), "the store's weakref callback waited for the lock its own thread holds"
    assert len(live) == 0  # the collected store's entry is gone at the next call


def test_runner_registry_keeps_no_store_alive():
    store = _resources(InMemoryStore())
    group = start_runners(lambda task, llm: 1.0, store, n=2)
    assert len(_LIVE.running(store)) == 2
    group.stop()
    assert _LIVE.running(store) == []
    ref = weakref.ref(store)
    del group, store
    gc.collect()
    assert ref() is None


def test_live_runner_group_is_the_latest_and_outlives_a_dropped_handle():
    store = _resources(InMemoryStore())
    first = start_runners(lambda task, llm: 1.0, store, n=1)
    assert live_runner_group(store) is first
    assert "stopped the previous group" in start_runners(lambda task, llm: 1.0, store, n=2).replaced  # not kept
    gc.collect()
    group = live_runner_group(store)
    try:
        assert group is not None and group is not first and len(group.runners) == 2
        assert all(r.alive for r in group.runners) and not any(r.alive for r in first.runners)
    finally:
        group.stop()


# ----- item 15: a dead LLM endpoint says so in one line ---------------------------------------
def _openai_agent(task, llm):
    # a refused connection fails at once; the timeout only bounds a real call, which takes seconds on a loaded
    # CPU (2 s failed the published endpoint's rollouts under 8 xdist workers on 2 cores)
    client = openai.OpenAI(base_url=llm.endpoint, api_key="none", max_retries=0, timeout=60.0)
    reply = client.chat.completions.create(model=llm.model, messages=[{"role": "user", "content": str(task)}],
                                           max_tokens=4)
    return float(len(reply.choices))


def _expected_hint(endpoint: str) -> str:
    return (f"the LLM endpoint {endpoint} in the store's resources is unreachable (connection refused); if the "
            f"proxy was restarted (e.g. after a kernel restart), publish it again with "
            f"store.add_resources({{'main_llm': proxy.as_resource()}})")


def _until(predicate, timeout_s=60.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_dead_llm_endpoint_at_start_holds_the_whole_queue_until_published(store, engine):
    """Issue 53 item 4: no rollout runs against an endpoint start_runners found dead, not even the first."""
    from lightning_nb import LLMProxy

    endpoint = f"http://127.0.0.1:{closed_port()}/v1"
    _resources(store, endpoint)
    ids = [store.enqueue_rollout(f"task {i}", config=RolloutConfig(max_attempts=1)).rollout_id for i in range(2)]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with start_runners(_openai_agent, store, n=2) as group:
            start_notes = [str(w.message) for w in record if str(w.message).startswith("start_runners:")]
            assert len(start_notes) == 1 and endpoint in start_notes[0]  # said before any rollout ran
            assert "the runners hold the whole queue" in start_notes[0]
            assert "store.add_resources({'main_llm': proxy.as_resource()})" in start_notes[0]
            assert record[0].category is RuntimeWarning and str(record[0].message) == start_notes[0]
            time.sleep(2.5)  # held: both stay queued, no attempt was made
            assert [store.get_rollout_by_id(r).status for r in ids] == ["queuing"] * 2
            assert store.query_attempts() == [] and group.runners[0].gate.closed
            with LLMProxy(engine, store) as proxy:  # the proxy restarted, and published again
                store.add_resources({"main_llm": proxy.as_resource()})
                _until(lambda: [store.get_rollout_by_id(r).status for r in ids] == ["succeeded"] * 2)
    latest = store.get_latest_resources().resources_id
    assert [store.get_rollout_by_id(r).resources_id for r in ids] == [latest, latest]  # re-pinned
    assert [len(store.query_attempts(r)) for r in ids] == [1, 1]  # one attempt each: none failed
    assert group.runners[0].gate.reopened == [(proxy.endpoint(), 0, 2)]  # nothing requeued, 2 re-pinned
    assert not _runner_warnings(record)


def test_an_endpoint_that_dies_after_the_start_fails_one_line_and_requeues_when_published(store, engine):
    from lightning_nb import LLMProxy

    endpoint = f"http://127.0.0.1:{closed_port()}/v1"
    _resources(store, endpoint)
    ids = [store.enqueue_rollout(f"task {i}", config=RolloutConfig(max_attempts=1)).rollout_id for i in range(2)]
    runner = Runner(_openai_agent, store, Tracer(store))  # not start_runners: its gate was not closed at the start
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        runner.start()
        try:
            _until(lambda: store.get_rollout_by_id(ids[0]).status == "failed")
            time.sleep(1.5)  # the gate is closed: the runner takes nothing more while the endpoint is dead
            assert store.get_rollout_by_id(ids[1]).status == "queuing" and runner.gate.closed
            (attempt,) = store.query_attempts(ids[0])
            first, rest = attempt.error.split("\n", 1)
            assert first == _expected_hint(endpoint)
            assert rest.startswith("Traceback") and "APIConnectionError" in rest  # the full traceback follows
            notes = _runner_warnings(record)
            assert len(notes) == 1 and _expected_hint(endpoint) in notes[0]

            with LLMProxy(engine, store) as proxy:  # the proxy restarted, and published again
                store.add_resources({"main_llm": proxy.as_resource()})
                _until(lambda: [store.get_rollout_by_id(r).status for r in ids] == ["succeeded"] * 2)
        finally:
            runner.stop()
            runner.join(30)
    latest = store.get_latest_resources().resources_id
    assert [store.get_rollout_by_id(r).resources_id for r in ids] == [latest, latest]  # re-pinned
    assert [a.status for a in store.query_attempts(ids[0])] == ["failed", "succeeded"]  # one more attempt
    assert runner.gate.reopened == [(proxy.endpoint(), 1, 1)]  # 1 requeued, 1 re-pinned
    assert any("answers; taking rollouts again (requeued 1" in str(w.message) for w in record)


def test_reopened_sqlite_store_with_a_dead_proxy_holds_its_queue_and_says_publish_again(tmp_path, engine):
    from lightning_nb import LLMProxy

    endpoint = f"http://127.0.0.1:{closed_port()}/v1"
    before = SqliteStore(tmp_path / "run.db")
    _resources(before, endpoint)  # the proxy of the previous kernel
    rid = before.enqueue_rollout("t", config=RolloutConfig(max_attempts=1)).rollout_id  # queued before the restart
    before.close()
    store = SqliteStore(tmp_path / "run.db")  # kernel restarted: reopened, resources still point at it
    try:
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            with start_runners(_openai_agent, store, n=2):
                time.sleep(2.5)
                assert store.get_rollout_by_id(rid).status == "queuing" and store.query_attempts(rid) == []
                with LLMProxy(engine, store) as proxy:
                    store.add_resources({"main_llm": proxy.as_resource()})
                    _until(lambda: store.get_rollout_by_id(rid).status == "succeeded")
        assert str(record[0].message).startswith(f"start_runners: the LLM endpoint {endpoint} of 'main_llm'")
        assert [a.status for a in store.query_attempts(rid)] == ["succeeded"]
    finally:
        store.close()


def test_start_runners_does_not_warn_about_an_endpoint_that_answers(proxied_store):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        start_runners(lambda task, llm: 1.0, proxied_store, n=1).stop()
    assert not [w for w in record if "does not answer" in str(w.message)]


def test_an_agent_that_never_calls_the_llm_keeps_working_with_a_dead_endpoint():
    store = _resources(InMemoryStore(), f"http://127.0.0.1:{closed_port()}/v1")
    ids = [r.rollout_id for r in store.enqueue_rollouts(range(3))]

    def agent(task, llm):
        return 1.0

    agent.calls_model = False  # it may answer without the LLM: not held
    with pytest.warns(RuntimeWarning, match="does not answer.*calls_model = False, so the runners take rollouts"):
        group = start_runners(agent, store, n=1)
    try:
        assert [r.status for r in store.wait_for_rollouts(ids, timeout=30)] == ["succeeded"] * 3
    finally:
        group.stop()


def test_connect_error_to_another_host_gets_no_llm_hint():
    store = _resources(InMemoryStore(), f"http://127.0.0.1:{closed_port()}/v1")
    tool_url = f"http://127.0.0.1:{closed_port()}/search"  # the agent's own tool service, also down

    def agent(task, llm):
        httpx.get(tool_url, timeout=2.0)
        return 1.0

    agent.calls_model = False  # it never calls the LLM: not held by the dead LLM endpoint

    rid = store.enqueue_rollout("t", config=RolloutConfig(max_attempts=1)).rollout_id
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with start_runners(agent, store, n=1):
            assert store.wait_for_rollouts([rid], timeout=30)
    error = store.query_attempts(rid)[0].error
    assert error.startswith("Traceback") and "ConnectError" in error
    assert "LLM endpoint" not in error


def test_read_timeout_is_not_called_unreachable():
    listener = socket.socket()  # accepts connections (the kernel's backlog) but never answers
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    endpoint = f"http://127.0.0.1:{listener.getsockname()[1]}/v1"
    try:
        client = openai.OpenAI(base_url=endpoint, api_key="none", max_retries=0, timeout=0.3)
        with pytest.raises(openai.APITimeoutError) as info:
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        assert unreachable_endpoint_hint(info.value, endpoint) is None
        refused = openai.OpenAI(base_url=f"http://127.0.0.1:{closed_port()}/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.APIConnectionError) as info:
            refused.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        other = str(refused.base_url)
        assert "connection refused" in unreachable_endpoint_hint(info.value, other)
        assert unreachable_endpoint_hint(info.value, endpoint) is None  # a different port: not the LLM endpoint
    finally:
        listener.close()


# ----- item 16: silent agent mistakes ---------------------------------------------------------
def test_agent_returning_none_without_reward_fails_with_how_to(resourced):
    store = resourced

    def agent(task, llm):
        if task == "emits":
            emit_reward(0.25)
        # forgot `return` for task "forgot"

    forgot = store.enqueue_rollout("forgot", config=RolloutConfig(max_attempts=1)).rollout_id
    emits = store.enqueue_rollout("emits", config=RolloutConfig(max_attempts=1)).rollout_id
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with start_runners(agent, store, n=1):
            assert len(store.wait_for_rollouts([forgot, emits], timeout=30)) == 2
    (attempt,) = store.query_attempts(forgot)
    assert attempt.status == "failed" and attempt.error == NO_REWARD_ERROR
    assert "return a float reward" in attempt.error and "lightning_nb.emit_reward(value)" in attempt.error
    assert store.get_rollout_by_id(emits).status == "succeeded" and store.final_reward(emits) == 0.25


def test_reward_span_written_by_another_tracer_counts(resourced):
    store = resourced

    def agent(task, llm):  # records its reward through a tracer of its own, with explicit ids
        parts = llm.endpoint.split("/")
        rid, aid = parts[parts.index("rollout") + 1], parts[parts.index("attempt") + 1]
        Tracer(store).start_span("reward", rid, aid, {semconv.REWARD: 0.5}).end()

    rid = store.enqueue_rollout("t", config=RolloutConfig(max_attempts=1)).rollout_id
    with start_runners(agent, store, n=1):
        assert store.wait_for_rollouts([rid], timeout=30)
    assert store.get_rollout_by_id(rid).status == "succeeded" and store.final_reward(rid) == 0.5


def test_first_failure_of_each_kind_warns_once_per_group():
    store = _resources(InMemoryStore())

    def agent(task, llm):
        if task.startswith("crash"):
            raise RuntimeError(f"tool exploded on {task}")
        if task == "bad input":
            raise ValueError("cannot parse the task")
        if task.startswith("forgot"):
            return None
        return 1.0

    tasks = ["crash 1", "crash 2", "crash 3", "bad input", "forgot 1", "forgot 2", "fine"]
    ids = [store.enqueue_rollout(t, config=RolloutConfig(max_attempts=1)).rollout_id for t in tasks]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with start_runners(agent, store, n=2):
            assert len(store.wait_for_rollouts(ids, timeout=30)) == len(tasks)
    notes = _runner_warnings(record)
    assert all(w.category is RuntimeWarning for w in record if str(w.message) in notes)
    assert sorted(re.search(r"later '(.+?)' failures", n).group(1) for n in notes) == [
        "RuntimeError", "ValueError", "no reward"]
    assert any(NO_REWARD_ERROR in n for n in notes)
    crash = next(n for n in notes if "RuntimeError" in n)
    assert "RuntimeError: tool exploded on crash" in crash  # the one-line error
    assert [a.status for i in ids for a in store.query_attempts(i)] == ["failed"] * 6 + ["succeeded"]

    # a new group warns again, once
    again = store.enqueue_rollout("crash 4", config=RolloutConfig(max_attempts=1)).rollout_id
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with start_runners(agent, store, n=1):
            assert store.wait_for_rollouts([again], timeout=30)
    assert len(_runner_warnings(record)) == 1


def test_span_for_an_unknown_attempt_is_tried_once_and_never_raised():
    store = _flaky(InMemoryStore)()
    calls = []
    original = store.add_span

    def counting(span):
        calls.append(span.name)
        return original(span)

    store.add_span = counting  # count the writes; the real store answers (NotFoundError: no such attempt)
    tracer = Tracer(store)
    tracer.open_attempt("ro-nope", "at-nope")
    tracer.start_span("reward", "ro-nope", "at-nope", {semconv.REWARD: 1.0}).end()  # does not raise
    (reason,) = tracer.close_attempt("ro-nope", "at-nope").lost  # the attempt's buffered span is written here
    assert calls == ["reward"]  # a retry cannot make the attempt exist
    assert reason.startswith("span 'reward' could not be stored after 1 try: NotFoundError")
