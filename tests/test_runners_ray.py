"""Runners as Ray actors on a local Ray cluster, against a real store server; no model is loaded."""

from __future__ import annotations

import os
import secrets
import signal
import sys
import time
import warnings
from pathlib import Path

import pytest

from lightning_nb import InMemoryStore, emit_reward, semconv, start_runners, tool_span
from lightning_nb.errors import ConfigError, MissingDependencyError
from lightning_nb.runners.ray import init_local_ray
from lightning_nb.store import StoreClient, StoreServer
from lightning_nb.types import LLMResource, RolloutConfig
from conftest import IDLE_LLM


def square_agent(task, llm):
    """A cheap agent: one tool span, one intermediate reward, returns the final reward."""
    if task == "hang":
        time.sleep(120)
    with tool_span("square", task) as span:
        span.set_attribute(semconv.TOOL_OUTPUT, str(task * task))
    emit_reward(0.5, kind="intermediate")
    return float(task % 2)


def _resourced(store):
    store.add_resources({"main_llm": LLMResource(endpoint=IDLE_LLM, model="m")})
    return store


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    started = not ray.is_initialized()
    if started:
        init_local_ray(2, object_store_bytes=100 * 1024 * 1024)
    yield ray
    if started:
        ray.shutdown()


@pytest.mark.slow
def test_two_ray_actors_finish_rollouts_with_spans(ray_cluster):
    store = _resourced(InMemoryStore())
    ids = [store.enqueue_rollout(i).rollout_id for i in range(12)]
    group = start_runners(square_agent, store, n=2, backend="ray", num_cpus=1)
    try:
        assert group.server is not None and group.url.startswith("http://127.0.0.1:")
        done = store.wait_for_rollouts(ids, timeout=120)
        status = group.status()
        assert len(status) == 2 and status["alive"].all() and status["pid"].nunique() == 2
    finally:
        abandoned = group.stop(timeout=20)
    assert abandoned == []
    assert [r.status for r in done] == ["succeeded"] * 12
    assert [store.final_reward(i) for i in ids] == [float(i % 2) for i in range(12)]
    for i, rid in enumerate(ids):
        spans = store.query_spans(rid)
        assert [s.name for s in spans] == ["tool:square", "reward", "reward", "agent"]
        assert spans[0].attributes[semconv.TOOL_OUTPUT] == str(i * i)
        assert all(s.parent_id == spans[-1].span_id for s in spans[:-1])
    workers = {a.worker_id for a in store.query_attempts()}
    assert workers <= set(group.worker_ids) and all(w.startswith("ray-runner-") for w in workers)
    after = group.status()
    assert list(after["state"]) == ["stopped", "stopped"] and not after["alive"].any()
    assert group.stop() == []  # idempotent


@pytest.mark.slow
def test_ray_actors_use_a_store_client_and_its_token(ray_cluster):
    token = secrets.token_urlsafe()
    inner = _resourced(InMemoryStore())
    with StoreServer(inner, token=token) as server:
        client = StoreClient(server.url, token=token)
        ids = [client.enqueue_rollout(i).rollout_id for i in range(4)]
        with start_runners(square_agent, client, n=1, backend="ray", num_cpus=0.5) as group:
            assert group.server is None and group.url == server.url
            assert len(client.wait_for_rollouts(ids, timeout=120)) == 4
        assert all(r.status == "succeeded" for r in inner.query_rollouts())
        assert len(inner.query_spans()) == 16
        client.close()


def slow_agent(task, llm):
    """The first attempt sleeps far past the kill (so only the SIGKILL can end it, however loaded the machine); the
    retry returns its reward at once. ``task`` is a marker file's path: the first attempt creates it."""
    marker = Path(task)
    if not marker.exists():
        marker.touch()
        time.sleep(120)
    return 1.0


def _kill_the_runner_of(store, group, rid, marker):
    """SIGKILL the actor running ``rid``'s attempt once its agent runs (``slow_agent`` created ``marker``: the
    rollout reads "running" a moment before the agent starts, and a kill in between would leave the retry to sleep
    as the first attempt); its worker id."""
    deadline = time.monotonic() + 60
    while not (marker.exists() and store.get_rollout_by_id(rid).status == "running") and time.monotonic() < deadline:
        time.sleep(0.05)
    wid = store.query_attempts(rid)[-1].worker_id
    pid = int(group.status().set_index("worker_id").loc[wid, "pid"])
    os.kill(pid, signal.SIGKILL)
    return wid


@pytest.mark.slow
@pytest.mark.parametrize("max_restarts", [1, 0])
def test_a_killed_actor_ends_its_attempt_at_once_and_the_rollout_is_retried(ray_cluster, max_restarts, tmp_path):
    """SIGKILL one of two actors mid-rollout: its attempt ends unresponsive within seconds (not at the rollout's
    60 s timeout) and the retry succeeds on a live runner; Ray restarts the actor, or the group warns it runs one
    short."""
    store = _resourced(InMemoryStore())
    config = RolloutConfig(max_attempts=2, timeout_seconds=60)
    marker = tmp_path / "first"
    rid = store.enqueue_rollout(str(marker), config=config).rollout_id
    with start_runners(slow_agent, store, n=2, backend="ray", num_cpus=0.5, max_restarts=max_restarts) as group:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", RuntimeWarning)
            wid = _kill_the_runner_of(store, group, rid, marker)
            killed = time.monotonic()
            (done,) = store.wait_for_rollouts([rid], timeout=50)
            took = time.monotonic() - killed
            deadline = time.monotonic() + 30  # the restarted actor (or the warning) follows within seconds
            back = (lambda row: row["restarts"] == 1 and row["state"] in ("idle", "running")) if max_restarts else (
                lambda row: row["state"] == "dead" and wid in group.watch.dead)
            while time.monotonic() < deadline and not back(group.status().set_index("worker_id").loc[wid]):
                time.sleep(0.2)
            status = group.status().set_index("worker_id")
    first, retry = store.query_attempts(rid)
    assert done.status == "succeeded" and took < 20, took  # the rollout's timeout is 60 s
    assert first.status == "unresponsive" and f"Ray runner actor {wid} died" in first.error
    assert retry.status == "succeeded" and store.final_reward(rid) == 1.0
    short = [w for w in caught if "runs one short" in str(w.message)]
    if max_restarts:
        assert status.loc[wid, "restarts"] == 1 and status.loc[wid, "state"] in ("idle", "running") and not short
    else:
        assert status.loc[wid, "state"] == "dead" and len(short) == 1 and "1 of 2 runners" in str(short[0].message)


@pytest.mark.slow
def test_interrupt_in_the_with_block_aborts_the_in_flight_attempt(ray_cluster):
    store = _resourced(InMemoryStore())
    rid = store.enqueue_rollout("hang").rollout_id
    with pytest.raises(KeyboardInterrupt):
        with start_runners(square_agent, store, n=1, backend="ray", num_cpus=0.5) as group:
            deadline = time.monotonic() + 60
            while store.get_rollout_by_id(rid).status != "running" and time.monotonic() < deadline:
                time.sleep(0.1)
            raise KeyboardInterrupt  # what "interrupt kernel" raises in the cell
    (attempt,) = store.query_attempts(rid)
    assert attempt.status == "failed" and "aborted: KeyboardInterrupt" in attempt.error
    assert store.get_rollout_by_id(rid).status == "failed"
    assert group.status()["state"].tolist() == ["stopped"]


def test_backend_and_option_errors_name_the_field():
    store = InMemoryStore()
    with pytest.raises(ConfigError, match="backend"):
        start_runners(square_agent, store, backend="processes")
    with pytest.raises(ConfigError, match="num_cpus"):
        start_runners(square_agent, store, n=1, num_cpus=1)
    with pytest.raises(ConfigError, match="tracer"):
        start_runners(square_agent, store, backend="ray", tracer=object())
    with pytest.raises(ConfigError, match="n must be"):
        start_runners(square_agent, store, n=0, backend="ray")
    with pytest.raises(ConfigError, match="agent must be callable"):
        start_runners("not a function", store, backend="ray")


def test_missing_ray_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # makes `import ray` raise ImportError
    with pytest.raises(MissingDependencyError, match=r"lightning-nb\[ray\]"):
        start_runners(square_agent, InMemoryStore(), n=1, backend="ray")
