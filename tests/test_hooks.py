"""Lifecycle hooks on real runner threads (and Ray actors) with the real stores; agents do not call a model."""

from __future__ import annotations

import secrets
import threading
import time

import pytest

from lightning_nb import emit_reward, start_runners, tool_span
from lightning_nb.errors import ConfigError
from lightning_nb.runners import HOOK_ERROR_SPAN, Hook, Runner
from lightning_nb.runners.hooks import HOOK_ATTRIBUTE, HOOK_METHODS
from lightning_nb.semconv import AGENT_SPAN, INTERMEDIATE_REWARD_SPAN, REWARD_NAME
from lightning_nb.tracing.tracer import Tracer, emit_intermediate_reward
from lightning_nb.types import LLMResource, Span
from conftest import IDLE_LLM

ORDER = list(HOOK_METHODS)


def reward_agent(task, llm):
    """Returns ``task`` as the reward; ``"raise"`` raises, so the attempt fails."""
    if task == "raise":
        raise RuntimeError("agent exploded")
    return float(task)


def slow_reward_agent(task, llm):
    """``reward_agent`` after 0.2 s, so that several runners take rollouts."""
    time.sleep(0.2)
    return reward_agent(task, llm)


@pytest.fixture
def resourced(store):
    store.add_resources({"main_llm": LLMResource(endpoint=IDLE_LLM, model="m")})
    return store


class Recorder(Hook):
    """Records every call (its name, ids and arguments) in a shared list."""

    def __init__(self, name, log, lock):
        self.name, self.log, self.lock = name, log, lock

    def _add(self, method, agent, runner, rollout, tracer=None, status=None):
        rid, aid = rollout.rollout.rollout_id, rollout.attempt.attempt_id
        stored = runner.store.query_attempts(rid)[-1].status if method == "on_rollout_end" else None
        with self.lock:
            self.log.append({"hook": self.name, "method": method, "rid": rid, "aid": aid, "agent": agent,
                             "runner": runner, "tracer": tracer, "status": status, "stored": stored,
                             "thread": threading.current_thread().name})

    def on_rollout_start(self, agent, runner, rollout):
        self._add("on_rollout_start", agent, runner, rollout)

    def on_trace_start(self, agent, runner, tracer, rollout):
        self._add("on_trace_start", agent, runner, rollout, tracer)

    def on_trace_end(self, agent, runner, tracer, rollout):
        self._add("on_trace_end", agent, runner, rollout, tracer)
        emit_intermediate_reward(0.5, name="from_hook")  # only works inside the attempt's trace context

    def on_rollout_end(self, agent, runner, rollout, status):
        self._add("on_rollout_end", agent, runner, rollout, status=status)


def test_four_callbacks_in_order_with_their_arguments_across_runners(resourced):
    store, log, lock = resourced, [], threading.Lock()
    tasks = [0.0, 1.0, "raise", 0.25, 0.5, 0.75]
    ids = [store.enqueue_rollout(t).rollout_id for t in tasks]
    with start_runners(slow_reward_agent, store, n=3, hooks=[Recorder("a", log, lock)]) as group:
        store.wait_for_rollouts(ids, timeout=60)
        runners = set(group.runners)
    for rid, task in zip(ids, tasks):
        calls = [c for c in log if c["rid"] == rid]
        assert [c["method"] for c in calls] == ORDER, rid
        attempt = store.query_attempts(rid)[-1]
        expected = "failed" if task == "raise" else "succeeded"
        assert attempt.status == expected
        assert {c["aid"] for c in calls} == {attempt.attempt_id}
        assert all(c["agent"] is slow_reward_agent and c["runner"] in runners for c in calls)
        assert {c["runner"].worker_id for c in calls} == {attempt.worker_id}
        assert calls[1]["tracer"] is calls[1]["runner"].tracer and calls[2]["tracer"] is calls[1]["tracer"]
        assert calls[3]["status"] == expected and calls[3]["stored"] == expected  # after the store has it
        # trace callbacks run in the agent thread, rollout callbacks in the runner thread
        assert [c["thread"].endswith("-agent") for c in calls] == [False, True, True, False]
        spans = store.query_spans(rid)
        hooked = [s for s in spans if s.name == INTERMEDIATE_REWARD_SPAN and s.attributes[REWARD_NAME] == "from_hook"]
        assert len(hooked) == 1, [s.name for s in spans]
        agent_span = next(s for s in spans if s.name == AGENT_SPAN)
        assert all(s.parent_id == agent_span.span_id for s in hooked)  # on_trace_end ran inside the trace context
        assert not [s for s in spans if s.name == HOOK_ERROR_SPAN]
    assert len({c["runner"].worker_id for c in log}) >= 2  # several runners took rollouts (the agent sleeps)
    assert "RuntimeError: agent exploded" in store.query_attempts(ids[2])[-1].error


def test_two_hooks_are_called_in_list_order(resourced):
    store, log, lock = resourced, [], threading.Lock()
    ids = [store.enqueue_rollout(float(i)).rollout_id for i in range(3)]
    with start_runners(reward_agent, store, n=2, hooks=[Recorder("first", log, lock), Recorder("second", log, lock)]):
        store.wait_for_rollouts(ids, timeout=60)
    for rid in ids:
        calls = [(c["method"], c["hook"]) for c in log if c["rid"] == rid]
        assert calls == [(m, h) for m in ORDER for h in ("first", "second")]


class Exploding(Hook):
    """Raises ValueError in ``method`` for the rollout whose task is ``"boom"``."""

    def __init__(self, method):
        self.method = method

    def _maybe(self, method, rollout):
        if method == self.method and rollout.rollout.input == "boom":
            raise ValueError(f"boom in {method}")

    def on_rollout_start(self, agent, runner, rollout):
        self._maybe("on_rollout_start", rollout)

    def on_trace_start(self, agent, runner, tracer, rollout):
        self._maybe("on_trace_start", rollout)

    def on_trace_end(self, agent, runner, tracer, rollout):
        self._maybe("on_trace_end", rollout)

    def on_rollout_end(self, agent, runner, rollout, status):
        self._maybe("on_rollout_end", rollout)


@pytest.mark.parametrize("method", ORDER)
def test_a_raising_hook_is_recorded_and_the_runner_goes_on(resourced, method):
    store, log, lock = resourced, [], threading.Lock()
    seen = []

    def agent(task, llm):
        seen.append(task)
        return 1.0

    ids = [store.enqueue_rollout(t).rollout_id for t in ("boom", "fine", "also fine")]
    with pytest.warns(RuntimeWarning, match=rf"hook Exploding\.{method} raised ValueError: boom in {method}"):
        with start_runners(agent, store, n=1, hooks=[Exploding(method), Recorder("after", log, lock)]) as group:
            done = store.wait_for_rollouts(ids, timeout=60)
            assert all(r.alive for r in group.runners)  # the runner thread survived
    boom = store.query_attempts(ids[0])
    final = method == "on_rollout_end"
    assert [r.status for r in done] == ["succeeded" if final else "failed", "succeeded", "succeeded"]
    assert len(boom) == 1
    if final:  # already recorded: the status is not changed
        assert boom[0].status == "succeeded" and boom[0].error is None
        assert store.final_reward(ids[0]) == 1.0
    else:
        assert boom[0].status == "failed"
        assert boom[0].error.startswith(f"hook Exploding.{method} raised ValueError: boom in {method}\nTraceback")
    # the agent is not called when a start callback failed
    assert ("boom" in seen) == (method in ("on_trace_end", "on_rollout_end"))
    errors = [s for s in store.query_spans(ids[0]) if s.name == HOOK_ERROR_SPAN]
    assert len(errors) == 1 and errors[0].status == "error"
    assert errors[0].attributes[HOOK_ATTRIBUTE] == f"Exploding.{method}"
    assert errors[0].attributes["exception.type"] == "ValueError"
    assert "boom in" in errors[0].attributes["exception.stacktrace"]
    assert not [s for rid in ids[1:] for s in store.query_spans(rid) if s.name == HOOK_ERROR_SPAN]
    # the hook after the raising one is skipped for that callback; a failed start callback skips what it
    # starts, but on_trace_end (after on_trace_start) and on_rollout_end (after on_rollout_start) always come
    calls = [c["method"] for c in log if c["rid"] == ids[0]]
    assert calls == {"on_rollout_start": ["on_rollout_end"],
                     "on_trace_start": ["on_rollout_start", "on_trace_end", "on_rollout_end"],
                     "on_trace_end": ["on_rollout_start", "on_trace_start", "on_rollout_end"],
                     "on_rollout_end": ["on_rollout_start", "on_trace_start", "on_trace_end"]}[method]
    assert [c["status"] for c in log if c["rid"] == ids[0] and c["method"] == "on_rollout_end"] == (
        [] if final else ["failed"])
    for rid in ids[1:]:
        assert [c["method"] for c in log if c["rid"] == rid] == ORDER


class DuckHook:
    """Not a Hook subclass, but has the four callbacks: accepted."""

    def __init__(self):
        self.ended = []

    def on_rollout_start(self, agent, runner, rollout):
        pass

    def on_trace_start(self, agent, runner, tracer, rollout):
        pass

    def on_trace_end(self, agent, runner, tracer, rollout):
        pass

    def on_rollout_end(self, agent, runner, rollout, status):
        self.ended.append(status)


class HalfHook:
    def on_rollout_start(self, agent, runner, rollout):
        pass


@pytest.mark.parametrize("hooks, match", [
    ([object()], r"hooks\[0\] is a object, not a lightning_nb.Hook .*subclass lightning_nb.Hook"),
    ([Hook(), HalfHook()], r"hooks\[1\] is a HalfHook.*lacks on_trace_start, on_trace_end, on_rollout_end"),
    ([Recorder], r"hooks\[0\] is the class Recorder, not an instance: pass hooks=\[Recorder\(\)\]"),
    (Hook(), r"hooks must be a list of Hook instances, e.g. hooks=\[MyHook\(\)\], got Hook"),
])
@pytest.mark.parametrize("backend", ["threads", "ray"])
def test_a_non_hook_is_refused_at_start(resourced, hooks, match, backend):
    with pytest.raises(ConfigError, match=match):
        start_runners(reward_agent, resourced, n=1, hooks=hooks, backend=backend)
    with pytest.raises(ConfigError, match=match):
        Runner(reward_agent, resourced, Tracer(resourced), hooks=hooks)


def test_a_duck_typed_hook_with_the_four_callbacks_is_accepted(resourced):
    store, duck = resourced, DuckHook()
    rid = store.enqueue_rollout(0.5).rollout_id
    with start_runners(reward_agent, store, n=1, hooks=[duck]) as group:
        store.wait_for_rollouts([rid], timeout=30)
    assert duck.ended == ["succeeded"]
    again = store.enqueue_rollout(0.25).rollout_id
    with group.restart():  # the panel's Start runners button keeps the hooks
        store.wait_for_rollouts([again], timeout=30)
    assert duck.ended == ["succeeded", "succeeded"]


def test_on_rollout_end_gets_timeout_when_the_agent_runs_past_it(resourced):
    from lightning_nb.types import RolloutConfig

    store, log, lock = resourced, [], threading.Lock()
    release = threading.Event()

    def slow_agent(task, llm):
        release.wait(10)
        return 1.0

    rid = store.enqueue_rollout("slow", config=RolloutConfig(timeout_seconds=0.5)).rollout_id
    with pytest.warns(RuntimeWarning, match="timeout"):
        with start_runners(slow_agent, store, n=1, hooks=[Recorder("a", log, lock)]):
            store.wait_for_rollouts([rid], timeout=30)
            ends = [c for c in log if c["method"] == "on_rollout_end"]
            deadline = time.monotonic() + 5
            while not ends and time.monotonic() < deadline:
                time.sleep(0.05)
                ends = [c for c in log if c["method"] == "on_rollout_end"]
            release.set()
    assert [c["status"] for c in ends] == ["timeout"]
    assert [c["stored"] for c in ends] == ["timeout"]


# ----- Ray: each actor calls its own (unpickled) copy; the hook records through the store ----------------
class StoreMarker(Hook):
    """Writes a span through the actor's store client in on_rollout_end, and a tool span in on_trace_start."""

    def on_trace_start(self, agent, runner, tracer, rollout):
        with tool_span("hooked", rollout.rollout.input):
            pass

    def on_rollout_end(self, agent, runner, rollout, status):
        now = time.time()
        runner.store.add_span(Span(rollout_id=rollout.rollout.rollout_id, attempt_id=rollout.attempt.attempt_id,
                                   trace_id=secrets.token_hex(16), span_id=secrets.token_hex(8), name="hook.marker",
                                   start_time=now, end_time=now,
                                   attributes={"status": status, "worker_id": runner.worker_id}))


def ray_reward_agent(task, llm):
    emit_reward(float(task))
    return None


@pytest.mark.slow
def test_hooks_run_on_ray_actors():
    pytest.importorskip("ray")
    from lightning_nb import InMemoryStore
    from lightning_nb.runners.ray import init_local_ray

    import ray

    started = not ray.is_initialized()
    if started:
        init_local_ray(2, object_store_bytes=100 * 1024 * 1024)
    try:
        store = InMemoryStore()
        store.add_resources({"main_llm": LLMResource(endpoint=IDLE_LLM, model="m")})
        ids = [store.enqueue_rollout(float(i)).rollout_id for i in range(4)]
        with start_runners(ray_reward_agent, store, n=2, backend="ray", num_cpus=0.5, hooks=[StoreMarker()]):
            done = store.wait_for_rollouts(ids, timeout=120)
        assert [r.status for r in done] == ["succeeded"] * 4
        for rid in ids:
            attempt = store.query_attempts(rid)[-1]
            names = [s.name for s in store.query_spans(rid)]
            assert names.count("tool:hooked") == 1 and names.count("hook.marker") == 1, names
            marker = next(s for s in store.query_spans(rid) if s.name == "hook.marker")
            assert marker.attributes == {"status": "succeeded", "worker_id": attempt.worker_id}
            assert attempt.worker_id.startswith("ray-runner-")
    finally:
        if started:
            ray.shutdown()
