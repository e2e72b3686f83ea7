"""GRPOTrainer.update on the demo's own batches: the path before issue 49 against today's, side by side in one run.

Workload: the demo's rollouts (``python -m lightning_nb demo`` defaults on CPU: 4 tasks x 4 rollouts of the calc
agent with its shaping bonus and slice weights, temperature 0.7, 32 tokens per call, up to 3 sample rounds), sampled
by the in-process ``TransformersEngine`` through the real proxy, runners and adapter (``LightningRL.collect``).
Each of ``--batches`` batches is then updated once by each side, from the same initial weights, in alternating
order (A B, B A, ...), so that load drifting over the run hits both sides alike:

* **before** (the path at 5d435d2): ``GRPOConfig(prefix_tree=False, micro_batch_tokens=None,
  track_reference_kl=True, kl_every=1)``: micro-batches of 4 padded rows, and the frozen reference's forward in
  every micro-batch to report ``kl``;
* **after** (today's defaults): ``GRPOConfig()``: each micro-batch a prefix tree under 2,048 nodes, no reference.

Both sides compute the same gradient (tests/test_prefix_tree.py checks it to 1e-5); this measures the time. Per
batch and side it prints the sequences, trained (response) tokens, forwarded tokens (tree nodes or padded rows;
the reference's forward, when on, forwards the same tokens again), ``update_seconds`` and trained tokens/s, and
the ratios after / before: forwarded tokens (target <= 0.35) and speed per trained token (target >= 2.5).

``--workload langgraph`` also samples notebook 05's LangGraph ReAct agent (a ``calc`` tool, LangChain's
``create_agent`` against the proxy) on ``--tasks`` tasks x 4 and reports what its packed multi-turn episodes share.

Usage::

    .venv/bin/python bench/update_speed.py                   # 3 demo batches, both sides (~6 min on 2 idle cores)
    .venv/bin/python bench/update_speed.py --batches 1 --workload demo langgraph

Threads: torch's default (one per core); run it on an otherwise idle machine, and quote the load.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
from typing import Any

SIDES = {
    "before": dict(prefix_tree=False, micro_batch_tokens=None, track_reference_kl=True),
    "after": dict(),
}


def _config(side: str) -> Any:
    import dataclasses

    from lightning_nb import GRPOConfig

    fields = dict(SIDES[side])
    if side == "before" and "kl_every" in {f.name for f in dataclasses.fields(GRPOConfig)}:
        fields["kl_every"] = 1  # the reference's forward on every update, as before issue 49
    return GRPOConfig(**fields)


def _serve(agent: Any, runners: int):
    from lightning_nb import InMemoryStore, LLMProxy, TransformersEngine, start_runners
    from lightning_nb.types import MAIN_LLM

    engine = TransformersEngine.from_default(max_batch_size=runners)
    store = InMemoryStore()
    proxy = LLMProxy(engine, store).start()
    store.add_resources({MAIN_LLM: proxy.as_resource()})
    group = start_runners(agent, store, n=runners)
    return engine, store, proxy, group


def demo_batches(n: int, seed: int, runners: int = 16) -> tuple[Any, list[list]]:
    """``n`` batches of the demo's rollouts (triplets), and the engine that sampled them (its initial weights)."""
    from lightning_nb import AlgorithmConfig, GRPOTrainer, LightningRL
    from lightning_nb.cli.demo import DEMO_ALL_NUMBERS_BONUS, DEMO_SLICE_WEIGHTS
    from lightning_nb.tasks.calc import calc_agent, load_tasks

    agent = functools.partial(calc_agent, all_numbers_bonus=DEMO_ALL_NUMBERS_BONUS)
    engine, store, proxy, group = _serve(agent, runners)
    try:
        algo = LightningRL(store, GRPOTrainer(engine, _config("after")), load_tasks("train"), config=AlgorithmConfig(
            tasks_per_step=4, group_size=4, seed=seed, temperature=0.7, max_tokens=32, dynamic_sampling=True,
            max_sample_rounds=3, slice_weights=dict(DEMO_SLICE_WEIGHTS)), slice_by="ops")
        batches = []
        for i in range(n):
            t0 = time.perf_counter()
            triplets, _ = algo.collect()
            print(f"[bench] batch {i + 1}: {len(triplets)} triplets of {len({t.rollout_id for t in triplets})} "
                  f"episodes in {time.perf_counter() - t0:.1f} s", flush=True)
            batches.append(triplets)
    finally:
        group.stop()
        proxy.stop()
    return engine, batches


def time_update(engine: Any, start: dict, side: str, batch: list) -> dict:
    """One update of ``batch`` by a fresh trainer of ``side`` from the weights ``start``; its metrics."""
    import torch

    from lightning_nb import GRPOTrainer

    with torch.no_grad():
        engine.model.load_state_dict(start)
    engine.weight_version = max(t.weight_version or 0 for t in batch)
    trainer = GRPOTrainer(engine, _config(side))
    m = trainer.update(batch)
    del trainer
    return m


def run_demo(args: argparse.Namespace) -> None:
    engine, batches = demo_batches(args.batches, args.seed)
    start = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
    rows = []
    for i, batch in enumerate(batches):
        order = ["before", "after"] if i % 2 == 0 else ["after", "before"]
        got = {side: time_update(engine, start, side, batch) for side in order}
        rows.append(got)
        b, a = got["before"], got["after"]
        trained = a["tokens_trained"]
        print(f"[bench] batch {i + 1}: {a['sequences_trained']} sequences, {trained} trained tokens; forwarded "
              f"{b['forwarded_tokens']} -> {a['forwarded_tokens']} ({a['forwarded_tokens'] / b['forwarded_tokens']:.2f}x;"
              f" shared {a['prefix_shared_tokens']}); update {b['update_seconds']:.1f} s -> {a['update_seconds']:.1f} s "
              f"({b['update_seconds'] / a['update_seconds']:.2f}x per trained token); "
              f"micro-batches {b['micro_batches']} -> {a['micro_batches']}", flush=True)
    engine.close()
    print("\n| batch | sequences | trained tokens | forwarded before | forwarded after | ratio | update before (s) | "
          "update after (s) | trained tok/s before | after | speed-up |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    fwd, speed = [], []
    for i, got in enumerate(rows):
        b, a = got["before"], got["after"]
        trained = a["tokens_trained"]
        fwd.append(a["forwarded_tokens"] / b["forwarded_tokens"])
        speed.append(b["update_seconds"] / a["update_seconds"])
        print(f"| {i + 1} | {a['sequences_trained']} | {trained} | {b['forwarded_tokens']} | {a['forwarded_tokens']} | "
              f"{fwd[-1]:.2f}x | {b['update_seconds']:.1f} | {a['update_seconds']:.1f} | "
              f"{trained / b['update_seconds']:.0f} | {trained / a['update_seconds']:.0f} | {speed[-1]:.2f}x |")
    print(f"\nforwarded tokens after/before: mean {statistics.mean(fwd):.3f}x (target <= 0.35); update speed per "
          f"trained token after/before: mean {statistics.mean(speed):.2f}x, min {min(speed):.2f}x (target >= 2.5); "
          f"load average at the end {os.getloadavg()[0]:.1f}")


def langgraph_agent(task: dict, llm: Any) -> float:
    """Notebook 05's LangGraph agent: LangChain's ReAct agent with one calculator tool, against ``llm.endpoint``."""
    from langchain.agents import create_agent
    from langchain_openai import ChatOpenAI

    from lightning_nb.tasks.calc import calc_reward, calculator

    def calc(expression: str) -> str:
        """Evaluate an arithmetic expression such as 17 * 23."""
        return calculator(expression)

    model = ChatOpenAI(base_url=llm.endpoint, api_key=llm.api_key, model=llm.model, max_retries=0)
    try:
        state = create_agent(model, [calc]).invoke({"messages": [("user", task["question"])]},
                                                   {"recursion_limit": 6})
    except Exception as exc:  # GraphRecursionError: the episode ran out of turns; its calls are recorded
        print(f"[bench] langgraph episode ended: {type(exc).__name__}", flush=True)
        return 0.0
    return calc_reward(str(state["messages"][-1].content), task)


def run_langgraph(args: argparse.Namespace) -> None:
    from lightning_nb import AlgorithmConfig, GRPOTrainer, LightningRL
    from lightning_nb.tasks.calc import load_tasks
    from lightning_nb.trainers.packing import episodes_of, pack_episode
    from lightning_nb.trainers.prefix_tree import build_prefix_tree, plan_tree_micro_batches
    from lightning_nb.trainers.microbatch import padded_tokens, plan_micro_batches

    engine, store, proxy, group = _serve(langgraph_agent, 8)
    try:
        algo = LightningRL(store, GRPOTrainer(engine, _config("after")), load_tasks("train", limit=args.tasks),
                           config=AlgorithmConfig(tasks_per_step=args.tasks, group_size=4, seed=args.seed,
                                                  temperature=0.7, max_tokens=48, dynamic_sampling=False))
        triplets, _ = algo.collect()
    finally:
        group.stop()
        proxy.stop()
    seqs = [s.input_ids for ts in episodes_of(triplets).values() for s in pack_episode(ts, 0.0)]
    turns = [len(ts) for ts in episodes_of(triplets).values()]
    tree = build_prefix_tree(seqs)
    rows = padded_tokens([len(s) for s in seqs], plan_micro_batches([len(s) for s in seqs], None, 4))
    trees = sum(build_prefix_tree([seqs[i] for i in mb]).nodes for mb in plan_tree_micro_batches(seqs, 2048))
    print(f"[bench] langgraph: {len(turns)} episodes, {sum(turns)} LLM calls ({min(turns)}-{max(turns)} per episode), "
          f"packed into {len(seqs)} sequences of {tree.sequence_tokens} tokens; one tree: {tree.nodes} nodes "
          f"({tree.nodes / tree.sequence_tokens:.2f}x the tokens); forwarded: 4-row padded micro-batches {rows}, "
          f"trees under 2,048 nodes {trees} ({trees / rows:.2f}x)")
    engine.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tasks", type=int, default=2, help="LangGraph workload: tasks (groups of 4)")
    p.add_argument("--workload", nargs="+", default=["demo"], choices=["demo", "langgraph"])
    args = p.parse_args()
    if "demo" in args.workload:
        run_demo(args)
    if "langgraph" in args.workload:
        run_langgraph(args)


if __name__ == "__main__":
    main()
