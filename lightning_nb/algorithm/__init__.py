"""The algorithm: LightningRL owns the training loop (enqueue, wait, adapt, update) and its checkpoints."""

from lightning_nb.algorithm.lightning_rl import AlgorithmConfig, LightningRL, SliceReport

__all__ = ["AlgorithmConfig", "LightningRL", "SliceReport"]
