"""The GRPO trainer's own math (lightning_nb.trainers.advantages and .grpo.losses) against verl's core_algos.

On random inputs (several seeds and shapes, masks with zero tokens and fully masked rows, groups of one
and of several, every mode GRPOConfig accepts) each pure function equals its verl counterpart: values
within 1e-6 in float32 and, for the losses, the gradients too. These comparisons skip only where verl
cannot be imported (it is an extra: ``pip install lightning-nb[verl]``; CI installs it). The worked
examples and the errors at the end need no verl.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from lightning_nb.errors import ConfigError
from lightning_nb.credit import group_relative_advantages
from lightning_nb.trainers.grpo.losses import (
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    aggregate_loss,
    kl_estimate,
    policy_loss,
    truncated_is_weights,
)

SEEDS = [0, 1, 2, 3]
SHAPES = [(1, 1), (3, 5), (8, 17), (16, 64)]  # (B, L)
TOL = {"atol": 1e-6, "rtol": 1e-6}


def _core_algos():
    """verl's core_algos, or a skip that says why (verl is an optional extra)."""
    try:
        from verl.trainer.ppo import core_algos
    except ImportError as exc:
        pytest.skip(f"verl cannot be imported ({type(exc).__name__}: {exc}); the comparison with verl's core_algos "
                    "needs the extra: pip install -e '.[verl]' (CI installs it)")
    return core_algos


def _mask(gen: torch.Generator, B: int, L: int) -> torch.Tensor:
    """A 0/1 float mask with random zeros, the first row always fully masked when B > 2, and at least one 1."""
    mask_B_L = (torch.rand(B, L, generator=gen) < 0.7).float()
    if B > 2:
        mask_B_L[0] = 0.0
    mask_B_L[-1, 0] = 1.0
    return mask_B_L


class _ActorView:
    """What verl's compute_policy_loss_vanilla reads of an ActorConfig (the view GRPOTrainer passed verl before it had its own losses)."""

    def __init__(self, clip_low, clip_high, clip_c, global_batch_info):
        self.clip_ratio = 0.2
        self.clip_ratio_low, self.clip_ratio_high, self.clip_ratio_c = clip_low, clip_high, clip_c
        self.global_batch_info = global_batch_info

    def get(self, key, default=None):
        return getattr(self, key, default)


# ----- advantages ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("norm_by_std", [True, False])
@pytest.mark.parametrize("E,n_groups", [(1, 1), (2, 1), (7, 3), (16, 4), (33, 20)])
def test_group_advantages_equal_verl(seed, norm_by_std, E, n_groups):
    core_algos = _core_algos()
    gen = torch.Generator().manual_seed(seed)
    L = 6
    rewards_E_L = torch.randn(E, L, generator=gen)
    rewards_E_L[: E // 3] = rewards_E_L[: E // 3].round()  # ties, and groups of equal scores below
    mask_E_L = _mask(gen, E, L)
    groups = [f"g{int(i)}" for i in torch.randint(0, n_groups, (E,), generator=gen)]
    if E >= 4:  # one group whose scores are all equal (std 0), and one singleton group
        groups[0] = groups[1] = "equal"
        rewards_E_L[1] = rewards_E_L[0]
        groups[2] = "alone"
    want_E_L, _ = core_algos.compute_grpo_outcome_advantage(
        token_level_rewards=rewards_E_L.clone(), response_mask=mask_E_L, index=np.array(groups, dtype=object),
        norm_adv_by_std_in_grpo=norm_by_std)
    adv_E = group_relative_advantages(rewards_E_L.sum(-1), groups, norm_by_std=norm_by_std)
    torch.testing.assert_close(adv_E[:, None] * mask_E_L, want_E_L, **TOL)
    if E >= 4:
        assert adv_E[0] == adv_E[1] == 0.0


def test_group_advantages_as_the_trainer_calls_verl():
    """GRPOTrainer's call: one reward per episode, token_level_rewards (E, 1), mask of ones, group ids as strings."""
    core_algos = _core_algos()
    gen = torch.Generator().manual_seed(7)
    rewards_E = torch.randint(0, 2, (12,), generator=gen).float() + 0.1 * torch.randn(12, generator=gen)
    groups = ["a"] * 4 + ["b"] * 4 + ["c"] * 3 + ["d"]
    for norm in (True, False):
        want_E, _ = core_algos.compute_grpo_outcome_advantage(
            token_level_rewards=rewards_E[:, None], response_mask=torch.ones(12, 1), index=groups,
            norm_adv_by_std_in_grpo=norm)
        torch.testing.assert_close(group_relative_advantages(rewards_E, groups, norm_by_std=norm), want_E[:, 0], **TOL)


def test_group_advantages_worked_examples():
    """The docstring's example, Dr. GRPO's, a singleton group and an all-equal group (no verl needed)."""
    r = torch.tensor([1.0, 0.0, 0.0, 0.0])
    torch.testing.assert_close(group_relative_advantages(r, ["g"] * 4), torch.tensor([1.5, -0.5, -0.5, -0.5]),
                               atol=1e-5, rtol=0)
    torch.testing.assert_close(group_relative_advantages(r, ["g"] * 4, norm_by_std=False),
                               torch.tensor([0.75, -0.25, -0.25, -0.25]), atol=1e-7, rtol=0)
    got = group_relative_advantages(torch.tensor([2.0, 3.0, 3.0]), ["one", "two", "two"])
    torch.testing.assert_close(got, torch.tensor([2.0 / (1 + 1e-6), 0.0, 0.0]), atol=1e-6, rtol=0)
    assert not got.requires_grad


def test_group_advantages_refuse_bad_shapes():
    with pytest.raises(ConfigError, match="shape"):
        group_relative_advantages(torch.zeros(2, 3), ["a", "b"])
    with pytest.raises(ValueError, match="3 scores"):
        group_relative_advantages(torch.zeros(3), ["a", "b"])


# ----- KL estimators ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
@pytest.mark.parametrize("B,L", SHAPES)
def test_kl_estimate_equals_verl(seed, estimator, B, L):
    core_algos = _core_algos()
    gen = torch.Generator().manual_seed(seed)
    ref_B_L = -torch.rand(B, L, generator=gen) * 5
    ref_B_L[0, 0] = -40.0  # beyond the clamp of low_var_kl
    base_B_L = -torch.rand(B, L, generator=gen) * 5
    logp_ours = base_B_L.clone().requires_grad_(True)
    logp_verl = base_B_L.clone().requires_grad_(True)
    ours = kl_estimate(logp_ours, ref_B_L, estimator)
    want = core_algos.kl_penalty(logp_verl, ref_B_L, estimator)
    torch.testing.assert_close(ours, want, **TOL)
    weights_B_L = torch.randn(B, L, generator=gen)
    (ours * weights_B_L).sum().backward()
    (want * weights_B_L).sum().backward()
    torch.testing.assert_close(logp_ours.grad, logp_verl.grad, **TOL)


def test_kl_estimate_values_and_errors():
    logp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-2.0, -1.0])
    torch.testing.assert_close(kl_estimate(logp, ref, "kl"), torch.tensor([1.0, -1.0]))
    torch.testing.assert_close(kl_estimate(logp, ref, "abs"), torch.tensor([1.0, 1.0]))
    torch.testing.assert_close(kl_estimate(logp, ref, "mse"), torch.tensor([0.5, 0.5]))
    e = torch.tensor(1.0).exp()
    torch.testing.assert_close(kl_estimate(logp, ref, "low_var_kl"), torch.stack([1 / e, e - 2]))
    with pytest.raises(ValueError, match="unknown KL estimator 'full'"):
        kl_estimate(logp, ref, "full")


# ----- loss aggregation ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("B,L", SHAPES)
@pytest.mark.parametrize("global_batch", [False, True])
def test_aggregate_loss_equals_verl(seed, mode, B, L, global_batch):
    core_algos = _core_algos()
    gen = torch.Generator().manual_seed(seed)
    loss_B_L = torch.randn(B, L, generator=gen)
    mask_B_L = _mask(gen, B, L)
    info = {"dp_size": 1, "batch_num_tokens": None, "global_batch_size": None, "loss_scale_factor": None}
    if global_batch:  # a micro-batch of a larger mini-batch (GRPOTrainer's case); Dr. GRPO's constant divisor
        info.update(batch_num_tokens=int(mask_B_L.sum()) + 11, global_batch_size=B + 3, loss_scale_factor=2 * L)
    want = core_algos.agg_loss(loss_mat=loss_B_L, loss_mask=mask_B_L, loss_agg_mode=mode, **info)
    got = aggregate_loss(loss_B_L, mask_B_L, mode, num_tokens=info["batch_num_tokens"],
                         num_sequences=info["global_batch_size"], norm_len=info["loss_scale_factor"])
    torch.testing.assert_close(got, want, **TOL)


def test_aggregate_loss_worked_example_and_errors():
    """Two sequences: [1, 2, (3 masked)] and [4, (5 masked), (6 masked)]."""
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    expect = {"token-mean": 7 / 3, "seq-mean-token-sum": (3 + 4) / 2, "seq-mean-token-mean": (1.5 + 4) / 2,
              "seq-mean-token-sum-norm": (3 + 4) / 2 / 3}
    for mode, value in expect.items():
        torch.testing.assert_close(aggregate_loss(loss, mask, mode), torch.tensor(value), atol=1e-6, rtol=0)
    torch.testing.assert_close(aggregate_loss(loss, mask, "token-mean", num_tokens=7), torch.tensor(1.0))
    loss[1, 2] = float("nan")  # masked out: never counts
    for mode, value in expect.items():
        torch.testing.assert_close(aggregate_loss(loss, mask, mode), torch.tensor(value), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="unknown loss aggregation 'token-sum'"):
        aggregate_loss(loss, mask, "token-sum")


# ----- PPO policy loss ----------------------------------------------------------------------------------------

CLIPS = [(0.2, 0.2, 3.0), (0.2, 0.28, 3.0), (0.1, 0.3, 2.0)]  # (ε_low, ε_high, c): PPO, DAPO, a tighter dual clip


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("B,L", SHAPES)
@pytest.mark.parametrize("clips", CLIPS)
@pytest.mark.parametrize("weighted", [False, True])
def test_policy_loss_equals_verl(seed, mode, B, L, clips, weighted):
    core_algos = _core_algos()
    gen = torch.Generator().manual_seed(seed)
    clip_low, clip_high, clip_c = clips
    old_B_L = -torch.rand(B, L, generator=gen) * 4
    # ratios from e^-2 to e^2 (all clip branches, dual clip included), and one far beyond the ±20 clamp
    base_B_L = old_B_L + (torch.rand(B, L, generator=gen) - 0.5) * 4
    base_B_L[-1, -1] = old_B_L[-1, -1] + 30.0
    adv_B_L = torch.randn(B, L, generator=gen) * 2
    mask_B_L = _mask(gen, B, L)
    weights_B_L = torch.rand(B, L, generator=gen) * 2 if weighted else None
    info = {"dp_size": 1, "batch_num_tokens": int(mask_B_L.sum()) + 5, "global_batch_size": B + 2,
            "loss_scale_factor": 3 * L}
    logp_verl = base_B_L.clone().requires_grad_(True)
    want, want_metrics = core_algos.compute_policy_loss_vanilla(
        old_log_prob=old_B_L, log_prob=logp_verl, advantages=adv_B_L, response_mask=mask_B_L, loss_agg_mode=mode,
        config=_ActorView(clip_low, clip_high, clip_c, info), rollout_is_weights=weights_B_L)
    logp_ours = base_B_L.clone().requires_grad_(True)
    got, metrics = policy_loss(old_B_L, logp_ours, adv_B_L, mask_B_L, clip_low=clip_low, clip_high=clip_high,
                               clip_c=clip_c, weights_B_L=weights_B_L, mode=mode, num_tokens=info["batch_num_tokens"],
                               num_sequences=info["global_batch_size"], norm_len=info["loss_scale_factor"])
    torch.testing.assert_close(got, want, **TOL)
    for key in ("ppo_kl", "pg_clipfrac", "pg_clipfrac_lower"):
        assert metrics[key] == pytest.approx(want_metrics[f"actor/{key}"], abs=1e-6), key
    want.backward()
    got.backward()
    torch.testing.assert_close(logp_ours.grad, logp_verl.grad, **TOL)


def test_policy_loss_default_denominators_equal_verl():
    """Without the mini-batch's denominators both fall back to the micro-batch's own counts."""
    core_algos = _core_algos()
    gen = torch.Generator().manual_seed(11)
    old_B_L = -torch.rand(4, 9, generator=gen)
    logp_B_L = old_B_L + 0.3 * torch.randn(4, 9, generator=gen)
    adv_B_L, mask_B_L = torch.randn(4, 9, generator=gen), _mask(gen, 4, 9)
    info = {"dp_size": 1, "batch_num_tokens": None, "global_batch_size": None, "loss_scale_factor": None}
    for mode in LOSS_AGG_MODES:
        want, _ = core_algos.compute_policy_loss_vanilla(old_B_L, logp_B_L, adv_B_L, mask_B_L, mode,
                                                         config=_ActorView(None, None, 3.0, info))
        got, _ = policy_loss(old_B_L, logp_B_L, adv_B_L, mask_B_L, mode=mode)
        torch.testing.assert_close(got, want, **TOL)


def test_policy_loss_worked_example():
    """One token per case, ε = 0.2, c = 3 (no verl needed): each branch of the clipped surrogate."""
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, -1.0]])
    ratio = torch.tensor([[1.1, 1.5, 0.5, 1.1, 5.0]])
    old = torch.zeros(1, 5)
    loss, metrics = policy_loss(old, ratio.log(), adv, torch.ones(1, 5), mode="seq-mean-token-sum")
    # A>0: −1.1 (inside), −1.2 (clipped at 1.2); A<0: 0.8 (clipped at 0.8), 1.1 (inside), 3 (dual clip, not 5)
    torch.testing.assert_close(loss, torch.tensor(-1.1 - 1.2 + 0.8 + 1.1 + 3.0), atol=1e-5, rtol=0)
    assert metrics["pg_clipfrac"] == pytest.approx(2 / 5)  # the clipped term is the larger at ratios 1.5 and 0.5
    assert metrics["pg_clipfrac_lower"] == pytest.approx(1 / 5)  # the dual clip bites at ratio 5 (A < 0)
    with pytest.raises(ValueError, match="must be > 1"):
        policy_loss(old, ratio.log(), adv, torch.ones(1, 5), clip_c=1.0)


# ----- truncated importance sampling --------------------------------------------------------------------------

@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("B,L", SHAPES)
@pytest.mark.parametrize("cap", [1.0, 2.0, 5.0])
def test_truncated_is_weights_equal_verl(seed, B, L, cap):
    _core_algos()
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_weights

    gen = torch.Generator().manual_seed(seed)
    log_ratio_B_L = torch.randn(B, L, generator=gen)
    log_ratio_B_L[-1, 0] = 25.0  # beyond the ±20 clamp
    mask_B_L = _mask(gen, B, L)
    want, _ = compute_rollout_correction_weights(log_ratio_B_L, mask_B_L, rollout_is="token", rollout_is_threshold=cap)
    got = truncated_is_weights(log_ratio_B_L, mask_B_L, cap)
    torch.testing.assert_close(got, want, **TOL)
    assert not got.requires_grad


def test_truncated_is_weights_values_and_errors():
    w = truncated_is_weights(torch.tensor([[0.0, -1.0, 2.0, 2.0]]), torch.tensor([[1.0, 1.0, 1.0, 0.0]]), 2.0)
    torch.testing.assert_close(w, torch.tensor([[1.0, float(np.exp(-1.0)), 2.0, 0.0]]))
    with pytest.raises(ValueError, match="must be > 0"):
        truncated_is_weights(torch.zeros(1, 1), torch.ones(1, 1), 0.0)


def test_modes_are_the_configs():
    """The modes these functions take are exactly the ones GRPOConfig validates."""
    from lightning_nb.trainers.grpo import GRPOConfig

    for mode, estimator in itertools.product(LOSS_AGG_MODES, KL_ESTIMATORS):
        GRPOConfig(loss_agg_mode=mode, kl_penalty=estimator, max_response_len=64)
    with pytest.raises(ValueError):
        GRPOConfig(loss_agg_mode="token-sum")
    with pytest.raises(ValueError):
        GRPOConfig(kl_penalty="k3+")
