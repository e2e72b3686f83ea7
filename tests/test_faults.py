"""Attempts, retries, the watchdog, worker records and abort semantics, over every store backend.

Agents here are cheap plain functions (no model); faults are injected on purpose.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections import Counter

import pytest
from pydantic import ValidationError

from lightning_nb import start_runners
from lightning_nb.errors import ConfigError
from lightning_nb.types import ATTEMPT_TERMINAL, ROLLOUT_TERMINAL, LLMResource, RolloutConfig
from conftest import IDLE_LLM

_KINDS = ["ok", "raise", "hang", "nan"]
_OUTCOME = {"ok": "succeeded", "raise": "failed", "nan": "failed", "hang": "timeout"}


@pytest.fixture
def resourced(store):
    store.add_resources({"main_llm": LLMResource(endpoint=IDLE_LLM, model="m")})
    return store


def _configs() -> list[RolloutConfig]:
    # The runners time hung agents out (default_timeout_s below); the watchdog only backs them up, with a
    # margin wide enough that a loaded CI machine never ends a healthy attempt.
    return [
        RolloutConfig(max_attempts=3, unresponsive_seconds=30),  # default retry_condition: failed, timeout, unresponsive
        RolloutConfig(max_attempts=2, unresponsive_seconds=30, retry_condition=["timeout"]),  # a crash is final
        RolloutConfig(max_attempts=1, unresponsive_seconds=30),
    ]


def _expected(plan: list[str], cfg: RolloutConfig) -> list[str]:
    """Attempt statuses the retry policy must produce for a fault plan."""
    statuses = []
    for kind in plan[: cfg.max_attempts]:
        statuses.append(_OUTCOME[kind])
        if statuses[-1] == "succeeded" or statuses[-1] not in cfg.retry_condition:
            break
    return statuses


def test_1000_rollouts_with_injected_faults_all_end_terminal_with_attempts_as_configured(resourced):
    store, n = resourced, 1000
    release = threading.Event()
    calls: Counter = Counter()
    lock = threading.Lock()
    plans = {}
    for i in range(n):
        rng = random.Random(i)
        plans[i] = [rng.choices(_KINDS, weights=[60, 18, 3, 19])[0] for _ in range(3)]

    def agent(task, llm):
        with lock:
            calls[task] += 1
            kind = plans[task][calls[task] - 1]
        if kind == "raise":
            raise RuntimeError(f"injected crash in task {task}")
        if kind == "hang":
            release.wait(60)  # past timeout_seconds; the runner abandons this thread
        return math.nan if kind == "nan" else 1.0

    configs = _configs()
    ids = {store.enqueue_rollout(i, config=configs[i % 3]).rollout_id: i for i in range(n)}
    t0 = time.monotonic()
    group = start_runners(agent, store, n=16, heartbeat_interval_s=0.5, default_timeout_s=2.0)
    try:
        done = store.wait_for_rollouts(list(ids), timeout=50)
        elapsed = time.monotonic() - t0
    finally:
        release.set()
        group.stop(timeout=10)
    assert len(done) == n, f"{n - len(done)} rollouts not terminal after {elapsed:.1f} s"

    rollouts = {r.rollout_id: r for r in store.query_rollouts()}
    by_rollout: dict[str, list] = {rid: [] for rid in ids}
    for a in store.query_attempts():
        by_rollout[a.rollout_id].append(a)
    rewarded = {s.rollout_id for s in store.query_spans() if s.name == "reward"
                and s.attempt_id == by_rollout[s.rollout_id][-1].attempt_id}
    mismatches = []
    for rid, i in ids.items():
        cfg, attempts, rollout = configs[i % 3], by_rollout[rid], rollouts[rid]
        want = _expected(plans[i], cfg)
        got = [a.status for a in attempts]
        final = "succeeded" if want[-1] == "succeeded" else "failed"
        if got != want or rollout.status != final or rollout.num_attempts != len(want) or calls[i] != len(want):
            mismatches.append((i, plans[i], cfg.max_attempts, want, got, rollout.status))
        assert [a.sequence_id for a in attempts] == list(range(1, len(attempts) + 1))
        assert all(a.status in ATTEMPT_TERMINAL and a.end_time is not None for a in attempts)
        assert all(a.error for a in attempts if a.status != "succeeded")  # every failure says why
        if final == "succeeded" and rid not in rewarded:
            mismatches.append((i, "no reward span on the succeeded attempt", [a.error for a in attempts]))
        if want[-1] == "failed" and rid in rewarded:  # a crash or a NaN records no reward (a released hang may)
            mismatches.append((i, "reward span on a failed attempt", [a.error for a in attempts]))
    assert not mismatches, mismatches[:5]
    # the runners' own counts agree with the store: nothing dropped, nothing counted twice
    stats = group.status()
    statuses = Counter(a.status for attempts in by_rollout.values() for a in attempts)
    assert stats["succeeded"].sum() == statuses["succeeded"]
    assert stats["failed"].sum() == statuses["failed"]
    assert stats["timed_out"].sum() + stats["abandoned"].sum() == statuses["timeout"]
    assert statuses["timeout"] > 0 and statuses["failed"] > 0 and statuses["succeeded"] > 0


def test_watchdog_ends_silent_and_overdue_attempts_and_requeues(store):
    silent = store.enqueue_rollout("silent", config=RolloutConfig(max_attempts=2, unresponsive_seconds=0.3))
    slow = store.enqueue_rollout("slow", config=RolloutConfig(max_attempts=1, timeout_seconds=0.3))
    fine = store.enqueue_rollout("fine", config=RolloutConfig(unresponsive_seconds=0.3))
    items = [store.dequeue_rollout("w-dead") for _ in range(3)]
    for it in items:
        store.update_attempt(it.rollout.rollout_id, it.attempt.attempt_id, status="running")
    assert store.sweep_attempts() == []  # nothing is overdue yet
    for _ in range(4):  # "fine" keeps sending heartbeats, the others stay silent
        time.sleep(0.15)
        store.update_attempt(fine.rollout_id, items[2].attempt.attempt_id, heartbeat=True)
    store.sweep_attempts()  # (a StoreServer's background sweep may have ended them first)
    ended = {a.rollout_id: a for a in store.query_attempts() if a.status in ("unresponsive", "timeout")}
    assert set(ended) == {silent.rollout_id, slow.rollout_id}
    assert ended[silent.rollout_id].status == "unresponsive" and "unresponsive_seconds=0.3" in ended[silent.rollout_id].error
    assert ended[slow.rollout_id].status == "timeout" and "timeout_seconds=0.3" in ended[slow.rollout_id].error
    assert store.get_rollout_by_id(silent.rollout_id).status == "requeuing"  # one attempt left
    assert store.get_rollout_by_id(slow.rollout_id).status == "failed"  # max_attempts=1
    assert store.get_rollout_by_id(fine.rollout_id).status == "running"
    retry = store.dequeue_rollout("w-new")
    assert retry.rollout.rollout_id == silent.rollout_id and retry.attempt.sequence_id == 2
    again = {a.attempt_id for a in store.sweep_attempts()}  # an ended attempt is never ended twice
    assert not again & {a.attempt_id for a in ended.values()}
    # a late heartbeat or result from the dead worker cannot revive its attempt
    assert store.update_attempt(silent.rollout_id, items[0].attempt.attempt_id, heartbeat=True).status == "unresponsive"


def test_waiting_callers_run_the_watchdog_without_any_thread(store):
    rid = store.enqueue_rollout("x", config=RolloutConfig(max_attempts=2, unresponsive_seconds=0.2)).rollout_id
    store.dequeue_rollout("w-dead")  # a worker that dies without a word
    done = store.wait_for_rollouts([rid], timeout=0.1)
    assert done == []
    retry = store.dequeue_rollout("w-2", timeout=3.0)  # waits; the watchdog requeues the silent attempt
    assert retry is not None and retry.attempt.sequence_id == 2
    assert store.query_attempts(rid)[0].status == "unresponsive"


def test_retry_condition_decides_which_failures_retry(store):
    cfg = RolloutConfig(max_attempts=3, retry_condition=["timeout"])
    rid = store.enqueue_rollout("x", config=cfg).rollout_id
    it = store.dequeue_rollout()
    store.update_attempt(rid, it.attempt.attempt_id, status="timeout")
    it = store.dequeue_rollout()
    assert it.attempt.sequence_id == 2
    store.update_attempt(rid, it.attempt.attempt_id, status="failed", error="boom")
    assert store.get_rollout_by_id(rid).status == "failed" and store.dequeue_rollout() is None
    assert store.get_rollout_by_id(rid).config.retry_condition == ["timeout"]  # stored as given


def test_bad_retry_condition_names_the_field():
    with pytest.raises(ValidationError, match="retry_condition"):
        RolloutConfig(retry_condition=["succeeded"])
    with pytest.raises(ValidationError, match="unresponsive_seconds"):
        RolloutConfig(unresponsive_seconds=0)


def test_worker_records_follow_dequeue_heartbeats_and_ends(store):
    rid = store.enqueue_rollout("x").rollout_id
    it = store.dequeue_rollout("w1")
    (w,) = store.query_workers()
    assert (w.worker_id, w.status, w.current_attempt_id) == ("w1", "busy", it.attempt.attempt_id)
    first = w.last_heartbeat_time
    time.sleep(0.01)
    store.update_attempt(rid, it.attempt.attempt_id, status="running", heartbeat=True)
    assert store.query_workers()[0].last_heartbeat_time > first
    store.update_attempt(rid, it.attempt.attempt_id, status="succeeded")
    (w,) = store.query_workers()
    assert w.status == "idle" and w.current_attempt_id is None
    w2 = store.update_worker("w2", status="idle", heartbeat_stats={"succeeded": 3})
    assert w2.heartbeat_stats == {"succeeded": 3} and w2.last_heartbeat_time is not None
    with pytest.raises(ConfigError, match="status"):
        store.update_worker("w2", status="dancing")
    with pytest.raises(ConfigError, match="worker_id"):
        store.update_worker("", status="idle")
    assert [w.worker_id for w in store.query_workers()] == ["w1", "w2"]  # the bad calls changed nothing
    assert store.query_workers()[1].heartbeat_stats == {"succeeded": 3}
    df = store.workers_df()
    assert list(df["worker_id"]) == ["w1", "w2"] and (df["heartbeat_age_s"] >= 0).all()


def test_runner_abandons_an_attempt_ended_elsewhere_and_goes_on(resourced):
    store = resourced
    release = threading.Event()

    def agent(task, llm):
        if task == "hang":
            release.wait(30)
        return 1.0

    hung = store.enqueue_rollout("hang", config=RolloutConfig(max_attempts=1)).rollout_id
    group = start_runners(agent, store, n=1, heartbeat_interval_s=0.1)
    try:
        deadline = time.monotonic() + 10
        while store.get_rollout_by_id(hung).status != "running" and time.monotonic() < deadline:
            time.sleep(0.02)
        aid = store.query_attempts(hung)[0].attempt_id
        store.update_attempt(hung, aid, status="unresponsive", error="ended by an operator")  # as the watchdog would
        nxt = store.enqueue_rollout("next").rollout_id
        assert [r.status for r in store.wait_for_rollouts([nxt], timeout=10)] == ["succeeded"]
        assert group.status()["abandoned"].sum() == 1
    finally:
        release.set()
        group.stop(timeout=5)


def test_abort_on_interrupt_ends_in_flight_attempts_and_requeues(resourced):
    store = resourced
    release = threading.Event()

    def agent(task, llm):
        release.wait(30)
        return 1.0

    ids = [store.enqueue_rollout(i, config=RolloutConfig(max_attempts=2)).rollout_id for i in range(3)]
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        with start_runners(agent, store, n=2) as group:  # the algorithm side, interrupted
            deadline = time.monotonic() + 10
            while len(store.query_rollouts(status=["running"])) < 2 and time.monotonic() < deadline:
                time.sleep(0.02)
            raise KeyboardInterrupt
    try:
        assert time.monotonic() - t0 < 10
        assert not any(r.alive for r in group.runners)
        attempts = store.query_attempts()
        assert all(a.status in ATTEMPT_TERMINAL for a in attempts)  # nothing left running
        aborted = [a for a in attempts if a.status == "failed"]
        assert len(aborted) == 2 and all("aborted: KeyboardInterrupt" in a.error for a in aborted)
        statuses = sorted(store.get_rollout_by_id(rid).status for rid in ids)
        assert statuses == ["queuing", "requeuing", "requeuing"]  # retries left: queued for the next runners
        assert {w.status for w in store.query_workers()} == {"stopped"}
    finally:
        release.set()


def test_graceful_stop_lets_attempts_finish(resourced):
    store = resourced
    rid = store.enqueue_rollout("x").rollout_id

    def agent(task, llm):
        time.sleep(0.3)
        return 1.0

    with start_runners(agent, store, n=1):
        deadline = time.monotonic() + 10
        while store.get_rollout_by_id(rid).status != "running" and time.monotonic() < deadline:
            time.sleep(0.02)
    assert store.get_rollout_by_id(rid).status == "succeeded"
    assert all(r.status in ROLLOUT_TERMINAL for r in store.query_rollouts())
