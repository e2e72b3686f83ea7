"""A fourth algorithm with its own credit, written here without touching lightning_nb/trainers/ or types.py:
RLOO's leave-one-out baseline (Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for
Learning from Human Feedback in LLMs", eq. 3).

For the k samples of one task with rewards r_1..r_k: ``A_i = r_i − (1 / (k − 1)) Σ_{j≠i} r_j``. Rewards [1, 0, 0, 1]
give [2/3, −2/3, −2/3, 2/3] (GRPO's would be ±0.866: (r − 0.5) / std with the unbiased std 0.577).

The algorithm subclasses LightningRL and overrides only ``assign_credit``; it runs one real step (rollouts through
the LLM proxy on SmolLM2-135M, one GRPOTrainer update) and the test reads the advantages the trainer trained on.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from lightning_nb import AlgorithmConfig, GRPOConfig, GRPOTrainer, LightningRL, start_runners
from lightning_nb.credit import Credit, with_advantages

pytestmark = pytest.mark.slow


def rloo_advantages(rewards: dict[str, float], groups: dict[str, str]) -> dict[str, float]:
    """Episode -> RLOO advantage; a group of one has no other sample to compare with and is left out."""
    members: dict[str, list[str]] = {}
    for e, g in groups.items():
        members.setdefault(g, []).append(e)
    out = {}
    for episodes in members.values():
        k = len(episodes)
        if k < 2:
            continue
        total = sum(rewards[e] for e in episodes)
        for e in episodes:
            out[e] = rewards[e] - (total - rewards[e]) / (k - 1)
    return out


class RLOO(LightningRL):
    """LightningRL's loop with RLOO's leave-one-out baseline as its credit."""

    def assign_credit(self, triplets):
        rewards = {t.rollout_id: t.reward for t in triplets}
        groups = {t.rollout_id: t.group_id for t in triplets}
        advantages = rloo_advantages(rewards, groups)
        return Credit(with_advantages(triplets, advantages), [t for t in triplets if t.rollout_id not in advantages])


def test_rloo_by_hand():
    got = rloo_advantages({"a": 1.0, "b": 0.0, "c": 0.0, "d": 1.0, "x": 1.0}, {"a": "g", "b": "g", "c": "g", "d": "g",
                                                                            "x": "alone"})
    assert got == pytest.approx({"a": 2 / 3, "b": -2 / 3, "c": -2 / 3, "d": 2 / 3}, abs=1e-12)


def test_an_rloo_algorithm_brings_its_own_credit_and_the_trainer_trains_on_it(engine, pristine, proxied_store,
                                                                             agent_with_reward):
    store = proxied_store
    runners = start_runners(agent_with_reward([1.0, 0.0, 0.0, 1.0]), store, n=1)  # one runner: rewards in this order
    trainer = GRPOTrainer(engine, GRPOConfig(track_reference_kl=False))
    try:
        algo = RLOO(store, trainer, [{"id": "t"}], config=AlgorithmConfig(
            tasks_per_step=1, group_size=4, max_sample_rounds=1, max_tokens=3))
        weights = engine.weight_version
        row = algo.step()
    finally:
        runners.stop()
    update = algo.last_update
    rewards = store.final_rewards(list(update.advantages))
    assert sorted(rewards.values()) == [0.0, 0.0, 1.0, 1.0], rewards
    # the advantages the trainer trained with are RLOO's, not GRPO's ±0.866
    for rid, reward in rewards.items():
        assert update.advantages[rid] == pytest.approx(2 / 3 if reward == 1.0 else -2 / 3, abs=1e-12)
    for row_ in update.batch:  # every trained response token of the packed sequences carries its episode's
        trained = [a for a, m in zip(row_["advantages"], row_["response_mask"]) if m]
        assert trained and set(trained) == {update.advantages[row_["rollout_id"]]}
    assert row["groups_with_signal"] == 1 and row["episodes"] == 4 and row["sequences_trained"] == 4
    assert engine.weight_version == weights + 1  # a real update changed the served weights
    assert algo.signal_groups(update.triplets) == {update.triplets[0].group_id}  # dynamic sampling asks the same


def test_rloo_lives_in_this_file_only():
    """The algorithm's credit is defined here, and this file imports nothing from lightning_nb.trainers or
    lightning_nb.types: a fourth algorithm edits neither."""
    assert RLOO.assign_credit.__module__ == __name__
    imported = [node.module for node in ast.walk(ast.parse(Path(__file__).read_text()))
                if isinstance(node, ast.ImportFrom) and node.module]
    assert "lightning_nb.credit" in imported
    assert not [m for m in imported if m.startswith(("lightning_nb.trainers", "lightning_nb.types"))], imported
