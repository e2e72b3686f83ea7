"""``VerlConfig``: :class:`~lightning_nb.trainers.config.TrainerConfig`'s fields (``GRPOConfig``'s) mapped onto verl's
Hydra config.

Building a ``VerlConfig`` needs no verl; :meth:`VerlConfig.verl_config` (and so building a
:class:`~lightning_nb.trainers.verl.trainer.VerlTrainer`) imports it, or raises
``MissingDependencyError`` naming ``pip install 'lightning-nb[verl]'``.
"""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from lightning_nb.errors import ConfigError
from lightning_nb.trainers.config import DEVICE_DEFAULT, DTYPE_DEFAULT, TrainerConfig
from lightning_nb.trainers.microbatch import auto_micro_batch_tokens

__all__ = ["VerlConfig", "MAPPED_KEYS", "ROWS_DEFAULT"]


class _RowsDefault:
    """The default of ``VerlConfig.micro_batch_size`` before construction resolves it: 4 without a token budget."""

    def __repr__(self) -> str:
        return "4, or None with micro_batch_tokens"


#: Placeholder default of ``VerlConfig.micro_batch_size``; construction replaces it by 4, or by None where
#: ``micro_batch_tokens`` is set (verl's dynamic micro-batches have no row cap).
ROWS_DEFAULT = _RowsDefault()

# The verl keys VerlConfig's own fields set (VerlConfig.overrides may not set them too).
MAPPED_KEYS: dict[str, str] = {
    "actor_rollout_ref.actor.optim.lr": "learning_rate",
    "actor_rollout_ref.actor.optim.weight_decay": "weight_decay",
    "actor_rollout_ref.actor.optim.lr_warmup_steps": "warmup_steps",
    "actor_rollout_ref.actor.optim.lr_scheduler_type": "lr_scheduler",
    "actor_rollout_ref.actor.optim.total_training_steps": "total_steps",
    "actor_rollout_ref.actor.grad_clip": "max_grad_norm",
    "actor_rollout_ref.actor.clip_ratio": "clip_ratio",
    "actor_rollout_ref.actor.clip_ratio_low": "clip_ratio_low",
    "actor_rollout_ref.actor.clip_ratio_high": "clip_ratio_high",
    "actor_rollout_ref.actor.loss_agg_mode": "loss_agg_mode",
    "actor_rollout_ref.actor.loss_scale_factor": "max_response_len",
    "actor_rollout_ref.actor.use_kl_loss": "kl_coef",
    "actor_rollout_ref.actor.kl_loss_coef": "kl_coef",
    "actor_rollout_ref.actor.kl_loss_type": "kl_penalty",
    "actor_rollout_ref.actor.ppo_epochs": "ppo_epochs",
    "actor_rollout_ref.actor.ppo_mini_batch_size": "mini_batch_size",
    "actor_rollout_ref.actor.use_dynamic_bsz": "micro_batch_size",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": "micro_batch_tokens",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": "micro_batch_tokens",
    "actor_rollout_ref.model.enable_gradient_checkpointing": "gradient_checkpointing",
    "actor_rollout_ref.model.lora_rank": "lora_rank",
    "algorithm.adv_estimator": "(VerlTrainer is GRPO)",
    "algorithm.norm_adv_by_std_in_grpo": "norm_adv_by_std",
    "algorithm.use_kl_in_reward": "kl_mode",
    "algorithm.rollout_correction.rollout_is": "tis_cap",
    "algorithm.rollout_correction.rollout_is_threshold": "tis_cap",
}

_VERL_SCHEDULES = ("constant", "cosine")


@dataclass
class VerlConfig(TrainerConfig):
    """The fields of :class:`~lightning_nb.GRPOConfig` for :class:`VerlTrainer`, mapped onto verl's Hydra config.

    A :class:`~lightning_nb.trainers.config.TrainerConfig`, as ``GRPOConfig`` is (the two are siblings: a
    ``VerlConfig`` is not a ``GRPOConfig``). The fields keep their ``GRPOConfig`` meaning (one name per
    concept) and each becomes the verl key that means the same (:meth:`hydra_overrides`; :data:`MAPPED_KEYS`
    lists them). ``overrides`` passes further Hydra overrides of verl's ``ppo_trainer.yaml`` to verl's actor, e.g.
    ``["actor_rollout_ref.actor.entropy_coeff=0.001"]`` or
    ``["actor_rollout_ref.actor.policy_loss.loss_mode=gspo"]``. :meth:`verl_config` composes verl's
    own defaults with both and runs verl's own checks (``verl.utils.config.validate_config``); print
    it with ``print(config.to_yaml())``.

    Supported as in ``GRPOConfig``: the PPO and GRPO knobs, the LR schedule (``lr_scheduler`` /
    ``warmup_steps`` / ``total_steps``: the trainer's schedule, which verl's engine steps), KL to the
    reference as a loss (``kl_coef``, ``kl_penalty``; ``track_reference_kl`` measures it),
    ``max_staleness``, ``min_group_size``, ``pack_turns``, ``fail_on_fork``, ``device``, ``dtype``,
    ``gradient_checkpointing`` and LoRA (``lora_*``: peft adapters injected in the engine's model; verl
    adopts that model as it is). Micro-batches are verl's dynamic ones (``use_dynamic_bsz``), by a token
    budget (``ppo_max_token_len_per_gpu``, :meth:`max_token_len`): ``micro_batch_tokens`` when set (an int, or
    ``"auto"`` from free device memory as in ``GRPOTrainer``), else ``micro_batch_size ×`` the longest row's
    tokens, so a forward holds at least ``micro_batch_size`` rows' worth of memory and never more. Defaults, as
    ``GRPOConfig``'s: on CUDA ``micro_batch_tokens="auto"`` (and ``micro_batch_size`` None); on CPU
    ``micro_batch_tokens`` None and ``micro_batch_size`` 4 (as before). Setting one of them resolves the other's
    default (``micro_batch_size=8`` on CUDA: no token budget; ``micro_batch_tokens=4096``: no row cap); setting
    both is refused (verl's dynamic micro-batches have no row cap). verl counts a micro-batch's real tokens
    (its rows' lengths), not ``GRPOTrainer``'s rows × longest row.

    ``tis_cap`` is verl's rollout correction (``algorithm.rollout_correction``: ``rollout_is="token"``,
    ``rollout_is_threshold=tis_cap``, decoupled mode; Liu et al. 2025, "When Speed Kills Stability"): each
    response token's policy loss is weighted by ``min(π_old / π_engine, tis_cap)``, π_old being verl's
    recomputed log-probs and π_engine the engine's (truncated importance sampling, Yao et al. 2025: what
    ``GRPOConfig.tis_cap`` does in ``GRPOTrainer``). Default as there: ``BF16_TIS_CAP`` (2.0) when
    ``dtype="bfloat16"``, None (off) in float32; an explicit None is kept. It needs the engine's log-probs
    on every triplet; a batch without them trains uncorrected, and the metrics say so (``tis_weight_mean``
    NaN). The metrics add ``tis_weight_mean`` and verl's ``rollout_corr/*``.

    One difference in meaning: verl recomputes π_old with the weights at the start of the update (its
    ``_compute_old_log_prob``), so an episode sampled one weight version earlier (kept by ``max_staleness=1``)
    is trained as if on-policy, without ``GRPOTrainer``'s importance ratio against the engine's log-probs;
    ``logprob_diff_max`` shows how far the two differ. ``max_staleness=0`` keeps only on-policy episodes.

    Refused (``ConfigError`` naming the field): the ``GRPOTrainer``-only options that verl's GRPO
    path does not have here: ``credit='reward_to_go'`` (and ``gamma``), ``kl_mode='reward'``,
    ``tis_cap``, ``overlong_filter``, ``overlong_buffer_len`` and ``skip_zero_advantage=True``
    (verl forwards every row).
    """

    micro_batch_size: Optional[int] = field(default=ROWS_DEFAULT, metadata={  # type: ignore[assignment]
        "help": "Without micro_batch_tokens: verl's token budget per forward is micro_batch_size × the longest "
                "row's tokens. Default: 4, or None where micro_batch_tokens is set or defaults to 'auto' (CUDA); "
                "must be None with micro_batch_tokens (verl has no row cap)."})
    micro_batch_tokens: Optional[Union[int, str]] = field(default=DEVICE_DEFAULT, metadata={  # type: ignore[assignment]
        "help": "verl's ppo_max_token_len_per_gpu (and log_prob_max_token_len_per_gpu): tokens per forward, an "
                "int >= 1 or 'auto' (from free device memory, lightning_nb.trainers.microbatch."
                "auto_micro_batch_tokens); None = micro_batch_size × the longest row. Default: 'auto' on CUDA "
                "unless micro_batch_size is set, None on CPU."})
    tis_cap: Optional[float] = field(default=DTYPE_DEFAULT, metadata={  # type: ignore[assignment]
        "help": "verl's rollout correction, token-level truncated IS (rollout_is='token', rollout_is_threshold="
                "tis_cap): each token's loss weighted by min(π_old/π_engine, tis_cap). Default: 2.0 when "
                "dtype='bfloat16', None (off) otherwise; an explicit None is kept."})
    skip_zero_advantage: bool = field(default=False, metadata={
        "help": "Not supported by VerlTrainer (verl forwards every row; a zero-advantage row adds no policy "
                "gradient); must stay False."})
    overrides: list = field(default_factory=list, metadata={
        "help": "Further Hydra overrides of verl's ppo_trainer.yaml, 'key=value' strings, e.g. "
                "'actor_rollout_ref.actor.entropy_coeff=0.001'. Keys that a VerlConfig field maps to "
                "(lightning_nb.trainers.verl.config.MAPPED_KEYS) are refused: set the field."})

    def __post_init__(self) -> None:
        if self.micro_batch_tokens is DEVICE_DEFAULT:  # resolved once, from the device (and a row count set)
            cuda = isinstance(self.device, str) and self.device.startswith("cuda")
            rows_set = self.micro_batch_size is not ROWS_DEFAULT and self.micro_batch_size is not None
            self.micro_batch_tokens = "auto" if cuda and not rows_set else None
        if self.micro_batch_size is ROWS_DEFAULT:
            self.micro_batch_size = 4 if self.micro_batch_tokens is None else None
        super().__post_init__()

    def validate(self) -> None:
        """The shared checks (:meth:`TrainerConfig.validate`), then the options VerlTrainer does not have, then the
        overrides' form.

        Raises:
            ConfigError: naming the field and the fix.
        """
        super().validate()
        unsupported = [
            ("credit", self.credit == "episode", "'episode'", "verl's GRPO advantage is per episode"),
            ("kl_mode", self.kl_mode == "loss", "'loss'",
             "verl's in-reward KL needs its KL controller; use kl_mode='loss' (verl's use_kl_loss)"),
            ("overlong_filter", not self.overlong_filter, "False", "use GRPOTrainer for DAPO's overlong filter"),
            ("overlong_buffer_len", self.overlong_buffer_len == 0, "0",
             "use GRPOTrainer for DAPO's soft overlong penalty"),
            ("skip_zero_advantage", not self.skip_zero_advantage, "False", "verl forwards every row"),
            ("micro_batch_size", self.micro_batch_size is not None or self.micro_batch_tokens is not None,
             "an int >= 1 without micro_batch_tokens", "set micro_batch_size (e.g. 4) or micro_batch_tokens"),
            ("micro_batch_size", self.micro_batch_size is None or self.micro_batch_tokens is None,
             "None with micro_batch_tokens",
             "verl's dynamic micro-batches have no row cap: set micro_batch_size=None to use micro_batch_tokens"),
        ]
        for name, ok, allowed, why in unsupported:
            if not ok:
                raise ConfigError(f"VerlConfig.{name}={getattr(self, name)!r} is not supported by VerlTrainer: "
                                  f"it must be {allowed} ({why})")
        if not isinstance(self.overrides, (list, tuple)):
            raise ConfigError(f"VerlConfig.overrides={self.overrides!r} must be a list of 'key=value' strings")
        for item in self.overrides:
            if not isinstance(item, str) or "=" not in item:
                raise ConfigError(f"VerlConfig.overrides has {item!r}; each entry is a Hydra override "
                                  "'key=value', e.g. 'actor_rollout_ref.actor.entropy_coeff=0.001'")
            key = item.split("=", 1)[0].lstrip("+~")
            if key in MAPPED_KEYS:
                raise ConfigError(f"VerlConfig.overrides sets {key}, which VerlConfig.{MAPPED_KEYS[key]} sets; "
                                  f"set that field instead")

    def max_token_len(self, longest: int, model: Any = None) -> int:
        """verl's ``max_token_len`` (``ppo_max_token_len_per_gpu``) for a batch whose longest row has ``longest``
        tokens: ``micro_batch_tokens``, ``"auto"`` resolved now for ``model`` (on its device), or
        ``micro_batch_size × longest``.

        Raises:
            ConfigError: ``"auto"`` without a transformers ``model``.
        """
        if self.micro_batch_tokens is None:
            assert self.micro_batch_size is not None  # __post_init__ sets 4 rows without a token budget
            return int(self.micro_batch_size * longest)
        if self.micro_batch_tokens == "auto":
            if model is None:
                raise ConfigError("VerlConfig.micro_batch_tokens='auto' is resolved for a model; pass it")
            return auto_micro_batch_tokens(model, gradient_checkpointing=self.gradient_checkpointing,
                                           lora=self.lora_rank > 0)
        return int(self.micro_batch_tokens)

    # ----- verl's config ----------------------------------------------------------------
    def hydra_overrides(self) -> list[str]:
        """The Hydra overrides of verl's ``ppo_trainer.yaml`` that this config's fields mean, then ``overrides``."""
        def val(v: Any) -> str:
            if v is None:
                return "null"
            if isinstance(v, bool):
                return "true" if v else "false"
            return repr(v) if isinstance(v, float) else str(v)

        a = "actor_rollout_ref.actor."
        out = [
            f"{a}optim.lr={val(self.learning_rate)}", f"{a}optim.weight_decay={val(self.weight_decay)}",
            f"{a}optim.lr_warmup_steps={self.warmup_steps if self.warmup_steps else -1}",
            f"{a}grad_clip={val(self.max_grad_norm)}", f"{a}clip_ratio={val(self.clip_ratio)}",
            f"{a}clip_ratio_low={val(self.clip_ratio_low if self.clip_ratio_low is not None else self.clip_ratio)}",
            f"{a}clip_ratio_high={val(self.clip_ratio_high if self.clip_ratio_high is not None else self.clip_ratio)}",
            f"{a}loss_agg_mode={self.loss_agg_mode}",
            f"{a}use_kl_loss={val(self.kl_coef > 0)}", f"{a}kl_loss_coef={val(float(self.kl_coef))}",
            f"{a}kl_loss_type={self.kl_penalty}", f"{a}ppo_epochs={self.ppo_epochs}",
            "actor_rollout_ref.model.enable_gradient_checkpointing=" + val(self.gradient_checkpointing),
            f"algorithm.norm_adv_by_std_in_grpo={val(self.norm_adv_by_std)}",
            "algorithm.use_kl_in_reward=false",
            "trainer.n_gpus_per_node=1", "trainer.nnodes=1",
            f"trainer.device={'cpu' if self.device == 'cpu' else 'cuda'}",
        ]
        if self.loss_agg_mode == "seq-mean-token-sum-norm":
            out.append(f"{a}loss_scale_factor={self.max_response_len}")
        if self.lr_scheduler in _VERL_SCHEDULES:
            out.append(f"{a}optim.lr_scheduler_type={self.lr_scheduler}")
        if self.total_steps is not None:
            out.append(f"{a}optim.total_training_steps={self.total_steps}")
        if self.mini_batch_size is not None:
            out.append(f"{a}ppo_mini_batch_size={self.mini_batch_size}")
        if self.tis_cap is not None:  # verl's decoupled token-level TIS; VerlTrainer applies it per update
            out += ["algorithm.rollout_correction.rollout_is=token",
                    f"algorithm.rollout_correction.rollout_is_threshold={val(float(self.tis_cap))}"]
        return [*out, *self.overrides]

    def verl_config(self) -> Any:
        """verl's ``ppo_trainer.yaml`` composed with :meth:`hydra_overrides`, checked by verl's ``validate_config``.

        Returns the ``omegaconf.DictConfig`` verl's trainer would get.

        Raises:
            ConfigError: Hydra refuses an override (an unknown key, a bad value), or verl's checks fail.
            MissingDependencyError: verl is not installed (an ImportError naming the extra).
        """
        from lightning_nb.trainers.verl.bridge import ppo_config, require_verl

        require_verl()  # an ImportError naming the extra, not a config error
        try:
            cfg = ppo_config(self.hydra_overrides())
        except Exception as exc:  # hydra's errors name the bad override
            raise ConfigError(f"verl's Hydra config refused VerlConfig ({type(exc).__name__}: {exc}); check "
                              f"VerlConfig.overrides={self.overrides!r}") from None
        try:
            from verl.utils.config import omega_conf_to_dataclass, validate_config

            with contextlib.redirect_stdout(io.StringIO()):  # verl prints "All configuration checks passed"
                validate_config(cfg, use_reference_policy=self.kl_coef > 0, use_critic=False)
            omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
        except Exception as exc:
            raise ConfigError(f"verl's checks refused VerlConfig ({type(exc).__name__}: {exc})") from None
        return cfg

    def to_yaml(self, section: Optional[str] = "actor_rollout_ref.actor") -> str:
        """The composed verl config as YAML: one ``section`` (dotted; None: all of it).

        A few of verl's keys are decided by :class:`VerlTrainer` per update instead, and show verl's defaults
        here: ``ppo_mini_batch_size`` (``mini_batch_size``; None = the whole batch), ``ppo_max_token_len_per_gpu``
        (:meth:`max_token_len`: ``micro_batch_tokens``, or ``micro_batch_size`` × the longest row's tokens), and
        ``fsdp_config`` (the model is trained unwrapped, in ``dtype``, on ``device``).
        """
        from omegaconf import OmegaConf

        cfg = self.verl_config()
        node = OmegaConf.select(cfg, section) if section else cfg
        return OmegaConf.to_yaml(node, resolve=True)

    # ----- presets ----------------------------------------------------------------------
    @classmethod
    def one_gpu_lora(cls, **changes: Any) -> "VerlConfig":
        """One GPU, a 0.5B–1.5B model, LoRA: verl's ``examples/tuning/0.5b/qwen2-0.5b_grpo-lora_1_h100_fsdp_vllm.sh``.

        CUDA, bfloat16, gradient checkpointing, LoRA rank 32 / alpha 32 on all linear layers,
        learning rate 3e-5, KL loss 0.001 (low_var_kl) to the base model (adapters disabled),
        entropy bonus 0.001. Micro-batches by a token budget from free memory (``micro_batch_tokens="auto"``,
        the CUDA default) and verl's token-level truncated IS at ``tis_cap`` 2.0 (the bfloat16 default).
        ``changes`` replace fields, e.g. ``one_gpu_lora(learning_rate=1e-5)``.
        """
        preset: dict[str, Any] = dict(
            device="cuda", dtype="bfloat16", gradient_checkpointing=True, lora_rank=32, lora_alpha=32.0,
            lora_target_modules="all-linear", learning_rate=3e-5, kl_coef=0.001, kl_penalty="low_var_kl",
            overrides=["actor_rollout_ref.actor.entropy_coeff=0.001"])
        preset.update(changes)
        return cls(**preset)
