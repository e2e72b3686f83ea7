"""Continuous batching for :class:`~lightning_nb.engines.transformers.TransformersEngine` (``batching="continuous"``).

Built on transformers' own continuous batching (``model.init_continuous_batching(...)``, a
``ContinuousBatchingManager`` with a paged KV cache and its own generation thread), not a scheduler of
ours: a request joins the running batch at the next decode step instead of waiting for the longest row
of a static batch to finish.

How it keeps the engine's contract:

* **One manager per sampling setting.** The manager's ``GenerationConfig`` fixes ``do_sample``, the
  temperature and ``top_p`` (per-request values exist in transformers only behind
  ``per_request_processors`` and only for processors the config already builds), so
  :class:`ContinuousDecoder` keeps one manager per ``(temperature, top_p)`` (and model device and
  dtype), created on first use and kept until :meth:`ContinuousDecoder.close`.
* **Weight versions.** The decoder's thread holds the engine's lock (:class:`WaitCountingLock`) for a
  *session*: from the first request it admits until nothing is in flight. A trainer that wants the lock
  (``with engine.lock:``) is seen waiting: the decoder then admits no new request, lets the in-flight ones
  finish, releases the lock, and lets the trainer take it before starting the next session. So every
  completion comes from one weight version, an update waits for in-flight requests to drain, and new
  requests wait for the update.
* **Attention.** The manager runs the model with ``paged|<attention>``; the model is shared with the
  trainer and the static path, so the decoder switches it to paged attention at the start of a session and
  back at its end (both under the lock).
* **No** ``torch.inference_mode()`` around the manager: its thread updates tensors in place.
* The paged KV cache: ``num_blocks = 8 * max_batch_size`` blocks of 256 tokens per manager unless
  ``continuous_options`` say otherwise (transformers' default takes 90% of the device's free memory).
* Log-probs: ``ContinuousBatchingConfig(return_logprobs=True)``: the log-softmax of the processed scores
  (logits / temperature), the engine's convention.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from typing import Any, Optional

from lightning_nb.errors import LightningNbError, MissingDependencyError

log = logging.getLogger(__name__)

_POLL_S = 0.01
_ids = itertools.count()


class WaitCountingLock:
    """A reentrant lock (``threading.RLock`` semantics) that counts the threads blocked in :meth:`acquire`, so
    the continuous decoder can see a trainer waiting for it and drain instead of starving it."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._count = threading.Lock()
        self._waiting = 0

    @property
    def waiting(self) -> int:
        """Threads blocked in :meth:`acquire` now."""
        return self._waiting

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if self._lock.acquire(blocking=False):
            return True
        if not blocking:
            return False
        with self._count:
            self._waiting += 1
        try:
            return self._lock.acquire(True, timeout)
        finally:
            with self._count:
                self._waiting -= 1

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> "WaitCountingLock":
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def acquire_after_waiters(self) -> None:
        """Let the threads waiting now take the lock first, then take it (a session start yields to an update)."""
        while self._waiting:
            time.sleep(0.001)
        self._lock.acquire()


def check_available() -> None:
    """Raise :class:`MissingDependencyError` where transformers has no continuous batching."""
    try:
        _cb_config_class()
        from transformers.generation.continuous_batching import ContinuousBatchingManager  # noqa: F401
    except ImportError as exc:
        raise MissingDependencyError(
            f"batching='continuous' needs transformers' continuous batching (transformers >= 5.10): {exc}; "
            "upgrade transformers (pip install -U transformers) or use batching='static'") from exc


def _cb_config_class() -> Any:
    try:
        from transformers import ContinuousBatchingConfig
    except ImportError:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
    return ContinuousBatchingConfig


class ContinuousDecoder:
    """The continuous-batching side of a :class:`TransformersEngine`: a daemon thread that owns the managers,
    admits requests into them and resolves their futures. Holds no engine while idle (requests carry it)."""

    def __init__(self, lock: WaitCountingLock, model: Any, max_batch_size: int,
                 options: Optional[dict[str, Any]] = None) -> None:
        self.lock = lock
        self.model = model
        # transformers sizes the paged cache from max_memory_percent (0.9 of the device's memory: of the RAM on a
        # CPU, slow to allocate, and too much beside a trainer): ask for 8 blocks (2,048 tokens) a row instead
        self.options = {"return_logprobs": True, "num_blocks": max(16, 8 * max_batch_size), **(options or {})}
        self.inbox: "queue.Queue[Any]" = queue.Queue()
        self.managers: dict[tuple[Any, ...], Any] = {}
        self._closed = False
        self._state = threading.Lock()
        self._original_attn: Optional[str] = None
        self.thread = threading.Thread(target=self._loop, name="lightning_nb-engine-cb", daemon=True)
        self.thread.start()

    # ----- called by other threads ----------------------------------------------------------------------------
    def submit(self, requests: list[Any]) -> None:
        """Queue requests (the engine's ``_Request``); they join the running batch at the next step."""
        with self._state:
            if not self._closed:
                for r in requests:
                    self.inbox.put(r)
                return
        for r in requests:
            r.future.set_exception(LightningNbError("engine stopped"))

    def close(self, wait_s: float = 0.0) -> None:
        """Finish in-flight requests, fail queued ones, stop the managers and their threads (waits up to
        ``wait_s`` seconds when not 0). Idempotent."""
        with self._state:
            first, self._closed = not self._closed, True
        if first:
            self.inbox.put(None)
        if wait_s and self.thread is not threading.current_thread():
            self.thread.join(timeout=wait_s)

    # ----- the decoder thread ---------------------------------------------------------------------------------
    def _loop(self) -> None:
        stop = False
        try:
            while not stop:
                item = self.inbox.get()
                if item is None:
                    break
                stop = self._session([item])
                item = None  # hold no engine while idle
        finally:
            self._fail_queued()
            self._stop_managers()

    def _session(self, pending: list[Any]) -> bool:
        """Take the lock, run requests until none is in flight (admitting arrivals unless a thread waits for
        the lock), release it. Returns whether close() was asked for."""
        self.lock.acquire_after_waiters()
        inflight: dict[str, tuple[Any, Any, int]] = {}
        stop = False
        try:
            version = pending[0].engine.weight_version
            self._enter_paged()
            while True:
                for r in pending:
                    self._admit(r, version, inflight)
                pending = []
                if not inflight:
                    break
                self._collect(inflight)
                if not stop and not self.lock.waiting:
                    pending, stop = self._drain_inbox()
        finally:
            self._leave_paged()
            self.lock.release()
        return stop

    def _drain_inbox(self) -> tuple[list[Any], bool]:
        got = []
        while True:
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return got, False
            if item is None:
                return got, True
            got.append(item)

    def _admit(self, request: Any, version: int, inflight: dict[str, tuple[Any, Any, int]]) -> None:
        rid = f"lnb-{next(_ids)}"
        try:
            manager = self._manager(request)
            inflight[rid] = (request, manager, version)
            added = manager.add_request(list(request.prompt_ids), request_id=rid, max_new_tokens=request.max_tokens,
                                        eos_token_id=list(request.engine.stop_token_ids))
            if added is None:
                raise LightningNbError("the continuous batching manager refused the request (stopping)")
        except BaseException as exc:
            log.exception("continuous batching: request not admitted")
            inflight.pop(rid, None)
            if not request.future.done():
                request.future.set_exception(exc)

    def _collect(self, inflight: dict[str, tuple[Any, Any, int]]) -> None:
        """Wait a little for results of the running managers; resolve the finished requests' futures."""
        managers = {id(m): m for _, m, _ in inflight.values()}
        for manager in managers.values():
            out = manager.get_result(timeout=_POLL_S / len(managers))
            while out is not None:
                self._finish(inflight, out)
                out = manager.get_result(timeout=0)
            if not manager.is_running():  # its thread died: fail what it held, start a fresh one next time
                error = getattr(manager, "fatal_error", None) or LightningNbError("continuous batching stopped")
                for rid in [k for k, (_, m, _) in inflight.items() if m is manager]:
                    request = inflight.pop(rid)[0]
                    if not request.future.done():
                        request.future.set_exception(error)
                self.managers = {k: m for k, m in self.managers.items() if m is not manager}

    def _finish(self, inflight: dict[str, tuple[Any, Any, int]], out: Any) -> None:
        import torch

        if out.request_id not in inflight:
            return
        if not out.is_finished() and not getattr(out, "error", None):
            return  # a partial (streaming) output: not asked for, ignore
        request, _, version = inflight.pop(out.request_id)
        try:
            if getattr(out, "error", None):
                raise LightningNbError(f"continuous batching failed the request: {out.error}")
            tokens = list(out.generated_tokens)[: request.max_tokens]
            logprobs = [float(x) for x in (out.logprobs or [])][: len(tokens)]
            if len(logprobs) != len(tokens):
                raise LightningNbError(f"continuous batching returned {len(logprobs)} log-probs for "
                                       f"{len(tokens)} tokens (return_logprobs unsupported?)")
            new_B_T, logprobs_B_T = torch.tensor([tokens]), torch.tensor([logprobs], dtype=torch.float64)
            engine = request.engine
            gen = engine._generations([request.prompt_ids], new_B_T, logprobs_B_T, [request.max_tokens],
                                      request.temperature, version, [request.stop])[0]
            request.future.set_result(gen)
        except BaseException as exc:
            if not request.future.done():
                request.future.set_exception(exc)

    def _manager(self, request: Any) -> Any:
        """The started manager for the request's sampling setting and the model's device and dtype."""
        model = self.model
        key = (request.temperature, request.top_p, str(model.device), str(model.dtype))
        manager = self.managers.get(key)
        if manager is not None and manager.is_running():
            return manager
        from transformers import GenerationConfig

        engine = request.engine
        sampling: dict[str, Any] = {"do_sample": False}
        if request.temperature > 0:
            sampling = {"do_sample": True, "temperature": request.temperature, "top_p": request.top_p, "top_k": 0}
        config = GenerationConfig(max_new_tokens=request.max_tokens, eos_token_id=list(engine.stop_token_ids),
                                  pad_token_id=engine.pad_token_id, **sampling)
        cb_config = _cb_config_class()(**self.options)
        manager = model.init_continuous_batching(generation_config=config, continuous_batching_config=cb_config)
        manager._original_attn_impl = None  # the decoder switches attention per session (_enter/_leave_paged)
        manager.start()  # from this daemon thread: the manager's thread is a daemon too
        self.managers[key] = manager
        return manager

    def _enter_paged(self) -> None:
        import torch

        from lightning_nb.models.device import model_dtype
        from lightning_nb.models.lm_head import install_fp32_head

        model = self.model
        if model_dtype(model) != torch.float32:  # as the static path: float32 logits
            install_fp32_head(model)
        impl = model.config._attn_implementation
        if "paged|" not in impl:
            self._original_attn = impl
            model.set_attn_implementation(f"paged|{impl}")

    def _leave_paged(self) -> None:
        if self._original_attn is not None:
            self.model.set_attn_implementation(self._original_attn)
            self._original_attn = None

    def _fail_queued(self) -> None:
        while True:
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return
            if item is not None and not item.future.done():
                item.future.set_exception(LightningNbError("engine stopped"))

    def _stop_managers(self) -> None:
        managers, self.managers = list(self.managers.values()), {}
        for manager in managers:
            try:
                manager.stop(block=True, timeout=30)
                manager.destroy()
            except Exception:
                log.exception("continuous batching: stopping a manager failed")
