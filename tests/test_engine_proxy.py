"""The real engine (SmolLM2-135M) behind the real LiteLLM proxy, called with the openai SDK."""

from __future__ import annotations

import concurrent.futures as cf

import httpx
import openai
import pytest

from lightning_nb import LLMProxy
from lightning_nb.errors import ConfigError
from lightning_nb.store import InMemoryStore

pytestmark = pytest.mark.slow


@pytest.fixture
def recorded(engine):
    """Record every Generation the engine returns (wraps the real batch function)."""
    seen = []
    original = engine._run_batch

    def run_batch(*args, **kwargs):
        out = original(*args, **kwargs)
        seen.extend(out)
        return out

    engine._run_batch = run_batch
    yield seen
    engine._run_batch = original


@pytest.fixture
def proxied(engine):
    store = InMemoryStore()
    with LLMProxy(engine, store) as proxy:
        yield store, proxy


def test_engine_batches_and_reports_ids_and_logprobs(engine, recorded):
    prompts = [engine.apply_chat_template([{"role": "user", "content": f"Count to {i}."}]) for i in range(4)]
    futures = [engine.submit(p, max_tokens=12, temperature=0.0) for p in prompts]
    results = [f.result(timeout=120) for f in futures]
    assert len(recorded) == 4
    for p, g in zip(prompts, results):
        assert g.prompt_ids == p
        assert 1 <= len(g.completion_ids) <= 12 and len(g.logprobs) == len(g.completion_ids)
        assert all(lp <= 0 for lp in g.logprobs)
        if g.finish_reason == "stop":
            assert g.completion_ids[-1] == 2  # <|im_end|>, not the GGUF's bogus eos id 1
    with pytest.raises(ConfigError, match="temperature"):
        engine.submit(prompts[0], temperature=-1)


def test_proxy_records_engine_token_ids_in_spans(proxied, recorded):
    store, proxy = proxied
    rid = store.enqueue_rollout("t").rollout_id
    aid = store.dequeue_rollout().attempt.attempt_id
    client = openai.OpenAI(base_url=proxy.endpoint(rid, aid), api_key="unused")
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    reply = client.chat.completions.create(model="SmolLM2", messages=messages, max_tokens=16, temperature=0.7)
    raw = reply.model_dump()
    (span,) = store.query_spans(rid)
    gen = recorded[-1]
    assert span.attributes["prompt_token_ids"] == gen.prompt_ids == raw["prompt_token_ids"]
    assert span.attributes["completion_token_ids"] == gen.completion_ids == raw["choices"][0]["token_ids"]
    assert span.attributes["logprobs"] == pytest.approx(gen.logprobs)
    assert span.attributes["gen_ai.completion"] == reply.choices[0].message.content == gen.text
    assert reply.usage.completion_tokens == len(gen.completion_ids)
    df = store.spans_df()
    assert df.loc[0, "prompt_tokens"] == len(gen.prompt_ids)


def test_the_rollouts_sampling_parameters_are_applied_whatever_the_client_sends(proxied, recorded):
    """Framework clients never read llm.sampling_parameters: the proxy applies the rollout's itself."""
    store, proxy = proxied
    rollout = store.enqueue_rollout("t", metadata={"sampling_parameters": {"temperature": 0.0, "max_tokens": 3,
                                                                           "stop": ["\n"]}})
    aid = store.dequeue_rollout().attempt.attempt_id
    client = openai.OpenAI(base_url=proxy.endpoint(rollout.rollout_id, aid), api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Count from one to twenty in words."}]
    reply = client.chat.completions.create(model="m", messages=messages, max_tokens=64, temperature=1.3)
    gen = recorded[-1]
    assert gen.temperature == 0.0 and len(gen.completion_ids) <= 3 and reply.usage.completion_tokens <= 3
    greedy = proxy.engine.generate(gen.prompt_ids, max_tokens=3, temperature=0.0)
    assert gen.completion_ids == greedy.completion_ids  # the greedy completion, not a sample at 1.3
    (span,) = store.query_spans(rollout.rollout_id)
    a = span.attributes
    assert (a["gen_ai.request.temperature"], a["gen_ai.request.max_tokens"]) == (1.3, 64)  # what was asked
    assert (a["temperature"], a["max_tokens"]) == (0.0, 3)  # what was applied: the log-probs' distribution
    assert a["lightning_nb.sampling_not_applied"] == ["stop"]  # said, not silently dropped
    # an unattributed call (no rollout) keeps the client's settings
    client = openai.OpenAI(base_url=proxy.endpoint(), api_key="unused", max_retries=0)
    client.chat.completions.create(model="m", messages=messages, max_tokens=5, temperature=0.9)
    assert recorded[-1].temperature == 0.9


def test_logprobs_come_in_the_openai_shape_and_only_when_asked(proxied, recorded):
    """OpenAI clients (the Agents SDK, AutoGen) parse ``logprobs.content[i]`` as token/bytes/logprob/top_logprobs."""
    store, proxy = proxied
    client = openai.OpenAI(base_url=proxy.endpoint(), api_key="unused", max_retries=0)
    messages = [{"role": "developer", "content": "Answer briefly."}, {"role": "user", "content": "What is 2 + 2?"}]
    plain = client.chat.completions.create(model="m", messages=messages, max_tokens=8, temperature=0.0)
    assert plain.choices[0].logprobs is None  # not asked: null, as OpenAI answers
    reply = client.chat.completions.create(model="m", messages=messages, max_tokens=8, temperature=0.0,
                                           logprobs=True, top_logprobs=0)
    gen = recorded[-1]
    content = reply.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx(gen.logprobs)
    assert [c.token for c in content] == [proxy.engine.tokenizer.decode([t]) for t in gen.completion_ids]
    assert all(c.bytes == list(c.token.encode()) and c.top_logprobs == [] for c in content)
    # the developer message was rendered as the system turn
    system = proxy.engine.apply_chat_template([{"role": "system", "content": "Answer briefly."},
                                               {"role": "user", "content": "What is 2 + 2?"}])
    assert gen.prompt_ids == system


@pytest.mark.parametrize("body, field", [
    ({"model": "m", "messages": []}, "messages"),
    ({"model": "m"}, "messages"),
    ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, "temperature"),
    ({"model": "m", "messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
    ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}, "stream"),
    ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 3},
     "top_logprobs"),
])
def test_malformed_requests_name_the_field_and_keep_store(proxied, body, field):
    store, proxy = proxied
    rid = store.enqueue_rollout("t").rollout_id
    aid = store.dequeue_rollout().attempt.attempt_id
    r = httpx.post(f"{proxy.endpoint(rid, aid)}/chat/completions", json=body, timeout=60)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"]
    assert store.get_rollout_by_id(rid).status == "preparing" and store.query_spans(rid) == []


def test_invalid_json_and_unknown_rollout(proxied):
    store, proxy = proxied
    r = httpx.post(f"{proxy.url}/v1/chat/completions", content=b"{not json", timeout=60)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    client = openai.OpenAI(base_url=proxy.endpoint("ro-unknown", "at-unknown"), api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError, match="ro-unknown"):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    rid = store.enqueue_rollout("t").rollout_id
    r = httpx.post(f"{proxy.endpoint(rid, 'at-unknown')}/chat/completions", timeout=60,
                   json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404 and r.json()["error"]["param"] == "attempt_id" and "at-unknown" in r.text
    assert store.query_spans() == []


def test_non_loopback_bind_requires_a_token(engine):
    store = InMemoryStore()
    with pytest.raises(ConfigError, match="api_key is required"):
        LLMProxy(engine, store, host="0.0.0.0")
    with LLMProxy(engine, store, api_key="s3cret") as proxy:
        assert httpx.get(f"{proxy.url}/health").status_code == 401
        ok = httpx.get(f"{proxy.url}/health", headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200 and ok.json()["status"] == "ok"


def test_concurrent_calls_through_proxy(proxied):
    store, proxy = proxied
    client = openai.OpenAI(base_url=proxy.endpoint(), api_key="x")

    def ask(i):
        return client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": f"Say {i}"}], max_tokens=8, temperature=1.0)

    with cf.ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(ask, range(4)))
    assert all(r.choices[0].finish_reason in ("stop", "length") for r in replies)
