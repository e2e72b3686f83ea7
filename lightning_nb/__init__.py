"""lightning-nb: train AI agents with reinforcement learning from a Jupyter notebook."""

from lightning_nb.adapter import TripletAdapter
from lightning_nb.algorithm import AlgorithmConfig, LightningRL
from lightning_nb.engine import TransformersEngine, load_default_model
from lightning_nb.errors import LightningNbError
from lightning_nb.proxy import LLMProxy
from lightning_nb.runner import start_runners
from lightning_nb.store import InMemoryStore, LightningStore
from lightning_nb.tracer import emit_reward, tool_span
from lightning_nb.trainer import GRPOConfig, GRPOTrainer
from lightning_nb.types import LLMResource, PromptTemplate, Rollout, Span, Triplet

__all__ = [
    "AlgorithmConfig", "GRPOConfig", "GRPOTrainer", "InMemoryStore", "LightningNbError", "LightningRL",
    "LightningStore", "LLMProxy", "LLMResource", "PromptTemplate", "Rollout", "Span", "TransformersEngine",
    "Triplet", "TripletAdapter", "emit_reward", "load_default_model", "start_runners", "tool_span",
]
__version__ = "0.1.0"
