"""VLLMEngine's server settings (lightning_nb.engines.vllm_settings): device-dependent defaults, the flags and
environment they become, and every refusal, all before a model is exported or a server started (no vLLM needed).

The CUDA branches build flags and check values without a GPU (they are pure); resolving ``device="cuda"`` needs
torch to see one, so that case is a ``gpu`` test.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from lightning_nb.engines.vllm import VLLMEngine
from lightning_nb.engines.vllm_process import WORKDIR_PREFIX
from lightning_nb.engines.vllm_settings import (DEFAULT_GPU_MEMORY_UTILIZATION, OWN_FLAGS, ServerSettings,
                                                _checked_kv_cache, _checked_utilization, server_settings,
                                                unknown_flag_hint)
from lightning_nb.errors import ConfigError


def test_cpu_defaults_are_todays_server():
    s = server_settings()
    assert s == ServerSettings(device="cpu", dtype="float32", enforce_eager=True, gpu_memory_utilization=None,
                               kv_cache_gb=1, sleep_mode=False)
    assert s.flags() == ["--dtype", "float32", "--enforce-eager"]
    assert s.env({}) == {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    # what the user sets on the CPU is honoured
    t = server_settings("cpu", "bfloat16", kv_cache_gb=3, sleep_mode=False, enforce_eager=False)
    assert t.flags() == ["--dtype", "bfloat16"] and t.env({})["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert server_settings(dtype="float16").dtype == "float16"


@pytest.mark.parametrize("kwargs, match", [
    ({"gpu_memory_utilization": 0.5}, r"gpu_memory_utilization=0\.5 applies to a CUDA device only.*kv_cache_gb"),
    ({"sleep_mode": True}, r"sleep_mode=True needs a CUDA device.*'auto' or False"),
    ({"sleep_mode": "on"}, r"sleep_mode must be 'auto'.*True or False, got 'on'"),
    ({"sleep_mode": 1}, r"sleep_mode must be 'auto'"),
    ({"dtype": "fp8"}, r"dtype='fp8' must be None.*float32, bfloat16, float16"),
    ({"dtype": "half"}, r"dtype='half'"),
    ({"kv_cache_gb": 1.5}, r"kv_cache_gb must be a whole number of GiB >= 1 on the CPU.*1\.5"),
    ({"kv_cache_gb": 0}, r"kv_cache_gb must be a whole number"),
    ({"kv_cache_gb": True}, r"kv_cache_gb must be a number of GiB"),
    ({"kv_cache_gb": "2"}, r"kv_cache_gb must be a number of GiB"),
    ({"enforce_eager": "yes"}, r"enforce_eager must be True, False or None"),
    ({"device": "gpu"}, r"VLLMEngine\.device='gpu' must be 'cpu'"),
    ({"extra_args": ["--dtype", "bfloat16"]}, r"extra_args holds --dtype.*argument dtype"),
    ({"extra_args": ["--enable-sleep-mode"]}, r"extra_args holds --enable-sleep-mode.*sleep_mode"),
    ({"extra_args": ["--gpu-memory-utilization=0.3"]}, r"--gpu-memory-utilization.*gpu_memory_utilization"),
    ({"extra_args": ["--logprobs-mode", "raw_logprobs"]}, r"--logprobs-mode, which the engine sets itself.*remove it"),
])
def test_refusals_name_the_argument_and_the_fix(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        server_settings(**kwargs)


def test_the_engine_refuses_before_exporting_or_starting_anything():
    """The checks run first: no model is touched (None here), no workdir made, no server spawned."""
    before = set(Path(tempfile.gettempdir()).glob(WORKDIR_PREFIX + "*"))
    for kwargs in ({"gpu_memory_utilization": 0.3}, {"sleep_mode": True}, {"dtype": "int8"}, {"kv_cache_gb": 0.5}):
        with pytest.raises(ConfigError, match="VLLMEngine"):
            VLLMEngine(None, None, **kwargs)
    assert set(Path(tempfile.gettempdir()).glob(WORKDIR_PREFIX + "*")) == before


def test_cuda_flags_and_environment():
    s = ServerSettings(device="cuda:1", dtype="bfloat16", enforce_eager=False, gpu_memory_utilization=0.35,
                       kv_cache_gb=2.5, sleep_mode=True)
    assert s.on_cuda
    assert s.flags() == ["--dtype", "bfloat16", "--gpu-memory-utilization", "0.35",
                         "--kv-cache-memory-bytes", str(int(2.5 * 2 ** 30)), "--enable-sleep-mode"]
    assert s.env({}) == {"VLLM_SERVER_DEV_MODE": "1", "CUDA_VISIBLE_DEVICES": "1"}
    # cuda:N is the N-th device this process sees: with CUDA_VISIBLE_DEVICES=4,6 that is physical GPU 6
    assert s.env({"CUDA_VISIBLE_DEVICES": "4, 6"})["CUDA_VISIBLE_DEVICES"] == "6"
    # no KV size: vLLM fills gpu_memory_utilization; no sleep mode when turned off
    t = ServerSettings("cuda", "bfloat16", True, 0.5, None, False)
    assert t.flags() == ["--dtype", "bfloat16", "--enforce-eager", "--gpu-memory-utilization", "0.5"]
    assert t.env({})["CUDA_VISIBLE_DEVICES"] == "0" and "VLLM_CPU_KVCACHE_SPACE" not in t.env({})


def test_cuda_value_checks():
    assert _checked_utilization(None, cuda=True) == DEFAULT_GPU_MEMORY_UTILIZATION == 0.5
    assert _checked_utilization(1, cuda=True) == 1.0 and _checked_utilization(0.25, cuda=True) == 0.25
    for bad in (0, 0.0, 1.01, -0.5, True, "0.5"):
        with pytest.raises(ConfigError, match=r"gpu_memory_utilization must be a fraction of the card in \(0, 1\]"):
            _checked_utilization(bad, cuda=True)
    assert _checked_kv_cache(None, cuda=True) is None and _checked_kv_cache(0.5, cuda=True) == 0.5
    with pytest.raises(ConfigError, match=r"kv_cache_gb must be > 0 GiB.*None lets vLLM size"):
        _checked_kv_cache(0, cuda=True)


def test_an_older_vllm_refusing_a_flag_is_named_with_the_argument():
    tail = ("INFO starting\napi_server.py: error: unrecognized arguments: --kv-cache-memory-bytes 1073741824")
    hint = unknown_flag_hint(tail)
    assert "does not know --kv-cache-memory-bytes, which VLLMEngine's kv_cache_gb sets" in hint
    assert "leave kv_cache_gb unset" in hint
    assert unknown_flag_hint("ValueError: something else") == ""
    assert set(OWN_FLAGS) >= {"--dtype", "--enforce-eager", "--gpu-memory-utilization", "--kv-cache-memory-bytes",
                              "--enable-sleep-mode"}


@pytest.mark.gpu
def test_cuda_defaults_follow_the_trainer():
    s = server_settings("cuda")
    assert (s.dtype, s.enforce_eager, s.gpu_memory_utilization, s.kv_cache_gb, s.sleep_mode) == \
        ("bfloat16", False, 0.5, None, True)
    assert server_settings("cuda", sleep_mode=False, enforce_eager=True).flags() == \
        ["--dtype", "bfloat16", "--enforce-eager", "--gpu-memory-utilization", "0.5"]
