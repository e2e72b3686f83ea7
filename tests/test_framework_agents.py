"""Agents written with LangGraph, the OpenAI Agents SDK and AutoGen, run by our runners through the LLM proxy.

Each agent is written the way that framework's users write it (a calculator tool, the framework's
own OpenAI client pointed at ``llm.endpoint``), receives the ``main_llm`` resource from our runner,
and talks to the real SmolLM2-135M-Instruct behind :class:`~lightning_nb.LLMProxy`. The proxy shows
the tools to the model as Hermes text (:mod:`lightning_nb.engines.chat_format`) and parses its
``<tool_call>`` blocks back into OpenAI ``tool_calls``; the tools record themselves with
:func:`lightning_nb.tool_span`.

A 135M model calls tools unreliably, so each framework runs two rollouts (greedy, different
questions; a third answers from a cache without the LLM) and the tests require at least one of them
to have made a tool call that went the whole way (parsed, run, its result in the next prompt,
multi-turn triplets); the rate seen is printed (``pytest -s``) and ``bench/tool_call_rate.py``
measures the model's rate alone.

Needs the ``agents`` extra: ``pip install -e '.[agents]'`` (part of ``dev``); a test whose
framework is missing is skipped with that instruction.
"""

from __future__ import annotations

import importlib.util
import json
import warnings
from typing import Any, Callable

import pytest

from lightning_nb import InMemoryStore, LLMProxy, TripletAdapter, semconv, start_runners, tool_span
from lightning_nb.engines.chat_format import parse_tool_calls
from lightning_nb.semconv import LLM_SPAN as LLM_SPAN_NAME
from lightning_nb.tasks.calc import calc_reward
from lightning_nb.tasks.calc import calculator as evaluate
from lightning_nb.types import LLMResource
from conftest import IDLE_LLM

pytestmark = pytest.mark.slow

EXTRA = "pip install -e '.[agents]'"
# Greedy, so a rollout's outcome does not hang on a lucky sample; the cap keeps the module short on 2 cores.
# 64 tokens: the model often repeats a line of the instructions before its <tool_call> block.
SAMPLING = {"temperature": 0.0, "max_tokens": 64}
# Questions on which greedy SmolLM2 wrote a calculator call as the first reply in all three frameworks'
# request layouts (measured with the shipped prompt: 9/20, 10/20 and 4/20 of bench/tool_call_rate.py's
# questions plus four others for LangGraph, the Agents SDK and AutoGen, whose default system message lowers it).
QUESTIONS = {"Compute 66 - 38.": "66 - 38", "Compute 98 + 81.": "98 + 81", "Calculate 58 * 9.": "58 * 9",
             "Calculate 92 + 80.": "92 + 80"}
CACHED = {"question": "What is 2 + 2?", "answer": 4, "cached": True}  # the agent answers it without the LLM


def _needs(*modules: str) -> None:
    for module in modules:
        if importlib.util.find_spec(module.split(".")[0]) is None:
            pytest.skip(f"{module} is not installed; {EXTRA}")


def _tasks() -> list[dict[str, Any]]:
    return [{"question": q, "answer": float(evaluate(expr))} for q, expr in QUESTIONS.items()]


# ----- the tool, as a user writes it (recorded with our tool_span) ---------------------------------------
def traced_calculator(expression: str) -> str:
    with tool_span("calculator", {"expression": expression}) as span:
        result = evaluate(expression)
        span.set_attribute(semconv.TOOL_OUTPUT, result)
    return result


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression such as 17 * 23."""
    return traced_calculator(expression)


# ----- the agents -----------------------------------------------------------------------------------------
def langgraph_agent(task: dict[str, Any], llm: LLMResource) -> float:
    from langchain.agents import create_agent  # LangGraph 1.0 moved create_react_agent here
    from langchain_openai import ChatOpenAI
    from langgraph.errors import GraphRecursionError

    if task.get("cached"):
        return calc_reward(str(task["answer"]), task)
    model = ChatOpenAI(base_url=llm.endpoint, api_key=llm.api_key, model=llm.model, max_retries=0)
    agent = create_agent(model, [calculator])
    try:
        state = agent.invoke({"messages": [{"role": "user", "content": task["question"]}]}, {"recursion_limit": 6})
    except GraphRecursionError:  # kept calling tools: no answer
        return 0.0
    return calc_reward(str(state["messages"][-1].content), task)


def openai_agents_agent(task: dict[str, Any], llm: LLMResource) -> float:
    from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool,
                        set_tracing_disabled)
    from agents.exceptions import MaxTurnsExceeded
    from openai import AsyncOpenAI

    if task.get("cached"):
        return calc_reward(str(task["answer"]), task)
    set_tracing_disabled(True)  # the SDK would export its own traces to OpenAI
    client = AsyncOpenAI(base_url=llm.endpoint, api_key=llm.api_key, max_retries=0)
    agent = Agent(
        name="calculator_agent", instructions="Answer the arithmetic question.",
        model=OpenAIChatCompletionsModel(model=llm.model, openai_client=client),
        tools=[function_tool(calculator)],
        model_settings=ModelSettings(tool_choice="required"),  # the SDK resets it to auto after a tool call
    )
    try:
        result = Runner.run_sync(agent, task["question"], max_turns=3)  # a runner thread: no event loop here
    except MaxTurnsExceeded:
        return 0.0
    return calc_reward(str(result.final_output), task)


async def autogen_agent(task: dict[str, Any], llm: LLMResource) -> float:
    from autogen_agentchat.agents import AssistantAgent
    from autogen_ext.models.openai import OpenAIChatCompletionClient

    # AutoGen runs a sync tool with loop.run_in_executor, which does not carry contextvars into the
    # worker thread, so tool_span there would be outside the rollout: AutoGen tools are async.
    async def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression such as 17 * 23."""
        return traced_calculator(expression)

    if task.get("cached"):
        return calc_reward(str(task["answer"]), task)
    client = OpenAIChatCompletionClient(
        model=llm.model, base_url=llm.endpoint, api_key=llm.api_key,
        model_info={"vision": False, "function_calling": True, "json_output": False, "family": "unknown",
                    "structured_output": False},
    )
    # AssistantAgent always asks with tool_choice="auto"; reflect_on_tool_use: a second call reads the result.
    agent = AssistantAgent("calculator_agent", model_client=client, tools=[calculator], reflect_on_tool_use=True)
    try:
        result = await agent.run(task=task["question"])
    finally:
        await client.close()
    return calc_reward(str(result.messages[-1].content), task)


FRAMEWORKS: dict[str, tuple[Callable[..., Any], tuple[str, ...]]] = {
    "langgraph": (langgraph_agent, ("langchain.agents", "langgraph", "langchain_openai")),
    "openai-agents": (openai_agents_agent, ("agents", "openai")),
    "autogen": (autogen_agent, ("autogen_agentchat", "autogen_ext")),
}


# ----- fixtures and helpers -------------------------------------------------------------------------------
@pytest.fixture
def stack(engine):
    """A fresh store with the proxy in front of the session's SmolLM2 engine as its ``main_llm``."""
    store = InMemoryStore()
    with LLMProxy(engine, store) as proxy:
        store.add_resources({"main_llm": proxy.as_resource()})
        yield store


def _run(store: InMemoryStore, agent: Callable[..., Any], tasks: list[Any], timeout: float = 150) -> list[str]:
    group = start_runners(agent, store, n=len(tasks), default_timeout_s=timeout)
    try:
        ids = [store.enqueue_rollout(t, metadata={"sampling_parameters": SAMPLING}).rollout_id for t in tasks]
        done = store.wait_for_rollouts(ids, timeout=timeout + 30)
    finally:
        group.stop()
    assert len(done) == len(ids), "rollouts still running"
    return ids


def _failures(store: InMemoryStore, ids: list[str]) -> list[str]:
    out = []
    for rid in ids:
        rollout = store.get_rollout_by_id(rid)
        if rollout.status != "succeeded":
            errors = [a.error for a in store.query_attempts(rid)]
            out.append(f"{rid} {rollout.status}: {errors[-1] if errors else ''}")
    return out


def _tool_call_rollout(store: InMemoryStore, rid: str) -> dict[str, Any] | None:
    """For a rollout whose model called the calculator and whose tool ran: the spans that show it."""
    spans = store.query_spans(rid, "latest")
    llm = [s for s in spans if s.name == LLM_SPAN_NAME]
    for i, span in enumerate(llm):
        calls = json.loads(span.attributes.get(semconv.RESPONSE_TOOL_CALLS) or "[]")
        for call in calls:
            if call["function"]["name"] != "calculator":
                continue
            args = json.loads(call["function"]["arguments"])
            tool = next((s for s in spans if s.name == "tool:calculator"
                         and json.loads(s.attributes[semconv.TOOL_INPUT]) == args), None)
            if tool is not None:
                return {"spans": spans, "llm": llm, "turn": i, "call": call, "tool": tool}
    return None


def _check_framework(store: InMemoryStore, name: str) -> None:
    agent, _modules = FRAMEWORKS[name]
    # two questions: each rollout goes through every check below, and greedy, more rollouts add time, not coverage.
    # These two made a call in all three frameworks (LangGraph wrote none for "Compute 66 - 38." on 2026-11-29)
    ids = _run(store, agent, [*_tasks()[1:3], CACHED])
    *asked, cached = ids
    assert not _failures(store, ids), _failures(store, ids)

    # every LLM call is a span with the token IDs the model saw and sampled
    for rid in asked:
        llm = [s for s in store.query_spans(rid, "latest") if s.name == LLM_SPAN_NAME]
        assert llm, f"{name}: rollout {rid} made no LLM call through the proxy"
        for span in llm:
            assert span.attributes.get(semconv.PROMPT_TOKEN_IDS), span
            assert span.attributes.get(semconv.COMPLETION_TOKEN_IDS), span
        assert "calculator" in llm[0].attributes[semconv.REQUEST_TOOLS]  # the framework sent the tool

    found = {rid: _tool_call_rollout(store, rid) for rid in asked}
    called = [rid for rid, f in found.items() if f is not None]
    rate = f"{len(called)}/{len(asked)} rollouts made a calculator call that ran"
    print(f"\n{name}: {rate} ({[store.get_rollout_by_id(rid).input['question'] for rid in called]})")
    # greedy, so deterministic: on 2026-11-23 LangGraph 3/4, Agents SDK 4/4, AutoGen 4/4 of QUESTIONS made a call
    assert called, f"{name}: no rollout made a tool call ({rate})"
    # every call the model writes to a tools-bearing request is parsed into tool_calls
    for rid in asked:
        for span in store.query_spans(rid, "latest"):
            a = span.attributes
            shown = a.get(semconv.REQUEST_TOOLS) and a.get(semconv.REQUEST_TOOL_CHOICE) != '"none"'
            if span.name == LLM_SPAN_NAME and shown and "<tool_call>" in str(a.get("gen_ai.completion")):
                _, parsed = parse_tool_calls(span.attributes["gen_ai.completion"], ["calculator"])
                assert not parsed or semconv.RESPONSE_TOOL_CALLS in span.attributes, span.attributes

    for rid in called:
        f = found[rid]
        tool, spans = f["tool"], f["spans"]
        # the tool span hangs under the rollout's agent span, with the result the tool returned
        root = next(s for s in spans if s.name == "agent")
        assert tool.parent_id == root.span_id and tool.attributes[semconv.TOOL_OUTPUT]
        # the result went back to the model: the next LLM call's prompt holds it as a tool message
        assert len(f["llm"]) > f["turn"] + 1, f"{name}: no LLM call after the tool ran"
        prompt = json.loads(f["llm"][f["turn"] + 1].attributes["gen_ai.prompt"])
        results = [m for m in prompt if m["role"] == "tool"]
        assert any(tool.attributes[semconv.TOOL_OUTPUT] in json.dumps(m.get("content")) for m in results), prompt
        assert any(c["function"]["name"] == "calculator" for m in prompt for c in m.get("tool_calls") or [])

    # store.episode (issue 50): the same calls with their token IDs, the traced tool with its result, the reward
    first = called[0]
    ep = store.episode(first)
    assert [c.completion_ids for c in ep.calls] == [s.attributes[semconv.COMPLETION_TOKEN_IDS] for s in found[first]["llm"]]
    assert ep.calls[found[first]["turn"]].tool_calls and ep.final_reply == ep.calls[-1].reply
    assert any(t.name == "calculator" and t.output == found[first]["tool"].attributes[semconv.TOOL_OUTPUT]
               for t in ep.tools)
    assert ep.reward == store.final_reward(first) and ep.status == "succeeded"

    # the adapter: triplets with the spans' token IDs (multi-turn when a tool ran); the cached rollout, which made
    # no LLM call, is counted as skipped, not dropped
    adapter = TripletAdapter()
    triplets = adapter.adapt(store, [first, cached])
    turns = [t for t in triplets if t.rollout_id == first]
    assert turns and [t.turn for t in turns] == list(range(len(turns)))
    assert all(t.prompt_ids and t.response_ids for t in turns)
    assert len(turns) >= 2 and turns[1].prompt_ids != turns[0].prompt_ids
    assert adapter.last_skipped["no_llm_calls"] == 1 and not any(t.rollout_id == cached for t in triplets)


# ----- tests ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(FRAMEWORKS))
def test_framework_agent_runs_through_runner_and_proxy(stack, name):
    _needs(*FRAMEWORKS[name][1])
    _check_framework(stack, name)


def test_the_langgraph_agent_runs_without_a_deprecation_warning(stack):
    """LangGraph 1.0 deprecated ``langgraph.prebuilt.create_react_agent`` (LangGraphDeprecatedSinceV10, one warning
    per agent built: notebook 05 printed 18 of them, issue 43); the agent is built with LangChain's
    ``create_agent``, the constructor that replaced it, so a rollout through the runner and proxy warns nothing."""
    _needs(*FRAMEWORKS["langgraph"][1])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # every warning, from the runner threads too, however often it was seen
        ids = _run(stack, langgraph_agent, _tasks()[:1])
    assert not _failures(stack, ids), _failures(stack, ids)
    deprecations = [f"{w.category.__name__}: {w.message}" for w in caught if issubclass(w.category, DeprecationWarning)]
    assert not deprecations, deprecations


def test_a_rollout_without_llm_calls_is_skipped_as_no_llm_calls_not_dropped():
    store = InMemoryStore()
    store.add_resources({"main_llm": LLMResource(endpoint=IDLE_LLM, model="m")})
    (rid,) = _run(store, lambda task, llm: 1.0, ["no model needed"], timeout=30)
    assert store.get_rollout_by_id(rid).status == "succeeded"
    assert [s.attributes[semconv.REWARD] for s in store.query_spans(rid) if s.name == "reward"] == [1.0]
    adapter = TripletAdapter()
    assert adapter.adapt(store, [rid]) == []
    assert adapter.last_skipped["no_llm_calls"] == 1 and adapter.skipped["no_llm_calls"] == 1


def test_the_langgraph_agent_replays_to_the_same_calls_tokens_and_reward(stack):
    """Issue 50: ``replay`` re-runs the LangGraph agent with every call answered from the record; LangGraph echoes the
    recorded tool calls (their ids too) and the tool is deterministic, so every request equals the recorded one."""
    from lightning_nb.replay import replay

    _needs(*FRAMEWORKS["langgraph"][1])
    store = stack
    with start_runners(langgraph_agent, store, n=1, default_timeout_s=150):
        task = _tasks()[0]
        rid = store.enqueue_rollout(task, metadata={"sampling_parameters": SAMPLING}).rollout_id
        assert store.wait_for_rollouts([rid], timeout=180)
        assert not _failures(store, [rid]), _failures(store, [rid])
        ep = replay(rid, store=store)
    orig = store.episode(rid)
    assert ep.divergence is None and ep.status == "succeeded", (ep.divergence, ep.error)
    assert all(c.replayed for c in ep.calls) and len(ep.calls) == len(orig.calls) >= 1
    assert [c.completion_ids for c in ep.calls] == [c.completion_ids for c in orig.calls]
    assert [c.messages for c in ep.calls] == [c.messages for c in orig.calls]
    assert ep.reward == orig.reward and [t.output for t in ep.tools] == [t.output for t in orig.tools]
