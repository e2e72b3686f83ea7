"""Held-out reward per slice: the calc tasks' ``ops`` field, ``evaluate(by=...)``, ``slice_by`` in the metrics rows,
the reward-curve PNG and live curve, and ``episodes_df(by=...)``.

The fast tests run real runners on a real store with a deterministic agent that needs no model (its reward is a
function of the task), so the expected counts are exact; the one slow test trains one real step on SmolLM2-135M.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections import Counter

import pandas as pd
import pytest
from openai import OpenAI

from lightning_nb import AlgorithmConfig, GRPOConfig, GRPOTrainer, InMemoryStore, LightningRL, semconv, start_runners
from lightning_nb.algorithm.lightning_rl import SliceReport
from lightning_nb.slices import slice_labels
from lightning_nb.tasks.calc import load_tasks
from lightning_nb.tasks.calc.dataset import count_ops
from lightning_nb.errors import ConfigError
from lightning_nb.types import LLMResource, Span
from conftest import IDLE_LLM

pytestmark = pytest.mark.filterwarnings("ignore:.*the agent crashed:RuntimeWarning")

# 5 one-operation tasks (one missed), 3 two-operation tasks (one solved), 1 two-operation task whose agent crashes
TASKS = [
    {"id": "a1", "answer": 10, "ops": 1}, {"id": "a2", "answer": 60, "ops": 1}, {"id": "a3", "answer": 20, "ops": 1},
    {"id": "a4", "answer": 70, "ops": 1}, {"id": "miss", "answer": 30, "ops": 1},
    {"id": "b1", "answer": 80, "ops": 2}, {"id": "b2", "answer": 40, "ops": 2}, {"id": "hit", "answer": 90, "ops": 2},
    {"id": "crash", "answer": 55, "ops": 2},
]


def _graded(task, llm):
    """Solves one-operation tasks (except ``miss``) and fails two-operation ones (except ``hit``); ``crash`` raises."""
    if task["id"] == "crash":
        raise RuntimeError("the agent crashed")
    if task["id"] in ("miss", "hit"):
        return 0.0 if task["id"] == "miss" else 1.0
    return 1.0 if task["ops"] == 1 else 0.0


@pytest.fixture
def trainer(engine):
    """A real GRPOTrainer on the session engine; evaluate() never updates its weights."""
    return GRPOTrainer(engine, GRPOConfig(track_reference_kl=False))


@pytest.fixture
def graded(trainer):
    """``(store, algo)``: an InMemoryStore served by 3 runners of :func:`_graded`, and a LightningRL on TASKS."""
    store = InMemoryStore()
    store.add_resources({"main_llm": LLMResource(endpoint=IDLE_LLM, model="unused")})
    runners = start_runners(_graded, store, n=3)
    try:
        yield store, LightningRL(store, trainer, TASKS, TASKS, AlgorithmConfig(rollout_timeout_s=30))
    finally:
        runners.stop()


# ----- the calc task set ---------------------------------------------------------------------------
def test_calc_tasks_carry_their_number_of_operations():
    for split in ("train", "val"):
        for task in load_tasks(split):
            assert task["ops"] == count_ops(task["expression"]) == (2 if task["expression"].count(" ") == 4 else 1)
    # the demo's 64 held-out tasks: 42 with one operation, 22 with two
    assert Counter(t["ops"] for t in load_tasks("val", limit=64)) == {1: 42, 2: 22}
    assert count_ops("49 + 29 - 23") == 2 and count_ops("12 * 5") == 1


# ----- evaluate(by=...) ----------------------------------------------------------------------------
def test_evaluate_by_field_gives_exact_counts_per_slice(graded):
    store, algo = graded
    report = algo.evaluate(by="ops", progress=False)
    assert isinstance(report, SliceReport) and report.by == "ops"
    assert report.slices == {"ops=1": (4 / 5, 5, 4), "ops=2": (1 / 4, 4, 1)}  # the crash counts 0, in n
    assert (report.n, report.solved) == (9, 5) and report.mean == pytest.approx(5 / 9)
    assert len(store.query_rollouts()) == len(TASKS)  # one rollout per task: sliced afterwards
    assert algo.last_report is report
    df = report.df
    assert list(df.columns) == ["slice", "n", "solved", "mean"]
    assert df.values.tolist() == [["ops=1", 5, 4, 0.8], ["ops=2", 4, 1, 0.25], ["all", 9, 5, pytest.approx(5 / 9)]]
    html = report._repr_html_()
    assert "Reward by ops" in html and 'data-slice="ops=2"' in html and "0.250" in html
    assert str(report).splitlines() == ["reward by ops: 0.556 (5/9 solved)", "  ops=1  0.800 (4/5 solved)",
                                        "  ops=2  0.250 (1/4 solved)"]
    assert report.metrics() == {"val_reward/ops=1": 0.8, "val_reward/ops=2": 0.25}
    # without by: a float, the same mean (backwards compatible)
    plain = algo.evaluate(progress=False)
    assert type(plain) is float and plain == pytest.approx(report.mean)
    # each task's reward, in task order: the spread behind the mean (the crash is a finished rollout: 0)
    assert algo.last_eval_rewards == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0]


def test_evaluate_by_function_and_on_given_tasks(graded):
    _, algo = graded
    report = algo.evaluate(TASKS[:6], by=lambda t: "big" if t["answer"] >= 50 else "small", progress=False)
    assert report.by == "<lambda>"
    assert report.slices == {"big": (2 / 3, 3, 2), "small": (2 / 3, 3, 2)}  # sorted by label
    assert report.n == 6 and report.solved == 4


def test_bad_by_names_the_field_or_the_task_and_enqueues_nothing(graded):
    store, algo = graded
    tasks = [*TASKS[:2], {"id": "odd", "answer": 3}]
    with pytest.raises(ConfigError, match=r"by='ops': task 2 has no field 'ops' \(its keys: \['id', 'answer'\]\)"):
        algo.evaluate(tasks, by="ops")
    with pytest.raises(ConfigError, match="task 0 has no field 'level'"):
        algo.evaluate(by="level")

    def level(task):
        return {10: "easy", 60: "hard"}[task["answer"]]

    with pytest.raises(ConfigError, match=r"by=level: raised on task 2: KeyError: 20") as info:
        algo.evaluate(by=level)
    assert isinstance(info.value.__cause__, KeyError)
    with pytest.raises(ConfigError, match="a task field name .str. or a function"):
        algo.evaluate(by=3)
    assert store.query_rollouts() == []  # labels are checked before anything is enqueued
    # LightningRL(slice_by=...) is checked against the val tasks when built
    with pytest.raises(ConfigError, match="task 2 has no field 'ops'"):
        LightningRL(store, algo.trainer, TASKS, tasks, slice_by="ops")
    with pytest.raises(ConfigError, match="task 0 has no field 'id'"):
        slice_labels([5], "id")


# ----- episodes_df(by=...) -------------------------------------------------------------------------
def test_episodes_df_by_adds_a_slice_column(graded):
    store, algo = graded
    report = algo.evaluate(by="ops", progress=False)
    assert report.slices["ops=2"][1:] == (4, 1)
    episodes = store.episodes_df(mode="val", by="ops")  # from "ops=2: 1/4" to its failing episodes
    assert episodes.columns.get_loc("slice") == episodes.columns.get_loc("input") + 1
    assert episodes["slice"].tolist() == [f"ops={t['ops']}" for t in TASKS]
    failing = episodes[(episodes["slice"] == "ops=2") & (episodes["reward"] < 1)]
    assert sorted(json.loads(i)["id"] for i in failing["input"]) == ["b1", "b2", "crash"]
    assert failing["status"].tolist().count("failed") == 1
    by_fn = store.episodes_df(by=lambda t: t["id"][0])
    assert by_fn["slice"].tolist() == [t["id"][0] for t in TASKS]
    assert "slice" not in store.episodes_df().columns
    with pytest.raises(ConfigError, match=r"by='level': rollout 0 \(ro-[^)]+\) has no field 'level'"):
        store.episodes_df(by="level")


# ----- the reward curve (PNG) and the live curve --------------------------------------------------
def test_reward_curve_png_draws_one_line_per_slice(tmp_path):
    from lightning_nb.cli.demo import _plot

    csv = tmp_path / "metrics.csv"
    pd.DataFrame({"step": [1, 2], "reward_mean": [0.2, 0.4], "val_reward": [math.nan, 0.6],
                  "val_reward/ops=1": [math.nan, 0.9], "val_reward/ops=2": [math.nan, 0.1]}).to_csv(csv, index=False)
    png = tmp_path / "curve.png"
    legend = _plot(csv, png, 0.5, 0.6, {"ops=1": 0.7, "ops=2": 0.0})
    assert legend == ["train reward (mean of step)", "train reward (rolling 3)", "held-out val reward",
                      "held-out ops=1", "held-out ops=2"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    plain = pd.read_csv(csv)[["step", "reward_mean", "val_reward"]]
    plain.to_csv(csv, index=False)
    assert "held-out ops=1" not in _plot(csv, png, 0.5, 0.6)  # no slice columns: no slice lines
    plain.assign(val_ood_reward=[math.nan, 0.3]).to_csv(csv, index=False)
    assert _plot(csv, png, 0.5, 0.6, ood_before=0.1)[-1] == "held-out val_ood (other wordings, numbers)"


def _finish_val(store, task, reward, weight_version):
    """Run one val rollout of ``task`` through the store by hand: an LLM span at ``weight_version``, its reward."""
    store.enqueue_rollout(task, mode="val")
    item = store.dequeue_rollout("test-worker")
    rid, aid = item.rollout.rollout_id, item.attempt.attempt_id
    store.update_attempt(rid, aid, status="running")
    now = time.time()
    for name, attributes in (("llm.chat.completions", {semconv.WEIGHT_VERSION: weight_version}),
                             ("reward", {semconv.REWARD: reward})):
        store.add_span(Span(rollout_id=rid, attempt_id=aid, trace_id=uuid.uuid4().hex, span_id=uuid.uuid4().hex[:16],
                            name=name, start_time=now, end_time=now + 0.01, attributes=attributes))
    store.update_attempt(rid, aid, status="succeeded")


def test_live_reward_curve_draws_one_val_line_per_slice():
    from widgets import RewardCurve

    store = InMemoryStore()
    curve = RewardCurve(store, batch_size=2, autostart=False, slice_by="ops")
    for task, reward, version in (({"ops": 1}, 1.0, 0), ({"ops": 2}, 0.0, 0), ({"ops": 1}, 0.0, 0),
                                  ({"ops": 1}, 1.0, 2), ({"ops": 2}, 1.0, 2), ({"other": 1}, 1.0, 2)):
        _finish_val(store, task, reward, version)
    curve.refresh()
    s = curve.series()
    assert s["val"]["x"] == [0, 2] and s["val"]["n"] == [3, 3]  # a rollout without the field counts in "val mean"
    assert s["val ops=1"]["x"] == [0, 2] and s["val ops=1"]["mean"] == [0.5, 1.0] and s["val ops=1"]["n"] == [2, 1]
    assert s["val ops=2"]["mean"] == [0.0, 1.0]
    traces = {t.name: t for t in curve.fig.data}
    assert list(traces) == ["train mean (min–max)", "val mean", "batch mean (min–max)", "val ops=1", "val ops=2"]
    assert list(traces["val ops=1"].y) == [0.5, 1.0] and list(traces["val ops=2"].x) == [0, 2]
    curve.close()


# ----- slice_by during training, on the real model ---------------------------------------------------
def _one_call_then_graded(task, llm):
    """One short LLM call (so the step has triplets), then reward 1.0 for one-operation tasks, 0.0 for two."""
    OpenAI(base_url=llm.endpoint, api_key="x", max_retries=0).chat.completions.create(
        model=llm.model, messages=[{"role": "user", "content": "Say hi."}], **llm.sampling_parameters)
    return 1.0 if task["ops"] == 1 else 0.0


@pytest.mark.slow
def test_slice_by_puts_val_reward_per_slice_in_the_metrics_row_and_curve(engine, pristine, proxied_store, tmp_path):
    from lightning_nb.cli.demo import _plot

    store = proxied_store
    runners = start_runners(_one_call_then_graded, store, n=2)
    trainer = GRPOTrainer(engine, GRPOConfig(track_reference_kl=False))
    val = load_tasks("val", limit=6)  # ops 2, 2, 1, ...: both slices
    expected = {f"val_reward/ops={k}": float(k == 1) for k in (1, 2)}
    try:
        algo = LightningRL(store, trainer, load_tasks("train", limit=4), val, AlgorithmConfig(
            tasks_per_step=1, group_size=2, max_tokens=4, max_sample_rounds=1, val_every=1), slice_by="ops")
        row = algo.step()
    finally:
        runners.stop()
    n1 = sum(t["ops"] == 1 for t in val)
    assert {k: row[k] for k in expected} == expected and row["val_reward"] == pytest.approx(n1 / len(val))
    assert algo.val_history == [(1, row["val_reward"])]
    df = algo.metrics_df()
    assert {"val_reward", *expected} <= set(df.columns)
    df.to_csv(tmp_path / "metrics.csv", index=False)
    legend = _plot(tmp_path / "metrics.csv", tmp_path / "curve.png", 0.5, row["val_reward"])
    assert {"held-out ops=1", "held-out ops=2"} <= set(legend)
