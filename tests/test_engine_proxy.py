"""The real engine (SmolLM2-135M) behind the real LiteLLM proxy, called with the openai SDK."""

from __future__ import annotations

import concurrent.futures as cf
import json

import httpx
import openai
import pytest

from lightning_nb import LLMProxy, semconv
from lightning_nb.engines.transformers import DEFAULT_MODEL_NAME as M
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
    reply = client.chat.completions.create(model=M, messages=messages, max_tokens=16, temperature=0.7)
    raw = reply.model_dump()
    (span,) = store.query_spans(rid)
    gen = recorded[-1]
    assert span.attributes[semconv.PROMPT_TOKEN_IDS] == gen.prompt_ids == raw["prompt_token_ids"]
    assert span.attributes[semconv.COMPLETION_TOKEN_IDS] == gen.completion_ids == raw["choices"][0]["token_ids"]
    assert span.attributes[semconv.LOGPROBS] == pytest.approx(gen.logprobs)
    assert span.attributes["gen_ai.completion"] == reply.choices[0].message.content == gen.text
    assert reply.usage.completion_tokens == len(gen.completion_ids)
    df = store.spans_df()
    assert df.loc[0, "prompt_tokens"] == len(gen.prompt_ids)


def test_the_rollouts_sampling_parameters_are_applied_whatever_the_client_sends(proxied, recorded):
    """Framework clients never read llm.sampling_parameters: the proxy applies the rollout's itself."""
    store, proxy = proxied
    rollout = store.enqueue_rollout("t", metadata={"sampling_parameters": {"temperature": 0.0, "max_tokens": 3,
                                                                           "logit_bias": {"2": 5}}})
    aid = store.dequeue_rollout().attempt.attempt_id
    client = openai.OpenAI(base_url=proxy.endpoint(rollout.rollout_id, aid), api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Count from one to twenty in words."}]
    reply = client.chat.completions.create(model=M, messages=messages, max_tokens=64, temperature=1.3)
    gen = recorded[-1]
    assert gen.temperature == 0.0 and len(gen.completion_ids) <= 3 and reply.usage.completion_tokens <= 3
    greedy = proxy.engine.generate(gen.prompt_ids, max_tokens=3, temperature=0.0)
    assert gen.completion_ids == greedy.completion_ids  # the greedy completion, not a sample at 1.3
    (span,) = store.query_spans(rollout.rollout_id)
    a = span.attributes
    assert (a["gen_ai.request.temperature"], a["gen_ai.request.max_tokens"]) == (1.3, 64)  # what was asked
    # what was applied: the log-probs' distribution
    assert (a[semconv.APPLIED_TEMPERATURE], a[semconv.APPLIED_MAX_TOKENS]) == (0.0, 3)
    assert a["lightning_nb.sampling_not_applied"] == ["logit_bias"]  # said, not silently dropped
    # an unattributed call (no rollout) keeps the client's settings
    client = openai.OpenAI(base_url=proxy.endpoint(), api_key="unused", max_retries=0)
    client.chat.completions.create(model=M, messages=messages, max_tokens=5, temperature=0.9)
    assert recorded[-1].temperature == 0.9


def test_logprobs_come_in_the_openai_shape_and_only_when_asked(proxied, recorded):
    """OpenAI clients (the Agents SDK, AutoGen) parse ``logprobs.content[i]`` as token/bytes/logprob/top_logprobs."""
    store, proxy = proxied
    client = openai.OpenAI(base_url=proxy.endpoint(), api_key="unused", max_retries=0)
    messages = [{"role": "developer", "content": "Answer briefly."}, {"role": "user", "content": "What is 2 + 2?"}]
    plain = client.chat.completions.create(model=M, messages=messages, max_tokens=8, temperature=0.0)
    assert plain.choices[0].logprobs is None  # not asked: null, as OpenAI answers
    reply = client.chat.completions.create(model=M, messages=messages, max_tokens=8, temperature=0.0,
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
    ({"model": M, "messages": []}, "messages"),
    ({"model": M}, "messages"),
    ({"model": M, "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, "temperature"),
    ({"model": M, "messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ({"model": M, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
    ({"model": M, "messages": [{"role": "user", "content": "hi"}], "stream": "maybe"}, "stream"),
    ({"model": M, "messages": [{"role": "user", "content": "hi"}], "logit_bias": {"2": 5}}, "logit_bias"),
    ({"model": M, "messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_object"}},
     "response_format"),
    ({"model": M, "messages": [{"role": "user", "content": "hi", "audio": {"id": "x"}}]}, "messages.0.audio"),
    ({"model": M, "messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}, "tool_choice"),
    ({"model": M, "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "tools"),
    ({"model": M, "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 3},
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
        client.chat.completions.create(model=M, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    rid = store.enqueue_rollout("t").rollout_id
    r = httpx.post(f"{proxy.endpoint(rid, 'at-unknown')}/chat/completions", timeout=60,
                   json={"model": M, "messages": [{"role": "user", "content": "hi"}]})
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
            model=M, messages=[{"role": "user", "content": f"Say {i}"}], max_tokens=8, temperature=1.0)

    with cf.ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(ask, range(4)))
    assert all(r.choices[0].finish_reason in ("stop", "length") for r in replies)


# ----- the chat surface framework agents send ----------------------------------------------
CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


def _attempt(store):
    rid = store.enqueue_rollout("t").rollout_id
    return rid, store.dequeue_rollout().attempt.attempt_id


def test_unknown_model_is_a_404_naming_the_served_models(proxied):
    store, proxy = proxied
    rid, aid = _attempt(store)
    r = httpx.post(f"{proxy.endpoint(rid, aid)}/chat/completions", timeout=60,
                   json={"model": "gpt-5", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    assert "gpt-5" in r.text and M in r.text
    assert store.query_spans(rid) == []


def test_models_on_every_base_url_and_the_responses_api_points_to_chat_completions(proxied):
    store, proxy = proxied
    rid, aid = _attempt(store)
    for base in (proxy.endpoint(), proxy.endpoint(rid, aid)):
        assert [m.id for m in openai.OpenAI(base_url=base, api_key="x").models.list()] == [M]
        r = httpx.post(f"{base}/responses", json={"model": M, "input": "hi"}, timeout=30)
        assert r.status_code == 404 and "chat_completions" in r.json()["error"]["message"]


def test_stream_is_sse_with_the_same_tokens_as_a_plain_call(proxied):
    store, proxy = proxied
    rid, aid = _attempt(store)
    client = openai.OpenAI(base_url=proxy.endpoint(rid, aid), api_key="x", max_retries=0)
    messages = [{"role": "user", "content": "Name three colours."}]
    plain = client.chat.completions.create(model=M, messages=messages, max_tokens=24, temperature=0.0)
    chunks = list(client.chat.completions.create(model=M, messages=messages, max_tokens=24, temperature=0.0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content and len([c for c in chunks if c.choices]) > 3  # token by token
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == plain.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    first, second = store.query_spans(rid)
    assert first.attributes[semconv.COMPLETION_TOKEN_IDS] == second.attributes[semconv.COMPLETION_TOKEN_IDS]
    assert first.attributes[semconv.PROMPT_TOKEN_IDS] == second.attributes[semconv.PROMPT_TOKEN_IDS]


def test_stop_cuts_the_text_and_keeps_the_sampled_tokens(proxied):
    store, proxy = proxied
    rid, aid = _attempt(store)
    client = openai.OpenAI(base_url=proxy.endpoint(rid, aid), api_key="x", max_retries=0)
    messages = [{"role": "user", "content": "Count from one to ten in words, separated by commas."}]
    full = client.chat.completions.create(model=M, messages=messages, max_tokens=40, temperature=0.0)
    text = full.choices[0].message.content
    stop = text[5:7]  # a string greedy decoding is known to write
    cut = client.chat.completions.create(model=M, messages=messages, max_tokens=40, temperature=0.0,
                                         stop=["never-written", stop])
    assert cut.choices[0].message.content == text.split(stop)[0] and cut.choices[0].finish_reason == "stop"
    span = store.query_spans(rid)[-1]
    ids = span.attributes[semconv.COMPLETION_TOKEN_IDS]
    assert stop in proxy.engine.tokenizer.decode(ids) and stop not in proxy.engine.tokenizer.decode(ids[:-1])
    assert len(span.attributes[semconv.LOGPROBS]) == len(ids)
    assert span.attributes[semconv.APPLIED_STOP] == ["never-written", stop]


def test_seed_reproduces_a_sample_without_moving_the_global_rng(proxied):
    import torch

    store, proxy = proxied
    client = openai.OpenAI(base_url=proxy.endpoint(), api_key="x", max_retries=0)
    messages = [{"role": "user", "content": "Write a short poem about rain."}]
    before = torch.get_rng_state()
    replies = [client.chat.completions.create(model=M, messages=messages, max_tokens=16, temperature=1.0, seed=s)
               .model_dump()["choices"][0]["token_ids"] for s in (7, 7, 8, 9)]
    assert torch.equal(torch.get_rng_state(), before)
    assert replies[0] == replies[1]
    assert len({tuple(r) for r in replies}) >= 2  # other seeds sample other tokens


def test_n_choices_give_one_span_each(proxied):
    store, proxy = proxied
    rid, aid = _attempt(store)
    client = openai.OpenAI(base_url=proxy.endpoint(rid, aid), api_key="x", max_retries=0)
    reply = client.chat.completions.create(model=M, messages=[{"role": "user", "content": "Say a number."}],
                                           max_tokens=8, temperature=1.0, n=3, seed=1)
    spans = sorted(store.query_spans(rid), key=lambda s: s.attributes[semconv.CHOICE_INDEX])
    assert len(reply.choices) == 3 and [s.attributes[semconv.CHOICE_INDEX] for s in spans] == [0, 1, 2]
    raw = reply.model_dump()
    for span, choice in zip(spans, raw["choices"]):
        assert span.attributes[semconv.COMPLETION_TOKEN_IDS] == choice["token_ids"]
        assert span.attributes[semconv.PROMPT_TOKEN_IDS] == raw["prompt_token_ids"]
        assert span.attributes[semconv.CHOICES] == 3


def test_tools_are_rendered_as_hermes_text_and_tool_calls_parsed(proxied):
    """SmolLM2 writes tool calls as text: the proxy shows it the tools and parses <tool_call> JSON back."""
    from lightning_nb.engines.chat_format import parse_tool_calls

    store, proxy = proxied
    rid, aid = _attempt(store)
    client = openai.OpenAI(base_url=proxy.endpoint(rid, aid), api_key="x", max_retries=0)
    history = [
        {"role": "user", "content": "What is 17 * 23?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "calculator", "arguments": "{\"expression\": \"17 * 23\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "391"},
    ]
    client.chat.completions.create(model=M, messages=history, tools=[CALCULATOR], max_tokens=16, temperature=0.0)
    prompt = proxy.engine.tokenizer.decode(store.query_spans(rid)[-1].attributes[semconv.PROMPT_TOKEN_IDS])
    assert '<tool_call>\n{"name": "calculator", "arguments": {"expression": "17 * 23"}}\n</tool_call>' in prompt
    assert "<tool_response>\n391\n</tool_response>" in prompt
    assert '"description": "Evaluate an arithmetic expression"' in prompt.split("<|im_end|>")[0]  # the system turn
    # a fresh question, 4 seeded samples: each reply is exactly what parsing the raw completion gives.
    # SmolLM2-135M rarely writes a call when sampled (bench/tool_call_rate.py measures how often; RL is there
    # to raise it): seed 0 wrote none in 16 samples here, so these check the plain replies, one ended by the
    # stop token and one cut at max_tokens; calls the model does write are parsed end to end in
    # test_framework_agents.py (greedy, where it writes them).
    reply = client.chat.completions.create(model=M, messages=history[:1], tools=[CALCULATOR], tool_choice="auto",
                                           max_tokens=48, temperature=1.0, n=4, seed=0)
    spans = {s.attributes[semconv.CHOICE_INDEX]: s.attributes for s in store.query_spans(rid)
             if s.attributes.get(semconv.CHOICES) == 4}
    assert sorted(spans) == list(range(4))
    assert {c.finish_reason for c in reply.choices if not c.message.tool_calls} == {"stop", "length"}
    for choice in reply.choices:
        raw = spans[choice.index]["gen_ai.completion"]
        content, calls = parse_tool_calls(raw, ["calculator"])
        assert [c.function.model_dump() for c in choice.message.tool_calls or []] == [c["function"] for c in calls]
        if calls:
            # cut at max_tokens (48 tokens, no stop token at the end) stays "length", as OpenAI reports it
            ids = spans[choice.index][semconv.COMPLETION_TOKEN_IDS]
            cut = len(ids) == 48 and ids[-1] not in proxy.engine.stop_token_ids
            assert choice.finish_reason == ("length" if cut else "tool_calls") and choice.message.content == content
            assert json.loads(spans[choice.index][semconv.RESPONSE_TOOL_CALLS])[0]["function"] == calls[0]["function"]
        else:
            assert choice.message.content == raw and choice.finish_reason in ("stop", "length")
    written = sum(bool(c.message.tool_calls) for c in reply.choices)
    print(f"tool calls written: {written}/4")
    # tool_choice="none" hides the tools and parses nothing
    client.chat.completions.create(model=M, messages=history[:1], tools=[CALCULATOR], tool_choice="none",
                                   max_tokens=4, temperature=0.0)
    served = store.query_spans(rid)[-1].attributes[semconv.PROMPT_TOKEN_IDS]
    assert "<tools>" not in proxy.engine.tokenizer.decode(served)


def test_parse_tool_calls_reads_hermes_blocks_and_keeps_other_text():
    from lightning_nb.engines.chat_format import parse_tool_calls

    text = 'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'
    content, calls = parse_tool_calls(text, ["calculator"])
    assert content == "Let me compute." and len(calls) == 1
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert calls[0]["function"] == {"name": "calculator", "arguments": '{"expression": "2+3"}'}
    # unclosed final block (the stop token ended it), arguments as a JSON string
    content, calls = parse_tool_calls('<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1\\"}"}')
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"expression": "1"}
    # an unknown tool, bad JSON or no name stays text
    for bad in ('<tool_call>{"name": "search", "arguments": {}}</tool_call>', "<tool_call>{oops</tool_call>",
                '<tool_call>{"arguments": {}}</tool_call>'):
        assert parse_tool_calls(bad, ["calculator"]) == (bad, [])
