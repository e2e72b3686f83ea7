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

    .venv/bin/python bench/task_seeds.py runs "reasoning_gym:number_format" --seeds 0 1 2 [-- --steps 16 ...]
    .venv/bin/python bench/task_seeds.py table runs/task_seeds/*/seed-*

``runs`` trains the task set with the CPU defaults (``python -m lightning_nb demo --task NAME --seed S``, one
process per seed, one after the other; arguments after ``--`` go to the demo) into
``--out/<task>/seed-<S>`` (its log in ``demo.log`` there) and prints one row per run from its summary.json: the
held-out reward before and after with their standard errors, the paired gain with its standard error, whether the
gain is more than twice that (issue 52's bar), and the minutes. ``table`` prints the same rows from runs already
made.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path


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


RUN_HEADER = ("| task | seed | held-out before | after | gain (paired s.e.) | gain > 2 s.e. | steps | minutes |\n"
              "|---|---|---|---|---|---|---|---|")


def run_row(run_dir: Path) -> str:
    """One table row from a demo run's summary.json (see the module docstring)."""
    s = json.loads((Path(run_dir) / "summary.json").read_text())
    task = s.get("task", {}).get("name", "calc")
    before, after = s["val_reward_before"], s["val_reward_after"]
    gain, gain_se = after - before, s.get("val_reward_gain_se")

    def pm(mean: float, se: float | None) -> str:
        return f"{mean:.3f} ± {se:.3f}" if se is not None else f"{mean:.3f}"

    passed = "yes" if gain_se is not None and gain > 2 * gain_se else "no"
    gain_text = f"{gain:+.3f} ± {gain_se:.3f}" if gain_se is not None else f"{gain:+.3f}"
    return (f"| `{task}` | {s['seed']} | {pm(before, s.get('val_reward_before_se'))} | "
            f"{pm(after, s.get('val_reward_after_se'))} | {gain_text} | {passed} | "
            f"{s['steps']} | {s['minutes']:.1f} |")


def runs(name: str, seeds: list[int], out: Path, demo_args: list[str]) -> list[str]:
    """Train ``name`` once per seed (``python -m lightning_nb demo``), printing each run's row as it ends."""
    rows = []
    slug = re.sub(r"[^A-Za-z0-9_.=-]+", "_", name)
    for seed in seeds:
        run_dir = out / slug / f"seed-{seed}"
        run_dir.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "lightning_nb", "demo", "--task", name, "--seed", str(seed), "--out", str(run_dir),
               *demo_args]
        with open(run_dir / "demo.log", "w") as log:
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT)
        if proc.returncode != 0:
            print(f"| `{name}` | {seed} | failed (exit {proc.returncode}): see {run_dir / 'demo.log'} |", flush=True)
            continue
        rows.append(run_row(run_dir))
        print(rows[-1], flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sc = sub.add_parser("screen", help="the untrained model's held-out reward on each named task set")
    sc.add_argument("names", nargs="+", help="task set names (docs/tasks.md)")
    sc.add_argument("--n", type=int, default=64, help="held-out seeds per task set (default 64)")
    sc.add_argument("--max-tokens", type=int, default=64, help="completion tokens per LLM call (default 64)")
    sc.add_argument("--runners", type=int, default=16, help="runner threads and engine batch (default 16)")
    ru = sub.add_parser("runs", help="train a task set on several seeds with the demo's CPU defaults")
    ru.add_argument("name", help="a task set name (docs/tasks.md)")
    ru.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="run seeds (default 0 1 2)")
    ru.add_argument("--out", type=Path, default=Path("runs/task_seeds"), help="where the runs go")
    ta = sub.add_parser("table", help="the rows of runs already made (their folders)")
    ta.add_argument("dirs", nargs="+", type=Path)
    argv = sys.argv[1:]
    demo_args = argv[argv.index("--") + 1:] if "--" in argv else []
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if args.command in ("runs", "table"):
        print(RUN_HEADER, flush=True)
        if args.command == "runs":
            runs(args.name, args.seeds, args.out, demo_args)
        else:
            for d in args.dirs:
                print(run_row(d))
        return 0
    print("| task | held-out seeds | reward (mean ± s.e.) | failed | seconds |\n|---|---|---|---|---|", flush=True)
    screen(args.names, args.n, args.max_tokens, args.runners)
    return 0


if __name__ == "__main__":
    sys.exit(main())
