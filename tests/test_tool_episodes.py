"""Multi-turn tool episodes reach the trainer as one sequence (issue 30, item 0).

A LangGraph ReAct agent with two tools answers two questions in one conversation through our
runner and the LLM proxy in front of the real SmolLM2-135M-Instruct. Every LLM call's prompt must
extend the previous call's prompt and completion token for token, so that
:func:`~lightning_nb.trainers.packing.pack_episode` packs the episode into ONE sequence (``turn_forks``
0), with the model's tokens under response mask 1 and the tool results and the user's words under 0.

Before the fix two things forked every later turn (measured at de7388f: 5 of 6 later turns at
temperature 0.7, 4 of 4 greedy): the proxy's tool hint sat in front of the first question only while it
was the last message, and a parsed tool call was re-written after the model's leftover text instead of
rendered as sampled.

Needs the ``agents`` extra (``pip install -e '.[agents]'``, part of ``dev``).
"""

from __future__ import annotations

import importlib.util
import json
from typing import Any

import pytest

from lightning_nb import InMemoryStore, LLMProxy, TripletAdapter, semconv, start_runners, tool_span
from lightning_nb.inspect.audit import token_fidelity
from lightning_nb.tasks.calc import calculator as evaluate
from lightning_nb.semconv import ERROR as LLM_ERROR
from lightning_nb.semconv import (ASSISTANT_TURNS_AS_SAMPLED, ASSISTANT_TURNS_REWRITTEN, LLM_SPAN, PROMPT_SPLICED,
                                  REQUEST_RESPONSE_MASK, RESPONSE_TOOL_CALLS)
from lightning_nb.trainers.packing import episodes_of, pack_episode
from lightning_nb.types import LLMResource

pytestmark = pytest.mark.slow

# Greedy SmolLM2-135M writes a calculator call for the first question (after repeating a line of the
# instructions: leftover text that the proxy must render back as sampled); 96 tokens leave room for both.
QUESTIONS = ("Compute 66 - 38.", "Calculate 7 * 9.")
SAMPLING = {"max_tokens": 96}


def _needs_langgraph() -> None:
    for module in ("langgraph", "langchain", "langchain_openai"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed; pip install -e '.[agents]'")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression such as 17 * 23."""
    with tool_span("calculator", {"expression": expression}):
        return evaluate(expression)


def round_number(x: float) -> str:
    """Round a number to a whole number."""
    with tool_span("round_number", {"x": x}):
        return str(round(float(x)))


def two_question_agent(task: dict[str, Any], llm: LLMResource) -> float:
    """A LangGraph ReAct agent with two tools, asked two questions in one conversation (several LLM calls)."""
    from langchain.agents import create_agent
    from langchain_openai import ChatOpenAI
    from langgraph.errors import GraphRecursionError

    model = ChatOpenAI(base_url=llm.endpoint, api_key=llm.api_key, model=llm.model, max_retries=0)
    agent = create_agent(model, [calculator, round_number])
    messages: list[Any] = []
    for question in task["questions"]:
        messages.append({"role": "user", "content": question})
        try:
            messages = agent.invoke({"messages": messages}, {"recursion_limit": 6})["messages"]
        except GraphRecursionError:
            break
    last = messages[-1] if messages else None  # the user's dict when the first question hit the recursion limit
    text = last.get("content") if isinstance(last, dict) else getattr(last, "content", "")
    return 1.0 if "63" in str(text) else 0.0


def test_a_langgraph_tool_episode_packs_into_one_sequence(engine):
    """Two greedy episodes and two at temperature 0.7, run at once (the engine batches the two temperatures
    together). They were two tests of four episodes each: the four greedy ones were the same episode four times,
    and every assertion holds per episode."""
    check_tool_episodes(engine, {0.0: 2, 0.7: 2})


def check_tool_episodes(engine: Any, temperature: float | dict[float, int]) -> None:
    """Two-question LangGraph episodes on ``engine``, all at once: four at ``temperature``, or ``{temperature:
    episodes}``. Each packs into one sequence, with no fork (tests/test_vllm_engine.py runs it on the vLLM server
    too)."""
    _needs_langgraph()
    per_temperature = temperature if isinstance(temperature, dict) else {temperature: 4}
    store = InMemoryStore()
    with LLMProxy(engine, store) as proxy:
        store.add_resources({"main_llm": proxy.as_resource()})
        group = start_runners(two_question_agent, store, n=sum(per_temperature.values()), default_timeout_s=240)
        try:
            at = {store.enqueue_rollout({"questions": list(QUESTIONS)}, metadata={
                "sampling_parameters": {**SAMPLING, "temperature": t}}).rollout_id: t
                for t, n in per_temperature.items() for _ in range(n)}
            ids = list(at)
            done = store.wait_for_rollouts(ids, timeout=300)
        finally:
            group.stop()
    assert len(done) == len(ids) and all(r.status == "succeeded" for r in done), [
        a.error for rid in ids for a in store.query_attempts(rid)]

    triplets = TripletAdapter().adapt(store, ids)
    episodes = episodes_of(triplets)
    later_turns = sum(len(ts) - 1 for ts in episodes.values())
    tool_turns = {rid: 0 for rid in ids}
    for rid, ts in episodes.items():
        calls = [s for s in store.query_spans(rid, "latest") if s.name == LLM_SPAN]
        tool_turns[rid] = sum(1 for s in calls if s.attributes.get(RESPONSE_TOOL_CALLS))
        # every echoed tool-calling turn was rendered as sampled, none re-written
        assert sum(s.attributes.get(ASSISTANT_TURNS_REWRITTEN, 0) for s in calls) == 0
        seqs = pack_episode(ts, advantage=1.0)
        assert len(seqs) == 1, f"{rid}: {len(ts)} turns packed into {len(seqs)} sequences, forks at " \
                               f"{[s.fork_at for s in seqs[1:]]}"
        (seq,) = seqs
        # the model's tokens are trained (mask 1), everything between them is not (mask 0)
        trained = sum(seq.mask)
        assert trained == sum(len(t.response_ids) for t in ts)
        assert seq.input_ids[: len(ts[0].prompt_ids)] == ts[0].prompt_ids
        for t in ts[1:]:
            extra = len(t.prompt_ids) - len(seq.input_ids[: len(t.prompt_ids)])
            assert extra == 0  # each prompt is a prefix of the packed sequence
        tool_results = [i for i, tok in enumerate(seq.input_ids) if seq.mask[i] == 0 and i >= len(ts[0].prompt_ids)]
        assert len(tool_results) == len(seq.input_ids) - len(ts[0].prompt_ids) - trained
    spliced = sum(1 for rid in ids for s in store.query_spans(rid, "latest") if s.attributes.get(PROMPT_SPLICED))
    print(f"\n{type(engine).__name__}, episodes per temperature {per_temperature}: {len(triplets)} LLM calls, "
          f"{later_turns} later turns, {sum(tool_turns.values())} tool-calling replies, {spliced} prompts spliced, "
          "0 forks")
    assert later_turns >= len(ids), "the episodes were not multi-turn"
    greedy = [rid for rid, t in at.items() if t == 0.0]  # sampled at 0.7, the 135M model rarely calls a tool
    assert all(tool_turns[rid] for rid in greedy), \
        "greedy, the first question's reply calls the calculator in every episode"  # (bench/tool_call_rate.py)
    # the audit agrees: every served prompt re-renders, and no turn forks
    df = token_fidelity(store, ids, engine.tokenizer)
    assert df.empty, df.to_dict("records")
    assert df.attrs["calls_checked"] == len(triplets)
    if any(tool_turns.values()):
        assert sum(s.attributes.get(ASSISTANT_TURNS_AS_SAMPLED, 0) for rid in ids
                   for s in store.query_spans(rid, "latest") if s.name == LLM_SPAN) >= 1


# ----- the proxy's rules, one by one ------------------------------------------------------------------------
CALC = {"type": "function", "function": {"name": "calculator", "description": "Evaluate an arithmetic expression",
                                         "parameters": {"type": "object", "properties": {
                                             "expression": {"type": "string"}}, "required": ["expression"]}}}
UNITS = {"type": "function", "function": {"name": "convert", "description": "Convert a length", "parameters": {
    "type": "object", "properties": {"unit": {"type": "string", "enum": ["cm", "inch"]}, "value": {"type": "number"}},
    "required": ["unit", "value"]}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "2+2"}'}}


def test_a_user_message_renders_the_same_whether_or_not_it_is_the_last_one():
    from lightning_nb.engines.chat_format import render_tools

    question = {"role": "user", "content": "What is 2+2?"}
    first = render_tools([question], [CALC])
    later = render_tools([question, {"role": "assistant", "content": None, "tool_calls": [CALL]},
                          {"role": "tool", "tool_call_id": "call_1", "content": "4"},
                          {"role": "user", "content": "And 3+3?"}], [CALC])
    assert later[: len(first)] == first  # the system turn and the hinted question, unchanged
    assert later[-1]["content"].startswith("Reply with a <tool_call> block")  # every question gets the hint
    assert "<tool_response>\n4\n</tool_response>" == later[3]["content"]  # a tool result never does


def test_an_echoed_tool_call_is_rendered_as_sampled_unless_the_client_changed_it():
    from lightning_nb.engines.chat_format import count_sampled_turns, render_tools, sampled_turn_key

    sampled_text = 'Let me see.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}}}\n</tool_call>'
    sampled = {sampled_turn_key([CALL]): sampled_text}
    echoed = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "Let me see.", "tool_calls": [CALL]},
              {"role": "tool", "tool_call_id": "call_1", "content": "4"}]
    assert render_tools(echoed, [CALC], sampled=sampled)[2]["content"] == sampled_text
    assert count_sampled_turns(echoed, sampled) == (1, 0)
    edited = dict(CALL, function={"name": "calculator", "arguments": '{"expression": "3+3"}'})
    echoed[1] = {**echoed[1], "tool_calls": [edited]}
    rewritten = render_tools(echoed, [CALC], sampled=sampled)[2]["content"]
    assert rewritten == 'Let me see.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "3+3"}}\n</tool_call>'
    assert count_sampled_turns(echoed, sampled) == (0, 1)


def test_the_example_call_fills_an_enum_argument_with_one_of_its_values():
    from lightning_nb.engines.chat_format import render_tools

    system = render_tools([{"role": "user", "content": "10 cm in inches?"}], [UNITS])[0]["content"]
    assert '{"name": "convert", "arguments": {"unit": "cm", "value": 1}}' in system and '"..."' not in system


@pytest.mark.parametrize("kind", ["image_url", "input_audio"])
def test_a_content_part_the_model_cannot_read_is_a_400_naming_it(proxied, kind):
    import httpx

    store, proxy = proxied
    rid = store.enqueue_rollout("t").rollout_id
    aid = store.dequeue_rollout().attempt.attempt_id
    part = {"type": kind, kind: {"url": "data:image/png;base64,AAAA"} if kind == "image_url" else
            {"data": "AAAA", "format": "wav"}}
    body = {"model": proxy.engine.model_name, "max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "What is this?"}, part]}]}
    reply = httpx.post(f"{proxy.endpoint(rid, aid)}/chat/completions", json=body, timeout=60)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "messages.0.content.1" and kind in error["message"]
    assert store.query_spans(rid) == []  # refused before the engine: nothing recorded, nothing lost


def test_tool_choice_required_is_enforced_or_refused_naming_it(proxied):
    import httpx

    store, proxy = proxied
    rid = store.enqueue_rollout("t").rollout_id
    aid = store.dequeue_rollout().attempt.attempt_id
    url = f"{proxy.endpoint(rid, aid)}/chat/completions"
    base = {"model": proxy.engine.model_name, "tools": [CALC], "max_tokens": 24,
            "messages": [{"role": "user", "content": "Tell me a joke."}]}
    # greedy, the model answers the joke without a call: nothing to resample, so a 400 naming tool_choice
    for choice in ("required", {"type": "function", "function": {"name": "calculator"}}):
        reply = httpx.post(url, json={**base, "tool_choice": choice, "temperature": 0.0}, timeout=120)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "tool_choice", reply.text
        assert "temperature > 0" in reply.json()["error"]["message"]
    errors = [s for s in store.query_spans(rid) if s.attributes.get(LLM_ERROR)]
    assert len(errors) == 2 and all("tool_choice" in s.attributes[LLM_ERROR] for s in errors)
    # sampled: every returned choice calls the tool (resampled up to 4 times), or the 400 says it never did
    reply = httpx.post(url, json={**base, "messages": [{"role": "user", "content": "Compute 66 - 38."}],
                                  "tool_choice": "required", "temperature": 1.0, "n": 2, "max_tokens": 96},
                       timeout=300)
    resampled = [s.attributes.get(semconv.TOOL_CHOICE_RESAMPLED) for s in store.query_spans(rid)
                 if s.attributes.get(semconv.CHOICES) == 2]
    print(f"\ntool_choice='required' at temperature 1: {reply.status_code}, resampled {resampled}")
    if reply.status_code == 200:
        assert all(c["message"]["tool_calls"] for c in reply.json()["choices"])
        spans = [s for s in store.query_spans(rid) if s.attributes.get(semconv.CHOICES) == 2]
        assert len(spans) == 2 and all(s.attributes.get(RESPONSE_TOOL_CALLS) for s in spans)
    else:
        assert reply.status_code == 400 and "in 4 samples" in reply.json()["error"]["message"]


def test_a_response_mask_is_checked_against_the_tokens_served(proxied):
    import httpx

    store, proxy = proxied
    rid = store.enqueue_rollout("t").rollout_id
    aid = store.dequeue_rollout().attempt.attempt_id
    url = f"{proxy.endpoint(rid, aid)}/chat/completions"
    body = {"model": proxy.engine.model_name, "max_tokens": 8, "temperature": 0.0,
            "messages": [{"role": "user", "content": "Hi"}]}
    first = httpx.post(url, json=body, timeout=60).json()
    history = body["messages"] + [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                                  {"role": "user", "content": "Again"}]
    added = (len(proxy.engine.apply_chat_template(history)) - len(first["prompt_token_ids"])
             - len(first["choices"][0]["token_ids"]))
    wrong = httpx.post(url, json={**body, "messages": history, "response_mask": [0] * (added + 2)}, timeout=60)
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "response_mask"
    assert f"this prompt adds {added} tokens" in wrong.json()["error"]["message"]
    right = httpx.post(url, json={**body, "messages": history, "response_mask": [0] * added}, timeout=60)
    assert right.status_code == 200, right.text
    spans = store.query_spans(rid)
    assert [s.attributes.get(REQUEST_RESPONSE_MASK) for s in spans if not s.attributes.get(LLM_ERROR)] == \
        [None, [0] * added]
    assert sum(1 for s in spans if "response_mask" in str(s.attributes.get(LLM_ERROR))) == 1
    off_attempt = httpx.post(f"{proxy.endpoint()}/chat/completions", json={**body, "response_mask": []}, timeout=60)
    assert off_attempt.status_code == 400 and off_attempt.json()["error"]["param"] == "response_mask"


def test_a_reply_that_re_tokenizes_differently_is_spliced_back_as_sampled(engine):
    """Greedy SmolLM2 wrote '"}' '}}' where its tokenizer writes '"}}' '}'; a reply cut at max_tokens has no stop
    token. Either way the next prompt is the previous prompt and completion as served, then the new turns."""
    from lightning_nb.proxy.splice import ServedCall, splice_previous_reply

    tok = engine.tokenizer
    first = [{"role": "user", "content": "Say it."}]
    prompt = engine.apply_chat_template(first)
    text = '{"a": {"b": 1}}}'
    canonical = tok.encode(text, add_special_tokens=False)
    pieces = [tok.encode(p, add_special_tokens=False) for p in ('{"a": {"b": 1', '}', '}}')]
    sampled = [t for p in pieces for t in p]
    assert sampled != canonical and tok.decode(sampled) == text  # a split the tokenizer would not write
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    later = engine.apply_chat_template(first + [{"role": "assistant", "content": text},
                                                {"role": "user", "content": "Again."}])
    for cut in (False, True):
        completion = tuple(sampled if cut else sampled + [im_end])
        prev = ServedCall(tuple(prompt), completion, text, tuple(prompt), cut=cut)
        spliced = splice_previous_reply(later, prev, tok, engine.stop_token_ids)
        assert spliced[: len(prompt) + len(completion)] == list(prompt) + list(completion)
        assert tok.decode(spliced) == tok.decode(later)  # the same text, the sampled tokens
        assert splice_previous_reply(spliced, prev, tok, engine.stop_token_ids) is None  # already extends
    # an edited history is not spliced: it forks, and turn_forks counts it
    edited = engine.apply_chat_template([{"role": "user", "content": "Say that."}, {"role": "assistant", "content": text}])
    assert splice_previous_reply(edited, prev, tok, engine.stop_token_ids) is None


@pytest.mark.parametrize("cut", [False, True])
def test_token_fidelity_re_derives_a_spliced_prompt(engine, cut):
    """token_fidelity re-renders a spliced call the way the proxy served it: no 'render' row, no fork. A reply cut
    at max_tokens ends with an ordinary token, which must not be taken for its stop token."""
    import time

    from lightning_nb import semconv
    from lightning_nb.proxy.splice import ServedCall, splice_previous_reply
    from lightning_nb.types import Span

    tok = engine.tokenizer
    first = [{"role": "user", "content": "List the steps."}]
    prompt = engine.apply_chat_template(first)
    text = '{"a": {"b": 1}}}'
    sampled = [t for piece in ('{"a": {"b": 1', '}', '}}') for t in tok.encode(piece, add_special_tokens=False)]
    assert tok.decode(sampled) == text and sampled != tok.encode(text, add_special_tokens=False)
    completion = sampled if cut else sampled + [tok.convert_tokens_to_ids("<|im_end|>")]
    second = first + [{"role": "assistant", "content": text}, {"role": "user", "content": "Go on."}]
    served = splice_previous_reply(engine.apply_chat_template(second), ServedCall(
        tuple(prompt), tuple(completion), text, tuple(prompt), cut=cut), tok, engine.stop_token_ids)
    store = InMemoryStore()
    run = store.start_rollout({"q": 1})
    rid, aid = run.rollout.rollout_id, run.attempt.attempt_id
    now = time.time()
    for i, (messages, ids, extra) in enumerate([(first, prompt, {}), (second, served, {semconv.PROMPT_SPLICED: True})]):
        store.add_span(Span(rollout_id=rid, attempt_id=aid, trace_id="t", span_id=f"c{i}", name=semconv.LLM_SPAN,
                            start_time=now + i, end_time=now + i, attributes={
                                semconv.PROMPT: json.dumps(messages), semconv.PROMPT_TOKEN_IDS: list(ids),
                                semconv.COMPLETION_TOKEN_IDS: list(completion), semconv.COMPLETION: text,
                                semconv.RESPONSE_FINISH_REASONS: ["length" if cut else "stop"], **extra}))
    df = token_fidelity(store, [rid], tok)
    assert df.empty and df.attrs["calls_checked"] == 2, df.to_dict("records")
