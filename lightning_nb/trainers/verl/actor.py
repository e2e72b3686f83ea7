"""verl's actor (old log-probs and the PPO update) on a model already in memory, in this process, without Ray.

:class:`VerlActor` is verl's FSDP training engine (``FSDPEngineWithLMHead``) and PPO loss
(``verl.workers.utils.losses.ppo_loss``) around a plain Hugging Face model that is already in
memory (e.g. ``TransformersEngine.model``, updated in place), with verl's configuration composed
from its own Hydra defaults (:func:`ppo_config`). No Ray cluster, no FSDP wrapping, no model loaded
from disk; CPU or one CUDA device. :mod:`lightning_nb.trainers.verl.patches` lists what is patched.
verl is imported inside the functions.
"""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
from collections.abc import Sequence
from typing import Any, Optional

from lightning_nb.trainers.verl.patches import (ensure_process_group, require_verl, save_model_config,
                                                use_cpu_platform_without_gpu, use_torch_padding_without_flash_attn)

__all__ = ["IN_PROCESS_OVERRIDES", "ppo_config", "VerlActor"]

# Hydra overrides of verl's ppo_trainer.yaml that the in-process actor needs (the caller's come after them).
IN_PROCESS_OVERRIDES: tuple[str, ...] = (
    # verl's packed ("remove padding") forward needs flash-attn varlen kernels; the padded path works everywhere
    "actor_rollout_ref.model.use_remove_padding=false",
    # micro-batches by a token budget, so any batch size works (verl's fixed micro-batch must divide the mini-batch)
    "actor_rollout_ref.actor.use_dynamic_bsz=true",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=4096",
    "algorithm.adv_estimator=grpo",
)



# ----- verl's configuration -------------------------------------------------------------
def ppo_config(overrides: Sequence[str] = ()) -> Any:
    """verl's own ``ppo_trainer.yaml``, composed by Hydra, with :data:`IN_PROCESS_OVERRIDES` then ``overrides``.

    ``overrides`` are Hydra override strings, e.g.
    ``["actor_rollout_ref.actor.optim.lr=1e-5", "actor_rollout_ref.actor.ppo_epochs=2"]``.
    Returns the ``omegaconf.DictConfig`` (printable with ``OmegaConf.to_yaml``); verl's dataclasses
    validate their sections when :class:`VerlActor` converts them.
    """
    require_verl()
    import verl
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    if GlobalHydra.instance().is_initialized():  # a notebook may have composed another config before
        GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose("ppo_trainer", overrides=[*IN_PROCESS_OVERRIDES, *overrides])


# ----- verl's actor, in this process ----------------------------------------------------
class VerlActor:
    """verl's actor (old log-probs and the PPO update) on a model already in memory, without Ray.

    Mirrors ``ActorRolloutRefWorker.init_model`` / ``TrainingWorker`` / ``RayPPOTrainer``: the
    actor section of ``config`` becomes verl's ``FSDPActorConfig``, the loss is
    ``functools.partial(verl.workers.utils.losses.ppo_loss, config=actor_config)``, and the engine is
    verl's ``FSDPEngineWithLMHead`` with the build hooks patched to adopt ``model`` (see the module
    docstring of :mod:`lightning_nb.trainers.verl.patches`). ``model`` is updated in place; ``optimizer``
    defaults to verl's ``build_optimizer``
    (AdamW from ``actor_rollout_ref.actor.optim``).

    Args:
        model: a ``transformers`` causal LM (``model(input_ids=..., attention_mask=...,
            position_ids=...).logits``), on the device it will train on.
        config: :func:`ppo_config`'s result; None: ``ppo_config()``.
        optimizer: a torch optimizer over ``model``'s trainable parameters, or None.
        lr_scheduler: the scheduler :meth:`update_policy` steps once per call, or None for verl's own
            (built from ``actor_rollout_ref.actor.optim``).
        forward_only: score only (e.g. the reference policy): no optimizer, no scheduler
            (verl's ``engine_config.forward_only``).
        response_logits_only: patch 6 (:mod:`lightning_nb.trainers.verl.patches`): the output head from each
            micro-batch's first response position on, not over the prompts (the same log-probs where verl reads
            them); False: verl's own head over every position.
        prefix_tree: patch 7: each micro-batch forwarded as one prefix tree where patch 6 applies (the same
            log-probs and gradients, a shared prompt forwarded once); False: padded rows.
    """

    def __init__(self, model: Any, config: Any = None, *, optimizer: Any = None, lr_scheduler: Any = None,
                 forward_only: bool = False, response_logits_only: bool = True, prefix_tree: bool = True) -> None:
        import functools

        import torch

        require_verl()
        use_cpu_platform_without_gpu()
        use_torch_padding_without_flash_attn()
        ensure_process_group()
        from omegaconf import OmegaConf, open_dict
        from verl.utils.config import omega_conf_to_dataclass
        from verl.workers.utils.losses import ppo_loss

        self.config = config if config is not None else ppo_config()
        cfg = self.config.actor_rollout_ref
        self._config_dir = tempfile.TemporaryDirectory(prefix="lightning-nb-verl-")
        save_model_config(model, self._config_dir.name)
        model_section = OmegaConf.create(OmegaConf.to_container(cfg.model, resolve=True))
        with open_dict(model_section):
            model_section.path = self._config_dir.name
            model_section.load_tokenizer = False
        self.model_config = omega_conf_to_dataclass(model_section)
        self.actor_config = omega_conf_to_dataclass(cfg.actor)
        self.actor_config.model_config = self.model_config
        engine_config = self.actor_config.engine
        # as ActorRolloutRefWorker.init_model and TrainingWorker.__init__ assign them
        engine_config.use_dynamic_bsz = cfg.actor.use_dynamic_bsz
        engine_config.infer_max_token_len_per_gpu = cfg.rollout.log_prob_max_token_len_per_gpu
        engine_config.infer_micro_batch_size_per_gpu = cfg.rollout.log_prob_micro_batch_size_per_gpu
        engine_config.max_token_len_per_gpu = cfg.actor.ppo_max_token_len_per_gpu
        engine_config.micro_batch_size_per_gpu = cfg.actor.ppo_micro_batch_size_per_gpu
        engine_config.use_remove_padding = self.model_config.get("use_remove_padding", False)
        engine_config.use_fused_kernels = self.model_config.get("use_fused_kernels", False)
        engine_config.forward_only = forward_only
        if self.model_config.lora_rank:
            raise ValueError("VerlActor adopts the model as it is: give it a peft model instead of "
                             "actor_rollout_ref.model.lora_rank > 0")
        self.engine = _engine_class()(model_config=self.model_config, engine_config=engine_config,
                                      optimizer_config=self.actor_config.optim,
                                      checkpoint_config=self.actor_config.checkpoint)
        self.engine.given_module, self.engine.given_optimizer = model, optimizer
        self.engine.given_lr_scheduler = lr_scheduler
        self.engine.response_logits_only = response_logits_only
        self.engine.prefix_tree = prefix_tree
        with contextlib.redirect_stdout(io.StringIO()):  # verl prints the model size and the LR schedule
            self.engine.initialize()
        self.model, self.optimizer = self.engine.module, self.engine.optimizer
        self.lr_scheduler = self.engine.lr_scheduler
        self.loss_fn = functools.partial(ppo_loss, config=self.actor_config)
        self._torch = torch

    @property
    def forward_counts(self) -> Optional[list]:
        """``[tokens forwarded, tokens a prefix tree shared]`` over the policy forwards since it was set to a
        ``[0, 0]`` list (patch 7 counts into it); None: not counting."""
        return self.engine.forward_counts

    @forward_counts.setter
    def forward_counts(self, counts: Optional[list]) -> None:
        self.engine.forward_counts = counts

    @property
    def device(self) -> Any:
        """The ``torch.device`` of the model's parameters: where verl computes, and where its outputs are."""
        return next(self.model.parameters()).device

    def _on_device(self, data: Any) -> Any:
        """``data`` with its tensors on :attr:`device` (``DataProto.to``, in place, only when some are elsewhere)."""
        device = self.device
        if any(v.device != device for v in data.batch.values()):
            return data.to(device)
        return data

    def _mode_kwargs(self) -> dict[str, bool]:
        """Arguments for verl's ``engine.eval_mode()`` / ``train_mode()``.

        Those contexts move an offloaded model or optimizer in on entry and out on exit. With neither
        offloaded (``fsdp_config.param_offload`` / ``optimizer_offload`` false, our default) the move is
        empty, but on a CPU device verl still runs ``gc.collect()`` on entry and on exit: about 0.3 s each
        in a test process, six times a step. Skip the contexts' offload step then; with offload set, it runs.
        """
        engine = self.engine
        return {"disable_auto_offload": not (engine.is_param_offload_enabled or engine.is_optimizer_offload_enabled)}

    def _no_padding(self, data: Any, **non_tensor: Any) -> Any:
        """``RayPPOTrainer``'s steps 1–3: DataProto → TensorDict → verl's no-padding layout, plus the
        per-call keys ``TrainingWorker`` injects."""
        from verl.utils import tensordict_utils as tu
        from verl.workers.utils.padding import left_right_2_no_padding

        td = left_right_2_no_padding(data.to_tensordict())
        tu.assign_non_tensor(td, **non_tensor)
        return td

    def compute_log_prob(self, data: Any, *, calculate_entropy: bool = False,
                         max_token_len: Optional[int] = None) -> Any:
        """The current policy's log-probs of ``data``'s responses, as verl's ``_compute_old_log_prob``.

        ``max_token_len``: the token budget of one forward (verl's dynamic micro-batching);
        None: ``rollout.log_prob_max_token_len_per_gpu``.

        Returns a ``DataProto`` with ``old_log_probs`` (B, R) float32 (0 on padding; to be
        ``union``-ed into ``data``), and ``entropys`` (B, R) with ``calculate_entropy``, on :attr:`device`
        (``data`` is moved there first when it is elsewhere, in place as ``DataProto.to`` moves; building it
        there, ``triplets_to_dataproto(..., device=actor.device)``, saves the copy).
        """
        from verl import DataProto
        from verl.utils import tensordict_utils as tu
        from verl.workers.utils.padding import no_padding_2_padding

        ec = self.engine.engine_config
        td = self._no_padding(self._on_device(data), calculate_entropy=calculate_entropy, compute_loss=False,
                              use_remove_padding=ec.use_remove_padding, use_dynamic_bsz=ec.use_dynamic_bsz,
                              max_token_len_per_gpu=max_token_len or ec.infer_max_token_len_per_gpu,
                              micro_batch_size_per_gpu=ec.infer_micro_batch_size_per_gpu,
                              use_fused_kernels=ec.use_fused_kernels)
        was_training = self.model.training
        try:
            with self.engine.eval_mode(**self._mode_kwargs()):
                out = self.engine.infer_batch(td, loss_function=None)
        finally:
            self.model.train(was_training)
        result = {"old_log_probs": no_padding_2_padding(out["model_output"]["log_probs"], td).float()}
        if calculate_entropy:
            result["entropys"] = no_padding_2_padding(out["model_output"]["entropy"], td).float()
        return DataProto.from_tensordict(tu.get_tensordict(result))

    def mini_batch_rows(self, rows: int, mini_batch_size: Optional[int] = None) -> int:
        """Rows per mini-batch of :meth:`update_policy` for a batch of ``rows``: ``mini_batch_size``, else
        ``ppo_mini_batch_size × rollout.n``, capped at ``rows``."""
        cfg = self.config.actor_rollout_ref
        return min(mini_batch_size or cfg.actor.ppo_mini_batch_size * cfg.rollout.n, rows)

    def optimizer_steps(self, rows: int, mini_batch_size: Optional[int] = None) -> int:
        """How many optimizer steps :meth:`update_policy` takes on ``rows`` rows: ``ppo_epochs`` × mini-batches."""
        mini = self.mini_batch_rows(rows, mini_batch_size)
        return self.actor_config.ppo_epochs * -(-rows // mini)

    def update_policy(self, data: Any, *, mini_batch_size: Optional[int] = None,
                      max_token_len: Optional[int] = None, old_from_forward: bool = False,
                      rollout_correction: Any = None) -> dict[str, float]:
        """verl's PPO update on ``data`` (``RayPPOTrainer._update_actor`` + ``TrainingWorker.train_mini_batch``).

        ``data`` needs ``old_log_probs`` and ``advantages`` (B, R) besides the keys of
        :func:`triplets_to_dataproto` (and ``ref_log_prob`` with ``actor.use_kl_loss``).

        ``old_from_forward=True`` (only for an update of one optimizer step, :meth:`optimizer_steps` == 1): π_old
        is the update's own forward, detached, so no :meth:`compute_log_prob` pass runs before it. Before its
        step the policy is the one that pass would score, so the loss and its gradient are the same (the ratio
        π/π_old is exactly 1; verl's loss otherwise sees 1 within float noise). ``data`` then needs no
        ``old_log_probs``: they are set on it, (B, R) float32 on :attr:`device`, as :meth:`compute_log_prob`
        returns them. ``rollout_correction`` (verl's ``algorithm.rollout_correction`` section with ``rollout_is``
        set, no rejection sampling, no batch normalization; None: off): each micro-batch's ``rollout_is_weights``
        are computed from those log-probs and ``rollout_log_probs`` (verl's
        ``compute_rollout_correction_and_rejection_mask``) before verl's loss reads them, as the decoupled mode
        computes them from the π_old pass.

        ``ppo_epochs`` times, the batch is cut into consecutive mini-batches of ``mini_batch_size``
        rows (the last one may be smaller; None: ``ppo_mini_batch_size × rollout.n``, capped at B);
        each mini-batch is one ``engine.train_batch`` (verl's dynamic micro-batches of at most
        ``max_token_len`` tokens, ``ppo_loss`` normalised over the whole mini-batch, ``clip_grad``,
        one optimizer step). verl's own ``make_iterator`` needs B to be a multiple of the mini-batch
        size, which an agent batch (forks, dropped groups) rarely is; without ``actor.shuffle`` it
        yields the same consecutive slices. The LR scheduler steps once per call. Returns the
        metrics averaged over the mini-batches: verl's ``actor/pg_loss``, ``actor/pg_clipfrac``,
        ``actor/ppo_kl``, ... plus ``loss``, ``grad_norm``, ``lr`` (after the step),
        ``optimizer_steps``.

        Raises:
            ValueError: a key is missing, ``actor.shuffle`` is set (not supported here), or ``old_from_forward``
                for an update of more than one optimizer step.
        """
        needed = ("advantages",) if old_from_forward else ("old_log_probs", "advantages")
        missing = [k for k in needed if k not in data.batch.keys()]
        if missing:
            raise ValueError(f"update_policy() needs {missing} in data.batch: union compute_log_prob()'s result "
                             "(or rollout_log_probs as old_log_probs) and grpo_advantages()")
        ac = self.actor_config
        if ac.shuffle:
            raise ValueError("actor_rollout_ref.actor.shuffle=true is not supported by the in-process actor; "
                             "mini-batches are consecutive rows")
        if old_from_forward and self.optimizer_steps(len(data), mini_batch_size) != 1:
            raise ValueError("update_policy(old_from_forward=True) needs one optimizer step (ppo_epochs=1, one "
                             "mini-batch): later steps need π_old from before the first; run compute_log_prob() first")
        data = self._on_device(data)
        B = len(data)
        mini = self.mini_batch_rows(B, mini_batch_size)
        tds = [self._train_dict(data[i: i + mini], max_token_len, old_from_forward) for i in range(0, B, mini)]
        loss_fn = _old_from_forward(self.loss_fn, rollout_correction) if old_from_forward else self.loss_fn
        rows: list[dict[str, float]] = []
        was_training = self.model.training
        try:
            with self.engine.train_mode(**self._mode_kwargs()):
                for _ in range(ac.ppo_epochs):
                    for td in tds:
                        out = self.engine.train_batch(td, loss_function=loss_fn)
                        rows.append(_reduce_metrics(out))
            lr = self.engine.lr_scheduler_step()
        finally:
            self.model.train(was_training)
        if old_from_forward:  # the forward's log-probs, back in row order, as compute_log_prob() returns them
            from verl.workers.utils.padding import no_padding_2_padding

            data.batch["old_log_probs"] = no_padding_2_padding(out["model_output"]["log_probs"], tds[0]).float()
        metrics = {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]}
        metrics.update(lr=lr, optimizer_steps=float(len(rows)))
        return metrics

    def _train_dict(self, part: Any, max_token_len: Optional[int], return_log_probs: bool) -> Any:
        """One mini-batch as ``TrainingWorker.train_mini_batch`` hands it to ``engine.train_batch``;
        ``return_log_probs``: verl's ``return_model_output``, so the forward's log-probs come back in row order."""
        ac, ec = self.actor_config, self.engine.engine_config
        return self._no_padding(
            part, calculate_entropy=ac.calculate_entropy or ac.entropy_coeff != 0.0, distillation_use_topk=False,
            distillation_only=False, global_batch_size=len(part), compute_loss=True,
            use_remove_padding=ec.use_remove_padding, use_dynamic_bsz=ec.use_dynamic_bsz,
            max_token_len_per_gpu=max_token_len or ec.max_token_len_per_gpu,
            micro_batch_size_per_gpu=ec.micro_batch_size_per_gpu, use_fused_kernels=ec.use_fused_kernels,
            return_model_output=return_log_probs)


def _old_from_forward(loss_fn: Any, rollout_correction: Any) -> Any:
    """verl's loss with π_old taken from the forward it is given: ``old_log_probs`` (b, R) = the micro-batch's own
    log-probs, detached (and with ``rollout_correction``, verl's IS weights from them and ``rollout_log_probs``)."""
    def loss(model_output: Any, data: Any, dp_group: Any = None) -> Any:
        from verl.workers.utils.padding import no_padding_2_padding

        old = no_padding_2_padding(model_output["log_probs"], data).detach().float()
        data["old_log_probs"] = old
        if rollout_correction is not None and "rollout_log_probs" in data.keys():
            from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

            weights, _, _ = compute_rollout_correction_and_rejection_mask(
                old_log_prob=old, rollout_log_prob=data["rollout_log_probs"], response_mask=data["response_mask"],
                rollout_is=rollout_correction.get("rollout_is"),
                rollout_is_threshold=rollout_correction.get("rollout_is_threshold", 2.0))
            data["rollout_is_weights"] = weights.batch["rollout_is_weights"]
        return loss_fn(model_output=model_output, data=data, dp_group=dp_group)

    return loss


def _reduce_metrics(out: dict[str, Any]) -> dict[str, float]:
    """One ``train_batch`` output → floats: verl ``Metric``s merged over micro-batches, losses summed."""
    from verl.utils.metric import Metric

    metrics: dict[str, float] = {"loss": float(sum(out["loss"])), "grad_norm": float(out["metrics"]["grad_norm"])}
    for key, values in out["metrics"].items():
        if key == "grad_norm":
            continue
        values = values if isinstance(values, list) else [values]
        if values and isinstance(values[0], Metric):
            merged = values[0].init_list()
            for v in values:
                merged.append(v)
            metrics[key] = float(merged.aggregate())
        else:
            metrics[key] = float(sum(float(v) for v in values) / len(values))
    return metrics


def _engine_class() -> type:
    """verl's ``FSDPEngineWithLMHead`` with the build hooks that adopt a given module (patch 1)."""
    import warnings

    with warnings.catch_warnings():  # verl.workers.engine warns about each optional backend not installed
        warnings.simplefilter("ignore")
        from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    from lightning_nb.trainers.verl.patches import response_tree, response_window, tree_log_probs, window_log_probs

    class _InProcessEngine(FSDPEngineWithLMHead):
        given_module: Any = None
        given_optimizer: Any = None
        given_lr_scheduler: Any = None
        response_logits_only: bool = True  # patch 6
        prefix_tree: bool = True  # patch 7
        forward_counts: Optional[list] = None  # [tokens forwarded, tokens a tree shared], when counting

        def prepare_model_inputs(self, micro_batch: Any) -> Any:  # patch 6: logits from the first response position
            model_inputs, output_args = super().prepare_model_inputs(micro_batch)
            window = response_window(micro_batch, self.module) if self.response_logits_only else None
            tree = response_tree(micro_batch, window, self.module) if window is not None and self.prefix_tree else None
            shared = 0
            if tree is not None:  # patch 7: the rows as one prefix tree
                model_inputs, output_args["response_tree"] = tree[0], tree[1]
                shared = tree[1].tree.shared_tokens
            elif window is not None:
                model_inputs["logits_to_keep"] = window.keep
                output_args["response_window"] = window
            if self.forward_counts is not None:
                self.forward_counts[0] += int(model_inputs["input_ids"].numel())
                self.forward_counts[1] += shared
            return model_inputs, output_args

        def prepare_model_outputs(self, output: Any, output_args: Any, micro_batch: Any,
                                  logits_processor_func: Any) -> Any:
            if "response_tree" in output_args:
                return {"log_probs": tree_log_probs(output.logits, output_args["temperature"], micro_batch,
                                                    output_args["response_tree"])}
            window = output_args.get("response_window")
            if window is None:
                return super().prepare_model_outputs(output, output_args, micro_batch, logits_processor_func)
            return {"log_probs": window_log_probs(output.logits, output_args["temperature"], micro_batch, window)}

        def initialize(self) -> None:  # no FSDPCheckpointManager: checkpoints are the trainer's
            self._build_model_optimizer()

        def _build_module(self) -> Any:
            return self.given_module

        def _build_fsdp_module(self, module: Any) -> Any:
            self._autocast_dtype = next(module.parameters()).dtype  # float32: no autocast
            self.scaler = None
            return module

        def _build_optimizer(self, module: Any) -> Any:
            if self.given_optimizer is not None:
                return self.given_optimizer
            return super()._build_optimizer(module)

        def _build_lr_scheduler(self, optimizer: Any) -> Any:
            if self.given_lr_scheduler is not None:
                return self.given_lr_scheduler
            return super()._build_lr_scheduler(optimizer)

    return _InProcessEngine
