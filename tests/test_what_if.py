"""What-if rewards on stored episodes and ``LightningRL.set_reward`` (issue 50, items 1-2).

Real runners, a real proxy on the session's SmolLM2-135M engine (one short call per episode, so every episode has
token IDs and the adapter builds its triplets), and an agent whose final reward and shaping term are fixed per task,
so the groups that gain or lose signal are known by hand.
"""

from __future__ import annotations

import math

import pytest
from openai import OpenAI

from lightning_nb import AlgorithmConfig, GRPOConfig, GRPOTrainer, LightningRL, emit_intermediate_reward, start_runners
from lightning_nb.errors import ConfigError
from lightning_nb.replay import what_if, what_if_groups, what_if_slices
from widgets import what_if_figure
from lightning_nb.trainers.config import TrainerConfig

# group -> per episode (final reward, shaping term): what the agent emits for task {"g": group, "i": i}
PLAN = {
    "keeps": [(1.0, 0.2), (1.0, 0.0), (0.0, 0.2), (0.0, 0.0)],   # signal under both
    "loses": [(0.0, 0.2), (0.0, 0.0), (0.0, 0.0), (0.0, 0.0)],   # only the shaping term differs
    "none": [(1.0, 0.0)] * 4,                                      # no signal under either
    "gains": [(1.0, 0.0), (1.0, 0.0), (0.0, 1.0), (0.0, 1.0)],    # the shaping term evens the totals out
}
TASKS = [{"id": f"{g}{i}", "g": g, "i": i, "ops": 1 if g in ("keeps", "none") else 2}
         for g in PLAN for i in range(4)]


def planned_agent(task, llm):
    OpenAI(base_url=llm.endpoint, api_key="x", max_retries=0).chat.completions.create(
        model=llm.model, messages=[{"role": "user", "content": f"Say {task['id']}."}], max_tokens=3, temperature=1.0)
    final, shaping = PLAN[task["g"]][task["i"]]
    if shaping:
        emit_intermediate_reward(shaping, name="shaping")
    return final


def final_only(task, episode):
    """The new reward: the recorded final reward without the shaping term (what the agent returned)."""
    return PLAN[task["g"]][task["i"]][0]


def _grpo(scores):
    """GRPO's advantage by hand: (r - mean) / (unbiased std + 1e-6); 0 for a group of equal scores."""
    n = len(scores)
    mean = sum(scores) / n
    std = math.sqrt(sum((s - mean) ** 2 for s in scores) / (n - 1))
    return [(s - mean) / (std + 1e-6) for s in scores]


@pytest.fixture
def stored(proxied_store):
    """The 16 planned episodes, four groups of four, finished in the store."""
    store = proxied_store
    group = start_runners(planned_agent, store, n=4)
    try:
        ids = [store.enqueue_rollout(t, metadata={"group_id": t["g"]}).rollout_id for t in TASKS]
        store.wait_for_rollouts(ids, timeout=120)
    finally:
        group.stop()
    assert all(r.status == "succeeded" for r in store.query_rollouts())
    return store, ids


def test_a_reward_without_the_shaping_term_changes_exactly_the_groups_computed_by_hand(stored):
    store, ids = stored
    spans_before = len(store.query_spans())
    df = what_if(final_only, store=store, by="ops")
    assert len(store.query_spans()) == spans_before  # nothing stored changes
    assert list(df["rollout_id"]) == ids and df["trained"].all()
    groups = what_if_groups(df).set_index("group_id")
    assert groups["change"].to_dict() == {"keeps": "keeps signal", "loses": "loses signal", "none": "no signal",
                                          "gains": "gains signal"}
    for g, plan in PLAN.items():
        rows = df[df["group_id"] == g].sort_values("rollout_id", key=lambda s: s.map(ids.index))
        old_by_hand = _grpo([f + s for f, s in plan]) if len({f + s for f, s in plan}) > 1 else [0.0] * 4
        new_by_hand = _grpo([f for f, _ in plan]) if len({f for f, _ in plan}) > 1 else [0.0] * 4
        assert list(rows["old_reward"]) == [f for f, _ in plan]
        assert list(rows["old_shaping"]) == pytest.approx([s for _, s in plan])
        assert list(rows["old_advantage"]) == pytest.approx(old_by_hand, abs=1e-5)
        assert list(rows["new_advantage"]) == pytest.approx(new_by_hand, abs=1e-5)
    # the one group whose totals were [1.2, 1, 0.2, 0]: the new advantages are +-0.866, not the old ones
    keeps = df[df["group_id"] == "keeps"]
    assert keeps["new_advantage"].round(3).tolist() == [0.866, 0.866, -0.866, -0.866]
    assert keeps["old_advantage"].round(3).tolist() != keeps["new_advantage"].round(3).tolist()
    slices = what_if_slices(df).set_index("slice")
    assert slices.loc["ops=2", "groups_loses"] == 1 and slices.loc["ops=2", "groups_gains"] == 1
    assert slices.loc["ops=1", "groups_loses"] == 0 and slices.loc["ops=1", "episodes"] == 8
    fig = what_if_figure(df)
    assert {t.name.split(" (")[0] for t in fig.data if t.name} == {"keeps signal", "loses signal", "no signal",
                                                                    "gains signal"}


def test_dict_rewards_are_summed_and_shown_per_component_and_bad_values_name_the_rollout(stored):
    store, ids = stored
    df = what_if(lambda task, ep: {"final": ep.reward, "bonus": 0.5 if task["i"] == 0 else 0.0}, ids[:4], store=store,
                 config=TrainerConfig(norm_adv_by_std=False))
    assert list(df["new_reward"]) == [1.5, 1.0, 0.0, 0.0] and list(df["new:bonus"]) == [0.5, 0.0, 0.0, 0.0]
    assert list(df["new_advantage"]) == pytest.approx([1.5 - 0.625, 1.0 - 0.625, -0.625, -0.625])  # Dr. GRPO
    with pytest.raises(ConfigError, match=f"rollout {ids[0]!r}.*finite"):
        what_if(lambda task, ep: math.nan, ids[:1], store=store)
    with pytest.raises(ConfigError, match="return a float, or a dict"):
        what_if(lambda task, ep: "1.0", ids[:1], store=store)
    with pytest.raises(ConfigError, match="needs the store"):
        what_if(final_only, ids[:1])


@pytest.mark.slow
def test_set_reward_trains_on_the_new_reward_from_the_next_step_and_logs_it(proxied_store, pristine):
    store = proxied_store
    group = start_runners(planned_agent, store, n=4)
    try:
        algo = LightningRL(store, GRPOTrainer(pristine, GRPOConfig(learning_rate=1e-6)), TASKS, [],
                           AlgorithmConfig(tasks_per_step=4, group_size=4, dynamic_sampling=False, seed=0))
        first = algo.step(progress=False)
        assert "reward" not in (first.get("config_changes") or "") and "reward_recorded_mean" not in first
        with pytest.raises(ConfigError, match="pass a function"):
            algo.set_reward(1.0)
        algo.set_reward(final_only)
        rewards_before = store.rewards_df()
        second = algo.step(progress=False)
    finally:
        group.stop()
    name = f"{final_only.__module__}.final_only"
    assert f"reward the agent → {name}" in second["config_changes"]
    assert [c["field"] for c in algo.config_changes if c["config"] == "algorithm"] == ["reward"]
    # the update's episodes carry the new reward: no shaping term, the final reward alone
    batch = algo.trainer.last_triplets
    assert batch and all(t.step_reward == 0.0 for t in batch)
    assert all(t.reward == PLAN[_group(store, t.rollout_id)][_index(store, t.rollout_id)][0] for t in batch)
    assert second["reward_mean"] == pytest.approx(sum(t.reward for t in {t.rollout_id: t for t in batch}.values())
                                                  / len({t.rollout_id for t in batch}))
    assert "reward_recorded_mean" in second
    after = store.rewards_df()
    assert after.iloc[: len(rewards_before)].equals(rewards_before)  # the recorded rewards stay as they were
    assert (after["component"] == "shaping").sum() > (rewards_before["component"] == "shaping").sum()  # still emitted
    state = algo.state_dict()
    assert state["reward_fn"] == name
    algo.set_reward(None)
    with pytest.warns(UserWarning, match="final_only"):
        algo.load_state_dict(state)


def _group(store, rid):
    return store.get_rollout_by_id(rid).input["g"]


def _index(store, rid):
    return store.get_rollout_by_id(rid).input["i"]
