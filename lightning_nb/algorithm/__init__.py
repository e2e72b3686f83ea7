"""The algorithms, each of which owns its run (:class:`Algorithm`, the contract: loop, step counter, metrics,
checkpoint): LightningRL trains on a task set (enqueue, wait, adapt, update); APO tunes a prompt resource instead of
weights; TrafficLearner trains on labelled traffic users sent."""

from lightning_nb.algorithm.apo import APO, APOConfig, BestPrompt
from lightning_nb.algorithm.base import Algorithm
from lightning_nb.algorithm.lightning_rl import AlgorithmConfig, LightningRL, SliceReport
from lightning_nb.algorithm.traffic import TrafficConfig, TrafficLearner, is_traffic

__all__ = ["Algorithm", "AlgorithmConfig", "LightningRL", "SliceReport", "APO", "APOConfig", "BestPrompt",
           "TrafficConfig", "TrafficLearner", "is_traffic"]
