"""GRPO (and Dr. GRPO, DAPO) on a transformers model: the default trainer.

``GRPOConfig`` and ``GRPOTrainer`` are imported on first access (PEP 562), so importing a submodule such as
``lightning_nb.trainers.grpo.config`` does not import the trainer (nor, through it, the in-place weights side
and the transformers engine).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_nb.trainers.grpo.config import GRPOConfig
    from lightning_nb.trainers.grpo.trainer import GRPOTrainer

__all__ = ["GRPOConfig", "GRPOTrainer"]


def __getattr__(name: str) -> Any:
    """Import ``GRPOConfig`` or ``GRPOTrainer`` from its module on first access, and keep it here."""
    if name == "GRPOConfig":
        from lightning_nb.trainers.grpo.config import GRPOConfig as value
    elif name == "GRPOTrainer":
        from lightning_nb.trainers.grpo.trainer import GRPOTrainer as value
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
