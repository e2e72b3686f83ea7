"""``VerlTrainer``: the GRPO update done by verl's own actor, behind the trainer surface of ``GRPOTrainer``.

The agent, the runners, the LLM proxy, the store and the algorithm (:class:`~lightning_nb.LightningRL`)
are the same as with :class:`~lightning_nb.GRPOTrainer`: the engine behind the proxy (in-process
transformers, or vLLM through :class:`~lightning_nb.vllm_engine.VLLMEngine`) serves the policy,
spans become triplets, and each :meth:`VerlTrainer.update` hands the batch to verl
(Agent Lightning's "Inside an RL Algorithm (VERL Example)", reference doc 000):

1. the kept episodes (fresh enough, groups of ``min_group_size`` or more: the same rule as
   ``GRPOTrainer``) → verl's ``DataProto`` (:func:`~lightning_nb.verl_bridge.triplets_to_dataproto`:
   the engine's token IDs, multi-turn packing under ``response_mask``, ``token_level_scores``,
   ``uid`` = group);
2. old log-probs recomputed by verl's actor (``compute_log_prob``, as verl's ``_compute_old_log_prob``
   does), and the reference policy's (``ref_log_prob``) when KL is tracked or penalised;
3. GRPO advantages by verl's ``compute_grpo_outcome_advantage``;
4. verl's PPO update (``FSDPEngineWithLMHead.train_batch`` with ``ppo_loss``: PPO clip with dual
   clip, the KL loss, verl's loss aggregation, gradient clipping, the optimizer step);
5. the new weights to the engine through the engine contract (``engine.load_weights``).

The verl pieces run in this process without Ray (:class:`~lightning_nb.verl_bridge.VerlActor`; its
module docstring lists the five patches). Everything else (``start`` / ``pause`` / ``resume`` /
``stop``, ``metrics_df``, ``last_batch_df``, the widgets, config edits while paused, LoRA through
peft) is ``GRPOTrainer``'s. Checkpoints use verl's layout: ``<folder>/global_step_N/`` and
``<folder>/latest_checkpointed_iteration.txt``, with verl's ``resume_mode`` (``auto``,
``resume_path``, ``disable``).
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from lightning_nb.errors import ConfigError
from lightning_nb.trainer import GRPOConfig, GRPOTrainer, _mean, _std
from lightning_nb.types import Triplet

__all__ = ["VerlConfig", "VerlTrainer", "MAPPED_KEYS"]

log = logging.getLogger(__name__)

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
    "actor_rollout_ref.model.enable_gradient_checkpointing": "gradient_checkpointing",
    "actor_rollout_ref.model.lora_rank": "lora_rank",
    "algorithm.adv_estimator": "(VerlTrainer is GRPO)",
    "algorithm.norm_adv_by_std_in_grpo": "norm_adv_by_std",
    "algorithm.use_kl_in_reward": "kl_mode",
}

_VERL_SCHEDULES = ("constant", "cosine")


@dataclass
class VerlConfig(GRPOConfig):
    """:class:`~lightning_nb.GRPOConfig` for :class:`VerlTrainer`, mapped onto verl's Hydra config.

    The fields keep their ``GRPOConfig`` meaning (one name per concept) and each becomes the verl key
    that means the same (:meth:`hydra_overrides`; :data:`MAPPED_KEYS` lists them). ``overrides``
    passes further Hydra overrides of verl's ``ppo_trainer.yaml`` to verl's actor, e.g.
    ``["actor_rollout_ref.actor.entropy_coeff=0.001"]`` or
    ``["actor_rollout_ref.actor.policy_loss.loss_mode=gspo"]``. :meth:`verl_config` composes verl's
    own defaults with both and runs verl's own checks (``verl.utils.config.validate_config``); print
    it with ``print(config.to_yaml())``.

    Supported as in ``GRPOConfig``: the PPO and GRPO knobs, the LR schedule (``lr_scheduler`` /
    ``warmup_steps`` / ``total_steps``: the trainer's schedule, which verl's engine steps), KL to the
    reference as a loss (``kl_coef``, ``kl_penalty``; ``track_reference_kl`` measures it),
    ``max_staleness``, ``min_group_size``, ``pack_turns``, ``fail_on_fork``, ``device``, ``dtype``,
    ``gradient_checkpointing`` and LoRA (``lora_*``: peft adapters injected in the engine's model; verl
    adopts that model as it is). ``micro_batch_size`` bounds one forward by tokens: verl's dynamic
    micro-batching (``use_dynamic_bsz``) with a budget of ``micro_batch_size ×`` the longest row's
    tokens, so a forward holds at least ``micro_batch_size`` rows' worth of memory and never more.

    One difference in meaning: verl recomputes π_old with the weights at the start of the update (its
    ``_compute_old_log_prob``), so an episode sampled one weight version earlier (kept by ``max_staleness=1``)
    is trained as if on-policy, without ``GRPOTrainer``'s importance ratio against the engine's log-probs;
    ``logprob_diff_max`` shows how far the two differ. ``max_staleness=0`` keeps only on-policy episodes.

    Refused (``ConfigError`` naming the field): the ``GRPOTrainer``-only options that verl's GRPO
    path does not have here: ``credit='reward_to_go'`` (and ``gamma``), ``kl_mode='reward'``,
    ``tis_cap``, ``overlong_filter``, ``overlong_buffer_len`` and ``skip_zero_advantage=True``
    (verl forwards every row).
    """

    skip_zero_advantage: bool = field(default=False, metadata={
        "help": "Not supported by VerlTrainer (verl forwards every row; a zero-advantage row adds no policy "
                "gradient); must stay False."})
    overrides: list = field(default_factory=list, metadata={
        "help": "Further Hydra overrides of verl's ppo_trainer.yaml, 'key=value' strings, e.g. "
                "'actor_rollout_ref.actor.entropy_coeff=0.001'. Keys that a VerlConfig field maps to "
                "(lightning_nb.verl_trainer.MAPPED_KEYS) are refused: set the field."})

    def validate(self) -> None:
        """GRPOConfig's checks, then the options VerlTrainer does not have, then the overrides' form.

        Raises:
            ConfigError: naming the field and the fix.
        """
        super().validate()
        unsupported = [
            ("credit", self.credit == "episode", "'episode'", "verl's GRPO advantage is per episode"),
            ("kl_mode", self.kl_mode == "loss", "'loss'",
             "verl's in-reward KL needs its KL controller; use kl_mode='loss' (verl's use_kl_loss)"),
            ("tis_cap", self.tis_cap is None, "None",
             "use GRPOTrainer for truncated importance sampling, or verl's rollout correction through overrides"),
            ("overlong_filter", not self.overlong_filter, "False", "use GRPOTrainer for DAPO's overlong filter"),
            ("overlong_buffer_len", self.overlong_buffer_len == 0, "0",
             "use GRPOTrainer for DAPO's soft overlong penalty"),
            ("skip_zero_advantage", not self.skip_zero_advantage, "False", "verl forwards every row"),
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
        return [*out, *self.overrides]

    def verl_config(self) -> Any:
        """verl's ``ppo_trainer.yaml`` composed with :meth:`hydra_overrides`, checked by verl's ``validate_config``.

        Returns the ``omegaconf.DictConfig`` verl's trainer would get.

        Raises:
            ConfigError: Hydra refuses an override (an unknown key, a bad value), or verl's checks fail.
            ImportError: verl is not installed (the message names the extra).
        """
        from lightning_nb.verl_bridge import ppo_config, require_verl

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
        (``micro_batch_size`` × the longest row's tokens), and ``fsdp_config`` (the model is trained unwrapped,
        in ``dtype``, on ``device``).
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
        entropy bonus 0.001. ``changes`` replace fields, e.g. ``one_gpu_lora(learning_rate=1e-5)``.
        """
        preset: dict[str, Any] = dict(
            device="cuda", dtype="bfloat16", gradient_checkpointing=True, lora_rank=32, lora_alpha=32.0,
            lora_target_modules="all-linear", learning_rate=3e-5, kl_coef=0.001, kl_penalty="low_var_kl",
            overrides=["actor_rollout_ref.actor.entropy_coeff=0.001"])
        preset.update(changes)
        return cls(**preset)


class VerlTrainer(GRPOTrainer):
    """GRPO with verl's actor update, with :class:`~lightning_nb.GRPOTrainer`'s notebook surface.

    ``start(algorithm)`` runs in the background; ``pause()`` returns at a step boundary (no update
    running, no rollout being enqueued); ``resume()`` validates config edits (and verl's checks)
    first; ``stop()``, ``metrics_df()``, ``last_batch_df()``, ``last_batch_html()`` and the widgets
    work as for ``GRPOTrainer``. See the module docstring for what one :meth:`update` does.

    Args:
        engine: serves the policy (``TransformersEngine``, or ``VLLMEngine`` whose server gets each
            update's weights); its ``model`` is what verl trains, in place.
        config: :class:`VerlConfig` (a plain ``GRPOConfig`` is refused: its defaults differ).

    Raises:
        ConfigError: ``config`` is not a ``VerlConfig``, verl refuses it, or a ``GRPOTrainer`` error
            (device not available, ...).
    """

    def __init__(self, engine: Any, config: Optional[VerlConfig] = None) -> None:
        config = config if config is not None else VerlConfig()
        if not isinstance(config, VerlConfig):
            raise ConfigError(f"VerlTrainer takes a VerlConfig, got {type(config).__name__}; build one with "
                              "VerlConfig(...) (same field names as GRPOConfig)")
        verl_cfg = config.verl_config()  # before anything is moved or adapted
        super().__init__(engine, config)
        self.verl_config = verl_cfg
        self._build_actors()

    def _build_actors(self) -> None:
        from lightning_nb.verl_bridge import VerlActor

        self.actor = VerlActor(self.model, self.verl_config, optimizer=self.optimizer, lr_scheduler=self.scheduler)
        self.reference_actor = (VerlActor(self.reference, self.verl_config, forward_only=True)
                                if self.reference is not None else None)

    # ----- the RL step ----------------------------------------------------------------
    def update(self, triplets: Sequence[Triplet]) -> dict[str, Any]:
        """One GRPO step by verl on ``triplets``; returns its metrics (also appended to :attr:`metrics`).

        Episodes are kept as :meth:`GRPOTrainer.update` keeps them (``max_staleness``, ``min_group_size``,
        forks counted or refused with ``fail_on_fork``), converted by
        :func:`~lightning_nb.verl_bridge.triplets_to_dataproto` (one row per packed sequence), scored by
        verl's actor (π_old, recomputed as verl does, and π_ref when the reference is active), given
        verl's GRPO advantages (:func:`~lightning_nb.verl_bridge.grpo_advantages`), and updated by verl
        (:meth:`~lightning_nb.verl_bridge.VerlActor.update_policy`: ``ppo_epochs`` × mini-batches of
        ``mini_batch_size`` rows, or the whole batch). Then ``engine.load_weights(model)``.

        Metrics: those of ``GRPOTrainer.update`` where the concept is the same (``loss``, ``pg_loss``,
        ``grad_norm``, ``ppo_kl``, ``pg_clipfrac`` (verl's, means over the mini-batches), ``kl`` (the
        ``kl_penalty`` estimator of π_old vs π_ref, mean over response tokens; NaN without a
        reference), ``logprob_diff_max`` (largest |π_old − engine| log-prob on the trained tokens, nats),
        ``reward_mean``, ``reward_std``, ``episodes``, ``groups``, ``groups_with_signal``,
        ``groups_dropped``, ``episodes_dropped``, ``transitions``, ``stale_episodes_dropped``,
        ``staleness_max``, ``sequences_trained``, ``tokens_trained``, ``optimizer_steps``,
        ``turn_forks``, ``truncated_responses``, ``intermediate_rewards``, ``update_seconds``,
        ``tokens_per_s``, ``lr``, ``config_changes``), plus every metric verl's loss reported under its
        own name (``actor/pg_loss``, ``actor/pg_clipfrac``, ``actor/ppo_kl``, ``actor/pg_clipfrac_lower``,
        ``kl_loss`` with the KL loss, ...) and ``trainer`` = ``"verl"``.

        Raises:
            ConfigError: as ``GRPOTrainer.update`` (no triplets, empty responses, ``top_p < 1``, a fork
                with ``fail_on_fork``), or verl refuses a config edited while paused.
        """
        from verl.trainer.ppo import core_algos

        self._check_batch(triplets)
        with self._updating:
            # verl's loss reads its own config: an edited config is composed and checked by verl first (nothing is
            # applied if verl refuses it), then verl's actor is rebuilt from it
            edited = self.config.verl_config() if asdict(self.config) != self._applied_config else None
            changes = self._sync_config()
            if edited is not None:
                self.verl_config = edited
                self._build_actors()
            lr = float(self.optimizer.param_groups[0]["lr"])
            t0 = time.perf_counter()
            with self.engine.lock:
                batch = self._build_batch(triplets, core_algos)  # the kept episodes, as GRPOTrainer keeps them
                kept = [t for t in triplets if t.rollout_id in batch.advantages]
                if kept:
                    data, stats = self._verl_step(kept, core_algos)
                    self.engine.load_weights(self.model)  # in place, or pushed to a server (VLLMEngine)
                else:
                    data, stats = None, {}
                    self._advance_schedule()  # the schedule counts updates
                self.step += 1
            seconds = time.perf_counter() - t0
            rows = _batch_rows(data) if data is not None else []
            metrics = self._verl_metrics(triplets, batch, stats, rows, seconds, lr, changes)
            self.last_triplets = list(triplets)
            self.last_advantages = _episode_advantages(rows)
            self.last_turn_advantages = {(t.rollout_id, t.turn): self.last_advantages[t.rollout_id] for t in kept}
            self.last_batch = rows
            self.metrics.append(metrics)
            return metrics

    def _verl_step(self, kept: list[Triplet], core_algos: Any) -> tuple[Any, dict[str, float]]:
        """DataProto → π_old (and π_ref) → verl's GRPO advantages → verl's PPO update.

        Returns ``(data, stats)``: the DataProto with ``old_log_probs``, ``advantages`` (and ``ref_log_prob``), and
        verl's metrics plus ``kl`` and ``logprob_diff_max``. Each stage done moves :attr:`progress` (phase
        ``"update"``, unit ``"stages"``: π_old, π_ref when active, verl's policy update).
        """
        from lightning_nb.verl_bridge import grpo_advantages, triplets_to_dataproto

        cfg = self.config
        stages = 3 if self._reference_active() else 2

        def report(done: int) -> None:
            self.report_progress("update", done, stages, unit="stages", step=self.step + 1)

        report(0)
        data = triplets_to_dataproto(kept, pad_token_id=self.engine.pad_token_id, pack_turns=cfg.pack_turns)
        lengths = data.batch["attention_mask"].sum(-1)
        max_tokens = int(cfg.micro_batch_size * int(lengths.max()))  # verl's dynamic micro-batch budget
        data = data.union(self.actor.compute_log_prob(data, max_token_len=max_tokens))
        report(1)
        mask = data.batch["response_mask"].bool()
        stats: dict[str, float] = {"kl": math.nan}
        if self._reference_active():
            ref = self._reference_log_prob(data, max_tokens)
            report(2)
            data.batch["ref_log_prob"] = ref
            kl = core_algos.kl_penalty(data.batch["old_log_probs"], ref, cfg.kl_penalty)
            stats["kl"] = float(kl[mask].mean()) if mask.any() else math.nan
        data.batch["advantages"] = grpo_advantages(data, norm_adv_by_std=cfg.norm_adv_by_std,
                                                   min_group_size=cfg.min_group_size)
        if "rollout_log_probs" in data.batch.keys() and mask.any():
            diff = (data.batch["old_log_probs"] - data.batch["rollout_log_probs"]).abs()
            stats["logprob_diff_max"] = float(diff[mask].max())
        else:
            stats["logprob_diff_max"] = math.nan
        stats.update(self.actor.update_policy(data, mini_batch_size=cfg.mini_batch_size, max_token_len=max_tokens))
        report(stages)
        return data, stats

    def _reference_log_prob(self, data: Any, max_tokens: int) -> Any:
        """π_ref's log-probs (B, R): the kept copy of the initial weights, or with LoRA the base model
        (adapters disabled, as verl's ``ref_in_actor``)."""
        if self.reference_actor is not None:
            return self.reference_actor.compute_log_prob(data, max_token_len=max_tokens).batch["old_log_probs"]
        with self.peft_model.disable_adapter():
            return self.actor.compute_log_prob(data, max_token_len=max_tokens).batch["old_log_probs"]

    def _verl_metrics(self, triplets: Sequence[Triplet], batch: Any, stats: dict[str, float],
                      rows: list[dict[str, Any]], seconds: float, lr: float, changes: list[str]) -> dict[str, Any]:
        """The metrics row of one update (see :meth:`update`)."""
        steps = int(stats.pop("optimizer_steps", 0))
        kept_rewards = [batch.rewards[r] for r in batch.advantages]
        groups = batch.groups
        signal = {groups[r] for r, a in batch.advantages.items() if a != 0.0}
        tokens = sum(len(r["input_ids"]) for r in rows)
        metrics: dict[str, Any] = {
            "step": self.step, "trainer": "verl",
            "loss": stats.get("loss", math.nan), "pg_loss": stats.get("actor/pg_loss", math.nan),
            "kl": stats.get("kl", math.nan), "ppo_kl": stats.get("actor/ppo_kl", math.nan),
            "pg_clipfrac": stats.get("actor/pg_clipfrac", math.nan),
            "logprob_diff_max": stats.get("logprob_diff_max", math.nan),
            "reward_mean": _mean(kept_rewards), "reward_std": _std(kept_rewards),
            "episodes": len(batch.advantages), "groups": len({groups[r] for r in batch.advantages}),
            "groups_with_signal": len(signal), "groups_dropped": len(batch.dropped),
            "episodes_dropped": sum(batch.dropped.values()), "transitions": len(triplets),
            "stale_episodes_dropped": len(batch.stale), "staleness_max": max(batch.staleness.values(), default=0),
            "sequences_trained": len(rows), "tokens_trained": sum(sum(r["response_mask"]) for r in rows),
            "grad_norm": stats.get("grad_norm", 0.0), "update_seconds": seconds,
            "tokens_per_s": tokens / seconds if seconds > 0 else 0.0, "lr": lr, "optimizer_steps": steps,
            "turn_forks": batch.forks, "truncated_responses": sum(1 for t in triplets if t.finish_reason == "length"),
            "intermediate_rewards": sum(1 for t in triplets if t.step_reward != 0.0),
            "config_changes": "; ".join(changes),
        }
        for k, v in stats.items():  # verl's own metric names, as its trainer logs them
            if k not in ("loss", "grad_norm", "kl", "logprob_diff_max", "lr"):
                metrics.setdefault(k, v)
        return metrics

    # ----- config edits while paused ----------------------------------------------------
    def _check_before_resume(self) -> None:
        super()._check_before_resume()
        if not isinstance(self.config, VerlConfig):
            raise ConfigError("VerlTrainer.config must stay a VerlConfig")
        self.config.verl_config()  # verl's own checks, before resume() lets the loop go on

    # ----- checkpoints (verl's layout) --------------------------------------------------
    def save(self, path: str | Path) -> Path:
        """Write a checkpoint into the folder ``path`` the way verl lays them out; returns the step's folder.

        ``path`` plays verl's ``trainer.default_local_dir``: this writes ``path/global_step_{step}/trainer.pt``
        (:meth:`GRPOTrainer.save`'s checkpoint: the weights or LoRA adapters, the optimizer and LR
        scheduler, RNG states, metrics, config, the algorithm's state) and then, atomically,
        ``path/latest_checkpointed_iteration.txt`` (verl's tracker file), so a crash mid-save leaves
        the previous checkpoint the latest. Call it at a step boundary (paused, or after ``wait()``).
        """
        root = Path(path)
        if root.suffix == ".pt":
            raise ConfigError(f"VerlTrainer.save() takes a folder (verl's trainer.default_local_dir), got {root}; "
                              "e.g. trainer.save('runs/verl/checkpoints')")
        folder = root / f"global_step_{self.step}"
        super().save(folder / "trainer.pt")
        tracker = root / "latest_checkpointed_iteration.txt"
        tmp = tracker.with_suffix(".tmp")
        tmp.write_text(str(self.step))
        os.replace(tmp, tracker)
        return folder

    def load(self, path: str | Path, *, resume_mode: str = "auto", keep_config: bool = False) -> None:
        """Continue from a :meth:`save` checkpoint, with verl's ``trainer.resume_mode``.

        * ``"auto"``: ``path`` is the checkpoint folder; load its latest step (verl's
          ``find_latest_ckpt_path`` reads ``latest_checkpointed_iteration.txt``).
        * ``"resume_path"``: ``path`` is one ``global_step_N`` folder (or its ``trainer.pt``).
        * ``"disable"``: load nothing (start fresh).

        The rest is :meth:`GRPOTrainer.load` (config restored from the checkpoint unless
        ``keep_config``; RNG states; the algorithm's state; the engine gets the weights).

        Raises:
            FileNotFoundError: no checkpoint at ``path``.
            ConfigError: an unknown ``resume_mode``, or what ``GRPOTrainer.load`` raises.
        """
        if resume_mode == "disable":
            return
        path = Path(path)
        if resume_mode == "auto":
            from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path

            tracker = path / "latest_checkpointed_iteration.txt"
            with contextlib.redirect_stdout(io.StringIO()):  # verl prints "Found checkpoint: %s <path>"
                latest = find_latest_ckpt_path(str(path)) if tracker.exists() else None
            if latest is None:
                raise FileNotFoundError(f"no checkpoint in {path} (no latest_checkpointed_iteration.txt naming an "
                                        "existing global_step_N folder); write one with trainer.save(folder)")
            file = Path(latest) / "trainer.pt"
        elif resume_mode == "resume_path":
            file = path if path.suffix == ".pt" else path / "trainer.pt"
        else:
            raise ConfigError(f"resume_mode={resume_mode!r}; use 'auto', 'resume_path' or 'disable' (verl's "
                              "trainer.resume_mode)")
        super().load(file, keep_config=keep_config)
        with self._updating:
            self.verl_config = self.config.verl_config()
            self._build_actors()


def _batch_rows(data: Any) -> list[dict[str, Any]]:
    """The DataProto's rows as :attr:`GRPOTrainer.last_batch` holds sequences (token-aligned lists)."""
    b = data.batch
    rows = []
    for i in range(len(data)):
        attn = b["attention_mask"][i]
        P = b["prompts"].shape[1]
        prompt = b["prompts"][i][attn[:P].bool()].tolist()
        n = int(attn[P:].sum())
        response = b["responses"][i][:n].tolist()
        mask = b["response_mask"][i][:n].tolist()
        zeros = [0.0] * len(prompt)
        adv = b["advantages"][i][:n].tolist()
        rows.append({
            "rollout_id": data.non_tensor_batch["rollout_id"][i], "group_id": data.non_tensor_batch["uid"][i],
            "input_ids": prompt + response, "response_mask": [0] * len(prompt) + mask,
            "advantage": float(next((a for a, m in zip(adv, mask) if m), 0.0)),
            "advantages": zeros + [a if m else 0.0 for a, m in zip(adv, mask)],
            "engine_logprobs": zeros + ([lp if m else 0.0
                                         for lp, m in zip(b["rollout_log_probs"][i][:n].tolist(), mask)]
                                        if "rollout_log_probs" in b.keys() else [0.0] * n),
            "trainer_logprobs": zeros + [lp if m else 0.0 for lp, m in zip(b["old_log_probs"][i][:n].tolist(), mask)],
        })
    return rows


def _episode_advantages(rows: list[dict[str, Any]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for r in rows:
        out.setdefault(r["rollout_id"], r["advantage"])
    return out
