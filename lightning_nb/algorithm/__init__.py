"""The algorithms: LightningRL owns the training loop (enqueue, wait, adapt, update) and its checkpoints; APO tunes a
prompt resource instead of weights; TrafficLearner trains on labelled traffic users sent."""

from lightning_nb.algorithm.apo import APO, APOConfig, BestPrompt
from lightning_nb.algorithm.lightning_rl import AlgorithmConfig, LightningRL, SliceReport
from lightning_nb.algorithm.traffic import TrafficConfig, TrafficLearner, is_traffic

__all__ = ["AlgorithmConfig", "LightningRL", "SliceReport", "APO", "APOConfig", "BestPrompt", "TrafficConfig",
           "TrafficLearner", "is_traffic"]
