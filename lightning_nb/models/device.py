"""Where a model runs and in which precision: one rule for the trainer and the engines.

* :func:`check_device` / :func:`check_dtype` validate the names ``GRPOConfig`` and
  :meth:`~lightning_nb.engines.transformers.TransformersEngine.from_pretrained` take;
* :func:`place_model` moves a model there, in place;
* :func:`set_gradient_checkpointing` recomputes each decoder layer's activations in the
  backward pass instead of storing them (less memory, about one extra forward of compute);
* :class:`~lightning_nb.trainers.optim.MasterWeightAdamW` keeps float32 master weights for a
  bfloat16 model (see there why a plain AdamW on bfloat16 weights would not learn).

torch is imported inside the functions, so importing this module stays cheap.
"""

from __future__ import annotations

import re
import types
from typing import Any

from lightning_nb.errors import ConfigError

__all__ = ["DTYPES", "check_device", "check_dtype", "torch_dtype", "model_device", "model_dtype", "place_model",
           "set_gradient_checkpointing"]

#: dtype names accepted everywhere (float16 is left out: without loss scaling its gradients underflow).
DTYPES = ("float32", "bfloat16")


def check_device(device: Any, field: str = "device") -> str:
    """Return ``device`` if it names a usable device: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.

    Raises:
        ConfigError: an unknown name, or a CUDA device on a machine without one (or without
            device ``N``); the message names ``field`` and the fix.
    """
    if not isinstance(device, str) or not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        raise ConfigError(f"{field}={device!r} must be 'cpu' (the default), 'cuda' or 'cuda:N'; use 'cuda' "
                          "for the first GPU")
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(f"{field}={device!r} but torch.cuda.is_available() is False on this machine "
                              f"(torch {torch.__version__}); use 'cpu', or install a CUDA build of torch on a "
                              "machine with an NVIDIA GPU")
        index = int(device.split(":")[1]) if ":" in device else 0
        if index >= torch.cuda.device_count():
            raise ConfigError(f"{field}={device!r} but this machine has {torch.cuda.device_count()} CUDA "
                              f"device(s); use 'cuda:0' .. 'cuda:{torch.cuda.device_count() - 1}'")
    return device


def check_dtype(dtype: Any, field: str = "dtype") -> str:
    """Return ``dtype`` if it is one of :data:`DTYPES`.

    Raises:
        ConfigError: any other value (``float16`` included: it needs loss scaling, which the
            trainer does not do; ``bfloat16`` has float32's range and needs none).
    """
    if dtype not in DTYPES:
        hint = ("; float16 needs loss scaling, which the trainer does not do: use 'bfloat16'"
                if dtype in ("float16", "half", "fp16") else "")
        raise ConfigError(f"{field}={dtype!r} must be 'float32' (the default, for CPU) or 'bfloat16' (for a GPU)"
                          f"{hint}")
    return dtype


def torch_dtype(dtype: str) -> Any:
    """The ``torch.dtype`` of a name in :data:`DTYPES` (checked by :func:`check_dtype`)."""
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[check_dtype(dtype)]


def model_device(model: Any) -> Any:
    """The ``torch.device`` of ``model``'s first parameter (where its inputs must go). Read it at each use:
    a trainer may move the model after an engine was built on it."""
    return next(model.parameters()).device


def model_dtype(model: Any) -> Any:
    """The ``torch.dtype`` of ``model``'s first floating-point parameter."""
    return next(p.dtype for p in model.parameters() if p.is_floating_point())


def place_model(model: Any, device: str, dtype: str) -> Any:
    """Move ``model`` to ``device`` and cast its floating-point weights to ``dtype``, in place; returns it.

    Cast are the parameters and the buffers saved in ``state_dict`` (persistent ones). Buffers
    a model computes itself and does not save (RoPE's ``inv_freq``) keep their dtype, as
    transformers' ``from_pretrained(dtype=torch.bfloat16)`` leaves them: ``model.to(torch.bfloat16)``
    would round the rotary frequencies to 8 bits, and the angle error grows with the position
    (measured on SmolLM2-135M, 1,024 random tokens: 0.073 vs 0.053 nats mean log-prob error
    against float32 on the last 256).

    Raises:
        ConfigError: ``device`` or ``dtype`` is not valid here (:func:`check_device`, :func:`check_dtype`).
    """
    target = torch_dtype(dtype)
    model.to(device=check_device(device))
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != target:
            p.data = p.data.to(target)
    saved = set(model.state_dict())
    for name, buf in list(model.named_buffers()):
        if name in saved and buf.is_floating_point() and buf.dtype != target:
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, buf.to(target))
    return model


def set_gradient_checkpointing(model: Any, enable: bool = True) -> int:
    """Recompute each decoder layer's activations in the backward pass (``enable``), or stop doing so.

    Returns the number of layers affected. Activation memory of the trained forward drops
    from all layers' intermediates to one layer's plus each layer's input (batch × tokens ×
    hidden per layer); compute grows by about one forward. Gradients are unchanged up to
    floating-point reordering.

    Why not ``model.gradient_checkpointing_enable()`` alone: transformers checkpoints a layer
    only while ``model.training`` is True, and the model shared with the engine stays in eval
    mode (no dropout, so the trainer's log-probs match the engine's). Here each
    transformers ``GradientCheckpointingLayer`` gets a forward that runs through
    ``torch.utils.checkpoint`` (non-reentrant) whenever autograd is recording, whatever the
    mode; under ``no_grad``/``inference_mode`` (generation, the reference model) it runs as
    before, KV cache included. The wrapper is a bound method, so ``copy.deepcopy`` of the
    model binds it to the copy.

    Raises:
        ConfigError: the model has no transformers ``GradientCheckpointingLayer`` to checkpoint.
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if enable and not layers:
        raise ConfigError(f"gradient_checkpointing=True but {type(model).__name__} has no transformers "
                          "GradientCheckpointingLayer to checkpoint; set gradient_checkpointing=False")
    for layer in layers:
        if enable:
            layer.forward = types.MethodType(_checkpointed_forward, layer)
        else:
            layer.__dict__.pop("forward", None)
    return len(layers)


def _checkpointed_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
    """A layer's class ``forward``, through ``torch.utils.checkpoint`` while autograd records."""
    import torch
    from torch.utils.checkpoint import checkpoint

    forward = type(self).forward
    if not torch.is_grad_enabled():
        return forward(self, *args, **kwargs)
    for key in ("past_key_values", "past_key_value", "layer_past"):  # the recompute would append to a cache twice
        if kwargs.get(key) is not None:
            kwargs[key] = None
    if kwargs.get("use_cache"):
        kwargs["use_cache"] = False
    return checkpoint(forward, self, *args, use_reentrant=False, **kwargs)
