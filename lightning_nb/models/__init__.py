"""The policy model: the default model and its cache (``default``), device and dtype (``device``), LoRA (``lora``)."""

from lightning_nb.models.default import DEFAULT_MODEL_NAME, load_default_model

__all__ = ["DEFAULT_MODEL_NAME", "load_default_model"]
