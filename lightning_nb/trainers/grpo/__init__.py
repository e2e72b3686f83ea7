"""GRPO (and Dr. GRPO, DAPO) on a transformers model: the default trainer.

``GRPOConfig`` and ``GRPOTrainer`` are imported on first access (PEP 562, :func:`lightning_nb._lazy.lazy_names`),
so importing a submodule such as ``lightning_nb.trainers.grpo.config`` does not import the trainer (nor, through
it, the in-place weights side and the transformers engine).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_nb._lazy import lazy_names

if TYPE_CHECKING:
    from lightning_nb.trainers.grpo.config import GRPOConfig
    from lightning_nb.trainers.grpo.trainer import GRPOTrainer

__all__ = ["GRPOConfig", "GRPOTrainer"]
__getattr__, __dir__ = lazy_names(__name__, {"GRPOConfig": "lightning_nb.trainers.grpo.config",
                                             "GRPOTrainer": "lightning_nb.trainers.grpo.trainer"})
