"""Runners as Ray actors on a local Ray cluster, against a real store server; no model is loaded."""

from __future__ import annotations

import secrets
import sys
import time

import pytest

from lightning_nb import InMemoryStore, emit_reward, semconv, start_runners, tool_span
from lightning_nb.errors import ConfigError, MissingDependencyError
from lightning_nb.runners.ray import init_local_ray
from lightning_nb.store import StoreClient, StoreServer
from lightning_nb.types import LLMResource


def square_agent(task, llm):
    """A cheap agent: one tool span, one intermediate reward, returns the final reward."""
    if task == "hang":
        time.sleep(120)
    with tool_span("square", task) as span:
        span.set_attribute(semconv.TOOL_OUTPUT, str(task * task))
    emit_reward(0.5, kind="intermediate")
    return float(task % 2)


def _resourced(store):
    store.add_resources({"main_llm": LLMResource(endpoint="http://127.0.0.1:9/v1", model="m")})
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
