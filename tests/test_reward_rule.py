"""One definition of a rollout's final reward, used by every number the user reads.

A reward span written before a crash must not count; ``evaluate()``, the step's
``reward_mean``, ``rollouts_df``, the store's HTML summary and the widgets agree;
``groups_with_signal`` counts only groups the trainer can learn from; a rollout that
made no LLM call is counted, not lost.
"""

from __future__ import annotations

import itertools
import threading

import pytest
from openai import OpenAI

from lightning_nb import (AlgorithmConfig, GRPOConfig, GRPOTrainer, LightningRL, TripletAdapter, emit_reward,
                          start_runners)
from lightning_nb.store.rules import final_reward


def test_the_rule():
    assert final_reward("succeeded", [0.2, 0.7]) == 0.7  # the last reward span of the latest attempt
    assert final_reward("succeeded", []) is None
    assert final_reward("failed", [1.0]) == 0.0  # a reward written before the crash does not count
    assert final_reward("cancelled", [1.0]) is None
    assert final_reward("running", [1.0]) is None


def _crash_after_reward(task, llm):
    emit_reward(1.0)
    if task["crash"]:
        raise RuntimeError("the agent crashed after emitting its reward")


def test_a_crash_after_the_reward_counts_zero_everywhere(engine, proxied_store):
    store = proxied_store
    runners = start_runners(_crash_after_reward, store, n=2)
    trainer = GRPOTrainer(engine, GRPOConfig(track_reference_kl=False))
    try:
        algo = LightningRL(store, trainer, [{"id": "t", "crash": False}])
        # evaluate(): one success (1.0) and one crash after emit_reward(1.0) -> 0.5, not 1.0
        assert algo.evaluate([{"id": "ok", "crash": False}, {"id": "bad", "crash": True}], progress=False) == 0.5
    finally:
        runners.stop()
    df = store.rollouts_df().set_index("input")
    ok = df[df.index.str.contains('"ok"')].iloc[0]
    bad = df[df.index.str.contains('"bad"')].iloc[0]
    assert (ok.status, ok.reward) == ("succeeded", 1.0) and (bad.status, bad.reward) == ("failed", 0.0)
    assert store.final_rewards() == {ok.rollout_id: 1.0, bad.rollout_id: 0.0}
    assert "val 0.500 (n=2)" in store._repr_html_()
    from widgets.reward import rollout_point

    points = sorted(rollout_point(store, r)[2] for r in store.query_rollouts())
    assert points == [0.0, 1.0]


def _llm_agent(plan):
    """An agent that makes one short LLM call, then does what ``plan(task, index_in_group)`` says."""
    counters: dict[str, itertools.count] = {}
    lock = threading.Lock()

    def agent(task, llm):
        with lock:
            i = next(counters.setdefault(task["id"], itertools.count()))
        action = plan(task, i)
        if action == "no_llm":
            return 0.0
        OpenAI(base_url=llm.endpoint, api_key="x", max_retries=0).chat.completions.create(
            model=llm.model, messages=[{"role": "user", "content": "Say hi."}], max_tokens=3, temperature=1.0)
        if action == "crash":
            raise RuntimeError("tool failed")
        return float(action)

    return agent


def test_groups_with_signal_counts_only_groups_the_trainer_can_learn_from(engine, proxied_store):
    store = proxied_store
    # group of 2: the first rollout earns 1.0, the second crashes -> one episode left, dropped by the trainer
    agent = _llm_agent(lambda task, i: 1.0 if i % 2 == 0 else "crash")
    runners = start_runners(agent, store, n=1)
    trainer = GRPOTrainer(engine, GRPOConfig(track_reference_kl=False))
    try:
        algo = LightningRL(store, trainer, [{"id": "t"}], config=AlgorithmConfig(
            tasks_per_step=1, group_size=2, max_sample_rounds=1, max_tokens=3))
        triplets, ids = algo.collect()
    finally:
        runners.stop()
    assert len(ids) == 2 and len({t.rollout_id for t in triplets}) == 1
    assert algo.last_groups_with_signal == 0  # {1.0, crash} is not a signal the trainer can use
    assert algo.signal_groups(triplets) == set()


def test_a_rollout_without_llm_calls_is_counted_in_the_step(engine, pristine, proxied_store, capsys):
    store = proxied_store
    # per group of 3: 1.0 and 0.0 with an LLM call, then one rollout that returns 0.0 without calling the LLM
    agent = _llm_agent(lambda task, i: [1.0, 0.0, "no_llm"][i % 3])
    runners = start_runners(agent, store, n=1)
    trainer = GRPOTrainer(engine, GRPOConfig(track_reference_kl=False))
    try:
        algo = LightningRL(store, trainer, [{"id": "t"}], config=AlgorithmConfig(
            tasks_per_step=1, group_size=3, max_sample_rounds=1, max_tokens=3))
        row = algo.step(progress=True)  # a script asks for the bars a notebook cell shows by default (issue 53)
    finally:
        runners.stop()
    assert row["skipped_no_llm_calls"] == 1 and row["rollouts"] == 3 and row["episodes"] == 2
    # a step with its bars shows its phases (issue 43): the rollouts, then the update's micro-batches
    shown = capsys.readouterr().err
    assert "step 1: rollouts" in shown and "3/3 rollouts" in shown and "step 1: update" in shown
    assert row["reward_mean"] == pytest.approx(1 / 3)  # every rollout of the step counts in the train reward
    assert row["batch_reward_mean"] == pytest.approx(0.5)  # the episodes the trainer saw
    adapter = TripletAdapter()
    adapter.adapt(store, [r.rollout_id for r in store.query_rollouts()])
    assert adapter.last_skipped["no_llm_calls"] == 1
