"""lightning-nb: train AI agents with reinforcement learning from a Jupyter notebook."""

from lightning_nb.adapter import TripletAdapter
from lightning_nb.algorithm import AlgorithmConfig, LightningRL, SliceReport
from lightning_nb.endpoint import OpenAIEndpoint
from lightning_nb.engine import Engine, TransformersEngine, load_default_model
from lightning_nb.errors import LightningNbError
from lightning_nb.proxy import LLMProxy
from lightning_nb.runner import start_runners
# lightning_nb.store already imports every backend (and the tracer module is imported above through the
# runner), so exporting them here costs nothing at import time; torch is still imported lazily.
from lightning_nb.store import InMemoryStore, LightningStore, SqliteStore, StoreClient, StoreServer
from lightning_nb.tracer import Tracer, emit_intermediate_reward, emit_reward, tool_span
from lightning_nb.trainer import GRPOConfig, GRPOTrainer
from lightning_nb.types import LLMResource, PromptTemplate, Rollout, RolloutConfig, Span, Triplet
from lightning_nb.verl_trainer import VerlConfig, VerlTrainer  # verl itself is imported when one is built

__all__ = [
    "AlgorithmConfig", "Engine", "GRPOConfig", "GRPOTrainer", "InMemoryStore", "LightningNbError", "LightningRL",
    "LightningStore", "LLMProxy", "LLMResource", "OpenAIEndpoint", "PromptTemplate", "Rollout", "RolloutConfig",
    "SliceReport", "Span", "SqliteStore", "StoreClient", "StoreServer", "Tracer", "TransformersEngine", "Triplet",
    "TripletAdapter", "VerlConfig", "VerlTrainer", "emit_intermediate_reward", "emit_reward", "load_default_model",
    "start_runners", "tool_span",
]
__version__ = "0.1.0"
