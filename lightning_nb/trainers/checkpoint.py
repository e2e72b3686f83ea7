"""The run's checkpoint file, and what it needs beyond weights: RNG states, a model signature, a weights fingerprint.

A run checkpoint is one dict: the trainer's ``state_dict()`` (weights or LoRA adapters, optimizer,
scheduler, step, config, ...) with the run's entries beside it: ``format``,
``lightning_nb_version``, ``rng`` (the global RNG states), ``algorithm`` (the algorithm's state: its step
counter, metrics rows and config log among it)
and ``resources_id`` (the store's latest resources when saved). :func:`run_checkpoint` assembles it,
the trainer's ``write_checkpoint`` lays it out (one file by default, :func:`write_file`), and
:func:`restore_checkpoint` reads it back into a trainer and returns the run's entries to the caller
(the algorithm, which owns them). Everything here is made of tensors, numbers, strings, lists, tuples
and dicts, so a checkpoint loads with ``torch.load(..., weights_only=True)``.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

from lightning_nb.errors import ConfigError

if TYPE_CHECKING:
    from lightning_nb.trainers.base import Trainer

__all__ = ["CHECKPOINT_FORMAT", "rng_state", "set_rng_state", "model_signature", "check_signature",
           "weights_fingerprint", "plain", "run_checkpoint", "write_file", "read_checkpoint", "restore_checkpoint"]

CHECKPOINT_FORMAT = "lightning_nb.grpo/2"


def _version() -> str:
    """The installed lightning-nb version (what ``lightning_nb.__version__`` says), or ``"unknown"``."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("lightning-nb")
    except PackageNotFoundError:
        return "unknown"


def run_checkpoint(trainer: "Trainer", *, rng: Optional[dict[str, Any]] = None,
                   algorithm: Optional[dict[str, Any]] = None, resources_id: Optional[str] = None) -> dict[str, Any]:
    """The run checkpoint dict: ``trainer.state_dict()`` with the run's entries (see the module docstring).

    ``rng`` defaults to the RNG states now (:func:`rng_state`). Call it where no update runs
    (inside ``trainer.frozen()``): the state dict holds the live tensors until it is written.
    """
    return {"format": CHECKPOINT_FORMAT, "lightning_nb_version": _version(), **trainer.state_dict(),
            "rng": rng if rng is not None else rng_state(),
            "algorithm": plain(algorithm) if algorithm is not None else None, "resources_id": resources_id}


def write_file(path: Path, state: dict[str, Any]) -> Path:
    """``torch.save`` ``state`` to ``path`` atomically (a ``.tmp`` file renamed over it); returns ``path``."""
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(state, tmp)
    tmp.replace(path)
    return path


def read_checkpoint(path: Path) -> dict[str, Any]:
    """The run checkpoint at ``path``, checked to be one this version reads.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ConfigError: the file does not load with ``weights_only=True``, or has another format tag.
    """
    import torch

    if not path.exists():
        raise FileNotFoundError(f"checkpoint {path} not found; write one with algo.save(path)")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ConfigError(f"{path} is not a lightning-nb checkpoint that loads with weights_only=True "
                          f"({type(exc).__name__}: {str(exc)[:200]}); write one with algo.save(path)") from exc
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        found = state.get("format", "no format tag") if isinstance(state, dict) else type(state).__name__
        raise ConfigError(f"checkpoint {path} has format {found!r}, this version reads {CHECKPOINT_FORMAT!r}; "
                          "save it again with this version's algo.save()")
    return state


def restore_checkpoint(trainer: "Trainer", path: Any, *, keep_config: bool = False,
                       **options: Any) -> Optional[dict[str, Any]]:
    """Load the run checkpoint ``trainer.find_checkpoint(path, **options)`` into ``trainer``.

    Restores the trainer's part (``load_state_dict``); returns the run's entries (``rng``, ``algorithm``,
    ``resources_id``, and ``metrics`` / ``config_changes`` where a checkpoint of an earlier version kept the
    run's rows with the trainer) for the caller, the algorithm, to restore; or None when the layout says to
    load nothing (VerlTrainer's ``resume_mode="disable"``).

    Raises:
        FileNotFoundError, ConfigError: as :func:`read_checkpoint` and ``trainer.load_state_dict``.
    """
    file = trainer.find_checkpoint(path, **options)
    if file is None:
        return None
    state = read_checkpoint(Path(file))
    trainer.load_state_dict(state, keep_config=keep_config, source=file)
    return {k: state.get(k) for k in ("rng", "algorithm", "resources_id", "metrics", "config_changes")}


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
              f"parameter {shape!r} has shape {saved[shape or '']} in the checkpoint, {mine[shape or '']} here")
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
