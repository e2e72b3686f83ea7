"""The GRPO step itself, on the real SmolLM2-135M: advantages, the direction of learning, what the step counts.

Every test that updates the session engine's weights restores them afterwards (``restore`` fixture).
"""

from __future__ import annotations

import math

import pytest
import torch

from lightning_nb import AlgorithmConfig, GRPOConfig, GRPOTrainer, InMemoryStore, LightningRL
from lightning_nb.errors import ConfigError
from lightning_nb.credit import group_advantages
from lightning_nb.trainers.grpo.trainer import response_logprobs
from lightning_nb.types import Triplet

pytestmark = pytest.mark.slow


def _weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _prompt(engine, question="What is 17 + 25? Answer with a number."):
    return engine.apply_chat_template([{"role": "user", "content": question}])


def _triplet(gen, rollout_id, group, reward, **kw) -> Triplet:
    return Triplet(rollout_id=rollout_id, attempt_id=f"at-{rollout_id}", group_id=group, turn=0,
                   prompt_ids=gen.prompt_ids, response_ids=gen.completion_ids, logprobs=gen.logprobs,
                   reward=reward, temperature=gen.temperature, **kw)


def _seq_logprob(model, gen) -> float:
    """Sum of log-probs of ``gen``'s completion under ``model`` (at its sampling temperature)."""
    ids = gen.prompt_ids + gen.completion_ids
    ids_B_T = torch.tensor([ids])
    mask_B_L = torch.tensor([[0.0] * (len(gen.prompt_ids) - 1) + [1.0] * len(gen.completion_ids)])
    with torch.no_grad():
        logp = response_logprobs(model, ids_B_T, torch.ones_like(ids_B_T), mask_B_L, torch.tensor([gen.temperature]))
    return float(logp.sum()), logp[0, len(gen.prompt_ids) - 1:]


# ----- advantages ---------------------------------------------------------------------
def test_group_advantages_match_the_grpo_formula_and_drop_small_groups():
    rewards = {"a": 1.0, "b": 0.0, "c": 0.0, "d": 0.0, "lone": 1.0}
    groups = {"a": "g", "b": "g", "c": "g", "d": "g", "lone": "single"}
    adv, dropped = group_advantages(rewards, groups)
    # mean 0.25, unbiased std 0.5 -> (r - 0.25) / 0.5
    assert adv.keys() == {"a", "b", "c", "d"}
    assert [round(adv[k], 5) for k in "abcd"] == [1.5, -0.5, -0.5, -0.5]
    assert dropped == {"single": 1}
    adv, dropped = group_advantages(rewards, groups, min_group_size=5)
    assert adv == {} and dropped == {"g": 4, "single": 1}
    adv, _ = group_advantages(rewards, groups, norm_by_std=False)  # Dr. GRPO: no std division
    assert [round(adv[k], 6) for k in "abcd"] == [0.75, -0.25, -0.25, -0.25]
    with pytest.raises(ConfigError, match="min_group_size"):
        group_advantages(rewards, groups, min_group_size=1)
    with pytest.raises(ConfigError, match="min_group_size"):
        GRPOConfig(min_group_size=1)


def test_a_lone_survivor_of_a_group_is_dropped_not_trained_on_its_raw_reward(engine, pristine, distinct_generations):
    prompt = _prompt(engine)
    (g,) = distinct_generations(engine, prompt, 1)
    trainer = GRPOTrainer(engine, GRPOConfig(track_reference_kl=False))
    before, version = _weights(engine.model), engine.weight_version
    m = trainer.update([_triplet(g, "r1", "grp", 1.0)])
    assert m["groups_dropped"] == 1 and m["episodes_dropped"] == 1 and m["episodes"] == 0
    assert m["sequences_trained"] == 0 and math.isnan(m["loss"])
    assert all(torch.equal(before[k], v) for k, v in _weights(engine.model).items())
    assert engine.weight_version == version and trainer.updates_applied == 1


# ----- direction of learning ----------------------------------------------------------
def test_one_update_raises_the_logprob_of_positive_advantage_and_lowers_negative(
        engine, pristine, distinct_generations):
    prompt = _prompt(engine)
    good, bad = distinct_generations(engine, prompt, 2)
    trainer = GRPOTrainer(engine, GRPOConfig(track_reference_kl=False))
    good_before, good_tok = _seq_logprob(engine.model, good)
    bad_before, bad_tok = _seq_logprob(engine.model, bad)
    # the trainer's recomputation agrees with the engine's sampling log-probs token by token
    assert float((good_tok - torch.tensor(good.logprobs)).abs().max()) < 1e-4
    assert float((bad_tok - torch.tensor(bad.logprobs)).abs().max()) < 1e-4
    m = trainer.update([_triplet(good, "good", "g", 1.0), _triplet(bad, "bad", "g", 0.0)])
    assert trainer.last_advantages["good"] > 0 > trainer.last_advantages["bad"]
    assert m["logprob_diff_max"] < 1e-4 and m["sequences_trained"] == 2
    good_after, _ = _seq_logprob(engine.model, good)
    bad_after, _ = _seq_logprob(engine.model, bad)
    assert good_after > good_before + 1e-3, (good_before, good_after)
    assert bad_after < bad_before - 1e-3, (bad_before, bad_after)


def test_logprobs_go_through_the_models_own_forward(engine, distinct_generations):
    """A model that soft-caps its logits in forward() (as Gemma 2 does) is scored with the capped logits."""

    class SoftCapped(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner
            self.model, self.lm_head = inner.model, inner.lm_head  # what a head-bypassing scorer would use

        def forward(self, **kwargs):
            out = self.inner(**kwargs)
            out.logits = 5.0 * torch.tanh(out.logits / 5.0)
            return out

    prompt = _prompt(engine)
    (g,) = distinct_generations(engine, prompt, 1)
    ids_B_T = torch.tensor([g.prompt_ids + g.completion_ids])
    P = len(g.prompt_ids)
    mask_B_L = torch.tensor([[0.0] * (P - 1) + [1.0] * len(g.completion_ids)])
    with torch.no_grad():
        got = response_logprobs(SoftCapped(engine.model), ids_B_T, torch.ones_like(ids_B_T), mask_B_L,
                                torch.tensor([1.0]))[0, P - 1:]
        logits = 5.0 * torch.tanh(engine.model(input_ids=ids_B_T).logits[0, P - 1:-1] / 5.0)
        want = torch.log_softmax(logits, -1).gather(-1, ids_B_T[0, P:, None]).squeeze(-1)
        plain = torch.log_softmax(engine.model(input_ids=ids_B_T).logits[0, P - 1:-1], -1).gather(
            -1, ids_B_T[0, P:, None]).squeeze(-1)
    assert float((got - want).abs().max()) < 1e-5
    assert float((got - plain).abs().max()) > 1e-2  # the cap matters here, so the check has teeth


# ----- what a step counts ---------------------------------------------------------------
def test_skip_zero_advantage_does_not_change_the_step(engine, pristine, distinct_generations):
    prompt = _prompt(engine)
    a, b, c, d = distinct_generations(engine, prompt, 4)
    batch = [_triplet(a, "a", "signal", 1.0), _triplet(b, "b", "signal", 0.0),
             _triplet(c, "c", "flat", 1.0), _triplet(d, "d", "flat", 1.0)]
    start = _weights(engine.model)
    results = {}
    for skip in (True, False):
        with torch.no_grad():
            engine.model.load_state_dict(start)
        trainer = GRPOTrainer(engine, GRPOConfig(track_reference_kl=False, skip_zero_advantage=skip,
                                                 micro_batch_size=8))
        results[skip] = trainer.update(batch)
    assert results[True]["sequences_trained"] == 2 and results[False]["sequences_trained"] == 4
    for key in ("loss", "grad_norm"):
        assert results[True][key] == pytest.approx(results[False][key], rel=1e-4), key
    assert results[True]["groups_with_signal"] == 1 and results[True]["groups"] == 2


def test_top_p_below_one_is_refused_for_training(engine, distinct_generations):
    prompt = _prompt(engine)
    (g,) = distinct_generations(engine, prompt, 1)
    trainer = GRPOTrainer(engine, GRPOConfig(track_reference_kl=False))
    with pytest.raises(ConfigError, match="top_p"):
        trainer.update([_triplet(g, "x", "g", 1.0, top_p=0.9), _triplet(g, "y", "g", 0.0)])
    assert trainer.updates_applied == 0


# ----- config edits ---------------------------------------------------------------------
def test_config_edits_take_effect_at_the_next_update_and_are_recorded(engine, pristine, distinct_generations):
    prompt = _prompt(engine)
    a, b = distinct_generations(engine, prompt, 2)
    batch = [_triplet(a, "a", "g", 1.0), _triplet(b, "b", "g", 0.0)]
    trainer = GRPOTrainer(engine, GRPOConfig(track_reference_kl=False))
    algo = LightningRL(InMemoryStore(), trainer, [{"id": "t"}], config=AlgorithmConfig(tasks_per_step=1, group_size=2))
    assert trainer.update(batch)["lr"] == 2e-5
    trainer.config.learning_rate = 1e-5
    m = trainer.update(batch)
    assert m["lr"] == 1e-5 and trainer.optimizer.param_groups[0]["lr"] == 1e-5
    assert "learning_rate 2e-05 → 1e-05" in m["config_changes"]
    assert trainer.last_config_changes == [{"field": "learning_rate", "old": 2e-5, "new": 1e-5}] and trainer.updates_applied == 2
    # an edit the trainer cannot honour is refused on resume() and on update(), never ignored
    trainer.config.kl_coef = 0.1
    with pytest.raises(ConfigError, match="kl_coef.*reference"):
        algo.resume()
    with pytest.raises(ConfigError, match="kl_coef.*reference"):
        trainer.update(batch)
    trainer.config.kl_coef = 0.0
    trainer.config.learning_rate = -1.0
    with pytest.raises(ConfigError, match="learning_rate"):
        algo.resume()
    assert trainer.updates_applied == 2


def test_samples_older_than_max_staleness_are_dropped_and_counted(engine, pristine, distinct_generations):
    prompt = _prompt(engine)
    a, b, c, d = distinct_generations(engine, prompt, 4)
    v = engine.weight_version
    trainer = GRPOTrainer(engine, GRPOConfig(track_reference_kl=False, max_staleness=1))
    engine.load_weights(engine.model)  # two versions later: a and b were sampled at v, now v + 2
    engine.load_weights(engine.model)
    batch = [_triplet(a, "a", "old", 1.0, weight_version=v), _triplet(b, "b", "old", 0.0, weight_version=v),
             _triplet(c, "c", "new", 1.0, weight_version=v + 1), _triplet(d, "d", "new", 0.0, weight_version=v + 2)]
    m = trainer.update(batch)
    assert m["stale_episodes_dropped"] == 2 and m["staleness_max"] == 2
    assert set(trainer.last_advantages) == {"c", "d"} and m["sequences_trained"] == 2
    assert engine.weight_version == v + 3  # the update itself served new weights
    with pytest.raises(ConfigError, match="max_staleness"):
        GRPOConfig(max_staleness=-1)
