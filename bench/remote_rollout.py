"""Per-rollout cost of the remote rollout shape (reference doc 002) over a plain function agent, side by side.

Run from the repo root with the project's venv::

    .venv/bin/python bench/remote_rollout.py            # 6 rollouts per shape, max_tokens 40, greedy
    .venv/bin/python bench/remote_rollout.py -n 12 --max-tokens 64

Both shapes run the same calculator episode on the real SmolLM2-135M (``TransformersEngine``) behind the
LLM proxy, with doc 002's four tools (``add``, ``subtract``, ``multiply``, ``divide``), greedy, up to 3 LLM
calls, on the same questions:

* **plain**: a function agent, ``agent(task, llm)``, that loops with the OpenAI SDK against ``llm.endpoint``
  and runs the tools in-process (what a user writes);
* **remote**: ``RemoteRolloutAgent`` POSTing ``/rollout`` to the reference ``RolloutServer`` on 127.0.0.1,
  which runs the same loop and calls the proxy back with ``response_mask`` (one tokenization of each prompt
  to size it).

Each shape has its own store, proxy (same engine) and one runner thread; rollouts alternate between the
shapes (which one goes first alternates too), one at a time, so load on the machine hits both alike. Per
rollout it measures the agent call (ms, wall), the time inside the proxy's LLM calls (the LLM spans'
durations), the rest (the shape's own cost: HTTP hops, tool runs, tokenization, JSON), and the proxy hops
(LLM callbacks; the remote shape adds its ``POST /rollout``, and one ``GET /tools`` per agent). It checks
that both shapes sampled the same completion token IDs, so the workload is the same, and prints medians and
the ratios remote / plain.

Measured here (2 cores shared with other jobs, load average 3-8, so the LLM time swings by seconds between
identical completions; the shape's own cost is the number to read), three runs of the defaults, medians:
remote / plain 1.032x, 1.243x, 1.066x per rollout; the shape's own cost (outside the LLM calls) 48.6 vs 44.1 ms,
70.0 vs 36.9 ms, 33.7 vs 30.9 ms (+4.5, +33.1, +2.8 ms); 1.83 LLM calls per rollout, proxy hops 2.83 vs 1.83;
identical completions in 6/6 pairs each time.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import threading
import time
from typing import Any

from lightning_nb import InMemoryStore, LLMProxy, semconv, start_runners
from lightning_nb.agents.remote import RemoteRolloutAgent, final_text
from lightning_nb.agents.rollout_server import CALCULATOR_TOOLS, RolloutServer, run_tool
from lightning_nb.engines.transformers import TransformersEngine
from lightning_nb.semconv import LLM_SPAN
from lightning_nb.types import LLMResource

QUESTIONS = ["Add 5 and 3.", "Add 12 and 30.", "Multiply 6 and 7.", "Subtract 9 from 20.", "Divide 84 by 4.",
             "Add 7 and 8."]


def reward(final_messages: list[dict[str, Any]], task: str) -> float:
    """1.0 when the last reply holds a tool result given earlier in the episode (the same rule for both shapes)."""
    results = [m["content"] for m in final_messages if m.get("role") == "tool"]
    return 1.0 if results and results[-1] in final_text(final_messages) else 0.0


def plain_agent(task: str, llm: LLMResource, max_turns: int = 3) -> float:
    """The calculator episode as a plain function agent: the OpenAI SDK in a loop, the tools in-process."""
    from openai import OpenAI

    client = OpenAI(base_url=llm.endpoint, api_key=llm.api_key, max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": task}]
    for _ in range(max_turns):
        reply = client.chat.completions.create(model=llm.model, messages=messages, tools=CALCULATOR_TOOLS,
                                               **llm.sampling_parameters)
        msg = reply.choices[0].message
        calls = [{"id": c.id, "type": "function", "function": {"name": c.function.name,
                                                               "arguments": c.function.arguments}}
                 for c in msg.tool_calls or []]
        messages.append({"role": "assistant", "content": msg.content, **({"tool_calls": calls} if calls else {})})
        if not calls:
            break
        for c in calls:
            result = asyncio.run(run_tool(c["function"]["name"], c["function"]["arguments"]))
            messages.append({"role": "tool", "tool_call_id": c["id"], "content": result})
    return reward(messages, task)


class Timed:
    """Wraps an agent and records each call's wall time (ms) by rollout id (read from the attributed endpoint)."""

    def __init__(self, agent: Any) -> None:
        self.agent, self.ms, self.lock = agent, {}, threading.Lock()

    def __call__(self, task: Any, llm: LLMResource) -> Any:
        t0 = time.perf_counter()
        try:
            return self.agent(task, llm)
        finally:
            rid = llm.endpoint.split("/rollout/")[1].split("/")[0]
            with self.lock:
                self.ms[rid] = (time.perf_counter() - t0) * 1e3


def one(store: InMemoryStore, timed: Timed, task: str) -> dict[str, Any]:
    rid = store.enqueue_rollout(task).rollout_id
    [rollout] = store.wait_for_rollouts([rid], timeout=900)
    assert rollout.status == "succeeded", store.query_attempts(rid)[-1].error
    calls = [s for s in store.query_spans(rid, "latest") if s.name == LLM_SPAN]
    llm_ms = sum((s.end_time - s.start_time) * 1e3 for s in calls)
    return {"ms": timed.ms[rid], "llm_ms": llm_ms, "calls": len(calls),
            "tokens": [tuple(s.attributes[semconv.COMPLETION_TOKEN_IDS]) for s in calls]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", "--rollouts", type=int, default=6, help="rollouts per shape")
    parser.add_argument("--max-tokens", type=int, default=40)
    args = parser.parse_args(argv)
    sampling = {"temperature": 0.0, "max_tokens": args.max_tokens}
    engine = TransformersEngine.from_default(max_batch_size=8)
    stores = {"plain": InMemoryStore(), "remote": InMemoryStore()}
    rows: dict[str, list[dict[str, Any]]] = {"plain": [], "remote": []}
    with LLMProxy(engine, stores["plain"]) as p1, LLMProxy(engine, stores["remote"]) as p2, \
            RolloutServer(tokenizer=engine.tokenizer) as server:
        stores["plain"].add_resources({"main_llm": p1.as_resource(**sampling)})
        stores["remote"].add_resources({"main_llm": p2.as_resource(**sampling)})
        remote = RemoteRolloutAgent(server.url, reward_fn=lambda task, msgs: reward(msgs, task), max_turns=3)
        remote.preflight()  # the one GET /tools, outside the timed rollouts
        timed = {"plain": Timed(plain_agent), "remote": Timed(remote)}
        groups = [start_runners(timed[k], stores[k], n=1) for k in ("plain", "remote")]
        try:
            one(stores["plain"], timed["plain"], "Add 1 and 1.")  # warm-up (first calls, imports), not counted
            one(stores["remote"], timed["remote"], "Add 1 and 1.")
            for i in range(args.rollouts):
                task = QUESTIONS[i % len(QUESTIONS)]
                order = ("plain", "remote") if i % 2 == 0 else ("remote", "plain")
                for shape in order:
                    rows[shape].append(one(stores[shape], timed[shape], task))
        finally:
            for g in groups:
                g.stop()
    same = sum(a["tokens"] == b["tokens"] for a, b in zip(rows["plain"], rows["remote"]))
    print(f"{args.rollouts} rollouts per shape, greedy, max_tokens {args.max_tokens}; identical completions in "
          f"{same}/{args.rollouts} pairs")
    print(f"{'shape':8} {'ms/rollout':>11} {'LLM ms':>9} {'other ms':>9} {'LLM calls':>10} {'proxy hops':>11}")
    med = {}
    for shape in ("plain", "remote"):
        r = rows[shape]
        calls = statistics.mean(x["calls"] for x in r)
        hops = calls + (1 if shape == "remote" else 0)
        med[shape] = {"ms": statistics.median(x["ms"] for x in r), "llm": statistics.median(x["llm_ms"] for x in r),
                      "other": statistics.median(x["ms"] - x["llm_ms"] for x in r)}
        print(f"{shape:8} {med[shape]['ms']:11.0f} {med[shape]['llm']:9.0f} {med[shape]['other']:9.1f} "
              f"{calls:10.2f} {hops:11.2f}")
    print(f"remote / plain: {med['remote']['ms'] / med['plain']['ms']:.3f}x per rollout; the shape's own cost "
          f"{med['remote']['other']:.1f} ms vs {med['plain']['other']:.1f} ms "
          f"(+{med['remote']['other'] - med['plain']['other']:.1f} ms, "
          f"{med['remote']['other'] / max(med['plain']['other'], 1e-9):.2f}x); medians")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
