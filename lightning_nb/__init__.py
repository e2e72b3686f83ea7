"""lightning-nb: train AI agents with reinforcement learning from a Jupyter notebook.

The trainers and the in-process engines are imported on first access (PEP 562, :func:`lightning_nb._lazy.lazy_names`):
``from lightning_nb import GRPOTrainer`` works as before, but ``import lightning_nb`` loads neither trainer nor
the transformers engine (nor torch, transformers, verl or litellm).
"""

from typing import TYPE_CHECKING

from lightning_nb._lazy import lazy_names
from lightning_nb.adapter import TripletAdapter
from lightning_nb.algorithm import (APO, AlgorithmConfig, APOConfig, LightningRL, SliceReport, TrafficConfig,
                                    TrafficLearner)
from lightning_nb.engines import Engine, OpenAIEndpoint, load_default_model
from lightning_nb.errors import LightningNbError
from lightning_nb.proxy import LLMProxy
from lightning_nb.rewards import GroupJudge, Judge, JudgeError, judge_reward
from lightning_nb.runners import Hook, start_runners
# lightning_nb.store already imports every backend (and the tracer module is imported above through the
# runner), so exporting them here costs nothing at import time; torch is still imported lazily.
from lightning_nb.store import InMemoryStore, LightningStore, SqliteStore, StoreClient, StoreServer
from lightning_nb.tracing import Tracer, emit_intermediate_reward, emit_reward, tool_span
from lightning_nb.types import LLMResource, PromptTemplate, Rollout, RolloutConfig, Span, Triplet

if TYPE_CHECKING:
    from lightning_nb.engines.transformers import TransformersEngine
    from lightning_nb.engines.vllm import VLLMEngine
    from lightning_nb.trainers.grpo.config import GRPOConfig
    from lightning_nb.trainers.grpo.trainer import GRPOTrainer
    from lightning_nb.trainers.verl.config import VerlConfig
    from lightning_nb.trainers.verl.trainer import VerlTrainer  # verl itself is imported when one is built

# name -> the module that defines it, imported on first access
_LAZY = {"TransformersEngine": "lightning_nb.engines.transformers", "VLLMEngine": "lightning_nb.engines.vllm",
         "GRPOConfig": "lightning_nb.trainers.grpo.config", "GRPOTrainer": "lightning_nb.trainers.grpo.trainer",
         "VerlConfig": "lightning_nb.trainers.verl.config", "VerlTrainer": "lightning_nb.trainers.verl.trainer"}


def _register_views() -> None:
    """Register the HTML views of :mod:`lightning_nb.inspect` for the kit's classes (what ``_repr_html_`` shows).

    Done here, at the package root, which sits above every layer: the classes live in the layers above
    and below ``inspect``, and no layer may import one above it. The trainers are registered by their dotted
    names (:func:`lightning_nb.types.register_html_view`), so registering does not import them.
    """
    from lightning_nb import inspect
    from lightning_nb.runners import RunnerGroup
    from lightning_nb.types import register_html_view

    for cls, view in ((Rollout, inspect.rollout_html), (LightningStore, inspect.store_html),
                      (RunnerGroup, inspect.runner_group_html), (SliceReport, inspect.slice_report_html),
                      (LightningRL, inspect.run_html), (TrafficLearner, inspect.run_html)):
        register_html_view(cls, view)
    for trainer in ("GRPOTrainer", "VerlTrainer"):
        register_html_view(f"{_LAZY[trainer]}.{trainer}", inspect.trainer_html)


_register_views()

__all__ = [
    "APO", "APOConfig", "GroupJudge", "Judge", "JudgeError", "TrafficConfig", "TrafficLearner", "judge_reward",
    "AlgorithmConfig", "Engine", "GRPOConfig", "GRPOTrainer", "Hook", "InMemoryStore", "LightningNbError", "LightningRL",
    "LightningStore", "LLMProxy", "LLMResource", "OpenAIEndpoint", "PromptTemplate", "Rollout", "RolloutConfig",
    "SliceReport", "Span", "SqliteStore", "StoreClient", "StoreServer", "Tracer", "TransformersEngine", "Triplet",
    "TripletAdapter", "VLLMEngine", "VerlConfig", "VerlTrainer", "emit_intermediate_reward", "emit_reward",
    "load_default_model", "start_runners", "tool_span",
]
__getattr__, __dir__ = lazy_names(__name__, _LAZY)
__version__ = "0.1.0"
