"""Reference doc 002 as written is the contract: a rollout server built from the doc's text alone
(``tests/_doc002_server.py``, which imports nothing of the kit) drives the kit, and the LLM proxy's checks of a
callback (its ``rollout_id``, its ``response_mask``, an attempt that already ended) over real HTTP on loopback,
on the real SmolLM2-135M with greedy sampling."""

from __future__ import annotations

import httpx
import pytest

from _doc002_server import TOOLS, make_app
from lightning_nb import TripletAdapter, start_runners
from lightning_nb._net import ThreadedServer
from lightning_nb.agents.remote import RemoteRolloutAgent, final_text
from lightning_nb.engines.chat_format import native_prompt_ids
from lightning_nb.semconv import COMPLETION_TOKEN_IDS, ERROR, LLM_SPAN, PROMPT_TOKEN_IDS, REQUEST_RESPONSE_MASK
from lightning_nb.trainers.packing import pack_episode

# Greedy SmolLM2 calls a calculator tool for the first two (doc 002's layout: four tools, no system message)
# and answers the other two in text: both kinds of episode.
TASKS = ["Add 5 and 3.", "Multiply 6 and 7.", "Subtract 9 from 20.", "Divide 12 by 4."]
SAMPLING = {"temperature": 0.0, "max_tokens": 40}


@pytest.fixture
def doc_server(engine):
    app = make_app(engine.tokenizer)
    server = ThreadedServer(app, "127.0.0.1", 0, "doc 002 rollout server")
    port = server.start()
    yield f"http://127.0.0.1:{port}", app
    server.stop()


def _llm_spans(store, rollout_id):
    return [s for s in store.query_spans(rollout_id) if s.name == LLM_SPAN]


def test_a_rollout_server_written_from_doc_002_alone_trains_through_the_kit(engine, proxied, doc_server):
    store, proxy = proxied
    store.add_resources({"main_llm": proxy.as_resource(**SAMPLING)})
    url, app = doc_server
    agent = RemoteRolloutAgent(url, reward_fn=lambda task, msgs: float(any(c.isdigit() for c in final_text(msgs))),
                               max_turns=3)
    ids = [store.enqueue_rollout(t).rollout_id for t in TASKS]
    with start_runners(agent, store, n=2):
        done = store.wait_for_rollouts(ids, timeout=600)
    errors = [store.query_attempts(i)[-1].error for i in ids]
    assert [r.status for r in done] == ["succeeded"] * 4, errors
    masks_checked = 0
    for session in app.state.sessions:
        spans = _llm_spans(store, session.request["rollout_id"])
        assert len(spans) == len(session.masks) >= 1
        for k, (span, mask) in enumerate(zip(spans, session.masks)):
            a = span.attributes
            assert a[PROMPT_TOKEN_IDS] and a[COMPLETION_TOKEN_IDS] and ERROR not in a  # token IDs on every call
            if mask is None:
                assert REQUEST_RESPONSE_MASK not in a
                continue
            masks_checked += 1
            assert a[REQUEST_RESPONSE_MASK] == mask == [0] * len(mask)
            prev = spans[k - 1].attributes
            served = len(a[PROMPT_TOKEN_IDS]) - len(prev[PROMPT_TOKEN_IDS]) - len(prev[COMPLETION_TOKEN_IDS])
            # the server counted on its own render of its messages (the model's template, which shows no tools),
            # not on the tokens the proxy served (the tools rendered into the prompt): the proxy counted both
            assert len(mask) != served > 0
    assert masks_checked >= 1, [s.masks for s in app.state.sessions]  # a tool-calling episode sent its mask
    triplets = TripletAdapter().adapt(store, ids)
    assert {t.rollout_id for t in triplets} == set(ids)
    for rid in ids:  # each episode one packed sequence: the second prompt extends the first prompt and reply
        [seq] = pack_episode([t for t in triplets if t.rollout_id == rid], 1.0)
        assert seq.fork_at is None


def _running_attempt(store):
    store.enqueue_rollout("conformance")
    item = store.dequeue_rollout("w")
    return item.rollout.rollout_id, item.attempt.attempt_id


def _post(url, body):
    return httpx.post(f"{url}/chat/completions", json=body, timeout=120)


def test_the_proxy_checks_a_callbacks_rollout_id_mask_and_attempt(engine, proxied, doc_server):
    store, proxy = proxied
    rid, aid = _running_attempt(store)
    url = proxy.endpoint(rid, aid)
    tools = TOOLS
    first = {"model": engine.model_name, "messages": [{"role": "user", "content": TASKS[0]}], "tools": tools,
             **SAMPLING}
    # rollout_id in the body: accepted when it is the URL's, a 400 naming both when not, and off an attempt URL
    wrong = _post(url, {**first, "rollout_id": "ro-other"})
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "rollout_id"
    assert "'ro-other'" in wrong.json()["error"]["message"] and repr(rid) in wrong.json()["error"]["message"]
    plain = _post(proxy.endpoint(), {**first, "rollout_id": rid})
    assert plain.status_code == 400 and plain.json()["error"]["param"] == "rollout_id"
    assert _llm_spans(store, rid) == []
    ok = _post(url, {**first, "rollout_id": rid})
    assert ok.status_code == 200, ok.text
    reply = ok.json()
    assert reply["token_ids"] == reply["choices"][0]["token_ids"] and reply["token_ids"]  # doc 002 reads this one
    [call] = reply["choices"][0]["message"]["tool_calls"]
    messages = first["messages"] + [
        {"role": "assistant", "content": reply["choices"][0]["message"]["content"] or "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": '{"operation": "add", "a": 5.0, "b": 3.0, "result": 8.0, '
                                                                '"exact": true, "note": "a + b, in floating point"}'}]
    added = (len(native_prompt_ids(engine.tokenizer, messages, tools))
             - len(native_prompt_ids(engine.tokenizer, messages[:1], tools)) - len(reply["token_ids"]))
    assert added > 0
    second = {**first, "rollout_id": rid, "messages": messages}
    # a 1 over tokens the model did not sample: a 400 naming the position, recorded as an error span
    one = _post(url, {**second, "response_mask": [0] * 2 + [1] * (added - 2)})
    assert one.status_code == 400 and one.json()["error"]["param"] == "response_mask"
    assert "response_mask[2] is 1" in one.json()["error"]["message"]
    short = _post(url, {**second, "response_mask": [0] * (added - 1)})
    assert short.status_code == 400 and f"has {added - 1} entries" in short.json()["error"]["message"]
    spans = _llm_spans(store, rid)
    assert len(spans) == 3 and all(ERROR in s.attributes for s in spans[1:])
    good = _post(url, {**second, "response_mask": [0] * added})  # sized as doc 002's session sizes it
    assert good.status_code == 200, good.text
    assert _llm_spans(store, rid)[-1].attributes[REQUEST_RESPONSE_MASK] == [0] * added
    # the attempt ends: a later call is refused (409 naming the attempt and its status) and nothing is stored
    store.update_attempt(rid, aid, status="succeeded")
    before = [s.model_dump() for s in store.query_spans(rid)]
    late = _post(url, {**second, "rollout_id": rid})
    assert late.status_code == 409 and late.json()["error"]["param"] == "attempt_id"
    assert f"attempt {aid!r} of rollout {rid!r} is already 'succeeded'" in late.json()["error"]["message"]
    assert [s.model_dump() for s in store.query_spans(rid)] == before
