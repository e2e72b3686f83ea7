"""Inference engines: the Engine contract (base), in-process transformers, a vLLM server, any OpenAI-compatible endpoint.

``base`` holds the contract every engine keeps; ``transformers``, ``vllm`` and ``endpoint`` implement it and
import only ``base``, ``chat_format`` and :mod:`lightning_nb.models`, never each other (``.importlinter``).
"""

from lightning_nb.engines.base import Engine, Generation
from lightning_nb.engines.endpoint import OpenAIEndpoint
from lightning_nb.engines.transformers import TransformersEngine
from lightning_nb.engines.vllm import VLLMEngine
from lightning_nb.models.default import load_default_model

__all__ = ["Engine", "Generation", "OpenAIEndpoint", "TransformersEngine", "VLLMEngine", "load_default_model"]
