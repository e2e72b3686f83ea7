"""Inference engines: the Engine contract (base), in-process transformers, a vLLM server, any OpenAI-compatible endpoint.

``base`` holds the contract every engine keeps; ``transformers``, ``vllm`` and ``endpoint`` implement it and
import only ``base``, ``chat_format`` and :mod:`lightning_nb.models`, never each other (``.importlinter``).
``TransformersEngine`` and ``VLLMEngine`` are imported on first access (PEP 562,
:func:`lightning_nb._lazy.lazy_names`), so a module that needs only the contract (the proxy, ``import
lightning_nb``) does not load the in-process engine and its continuous batching.
"""

from typing import TYPE_CHECKING

from lightning_nb._lazy import lazy_names
from lightning_nb.engines.base import Engine, Generation
from lightning_nb.engines.endpoint import OpenAIEndpoint
from lightning_nb.models.default import load_default_model

if TYPE_CHECKING:
    from lightning_nb.engines.transformers import TransformersEngine
    from lightning_nb.engines.vllm import VLLMEngine

__all__ = ["Engine", "Generation", "OpenAIEndpoint", "TransformersEngine", "VLLMEngine", "load_default_model"]
__getattr__, __dir__ = lazy_names(__name__, {"TransformersEngine": "lightning_nb.engines.transformers",
                                             "VLLMEngine": "lightning_nb.engines.vllm"})
