"""GRPO (and Dr. GRPO, DAPO) on a transformers model: the default trainer."""

from lightning_nb.trainers.grpo.config import GRPOConfig
from lightning_nb.trainers.grpo.trainer import GRPOTrainer

__all__ = ["GRPOConfig", "GRPOTrainer"]
