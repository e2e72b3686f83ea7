"""The seven patches that let verl's actor run in this process, without Ray, on a model already in memory.

What runs in-process and what is patched (patch 1 in :mod:`lightning_nb.trainers.verl.actor`, 2–7 here;
nothing in verl's files).
verl 0.9.0 has no ``dp_actor.DataParallelPPOActor`` any more: its actor is
``engine_workers.ActorRolloutRefWorker`` → ``TrainingWorker`` → an engine from
``verl.workers.engine`` (FSDP: ``FSDPEngineWithLMHead``). ``TrainingWorker`` itself cannot be
built here without a Ray-style launch (``Worker.__init__`` reads ``RANK``/``WORLD_SIZE``/
``MASTER_ADDR``/``MASTER_PORT``, and the engine it builds loads the model from a path and wraps
it in FSDP), so :class:`~lightning_nb.trainers.verl.actor.VerlActor` drives the engine the way
``TrainingWorker.infer_batch`` / ``train_mini_batch`` and ``RayPPOTrainer._compute_old_log_prob`` / ``_update_actor`` do. The
departures:

1. ``_InProcessEngine(FSDPEngineWithLMHead)`` overrides four build hooks: ``_build_module``
   returns the given model (no ``from_pretrained``, no verl monkey patches), ``_build_fsdp_module``
   returns it unwrapped (autocast follows the model's own dtype: none in float32), and
   ``_build_optimizer`` / ``_build_lr_scheduler`` return the given optimizer / scheduler if one
   was passed (else verl's ``build_optimizer`` / its warmup schedules). ``initialize`` builds no
   FSDP checkpoint manager (checkpoints are the trainer's job). Forward, loss, micro-batching,
   gradient clipping (``clip_grad_norm_`` for a non-FSDP module is verl's own branch), the optimizer
   step and the LR scheduler are verl's code.
2. A one-process ``torch.distributed`` group (gloo, or ``cpu:gloo,cuda:nccl`` on a GPU, over an
   in-memory ``HashStore``: no port, no Ray) because the engine all-reduces token counts.
3. On a machine without a GPU, a CPU platform (:class:`_PlatformCPU`) registered through verl's
   own extension point ``verl.plugin.platform.PlatformRegistry`` / ``set_platform``: verl 0.9.0
   registers only nvidia/huawei/amd and falls back to CUDA, so ``get_device_id()`` would call
   ``torch.cuda.current_device()``.
4. Where ``flash_attn`` is not installed (CPU), verl's padding helpers
   (``verl.utils.attention_utils.unpad_input`` & co., which ``left_right_2_no_padding`` calls) are
   pointed at plain-torch equivalents of flash-attn's ``bert_padding`` functions (verl's own
   port, ``verl.utils.npu_flash_attn_utils``, needs einops, which verl does not declare), by
   replacing ``attention_utils._get_attention_functions``. verl 0.9.1 has the same torch fallback
   built in, so this patch can go when we move to 0.9.1.
5. The model's ``config.json`` is written to a temporary folder (with ``architectures`` filled in)
   because verl's ``HFModelConfig`` reads the model config from a path and asserts one architecture.
6. The output head only where log-probs are read (:func:`response_window` and :func:`window_log_probs`, hooked
   into ``_InProcessEngine.prepare_model_inputs`` / ``prepare_model_outputs``): verl's padded forward
   (``use_remove_padding=false``) takes logits and log-softmax at every position of every row, prompt included,
   although its loss and ``compute_log_prob`` read only the response positions. On the calc demo's batch (16 rows
   of ~250 tokens, ~60 of them after the prompt) that head was about a third of the update's CPU time
   (bench/README.md, issue 49). The model is called with ``logits_to_keep`` (transformers' own argument: logits
   from the micro-batch's first response position on), the log-probs are verl's ``logprobs_from_logits`` of
   those logits divided by each row's temperature, as verl computes them, and they fill verl's per-token layout
   at each row's response positions, 0 elsewhere (positions nothing reads). Where anything else reads the
   logits (entropy, ``calculate_sum_pi_squared``, distillation, fused kernels, remove-padding, multi-modal
   inputs) or the model takes no ``logits_to_keep``, verl's own code runs. ``VerlActor(response_logits_only=False)``
   turns it off.
7. Prefix trees (``TrainerConfig.prefix_tree``, :func:`response_tree` and :func:`tree_log_probs`, in the same two
   hooks, where patch 6 applies and the model's attention reads a 4-D mask): the micro-batch's rows go through
   the model as one prefix tree (:mod:`lightning_nb.trainers.prefix_tree`), so a prompt that several rows share
   is forwarded once, and the response positions' log-probs are verl's ``logprobs_from_logits`` of the logits of
   the nodes that hold them, divided by each row's temperature, in verl's per-token layout: the same values as
   patch 6 (float32: within 1e-5) and the same gradients. verl's dynamic micro-batching counts row tokens, not
   tree nodes, so ``VerlTrainer`` gives it :func:`~lightning_nb.trainers.prefix_tree.tree_token_budget`: a batch
   whose tree fits the budget is one micro-batch. ``VerlActor(prefix_tree=False)`` turns it off.

``import verl`` needs the ``ray`` *package* (``verl/protocol.py`` imports it at module level),
but nothing here starts or contacts Ray.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Optional

from lightning_nb.errors import MissingDependencyError

__all__ = ["require_verl", "use_cpu_platform_without_gpu", "use_torch_padding_without_flash_attn",
           "ensure_process_group", "save_model_config", "ResponseWindow", "response_window", "window_log_probs"]


def require_verl() -> None:
    """Import verl, or raise an ImportError that names the extra to install.

    Raises:
        MissingDependencyError: an ImportError: verl (or the ``ray`` package that ``verl/protocol.py``
            imports) is not installed.
    """
    try:
        import verl  # noqa: F401
    except ImportError as exc:
        raise MissingDependencyError(
            f"lightning_nb.trainers.verl.bridge and VerlTrainer need verl and the ray package it imports ({exc}); install "
            "the tested set with pip install 'lightning-nb[verl]' (CPU, verl 0.9.0) or 'lightning-nb[gpu]' "
            "(CUDA: verl[vllm]==0.9.1 with vllm 0.24.0, torch 2.11.0, transformers 5.9.0)") from exc


def save_model_config(model: Any, path: str) -> None:
    """Write ``model``'s ``config.json``, architecture named: verl's ``HFModelConfig`` asserts one (patch 5)."""
    import copy

    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a peft model: the wrapped one
    config = copy.deepcopy(base.config)
    if not getattr(config, "architectures", None):
        config.architectures = [type(base).__name__]
    config.save_pretrained(path)



@dataclass
class ResponseWindow:
    """Where one micro-batch's log-probs are read (patch 6): row ``i`` of ``b`` has ``lengths[i]`` tokens and its
    response positions are ``starts[i] <= t < lengths[i] - 1`` (position t scores token t + 1; ``starts[i]`` is its
    prompt length − 1); rows are right-padded to ``T`` tokens, and ``keep`` = ``T − min(starts)`` is the
    ``logits_to_keep`` the model is called with. Tensors are (b,) int64 on the batch's device."""

    starts: Any
    lengths: Any
    T: int
    keep: int


#: the non-tensor flags of a micro-batch by which something besides the log-probs reads the logits, or verl's
#: packed path runs (patch 6 needs each False; verl's default when absent in brackets)
_LOGIT_READERS = {"use_remove_padding": True, "use_fused_kernels": False, "calculate_entropy": False,
                  "calculate_sum_pi_squared": False, "distillation_use_topk": False, "distillation_only": False}


def response_window(micro_batch: Any, module: Any) -> Optional[ResponseWindow]:
    """The :class:`ResponseWindow` of a verl micro-batch (a TensorDict in verl's no-padding layout, with the
    ``prompts`` and ``attention_mask`` of :func:`~lightning_nb.trainers.verl.bridge.triplets_to_dataproto`), or None
    where verl's full head must run: a flag of :data:`_LOGIT_READERS` is set (or absent with a true default), the
    batch has multi-modal inputs or 3-D position ids, or ``module``'s forward takes no ``logits_to_keep``."""
    import inspect

    from verl.utils import tensordict_utils as tu

    if any(tu.get_non_tensor_data(data=micro_batch, key=k, default=d) for k, d in _LOGIT_READERS.items()):
        return None
    if "multi_modal_inputs" in micro_batch.keys() or micro_batch["position_ids"].dim() != 2:
        return None
    if "logits_to_keep" not in inspect.signature(type(module).forward).parameters:
        return None
    prompts, lengths = micro_batch["prompts"], micro_batch["input_ids"].offsets().diff()
    if prompts.is_nested:
        prompt_lens = prompts.offsets().diff()
    else:  # left-padded (b, P): as verl's no_padding_2_padding counts it
        prompt_lens = micro_batch["attention_mask"][:, : prompts.shape[1]].sum(dim=1)
    starts = (prompt_lens - 1).to(lengths.device, lengths.dtype)
    T = int(lengths.max())
    return ResponseWindow(starts=starts, lengths=lengths, T=T, keep=T - int(starts.min()))


def window_log_probs(logits_b_K_V: Any, temperature_b: Any, micro_batch: Any, window: ResponseWindow) -> Any:
    """verl's ``log_probs`` of a micro-batch from the logits of its :class:`ResponseWindow` (patch 6): a jagged
    nested tensor (b, j) as verl's ``prepare_model_outputs`` returns it, each row's response positions filled with
    ``logprobs_from_logits(logits / temperature, next token)`` (verl's function and division), 0 elsewhere.

    ``logits_b_K_V``: the model's logits of the last K = ``window.keep`` positions of the right-padded rows;
    ``temperature_b``: each row's sampling temperature (verl's ``output_args["temperature"]``)."""
    import torch
    from verl.utils.torch_functional import logprobs_from_logits

    ids = micro_batch["input_ids"]
    b, K = logits_b_K_V.shape[:2]
    first = window.T - K
    ids_b_T1 = torch.nested.to_padded_tensor(ids, padding=0, output_size=(b, window.T + 1))  # one more: t + 1
    positions_K = torch.arange(first, window.T, device=logits_b_K_V.device)
    sel_b_K = (positions_K >= window.starts[:, None]) & (positions_K < window.lengths[:, None] - 1)
    logits_b_K_V = logits_b_K_V / temperature_b.clamp(min=1e-8)[:, None, None].to(logits_b_K_V.dtype)
    log_probs_N = logprobs_from_logits(logits=logits_b_K_V[sel_b_K], labels=ids_b_T1[:, first + 1:][sel_b_K])
    offsets = ids.offsets()
    flat_N = (offsets[:-1, None] + positions_K[None, :])[sel_b_K]
    values = torch.zeros(int(offsets[-1]), dtype=log_probs_N.dtype, device=log_probs_N.device)
    return torch.nested.nested_tensor_from_jagged(values.index_put((flat_N,), log_probs_N), offsets)


@dataclass
class ResponseTree:
    """One micro-batch as a prefix tree (patch 7): the tree of its rows, and for each of the N response positions
    verl reads (row ``b_N``, position ``t_N``: scoring token t + 1) the slot ``slot_N`` of its node among the K
    distinct nodes ``keep_K`` whose logits the model returns, and its next token ``labels_N``."""

    tree: Any
    b_N: Any
    t_N: Any
    labels_N: Any
    keep_K: Any
    slot_N: Any


def response_tree(micro_batch: Any, window: ResponseWindow, module: Any) -> Optional[tuple[dict, ResponseTree]]:
    """The model inputs of a verl micro-batch forwarded as one prefix tree, and its :class:`ResponseTree` (patch 7);
    None where the module's attention takes no 4-D mask (:func:`~lightning_nb.trainers.prefix_tree.tree_path`).

    The inputs are one row of the tree's N nodes: ``input_ids`` (1, N), ``position_ids`` (1, N) = each node's
    depth, ``attention_mask`` (1, 1, N, N) the tree mask, ``logits_to_keep`` (K,) the nodes whose logits are read.
    """
    import torch

    from lightning_nb.trainers.prefix_tree import build_prefix_tree, tree_attention_mask, tree_path

    if tree_path(module) != "tree":
        return None
    rows = [r.tolist() for r in micro_batch["input_ids"].unbind()]
    tree = build_prefix_tree(rows)
    device = window.lengths.device
    b: list[int] = []
    t: list[int] = []
    for i, (start, length) in enumerate(zip(window.starts.tolist(), window.lengths.tolist())):
        b += [i] * max(length - 1 - start, 0)
        t += range(start, length - 1)
    node_N = torch.tensor([tree.paths[i][j] for i, j in zip(b, t)], dtype=torch.long, device=device)
    labels_N = torch.tensor([rows[i][j + 1] for i, j in zip(b, t)], dtype=torch.long, device=device)
    keep_K, slot_N = torch.unique(node_N, return_inverse=True)
    inputs = {"input_ids": torch.tensor([tree.ids], dtype=torch.long, device=device),
              "position_ids": torch.tensor([tree.depth], dtype=torch.long, device=device),
              "attention_mask": tree_attention_mask(tree, module, device), "logits_to_keep": keep_K}
    return inputs, ResponseTree(tree, torch.tensor(b, dtype=torch.long, device=device),
                                torch.tensor(t, dtype=torch.long, device=device), labels_N, keep_K, slot_N)


def tree_log_probs(logits_1_K_V: Any, temperature_b: Any, micro_batch: Any, rt: ResponseTree) -> Any:
    """verl's ``log_probs`` of a micro-batch forwarded as a tree (patch 7), in the jagged layout of
    :func:`window_log_probs`: each response position's ``logprobs_from_logits(logits / temperature, next token)``
    from the logits of its node, 0 elsewhere. ``logits_1_K_V``: the logits of the nodes ``rt.keep_K``."""
    import torch
    from verl.utils.torch_functional import logprobs_from_logits

    temp_N = temperature_b.clamp(min=1e-8).to(logits_1_K_V.dtype)[rt.b_N]
    logits_N_V = logits_1_K_V[0].index_select(0, rt.slot_N) / temp_N[:, None]
    log_probs_N = logprobs_from_logits(logits=logits_N_V, labels=rt.labels_N)
    offsets = micro_batch["input_ids"].offsets()
    values = torch.zeros(int(offsets[-1]), dtype=log_probs_N.dtype, device=log_probs_N.device)
    flat_N = offsets[:-1][rt.b_N] + rt.t_N
    return torch.nested.nested_tensor_from_jagged(values.index_put((flat_N,), log_probs_N), offsets)


def use_torch_padding_without_flash_attn() -> None:
    """Without flash_attn, verl's unpad/pad helpers use the plain-torch versions below (patch 4)."""
    import importlib.util

    from verl.utils import attention_utils
    from verl.utils.device import is_torch_npu_available

    if importlib.util.find_spec("flash_attn") is not None or is_torch_npu_available(check_device=False):
        return
    functions = (_index_first_axis, _pad_input, _no_rearrange, _unpad_input)
    attention_utils._get_attention_functions = lambda: functions


def _index_first_axis(x: Any, indices: Any) -> Any:
    """flash_attn.bert_padding.index_first_axis: ``x[indices]`` along the first axis (differentiable)."""
    return x[indices]


def _pad_input(hidden: Any, indices: Any, batch: int, seqlen: int) -> Any:
    """flash_attn.bert_padding.pad_input: (total_nnz, ...) → (batch, seqlen, ...), zeros where not indexed."""
    import torch

    out = torch.zeros(batch * seqlen, *hidden.shape[1:], dtype=hidden.dtype, device=hidden.device)
    out[indices] = hidden
    return out.reshape(batch, seqlen, *hidden.shape[1:])


def _unpad_input(hidden: Any, attention_mask: Any, unused_mask: Any = None) -> tuple:
    """flash_attn.bert_padding.unpad_input: ``(hidden[mask], indices, cu_seqlens, max_seqlen, used_seqlens)``."""
    import torch
    import torch.nn.functional as F

    masks = attention_mask + unused_mask if unused_mask is not None else attention_mask
    seqlens = masks.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(masks.flatten(), as_tuple=False).flatten()
    cu_seqlens = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden.reshape(-1, *hidden.shape[2:])
    return flat[indices], indices, cu_seqlens, int(seqlens.max()), attention_mask.sum(dim=-1, dtype=torch.int32)


def _no_rearrange(*args: Any, **kwargs: Any) -> Any:
    raise ImportError("verl asked for einops.rearrange through attention_utils; install flash-attn (GPU) or einops")


def ensure_process_group() -> None:
    """A one-process ``torch.distributed`` group over an in-memory store (patch 2); kept if one exists."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)


def use_cpu_platform_without_gpu() -> None:
    """Register and select :class:`_PlatformCPU` when no GPU is visible (patch 3)."""
    import torch
    from verl.plugin.platform import platform_manager as pm

    if torch.cuda.is_available():
        return
    current = pm._current_platform
    if current is not None and current.device_name == "cpu":
        return
    pm.PlatformRegistry.register(platform="cpu")(_platform_cpu_class())
    level = pm.logger.level
    pm.logger.setLevel(logging.ERROR)  # set_platform warns when it replaces the CUDA fallback
    try:
        pm.set_platform(pm.PlatformRegistry.get("cpu")())
    finally:
        pm.logger.setLevel(level)


def _platform_cpu_class() -> type:
    """verl's ``PlatformBase`` for a machine without an accelerator (device ``cpu``, backend gloo)."""
    from types import ModuleType

    import torch
    from verl.plugin.platform.platform_base import PlatformBase

    class _PlatformCPU(PlatformBase):
        @property
        def device_name(self) -> str:
            return "cpu"

        @property
        def vendor_name(self) -> str:
            return "cpu"

        @property
        def device_module(self) -> ModuleType:
            return torch.cpu

        def is_available(self) -> bool:
            return True

        def current_device(self) -> Any:  # used as a .to() target: "cpu"
            return "cpu"

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None:
            pass

        def synchronize(self, device_index: Optional[int] = None) -> None:
            pass

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            pass

        def empty_cache(self) -> None:
            pass

        def get_device_capability(self, device_index: int = 0) -> tuple[Optional[int], Optional[int]]:
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"

        def nvtx_range(self, msg: str) -> Any:
            return contextlib.nullcontext()

        def profiler_start(self) -> None:
            pass

        def profiler_stop(self) -> None:
            pass

        def ray_resource_name(self) -> str:
            return "CPU"

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self) -> Any:
            return None

    return _PlatformCPU
