"""Model weights in and out: LoRA adapters through peft, merged weights, Hugging Face folders.

* :func:`add_lora` injects LoRA adapters (Hu et al. 2021, "LoRA: Low-Rank Adaptation of
  Large Language Models") into a model *in place*, with ``peft``: every targeted
  ``nn.Linear`` computes ``W x + (alpha / r) · B A x`` with ``A`` (r × in) random and ``B``
  (out × r) zero, so the adapted model starts equal to the base. The model object an engine
  serves stays the same object, so :class:`~lightning_nb.engines.transformers.TransformersEngine` serves
  the adapted weights with no copy.
* :func:`merged_state_dict` is the state dict of the model as plain weights (``W + ΔW``
  under the base names): what :class:`~lightning_nb.engines.vllm.VLLMEngine` reloads and what
  a merged export writes. For a model without adapters it is ``model.state_dict()``.
* :func:`adapter_state_dict` / :func:`base_state_dict` split a LoRA model's state dict.
* :func:`write_hf_folder` writes a Hugging Face model folder (``model.safetensors``,
  ``config.json``, tokenizer, ``generation_config.json``) that ``transformers`` and vLLM load.

**The adapters' dtype (issue 29).** The adapters take the base weights' dtype: on a bfloat16 base they
are bfloat16 and compute in bfloat16, and the trainer's
:class:`~lightning_nb.trainers.optim.MasterWeightAdamW` (``dtype="bfloat16"``) keeps their float32
masters, as it does for full fine-tuning (mixed precision, Micikevicius et al. 2018; verl's FSDP
``param_dtype=bf16`` over float32 parameters does the same for LoRA). peft's default
(``autocast_adapter_dtype=True``) would keep float32 adapters instead: each adapted layer then casts its
bfloat16 input to float32 and runs ``B A x`` in float32, off the bfloat16 tensor cores (one H100, 1.5B,
LoRA r=32 on all linear layers: 16.9k tokens/s against 33.2k for full fine-tuning), and a second trainer
on the same engine (``place_model``) cast them to bfloat16 anyway. Measured on CPU
(``bench/lora_dtype.py``, SmolLM2-135M in bfloat16, r=32, 8 x 128 tokens, 10 AdamW steps): the float32
masters moved every element of ``lora_A`` at lr 2e-5 and at 1e-6, and the bfloat16 ``lora_A`` the model
computes with follows them as the steps add up (99.2% of its elements changed at 2e-5, 7.2% at 1e-6),
while bfloat16 adapters under a plain AdamW changed 22% and 1.0%: the other steps rounded away, every
time. ``lora_B`` starts at 0, where bfloat16 holds a step of any size. One forward + backward + step took
1.6 s with bfloat16 adapters and 2.2 s with float32 ones there, on a loaded 2-core CPU: CPU speed says
nothing about a GPU's; ``bench/lora_dtype.py --device cuda`` measures it. ``adapter_dtype="float32"``
keeps peft's float32 adapters.

peft and torch are imported inside the functions, so importing this module stays cheap.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any, Optional, Sequence, Union

from lightning_nb.errors import ConfigError

__all__ = ["add_lora", "has_lora", "peft_model_of", "merged_state_dict", "adapter_state_dict", "base_state_dict",
           "write_hf_folder"]

_PEFT = "_lightning_nb_peft_model"  # attribute of the base model holding its PeftModel wrapper
_SPEC = "_lightning_nb_lora_spec"  # (rank, alpha, targets) add_lora was called with


def add_lora(model: Any, rank: int, alpha: float, target_modules: Union[str, Sequence[str]] = "all-linear", *,
             adapter_dtype: Optional[str] = None) -> Any:
    """Inject LoRA adapters into ``model`` in place and return the ``peft.PeftModel`` around it.

    The base weights are frozen (``requires_grad=False``); only the adapters' ``lora_A`` /
    ``lora_B`` train. ``model`` itself keeps working as before (its targeted linear layers
    are now peft's ``lora.Linear``), so code holding ``model`` serves the adapted model.
    No dropout: the trainer keeps the model in eval mode so that its log-probs match the
    engine's, where dropout would be inactive anyway.

    Args:
        model: a transformers causal LM (``nn.Module``).
        rank: r, the adapters' rank (>= 1).
        alpha: the scale numerator: ΔW = (alpha / r) · B A.
        target_modules: ``"all-linear"`` (every linear layer but the output head) or module
            names such as ``["q_proj", "v_proj"]`` (peft's ``target_modules``).
        adapter_dtype: None (default): the adapters take the base weights' dtype (bfloat16 on a
            bfloat16 base: computed in bfloat16, with float32 masters in the trainer's optimizer;
            see the module docstring); ``"float32"``: float32 adapters on any base (peft's
            ``autocast_adapter_dtype``).

    A model that already has adapters of the same rank, alpha and targets (a notebook cell
    that builds a trainer, run twice) keeps them, trained as they are: the same as a second
    full fine-tuning trainer on an engine, which continues from the engine's current weights.

    Raises:
        ConfigError: ``model`` already has adapters of another rank, alpha or targets,
            ``target_modules`` matches no module, or ``adapter_dtype`` is not None or ``"float32"``.
    """
    from peft import LoraConfig, get_peft_model

    if adapter_dtype not in (None, "float32"):
        raise ConfigError(f"adapter_dtype={adapter_dtype!r} must be None (the base weights' dtype) or 'float32' "
                          "(peft's float32 adapters)")
    targets = target_modules if isinstance(target_modules, str) else list(target_modules)
    existing = peft_model_of(model)
    want = (rank, float(alpha), targets if isinstance(targets, str) else sorted(targets))
    if existing is not None:
        have = getattr(model, _SPEC)
        if want != have:
            raise ConfigError(
                f"this model already has LoRA adapters (rank {have[0]}, alpha {have[1]}, targets {have[2]!r}) from an "
                f"earlier trainer, and this one asks for rank {rank}, alpha {alpha}, targets {target_modules!r}; "
                "build the trainer with the same lora_* fields to continue training them, or build a new engine")
        return existing
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=targets, bias="none",
                        task_type="CAUSAL_LM")
    try:
        peft_model = get_peft_model(model, config, autocast_adapter_dtype=adapter_dtype == "float32")
    except ValueError as exc:
        raise ConfigError(f"GRPOConfig.lora_target_modules={target_modules!r}: {exc}; use 'all-linear' or names "
                          f"of linear layers of {type(model).__name__} such as ['q_proj', 'v_proj']") from exc
    object.__setattr__(model, _PEFT, peft_model)  # not a submodule: no cycle in modules() / state_dict()
    object.__setattr__(model, _SPEC, want)
    return peft_model


def has_lora(model: Any) -> bool:
    """True when :func:`add_lora` injected adapters into ``model``."""
    return getattr(model, _PEFT, None) is not None


def peft_model_of(model: Any) -> Any:
    """The ``peft.PeftModel`` :func:`add_lora` returned for ``model`` (None without adapters)."""
    return getattr(model, _PEFT, None)


def _is_adapter_key(name: str) -> bool:
    return ".lora_" in name


def adapter_state_dict(model: Any) -> dict[str, Any]:
    """The adapters' tensors of a LoRA model (keys as in ``model.state_dict()``, containing ``.lora_``)."""
    return {k: v for k, v in model.state_dict().items() if _is_adapter_key(k)}


def base_state_dict(model: Any) -> dict[str, Any]:
    """Every tensor of ``model.state_dict()`` but the adapters' (the frozen base, under peft's names)."""
    return {k: v for k, v in model.state_dict().items() if not _is_adapter_key(k)}


def merged_state_dict(model: Any) -> dict[str, Any]:
    """``model``'s weights as a plain model of its architecture holds them, adapters merged in.

    For each LoRA layer the weight is ``W + ΔW`` (peft's ``get_delta_weight``, computed out
    of place: the model is not changed, unlike peft's ``merge_adapter``, whose merge and
    unmerge round the base weights in bfloat16), under the base name
    (``...q_proj.weight``, not ``...q_proj.base_layer.weight``); adapter tensors are left
    out. A model without adapters gives ``model.state_dict()`` itself.
    """
    import torch

    if not has_lora(model):
        return model.state_dict()
    from peft.tuners.lora import LoraLayer

    deltas: dict[str, Any] = {}
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, LoraLayer):
                weight = module.get_base_layer().weight
                delta = sum(module.get_delta_weight(a) for a in module.active_adapters)
                deltas[f"{name}.base_layer.weight"] = (weight.float() + delta.float()).to(weight.dtype)
    out: dict[str, Any] = {}
    for key, tensor in model.state_dict().items():
        if _is_adapter_key(key):
            continue
        out[key.replace(".base_layer.", ".")] = deltas.get(key, tensor)
    return out


def write_hf_folder(model: Any, tokenizer: Any, path: Union[str, Path], *, stop_token_ids: Sequence[int],
                    pad_token_id: int, untie_lm_head: bool = False, with_tokenizer: bool = True,
                    state_dict: Optional[dict[str, Any]] = None) -> Path:
    """Write ``model`` as a Hugging Face folder that ``AutoModelForCausalLM.from_pretrained`` and vLLM load.

    Writes one ``model.safetensors`` (:func:`merged_state_dict` unless ``state_dict`` is given;
    tensors copied to CPU, shared storage split), ``config.json``, and with ``with_tokenizer``
    the tokenizer files and a ``generation_config.json`` whose ``eos_token_id`` is
    ``stop_token_ids`` (the GGUF of the default model reports the wrong eos) and
    ``pad_token_id``. ``untie_lm_head`` writes ``tie_word_embeddings: false`` when the state
    holds ``lm_head.weight`` (vLLM 0.32's in-place reload skips a tied head; see
    :class:`~lightning_nb.engines.vllm.VLLMEngine`). An existing ``path`` is replaced.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.
    """
    from safetensors.torch import save_file

    path = Path(path)
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    state = merged_state_dict(model) if state_dict is None else state_dict
    tensors: dict[str, Any] = {}
    storages: set[int] = set()
    for name, tensor in state.items():
        t = tensor.detach().to("cpu")
        ptr = t.untyped_storage().data_ptr()
        tensors[name] = t.clone() if ptr in storages else t.contiguous()  # safetensors refuses shared storage
        storages.add(ptr)
    config = copy.deepcopy(model.config)
    if not untie_lm_head and getattr(config, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)  # transformers ties it back on load
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    if "lm_head.weight" in tensors and getattr(config, "tie_word_embeddings", False):
        config.tie_word_embeddings = False
    config.save_pretrained(path)
    if with_tokenizer:
        tokenizer.save_pretrained(path)
        gen = model.generation_config.to_diff_dict() if getattr(model, "generation_config", None) else {}
        gen = {k: v for k, v in gen.items() if not k.startswith("_") and k != "transformers_version"}
        gen["eos_token_id"] = list(stop_token_ids)  # vLLM and generate() stop on every id listed here
        gen["pad_token_id"] = pad_token_id
        (path / "generation_config.json").write_text(json.dumps(gen, indent=2, default=str))
    return path
