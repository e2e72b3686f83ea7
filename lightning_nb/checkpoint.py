"""What a trainer checkpoint needs beyond weights: RNG states, a model signature, a weights fingerprint.

Everything here is made of tensors, numbers, strings, lists, tuples and dicts, so a
checkpoint loads with ``torch.load(..., weights_only=True)``.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np

from lightning_nb.errors import ConfigError

__all__ = ["CHECKPOINT_FORMAT", "rng_state", "set_rng_state", "model_signature", "check_signature",
           "weights_fingerprint", "plain"]

CHECKPOINT_FORMAT = "lightning_nb.grpo/2"


def rng_state() -> dict[str, Any]:
    """The torch (CPU and, when present, CUDA), numpy and Python ``random`` global RNG states."""
    import torch

    np_state = np.random.get_state(legacy=False)
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {"bit_generator": np_state["bit_generator"],
                  "key": torch.from_numpy(np.asarray(np_state["state"]["key"], dtype=np.int64)),
                  "pos": int(np_state["state"]["pos"]), "has_gauss": int(np_state["has_gauss"]),
                  "gauss": float(np_state["gauss"])},
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` captured (CUDA states only where CUDA is present)."""
    import torch

    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state({"bit_generator": n["bit_generator"],
                         "state": {"key": n["key"].numpy().astype(np.uint32), "pos": n["pos"]},
                         "has_gauss": n["has_gauss"], "gauss": n["gauss"]})
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def model_signature(model: Any) -> dict[str, list[int]]:
    """Parameter name -> shape: checkpoints of another architecture are refused by :func:`check_signature`."""
    return {name: list(p.shape) for name, p in model.state_dict().items()}


def check_signature(saved: dict[str, list[int]], model: Any, path: Any) -> None:
    """Raise ConfigError naming the first difference between a checkpoint's signature and ``model``."""
    mine = model_signature(model)
    if saved == mine:
        return
    missing = sorted(set(saved) - set(mine))
    extra = sorted(set(mine) - set(saved))
    shape = next((k for k in saved if k in mine and saved[k] != mine[k]), None)
    detail = (f"parameter {missing[0]!r} is not in this model" if missing else
              f"this model has parameter {extra[0]!r}, the checkpoint does not" if extra else
              f"parameter {shape!r} has shape {saved[shape]} in the checkpoint, {mine[shape]} here")
    raise ConfigError(f"checkpoint {path} was saved from another model ({detail}); load it into a trainer "
                      "built on the same model as the one that saved it")


def weights_fingerprint(model: Any) -> Any:
    """A float64 CPU tensor of per-parameter sums: equal for bitwise-equal weights, wherever they live.

    Each sum runs on the CPU (one parameter copied at a time), so a CUDA run's checkpoint
    compares equal on a CPU machine: a GPU reduction sums in another order.
    """
    import torch

    with torch.no_grad():
        return torch.stack([p.detach().to("cpu", torch.float64).sum() for p in model.state_dict().values()])


def plain(value: Any) -> Any:
    """``value`` with numpy scalars turned into Python numbers (so ``weights_only=True`` loads it)."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(plain(v) for v in value)
    if isinstance(value, np.generic):
        return value.item()
    return value
