"""Python-side state of the live widgets, on the real store, runners, engine and trainer (no browser).

The browser test (tests/test_browser.py) checks what a person sees; these check the
values the widgets hold and that their buttons drive the real objects.
"""

from __future__ import annotations

import html
import threading
import time
import uuid

import pytest

from lightning_nb import (AlgorithmConfig, GRPOConfig, GRPOTrainer, InMemoryStore, LightningRL, LLMProxy,
                          semconv, start_runners)
from lightning_nb.tasks.calc import calc_agent
from lightning_nb.runners import Runner, live_runner_group
from lightning_nb.tracing.tracer import Tracer
from lightning_nb.types import Span
from widgets import RewardCurve, RunnerPanel, RunPanel, SpanBrowser, close_all, dashboard
from conftest import IDLE_LLM


def _finish(store, reward, *, mode="train", group_id=None, weight_version=None, status="succeeded"):
    """Run one rollout through the store by hand: dequeue, optional LLM span, reward span, final status."""
    metadata = {"group_id": group_id} if group_id else {}
    store.enqueue_rollout({"q": reward}, mode=mode, metadata=metadata)
    item = store.dequeue_rollout("test-worker")
    rid, aid = item.rollout.rollout_id, item.attempt.attempt_id
    store.update_attempt(rid, aid, status="running")
    now = time.time()

    def span(name, attributes):
        store.add_span(Span(rollout_id=rid, attempt_id=aid, trace_id=uuid.uuid4().hex, span_id=uuid.uuid4().hex[:16],
                            name=name, start_time=now, end_time=now + 0.01, attributes=attributes))

    if weight_version is not None:
        span("llm.chat.completions", {semconv.WEIGHT_VERSION: weight_version})
    if reward is not None:
        span("reward", {semconv.REWARD: reward})
    store.update_attempt(rid, aid, status=status, error=None if status == "succeeded" else "boom")
    return rid


def _until(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


# ----- reward curve ------------------------------------------------------------------------------
def test_reward_curve_values_follow_the_store():
    store = InMemoryStore()
    curve = RewardCurve(store, batch_size=2, autostart=False)
    curve.refresh()
    assert curve.series()["train"]["x"] == [] and list(curve.fig.data[0].y) == []
    _finish(store, 1.0, group_id="1:task-a")
    _finish(store, 0.0, group_id="1:task-a")
    _finish(store, 1.0, group_id="2.0:task-b")          # dynamic sampling writes "<step>.<round>:<task>"
    _finish(store, None, group_id="2.1:task-c", status="failed")  # failed, no reward: counts 0
    _finish(store, 0.5, mode="val", weight_version=2)
    curve.refresh()
    s = curve.series()
    assert s["train"] == {"x": [1, 2], "mean": [0.5, 0.5], "min": [0.0, 0.0], "max": [1.0, 1.0], "n": [2, 2]}
    assert s["val"]["x"] == [2] and s["val"]["mean"] == [0.5]
    assert s["batch"]["mean"] == [0.5, 0.5, 0.5] and s["batch"]["n"] == [2, 2, 1]
    # the figure shows the same numbers
    assert list(curve.fig.data[0].x) == [1, 2] and list(curve.fig.data[0].y) == [0.5, 0.5]
    assert list(curve.fig.data[0].error_y.array) == [0.5, 0.5]
    assert list(curve.fig.data[1].y) == [0.5] and list(curve.fig.data[2].y) == [0.5, 0.5, 0.5]
    _finish(store, 1.0, group_id="3:task-d")
    curve.refresh()
    assert list(curve.fig.data[0].x) == [1, 2, 3] and curve.fig.data[0].y[-1] == 1.0
    curve.close()


def test_reward_curve_polls_in_the_background_and_stops_when_closed():
    store = InMemoryStore()
    curve = RewardCurve(store, batch_size=1, interval_s=0.05)
    assert curve.polling
    _finish(store, 1.0, group_id="1:t")
    _until(lambda: list(curve.fig.data[2].y) == [1.0])
    curve.close()
    assert not curve.polling and curve._lnb_thread is not None and not curve._lnb_thread.is_alive()
    count = curve.refresh_count
    _finish(store, 0.0, group_id="1:t")
    time.sleep(0.3)
    assert list(curve.fig.data[2].y) == [1.0] and curve.refresh_count == count  # no update after close


def test_reward_curve_holds_back_a_step_the_trainer_is_paused_inside(engine, pristine, proxied_store):
    """Paused ``before update`` of step 2, step 2's rollouts are in the store but its point is not final."""
    import itertools

    from openai import OpenAI

    store, gate, counter = proxied_store, threading.Event(), itertools.count()

    def agent(task, llm):  # one LLM call (a triplet); step 2's rollouts (the 3rd and 4th) wait for the gate
        i = next(counter)
        OpenAI(base_url=llm.endpoint, api_key="x", max_retries=0).chat.completions.create(
            model=llm.model, messages=[{"role": "user", "content": "Say hi."}], **llm.sampling_parameters)
        if i >= 2:
            gate.wait(120)
        return float(i % 2)

    runners = start_runners(agent, store, n=2)
    trainer = GRPOTrainer(engine, GRPOConfig(track_reference_kl=False))
    algo = LightningRL(store, trainer, [{"id": "t", "question": "1 + 1?", "answer": 2}], config=AlgorithmConfig(
        tasks_per_step=1, group_size=2, max_tokens=4, max_sample_rounds=1))
    curve = RewardCurve(store, autostart=False, trainer=trainer)
    unbound = RewardCurve(store, autostart=False)  # no trainer: draws every step with finished rollouts
    try:
        algo.start(steps=2)
        assert algo.wait(until_step=1, timeout=300)
        _until(lambda: len(store.query_rollouts()) == 4, timeout=60)  # step 2 is collecting (held by the gate)
        algo.pause(wait=False)  # the loop parks once step 2's rollouts finish, before its update
        gate.set()
        assert algo.pause(timeout=300) and algo.paused_at == "before update" and algo.global_step == 1
        for c in (curve, unbound):
            c.refresh()
        assert sorted(curve.train) == [1, 2]  # step 2's rollouts were read...
        assert curve.series()["train"]["x"] == [1] and list(curve.fig.data[0].x) == [1]  # ...and held back
        assert unbound.series()["train"]["x"] == [1, 2]
        algo.resume()
        assert algo.wait(timeout=300) and algo.global_step == 2
        curve.refresh()  # no rollout finished since: the trainer's step alone moves the curve
        assert curve.series()["train"]["x"] == [1, 2] and list(curve.fig.data[0].x) == [1, 2]
    finally:
        algo.stop(timeout=60)
        gate.set()
        runners.stop()
        curve.close()
        unbound.close()


# ----- span browser (real engine, proxy and calc agent) --------------------------------------------
@pytest.fixture
def served(engine):
    store = InMemoryStore()
    proxy = LLMProxy(engine, store).start()
    resource = proxy.as_resource().model_copy(update={"sampling_parameters": {"temperature": 0.0, "max_tokens": 8}})
    store.add_resources({"main_llm": resource})
    yield store
    proxy.stop()


def test_span_browser_table_filters_and_tree(served):
    store = served
    runner = Runner(calc_agent, store, Tracer(store))
    rollout = runner.step({"id": "t1", "question": "Tom has 2 apples and gets 3 more. How many now?", "answer": 5})
    rid = rollout.rollout_id
    spans = store.query_spans(rid)
    llm = [s for s in spans if s.name == "llm.chat.completions"]
    assert llm and any(s.name == "reward" for s in spans)

    browser = SpanBrowser(store, autostart=False)
    browser.refresh()
    names = [row[4] for row in browser.table.rows]
    assert len(browser.table.rows) == len(spans) and {"agent", "reward", "llm.chat.completions"} <= set(names)
    assert browser.table.row_keys == [rid] * len(spans)
    row = browser.table.rows[names.index("llm.chat.completions")]
    assert row[6] == llm[-1].attributes["gen_ai.usage.input_tokens"]  # newest LLM call first

    browser.name_filter.value = "reward"  # observing the filter refreshes at once
    assert [r[4] for r in browser.table.rows] == ["reward"]
    browser.name_filter.value = "(all)"
    browser.attempt_filter.value = "no-such-attempt"
    assert browser.table.rows == []
    browser.attempt_filter.value = ""

    assert browser.tree.value == ""
    browser.table.selected = rid  # what a click on a row does
    tree = browser.tree.value
    assert rid in browser.tree_title.value
    assert "Solve the math problem" in html.unescape(tree)
    assert html.escape(llm[0].attributes["gen_ai.completion"]) in tree
    assert f"{llm[0].attributes['gen_ai.usage.input_tokens']} prompt + " in tree and "completion tokens" in tree
    assert tree.index('data-name="agent"') < tree.index('data-name="llm.chat.completions"') < tree.index(
        'data-name="reward"')
    browser.close()


# ----- runner panel -----------------------------------------------------------------------------
def test_runner_panel_counts_and_start_stop_buttons():
    store = InMemoryStore()
    store.add_resources({"main_llm": {"endpoint": IDLE_LLM, "model": "none"}})
    group = start_runners(lambda task, llm: 1.0, store, n=2)
    panel = RunnerPanel(group, autostart=False)
    try:
        ids = [r.rollout_id for r in store.enqueue_rollouts([1, 2, 3])]
        assert len(store.wait_for_rollouts(ids, timeout=30)) == 3
        _until(lambda: group.status()["succeeded"].sum() == 3)
        panel.refresh()
        assert "2 of 2 runners alive" in panel.table.value
        assert panel.start_button.disabled and not panel.stop_button.disabled

        panel.stop_button.click()
        panel._stopper.join(30)
        panel.refresh()
        assert not any(r.alive for r in group.runners)
        assert "0 of 2 runners alive" in panel.table.value and 'data-state="stopped"' in panel.table.value
        assert not panel.start_button.disabled and panel.stop_button.disabled

        panel.start_button.click()  # a new group through start_runners' replace rule (nothing runs: no warning)
        panel.refresh()
        restarted = panel.runners
        assert restarted is not group and restarted is live_runner_group(store)
        assert all(r.alive for r in restarted.runners) and "2 of 2 runners alive" in panel.table.value
        assert restarted.status()["succeeded"].sum() == 3  # counts carried over to the new threads
        assert "started 2 runner threads" in panel.status_line.value
        more = store.enqueue_rollout(4).rollout_id
        assert len(store.wait_for_rollouts([more], timeout=30)) == 1
    finally:
        panel.close()
        panel.runners.stop()


def _runner_threads() -> int:
    return sum(t.name.startswith("lightning_nb-runner-") and not t.name.endswith("-agent") and t.is_alive()
               for t in threading.enumerate())


def test_runner_panel_follows_a_rerun_of_start_runners_and_start_replaces():
    store = InMemoryStore()
    store.add_resources({"main_llm": {"endpoint": IDLE_LLM, "model": "none"}})
    before = _runner_threads()
    old = start_runners(lambda task, llm: 0.0, store, n=2)  # the agent before the user edited its reward
    panel = RunnerPanel(old, autostart=False)
    try:
        new = start_runners(lambda task, llm: 1.0, store, n=2)  # the cell re-run after the edit: an info line
        assert "stopped the previous group of 2" in new.replaced
        panel.refresh()
        assert panel.runners is new and "2 of 2 runners alive" in panel.table.value
        assert all(r.worker_id in panel.table.value for r in new.runners)
        assert not any(r.worker_id in panel.table.value for r in old.runners)
        assert panel.start_button.disabled  # every runner of the live group runs
        _until(lambda: _runner_threads() == before + 2)

        new.runners[0].stop()  # one runner of the live group ends; Start replaces the whole group
        new.runners[0].join(10)
        panel.refresh()
        assert not panel.start_button.disabled
        panel.start_button.click()
        assert "stopped the previous group of 1" in panel.status_line.value  # the info line, shown in the panel
        assert panel.runners is live_runner_group(store) and panel.runners is not new
        _until(lambda: _runner_threads() == before + 2)  # 2 threads, never 4 or 6
        ids = [r.rollout_id for r in store.enqueue_rollouts(range(4))]
        assert [store.final_reward(r.rollout_id) for r in store.wait_for_rollouts(ids, timeout=30)] == [1.0] * 4
    finally:
        panel.close()
        panel.runners.stop()


# ----- trainer panel (real engine and trainer) ------------------------------------------------------
def test_trainer_panel_buttons_drive_the_trainer(engine, tmp_path):
    store = InMemoryStore()
    gate = threading.Event()

    def held_agent(task, llm):  # the step's rollouts run until the test opens the gate
        gate.wait(120)
        return 1.0

    store.add_resources({"main_llm": {"endpoint": IDLE_LLM, "model": "none"}})  # never called
    runners = start_runners(held_agent, store, n=2)
    trainer = GRPOTrainer(engine, GRPOConfig(track_reference_kl=False))
    algo = LightningRL(store, trainer, [{"id": "t", "question": "1 + 1?", "answer": 2}],
                       config=AlgorithmConfig(tasks_per_step=1, group_size=2))
    panel = RunPanel(algo, autostart=False, chat_max_tokens=8,
                     checkpoint_path=str(tmp_path / "ckpt-step-{step}.pt"))
    algo.start(steps=1)
    try:
        _until(lambda: len(store.query_rollouts()) == 2)
        panel.refresh()
        assert 'data-state="running"' in panel.summary.value
        assert not panel.pause_button.disabled and panel.resume_button.disabled and panel.chat_button.disabled

        panel.pause_button.click()  # the step's rollouts are still running: the loop parks once they finish
        assert algo.state == "pausing" and 'data-state="pausing"' in panel.summary.value
        assert panel.pause_button.disabled and panel.chat_button.disabled
        gate.set()
        _until(lambda: algo.state == "paused")
        panel.refresh()
        assert 'data-state="paused"' in panel.summary.value
        # the row "now": inside step 1 (its agent makes no LLM call, so no group has signal: a second round is due)
        assert algo.paused_at == "between sample rounds"
        assert "step 1 · paused between sample rounds" in panel.summary.value
        assert panel.pause_button.disabled and not panel.resume_button.disabled and not panel.chat_button.disabled

        panel.chat_input.value = "What is 2 + 2?"
        panel.chat_button.click()
        panel._worker.join(120)
        expected = engine.chat("What is 2 + 2?", max_tokens=8)  # greedy: the same weights give the same text
        assert f"<span>{html.escape(expected)}</span>" in panel.chat_log.value
        assert f"weights v{engine.weight_version}" in panel.chat_log.value  # the session engine may be trained

        panel.save_button.click()
        panel._worker.join(120)
        assert panel.last_checkpoint == tmp_path / "ckpt-step-0.pt" and panel.last_checkpoint.stat().st_size > 10**8
        assert "saved" in panel.status_line.value

        gate.clear()  # hold the next round's rollouts, so the loop is still running when we look
        panel.resume_button.click()
        assert algo.state == "running" and 'data-state="running"' in panel.summary.value
    finally:
        algo.stop(timeout=30)  # cancels the held rollouts
        gate.set()
        runners.stop()
        panel.close()
    panel.refresh()  # a closed panel ignores refreshes
    assert algo.state == "stopped"


def test_dashboard_shows_every_panel_and_close_stops_all_threads(engine):
    store = InMemoryStore()
    group = start_runners(lambda task, llm: 0.0, store, n=1)
    trainer = GRPOTrainer(engine, GRPOConfig(track_reference_kl=False))
    algo = LightningRL(store, trainer, [{"id": "t", "question": "1 + 1?", "answer": 2}])
    try:
        dash = dashboard(store, group, algo, interval_s=0.1)
        assert set(dash.panels) == {"run", "runners", "reward", "spans"}
        assert all(p.polling for p in dash.panels.values())
        _until(lambda: all(p.refresh_count >= 2 for p in dash.panels.values()))
        assert all(p.last_error is None for p in dash.panels.values())
        dash.close()
        assert not any(p.polling for p in dash.panels.values())
        names = {t.name for t in threading.enumerate()}
        assert not names & {"lightning_nb-RunPanel", "lightning_nb-RunnerPanel", "lightning_nb-RewardCurve",
                            "lightning_nb-SpanBrowser"}
        assert close_all() == 0  # nothing left open
    finally:
        group.stop()


# ----- HTML reprs -----------------------------------------------------------------------------------
def test_html_reprs_summarize_store_rollout_runners_and_trainer(engine):
    store = InMemoryStore()
    rid = _finish(store, 1.0, group_id="1:t")
    _finish(store, 0.0, mode="val", weight_version=0)
    text = store._repr_html_()
    assert "InMemoryStore" in text and rid in text and 'data-state="succeeded"' in text
    assert "train 1.000 (n=1)" in text and "val 0.000 (n=1)" in text

    rollout = store.get_rollout_by_id(rid)
    text = rollout._repr_html_()
    assert rid in text and 'data-state="succeeded"' in text and "1 of 1" in text and "group_id" in text

    group = start_runners(lambda task, llm: 0.0, store, n=2)
    try:
        text = group._repr_html_()
        assert "2 of 2 runners alive" in text and group.runners[0].worker_id in text
    finally:
        group.stop()

    trainer = GRPOTrainer(engine, GRPOConfig(track_reference_kl=False))
    algo = LightningRL(store, trainer, [{"id": "t", "question": "1 + 1?", "answer": 2}])
    algo.add_metrics(1, reward_mean=0.25, loss=0.5, kl=0.01, tokens_per_s=100.0, val_reward=0.75)
    text = algo._repr_html_()
    assert 'data-state="idle"' in text and "0.250" in text and "0.750" in text and "100.000" in text
    # kl is measured on some steps only (kl_every): the run panel keeps the latest measured value
    algo.add_metrics(2, reward_mean=0.5, loss=0.4, kl=float("nan"), tokens_per_s=90.0)
    assert 'data-key="KL to initial weights (latest)">0.010<' in algo._repr_html_()


def test_wait_for_rollouts_progress_bar(capsys):
    store = InMemoryStore()
    ids = [_finish(store, 1.0) for _ in range(3)]
    done = store.wait_for_rollouts(ids, timeout=5, progress=True)
    assert [r.rollout_id for r in done] == ids
    assert "3/3" in capsys.readouterr().err  # tqdm's text bar outside a notebook
