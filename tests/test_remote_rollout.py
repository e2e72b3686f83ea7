"""The remote rollout protocol (reference doc 002), both sides, over real HTTP on loopback.

The trainer side is :class:`~lightning_nb.agents.remote.RemoteRolloutAgent` run by our runners
(``start_runners``), the callback is the real LLM proxy on the real SmolLM2-135M, and the rollout server is
the kit's reference one (:mod:`lightning_nb.agents.rollout_server`) or, for the faults, a small FastAPI app
here that answers what a broken server would (no model calls). Greedy sampling and short replies keep the
module short on 2 cores.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
import warnings

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse

from lightning_nb import TripletAdapter, semconv, start_runners
from lightning_nb._net import ThreadedServer
from lightning_nb.agents.protocol import (FINISH_REASONS, MaskTracker, RolloutRequest, RolloutResponse,
                                          RolloutServerError, SamplingParams, ToolsResponse,
                                          parse_rollout_response, parse_tools_response)
from lightning_nb.agents.remote import RemoteRolloutAgent, callback_url, final_text
from lightning_nb.agents.rollout_server import CALCULATOR_TOOLS, RolloutServer, run_tool
from lightning_nb.errors import ConfigError
from lightning_nb.proxy.proxy import LLMProxy
from lightning_nb.semconv import ERROR, LLM_SPAN, REQUEST_RESPONSE_MASK, TOOL_INPUT, TOOL_OUTPUT, TOOL_SPAN_PREFIX
from lightning_nb.store import InMemoryStore
from lightning_nb.trainers.packing import pack_episode
from lightning_nb.types import LLMResource, RolloutConfig
from conftest import IDLE_LLM

# Greedy SmolLM2 answers "Add 5 and 3." with <tool_call>{"name": "add", "arguments": {"a": 5, "b": 3}} in the
# reference server's layout (its four tools, no system message); 40 tokens hold the call.
TOOL_QUESTION = "Add 5 and 3."
SAMPLING = {"temperature": 0.0, "max_tokens": 40}
SERVER_SPAN = f"{TOOL_SPAN_PREFIX}rollout_server"


def run(agent, store, tasks, n=2):
    """Run ``tasks`` through ``n`` runner threads; the rollouts (in task order) and each one's latest attempt."""
    ids = [store.enqueue_rollout(t).rollout_id for t in tasks]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the first failure of each kind warns; tested apart
        with start_runners(agent, store, n=n):
            done = store.wait_for_rollouts(ids, timeout=600)
    assert len(done) == len(ids), "rollouts did not finish"
    return [(store.get_rollout_by_id(i), store.query_attempts(i)[-1]) for i in ids]


def spans_of(store, rollout_id, name):
    return [s for s in store.query_spans(rollout_id, "latest") if s.name == name]


def reward_of(store, rollout_id):
    return [s.attributes[semconv.REWARD] for s in store.query_spans(rollout_id, "latest") if s.name == "reward"]


@pytest.fixture(scope="module")
def reference_server(engine):
    with RolloutServer(tokenizer=engine.tokenizer) as server:
        yield server


# ----- a rollout server gone wrong: the task's text says how ------------------------------------------------
async def _fake_rollout(request: Request):
    req = await request.json()
    mode, rid = req["messages"][0]["content"], req["rollout_id"]
    ok = {"rollout_id": rid, "status": "COMPLETED", "finish_reason": "stop",
          "final_messages": req["messages"] + [{"role": "assistant", "content": "8"}],
          "metrics": {"num_llm_calls": 1}}
    if mode == "error":
        return {"rollout_id": rid, "status": "ERROR", "error_message": "tool backend down", "final_messages": []}
    if mode == "finish_error":
        return {**ok, "finish_reason": "error", "error_message": "gave up"}
    if mode == "hang":
        await asyncio.sleep(4)
        return ok
    if mode == "nonsense":
        return PlainTextResponse("<html>502 Bad Gateway</html>")
    if mode == "missing":
        return {k: v for k, v in ok.items() if k != "status"}
    if mode == "unknown_finish":
        return {**ok, "finish_reason": "done"}
    if mode == "other_id":
        return {**ok, "rollout_id": "ro-someone-else"}
    if mode == "server_reward":
        return {**ok, "reward": 0.25}
    if mode == "no_final":
        return {k: v for k, v in ok.items() if k != "final_messages"}
    if mode == "late_callback":  # answers at once, then calls the model back a second later (after the attempt ended)
        LATE.append(asyncio.create_task(_late_callback(req)))
        return ok
    if mode == "wrong_mask":  # one callback with a mask for 3 added tokens on the first call (the prompt is all new)
        body = {"model": req["sampling_params"]["model"], "messages": req["messages"], "max_tokens": 1,
                "response_mask": [0, 0, 0]}
        async with httpx.AsyncClient(timeout=120) as client:
            r = await client.post(f"{req['server_url']}/v1/chat/completions", json=body,
                                  headers={"Authorization": f"Bearer {req['callback_api_key']}"})
        return {"rollout_id": rid, "status": "ERROR", "final_messages": [],
                "error_message": f"HTTP {r.status_code}: {r.json()['error']['message']}"}
    return ok


async def _late_callback(req):
    await asyncio.sleep(1.0)
    body = {"model": req["sampling_params"]["model"], "messages": req["messages"], "max_tokens": 1}
    async with httpx.AsyncClient(timeout=120) as client:
        r = await client.post(f"{req['server_url']}/v1/chat/completions", json=body,
                              headers={"Authorization": f"Bearer {req['callback_api_key']}"})
    return r.status_code, r.json()


LATE: list = []  # the late callbacks' tasks: each gives (HTTP status, body)
TOOLS_HITS: list[float] = []  # one entry per GET /tools the fake server answered


def _fake_tools():
    TOOLS_HITS.append(time.monotonic())
    return {"tools": CALCULATOR_TOOLS}


@pytest.fixture(scope="module")
def fake_server():
    app = FastAPI()
    app.get("/tools")(_fake_tools)
    app.post("/rollout")(_fake_rollout)
    server = ThreadedServer(app, "127.0.0.1", 0, "fake rollout server")
    port = server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


def _dead_url():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


# ----- the schemas and the mask arithmetic -----------------------------------------------------------------
def test_doc_002_worked_response_mask_example():
    """Turn 1: prompt [1..5] -> None, reply 5 tokens; turn 2: prompt [1..13] -> three zeros, reply 3 -> 16."""
    tracker = MaskTracker()
    assert tracker.mask_for(5) is None
    tracker.after_reply(5, 5)
    assert tracker.last_length == 10
    assert tracker.mask_for(13) == [0, 0, 0]
    tracker.after_reply(13, 3)
    assert tracker.last_length == 16
    assert tracker.mask_for(16) is None  # nothing added since: no mask


def test_schemas_follow_doc_002():
    req = RolloutRequest(rollout_id="r1", messages=[{"role": "user", "content": "hi"}],
                         server_url="http://127.0.0.1:1/rollout/r1/attempt/a1/", sampling_params={"model": "m"},
                         tools=CALCULATOR_TOOLS)
    assert req.server_url == "http://127.0.0.1:1/rollout/r1/attempt/a1"
    assert (req.max_turns, req.max_tokens_total, req.callback_api_key, req.metadata) == (10, 8192, None, {})
    assert [t.function["name"] for t in ToolsResponse(tools=CALCULATOR_TOOLS).tools] == [
        "add", "subtract", "multiply", "divide"]
    err = RolloutResponse.error("r1", "boom").model_dump(mode="json", exclude_none=True)
    assert {k: err[k] for k in ("rollout_id", "status", "error_message", "final_messages")} == {
        "rollout_id": "r1", "status": "ERROR", "error_message": "boom", "final_messages": []}
    assert FINISH_REASONS == ("stop", "max_turns", "max_tokens", "error")
    for bad, field in (({"rollout_id": "r1", "status": "COMPLETED", "finish_reason": "done"}, "finish_reason"),
                       ({"rollout_id": "r1", "finish_reason": "stop"}, "status"),
                       ({"rollout_id": "r1", "status": "DONE"}, "status"),
                       ({"rollout_id": "r1", "status": "COMPLETED", "final_messages": [{"role": "robot"}]},
                        "final_messages.0.role"),
                       ({"rollout_id": "r1", "status": "COMPLETED", "score": 1}, "score"),
                       ([1, 2], "body")):
        with pytest.raises(RolloutServerError, match=field) as info:
            parse_rollout_response(bad, "http://x")
        assert info.value.field == field
    with pytest.raises(RolloutServerError, match="field 'tools.0.function' is invalid") as info:
        parse_tools_response({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "http://x")
    assert info.value.field == "tools.0.function"
    with pytest.raises(ValueError, match="server_url"):
        RolloutRequest(rollout_id="r", messages=[{"role": "user", "content": "x"}], server_url="ftp://x",
                       sampling_params={"model": "m"})
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(model="m", top_k=5)


def test_calculator_tools():
    assert asyncio.run(run_tool("add", '{"a": 5, "b": 3}')) == "8"
    assert asyncio.run(run_tool("divide", {"a": 7, "b": 2})) == "3.5"
    assert asyncio.run(run_tool("divide", {"a": 1, "b": 0})) == "error: division by zero"
    assert asyncio.run(run_tool("subtract", {"a": 1})).startswith("error: subtract takes two numbers")
    assert asyncio.run(run_tool("power", {"a": 1, "b": 2})).startswith("error: unknown tool 'power'")


def test_agent_settings_are_checked():
    with pytest.raises(ConfigError, match="api_key is required"):
        RemoteRolloutAgent("http://10.1.2.3:9000")
    RemoteRolloutAgent("http://10.1.2.3:9000", api_key="k")
    with pytest.raises(ConfigError, match="url must be"):
        RemoteRolloutAgent("127.0.0.1:9000")
    with pytest.raises(ConfigError, match="timeout_s"):
        RemoteRolloutAgent("http://127.0.0.1:9000", timeout_s=0)
    with pytest.raises(ConfigError, match="api_key is required"):
        RolloutServer(host="0.0.0.0")
    with pytest.raises(ConfigError, match="not an LLM proxy URL attributed"):
        callback_url("http://127.0.0.1:8000/v1")
    assert callback_url("http://127.0.0.1:8000/rollout/ro-1/attempt/at-2/v1") == (
        "http://127.0.0.1:8000/rollout/ro-1/attempt/at-2", "ro-1", "at-2")


# ----- a whole episode: the reference server, the proxy, the runners ------------------------------------------
def test_episode_through_the_reference_server_is_one_masked_sequence(engine, proxied, reference_server):
    store, proxy = proxied
    store.add_resources({"main_llm": proxy.as_resource(**SAMPLING)})
    seen = []

    def reward_fn(task, final_messages):
        seen.append(final_messages)
        return 1.0 if "8" in final_text(final_messages) else 0.0

    agent = RemoteRolloutAgent(reference_server.url, reward_fn=reward_fn, max_turns=3)
    agent.preflight()
    [(rollout, attempt)] = run(agent, store, [TOOL_QUESTION], n=1)
    assert rollout.status == "succeeded", attempt.error
    [final] = seen
    assert final[0] == {"role": "user", "content": TOOL_QUESTION}
    assert final[1]["tool_calls"][0]["function"]["name"] == "add"
    assert final[2] == {"role": "tool", "tool_call_id": final[1]["tool_calls"][0]["id"], "content": "8"}
    assert reward_of(store, rollout.rollout_id) == [1.0 if "8" in final_text(final) else 0.0]

    [server_span] = spans_of(store, rollout.rollout_id, SERVER_SPAN)
    assert "callback_api_key" not in json.loads(server_span.attributes[TOOL_INPUT])
    answer = json.loads(server_span.attributes[TOOL_OUTPUT])
    calls = spans_of(store, rollout.rollout_id, LLM_SPAN)
    assert answer["metrics"]["num_llm_calls"] == len(calls) >= 2
    assert answer["metrics"]["num_tool_calls"] >= 1 and answer["finish_reason"] in ("stop", "max_turns")
    first, second = calls[0].attributes, calls[1].attributes
    assert REQUEST_RESPONSE_MASK not in first
    first_prompt, first_completion = first[semconv.PROMPT_TOKEN_IDS], first[semconv.COMPLETION_TOKEN_IDS]
    added = len(second[semconv.PROMPT_TOKEN_IDS]) - len(first_prompt) - len(first_completion)
    assert added > 0 and second[REQUEST_RESPONSE_MASK] == [0] * added
    # the second prompt extends the first prompt and completion token for token: one packed sequence
    assert second[semconv.PROMPT_TOKEN_IDS][: len(first_prompt) + len(first_completion)] == (
        first_prompt + first_completion)
    ep = store.episode(rollout.rollout_id)  # built from the same spans: the calls, the tool result, the reward
    assert [c.completion_ids for c in ep.calls] == [c.attributes[semconv.COMPLETION_TOKEN_IDS] for c in calls]
    assert ep.calls[0].tool_calls[0]["function"]["name"] == "add" and ep.calls[1].messages[2]["content"] == "8"
    assert ep.reward == reward_of(store, rollout.rollout_id)[0] and ep.task == TOOL_QUESTION
    triplets = TripletAdapter().adapt(store, [rollout.rollout_id])
    [seq] = pack_episode(triplets, 1.0)
    assert seq.fork_at is None and len(seq.input_ids) == len(triplets[-1].prompt_ids) + len(triplets[-1].response_ids)
    start = len(first_prompt) + len(first_completion)
    assert seq.mask[start:start + added] == [0] * added  # the tool result's tokens are not trained
    assert "<tool_response>\n8\n</tool_response>" in engine.tokenizer.decode(seq.input_ids[start:start + added])
    assert seq.mask[start - len(first_completion):start] == [1] * len(first_completion)


# ----- faults: each fails its attempt with an error naming what went wrong; what was stored stays --------------
def test_a_broken_rollout_server_fails_each_attempt_naming_the_field(proxied_store, fake_server):
    agent = RemoteRolloutAgent(fake_server, reward_fn=lambda task, msgs: 1.0, timeout_s=1.0)
    agent.calls_model = False  # the fake server never calls the model back ("ok" would be refused otherwise)
    modes = ["error", "finish_error", "hang", "nonsense", "missing", "unknown_finish", "other_id", "no_final", "ok"]
    results = dict(zip(modes, run(agent, proxied_store, modes, n=4)))
    expected = {"error": ("RolloutServerError", "status ERROR): tool backend down"),
                "finish_error": ("RolloutServerError", "finish_reason error): gave up"),
                "hang": ("RolloutServerTimeout", f"{fake_server} did not answer POST /rollout"),
                "nonsense": ("RolloutServerError", "body that is not JSON: '<html>502 Bad Gateway</html>'"),
                "missing": ("RolloutServerError", "field 'status' is missing"),
                "unknown_finish": ("RolloutServerError", "field 'finish_reason' is invalid"),
                "other_id": ("RolloutServerError", "answered for rollout_id 'ro-someone-else'"),
                "no_final": ("RolloutServerError", "answered status COMPLETED without field 'final_messages'")}
    for mode, (kind, text) in expected.items():
        rollout, attempt = results[mode]
        assert rollout.status == "failed", mode
        assert f"{kind}: " in attempt.error and text in attempt.error, (mode, attempt.error)
        assert spans_of(proxied_store, rollout.rollout_id, SERVER_SPAN), mode  # the request stays recorded
    assert "timeout_s=1 s" in results["hang"][1].error
    assert spans_of(proxied_store, results["nonsense"][0].rollout_id, SERVER_SPAN)[0].attributes[TOOL_OUTPUT] == (
        "<html>502 Bad Gateway</html>")
    assert results["ok"][0].status == "succeeded" and reward_of(proxied_store, results["ok"][0].rollout_id) == [1.0]


def _no_model_agent(url, **options):
    """A RemoteRolloutAgent for the fake server, which never calls the model back: not declared to call it."""
    agent = RemoteRolloutAgent(url, **options)
    agent.calls_model = False
    return agent


def test_server_reward_is_used_without_reward_fn_and_warned_about_with_one(proxied_store, fake_server):
    [(rollout, attempt)] = run(_no_model_agent(fake_server), proxied_store, ["server_reward"], n=1)
    assert rollout.status == "succeeded" and reward_of(proxied_store, rollout.rollout_id) == [0.25]
    [(rollout, attempt)] = run(_no_model_agent(fake_server), proxied_store, ["ok"], n=1)
    assert rollout.status == "failed" and "sent no 'reward'" in attempt.error
    agent = _no_model_agent(fake_server, reward_fn=lambda task, msgs: 1.0)
    ids = [proxied_store.enqueue_rollout("server_reward").rollout_id for _ in range(2)]
    with pytest.warns(RuntimeWarning, match="sent reward=0.25 and reward_fn is set") as record:
        with start_runners(agent, proxied_store, n=1):
            proxied_store.wait_for_rollouts(ids, timeout=60)
    assert len([w for w in record if "reward_fn is set" in str(w.message)]) == 1
    assert [reward_of(proxied_store, i) for i in ids] == [[1.0], [1.0]]


def test_a_wrong_response_mask_is_a_400_and_an_attempt_error(proxied_store, fake_server):
    store = proxied_store
    resource = store.get_latest_resources().resources["main_llm"]
    store.add_resources({"main_llm": resource.model_copy(update={"sampling_parameters": {"max_tokens": 1}})})
    agent = RemoteRolloutAgent(fake_server, reward_fn=lambda task, msgs: 1.0)
    [(rollout, attempt)] = run(agent, store, ["wrong_mask"], n=1)
    assert rollout.status == "failed"
    assert "HTTP 400: response_mask has 3 entries" in attempt.error
    [call] = spans_of(store, rollout.rollout_id, LLM_SPAN)
    assert "response_mask has 3 entries" in call.attributes[ERROR]


def test_a_callback_after_the_server_answered_is_refused_and_never_stored(proxied_store, fake_server):
    """A rollout server that calls the model back after it answered /rollout: the attempt has ended, so the proxy
    answers 409 naming it, and the attempt keeps exactly what it had (nothing to train on is added)."""
    store = proxied_store
    agent = _no_model_agent(fake_server, reward_fn=lambda task, msgs: 1.0)
    [(rollout, attempt)] = run(agent, store, ["late_callback"], n=1)
    assert rollout.status == "succeeded" and attempt.status == "succeeded"
    before = [s.model_dump() for s in store.query_spans(rollout.rollout_id)]
    status, body = asyncio.run_coroutine_threadsafe(_wait_late(), _server_loop()).result(timeout=120)
    assert status == 409 and body["error"]["param"] == "attempt_id", body
    assert f"attempt {attempt.attempt_id!r} of rollout {rollout.rollout_id!r} is already 'succeeded'" in (
        body["error"]["message"])
    assert [s.model_dump() for s in store.query_spans(rollout.rollout_id)] == before
    assert not spans_of(store, rollout.rollout_id, LLM_SPAN)
    assert TripletAdapter().adapt(store, [rollout.rollout_id]) == []


async def _wait_late():
    return await LATE.pop()


def _server_loop():
    return LATE[-1].get_loop()


def test_callback_carries_the_bearer_token_when_the_proxy_is_off_loopback(engine, reference_server):
    store = InMemoryStore()
    with LLMProxy(engine, store, host="0.0.0.0", api_key="s3cret") as proxy:
        store.add_resources({"main_llm": proxy.as_resource(temperature=0.0, max_tokens=4)})
        anonymous = httpx.post(f"{proxy.url}/v1/chat/completions", json={"model": proxy.served_models[0],
                                                                         "messages": [{"role": "user", "content": "hi"}]})
        assert anonymous.status_code == 401  # so the callback below got through only with the key
        agent = RemoteRolloutAgent(reference_server.url, reward_fn=lambda task, msgs: 0.5, max_turns=1)
        [(rollout, attempt)] = run(agent, store, ["Say hi."], n=1)
    assert rollout.status == "succeeded", attempt.error
    assert len(spans_of(store, rollout.rollout_id, LLM_SPAN)) == 1


def test_rollout_server_bearer_token(engine, proxied_store):
    with RolloutServer(tokenizer=engine.tokenizer, api_key="tok") as server:
        assert httpx.get(f"{server.url}/tools").status_code == 401
        with pytest.raises(RolloutServerError, match="HTTP 401") as info:
            RemoteRolloutAgent(server.url, api_key="wrong").tools()
        assert info.value.field == "api_key"
        assert len(RemoteRolloutAgent(server.url, api_key="tok").tools()) == 4
        bad = httpx.post(f"{server.url}/rollout", json={"rollout_id": "r"}, headers={"Authorization": "Bearer tok"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"


def test_preflight_warns_once_for_a_dead_rollout_server(proxied_store):
    url = _dead_url()
    agent = RemoteRolloutAgent(url, reward_fn=lambda task, msgs: 1.0)
    t0 = time.monotonic()
    with pytest.warns(RuntimeWarning) as record:
        agent.preflight()
    assert time.monotonic() - t0 < 5
    [warning] = [w for w in record if "RemoteRolloutAgent" in str(w.message)]
    assert url in str(warning.message) and "python -m lightning_nb.agents.rollout_server" in str(warning.message)
    [(rollout, attempt)] = run(agent, proxied_store, ["x"], n=1)  # and each rollout then fails saying so
    assert rollout.status == "failed" and f"GET {url}/tools failed" in attempt.error


def test_tools_are_discovered_once_per_agent_and_process(fake_server):
    import pickle
    import threading

    agent = RemoteRolloutAgent(fake_server)
    before = len(TOOLS_HITS)
    threads = [threading.Thread(target=agent.tools) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    agent.tools()
    assert len(TOOLS_HITS) - before == 1
    copy = pickle.loads(pickle.dumps(agent))  # a Ray actor's copy discovers them again, in its process
    assert len(copy.tools()) == 4 and len(TOOLS_HITS) - before == 2


def test_a_completed_answer_without_a_model_call_is_refused(store, fake_server):
    """Doc 002's COMPLETED answer from a server that never called the model back: RemoteRolloutAgent declares
    calls_model, so the attempt fails naming why instead of succeeding with a reward and 0 LLM calls."""
    store.add_resources({"main_llm": LLMResource(endpoint=IDLE_LLM, model="m")})  # never called
    agent = RemoteRolloutAgent(fake_server, reward_fn=lambda task, msgs: 1.0)
    [(rollout, attempt)] = run(agent, store, ["ok"], n=1)
    assert rollout.status == "failed" and "without calling the model" in attempt.error
    assert store.rollouts_df().set_index("rollout_id").loc[rollout.rollout_id, "llm_calls"] == 0


def test_an_answer_after_the_attempt_timed_out_is_refused_and_never_stored(store, fake_server, caplog):
    """The /rollout answer arrives (4 s) after the rollout's timeout_seconds (1 s) ended the attempt: its
    tool:rollout_server span, reward and agent span are refused on every backend, and logged."""
    store.add_resources({"main_llm": LLMResource(endpoint=IDLE_LLM, model="m")})
    agent = RemoteRolloutAgent(fake_server, reward_fn=lambda task, msgs: 1.0, timeout_s=30.0)
    rid = store.enqueue_rollout("hang", config=RolloutConfig(timeout_seconds=1.0)).rollout_id
    with caplog.at_level("WARNING", logger="lightning_nb.tracing.tracer"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with start_runners(agent, store, n=1):
            store.wait_for_rollouts([rid], timeout=30)
            deadline = time.monotonic() + 15
            while not any(SERVER_SPAN in r.getMessage() for r in caplog.records) and time.monotonic() < deadline:
                time.sleep(0.2)  # the answer comes 4 s after the request
            time.sleep(0.5)
    (attempt,) = store.query_attempts(rid)
    assert attempt.status == "timeout" and store.get_rollout_by_id(rid).status == "failed"
    assert store.query_spans(rid) == []  # no tool:rollout_server, reward or agent span on the ended attempt
    refused = [r.getMessage() for r in caplog.records if "already ended 'timeout'" in r.getMessage()]
    assert any(SERVER_SPAN in m for m in refused), refused

