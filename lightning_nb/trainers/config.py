"""``TrainerConfig``: the hyper-parameters both trainers share, validated on construction; and :func:`lr_factor`,
the learning-rate schedule they describe.

:class:`~lightning_nb.trainers.grpo.config.GRPOConfig` (for ``GRPOTrainer``) and
:class:`~lightning_nb.trainers.verl.config.VerlConfig` (for ``VerlTrainer``) are its two subclasses, side by
side: the same field names (one name per concept), each with its trainer's defaults and refusals. What both
trainers read (the shared batch builder :func:`~lightning_nb.trainers.batch.build_batch`, the in-place weights
side :class:`~lightning_nb.trainers.inplace.InPlaceTrainer`) types against this class.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Union

from lightning_nb.errors import ConfigError
from lightning_nb.models.device import check_device, check_dtype

__all__ = ["TrainerConfig", "lr_factor", "BF16_TIS_CAP", "DEVICE_DEFAULT", "DTYPE_DEFAULT", "KL_EVERY_DEFAULT"]


class _DeviceDefault:
    """The default of ``micro_batch_tokens`` before construction resolves it: 'auto' on CUDA, None on CPU."""

    def __repr__(self) -> str:
        return "'auto' on CUDA, None on CPU"


#: Placeholder default of ``micro_batch_tokens``; ``GRPOConfig`` and ``VerlConfig`` replace it on construction by
#: the device's default.
DEVICE_DEFAULT = _DeviceDefault()


class _DtypeDefault:
    """The default of ``tis_cap`` before construction resolves it: BF16_TIS_CAP in bfloat16, else None."""

    def __repr__(self) -> str:
        return f"{BF16_TIS_CAP} in bfloat16, None in float32"


#: Placeholder default of ``tis_cap``; ``GRPOConfig`` and ``VerlConfig`` replace it on construction by the dtype's
#: default.
DTYPE_DEFAULT = _DtypeDefault()

#: ``tis_cap`` in bfloat16 unless set: engine and trainer log-probs of the same tokens differ there even with
#: float32 LM heads on both sides (measured on CPU, SmolLM2-135M: p99 0.15-0.21 nats, max 0.29; issue 29; on an
#: H200 through verl: 0.5-1.0 nats per step, issue 42).
BF16_TIS_CAP = 2.0


#: ``kl_every`` unless set: with ``track_reference_kl`` KL is measured on every fourth update (a reference forward
#: costs about a quarter of an update on CPU, so measuring it costs ~6% of the update time in all).
KL_EVERY_DEFAULT = 4


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class TrainerConfig:
    """Hyper-parameters of the update, shared by both trainers. Validated on construction and again on
    ``algo.resume()``.

    Build a :class:`~lightning_nb.trainers.grpo.config.GRPOConfig` or a
    :class:`~lightning_nb.trainers.verl.config.VerlConfig`: they take these fields (the help texts and
    the messages name them ``GRPOConfig.<field>``, the vocabulary both trainers share) with their own
    trainer's defaults. Fields may be edited while the trainer is paused; the edit takes effect at the next
    update and is recorded in the metrics (``config_changes``, and the algorithm's ``config_changes``).
    """

    learning_rate: float = field(default=2e-5, metadata={
        "help": "AdamW learning rate (2e-5 suits SmolLM2-135M: 5e-5 drifted, KL to the initial weights > 0.6 "
                "within 12 steps; use ~1e-6 for 1B+ models)."})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay."})
    max_grad_norm: float = field(default=1.0, metadata={"help": "Clip the global gradient norm to this value."})
    clip_ratio: float = field(default=0.2, metadata={"help": "PPO clip range epsilon for the importance ratio."})
    kl_coef: float = field(default=0.0, metadata={
        "help": "Weight of the KL-to-reference loss; 0 disables it. > 0 needs the reference model (kept when "
                "kl_coef > 0 or track_reference_kl is set at construction), scored on every micro-batch of every "
                "update, and the kl metric is then reported on every update."})
    kl_penalty: str = field(default="low_var_kl", metadata={"help": "verl KL estimator: kl, abs, mse, low_var_kl."})
    track_reference_kl: bool = field(default=False, metadata={
        "help": "Measure KL to the reference policy (the initial weights; with LoRA the base model, adapters "
                "disabled) as the kl metric while kl_coef == 0, on every kl_every-th update. Keeps a frozen copy of "
                "the initial weights (a second copy in memory; none with LoRA) and runs it over the update's "
                "sequences on those updates (one more forward: about a quarter of an update's time on CPU). False "
                "(the default since issue 49; True before): no reference model unless kl_coef > 0, and kl is NaN "
                "while kl_coef == 0. Set at construction."})
    kl_every: int = field(default=KL_EVERY_DEFAULT, metadata={
        "help": "With track_reference_kl and kl_coef == 0: KL is measured on the updates whose metrics row has a "
                "step that is a multiple of kl_every (1 = every update), and kl is NaN on the others. With "
                "kl_coef > 0 the KL term needs the reference on every update, so kl is reported on every update. "
                f"Any value but the default ({KL_EVERY_DEFAULT}) needs track_reference_kl=True."})
    norm_adv_by_std: bool = field(default=True, metadata={"help": "Deprecated: the algorithm's option now, AlgorithmConfig.norm_adv_by_std (set here, it is forwarded there with a DeprecationWarning for one release; the trainer trains on the advantages the algorithm gives). Divide group-relative advantages by the group std."})
    credit: str = field(default="episode", metadata={
        "help": "Deprecated: the algorithm's option now, AlgorithmConfig.credit (set here, it is forwarded there with a DeprecationWarning for one release; the trainer trains on the advantages the algorithm gives). How rewards become per-turn credit (Triplet.reward = final reward R, Triplet.step_reward = s_t, the "
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
        "help": "Deprecated: the algorithm's option now, AlgorithmConfig.gamma (set here, it is forwarded there with a DeprecationWarning for one release; the trainer trains on the advantages the algorithm gives). Discount γ in (0, 1] of credit='reward_to_go' per turn (LLM call), not per token; 1 = undiscounted. "
                "credit='episode' refuses any other value."})
    min_group_size: int = field(default=2, metadata={
        "help": "Deprecated: the algorithm's option now, AlgorithmConfig.min_group_size (set here, it is forwarded there with a DeprecationWarning for one release; the trainer trains on the advantages the algorithm gives). Groups with fewer episodes than this (after failures, timeouts and adapter skips) are dropped "
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
                "micro-batches (micro_batch_tokens, micro_batch_size) accumulate gradients, and the loss is "
                "normalized per mini-batch, so accumulation does not change the step."})
    lr_scheduler: str = field(default="constant", metadata={
        "help": "Learning-rate schedule over update() calls, after warmup_steps of linear warmup: constant, "
                "linear (to 0 at total_steps) or cosine (to 0 at total_steps). See lightning_nb.trainers.config.lr_factor."})
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
        "help": "Deprecated: the algorithm's option now, AlgorithmConfig.overlong_buffer_len (set here, it is forwarded there with a DeprecationWarning for one release; the trainer trains on the advantages the algorithm gives). L_cache of DAPO's soft overlong punishment: responses longer than max_response_len − "
                "overlong_buffer_len lose up to overlong_penalty_factor of reward, linearly. 0 = off."})
    overlong_penalty_factor: float = field(default=1.0, metadata={
        "help": "Deprecated: the algorithm's option now, AlgorithmConfig.overlong_penalty_factor (set here, it is forwarded there with a DeprecationWarning for one release; the trainer trains on the advantages the algorithm gives). Largest soft overlong penalty (reward units), reached at max_response_len tokens."})
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
    micro_batch_size: Optional[int] = field(default=None, metadata={
        "help": "Rows (sequences) per forward/backward. Without a token budget (micro_batch_tokens=None): "
                "micro-batches of this many rows in batch order, 4 when None. With a token budget: a cap on the "
                "rows of a micro-batch on top of it (None: no cap). Either way the step does not change, only "
                "memory and speed (the loss is normalized per mini-batch)."})
    micro_batch_tokens: Optional[Union[int, str]] = field(default=None, metadata={
        "help": "Token budget of one forward/backward (verl's use_dynamic_bsz with ppo_max_token_len_per_gpu): "
                "an int >= 1, 'auto' (chosen from free device memory, lightning_nb.trainers.microbatch."
                "auto_micro_batch_tokens) or None (fixed micro-batches of micro_batch_size rows)."})
    pack_turns: bool = field(default=True, metadata={
        "help": "Pack an episode's turns into one sequence when each prompt extends the previous turn."})
    skip_zero_advantage: bool = field(default=True, metadata={
        "help": "Skip the forward/backward of sequences whose advantage is 0 on every trained token when kl_coef == 0 "
                "(their gradient is exactly 0); they still count in the loss denominator, so the step size is "
                "unchanged."})
    prefix_tree: bool = field(default=True, metadata={
        "help": "Forward each micro-batch's sequences as a prefix tree (lightning_nb.trainers.prefix_tree): a "
                "token that several sequences share at the same position, after the same tokens, is forwarded "
                "and backpropagated once (the batch's system prompt, a group's prompt, an episode's shared "
                "turns), under a tree attention mask; the same log-probs and gradients as padded rows (float32: "
                "within 1e-5). The token budget (micro_batch_tokens) then counts the tree's nodes. Reported per "
                "update as prefix_shared_tokens and forwarded_tokens. Needs an attention implementation that "
                "takes a dense 4-D mask (sdpa, the default, or eager); with another the update forwards padded "
                "rows and warns once. VerlTrainer: inside verl's actor (patch 7 of lightning_nb.trainers.verl."
                "patches) where only log-probs are read from the logits. False = padded rows."})
    device: str = field(default="cpu", metadata={
        "help": "Where the model trains and the TransformersEngine serves it: 'cpu', 'cuda' or 'cuda:N'. "
                "The trainer moves the engine's model (and the reference copy) there; set at construction."})
    dtype: str = field(default="float32", metadata={
        "help": "Weight and compute precision: 'float32' (CPU default) or 'bfloat16' (the GPU choice). bfloat16 "
                "keeps float32 master weights in the optimizer (lightning_nb.trainers.optim.MasterWeightAdamW), since "
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
    lora_adapter_dtype: Optional[str] = field(default=None, metadata={
        "help": "None: the adapters take the model's dtype (bf16 adapters on a bf16 model, with float32 master "
                "copies in AdamW, so small steps survive); 'float32': peft's float32 adapters (slower bf16 "
                "matmuls become float32 ones). Set at construction."})
    lora_target_modules: Union[str, list] = field(default="all-linear", metadata={
        "help": "Layers that get adapters: 'all-linear' (every linear layer but the output head, as QLoRA and "
                "verl's examples do) or module names such as ['q_proj', 'v_proj'] (peft's target_modules). "
                "Set at construction."})

    def __post_init__(self) -> None:
        if self.tis_cap is DTYPE_DEFAULT:  # a subclass's dtype-following default, resolved once from the dtype named
            self.tis_cap = BF16_TIS_CAP if self.dtype == "bfloat16" else None
        self.validate()

    def validate(self) -> None:
        """Raise ConfigError naming the first field out of range."""
        checks = {
            "learning_rate": self.learning_rate > 0, "weight_decay": self.weight_decay >= 0,
            "max_grad_norm": self.max_grad_norm > 0, "clip_ratio": 0 < self.clip_ratio < 1,
            "kl_coef": self.kl_coef >= 0,
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

    def _micro_batch_rules(self) -> list[tuple[str, bool, str, str]]:
        """(field, valid, allowed range, fix) of micro_batch_size and micro_batch_tokens."""
        return [
            ("micro_batch_size", self.micro_batch_size is None or (
                _is_int(self.micro_batch_size) and self.micro_batch_size >= 1), "None or an int >= 1",
             "use None for 4 rows (or no row cap with micro_batch_tokens)"),
            ("micro_batch_tokens", self.micro_batch_tokens is None or self.micro_batch_tokens == "auto" or (
                isinstance(self.micro_batch_tokens, int) and _is_int(self.micro_batch_tokens)
                and self.micro_batch_tokens >= 1),
             "None, 'auto' or an int >= 1 (tokens per forward/backward, padding counted)",
             "use 'auto' to size micro-batches from free device memory, or None for micro_batch_size rows"),
        ]

    def _kl_rules(self) -> list[tuple[str, bool, str, str]]:
        """(field, valid, allowed range, fix) of kl_every, the KL measurement of track_reference_kl."""
        return [
            ("kl_every", _is_int(self.kl_every) and self.kl_every >= 1, "an int >= 1 (updates between KL measurements)",
             "use 1 to measure KL on every update"),
            ("kl_every", self.kl_every == KL_EVERY_DEFAULT or self.track_reference_kl,
             f"{KL_EVERY_DEFAULT} (the default) with track_reference_kl=False",
             "set track_reference_kl=True to measure KL to the initial weights every kl_every updates (with "
             "kl_coef > 0 it is measured on every update anyway)"),
        ]

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
            ("lora_adapter_dtype", self.lora_adapter_dtype in (None, "float32"), "None or 'float32'",
             "use None for adapters in the model's dtype, or 'float32' for peft's float32 adapters"),
            ("lora_target_modules", self.lora_target_modules == "all-linear" or (
                isinstance(self.lora_target_modules, (list, tuple)) and self.lora_target_modules
                and all(isinstance(m, str) for m in self.lora_target_modules)),
             "'all-linear' or a non-empty list of module names", "e.g. ['q_proj', 'k_proj', 'v_proj', 'o_proj']"),
            ("prefix_tree", isinstance(self.prefix_tree, bool), "True or False", "use False to forward padded rows"),
            ("fail_on_fork", not self.fail_on_fork or self.pack_turns, "False when pack_turns is False",
             "set pack_turns=True (without packing every turn is its own sequence, so nothing forks)"),
        ]
        for name, ok, allowed, fix in self._micro_batch_rules() + self._kl_rules() + rules:
            if not ok:
                raise ConfigError(f"GRPOConfig.{name}={getattr(self, name)!r} is invalid: it must be {allowed}; "
                                  f"{fix}")


def lr_factor(step: int, config: TrainerConfig) -> float:
    """Multiplier of ``config.learning_rate`` for the update that follows ``step`` updates (0-based).

    With ``W = warmup_steps``, ``T = total_steps`` and ``p = clip((step − W) / (T − W), 0, 1)``::

        step < W:           (step + 1) / W          linear warmup (the first update is not spent at lr 0)
        constant:           1
        linear:             1 − p
        cosine:             (1 + cos(π p)) / 2      (Loshchilov & Hutter 2017, SGDR, one cycle, no restart)

    Linear and cosine reach 0 after ``T`` updates and stay there. The same shapes as
    transformers' ``get_*_schedule_with_warmup`` except that warmup starts at ``1/W``
    (as nanochat does), not at 0. :class:`~lightning_nb.trainers.inplace.InPlaceTrainer` (both trainers) applies it
    with ``torch.optim.lr_scheduler.LambdaLR``, one scheduler step per ``update()``.
    """
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    if config.lr_scheduler == "constant":
        return 1.0
    assert config.total_steps is not None, "validate() requires total_steps with a decaying schedule"
    span = config.total_steps - config.warmup_steps
    p = min(max((step - config.warmup_steps) / span, 0.0), 1.0)
    return 1.0 - p if config.lr_scheduler == "linear" else 0.5 * (1.0 + math.cos(math.pi * p))
