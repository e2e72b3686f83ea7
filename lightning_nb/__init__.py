"""lightning-nb: train AI agents with reinforcement learning from a Jupyter notebook."""

from lightning_nb.adapter import TripletAdapter
from lightning_nb.algorithm import (APO, AlgorithmConfig, APOConfig, LightningRL, SliceReport, TrafficConfig,
                                    TrafficLearner)
from lightning_nb.engines import Engine, OpenAIEndpoint, TransformersEngine, VLLMEngine, load_default_model
from lightning_nb.errors import LightningNbError
from lightning_nb.proxy import LLMProxy
from lightning_nb.rewards import GroupJudge, Judge, JudgeError, judge_reward
from lightning_nb.runners import Hook, start_runners
# lightning_nb.store already imports every backend (and the tracer module is imported above through the
# runner), so exporting them here costs nothing at import time; torch is still imported lazily.
from lightning_nb.store import InMemoryStore, LightningStore, SqliteStore, StoreClient, StoreServer
from lightning_nb.tracing import Tracer, emit_intermediate_reward, emit_reward, tool_span
from lightning_nb.trainers.grpo import GRPOConfig, GRPOTrainer
from lightning_nb.trainers.verl import VerlConfig, VerlTrainer  # verl itself is imported when one is built
from lightning_nb.types import LLMResource, PromptTemplate, Rollout, RolloutConfig, Span, Triplet


def _register_views() -> None:
    """Register the HTML views of :mod:`lightning_nb.inspect` for the kit's classes (what ``_repr_html_`` shows).

    Done here, at the package root, which sits above every layer: the classes live in the layers above
    and below ``inspect``, and no layer may import one above it.
    """
    from lightning_nb import inspect
    from lightning_nb.runners import RunnerGroup
    from lightning_nb.types import register_html_view

    for cls, view in ((Rollout, inspect.rollout_html), (LightningStore, inspect.store_html),
                      (RunnerGroup, inspect.runner_group_html), (GRPOTrainer, inspect.trainer_html),
                      (VerlTrainer, inspect.trainer_html), (SliceReport, inspect.slice_report_html)):
        register_html_view(cls, view)


_register_views()

__all__ = [
    "APO", "APOConfig", "GroupJudge", "Judge", "JudgeError", "TrafficConfig", "TrafficLearner", "judge_reward",
    "AlgorithmConfig", "Engine", "GRPOConfig", "GRPOTrainer", "Hook", "InMemoryStore", "LightningNbError", "LightningRL",
    "LightningStore", "LLMProxy", "LLMResource", "OpenAIEndpoint", "PromptTemplate", "Rollout", "RolloutConfig",
    "SliceReport", "Span", "SqliteStore", "StoreClient", "StoreServer", "Tracer", "TransformersEngine", "Triplet",
    "TripletAdapter", "VLLMEngine", "VerlConfig", "VerlTrainer", "emit_intermediate_reward", "emit_reward",
    "load_default_model", "start_runners", "tool_span",
]
__version__ = "0.1.0"
