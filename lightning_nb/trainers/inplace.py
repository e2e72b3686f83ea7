"""The weights side both trainers share: the engine's own model trained in place, its optimizer and its state.

:class:`InPlaceTrainer` implements the parts of the :class:`~lightning_nb.trainers.base.Trainer`
contract that do not depend on how the update is computed: it moves the engine's model to
``config.device`` / ``config.dtype`` (the engine serves it from there), injects LoRA adapters, keeps
the frozen reference model, builds the AdamW optimizer and the LR schedule (:func:`lr_factor`),
applies config edits made while paused, and saves and restores all of it (:meth:`state_dict`,
:meth:`save_pretrained`). :class:`~lightning_nb.trainers.grpo.trainer.GRPOTrainer` and
:class:`~lightning_nb.trainers.verl.trainer.VerlTrainer` are its two subclasses, side by side.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

from lightning_nb.errors import ConfigError
from lightning_nb.models.device import place_model, set_gradient_checkpointing
from lightning_nb.models.lora import adapter_state_dict, add_lora, base_state_dict, has_lora, write_hf_folder
from lightning_nb.trainers.base import Trainer
from lightning_nb.trainers.checkpoint import check_signature, model_signature, weights_fingerprint
from lightning_nb.trainers.config import TrainerConfig, lr_factor
from lightning_nb.trainers.edits import ConfigChange, ConfigWatch

__all__ = ["InPlaceTrainer"]

log = logging.getLogger(__name__)


class InPlaceTrainer(Trainer):
    """A :class:`~lightning_nb.trainers.base.Trainer` that trains ``engine.model`` in place with a torch optimizer.

    Args:
        engine: serves the policy; its ``model`` is updated in place, and moved to
            ``config.device`` / ``config.dtype`` on construction (the engine follows it).
        config: a :class:`~lightning_nb.trainers.config.TrainerConfig` (a ``GRPOConfig`` or a ``VerlConfig``).

    Raises:
        ConfigError: ``config.device`` is not available here, ``config.gradient_checkpointing``
            is set for a model without transformers decoder layers, or ``lora_rank=0`` for a model that
            already has LoRA adapters.
    """

    def __init__(self, engine: Any, config: TrainerConfig) -> None:
        import torch

        from lightning_nb.trainers.optim import make_optimizer

        super().__init__(engine, config)
        self.model = engine.model
        cfg = self.config
        self.peft_model = None  # the peft.PeftModel around self.model when training LoRA adapters
        with engine.lock:  # the engine serves the moved model from its next batch on (it reads the device each time)
            place_model(self.model, cfg.device, cfg.dtype)
            if cfg.lora_rank:  # injected in place: the engine serves the adapted model with no copy
                self.peft_model = add_lora(self.model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_target_modules,
                                           adapter_dtype=cfg.lora_adapter_dtype)
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
                                                         "lora_alpha", "lora_target_modules", "lora_adapter_dtype",
                                                         "track_reference_kl")}
        self._trainable = [p for p in self.model.parameters() if p.requires_grad]  # the adapters only, with LoRA
        # created after the move, so its state lives beside the weights
        self.optimizer = make_optimizer(self._trainable, dtype=cfg.dtype, lr=cfg.learning_rate,
                                        weight_decay=cfg.weight_decay)
        # one scheduler step per update(); _sync_config re-applies lr_factor with the config as edited before each
        # update. The lambda holds the config, not self: a trainer -> scheduler -> trainer cycle would keep the
        # weights and AdamW state of discarded trainers alive until the cyclic garbage collector runs.
        config = self.config
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: lr_factor(s, config))
        self.config_watch = ConfigWatch(self.config)  # what the last update applied of the config

    # ----- config edits while paused ----------------------------------------------------
    def _sync_config(self) -> list[ConfigChange]:
        """Apply edits of :attr:`config` since the last update (lock held); returns them (the update's
        :attr:`~lightning_nb.trainers.base.Update.config_changes`, which the algorithm logs).

        ``learning_rate`` and ``weight_decay`` go into the optimizer's param groups; every
        other field is read at each update.

        With a schedule, ``learning_rate`` is its peak: the update after ``s`` updates uses
        ``learning_rate × lr_factor(s)`` (:func:`lr_factor`) with the config as it is now. So an
        edit of ``learning_rate`` rescales the rest of the schedule (it does not restart the
        warmup), and edits of ``lr_scheduler``, ``warmup_steps`` or ``total_steps`` reshape it
        from the current update count on.

        Raises:
            ConfigError: the edited config is invalid, or ``kl_coef > 0`` without a reference model.
        """
        self.check_config()
        cfg, done = self.config, self.scheduler.last_epoch  # updates done so far
        if cfg.lr_scheduler != "constant" and done == cfg.total_steps:
            log.warning("the %s LR schedule ended after total_steps=%d updates: the learning rate is 0 from now "
                        "on; raise GRPOConfig.total_steps to keep training", cfg.lr_scheduler, cfg.total_steps)
        self.scheduler.base_lrs = [cfg.learning_rate] * len(self.optimizer.param_groups)
        for group in self.optimizer.param_groups:
            group["initial_lr"] = cfg.learning_rate
            group["lr"] = cfg.learning_rate * lr_factor(done, cfg)
            group["weight_decay"] = cfg.weight_decay
        changes = self.config_watch.take(self.config)
        for change in changes:
            log.info("config changed at update %d: %s", self.updates_applied + 1, change.text)
        return changes

    def check_config(self) -> None:
        """Raise ConfigError for an invalid config edit, or one of a field fixed at construction (``resume()``
        and every update call it). A field fixed at construction is named first: another field's rule may
        depend on it (``kl_every`` on ``track_reference_kl``)."""
        for name, built in self._placement.items():
            if getattr(self.config, name) != built:
                raise ConfigError(
                    f"GRPOConfig.{name} was {built!r} when this trainer was built and is now "
                    f"{getattr(self.config, name)!r}; it is set at construction: set it back, or save() and "
                    f"build a new GRPOTrainer with GRPOConfig({name}={getattr(self.config, name)!r}), then load()")
        self.config.validate()
        if self.config.kl_coef > 0 and self.reference is None and self.peft_model is None:
            raise ConfigError(
                f"GRPOConfig.kl_coef={self.config.kl_coef} needs a reference model, and this trainer was built "
                "with kl_coef=0 and track_reference_kl=False, so it kept none; set kl_coef back to 0, or build "
                "the trainer with GRPOConfig(track_reference_kl=True) (and load() a checkpoint to continue)")

    def _advance_schedule(self) -> None:
        """One LR-scheduler step per update (also one that took no optimizer step: the schedule counts updates)."""
        import warnings

        with warnings.catch_warnings():  # torch warns if the first scheduler step has no optimizer step before it
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)`")
            self.scheduler.step()

    def _reference_active(self) -> bool:
        """Whether this update scores the reference policy (the kept copy of the initial weights, or with LoRA the
        base model with its adapters disabled) and so reports ``kl``: every update while ``kl_coef > 0`` (the KL
        term needs it), and with ``track_reference_kl`` the updates whose metrics row has a ``step`` that is a
        multiple of ``kl_every``. Read during an update (:attr:`step` is then the number of updates before it)."""
        cfg = self.config
        if cfg.kl_coef > 0:
            return True
        return cfg.track_reference_kl and (self.updates_applied + 1) % cfg.kl_every == 0

    # ----- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The trainer's part of a run checkpoint (call it inside :meth:`frozen`, or at a step boundary).

        ``model_signature``; ``model`` (the weights, or with LoRA the adapters only); ``optimizer`` and
        ``scheduler`` state; ``step`` (updates applied), ``config`` (as edited);
        ``weight_version`` (the engine's); ``reference`` (the reference model's weights fingerprint and how
        to rebuild it: ``source`` ``"default"`` for the default model's initial weights) and ``lora_base``
        (a fingerprint of the frozen base weights with LoRA), which :meth:`load_state_dict` checks.
        """
        return {
            "model_signature": model_signature(self.model),
            "model": self.model.state_dict() if self.peft_model is None else adapter_state_dict(self.model),
            "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
            "step": self.updates_applied, "config": asdict(self.config),
            "weight_version": self.engine.weight_version,
            "reference": None if self.reference is None else {
                "fingerprint": weights_fingerprint(self.reference),
                "source": getattr(self.engine, "model_source", None)},
            "lora_base": None if self.peft_model is None else {"fingerprint": self._base_fingerprint()},
        }

    def load_state_dict(self, state: dict[str, Any], *, keep_config: bool = False, source: Any = "the state") -> None:
        """Restore :meth:`state_dict` into this trainer and its engine's model (served at once).

        The config: by default :attr:`config` takes the saved values (edits made while paused before
        the save included), so the run continues as it was; each field this replaces is logged as a
        warning. Fields fixed at construction (``device``, ``dtype``, ``gradient_checkpointing``,
        ``lora_*``, ``track_reference_kl``) stay this trainer's, and so does ``kl_every`` unless both the
        checkpoint's run and this trainer track KL: a checkpoint that tracked it (every checkpoint from before
        issue 49, where that was the default) loads into a trainer that does not, with a warning, and its
        reference fingerprint is not checked. ``keep_config=True`` keeps this trainer's config instead (as verl
        and TRL do on resume): the fields that differ from the saved ones are applied at the next update
        and recorded in its ``Update.config_changes`` and the ``config_changes`` metric, like edits made while
        paused.

        Raises:
            ConfigError: ``state`` was saved from another model, by a trainer with other LoRA fields, its
                config is refused by this version, its ``kl_coef > 0`` needs a reference model this trainer
                was built without (unless ``keep_config``), or its reference model differs from this trainer's
                and cannot be rebuilt. ``source`` (the checkpoint's path) names it in the message.
        """
        self._check_lora_matches(state, source)
        check_signature(state["model_signature"], self.model, source)
        saved_config = self._saved_config(state.get("config") or {}, source, check=not keep_config)
        with self._updating, self.engine.lock:
            self._restore_reference(state.get("reference"), source)
            self._restore_weights(state, source)
            self.optimizer.load_state_dict(state["optimizer"])
            self.updates_applied = int(state["step"])
            if state.get("scheduler") is not None:
                self.scheduler.load_state_dict(state["scheduler"])
            else:  # a checkpoint from before LR schedules: the schedule counts updates
                self.scheduler.last_epoch = self.updates_applied
            self.engine.load_weights(self.model, version=int(state["weight_version"]))
            self._restore_config(saved_config, keep_config)

    def _restore_weights(self, state: dict[str, Any], path: Any) -> None:
        """The saved weights into :attr:`model` (with LoRA the adapters, after checking the base they were trained on)."""
        import torch

        if self.peft_model is None:
            self.model.load_state_dict(state["model"])
            return
        if not torch.equal(self._base_fingerprint(), state["lora_base"]["fingerprint"]):
            raise ConfigError(
                f"checkpoint {path} holds LoRA adapters trained on other base weights than this "
                "trainer's model; build the engine on the same base model as the run that saved it")
        self.model.load_state_dict(state["model"], strict=False)

    def _restore_config(self, saved_config: dict[str, Any], keep_config: bool) -> None:
        if keep_config:  # the next update applies (and records) this trainer's values over the checkpoint's
            self.config_watch.reset(self.config, saved_config)
            return
        for name, value in saved_config.items():
            if getattr(self.config, name) != value:
                log.warning("load: config.%s = %r from the checkpoint (was %r here); pass "
                            "keep_config=True to keep this trainer's value", name, value, getattr(self.config, name))
                setattr(self.config, name, value)
        self.config_watch.reset(self.config)

    def _saved_config(self, saved: dict[str, Any], path: Any, check: bool = True) -> dict[str, Any]:
        """The checkpoint's GRPOConfig fields that :meth:`load` may apply (all but those fixed at construction,
        and fields this version does not know), checked to form a valid config before anything is loaded."""
        from dataclasses import fields, replace

        known = {f.name for f in fields(type(self.config))} - set(self._placement)  # a subclass's fields too
        out = {k: v for k, v in saved.items() if k in known}
        self._saved_kl_fields(saved, out, path)
        if not check:
            return out
        if out.get("kl_coef", 0.0) > 0 and self.reference is None and self.peft_model is None:
            raise ConfigError(
                f"checkpoint {path} was trained with kl_coef={out['kl_coef']}, which needs a reference model, and "
                "this trainer was built without one (kl_coef=0, track_reference_kl=False); build it with "
                "GRPOConfig(track_reference_kl=True) on the same starting weights, or load with keep_config=True "
                "to train on with this trainer's kl_coef")
        try:
            replace(self.config, **out)
        except ConfigError as exc:
            raise ConfigError(f"checkpoint {path} holds a config this version refuses ({exc}); load it with "
                              "keep_config=True to train on with this trainer's config") from None
        return out

    def _saved_kl_fields(self, saved: dict[str, Any], out: dict[str, Any], path: Any) -> None:
        """The checkpoint's KL measurement against this trainer's (``track_reference_kl`` is set at construction, so
        the saved one is not applied): ``kl_every`` is taken from ``out`` unless both track KL, and a warning says
        when the checkpoint's run measured KL (the default before issue 49) and this trainer does not."""
        if not (saved.get("track_reference_kl") and self.config.track_reference_kl):
            out.pop("kl_every", None)
        if saved.get("track_reference_kl") and not self.config.track_reference_kl:
            log.warning("load: checkpoint %s was saved by a trainer that measured KL to its initial weights "
                        "(track_reference_kl=True, the default before issue 49); this trainer was built without "
                        "(track_reference_kl is set at construction), so kl is reported only while kl_coef > 0: "
                        "build it with GRPOConfig(track_reference_kl=True) to keep measuring it", path)

    def _base_fingerprint(self) -> Any:
        """Per-tensor float64 sums of the frozen base weights of a LoRA model (see ``weights_fingerprint``)."""
        import torch

        with torch.no_grad():
            return torch.stack([t.detach().to("cpu", torch.float64).sum() for t in base_state_dict(self.model).values()])

    def _check_lora_matches(self, state: dict[str, Any], path: Any) -> None:
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

        * ``merged=True`` (the default): a Hugging Face model folder (:func:`lightning_nb.models.lora.write_hf_folder`:
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
                assert self.peft_model is not None  # lora_rank > 0, checked above
                self.peft_model.save_pretrained(str(path), save_embedding_layers=False)
                return path
            return write_hf_folder(self.model, self.engine.tokenizer, path,
                                   stop_token_ids=self.engine.stop_token_ids, pad_token_id=self.engine.pad_token_id)

    def _restore_reference(self, saved: Optional[dict[str, Any]], path: Any) -> None:
        """Make this trainer's reference model the one the checkpoint was trained against."""
        if saved is None or self.reference is None:
            return
        import torch

        if torch.equal(weights_fingerprint(self.reference), saved["fingerprint"]):
            return
        if saved.get("source") == "default":  # rebuild the initial weights of the default model
            from lightning_nb.engines.transformers import load_default_model

            rebuilt, _ = load_default_model(device=self.config.device, dtype=self.config.dtype)
            rebuilt = rebuilt.eval().requires_grad_(False)
            if torch.equal(weights_fingerprint(rebuilt), saved["fingerprint"]):
                self.reference = rebuilt
                return
        raise ConfigError(
            f"checkpoint {path} was trained against a reference model (the initial weights) that differs from "
            "this trainer's, and it cannot be rebuilt; build this trainer on the same starting weights as the "
            "run that saved it, or use GRPOConfig(track_reference_kl=False, kl_coef=0)")

