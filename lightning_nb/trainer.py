"""GRPO trainer on CPU (or one GPU) that updates the engine's model in place.

The trainer is the only thing that updates weights. It shares the ``nn.Module``
with :class:`~lightning_nb.engine.TransformersEngine` (no weight copy) and holds
the engine's lock while it changes them. It can run an algorithm's loop in a
background thread (:meth:`GRPOTrainer.start`) and be paused, inspected and
resumed from a notebook cell; :meth:`save` / :meth:`load` continue across kernels.
"""

from __future__ import annotations

import copy
import logging
import math
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, Union

import pandas as pd

from lightning_nb.checkpoint import (CHECKPOINT_FORMAT, check_signature, model_signature, plain, rng_state,
                                     set_rng_state, weights_fingerprint)
from lightning_nb.control import BackgroundLoop, TrainerStopped, config_edits
from lightning_nb.device import check_device, check_dtype, place_model, set_gradient_checkpointing
from lightning_nb.engine import TransformersEngine
from lightning_nb.errors import ConfigError
from lightning_nb.types import Triplet
from lightning_nb.weights import adapter_state_dict, add_lora, base_state_dict, has_lora, write_hf_folder

if TYPE_CHECKING:
    from lightning_nb.algorithm import LightningRL

__all__ = ["GRPOConfig", "GRPOTrainer", "TrainerStopped", "group_advantages", "lr_factor", "overlong_penalty",
           "pack_episode", "response_logprobs", "reward_to_go", "transition_advantages"]

log = logging.getLogger(__name__)


@dataclass
class GRPOConfig:
    """Hyper-parameters of the GRPO update. Validated on construction and again on :meth:`GRPOTrainer.resume`.

    Fields may be edited while the trainer is paused; the edit takes effect at the next
    update and is recorded in the metrics (``config_changes``, and :attr:`GRPOTrainer.config_changes`).
    """

    learning_rate: float = field(default=2e-5, metadata={
        "help": "AdamW learning rate (2e-5 suits SmolLM2-135M: 5e-5 drifted, KL to the initial weights > 0.6 "
                "within 12 steps; use ~1e-6 for 1B+ models)."})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay."})
    max_grad_norm: float = field(default=1.0, metadata={"help": "Clip the global gradient norm to this value."})
    clip_ratio: float = field(default=0.2, metadata={"help": "PPO clip range epsilon for the importance ratio."})
    kl_coef: float = field(default=0.0, metadata={
        "help": "Weight of the KL-to-reference loss; 0 disables it. > 0 needs the reference model, kept when "
                "kl_coef > 0 or track_reference_kl is set at construction."})
    kl_penalty: str = field(default="low_var_kl", metadata={"help": "verl KL estimator: kl, abs, mse, low_var_kl."})
    track_reference_kl: bool = field(default=True, metadata={
        "help": "Keep a frozen copy of the initial weights and report KL to it every step (costs one forward)."})
    norm_adv_by_std: bool = field(default=True, metadata={"help": "Divide group-relative advantages by the group std."})
    credit: str = field(default="episode", metadata={
        "help": "How rewards become per-turn credit (Triplet.reward = final reward R, Triplet.step_reward = s_t, the "
                "intermediate rewards of turn t, emit_intermediate_reward). 'episode' (LightningRL, Agent Lightning "
                "§3.2): every turn of episode i gets A_i, GRPO's group-normalised R_i = R + Σ_t s_t (+ overlong "
                "penalty, + KL penalty with kl_mode='reward'); without intermediate rewards exactly the plain "
                "LightningRL update. 'reward_to_go': turn t of T gets the discounted return G_t = Σ_{k≥t} γ^(k−t) "
                "s_k + γ^(T−1−t) R (Sutton & Barto §3.3; s_k includes turn k's overlong penalty), normalised over "
                "all transitions (i, t) of the group: A_it = (G_it − mean_g G) / (std_g G + 1e-6) (verl "
                "compute_grpo_outcome_advantage, one item per transition), so episodes with more turns weigh more "
                "in the group statistics. min_group_size still counts episodes; kl_mode='reward' is refused "
                "(use kl_mode='loss')."})
    gamma: float = field(default=1.0, metadata={
        "help": "Discount γ in (0, 1] of credit='reward_to_go' per turn (LLM call), not per token; 1 = undiscounted. "
                "credit='episode' refuses any other value."})
    min_group_size: int = field(default=2, metadata={
        "help": "Groups with fewer episodes than this (after failures, timeouts and adapter skips) are dropped "
                "from the update and counted in groups_dropped; must be >= 2 (a group of one has no baseline)."})
    max_staleness: int = field(default=1, metadata={
        "help": "Episodes sampled more than this many weight versions before the current one are dropped "
                "(stale_episodes_dropped); fresher off-policy samples are corrected by the clipped importance "
                "ratio against the engine's behavior log-probs (PPO). 0 = strictly on-policy."})
    ppo_epochs: int = field(default=1, metadata={
        "help": "Passes over each batch (PPO epochs, Schulman et al. 2017). With more than one optimizer step "
                "per batch (ppo_epochs > 1, or mini_batch_size below the batch) the ratio is taken against the "
                "policy at the start of the update, so the clip acts. 1 = one pass."})
    mini_batch_size: Optional[int] = field(default=None, metadata={
        "help": "Sequences per optimizer step (PPO mini-batch); None = the whole batch, one step. Its "
                "micro-batches (micro_batch_size) accumulate gradients, and the loss is normalized per "
                "mini-batch, so accumulation does not change the step."})
    lr_scheduler: str = field(default="constant", metadata={
        "help": "Learning-rate schedule over update() calls, after warmup_steps of linear warmup: constant, "
                "linear (to 0 at total_steps) or cosine (to 0 at total_steps). See lightning_nb.trainer.lr_factor."})
    warmup_steps: int = field(default=0, metadata={
        "help": "Updates of linear warmup: update s (0-based) uses learning_rate × (s + 1) / warmup_steps."})
    total_steps: Optional[int] = field(default=None, metadata={
        "help": "Updates the linear and cosine schedules span (required by them; > warmup_steps)."})
    kl_mode: str = field(default="loss", metadata={
        "help": "How kl_coef × KL to the reference enters: 'loss' (added to the loss, GRPO) or 'reward' "
                "(a per-token penalty subtracted from the episode reward before group normalization, "
                "InstructGPT; verl apply_kl_penalty)."})
    clip_ratio_low: Optional[float] = field(default=None, metadata={
        "help": "ε_low: the ratio is clipped below at 1 − ε_low; None = clip_ratio."})
    clip_ratio_high: Optional[float] = field(default=None, metadata={
        "help": "ε_high: the ratio is clipped above at 1 + ε_high; None = clip_ratio. DAPO's clip-higher "
                "(Yu et al. 2025) uses ε_low 0.2, ε_high 0.28."})
    overlong_filter: bool = field(default=False, metadata={
        "help": "DAPO overlong filtering: responses the engine cut at max_tokens (Triplet.finish_reason "
                "'length') get response mask 0, so they add no gradient; their episodes still count in the "
                "group statistics."})
    max_response_len: Optional[int] = field(default=None, metadata={
        "help": "L_max: the max_tokens rollouts sample with (AlgorithmConfig.max_tokens). Needed by the soft "
                "overlong penalty and by loss_agg_mode='seq-mean-token-sum-norm' (its constant divisor)."})
    overlong_buffer_len: int = field(default=0, metadata={
        "help": "L_cache of DAPO's soft overlong punishment: responses longer than max_response_len − "
                "overlong_buffer_len lose up to overlong_penalty_factor of reward, linearly. 0 = off."})
    overlong_penalty_factor: float = field(default=1.0, metadata={
        "help": "Largest soft overlong penalty (reward units), reached at max_response_len tokens."})
    tis_cap: Optional[float] = field(default=None, metadata={
        "help": "Truncated importance sampling (Yao et al. 2025): weight each token's loss by "
                "min(π_trainer/π_engine, tis_cap), for engines whose log-probs differ from the trainer's "
                "(vLLM, bf16, stale weights); 2 is typical. None = off."})
    fail_on_fork: bool = field(default=False, metadata={
        "help": "Raise ConfigError when a turn's prompt does not extend the previous turn's prompt + "
                "completion token for token (a fork: pack_episode would start a new sequence; counted in the "
                "turn_forks metric either way). Needs pack_turns."})
    loss_agg_mode: str = field(default="token-mean", metadata={
        "help": "verl loss aggregation: token-mean, seq-mean-token-sum, seq-mean-token-mean, or "
                "seq-mean-token-sum-norm (Dr. GRPO; needs max_response_len)."})
    micro_batch_size: int = field(default=4, metadata={"help": "Sequences per forward/backward (memory bound)."})
    pack_turns: bool = field(default=True, metadata={
        "help": "Pack an episode's turns into one sequence when each prompt extends the previous turn."})
    skip_zero_advantage: bool = field(default=True, metadata={
        "help": "Skip the forward/backward of sequences whose advantage is 0 on every trained token when kl_coef == 0 "
                "(their gradient is exactly 0); they still count in the loss denominator, so the step size is "
                "unchanged."})
    device: str = field(default="cpu", metadata={
        "help": "Where the model trains and the TransformersEngine serves it: 'cpu', 'cuda' or 'cuda:N'. "
                "The trainer moves the engine's model (and the reference copy) there; set at construction."})
    dtype: str = field(default="float32", metadata={
        "help": "Weight and compute precision: 'float32' (CPU default) or 'bfloat16' (the GPU choice). bfloat16 "
                "keeps float32 master weights in the optimizer (lightning_nb.optim.MasterWeightAdamW), since "
                "bfloat16 weights alone would round AdamW's small steps away; log-probs are computed in float32. "
                "Set at construction."})
    gradient_checkpointing: bool = field(default=False, metadata={
        "help": "Recompute each decoder layer's activations in the backward pass: activation memory of one "
                "layer instead of all, for about one extra forward of compute; same gradients. Set at construction."})
    lora_rank: int = field(default=0, metadata={
        "help": "0 = full fine-tuning. r >= 1 trains LoRA adapters of rank r (Hu et al. 2021) through peft "
                "instead of the weights: each targeted linear layer computes W x + (lora_alpha / r) B A x with W "
                "frozen. The reference policy is then the base model with the adapters disabled (no second "
                "copy), checkpoints hold only the adapters, and save_pretrained() exports merged weights or the "
                "adapter. LoRA wants a ~10x higher learning_rate than full fine-tuning. Set at construction."})
    lora_alpha: float = field(default=32.0, metadata={
        "help": "LoRA scale numerator: the adapters' update is scaled by lora_alpha / lora_rank (verl's and "
                "peft's lora_alpha)."})
    lora_target_modules: Union[str, list] = field(default="all-linear", metadata={
        "help": "Layers that get adapters: 'all-linear' (every linear layer but the output head, as QLoRA and "
                "verl's examples do) or module names such as ['q_proj', 'v_proj'] (peft's target_modules). "
                "Set at construction."})

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ConfigError naming the first field out of range."""
        checks = {
            "learning_rate": self.learning_rate > 0, "weight_decay": self.weight_decay >= 0,
            "max_grad_norm": self.max_grad_norm > 0, "clip_ratio": 0 < self.clip_ratio < 1,
            "kl_coef": self.kl_coef >= 0, "micro_batch_size": self.micro_batch_size >= 1,
            "min_group_size": self.min_group_size >= 2, "max_staleness": self.max_staleness >= 0,
        }
        for name, ok in checks.items():
            if not ok:
                raise ConfigError(f"GRPOConfig.{name}={getattr(self, name)!r} is out of range; "
                                  f"see GRPOConfig.__dataclass_fields__['{name}'].metadata['help']")
        if self.kl_penalty not in ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"):
            raise ConfigError(f"GRPOConfig.kl_penalty={self.kl_penalty!r}; use one of kl, abs, mse, low_var_kl")
        if self.loss_agg_mode not in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                                      "seq-mean-token-sum-norm"):
            raise ConfigError(f"GRPOConfig.loss_agg_mode={self.loss_agg_mode!r}; use token-mean, "
                              "seq-mean-token-sum, seq-mean-token-mean or seq-mean-token-sum-norm")
        self._validate_rl_options()
        check_device(self.device, "GRPOConfig.device")
        check_dtype(self.dtype, "GRPOConfig.dtype")

    def _validate_rl_options(self) -> None:
        """The RL-step options: (field, in range, allowed range, fix) in order; the first failure raises."""
        needs_len = self.overlong_buffer_len > 0 or self.loss_agg_mode == "seq-mean-token-sum-norm"
        rules = [
            ("ppo_epochs", self.ppo_epochs >= 1, "an int >= 1", "use 1 for one pass over the batch"),
            ("mini_batch_size", self.mini_batch_size is None or self.mini_batch_size >= 1, "None or an int >= 1",
             "use None for one optimizer step per batch"),
            ("lr_scheduler", self.lr_scheduler in ("constant", "linear", "cosine"), "constant, linear or cosine",
             "pick one of them"),
            ("warmup_steps", self.warmup_steps >= 0, "an int >= 0", "use 0 for no warmup"),
            ("total_steps", self.total_steps is None or self.total_steps > self.warmup_steps,
             f"None or an int > warmup_steps ({self.warmup_steps})", "set it to the number of updates of the run"),
            ("total_steps", self.lr_scheduler == "constant" or self.total_steps is not None,
             f"an int > warmup_steps with lr_scheduler={self.lr_scheduler!r}",
             "set total_steps to the number of updates of the run (AlgorithmConfig.steps), or use "
             "lr_scheduler='constant'"),
            ("kl_mode", self.kl_mode in ("loss", "reward"), "'loss' or 'reward'", "pick one of them"),
            ("credit", self.credit in ("episode", "reward_to_go"), "'episode' or 'reward_to_go'",
             "use 'episode' (every turn gets its episode's advantage) or 'reward_to_go' (per-turn returns)"),
            ("gamma", isinstance(self.gamma, (int, float)) and not isinstance(self.gamma, bool)
             and 0 < self.gamma <= 1, "a float in (0, 1]", "use 1.0 for undiscounted returns"),
            ("gamma", self.gamma == 1.0 or self.credit == "reward_to_go", "1.0 with credit='episode'",
             "set credit='reward_to_go' to discount per turn (credit='episode' gives every turn the episode's "
             "return, so there is nothing to discount)"),
            ("kl_mode", not (self.credit == "reward_to_go" and self.kl_mode == "reward"),
             "'loss' with credit='reward_to_go'",
             "set kl_mode='loss' (the KL term is per token already), or credit='episode' to keep the KL penalty "
             "in the reward"),
            ("clip_ratio_low", self.clip_ratio_low is None or 0 < self.clip_ratio_low < 1, "None or in (0, 1)",
             "use None to take clip_ratio"),
            ("clip_ratio_high", self.clip_ratio_high is None or self.clip_ratio_high > 0, "None or > 0",
             "use None to take clip_ratio (DAPO uses 0.28)"),
            ("max_response_len", self.max_response_len is None or self.max_response_len >= 1, "None or an int >= 1",
             "set it to the max_tokens of the rollouts"),
            ("max_response_len", not needs_len or self.max_response_len is not None,
             "an int >= 1 when overlong_buffer_len > 0 or loss_agg_mode='seq-mean-token-sum-norm'",
             "set it to the max_tokens of the rollouts (AlgorithmConfig.max_tokens)"),
            ("overlong_buffer_len", self.overlong_buffer_len >= 0 and (
                self.overlong_buffer_len == 0 or self.overlong_buffer_len < (self.max_response_len or 0)),
             "0 (off) or an int in [1, max_response_len)", "DAPO uses a quarter of max_response_len"),
            ("overlong_penalty_factor", self.overlong_penalty_factor >= 0, ">= 0", "DAPO uses 1.0"),
            ("tis_cap", self.tis_cap is None or self.tis_cap >= 1, "None or >= 1",
             "a cap below 1 would shrink the weight of on-policy tokens; Yao et al. use 2"),
            ("lora_rank", isinstance(self.lora_rank, int) and self.lora_rank >= 0, "an int >= 0",
             "use 0 for full fine-tuning, or 8-64 for LoRA"),
            ("lora_alpha", self.lora_alpha > 0, "> 0", "use twice lora_rank, a common choice"),
            ("lora_target_modules", self.lora_target_modules == "all-linear" or (
                isinstance(self.lora_target_modules, (list, tuple)) and self.lora_target_modules
                and all(isinstance(m, str) for m in self.lora_target_modules)),
             "'all-linear' or a non-empty list of module names", "e.g. ['q_proj', 'k_proj', 'v_proj', 'o_proj']"),
            ("fail_on_fork", not self.fail_on_fork or self.pack_turns, "False when pack_turns is False",
             "set pack_turns=True (without packing every turn is its own sequence, so nothing forks)"),
        ]
        for name, ok, allowed, fix in rules:
            if not ok:
                raise ConfigError(f"GRPOConfig.{name}={getattr(self, name)!r} is invalid: it must be {allowed}; "
                                  f"{fix}")


def lr_factor(step: int, config: GRPOConfig) -> float:
    """Multiplier of ``config.learning_rate`` for the update that follows ``step`` updates (0-based).

    With ``W = warmup_steps``, ``T = total_steps`` and ``p = clip((step − W) / (T − W), 0, 1)``::

        step < W:           (step + 1) / W          linear warmup (the first update is not spent at lr 0)
        constant:           1
        linear:             1 − p
        cosine:             (1 + cos(π p)) / 2      (Loshchilov & Hutter 2017, SGDR, one cycle, no restart)

    Linear and cosine reach 0 after ``T`` updates and stay there. The same shapes as
    transformers' ``get_*_schedule_with_warmup`` except that warmup starts at ``1/W``
    (as nanochat does), not at 0. :class:`GRPOTrainer` applies it with
    ``torch.optim.lr_scheduler.LambdaLR``, one scheduler step per :meth:`GRPOTrainer.update`.
    """
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    if config.lr_scheduler == "constant":
        return 1.0
    span = config.total_steps - config.warmup_steps
    p = min(max((step - config.warmup_steps) / span, 0.0), 1.0)
    return 1.0 - p if config.lr_scheduler == "linear" else 0.5 * (1.0 + math.cos(math.pi * p))


def overlong_penalty(length: int, max_len: int, buffer_len: int, factor: float = 1.0) -> float:
    """DAPO's soft overlong punishment of a response of ``length`` tokens (Yu et al. 2025, section 3.4, eq. 13).

    With ``L_max = max_len`` and ``L_cache = buffer_len``::

        0                                       if length <= L_max − L_cache
        ((L_max − L_cache) − length) / L_cache  if L_max − L_cache < length <= L_max
        −1                                      if length > L_max

    times ``factor`` (verl's ``overlong_buffer.penalty_factor``). ``buffer_len`` 0 turns it off (0).
    """
    if buffer_len <= 0:
        return 0.0
    return factor * min(0.0, max(-1.0, (max_len - buffer_len - length) / buffer_len))


def group_advantages(rewards: dict[str, float], groups: dict[str, str], *, min_group_size: int = 2,
                     norm_by_std: bool = True) -> tuple[dict[str, float], dict[str, int]]:
    """GRPO's group-relative outcome advantage per episode, with undersized groups dropped.

    For the episodes ``i`` of a group ``g`` with rewards ``r_i``:
    ``A_i = (r_i - mean_g(r)) / (std_g(r) + 1e-6)`` with the unbiased std (``norm_by_std``;
    GRPO, Shao et al. 2024, "DeepSeekMath", section 4.1.2; computed by verl's
    ``compute_grpo_outcome_advantage``), or ``A_i = r_i - mean_g(r)`` without it (Dr. GRPO,
    Liu et al. 2025). Rewards ``[1, 0, 0, 0]`` give ``[1.5, -0.5, -0.5, -0.5]``.

    A group with fewer than ``min_group_size`` episodes (failures, timeouts and adapter
    skips shrink groups) is dropped: with one episode verl would use mean 0 and std 1,
    training the survivor on its raw reward, and two or three samples make a poor baseline.

    Args:
        rewards: episode (rollout) id -> final reward.
        groups: episode id -> group id (same keys as ``rewards``).
        min_group_size: smallest group kept (>= 2).
        norm_by_std: divide by the group std.

    Returns:
        ``(advantages, dropped)``: episode id -> advantage for the kept episodes, and
        group id -> size for the dropped groups.

    Raises:
        ConfigError: ``min_group_size`` < 2, or ``groups`` lacks an episode of ``rewards``.
    """
    import torch
    from verl.trainer.ppo import core_algos

    dropped = _undersized_groups(rewards, groups, min_group_size)
    kept = [e for e in rewards if groups[e] not in dropped]
    if not kept:
        return {}, dropped
    rewards_E = torch.tensor([rewards[e] for e in kept], dtype=torch.float32)
    adv_E, _ = core_algos.compute_grpo_outcome_advantage(
        token_level_rewards=rewards_E[:, None], response_mask=torch.ones(len(kept), 1),
        index=[groups[e] for e in kept], norm_adv_by_std_in_grpo=norm_by_std)
    return {e: float(a) for e, a in zip(kept, adv_E[:, 0])}, dropped


def _undersized_groups(episodes: Sequence[str] | dict[str, Any], groups: dict[str, str],
                       min_group_size: int) -> dict[str, int]:
    """Group id -> number of episodes, for the groups of ``episodes`` with fewer than ``min_group_size``.

    Raises:
        ConfigError: ``min_group_size`` < 2, or ``groups`` lacks one of ``episodes``.
    """
    if min_group_size < 2:
        raise ConfigError(f"min_group_size must be >= 2, got {min_group_size}: a group of one has no baseline")
    missing = [e for e in episodes if e not in groups]
    if missing:
        raise ConfigError(f"groups has no group for episode {missing[0]!r}")
    sizes: dict[str, int] = {}
    for e in episodes:
        sizes[groups[e]] = sizes.get(groups[e], 0) + 1
    return {g: n for g, n in sizes.items() if n < min_group_size}


def reward_to_go(step_rewards: Sequence[float], final_reward: float, gamma: float = 1.0) -> list[float]:
    """Discounted return of each turn of one episode (``GRPOConfig.credit="reward_to_go"``).

    For turns ``t = 0..T-1`` with step rewards ``s_t`` (intermediate rewards, reward units) and
    the episode's final reward ``R`` (arriving after the last turn)::

        G_t = Σ_{k≥t} γ^(k−t) s_k + γ^(T−1−t) R         (Sutton & Barto 2018, §3.3)

    computed backwards, ``G_{T−1} = s_{T−1} + R`` and ``G_t = s_t + γ G_{t+1}``. Steps ``[0.5, 0, 0]``,
    ``R = 1`` and ``γ = 0.5`` give ``[0.75, 0.5, 1.0]``. ``[]`` gives ``[]``.
    """
    out = [0.0] * len(step_rewards)
    ahead = float(final_reward)
    for t in range(len(step_rewards) - 1, -1, -1):
        out[t] = float(step_rewards[t]) + ahead
        ahead = gamma * out[t]
    return out


def transition_advantages(returns: dict[tuple[str, int], float], groups: dict[str, str], *, min_group_size: int = 2,
                          norm_by_std: bool = True) -> tuple[dict[tuple[str, int], float], dict[str, int]]:
    """GRPO's group-relative advantage per transition, with groups of too few episodes dropped.

    For the transitions ``(i, t)`` (episode i, turn t) of a group ``g`` with returns ``G_it``
    (:func:`reward_to_go`): ``A_it = (G_it − mean_g G) / (std_g G + 1e-6)`` over all of the group's
    transitions (unbiased std; ``norm_by_std=False``: ``G_it − mean_g G``), computed by
    :func:`group_advantages` (verl's ``compute_grpo_outcome_advantage``) with one item per
    transition. An episode with more turns puts more items into the mean and std, so it weighs
    more in the group statistics than under per-episode normalization.

    A group is dropped when it has fewer than ``min_group_size`` **episodes** (not transitions).

    Args:
        returns: ``(episode id, turn index)`` -> return.
        groups: episode id -> group id (every episode of ``returns``).

    Returns:
        ``(advantages, dropped)``: ``(episode, turn)`` -> advantage for the kept groups, and group id -> episodes
        for the dropped ones.

    Raises:
        ConfigError: ``min_group_size`` < 2, or ``groups`` lacks an episode of ``returns``.
    """
    dropped = _undersized_groups(list(dict.fromkeys(e for e, _ in returns)), groups, min_group_size)
    kept = {k: v for k, v in returns.items() if groups[k[0]] not in dropped}
    # every kept group has >= 2 episodes, so >= 2 transitions: group_advantages drops nothing more
    advantages, _ = group_advantages(kept, {k: groups[k[0]] for k in kept}, min_group_size=2,  # type: ignore[arg-type]
                                     norm_by_std=norm_by_std)
    return advantages, dropped  # type: ignore[return-value]


@dataclass
class _Sequence:
    """One training sequence: tokens, response mask (1 = trained token), behavior logprobs, advantage.

    ``old_logprobs``, ``mask`` and ``input_ids`` have one length; ``trainer_logprobs`` (same
    length) are the trainer's log-probs at the start of the update, once it has scored the
    sequence. ``fork_at`` is set on a sequence that :func:`pack_episode` started because the
    turn's prompt did not extend the previous sequence: the first differing token position.

    Advantages are per token, since one sequence can hold several turns: ``token_turns[j]`` is
    the index (0..T−1, in turn order among the episode's T triplets) of the transition token j
    came with (its prompt or its response), and ``token_advantages[j]`` that transition's
    advantage; both as long as ``input_ids``. ``advantage`` is their mean over the response
    tokens (mask 1), for displays; the loss uses ``token_advantages``.
    """

    input_ids: list[int]
    mask: list[int]
    old_logprobs: list[float]
    has_old: bool
    advantage: float
    temperature: float
    rollout_id: str = ""
    group_id: str = ""
    turn: int = 0
    fork_at: Optional[int] = None
    trained: bool = False
    trainer_logprobs: Optional[list[float]] = None
    kl_sum: float = 0.0
    token_turns: list[int] = field(default_factory=list)
    token_advantages: list[float] = field(default_factory=list)

    def set_advantages(self, by_turn: dict[int, float]) -> None:
        """Give token j the advantage ``by_turn[token_turns[j]]``; ``advantage`` becomes their response-token mean."""
        self.token_advantages = [by_turn[k] for k in self.token_turns]
        trained = [a for a, m in zip(self.token_advantages, self.mask) if m] or self.token_advantages
        # one value exactly when all are equal (credit="episode"): a float mean of n copies can round
        self.advantage = trained[0] if len(set(trained)) == 1 else (sum(trained) / len(trained) if trained else 0.0)

    def as_row(self) -> dict[str, Any]:
        """The sequence as :attr:`GRPOTrainer.last_batch` holds it (engine/trainer log-probs 0.0 off the mask)."""
        return {"rollout_id": self.rollout_id, "group_id": self.group_id, "input_ids": list(self.input_ids),
                "response_mask": list(self.mask), "advantage": float(self.advantage),
                "advantages": [a if m else 0.0 for a, m in zip(self.token_advantages, self.mask)],
                "engine_logprobs": [lp if m else 0.0 for lp, m in zip(self.old_logprobs, self.mask)],
                "trainer_logprobs": ([lp if m else 0.0 for lp, m in zip(self.trainer_logprobs, self.mask)]
                                     if self.trained and self.trainer_logprobs is not None else None)}


def pack_episode(triplets: Sequence[Triplet], advantage: float, pack: bool = True, *,
                 mask_truncated: bool = False) -> list[_Sequence]:
    """Turn one episode's triplets (ordered by turn) into training sequences.

    When a turn's prompt starts with the previous sequence (prompt + response),
    the new tokens are appended: tool results/user text get mask 0, the response
    mask 1 (the response_mask of multi-turn RL). Otherwise a new sequence starts; with
    ``pack`` that is a fork, and the new sequence's ``fork_at`` is the first position where
    the prompt differs from the previous sequence (an episode packed into k sequences has
    k − 1 forks). With ``mask_truncated`` the response of a turn the engine cut at
    ``max_tokens`` (``finish_reason == "length"``) gets mask 0 (DAPO's overlong filtering).
    A turn sampled at another temperature than the sequence it extends starts a new sequence
    (not a fork: ``fork_at`` stays None), since a sequence is scored at one temperature.
    Each token's ``token_turns`` entry is its transition's index in turn order (0..T−1), and every
    token gets ``advantage`` (:meth:`_Sequence.set_advantages` sets per-turn ones).
    """
    out: list[_Sequence] = []
    for k, t in enumerate(sorted(triplets, key=lambda t: t.turn)):
        lp = list(t.logprobs) if t.logprobs is not None else [0.0] * len(t.response_ids)
        keep = 0 if mask_truncated and t.finish_reason == "length" else 1  # response mask value
        cur = out[-1] if out else None
        extends = cur is not None and t.prompt_ids[: len(cur.input_ids)] == cur.input_ids
        if pack and extends and t.temperature == cur.temperature:
            extra = t.prompt_ids[len(cur.input_ids):]
            cur.input_ids += extra + t.response_ids
            cur.mask += [0] * len(extra) + [keep] * len(t.response_ids)
            cur.old_logprobs += [0.0] * len(extra) + lp
            cur.has_old = cur.has_old and t.logprobs is not None
            cur.token_turns += [k] * (len(extra) + len(t.response_ids))
            cur.token_advantages += [advantage] * (len(extra) + len(t.response_ids))
        else:
            fork_at = (_first_difference(cur.input_ids, t.prompt_ids) if pack and cur is not None and not extends
                       else None)
            out.append(_Sequence(list(t.prompt_ids) + list(t.response_ids),
                                 [0] * len(t.prompt_ids) + [keep] * len(t.response_ids),
                                 [0.0] * len(t.prompt_ids) + lp, t.logprobs is not None, advantage, t.temperature,
                                 rollout_id=t.rollout_id, group_id=t.group_id, turn=t.turn, fork_at=fork_at,
                                 token_turns=[k] * (len(t.prompt_ids) + len(t.response_ids)),
                                 token_advantages=[advantage] * (len(t.prompt_ids) + len(t.response_ids))))
    return out


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    """First index where ``a`` and ``b`` differ (the shorter length if one is a prefix of the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


class _VerlActorView:
    """The few ActorConfig fields verl's ``compute_policy_loss_vanilla`` reads, for one mini-batch.

    ``num_tokens`` and ``num_sequences`` are the mini-batch's response tokens and sequences
    with at least one: the loss denominators of ``token-mean`` and the ``seq-mean-*`` modes,
    so the micro-batches' losses add up to the mini-batch's. ``loss_scale_factor`` (the
    constant divisor of ``seq-mean-token-sum-norm``) is ``max_response_len``.
    """

    def __init__(self, config: GRPOConfig, num_tokens: int, num_sequences: int) -> None:
        self.clip_ratio = config.clip_ratio
        self.clip_ratio_low, self.clip_ratio_high = config.clip_ratio_low, config.clip_ratio_high  # None: clip_ratio
        self.loss_agg_mode = config.loss_agg_mode
        self.global_batch_info = {"dp_size": 1, "batch_num_tokens": num_tokens, "global_batch_size": num_sequences,
                                  "loss_scale_factor": config.max_response_len}

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key, default)


@dataclass
class _Batch:
    """What one update trains on (its kept episodes' sequences) and what its metrics report about the rest."""

    seqs: list[_Sequence]
    rewards: dict[str, float]  # episode -> reward as emitted (episodes not dropped as stale)
    groups: dict[str, str]  # episode -> group
    advantages: dict[str, float]  # kept episodes only (credit="reward_to_go": the mean over its turns)
    turn_advantages: dict[str, dict[int, float]]  # kept episode -> turn index (0..T-1, in turn order) -> advantage
    dropped: dict[str, int]  # undersized group -> size
    staleness: dict[str, int]  # episode -> weight versions behind
    stale: list[str]
    forks: int


def _per_triplet_turn(triplets: Sequence[Triplet],
                      by_turn: dict[str, dict[int, float]]) -> dict[tuple[str, int], float]:
    """``(rollout_id, Triplet.turn) -> advantage`` from the trainer's ``episode -> turn index -> advantage``."""
    episodes: dict[str, list[Triplet]] = {}
    for t in triplets:
        episodes.setdefault(t.rollout_id, []).append(t)
    return {(r, t.turn): advs[k] for r, advs in by_turn.items()
            for k, t in enumerate(sorted(episodes[r], key=lambda t: t.turn))}


def _shift_pad(rows: Sequence[Sequence[float]], T: int, device: Any) -> Any:
    """(B, T-1) float32 tensor of per-token ``rows`` (each as long as its sequence) for tokens 1..T-1, 0-padded."""
    import torch

    return torch.tensor([list(r[1:]) + [0] * (T - len(r)) for r in rows], dtype=torch.float32, device=device)


class GRPOTrainer(BackgroundLoop):
    """Group Relative Policy Optimization on the engine's model.

    Control from a notebook (:class:`~lightning_nb.control.BackgroundLoop`): :meth:`start`
    runs an algorithm's loop in the background; :meth:`pause` returns once the loop is
    parked at a step boundary; edits to :attr:`config` (or the algorithm's config) made
    while paused take effect on :meth:`resume`, which validates them first; :meth:`save` /
    :meth:`load` continue a run exactly, in the same or a new process.

    Args:
        engine: serves the policy; its ``model`` is updated in place, and moved to
            ``config.device`` / ``config.dtype`` on construction (the engine follows it).
        config: :class:`GRPOConfig`.

    Raises:
        ConfigError: ``config.device`` is not available here, or ``config.gradient_checkpointing``
            is set for a model without transformers decoder layers.
    """

    def __init__(self, engine: TransformersEngine, config: Optional[GRPOConfig] = None) -> None:
        import torch

        from lightning_nb.optim import make_optimizer

        self.engine = engine
        self.model = engine.model
        self.config = config or GRPOConfig()
        cfg = self.config
        self.peft_model = None  # the peft.PeftModel around self.model when training LoRA adapters
        with engine.lock:  # the engine serves the moved model from its next batch on (it reads the device each time)
            place_model(self.model, cfg.device, cfg.dtype)
            if cfg.lora_rank:  # injected in place: the engine serves the adapted model with no copy
                self.peft_model = add_lora(self.model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_target_modules)
            elif has_lora(self.model):
                raise ConfigError(
                    "GRPOConfig.lora_rank=0 (full fine-tuning), but this engine's model has LoRA adapters from an "
                    "earlier trainer with lora_rank > 0; build this trainer with that trainer's lora_* fields, or "
                    "build a new engine for full fine-tuning")
        self.reference = None  # a frozen copy of the initial weights; with LoRA the base model is the reference
        if self.peft_model is None and (cfg.track_reference_kl or cfg.kl_coef > 0):  # copied after the move
            self.reference = copy.deepcopy(self.model).eval().requires_grad_(False)
            set_gradient_checkpointing(self.reference, False)
        set_gradient_checkpointing(self.model, cfg.gradient_checkpointing)
        self._placement = {k: getattr(cfg, k) for k in ("device", "dtype", "gradient_checkpointing", "lora_rank",
                                                         "lora_alpha", "lora_target_modules")}
        self._trainable = [p for p in self.model.parameters() if p.requires_grad]  # the adapters only, with LoRA
        # created after the move, so its state lives beside the weights
        self.optimizer = make_optimizer(self._trainable, dtype=cfg.dtype, lr=cfg.learning_rate,
                                        weight_decay=cfg.weight_decay)
        # one scheduler step per update(); _sync_config re-applies lr_factor with the config as edited before each
        # update. The lambda holds the config, not self: a trainer -> scheduler -> trainer cycle would keep the
        # weights and AdamW state of discarded trainers alive until the cyclic garbage collector runs.
        config = self.config
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: lr_factor(s, config))
        self.step = 0
        self.metrics: list[dict[str, Any]] = []
        self.config_changes: list[dict[str, Any]] = []  # {"step", "field", "old", "new"} per edit applied
        self.last_triplets: list[Triplet] = []
        self.last_advantages: dict[str, float] = {}
        self.last_turn_advantages: dict[tuple[str, int], float] = {}  # (rollout_id, Triplet.turn) -> advantage
        self.last_batch: list[dict[str, Any]] = []  # the optimizer's-eye view of the last update (see update())
        self.algorithm: Optional["LightningRL"] = None
        self._pending_algorithm_state: Optional[dict[str, Any]] = None
        self._applied_config = asdict(self.config)
        self._updating = threading.Lock()
        self._init_loop()

    # ----- the RL step ----------------------------------------------------------------
    def update(self, triplets: Sequence[Triplet]) -> dict[str, Any]:
        """One GRPO step on ``triplets``; returns its metrics (also appended to :attr:`metrics`).

        Steps, top to bottom:
          1. :meth:`_build_batch`: drop episodes sampled more than ``max_staleness`` weight
             versions ago; pack each episode's turns into sequences with a response mask
             (:func:`pack_episode`; forks are counted, or refused with ``fail_on_fork``); episode
             reward (final reward + intermediate rewards, with DAPO's soft overlong penalty, and the
             KL penalty of ``kl_mode="reward"``) → group-relative advantage (:func:`group_advantages`;
             groups = ``Triplet.group_id``; groups under ``min_group_size`` are dropped), given to
             every token of the episode (LightningRL); with ``credit="reward_to_go"`` each turn's
             discounted return → a group-relative advantage per turn (:func:`reward_to_go`,
             :func:`transition_advantages`), given to that turn's tokens;
          2. :meth:`_optimize`: ``ppo_epochs`` passes over mini-batches of ``mini_batch_size``
             sequences, one AdamW step each with gradient-norm clipping; each mini-batch is
             forwarded in micro-batches of ``micro_batch_size`` (:meth:`_micro_step`, gradients
             accumulated) through the model's own ``forward``; each micro-batch done (also those
             of π_start's scoring forwards) moves :attr:`progress` (phase ``"update"``, unit
             ``"micro-batches"``);
          3. ``engine.load_weights(model)`` serves the new weights and bumps
             ``engine.weight_version`` (only when the weights changed); the learning rate
             moves one step along its schedule (:func:`lr_factor`).

        The loss of a mini-batch M, over the response tokens t of its sequences i, with
        ``r = π_θ(t) / π_old(t)`` and A_it the advantage of the turn token t came with::

            ℓ_it = w_it · max(−A_it r, −A_it clip(r, 1 − ε_low, 1 + ε_high))  PPO (Schulman et al. 2017)
                   (for A_it < 0 also capped at −3 A_it: dual-clip, Ye et al. 2020; verl's clip_ratio_c)
            token-mean               Σ_it ℓ_it / N_M                         verl default, DAPO
            seq-mean-token-mean      (1/G_M) Σ_i (1/|o_i|) Σ_t ℓ_it          GRPO paper
            seq-mean-token-sum       (1/G_M) Σ_i Σ_t ℓ_it
            seq-mean-token-sum-norm  (1/G_M) Σ_i Σ_t ℓ_it / max_response_len  Dr. GRPO (Liu et al. 2025, §3.2)
            + kl_coef · (the same aggregation of the KL estimator to the reference)   kl_mode="loss"

        computed by verl's ``compute_policy_loss_vanilla``, ``agg_loss`` and ``kl_penalty``.
        N_M and G_M are the response tokens and sequences of the whole mini-batch, also the
        zero-advantage ones that ``skip_zero_advantage`` does not forward, so the micro-batch
        losses add up to the mini-batch's (gradient accumulation does not change the step).

        * π_old is fixed at the start of the update: the engine's log-probs (the policy that
          sampled), or the trainer's before the first optimizer step (π_start) for triplets
          without engine log-probs. With one optimizer step per batch (the default) π_start
          comes from the gradient forward itself; with more, :meth:`_score_at_start` records it first.
        * ε_low, ε_high: ``clip_ratio_low`` / ``clip_ratio_high``, both ``clip_ratio`` unless set
          (DAPO's clip-higher, Yu et al. 2025, §3.1: ε_high 0.28 leaves room for
          low-probability tokens to grow).
        * w_it = 1, or with ``tis_cap`` C, ``min(π_start(t) / π_engine(t), C)``: truncated importance
          sampling (Yao et al. 2025, "Your efficient RL framework secretly brings you
          off-policy RL training"; verl's ``compute_rollout_correction_weights``, token level);
          π_old is then π_start (decoupled PPO, as verl does it).

        After the update, :attr:`last_batch` holds one dict per sequence of the kept episodes
        (also those not forwarded): ``rollout_id``, ``group_id``, ``input_ids``,
        ``response_mask``, ``advantage`` (the mean of ``advantages`` over the trained tokens),
        ``advantages`` (per token), ``engine_logprobs`` and ``trainer_logprobs`` (π_start, or None
        when the sequence was not forwarded), the per-token lists as long as ``input_ids`` with 0.0
        where the mask is 0. :attr:`last_advantages` holds each kept episode's advantage and
        :attr:`last_turn_advantages` each triplet's, keyed ``(rollout_id, turn)``.

        Metrics (one row): ``step``, ``loss``, ``pg_loss`` and ``grad_norm`` (means over the
        optimizer steps), ``kl``, ``ppo_kl``, ``pg_clipfrac`` and ``tis_weight_mean`` (NaN without
        ``tis_cap``) (means over the forwarded tokens of all epochs), ``logprob_diff_max``
        (largest per-token |π_start − engine| log-prob on the trained tokens, nats),
        ``reward_mean``/``reward_std`` over the kept episodes' rewards as emitted,
        ``episodes``, ``groups``, ``groups_with_signal``, ``groups_dropped``,
        ``episodes_dropped``, ``transitions``, ``stale_episodes_dropped``, ``staleness_max``,
        ``sequences_trained``, ``tokens_trained``, ``optimizer_steps``, ``turn_forks``
        (sequences started because a turn's prompt did not extend the previous turn's
        tokens), ``truncated_responses`` (triplets with ``finish_reason == "length"``),
        ``intermediate_rewards`` (triplets with ``step_reward != 0``),
        ``update_seconds``, ``tokens_per_s``, ``lr`` (the learning rate this update used),
        ``config_changes`` (edits applied at this step, or "").

        Departures from the GRPO paper (Shao et al. 2024) and the Agent Lightning paper:
          * no KL penalty by default (``kl_coef=0``, as in DAPO / Dr. GRPO); KL to the
            initial weights is still measured (``track_reference_kl``);
          * one optimizer step per batch by default (``ppo_epochs=1``,
            ``mini_batch_size=None``), so clipping only bites on engine/trainer numeric
            mismatch or stale weights;
          * advantages are normalized per episode, not per transition, so an
            episode with more LLM calls does not weigh more in the group statistics
            (``credit="reward_to_go"`` normalizes per transition, so there it does);
          * groups smaller than ``min_group_size`` are dropped, not trained with verl's
            size-1 rule;
          * turns sharing a prefix are packed into one sequence (same gradient, fewer tokens);
          * token-mean loss over the whole batch (verl default), not mean-per-sequence.

        Raises:
            ConfigError: no triplets, a triplet with an empty response, a triplet sampled
                with ``top_p < 1`` (the engine's log-probs are of the untruncated
                distribution), ``kl_coef > 0`` without a reference model, or a fork with
                ``fail_on_fork``.
        """
        from verl.trainer.ppo import core_algos

        self._check_batch(triplets)
        with self._updating:
            changes = self._sync_config()
            lr = float(self.optimizer.param_groups[0]["lr"])
            t0 = time.perf_counter()
            self.report_progress("update", 0, 0, unit="micro-batches", step=self.step + 1)
            with self.engine.lock:
                batch = self._build_batch(triplets, core_algos)
                stats = self._optimize(batch.seqs, core_algos)
                if stats["optimizer_steps"]:
                    self.engine.load_weights(self.model)  # in place, or pushed to a server (VLLMEngine)
                self._advance_schedule()
                self.step += 1
            metrics = self._step_metrics(triplets, batch, stats, time.perf_counter() - t0, lr, changes)
            self.last_triplets, self.last_advantages = list(triplets), batch.advantages
            self.last_turn_advantages = _per_triplet_turn(triplets, batch.turn_advantages)
            self.last_batch = [s.as_row() for s in batch.seqs]
            self.metrics.append(metrics)
            return metrics

    def _build_batch(self, triplets: Sequence[Triplet], core_algos: Any) -> _Batch:
        """Episodes → packed sequences carrying per-token advantages (step 1 of :meth:`update`).

        With ``credit="episode"`` (the default) the reward that goes into the group normalization
        of episode i, whose advantage every token of the episode gets, is::

            R_i = r_i + Σ_turns s_turn                            (intermediate rewards, Triplet.step_reward)
                      + Σ_turns overlong_penalty(|response|)     (overlong_buffer_len > 0)
                      − kl_coef · Σ_t kl_t                       (kl_mode="reward", kl_coef > 0)

        With ``credit="reward_to_go"`` each turn gets its own advantage (:meth:`_advantages`), and
        the tokens of a packed sequence carry the advantage of the turn they came with.

        * the soft overlong penalty of DAPO (:func:`overlong_penalty`), summed over the
          episode's LLM calls (one call: DAPO's single response);
        * kl_t: the ``kl_penalty`` estimator of ``log π_start(t) − log π_ref(t)`` on each response
          token of the episode, π_start the trainer before this update. That is the per-token
          reward ``−β · kl_t`` of InstructGPT (Ouyang et al. 2022, eq. 2) as verl's
          ``apply_kl_penalty`` adds it to the token-level rewards, which GRPO's outcome
          advantage then sums per sequence (``compute_grpo_outcome_advantage``).

        Raises:
            ConfigError: ``fail_on_fork`` is set and an episode's turns do not pack into one sequence.
        """
        cfg = self.config
        episodes: dict[str, list[Triplet]] = {}
        for t in triplets:
            episodes.setdefault(t.rollout_id, []).append(t)
        packed = {r: pack_episode(ts, 0.0, cfg.pack_turns, mask_truncated=cfg.overlong_filter)
                  for r, ts in episodes.items()}
        forks = [s for seqs in packed.values() for s in seqs if s.fork_at is not None]
        if forks and cfg.fail_on_fork:
            f = forks[0]
            raise ConfigError(
                f"rollout {f.rollout_id!r}: the prompt of turn {f.turn} does not extend the previous turn's prompt + "
                f"completion (first differing token at position {f.fork_at}), so it would train as a separate "
                f"sequence ({len(forks)} such fork(s) in this batch; GRPOConfig.fail_on_fork=True). Find the cause "
                "with lightning_nb.audit's token-fidelity check (the agent rewrote the history, or the reply "
                "re-tokenizes differently), or set fail_on_fork=False to train forks as separate sequences")
        staleness = {r: max((self.engine.weight_version - t.weight_version for t in ts
                             if t.weight_version is not None), default=0) for r, ts in episodes.items()}
        stale = [r for r, age in staleness.items() if age > cfg.max_staleness]
        for r in stale:  # too old to correct by importance weighting
            del episodes[r]
        groups = {r: ts[0].group_id for r, ts in episodes.items()}
        advantages, by_turn, dropped = self._advantages(episodes, groups)
        seqs = [s for r in advantages for s in packed[r]]
        if cfg.kl_coef > 0 and cfg.kl_mode == "reward" and seqs:  # credit="episode" (validated)
            scored = [s for s in seqs if any(s.mask)]
            tick = self._micro_batch_counter(_micro_batches(scored, cfg.micro_batch_size))
            self._score_at_start(scored, core_algos, tick, with_reference=True)
            kl_sums: dict[str, list[float]] = {}
            for s in seqs:
                kl_sums.setdefault(s.rollout_id, []).append(s.kl_sum)
            advantages, by_turn, _ = self._advantages({r: episodes[r] for r in advantages}, groups, kl_sums)
        for s in seqs:
            s.set_advantages(by_turn[s.rollout_id])
        return _Batch(seqs=seqs, rewards={r: ts[0].reward for r, ts in episodes.items()}, groups=groups,
                      advantages=advantages, turn_advantages=by_turn, dropped=dropped, staleness=staleness,
                      stale=stale, forks=len(forks))

    def _advantages(self, episodes: dict[str, list[Triplet]], groups: dict[str, str],
                    kl_sums: Optional[dict[str, list[float]]] = None,
                    ) -> tuple[dict[str, float], dict[str, dict[int, float]], dict[str, int]]:
        """The advantages of ``episodes`` under ``GRPOConfig.credit`` (one rule for :meth:`update` and
        :meth:`signal_groups`).

        * ``"episode"``: :func:`group_advantages` of :meth:`_episode_rewards` (minus ``kl_coef`` × each of
          ``kl_sums[episode]``, the KL penalty of ``kl_mode="reward"``); every turn gets its episode's.
        * ``"reward_to_go"``: :func:`reward_to_go` of the turns' step rewards (``Triplet.step_reward`` plus
          the turn's :func:`overlong_penalty`) and the final reward, with ``gamma``, then
          :func:`transition_advantages` over each group's transitions.

        Returns:
            ``(per_episode, per_turn, dropped)``: kept episode -> advantage (``reward_to_go``: the mean over its
            turns, for displays); kept episode -> {turn index 0..T−1 in turn order -> advantage}; undersized
            group -> episodes.
        """
        cfg = self.config
        if cfg.credit == "reward_to_go":
            returns: dict[tuple[str, int], float] = {}
            for r, ts in episodes.items():
                ordered = sorted(ts, key=lambda t: t.turn)
                steps = [t.step_reward + overlong_penalty(len(t.response_ids), cfg.max_response_len or 0,
                                                          cfg.overlong_buffer_len, cfg.overlong_penalty_factor)
                         for t in ordered]
                for k, g in enumerate(reward_to_go(steps, ordered[0].reward, cfg.gamma)):
                    returns[(r, k)] = g
            flat, dropped = transition_advantages(returns, groups, min_group_size=cfg.min_group_size,
                                                  norm_by_std=cfg.norm_adv_by_std)
            by_turn: dict[str, dict[int, float]] = {}
            for (r, k), a in flat.items():
                by_turn.setdefault(r, {})[k] = a
            return {r: sum(v.values()) / len(v) for r, v in by_turn.items()}, by_turn, dropped
        shaped = self._episode_rewards(episodes)
        for r, kls in (kl_sums or {}).items():
            for kl in kls:  # one subtraction per packed sequence, in order
                shaped[r] -= cfg.kl_coef * kl
        advantages, dropped = group_advantages(shaped, groups, min_group_size=cfg.min_group_size,
                                               norm_by_std=cfg.norm_adv_by_std)
        return advantages, {r: dict.fromkeys(range(len(episodes[r])), a) for r, a in advantages.items()}, dropped

    def _episode_rewards(self, episodes: dict[str, list[Triplet]]) -> dict[str, float]:
        """Each episode's final reward plus its turns' intermediate rewards (``Triplet.step_reward``) and the
        soft overlong penalty of its responses (0 unless overlong_buffer_len > 0)."""
        cfg = self.config
        shaped = {r: ts[0].reward + sum(t.step_reward for t in ts) for r, ts in episodes.items()}
        if cfg.overlong_buffer_len == 0:
            return shaped
        return {r: shaped[r] + sum(overlong_penalty(len(t.response_ids), cfg.max_response_len,
                                                    cfg.overlong_buffer_len, cfg.overlong_penalty_factor)
                                   for t in ts) for r, ts in episodes.items()}

    def _optimize(self, seqs: list[_Sequence], core_algos: Any) -> dict[str, float]:
        """``ppo_epochs`` passes over mini-batches of ``seqs``, one optimizer step each (step 2 of :meth:`update`).

        Mini-batches are ``mini_batch_size`` consecutive sequences in batch order (no shuffle,
        as verl's default); one with nothing to forward takes no step. Returns the sums over
        micro-batches of ``loss``, ``pg_loss`` and the token-weighted ``kl``, ``ppo_kl``,
        ``pg_clipfrac``, ``tis_weight`` with the forwarded ``tokens``; ``grad_norm`` summed over
        the steps; the largest ``logprob_diff_max``; and ``optimizer_steps``.
        """
        import torch

        cfg = self.config
        skip = cfg.skip_zero_advantage and (cfg.kl_coef == 0 or cfg.kl_mode == "reward")
        for s in seqs:  # without a KL loss term a zero advantage on every trained token has exactly zero gradient
            s.trained = any(s.mask) and not (skip and all(a == 0.0 for a, m in zip(s.token_advantages, s.mask) if m))
        size = cfg.mini_batch_size or max(len(seqs), 1)
        minis = [m for m in (seqs[i: i + size] for i in range(0, len(seqs), size)) if any(s.trained for s in m)]
        scored = ([s for s in seqs if s.trained and s.trainer_logprobs is None]
                  if cfg.ppo_epochs * len(minis) > 1 else [])
        tick = self._micro_batch_counter(_micro_batches(scored, cfg.micro_batch_size) + cfg.ppo_epochs * sum(
            _micro_batches([s for s in m if s.trained], cfg.micro_batch_size) for m in minis))
        if scored:  # fix π_start before the first step changes the weights
            self._score_at_start(scored, core_algos, tick)
        stats = dict.fromkeys(("loss", "pg_loss", "kl", "ppo_kl", "pg_clipfrac", "tis_weight", "tokens",
                               "logprob_diff_max", "grad_norm"), 0.0)
        stats["optimizer_steps"] = 0
        for _ in range(cfg.ppo_epochs):
            for mini in minis:
                view = _VerlActorView(cfg, sum(sum(s.mask) for s in mini), sum(1 for s in mini if any(s.mask)))
                trained = [s for s in mini if s.trained]
                for i in range(0, len(trained), cfg.micro_batch_size):
                    part = self._micro_step(trained[i: i + cfg.micro_batch_size], view, core_algos)
                    tick()
                    for k, v in part.items():
                        stats[k] = max(stats[k], v) if k == "logprob_diff_max" else stats[k] + v
                stats["grad_norm"] += float(torch.nn.utils.clip_grad_norm_(self._trainable,
                                                                           cfg.max_grad_norm))
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
                stats["optimizer_steps"] += 1
        return stats

    def _micro_batch_counter(self, total: int) -> Callable[[], None]:
        """A function to call after each of the update's ``total`` micro-batches: reports ``update`` progress."""
        done = 0
        self.report_progress("update", 0, total, unit="micro-batches", step=self.step + 1)

        def tick() -> None:
            nonlocal done
            done += 1
            self.report_progress("update", done, total, unit="micro-batches", step=self.step + 1)

        return tick

    def _advance_schedule(self) -> None:
        """One LR-scheduler step per update (also one that took no optimizer step: the schedule counts updates)."""
        import warnings

        with warnings.catch_warnings():  # torch warns if the first scheduler step has no optimizer step before it
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)`")
            self.scheduler.step()

    def _step_metrics(self, triplets: Sequence[Triplet], batch: _Batch, stats: dict[str, float], seconds: float,
                      lr: float, changes: list[str]) -> dict[str, Any]:
        """The metrics row of one update (see :meth:`update`)."""
        steps, tokens = int(stats.pop("optimizer_steps")), stats.pop("tokens")
        tis_weight, grad_norm = stats.pop("tis_weight"), stats.pop("grad_norm")
        trained = [s for s in batch.seqs if s.trained]
        if not steps:  # nothing was forwarded, so nothing was measured
            stats = {k: math.nan for k in stats}
        else:  # means over the optimizer steps, and over the forwarded tokens
            for k in ("loss", "pg_loss"):
                stats[k] = stats[k] / steps
            for k in ("kl", "ppo_kl", "pg_clipfrac"):
                stats[k] = stats[k] / max(tokens, 1)
        kept_rewards = [batch.rewards[r] for r in batch.advantages]
        groups = batch.groups
        signal = {groups[r] for r, advs in batch.turn_advantages.items() if any(a != 0.0 for a in advs.values())}
        metrics: dict[str, Any] = {"step": self.step, **stats}
        metrics.update({
            "reward_mean": _mean(kept_rewards), "reward_std": _std(kept_rewards),
            "episodes": len(batch.advantages), "groups": len({groups[r] for r in batch.advantages}),
            "groups_with_signal": len(signal), "groups_dropped": len(batch.dropped),
            "episodes_dropped": sum(batch.dropped.values()), "transitions": len(triplets),
            "stale_episodes_dropped": len(batch.stale), "staleness_max": max(batch.staleness.values(), default=0),
            "sequences_trained": len(trained), "tokens_trained": sum(sum(s.mask) for s in trained),
            "grad_norm": grad_norm / steps if steps else 0.0, "update_seconds": seconds,
            "tokens_per_s": sum(len(s.input_ids) for s in trained) / seconds if seconds > 0 else 0.0,
            "lr": lr, "optimizer_steps": steps,
            "tis_weight_mean": tis_weight / tokens if self.config.tis_cap is not None and tokens else math.nan,
            "turn_forks": batch.forks, "truncated_responses": sum(1 for t in triplets if t.finish_reason == "length"),
            "intermediate_rewards": sum(1 for t in triplets if t.step_reward != 0.0),
            "config_changes": "; ".join(changes),
        })
        return metrics

    def signal_groups(self, triplets: Sequence[Triplet]) -> set[str]:
        """Group ids of ``triplets`` that :meth:`update` would learn from: kept groups with a non-zero advantage.

        The same rule as :meth:`update` (:meth:`_advantages` with this config: ``credit``, intermediate
        rewards, the soft overlong penalty), so the algorithm's ``groups_with_signal`` counts exactly
        what the trainer can use; a group has signal when any of its turns has a non-zero advantage.
        Only the KL penalty of ``kl_mode="reward"`` is left out (it needs a forward pass); it rarely
        makes a group's rewards all equal or unequal.
        """
        episodes: dict[str, list[Triplet]] = {}
        for t in triplets:
            episodes.setdefault(t.rollout_id, []).append(t)
        groups = {r: ts[0].group_id for r, ts in episodes.items()}
        _, by_turn, _ = self._advantages(episodes, groups)
        return {groups[r] for r, advs in by_turn.items() if any(a != 0.0 for a in advs.values())}

    def _check_batch(self, triplets: Sequence[Triplet]) -> None:
        if not triplets:
            raise ConfigError("update() got no triplets; check that rollouts succeeded and emitted rewards")
        bad = [t.rollout_id for t in triplets if not t.response_ids]
        if bad:
            raise ConfigError(f"triplets of rollouts {bad[:3]} have empty response_ids; drop them before update()")
        truncated = [t.rollout_id for t in triplets if t.top_p < 1.0]
        if truncated:
            raise ConfigError(
                f"triplets of rollouts {truncated[:3]} were sampled with top_p < 1; the engine's log-probs are of "
                "the untruncated distribution, so the PPO ratio would be wrong: sample training rollouts with "
                "top_p=1 (the default; do not pass top_p in the agent's training calls)")

    def _inputs(self, micro: list[_Sequence]) -> tuple[int, Any, Any, Any, Any, Any]:
        """``(T, device, ids_B_T, attn_B_T, mask_B_L, temp_B)`` of a micro-batch, right-padded to its longest T."""
        import torch

        T = max(len(s.input_ids) for s in micro)
        pad = self.engine.pad_token_id
        device = next(self.model.parameters()).device
        ids_B_T = torch.tensor([s.input_ids + [pad] * (T - len(s.input_ids)) for s in micro], device=device)
        attn_B_T = torch.tensor([[1] * len(s.input_ids) + [0] * (T - len(s.input_ids)) for s in micro], device=device)
        # targets are tokens 1..T-1; position t of the *_B_L tensors scores token t+1
        mask_B_L = _shift_pad([s.mask for s in micro], T, device)
        temp_B = torch.tensor([s.temperature if s.temperature > 0 else 1.0 for s in micro], device=device)
        return T, device, ids_B_T, attn_B_T, mask_B_L, temp_B

    def _score_at_start(self, seqs: list[_Sequence], core_algos: Any, tick: Optional[Callable[[], None]] = None,
                        with_reference: bool = False) -> None:
        """Record π_start, the log-probs of ``seqs`` under the weights before any step of this update, without grad.

        Sets each sequence's ``trainer_logprobs``; ``with_reference`` also sets ``kl_sum``,
        the ``kl_penalty`` estimator to the reference summed over its response tokens. ``tick()`` is
        called after each micro-batch.
        """
        import torch

        with torch.no_grad():
            for i in range(0, len(seqs), self.config.micro_batch_size):
                micro = seqs[i: i + self.config.micro_batch_size]
                _, _, ids_B_T, attn_B_T, mask_B_L, temp_B = self._inputs(micro)
                logp_B_L = response_logprobs(self.model, ids_B_T, attn_B_T, mask_B_L, temp_B)
                if with_reference:
                    ref_B_L = self._reference_logprobs(ids_B_T, attn_B_T, mask_B_L, temp_B)
                    kl_B = (core_algos.kl_penalty(logp_B_L, ref_B_L, self.config.kl_penalty) * mask_B_L).sum(-1)
                for b, s in enumerate(micro):
                    s.trainer_logprobs = [0.0] + logp_B_L[b, : len(s.input_ids) - 1].tolist()
                    if with_reference:
                        s.kl_sum = float(kl_B[b])
                if tick is not None:
                    tick()

    def _reference_active(self) -> bool:
        """Whether the update measures KL to the reference (a kept copy, or with LoRA the base model when
        ``track_reference_kl`` or ``kl_coef > 0``)."""
        if self.peft_model is not None:
            return self.config.track_reference_kl or self.config.kl_coef > 0
        return self.reference is not None

    def _reference_logprobs(self, ids_B_T: Any, attn_B_T: Any, mask_B_L: Any, temp_B: Any) -> Any:
        """Log-probs (B, T-1) under the reference policy, without grad (see :func:`response_logprobs`).

        With LoRA that is the model itself with its adapters disabled (peft's ``disable_adapter``;
        the engine lock held by :meth:`update` keeps the engine from generating meanwhile).
        """
        import torch

        with torch.no_grad():
            if self.peft_model is None:
                return response_logprobs(self.reference, ids_B_T, attn_B_T, mask_B_L, temp_B)
            with self.peft_model.disable_adapter():
                return response_logprobs(self.model, ids_B_T, attn_B_T, mask_B_L, temp_B)

    def _micro_step(self, micro: list[_Sequence], view: _VerlActorView, core_algos: Any) -> dict:
        """Forward/backward one micro-batch; returns its token-weighted sums of the step's metrics.

        π_start is this forward's log-probs, detached, when the update takes one optimizer
        step (and records them in ``trainer_logprobs``), else what :meth:`_score_at_start` recorded.
        """
        import torch
        from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_weights

        cfg = self.config
        T, device, ids_B_T, attn_B_T, mask_B_L, temp_B = self._inputs(micro)
        adv_B_L = _shift_pad([s.token_advantages for s in micro], T, device) * mask_B_L  # per token: turns differ
        logp_B_L = response_logprobs(self.model, ids_B_T, attn_B_T, mask_B_L, temp_B)
        if micro[0].trainer_logprobs is None:  # no step yet in this update: this forward is π_start
            start_B_L = logp_B_L.detach()
            for b, s in enumerate(micro):
                s.trainer_logprobs = [0.0] + start_B_L[b, : len(s.input_ids) - 1].tolist()
        else:
            start_B_L = _shift_pad([s.trainer_logprobs for s in micro], T, device)
        has_old_B = torch.tensor([s.has_old for s in micro], device=device)[:, None]
        engine_B_L = torch.where(has_old_B, _shift_pad([s.old_logprobs for s in micro], T, device), start_B_L)
        old_B_L, is_B_L = engine_B_L, None
        if cfg.tis_cap is not None:  # PPO against π_start; π_start/π_engine, capped, weighs each token
            old_B_L = start_B_L
            is_B_L, _ = compute_rollout_correction_weights(start_B_L - engine_B_L, mask_B_L, rollout_is="token",
                                                           rollout_is_threshold=cfg.tis_cap)
        pg_loss, pg_metrics = core_algos.compute_policy_loss_vanilla(
            old_log_prob=old_B_L, log_prob=logp_B_L, advantages=adv_B_L, response_mask=mask_B_L,
            loss_agg_mode=view.loss_agg_mode, config=view, rollout_is_weights=is_B_L)
        loss = pg_loss
        tokens = float(mask_B_L.sum())
        kl_sum = 0.0
        if self._reference_active():
            ref_B_L = self._reference_logprobs(ids_B_T, attn_B_T, mask_B_L, temp_B)
            kl_B_L = core_algos.kl_penalty(logp_B_L, ref_B_L, cfg.kl_penalty)
            if cfg.kl_coef > 0 and cfg.kl_mode == "loss":
                loss = loss + cfg.kl_coef * core_algos.agg_loss(
                    kl_B_L, mask_B_L, view.loss_agg_mode, **view.global_batch_info)
            kl_sum = float((kl_B_L.detach() * mask_B_L).sum())
        loss.backward()
        diff_B_L = (start_B_L - engine_B_L).abs() * mask_B_L * has_old_B
        return {"loss": float(loss.detach()), "pg_loss": float(pg_loss.detach()), "kl": kl_sum,
                "ppo_kl": pg_metrics["actor/ppo_kl"] * tokens, "pg_clipfrac": pg_metrics["actor/pg_clipfrac"] * tokens,
                "tis_weight": float((is_B_L * mask_B_L).sum()) if is_B_L is not None else 0.0, "tokens": tokens,
                "logprob_diff_max": float(diff_B_L.max())}

    # ----- config edits while paused ----------------------------------------------------
    def _sync_config(self) -> list[str]:
        """Apply edits of :attr:`config` since the last update (lock held); returns them as text.

        ``learning_rate`` and ``weight_decay`` go into the optimizer's param groups; every
        other field is read at each update. Each edit is appended to :attr:`config_changes`.

        With a schedule, ``learning_rate`` is its peak: the update after ``s`` updates uses
        ``learning_rate × lr_factor(s)`` (:func:`lr_factor`) with the config as it is now. So an
        edit of ``learning_rate`` rescales the rest of the schedule (it does not restart the
        warmup), and edits of ``lr_scheduler``, ``warmup_steps`` or ``total_steps`` reshape it
        from the current update count on.

        Raises:
            ConfigError: the edited config is invalid, or ``kl_coef > 0`` without a reference model.
        """
        self._check_config()
        now = asdict(self.config)
        cfg, done = self.config, self.scheduler.last_epoch  # updates done so far
        if cfg.lr_scheduler != "constant" and done == cfg.total_steps:
            log.warning("the %s LR schedule ended after total_steps=%d updates: the learning rate is 0 from now "
                        "on; raise GRPOConfig.total_steps to keep training", cfg.lr_scheduler, cfg.total_steps)
        self.scheduler.base_lrs = [cfg.learning_rate] * len(self.optimizer.param_groups)
        for group in self.optimizer.param_groups:
            group["initial_lr"] = cfg.learning_rate
            group["lr"] = cfg.learning_rate * lr_factor(done, cfg)
            group["weight_decay"] = cfg.weight_decay
        edits = config_edits(self._applied_config, now)
        for k, old, new, text in edits:
            self.config_changes.append({"step": self.step + 1, "field": k, "old": old, "new": new})
            log.info("config changed at step %d: %s", self.step + 1, text)
        self._applied_config = now
        return [text for *_, text in edits]

    def _check_config(self) -> None:
        self.config.validate()
        for name, built in self._placement.items():
            if getattr(self.config, name) != built:
                raise ConfigError(
                    f"GRPOConfig.{name} was {built!r} when this trainer was built and is now "
                    f"{getattr(self.config, name)!r}; it is set at construction: set it back, or save() and "
                    f"build a new GRPOTrainer with GRPOConfig({name}={getattr(self.config, name)!r}), then load()")
        if self.config.kl_coef > 0 and self.reference is None and self.peft_model is None:
            raise ConfigError(
                f"GRPOConfig.kl_coef={self.config.kl_coef} needs a reference model, and this trainer was built "
                "with kl_coef=0 and track_reference_kl=False, so it kept none; set kl_coef back to 0, or build "
                "the trainer with GRPOConfig(track_reference_kl=True) (and load() a checkpoint to continue)")

    def _check_before_resume(self) -> None:
        self._check_config()
        if self.algorithm is not None:
            self.algorithm.config.validate()

    # ----- background loop --------------------------------------------------------------
    def attach(self, algorithm: "LightningRL") -> None:
        """Make ``algorithm`` the one whose state :meth:`save` and :meth:`load` carry (LightningRL calls this)."""
        self.algorithm = algorithm
        if self._pending_algorithm_state is not None:
            algorithm.load_state_dict(self._pending_algorithm_state)
            self._pending_algorithm_state = None

    def start(self, algorithm: "LightningRL", steps: Optional[int] = None) -> "GRPOTrainer":
        """Run ``algorithm.run(steps)`` in a background thread and return at once.

        Raises:
            LightningNbError: a loop started earlier is still running (even if a wait() was interrupted).
            ConfigError: ``algorithm`` was built with another trainer.
        """
        if getattr(algorithm, "trainer", self) is not self:
            raise ConfigError("algorithm.trainer is a different trainer; build the algorithm with this trainer")
        n = steps if steps is not None else getattr(getattr(algorithm, "config", None), "steps", None)
        self._start_loop(lambda: algorithm.run(steps), self.step, None if n is None else self.step + n)
        return self

    # ----- inspection -------------------------------------------------------------------
    def add_metrics(self, step: int, **values: Any) -> None:
        """Attach values (e.g. val_reward, step_seconds) to the metrics row of ``step``.

        When the attached algorithm's loggers already logged that row, the values are
        logged at its step too (:meth:`LightningRL.metrics_added`).
        """
        for row in self.metrics:
            if row["step"] == step:
                row.update(values)
                break
        else:
            self.metrics.append({"step": step, **values})
        if self.algorithm is not None:
            self.algorithm.metrics_added(step, values)

    def metrics_df(self) -> pd.DataFrame:
        """One row per training step (see :meth:`update` and :meth:`LightningRL.step` for the columns)."""
        return pd.DataFrame(self.metrics)

    def last_batch_df(self) -> pd.DataFrame:
        """The optimizer's-eye view of the last update: one row per packed sequence in the loss.

        Columns (:func:`lightning_nb.audit.batch_df`): ``rollout_id``, ``group_id``,
        ``advantage``, ``tokens``, ``response_tokens``, ``mean_ratio``,
        ``max_abs_logprob_diff`` (nats), ``response_text``. The triplets themselves, one row
        per LLM call: ``lightning_nb.adapter.triplets_df(trainer.last_triplets, trainer.last_turn_advantages)``.
        """
        from lightning_nb.audit import batch_df  # audit imports this module

        return batch_df(self.last_batch, self.engine.tokenizer)

    def last_batch_html(self, max_rows: int = 16) -> str:
        """The last update's sequences token by token, shaded by response mask and coloured by advantage,
        with engine and trainer log-probs and the ratio on hover (:func:`lightning_nb.audit.batch_html`).
        Show it with ``IPython.display.HTML(trainer.last_batch_html())``."""
        from lightning_nb.audit import batch_html

        clip = self.config.clip_ratio_high if self.config.clip_ratio_high is not None else self.config.clip_ratio
        return batch_html(self.last_batch, self.engine.tokenizer, max_rows=max_rows, clip_ratio=clip)

    def _repr_html_(self) -> str:
        from lightning_nb._repr import trainer_html

        return trainer_html(self)

    # ----- checkpoints ------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        """Write everything a continued run needs to ``path`` (a file, written atomically). Returns the path.

        The checkpoint holds: model weights, optimizer and LR-scheduler state; the torch, numpy and
        Python RNG states; the step, metrics, config edits and config; the attached
        algorithm's state (task sampler RNG, ``val_history``: :meth:`LightningRL.state_dict`);
        the weight version; the store's latest resources id; the reference model's
        weights fingerprint and how to rebuild it (the initial weights of the default
        model); a model signature. It loads with ``torch.load(weights_only=True)``.
        Call it at a step boundary (paused, or after ``wait()``); it takes the update lock. Paused inside a
        step before its update (``between sample rounds``, ``before update``), the checkpoint is of the
        step before, with the algorithm's and RNG states from the start of the paused step
        (:meth:`LightningRL.checkpoint_state`), so a continued run redoes that step as this one does.
        Size: weights + 2 × weights for AdamW (about 1.6 GB for SmolLM2-135M in float32). With LoRA
        (``lora_rank > 0``) it holds the adapters and their AdamW state instead of the weights (about
        60 MB for SmolLM2-135M at rank 32), and a fingerprint of the frozen base weights, which
        :meth:`load` checks.

        Raises:
            ConfigError: the loop is paused ``before evaluate`` (the step updated the weights, its
                evaluation and metrics are not done): resume and save at the next pause.
        """
        import torch

        from lightning_nb import __version__

        path = Path(path)
        if self.paused_at == "before evaluate":
            raise ConfigError(f"trainer.save(): the loop is paused before step {self.step}'s evaluation, after its "
                              "update; its metrics row and evaluation are not done yet, so a run continued from "
                              "a checkpoint now would differ from this one. trainer.resume() and save at the next "
                              "pause, or after trainer.wait()")
        path.parent.mkdir(parents=True, exist_ok=True)
        with self._updating, self.engine.lock:
            store = getattr(self.algorithm, "store", None)
            algorithm_state, rng = None, None
            if self.algorithm is not None:
                algorithm_state, rng = (self.algorithm.checkpoint_state() if hasattr(self.algorithm, "checkpoint_state")
                                        else (self.algorithm.state_dict(), None))
            latest = store.get_latest_resources() if store is not None else None
            state = {
                "format": CHECKPOINT_FORMAT, "lightning_nb_version": __version__,
                "model_signature": model_signature(self.model),
                "model": self.model.state_dict() if self.peft_model is None else adapter_state_dict(self.model),
                "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "step": self.step, "metrics": plain(self.metrics),
                "config": asdict(self.config), "config_changes": plain(self.config_changes),
                "weight_version": self.engine.weight_version, "rng": rng if rng is not None else rng_state(),
                "reference": None if self.reference is None else {
                    "fingerprint": weights_fingerprint(self.reference),
                    "source": getattr(self.engine, "model_source", None)},
                "lora_base": None if self.peft_model is None else {"fingerprint": self._base_fingerprint()},
                "algorithm": plain(algorithm_state) if algorithm_state is not None else None,
                "resources_id": latest.resources_id if latest is not None else None,
            }
            tmp = path.with_suffix(path.suffix + ".tmp")
            torch.save(state, tmp)
            tmp.replace(path)
        return path

    def load(self, path: str | Path, *, keep_config: bool = False) -> None:
        """Restore a :meth:`save` checkpoint into this trainer, its engine's model and its algorithm.

        The algorithm's state is applied to the attached algorithm, or to the next one built
        with this trainer. The RNG states are restored too, so the continued run samples
        what the uninterrupted run would have. ``resources_id`` of the checkpoint is kept in
        :attr:`checkpoint_resources_id` (the proxy URL of a new process differs: publish the
        new one with ``store.add_resources``).

        The config: by default :attr:`config` takes the checkpoint's values (edits made while
        paused before the save included), so the run continues as it was; each field this
        replaces is logged as a warning. Fields fixed at construction (``device``, ``dtype``,
        ``gradient_checkpointing``, ``lora_*``) stay this trainer's. ``keep_config=True`` keeps
        this trainer's config instead (as verl and TRL do on resume): the fields that differ from
        the checkpoint's are applied at the next update and recorded in :attr:`config_changes`
        and the ``config_changes`` metric, like edits made while paused. Edit :attr:`config`
        after ``load()`` to change anything further.

        Raises:
            FileNotFoundError: ``path`` does not exist.
            ConfigError: the file is not a lightning-nb GRPO checkpoint of this format, was
                saved from another model, or its reference model differs from this trainer's
                and cannot be rebuilt.
        """
        import torch

        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"checkpoint {path} not found; write one with trainer.save(path)")
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:
            raise ConfigError(f"{path} is not a lightning-nb checkpoint that loads with weights_only=True "
                              f"({type(exc).__name__}: {str(exc)[:200]}); write one with trainer.save(path)") from exc
        if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
            found = state.get("format", "no format tag") if isinstance(state, dict) else type(state).__name__
            raise ConfigError(f"checkpoint {path} has format {found!r}, this version reads {CHECKPOINT_FORMAT!r}; "
                              "save it again with this version's trainer.save()")
        self._check_lora_matches(state, path)
        check_signature(state["model_signature"], self.model, path)
        saved_config = self._saved_config(state.get("config") or {}, path, check=not keep_config)
        with self._updating, self.engine.lock:
            self._restore_reference(state.get("reference"), path)
            if self.peft_model is None:
                self.model.load_state_dict(state["model"])
            else:  # the adapters only; the base must be the one they were trained on
                if not torch.equal(self._base_fingerprint(), state["lora_base"]["fingerprint"]):
                    raise ConfigError(
                        f"checkpoint {path} holds LoRA adapters trained on other base weights than this "
                        "trainer's model; build the engine on the same base model as the run that saved it")
                self.model.load_state_dict(state["model"], strict=False)
            self.optimizer.load_state_dict(state["optimizer"])
            self.step = int(state["step"])
            if state.get("scheduler") is not None:
                self.scheduler.load_state_dict(state["scheduler"])
            else:  # a checkpoint from before LR schedules: the schedule counts updates
                self.scheduler.last_epoch = self.step
            self.metrics = list(state["metrics"])
            self.config_changes = list(state.get("config_changes", []))
            self.engine.load_weights(self.model, version=int(state["weight_version"]))
            self.checkpoint_resources_id = state.get("resources_id")
            set_rng_state(state["rng"])
            if keep_config:  # the next update applies (and records) this trainer's values over the checkpoint's
                self._applied_config = {**asdict(self.config), **saved_config}
            else:
                for name, value in saved_config.items():
                    if getattr(self.config, name) != value:
                        log.warning("trainer.load: config.%s = %r from the checkpoint (was %r here); pass "
                                    "keep_config=True to keep this trainer's value", name, value,
                                    getattr(self.config, name))
                        setattr(self.config, name, value)
                self._applied_config = asdict(self.config)
        if state.get("algorithm") is not None:
            if self.algorithm is not None:
                self.algorithm.load_state_dict(state["algorithm"])
            else:
                self._pending_algorithm_state = state["algorithm"]

    def _saved_config(self, saved: dict[str, Any], path: Path, check: bool = True) -> dict[str, Any]:
        """The checkpoint's GRPOConfig fields that :meth:`load` may apply (all but those fixed at construction,
        and fields this version does not know), checked to form a valid config before anything is loaded."""
        from dataclasses import fields, replace

        known = {f.name for f in fields(type(self.config))} - set(self._placement)  # a subclass's fields too
        out = {k: v for k, v in saved.items() if k in known}
        if not check:
            return out
        try:
            replace(self.config, **out)
        except ConfigError as exc:
            raise ConfigError(f"checkpoint {path} holds a config this version refuses ({exc}); load it with "
                              "keep_config=True to train on with this trainer's config") from None
        return out

    def _base_fingerprint(self) -> Any:
        """Per-tensor float64 sums of the frozen base weights of a LoRA model (see ``weights_fingerprint``)."""
        import torch

        with torch.no_grad():
            return torch.stack([t.detach().to("cpu", torch.float64).sum() for t in base_state_dict(self.model).values()])

    def _check_lora_matches(self, state: dict[str, Any], path: Path) -> None:
        """Raise ConfigError when the checkpoint and this trainer disagree on LoRA (before the signature check,
        whose message would only name a parameter)."""
        saved = {k: state.get("config", {}).get(k, d) for k, d in (("lora_rank", 0), ("lora_alpha", 32.0),
                                                                  ("lora_target_modules", "all-linear"))}
        mine = {k: getattr(self.config, k) for k in saved}
        if saved["lora_rank"] == 0 and mine["lora_rank"] == 0:
            return
        if saved != mine:
            diff = ", ".join(f"{k}={saved[k]!r}" for k in saved if saved[k] != mine[k])
            raise ConfigError(f"checkpoint {path} was saved by a trainer with {diff}; this trainer has "
                              + ", ".join(f"{k}={mine[k]!r}" for k in saved if saved[k] != mine[k])
                              + ": build the trainer with the checkpoint's values (GRPOConfig(" + diff + "))")

    def save_pretrained(self, path: str | Path, *, merged: bool = True) -> Path:
        """Export the trained policy as a folder that transformers and vLLM load. Returns ``path``.

        * ``merged=True`` (the default): a Hugging Face model folder (:func:`lightning_nb.weights.write_hf_folder`:
          ``model.safetensors``, ``config.json``, the tokenizer and a ``generation_config.json``
          with the engine's stop tokens). With LoRA the adapters are merged into the weights
          (``W + (alpha / r) B A``). Load it with ``AutoModelForCausalLM.from_pretrained(path)``,
          ``TransformersEngine.from_pretrained(path)``, or ``vllm serve path``.
        * ``merged=False`` (LoRA only): the adapter as peft writes it (``adapter_config.json``,
          ``adapter_model.safetensors``, a few MB). Load it with
          ``peft.PeftModel.from_pretrained(base_model, path)``, or serve it with vLLM as
          ``vllm serve BASE --enable-lora --lora-modules NAME=path``.

        Call it at a step boundary (paused, or after ``wait()``); it takes the update lock.

        Raises:
            ConfigError: ``merged=False`` for a trainer without LoRA (``lora_rank=0``).
        """
        if not merged and self.peft_model is None:
            raise ConfigError("save_pretrained(merged=False) writes a LoRA adapter, and this trainer trains the full "
                              "weights (GRPOConfig.lora_rank=0); use merged=True")
        path = Path(path)
        with self._updating, self.engine.lock:
            if not merged:
                self.peft_model.save_pretrained(str(path), save_embedding_layers=False)
                return path
            return write_hf_folder(self.model, self.engine.tokenizer, path,
                                   stop_token_ids=self.engine.stop_token_ids, pad_token_id=self.engine.pad_token_id)

    def _restore_reference(self, saved: Optional[dict[str, Any]], path: Path) -> None:
        """Make this trainer's reference model the one the checkpoint was trained against."""
        if saved is None or self.reference is None:
            return
        import torch

        if torch.equal(weights_fingerprint(self.reference), saved["fingerprint"]):
            return
        if saved.get("source") == "default":  # rebuild the initial weights of the default model
            from lightning_nb.engine import load_default_model

            rebuilt, _ = load_default_model(device=self.config.device, dtype=self.config.dtype)
            rebuilt = rebuilt.eval().requires_grad_(False)
            if torch.equal(weights_fingerprint(rebuilt), saved["fingerprint"]):
                self.reference = rebuilt
                return
        raise ConfigError(
            f"checkpoint {path} was trained against a reference model (the initial weights) that differs from "
            "this trainer's, and it cannot be rebuilt; build this trainer on the same starting weights as the "
            "run that saved it, or use GRPOConfig(track_reference_kl=False, kl_coef=0)")


def _micro_batches(seqs: Sequence[Any], size: int) -> int:
    """Micro-batches of ``size`` that ``seqs`` make (the last may be smaller)."""
    return -(-len(seqs) // size)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def _std(values: Sequence[float]) -> float:
    if len(values) < 2:
        return 0.0 if values else math.nan
    m = _mean(values)
    return math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))


def response_logprobs(model: Any, ids_B_T: Any, attn_B_T: Any, mask_B_L: Any, temp_B: Any) -> Any:
    """Log-probs (B, T-1) of tokens 1..T-1 under ``model`` at masked positions (0 elsewhere).

    Goes through the model's own ``forward`` (so logit scaling or soft-capping a model
    applies is kept), asking it only for the logits from the first masked position on
    (``logits_to_keep``): the vocabulary (49,152) makes the LM head the costliest layer
    for prompt positions that are never scored. Logits are divided by ``temp_B`` (B,),
    the sampling temperature of each sequence.
    """
    import torch

    L = mask_B_L.shape[1]
    cols = mask_B_L.any(dim=0).nonzero()
    first = int(cols[0]) if len(cols) else L - 1
    keep = L + 1 - first  # positions first..T-1 (T = L + 1); the last one predicts nothing
    logits_B_K_V = model(input_ids=ids_B_T, attention_mask=attn_B_T, logits_to_keep=keep).logits
    logits_B_K_V = logits_B_K_V[:, :-1].float() / temp_B[:, None, None]
    sel_B_K = mask_B_L[:, first:].bool()
    target_N = ids_B_T[:, 1:][:, first:][sel_B_K]
    logp_N = torch.log_softmax(logits_B_K_V[sel_B_K], dim=-1).gather(-1, target_N[:, None]).squeeze(-1)
    out_B_L = torch.zeros(mask_B_L.shape, dtype=logp_N.dtype, device=logp_N.device)
    out_B_L[:, first:][sel_B_K] = logp_N
    return out_B_L
