"""Shaping terms as named reward components, and sampling weights per slice (issue 14, part 2).

* ``calc_agent(all_numbers_bonus=...)`` emits the intermediate reward ``calc_uses_all_numbers`` for its first
  CALC that uses every number of the question; it never changes the final reward.
* ``store.rewards_df()`` has a ``component`` column (``"final"`` or the intermediate reward's name),
  ``LightningRL.step`` a ``reward/<component>`` column, the live ``RewardCurve`` a ``train <component>`` line.
* ``AlgorithmConfig.slice_weights`` draws training tasks with weights per ``slice_by`` label.

Fast tests use real runners on a real store with agents that need no model; the slow ones run SmolLM2-135M.
"""

from __future__ import annotations

import functools
from collections import Counter

import pytest
from openai import OpenAI

from lightning_nb import semconv
from lightning_nb import (AlgorithmConfig, GRPOConfig, GRPOTrainer, InMemoryStore, LightningRL,
                          emit_intermediate_reward, start_runners)
from lightning_nb.runners.runner import Runner
from lightning_nb.tracing.tracer import Tracer
from lightning_nb.tasks.calc import calc_agent, calc_reward, load_tasks
from lightning_nb.tasks.calc.agent import ALL_NUMBERS_COMPONENT, uses_all_numbers
from lightning_nb.errors import ConfigError
from lightning_nb.types import LLMResource
from conftest import IDLE_LLM

# 5 one-operation tasks, 4 two-operation tasks
TASKS = [{"id": f"a{i}", "ops": 1} for i in range(5)] + [{"id": f"b{i}", "ops": 2} for i in range(4)]

def _shaped(task, llm):
    """No model: 0.25 shaping (component "tidy") on two-operation tasks, twice 0.5 ("bonus") on b0; final 1.0 on ops 1."""
    if task["ops"] == 2:
        emit_intermediate_reward(0.25, name="tidy")
    if task["id"] == "b0":
        emit_intermediate_reward(0.5, name="bonus")
        emit_intermediate_reward(0.5, name="bonus")
    return 1.0 if task["ops"] == 1 else 0.0

@pytest.fixture
def served():
    """An InMemoryStore with a placeholder LLM resource and ``start(agent, n)`` runner groups stopped afterwards."""
    store = InMemoryStore()
    store.add_resources({"main_llm": LLMResource(endpoint=IDLE_LLM, model="unused")})
    groups = []

    def start(agent, n=3):
        groups.append(start_runners(agent, store, n=n))

    yield store, start
    for g in groups:
        g.stop()

def test_uses_all_numbers():
    q = "Eva has 29 marbles, gets 16 more, then gives away 12. How many marbles does Eva have now?"
    assert uses_all_numbers("29 + 16 - 12", q) and uses_all_numbers("(29+16)-12", q)
    assert not uses_all_numbers("29 - 12", q) and not uses_all_numbers("29 + 16 + 1", q)
    assert uses_all_numbers("3 * 3", "3 boxes of 3") and not uses_all_numbers("3 * 4", "3 boxes of 3")
    assert not uses_all_numbers("1 + 2", "no numbers here")

def test_rewards_df_lists_each_component_and_final_rewards_stay_final(served, engine):
    store, start = served
    start(_shaped)
    algo = LightningRL(store, GRPOTrainer(engine, GRPOConfig(track_reference_kl=False)), TASKS, TASKS,
                       AlgorithmConfig(rollout_timeout_s=30))
    assert algo.evaluate(progress=False) == pytest.approx(5 / 9)  # the final reward alone: shaping never adds to it
    df = store.rewards_df()
    assert list(df.columns) == ["rollout_id", "attempt_id", "mode", "component", "reward", "time", "judge_error"]
    assert Counter(df.component) == {"final": 9, "tidy": 4, "bonus": 2}
    sums = df.pivot_table("reward", "rollout_id", "component", aggfunc="sum", fill_value=0.0)
    by_task = {r.input["id"]: sums.loc[r.rollout_id].to_dict() for r in store.query_rollouts()}
    assert by_task["b0"] == {"bonus": 1.0, "final": 0.0, "tidy": 0.25}
    assert by_task["b3"] == {"bonus": 0.0, "final": 0.0, "tidy": 0.25}
    assert by_task["a0"] == {"bonus": 0.0, "final": 1.0, "tidy": 0.0}
    comps = store.reward_components([r.rollout_id for r in store.query_rollouts()])
    assert sorted(comps.values(), key=len) == [{"tidy": 0.25}] * 3 + [{"tidy": 0.25, "bonus": 1.0}]

def test_live_reward_curve_draws_one_line_per_component(served):
    from widgets import RewardCurve

    store, start = served
    start(_shaped)
    for task in TASKS:  # what LightningRL enqueues at step 1: mode train, group "<step>:<task id>"
        store.enqueue_rollout(task, mode="train", metadata={"group_id": f"1:{task['id']}"})
    assert len(store.wait_for_rollouts([r.rollout_id for r in store.query_rollouts()], timeout=30)) == 9
    curve = RewardCurve(store, autostart=False)
    curve.refresh()
    s = curve.series()
    assert s["train"]["mean"] == [pytest.approx(5 / 9)]
    assert s["train tidy"]["mean"] == [pytest.approx(4 * 0.25 / 9)] and s["train bonus"]["mean"] == [pytest.approx(1 / 9)]
    names = [t.name for t in curve.fig.data]
    assert names[3:] == ["train bonus", "train tidy"]
    assert list(curve.fig.data[4].y) == [pytest.approx(1 / 9)]
    curve.close()

# ----- sampling weights per slice --------------------------------------------------------------------
def _drawn(store, algo, n_tasks, steps=1):
    """Task ids of the groups ``steps`` collect() rounds enqueue (``n_tasks`` groups of 2 each), in order."""
    algo.config.tasks_per_step = n_tasks
    drawn = []
    for _ in range(steps):
        _, ids = algo.collect()
        drawn += [r.input["id"] for r in store.query_rollouts(rollout_ids=ids)][::2]
    return drawn

def test_slice_weights_draw_tasks_in_proportion(served, engine):
    store, start = served
    start(lambda task, llm: 0.0, n=4)
    trainer = GRPOTrainer(engine, GRPOConfig(track_reference_kl=False))
    cfg = AlgorithmConfig(group_size=2, dynamic_sampling=False, slice_weights={"ops=2": 3.0}, rollout_timeout_s=30)
    algo = LightningRL(store, trainer, TASKS, (), cfg, slice_by="ops")
    drawn = _drawn(store, algo, 1, steps=300)  # one task a step: the weights alone decide
    share = sum(d.startswith("b") for d in drawn) / len(drawn)
    assert abs(share - 12 / 17) < 0.1, share  # 4 tasks x 3 against 5 x 1; uniform would be 4/9
    algo.config.slice_weights = {"ops=2": 0.0}  # an edit between steps: the next draw follows it
    assert sorted(_drawn(store, algo, 5)) == ["a0", "a1", "a2", "a3", "a4"]  # weight 0: never drawn
    uniform = LightningRL(store, trainer, TASKS, (), AlgorithmConfig(group_size=2, dynamic_sampling=False,
                                                                       rollout_timeout_s=30))
    share = sum(d.startswith("b") for d in _drawn(store, uniform, 1, steps=300)) / 300
    assert abs(share - 4 / 9) < 0.1, share

@pytest.mark.parametrize("weights", [None, {"ops=2": 3.0}])
def test_a_step_draws_distinct_tasks_without_replacement(served, engine, weights):
    """AlgorithmConfig.tasks_per_step is "distinct training tasks per step": a task twice would merge two GRPO
    groups into one (same group_id). Also across dynamic-sampling rounds, and duplicates in train_tasks."""
    store, start = served
    start(lambda task, llm: 0.0, n=4)  # equal rewards: no group has signal, so dynamic sampling goes on
    trainer = GRPOTrainer(engine, GRPOConfig(track_reference_kl=False))
    cfg = AlgorithmConfig(group_size=2, tasks_per_step=9, dynamic_sampling=False, slice_weights=weights,
                          rollout_timeout_s=30)
    algo = LightningRL(store, trainer, TASKS + TASKS[:3], (), cfg, slice_by="ops")  # 3 tasks listed twice
    for _ in range(3):
        drawn = _drawn(store, algo, 9)
        assert sorted(drawn) == sorted(t["id"] for t in TASKS), drawn  # every task once, none twice
    rounds = LightningRL(store, trainer, TASKS, (), AlgorithmConfig(
        group_size=2, tasks_per_step=4, max_sample_rounds=3, slice_weights=weights, rollout_timeout_s=30),
        slice_by="ops")
    _, ids = rounds.collect()
    rollouts = store.query_rollouts(rollout_ids=ids)
    tasks = [r.input["id"] for r in rollouts][::2]
    assert rounds.last_sample_rounds == 3 and len(tasks) == 12
    # rounds of 4 distinct tasks; the step's unseen tasks first: rounds 1 and 2 and the first of round 3 are all 9
    assert all(len(set(tasks[k:k + 4])) == 4 for k in (0, 4, 8))
    assert sorted(set(tasks[:8])) == sorted(tasks[:8]) and set(tasks) == {t["id"] for t in TASKS}
    groups = [r.metadata["group_id"] for r in rollouts]
    assert len(set(groups)) == 12 and all(groups.count(g) == 2 for g in groups)  # a group per task and round
    before = len(store.query_rollouts())
    few = LightningRL(store, trainer, TASKS + TASKS, (), AlgorithmConfig(tasks_per_step=10, group_size=2))
    with pytest.raises(ConfigError, match=r"tasks_per_step=10, but train_tasks has 9 distinct task\(s\)"):
        few.step()  # built, it may still evaluate(); a step is refused before it enqueues anything
    algo.config.tasks_per_step = 10  # an edit while paused is checked before the next step enqueues anything
    with pytest.raises(ConfigError, match="tasks_per_step=10"):
        algo.step()
    assert len(store.query_rollouts()) == before

@pytest.mark.parametrize("weights, slice_by, match", [
    ({"ops=3": 2.0}, "ops", r"slice_weights: 'ops=3' is not a slice of the training tasks \(by=ops\); "
                            r"their slices are \['ops=1', 'ops=2'\]"),
    ({"ops=2": 2.0}, None, r"slice_weights .* needs LightningRL\(\.\.\., slice_by='ops'\)"),
    ({"ops=1": 0, "ops=2": 0}, "ops", "weighs every training task 0"),
    ({"ops=2": -1.0}, "ops", r"slice_weights\['ops=2'\] must be a finite number >= 0, got -1.0"),
    ({"ops=2": float("nan")}, "ops", r"slice_weights\['ops=2'\] must be a finite number >= 0"),
    ([("ops=2", 1.0)], "ops", "slice_weights must be a dict"),
])
def test_bad_slice_weights_name_the_field_and_enqueue_nothing(served, engine, weights, slice_by, match):
    store, _ = served
    trainer = GRPOTrainer(engine, GRPOConfig(track_reference_kl=False))
    with pytest.raises(ConfigError, match=match):
        LightningRL(store, trainer, TASKS, (), AlgorithmConfig(slice_weights=weights), slice_by=slice_by)
    algo = LightningRL(store, trainer, TASKS, (), AlgorithmConfig(), slice_by=slice_by)
    algo.config.slice_weights = weights  # an edit while paused is checked before the next step collects
    with pytest.raises(ConfigError, match=match):
        algo.step()
    assert store.query_rollouts() == []

# ----- on the real model -------------------------------------------------------------------------------
def _one_call_then_shaped(task, llm):
    """One short LLM call (so the step has triplets), then ``_shaped``."""
    OpenAI(base_url=llm.endpoint, api_key="x", max_retries=0).chat.completions.create(
        model=llm.model, messages=[{"role": "user", "content": "Say hi."}], **llm.sampling_parameters)
    return _shaped(task, llm)

@pytest.mark.slow
def test_step_row_has_one_column_per_component_and_the_trainer_adds_it(engine, pristine, proxied_store, tmp_path):
    from lightning_nb.cli.demo import _plot

    store = proxied_store
    runners = start_runners(_one_call_then_shaped, store, n=2)
    trainer = GRPOTrainer(engine, GRPOConfig(track_reference_kl=False))
    tasks = [t for t in TASKS if t["id"] in ("a0", "b0", "b1")]
    try:
        algo = LightningRL(store, trainer, tasks, (), AlgorithmConfig(
            tasks_per_step=3, group_size=2, max_tokens=4, dynamic_sampling=False, seed=6))  # draws all 3
        row = algo.step()
    finally:
        runners.stop()
    ids = [r.input["id"] for r in store.query_rollouts()]
    assert row["reward/tidy"] == pytest.approx(0.25 * sum(i.startswith("b") for i in ids) / len(ids))
    assert row["reward/bonus"] == pytest.approx(1.0 * ids.count("b0") / len(ids))
    assert row["reward_mean"] == pytest.approx(ids.count("a0") / len(ids))  # final rewards only
    assert row["intermediate_rewards"] == sum(i.startswith("b") for i in ids)  # the trainer saw them: one call each
    assert {"reward/tidy", "reward/bonus"} <= set(algo.metrics_df().columns)
    algo.add_metrics(algo.global_step, val_reward=0.5)  # as the demo does after its last step
    algo.metrics_df().to_csv(tmp_path / "metrics.csv", index=False)
    assert _plot(tmp_path / "metrics.csv", tmp_path / "curve.png", 0.5, 0.5)[-2:] == ["shaping bonus", "shaping tidy"]

@pytest.mark.slow
def test_calc_agent_emits_the_bonus_once_for_the_first_call_that_uses_every_number(engine, proxied_store):
    store = proxied_store
    runner = Runner(functools.partial(calc_agent, all_numbers_bonus=0.3), store, Tracer(store))
    store.add_resources({"main_llm": store.get_latest_resources().resources["main_llm"].model_copy(
        update={"sampling_parameters": {"temperature": 0.0, "max_tokens": 24}})})
    tasks = load_tasks("val", limit=8)
    shaped = 0
    for task in tasks:
        rollout = runner.step(task)
        spans = store.query_spans(rollout.rollout_id, "latest")
        tools = [s.attributes.get(semconv.TOOL_INPUT) for s in spans if s.name == "tool:calculator"]
        bonus = [s for s in spans if s.name == "intermediate_reward"]
        first = next((t for t in tools if uses_all_numbers(t, task["question"])), None)
        if first is None:
            assert bonus == [], (task["question"], tools)
            continue
        shaped += 1
        assert [(b.attributes[semconv.REWARD], b.attributes[semconv.REWARD_NAME], b.attributes["expression"])
                for b in bonus] == [(0.3, ALL_NUMBERS_COMPONENT, first)]
        final = [s.attributes[semconv.REWARD] for s in spans if s.name == "reward"]
        llm_text = [s for s in spans if s.name == "llm.chat.completions"][-1].attributes["gen_ai.completion"]
        assert final == [calc_reward(llm_text, task)]  # the shaping term is not in the final reward
    assert shaped >= 1  # greedy SmolLM2 writes CALC: a + b for most one-operation tasks
