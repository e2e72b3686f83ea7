"""The GRPO trainer's loss: PPO's clipped surrogate, its aggregations, KL estimators, truncated IS weights.

Small pure functions of torch tensors, each with its formula and paper, that
:class:`~lightning_nb.trainers.grpo.trainer.GRPOTrainer` composes into one micro-batch's loss
(the advantages going in are :mod:`lightning_nb.trainers.advantages`'). They are verl's
``core_algos.compute_policy_loss_vanilla``, ``agg_loss`` and ``kl_penalty`` and
``rollout_corr_helper.compute_rollout_correction_weights`` for the options
:class:`~lightning_nb.trainers.grpo.config.GRPOConfig` accepts, written out so the plain trainer
needs no verl; ``tests/test_advantages.py`` checks each equal to verl's on random inputs wherever
verl is installed.

Shapes: ``B`` sequences of a micro-batch, ``L`` scored positions (response tokens, padded); a mask
``mask_B_L`` is 1.0 on the tokens that train and 0.0 elsewhere. Log-probabilities are in nats.
torch is imported inside the functions, so importing this module stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from lightning_nb.errors import ConfigError

if TYPE_CHECKING:
    import torch

__all__ = ["KL_ESTIMATORS", "LOSS_AGG_MODES", "aggregate_loss", "kl_estimate", "masked_mean", "policy_loss",
           "truncated_is_weights"]

#: ``GRPOConfig.loss_agg_mode`` values, see :func:`aggregate_loss`.
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
#: ``GRPOConfig.kl_penalty`` values (two names each), see :func:`kl_estimate`.
KL_ESTIMATORS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
_LOG_RATIO_BOUND = 20.0  # |log ratio| is clamped to this before exp (as verl does), so exp never overflows


def _masked_sum(values: "torch.Tensor", mask: "torch.Tensor", dim: Optional[int] = None) -> "torch.Tensor":
    """``Σ values · mask`` over ``dim`` (all of it when None); values where the mask is 0 never count, not even NaN."""
    import torch

    kept = torch.where(mask.bool(), values, 0.0) * mask
    return kept.sum() if dim is None else kept.sum(dim)


def masked_mean(values_B_L: "torch.Tensor", mask_B_L: "torch.Tensor") -> "torch.Tensor":
    """``Σ values · mask / (Σ mask + 1e-8)``: the mean over the masked-in tokens, 0 for an empty mask (0-d tensor)."""
    return _masked_sum(values_B_L, mask_B_L) / (mask_B_L.sum() + 1e-8)


def kl_estimate(logp_B_L: "torch.Tensor", ref_logp_B_L: "torch.Tensor", estimator: str = "low_var_kl",
                ) -> "torch.Tensor":
    """Per-token estimate of KL(π_θ ‖ π_ref) from the log-probs of the sampled tokens (Schulman 2020).

    With ``d = log π_θ(t) − log π_ref(t)`` (nats) of the token ``t`` sampled from π_θ
    (J. Schulman, "Approximating KL divergence", 2020, http://joschu.net/blog/kl-approx.html)::

        "kl",  "k1"          d                          unbiased, high variance, can be < 0
        "abs"                |d|
        "mse", "k2"          d² / 2                     biased, low variance
        "low_var_kl", "k3"   e^(−d) − (−d) − 1          unbiased, low variance, >= 0; −d clamped to
                                                        [−20, 20] and the result to [−10, 10] (as verl)

    Same values (and gradients) as verl's ``core_algos.kl_penalty`` for these names.

    Args:
        logp_B_L: log-probs under the trained policy, shape ``(B, L)`` (any shape, with ``ref_logp_B_L``'s).
        ref_logp_B_L: log-probs of the same tokens under the reference policy.
        estimator: one of :data:`KL_ESTIMATORS`.

    Returns:
        ``kl_B_L``, nats per token, the shape of the inputs (not masked: multiply by the mask yourself,
        or aggregate with :func:`aggregate_loss`).

    Raises:
        ConfigError: an unknown ``estimator``.
    """
    import torch

    d_B_L = logp_B_L - ref_logp_B_L
    if estimator in ("kl", "k1"):
        return d_B_L
    if estimator == "abs":
        return d_B_L.abs()
    if estimator in ("mse", "k2"):
        return 0.5 * d_B_L.square()
    if estimator in ("low_var_kl", "k3"):
        neg_B_L = torch.clamp(ref_logp_B_L - logp_B_L, min=-_LOG_RATIO_BOUND, max=_LOG_RATIO_BOUND)
        return torch.clamp(torch.exp(neg_B_L) - neg_B_L - 1, min=-10, max=10)
    raise ConfigError(f"unknown KL estimator {estimator!r}; use one of {', '.join(KL_ESTIMATORS)}")


def aggregate_loss(loss_B_L: "torch.Tensor", mask_B_L: "torch.Tensor", mode: str = "token-mean", *,
                   num_tokens: Optional[float] = None, num_sequences: Optional[float] = None,
                   norm_len: Optional[float] = None) -> "torch.Tensor":
    """One scalar loss from per-token losses ``ℓ_it`` of the masked-in tokens t of sequences i.

    ``N`` = ``num_tokens`` and ``G`` = ``num_sequences`` are the denominators: the tokens and the
    sequences (with at least one token) of the whole mini-batch when this is one micro-batch of it,
    so the micro-batches' losses add up to the mini-batch's (gradient accumulation does not change
    the step); None = this micro-batch's own (``Σ mask``, and the rows with a token)::

        "token-mean"               Σ_it ℓ_it / N                          DAPO (Yu et al. 2025, §3.3), verl default
        "seq-mean-token-mean"      (1/G) Σ_i (1/|o_i|) Σ_t ℓ_it           GRPO (Shao et al. 2024, eq. 3)
        "seq-mean-token-sum"       (1/G) Σ_i Σ_t ℓ_it
        "seq-mean-token-sum-norm"  (1/G) Σ_i Σ_t ℓ_it / norm_len          Dr. GRPO (Liu et al. 2025, §3.2)

    ``|o_i|`` is sequence i's masked-in token count (``+ 1e-8``, so a row without tokens adds 0);
    ``norm_len`` is the constant divisor of Dr. GRPO (``GRPOConfig.max_response_len``), None = ``L``.
    Positions where the mask is 0 never count, not even as NaN. Same value as verl's
    ``core_algos.agg_loss(..., dp_size=1, batch_num_tokens=N, global_batch_size=G,
    loss_scale_factor=norm_len)`` for these modes.

    Args:
        loss_B_L: per-token losses, shape ``(B, L)``.
        mask_B_L: 1.0 on the tokens that count, shape ``(B, L)``.
        mode: one of :data:`LOSS_AGG_MODES`.
        num_tokens, num_sequences, norm_len: the denominators above (counts; tokens).

    Returns:
        A 0-d tensor, in the units of ``loss_B_L``.

    Raises:
        ConfigError: an unknown ``mode``.
    """
    if mode == "token-mean":
        return _masked_sum(loss_B_L, mask_B_L) / (mask_B_L.sum() if num_tokens is None else num_tokens)
    if mode not in LOSS_AGG_MODES:
        raise ConfigError(f"unknown loss aggregation {mode!r}; use one of {', '.join(LOSS_AGG_MODES)}")
    tokens_B = mask_B_L.sum(-1)
    seq_B = _masked_sum(loss_B_L, mask_B_L, dim=-1)
    if mode == "seq-mean-token-mean":
        seq_B = seq_B / (tokens_B + 1e-8)
    has_tokens_B = (tokens_B > 0).float()
    loss = _masked_sum(seq_B, has_tokens_B) / (has_tokens_B.sum() if num_sequences is None else num_sequences)
    if mode == "seq-mean-token-sum-norm":
        loss = loss / (mask_B_L.shape[-1] if norm_len is None else norm_len)
    return loss


def policy_loss(old_logp_B_L: "torch.Tensor", logp_B_L: "torch.Tensor", adv_B_L: "torch.Tensor",
                mask_B_L: "torch.Tensor", *, clip_low: float = 0.2, clip_high: float = 0.2, clip_c: float = 3.0,
                weights_B_L: Optional["torch.Tensor"] = None, mode: str = "token-mean",
                num_tokens: Optional[float] = None, num_sequences: Optional[float] = None,
                norm_len: Optional[float] = None) -> tuple["torch.Tensor", dict[str, float]]:
    """PPO's clipped surrogate loss with clip-higher and dual-clip, aggregated by :func:`aggregate_loss`.

    With the ratio ``r_it = π_θ(t) / π_old(t) = exp(logp − old_logp)`` (the log ratio clamped to
    [−20, 20]) and the advantage ``A_it`` of each token::

        ℓ_it = max(−A_it r_it, −A_it clip(r_it, 1 − ε_low, 1 + ε_high))   PPO (Schulman et al. 2017, eq. 7)
                                                                            with DAPO's clip-higher ε_low ≠ ε_high
                                                                            (Yu et al. 2025, §3.1)
        ℓ_it = min(ℓ_it, −c A_it)                   where A_it < 0         dual-clip (Ye et al. 2020, "Mastering
                                                                            Complex Control in MOBA Games", eq. 5)
        ℓ_it = w_it ℓ_it                            with ``weights_B_L``   e.g. :func:`truncated_is_weights`

    then ``aggregate_loss(ℓ, mask, mode, num_tokens=, num_sequences=, norm_len=)``. Same loss and
    metrics as verl's ``core_algos.compute_policy_loss_vanilla`` with an actor config of
    ``clip_ratio_low=ε_low``, ``clip_ratio_high=ε_high``, ``clip_ratio_c=c`` and
    ``global_batch_info={"dp_size": 1, "batch_num_tokens": num_tokens, "global_batch_size": num_sequences,
    "loss_scale_factor": norm_len}``.

    Args:
        old_logp_B_L: log-probs (nats) of the tokens under π_old (the policy that sampled, or the
            trainer's at the start of the update), shape ``(B, L)``, no grad needed.
        logp_B_L: log-probs under π_θ, with grad.
        adv_B_L: advantage of each token (reward units).
        mask_B_L: 1.0 on the tokens that train.
        clip_low, clip_high: ε_low, ε_high (> 0; PPO 0.2, DAPO 0.2 and 0.28).
        clip_c: the dual-clip bound ``c`` (> 1; verl's default 3).
        weights_B_L: per-token weights of the loss, None = 1.
        mode, num_tokens, num_sequences, norm_len: the aggregation (:func:`aggregate_loss`).

    Returns:
        ``(loss, metrics)``: the 0-d loss tensor (with grad), and floats over the masked-in tokens:
        ``ppo_kl`` (mean of ``old_logp − logp``, nats), ``pg_clipfrac`` (share of tokens where the
        clipped term is the larger), ``pg_clipfrac_lower`` (share where the dual clip bites).

    Raises:
        ConfigError: ``clip_c <= 1``, or an unknown ``mode``.
    """
    import torch

    if not clip_c > 1.0:
        raise ConfigError(f"clip_c={clip_c!r}: the dual-clip bound must be > 1 (Ye et al. 2020 use 3)")
    log_ratio_B_L = torch.clamp(logp_B_L - old_logp_B_L, min=-_LOG_RATIO_BOUND, max=_LOG_RATIO_BOUND)
    ratio_B_L = torch.exp(log_ratio_B_L)
    plain_B_L = -adv_B_L * ratio_B_L
    clipped_B_L = -adv_B_L * torch.clamp(ratio_B_L, 1 - clip_low, 1 + clip_high)
    ppo_B_L = torch.maximum(plain_B_L, clipped_B_L)
    dual_B_L = torch.min(-adv_B_L * clip_c, ppo_B_L)
    loss_B_L = torch.where(adv_B_L < 0, dual_B_L, ppo_B_L)
    if weights_B_L is not None:
        loss_B_L = loss_B_L * weights_B_L
    metrics = {
        "ppo_kl": masked_mean(-log_ratio_B_L, mask_B_L).detach().item(),
        "pg_clipfrac": masked_mean(torch.gt(clipped_B_L, plain_B_L).float(), mask_B_L).detach().item(),
        "pg_clipfrac_lower": masked_mean(torch.gt(ppo_B_L, -adv_B_L * clip_c) * (adv_B_L < 0).float(),
                                         mask_B_L).detach().item(),
    }
    loss = aggregate_loss(loss_B_L, mask_B_L, mode, num_tokens=num_tokens, num_sequences=num_sequences,
                          norm_len=norm_len)
    return loss, metrics


def truncated_is_weights(log_ratio_B_L: "torch.Tensor", mask_B_L: "torch.Tensor", cap: float) -> "torch.Tensor":
    """Token-level truncated importance-sampling weights ``w_it = min(π_train(t) / π_engine(t), C)``.

    For tokens sampled by an engine whose log-probs differ from the trainer's (vLLM kernels, bf16,
    stale weights), weighting each token's loss by ``w_it`` corrects the sampling mismatch with
    bounded variance (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL
    training"; truncated IS, Ionides 2008)::

        w_it = min(exp(clamp(log_ratio_it, −20, 20)), C) · mask_it

    Same weights as verl's ``rollout_corr_helper.compute_rollout_correction_weights(log_ratio, mask,
    rollout_is="token", rollout_is_threshold=C)`` (without its batch normalisation, and without its
    metrics, so an empty mask gives zeros here where verl raises ValueError).

    Args:
        log_ratio_B_L: ``log π_train(t) − log π_engine(t)`` per token (nats), shape ``(B, L)``.
        mask_B_L: 1.0 on the tokens that train; weights are 0 elsewhere.
        cap: ``C`` > 0 (``GRPOConfig.tis_cap``; 2 is typical).

    Returns:
        ``w_B_L``, shape ``(B, L)``, without grad (the weights change the measure, not the objective).

    Raises:
        ConfigError: ``cap <= 0``.
    """
    import torch

    if not cap > 0:
        raise ConfigError(f"cap={cap!r}: the truncation of importance weights must be > 0 (2 is typical)")
    bounded_B_L = torch.clamp(log_ratio_B_L.detach(), min=-_LOG_RATIO_BOUND, max=_LOG_RATIO_BOUND)
    return (torch.exp(bounded_B_L) * mask_B_L).clamp(max=cap)
