"""Which task sets the untrained default model half-solves: held-out reward (greedy) per task set, with its spread.

    .venv/bin/python bench/task_seeds.py screen "reasoning_gym:leg_counting" "reasoning_gym:gcd" ... [--n 64]

Issue 52 asks for third-party tasks on which RL through the kit measurably improves SmolLM2-135M-Instruct. A task
is worth training when the untrained model scores between 0.1 and 0.6 on its held-out seeds: lower gives GRPO
groups without signal, higher leaves little to learn. ``screen`` loads the default model once
(:class:`~lightning_nb.engines.transformers.TransformersEngine`), and for each name
(:func:`lightning_nb.tasks.load_task`, docs/tasks.md) runs the task set's agent through the LLM proxy on the tasks of its first ``--n`` held-out seeds
(greedy, ``--max-tokens`` per call, 16 runner threads) and prints one row: the mean final reward (a failed rollout
counts 0), its standard error (sample standard deviation / sqrt(n)), how many rollouts failed, and the seconds it
took. Quote the rows with the commit, the machine and its load.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time


def screen(names: list[str], n: int, max_tokens: int, runners: int) -> list[dict]:
    """One row per task set name: ``{"task", "n", "mean", "se", "failed", "seconds"}`` (see the module docstring)."""
    from lightning_nb import InMemoryStore, LLMProxy, TransformersEngine, start_runners
    from lightning_nb.tasks import load_task
    from lightning_nb.types import SAMPLING_PARAMETERS_KEY

    engine = TransformersEngine.from_default(max_batch_size=runners)
    rows = []
    try:
        for name in names:
            task = load_task(name)
            t0 = time.perf_counter()
            store = InMemoryStore()
            with LLMProxy(engine, store) as proxy:
                store.add_resources({"main_llm": proxy.as_resource()})
                with start_runners(task.agent, store, n=runners):
                    sampling = {"temperature": 0.0, "max_tokens": max_tokens}
                    ids = [r.rollout_id for r in store.enqueue_rollouts(
                        task.heldout_tasks(n), mode="val", metadata={SAMPLING_PARAMETERS_KEY: sampling})]
                    done = store.wait_for_rollouts(ids, timeout=3600, progress=True)
            rewards = store.final_rewards(ids)
            values = [float(rewards.get(i) or 0.0) for i in ids]
            rows.append({"task": name, "n": len(values), "mean": statistics.fmean(values),
                         "se": statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else math.nan,
                         "failed": sum(1 for r in done if r.status != "succeeded"),
                         "seconds": time.perf_counter() - t0})
            r = rows[-1]
            print(f"| {r['task']} | {r['n']} | {r['mean']:.3f} ± {r['se']:.3f} | {r['failed']} | {r['seconds']:.0f} |",
                  flush=True)
    finally:
        engine.close()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sc = sub.add_parser("screen", help="the untrained model's held-out reward on each named task set")
    sc.add_argument("names", nargs="+", help="task set names (docs/tasks.md)")
    sc.add_argument("--n", type=int, default=64, help="held-out seeds per task set (default 64)")
    sc.add_argument("--max-tokens", type=int, default=64, help="completion tokens per LLM call (default 64)")
    sc.add_argument("--runners", type=int, default=16, help="runner threads and engine batch (default 16)")
    args = parser.parse_args()
    print("| task | held-out seeds | reward (mean ± s.e.) | failed | seconds |\n|---|---|---|---|---|", flush=True)
    screen(args.names, args.n, args.max_tokens, args.runners)
    return 0


if __name__ == "__main__":
    sys.exit(main())
