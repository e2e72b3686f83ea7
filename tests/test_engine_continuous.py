"""TransformersEngine(batching="continuous"): transformers' continuous batching behind the engine's contract.

The real default model on the CPU. The static reference is the same engine's static path: a request with a
``seed`` is decoded alone by ``model.generate`` (temperature 0 is greedy, so the seed changes nothing).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from lightning_nb.engines.transformers import TransformersEngine
from lightning_nb.errors import ConfigError

pytestmark = pytest.mark.slow

QUESTIONS = ["What is 2+2?", "Name a colour.", "Say hello in French.", "What is the capital of Italy?"]


@pytest.fixture(scope="module")
def cb():
    eng = TransformersEngine.from_default(batching="continuous", max_batch_size=8)
    yield eng
    eng.close()


def _prompt(eng, text):
    return eng.apply_chat_template([{"role": "user", "content": text}])


def _static(eng, prompt, **kw):
    return eng.generate(prompt, temperature=0.0, seed=0, **kw)  # seeded: the static path


def test_greedy_equals_static(cb):
    prompts = [_prompt(cb, q) for q in QUESTIONS]
    futures = [cb.submit(p, max_tokens=16, temperature=0.0) for p in prompts]
    gens = [f.result(timeout=120) for f in futures]
    for p, g in zip(prompts, gens):
        ref = _static(cb, p, max_tokens=16)
        assert g.completion_ids == ref.completion_ids
        assert g.finish_reason == ref.finish_reason
        assert g.text == ref.text
        assert g.weight_version == ref.weight_version == cb.weight_version
        assert g.temperature == 0.0
        assert len(g.logprobs) == len(g.completion_ids)
        assert max(abs(a - b) for a, b in zip(g.logprobs, ref.logprobs)) < 1e-4
        if g.finish_reason == "stop":
            assert g.completion_ids[-1] in cb.stop_token_ids
    assert cb.model.config._attn_implementation == "sdpa"  # switched back once idle


def test_concurrent_sampled_requests(cb):
    before = cb.tokens_generated
    prompt = _prompt(cb, "Tell me a fact about cats.")
    with ThreadPoolExecutor(8) as pool:
        gens = list(pool.map(lambda i: cb.generate(prompt, max_tokens=12, temperature=1.0), range(8)))
    for g in gens:
        assert 1 <= len(g.completion_ids) <= 12
        assert len(g.logprobs) == len(g.completion_ids)
        assert all(isinstance(x, float) and x <= 0.0 for x in g.logprobs)
        assert g.finish_reason in ("stop", "length") and g.temperature == 1.0
    assert cb.tokens_generated - before == sum(len(g.completion_ids) for g in gens)


def test_short_request_joins_running_batch(cb):
    long = cb.submit(_prompt(cb, "Write a long story about a dragon and a knight."), max_tokens=64, temperature=0.0)
    time.sleep(1.0)  # the long one is decoding
    assert not long.done()
    short = cb.submit(_prompt(cb, "Say yes."), max_tokens=2, temperature=0.0).result(timeout=120)
    assert not long.done()  # the short one did not wait for the long one's batch
    done = long.result(timeout=120)
    assert len(short.completion_ids) <= 2
    assert done.finish_reason == "length" and len(done.completion_ids) == 64


def test_load_weights_state_dict(cb):
    model = cb.model
    original = {k: v.detach().clone() for k, v in model.state_dict().items()}
    prompt = _prompt(cb, QUESTIONS[0])
    before = cb.generate(prompt, max_tokens=8, temperature=0.0)
    try:
        changed = {k: v.clone() for k, v in original.items()}
        name = "model.layers.0.mlp.down_proj.weight"
        changed[name] += torch.randn(changed[name].shape, generator=torch.Generator().manual_seed(0)) * 0.5
        version = cb.load_weights(changed)
        assert version == before.weight_version + 1
        after = cb.generate(prompt, max_tokens=8, temperature=0.0)
        ref = _static(cb, prompt, max_tokens=8)
        assert after.weight_version == version
        assert after.completion_ids == ref.completion_ids
        assert max(abs(a - b) for a, b in zip(after.logprobs, ref.logprobs)) < 1e-4
        assert after.logprobs != before.logprobs
    finally:
        cb.load_weights(original)


def test_update_waits_for_inflight_and_gets_lock(cb):
    prompt = _prompt(cb, "Write a poem about the sea.")
    running = cb.submit(prompt, max_tokens=24, temperature=0.0)
    time.sleep(0.5)
    with cb.lock:  # what a trainer does: it gets the lock once the in-flight request is done
        assert running.done()
        version = cb.load_weights(cb.model)
        queued = cb.submit(prompt, max_tokens=2, temperature=0.0)
        time.sleep(0.3)
        assert not queued.done()  # new requests wait for the update
    assert queued.result(timeout=120).weight_version == version
    assert running.result().weight_version == version - 1


def test_close_stops_manager_threads():
    base = TransformersEngine.from_default(max_batch_size=2)
    eng = TransformersEngine(base.model, base.tokenizer, batching="continuous", max_batch_size=2)
    try:
        eng.generate(_prompt(eng, "Hi"), max_tokens=2, temperature=0.0)
        decoder = eng._serving.decoder
        threads = [m._generation_thread for m in decoder.managers.values()] + [decoder.thread]
        assert all(t is not None and t.is_alive() for t in threads)
    finally:
        eng.close()
        base.close()
    assert not any(t.is_alive() for t in threads)
    assert all(t not in threading.enumerate() for t in threads)
    assert base.model.config._attn_implementation == "sdpa"


def test_bogus_batching_is_config_error():
    with pytest.raises(ConfigError, match="batching"):
        TransformersEngine(torch.nn.Linear(1, 1), None, batching="bogus", stop_token_ids=[0])


def test_continuous_options_without_continuous_batching_is_refused():
    """Nothing set is silently ignored: the static engine has no continuous-batching config to apply them to."""
    with pytest.raises(ConfigError, match="continuous_options"):
        TransformersEngine(torch.nn.Linear(1, 1), None, continuous_options={"use_cuda_graph": True},
                           stop_token_ids=[0])
