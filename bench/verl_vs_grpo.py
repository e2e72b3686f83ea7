"""``VerlTrainer.update`` vs ``GRPOTrainer.update`` on the same CPU batch, this tree against a baseline tree (issue 49).

Issue 49, item 2: with ``kl_coef == 0`` no reference model is built or run unless the KL metric is asked for, a
step with one optimizer step runs no separate π_old pass on either trainer, and ``VerlTrainer.update`` takes at
most 1.25x ``GRPOTrainer.update``'s time on the same CPU batch. This script prints, from one run, each trainer's
update time in this tree and in a baseline tree (today's main, exported with ``git archive``), and the ratios::

    git archive 5d435d2 | (mkdir -p /tmp/lnb-base && tar -x -C /tmp/lnb-base)     # the baseline tree
    python bench/verl_vs_grpo.py --baseline /tmp/lnb-base                        # 16 demo sequences, 3 rounds
    python bench/verl_vs_grpo.py --baseline /tmp/lnb-base --batch /tmp/b.json    # reuse (or write) the batch
    python bench/verl_vs_grpo.py --sides new-grpo,new-verl --rounds 1            # this tree only
    python bench/verl_vs_grpo.py --profile /tmp/prof --sides new-verl --rounds 1 # cProfile of each timed update

Workload, the same for every side:

* model: SmolLM2-135M-Instruct in float32 on the CPU (``TransformersEngine.from_default``), torch's default
  thread count.
* batch: real rollouts of the demo's calc agent (``calc_agent`` behind ``LLMProxy`` → ``TransformersEngine``,
  16 runner threads, temperature 0.7, 32 tokens per call, up to 3 calls per episode, seed 0), collected by
  ``LightningRL.collect`` in rounds of 4 tasks x 4 rollouts until 4 groups carry signal (rewards that differ);
  the batch is those 4 groups: 16 episodes, each packed into one sequence (~250 tokens: the system prompt, two
  worked examples, the question, the model's turns and the tool results), every one of which both trainers
  forward (no zero-advantage group for ``GRPOTrainer`` to skip). The triplets are written to ``--batch``
  (JSON) and read back by every side, so all sides train on the same token IDs and engine log-probs.
* trainers: each side's defaults as the demo builds them (``learning_rate=2e-5, kl_coef=0``; everything else
  the config's default: in the baseline tree that keeps a reference copy and measures KL every step, in this
  tree it does not), one optimizer step per update; ``GRPOTrainer``: micro-batches of 4 rows (the CPU default);
  ``VerlTrainer``: verl's dynamic micro-batches of 4 x the longest row's tokens (the CPU default).
* timed: ``trainer.update(triplets)``, all of it, after one untimed warm-up update. Before each update the
  triplets are re-stamped with the engine's current weight version (fresh, as the loop's batches are), so
  the same 16 sequences are trained every time.

Each side runs in its own process (``--side``; the baseline tree's code is imported from its folder), and the
sides take turns: every round runs each side once (warm-up + ``--repeats`` timed updates), so a change in the
machine's load falls on all sides alike. Printed: each update's seconds, each side's median over all rounds, and
the ratios ``new-verl / new-grpo`` (the target, <= 1.25), ``base-verl / base-grpo``, ``new-grpo / base-grpo`` and
``new-verl / base-verl``; with ``--profile DIR`` one cProfile file per timed update.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
HERE = Path(__file__).resolve()
TREE = HERE.parents[1]


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--baseline", default=None, help="a tree of the baseline commit (git archive); base-* sides")
    p.add_argument("--sides", default=None,
                   help="comma-separated, in turn order (default: base-grpo,base-verl,new-grpo,new-verl with "
                        "--baseline, else new-grpo,new-verl)")
    p.add_argument("--batch", default="/tmp/verl_vs_grpo_batch.json",
                   help="the batch's triplets (JSON); made if absent")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=1, help="timed updates per side per round")
    p.add_argument("--profile", default=None, help="folder for one cProfile file per timed update")
    p.add_argument("--side", default=None, help=argparse.SUPPRESS)  # a child: grpo or verl
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)  # a child's JSON result
    p.add_argument("--label", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ----- the batch --------------------------------------------------------------------------
def make_batch(path: Path, groups: int = 4, group_size: int = 4, rounds: int = 6) -> None:
    """Collect demo rollouts until ``groups`` groups carry signal; write their triplets to ``path`` (JSON)."""
    import torch

    from lightning_nb import (AlgorithmConfig, GRPOConfig, GRPOTrainer, InMemoryStore, LightningRL, LLMProxy,
                              TransformersEngine, start_runners)
    from lightning_nb.tasks.calc import calc_agent, load_tasks

    torch.manual_seed(0)
    engine = TransformersEngine.from_default(max_batch_size=16)
    store = InMemoryStore()
    proxy = LLMProxy(engine, store).start()
    store.add_resources({"main_llm": proxy.as_resource()})
    runners = start_runners(calc_agent, store, n=16)
    trainer = GRPOTrainer(engine, GRPOConfig(track_reference_kl=False))  # only its signal_groups rule is used
    algo = LightningRL(store, trainer, load_tasks("train"), config=AlgorithmConfig(
        tasks_per_step=groups, group_size=group_size, max_tokens=32, temperature=0.7, seed=0,
        dynamic_sampling=True, max_sample_rounds=rounds))
    try:
        triplets, _ = algo.collect()  # rounds until `groups` groups carry signal
    finally:
        runners.stop()
        proxy.stop()
        engine.stop()
    signal = trainer.signal_groups(triplets)
    kept = [t for t in triplets if t.group_id in signal]
    chosen = list(dict.fromkeys(t.group_id for t in kept))[:groups]
    kept = [t for t in kept if t.group_id in chosen]
    path.write_text(json.dumps([t.model_dump() for t in kept]))


def load_batch(path: Path) -> list[Any]:
    from lightning_nb.types import Triplet

    return [Triplet.model_validate(d) for d in json.loads(path.read_text())]


# ----- one side, in its own process ---------------------------------------------------------
def _decoders(trainer: Any) -> dict[str, Any]:
    """The decoder stacks whose forward calls are counted: the policy's, and the reference copy's if one is kept."""
    out = {"policy": trainer.model.get_decoder() if hasattr(trainer.model, "get_decoder") else trainer.model}
    if getattr(trainer, "reference", None) is not None:
        out["reference"] = trainer.reference.get_decoder()
    return out


def run_side(args: argparse.Namespace) -> dict[str, Any]:
    """Build ``args.side``'s trainer on the default model, warm up once, time ``args.repeats`` updates."""
    import cProfile

    import torch

    from lightning_nb import TransformersEngine

    if args.side == "verl":
        from lightning_nb import VerlConfig as Config, VerlTrainer as Trainer
    else:
        from lightning_nb import GRPOConfig as Config, GRPOTrainer as Trainer
    torch.manual_seed(0)
    engine = TransformersEngine.from_default()
    triplets = load_batch(Path(args.batch))
    t0 = time.perf_counter()
    trainer = Trainer(engine, Config(learning_rate=2e-5, kl_coef=0.0))
    built = time.perf_counter() - t0
    calls = {name: 0 for name in _decoders(trainer)}
    for name, module in _decoders(trainer).items():
        module.register_forward_hook(lambda *_, n=name: calls.__setitem__(n, calls[n] + 1))
    seconds, rows = [], []
    for k in range(args.repeats + 1):
        fresh = [t.model_copy(update={"weight_version": engine.weight_version}) for t in triplets]
        for name in calls:
            calls[name] = 0
        prof = cProfile.Profile() if args.profile and k else None
        t0 = time.perf_counter()
        if prof is not None:
            prof.enable()
        m = trainer.update(fresh)
        if prof is not None:
            prof.disable()
            Path(args.profile).mkdir(parents=True, exist_ok=True)
            prof.dump_stats(str(Path(args.profile) / f"{args.label}-{os.getpid()}-{k}.prof"))
        if k:  # the first update is the warm-up
            seconds.append(time.perf_counter() - t0)
            rows.append({"forwards": dict(calls), **{key: m.get(key) for key in (
                "loss", "grad_norm", "kl", "sequences_trained", "tokens_trained", "optimizer_steps",
                "micro_batches", "logprob_diff_max")}})
    engine.stop()
    return {"label": args.label, "seconds": seconds, "rows": rows, "build_seconds": built,
            "reference_copy": getattr(trainer, "reference", None) is not None,
            "threads": torch.get_num_threads()}


# ----- the sides in turn, and the table -------------------------------------------------------
def run_child(args: argparse.Namespace, label: str) -> dict[str, Any]:
    """Run one side (``base-grpo``, ``new-verl``, ...) in a child process on its tree; returns its result."""
    tree, side = (args.baseline, label[5:]) if label.startswith("base-") else (str(TREE), label[4:])
    out = Path(args.batch).with_suffix(f".{label}.json")
    cmd = [sys.executable, str(HERE), "--side", side, "--label", label, "--out", str(out), "--batch", args.batch,
           "--repeats", str(args.repeats)] + (["--profile", args.profile] if args.profile else [])
    env = {**os.environ, "PYTHONPATH": tree}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{label} failed:\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def report(results: dict[str, list[dict[str, Any]]]) -> None:
    """Print each side's updates, its median, and the ratios of the medians."""
    med = {}
    for label, runs in results.items():
        seconds = [s for r in runs for s in r["seconds"]]
        med[label] = statistics.median(seconds)
        last = runs[-1]["rows"][-1]
        print(f"{label:10s} median {med[label]:6.1f} s  updates {', '.join(f'{s:.1f}' for s in seconds)}  "
              f"forwards {last['forwards']}  reference copy {runs[-1]['reference_copy']}  "
              f"micro_batches {last['micro_batches']}  kl {last['kl']}  loss {last['loss']:.5f}  "
              f"grad_norm {last['grad_norm']:.4f}  build {runs[-1]['build_seconds']:.1f} s", flush=True)
    for a, b, what in (("new-verl", "new-grpo", "VerlTrainer / GRPOTrainer, this tree (target <= 1.25)"),
                       ("base-verl", "base-grpo", "VerlTrainer / GRPOTrainer, baseline"),
                       ("new-grpo", "base-grpo", "GRPOTrainer, this tree / baseline"),
                       ("new-verl", "base-verl", "VerlTrainer, this tree / baseline")):
        if a in med and b in med:
            print(f"{a} / {b} = {med[a] / med[b]:.2f}   ({what})", flush=True)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.side:
        result = run_side(args)
        Path(args.out).write_text(json.dumps(result))
        return 0
    batch = Path(args.batch)
    if not batch.exists():
        t0 = time.perf_counter()
        make_batch(batch)
        print(f"batch: real demo rollouts written to {batch} in {time.perf_counter() - t0:.0f} s", flush=True)
    triplets = load_batch(batch)
    print(f"batch: {len(triplets)} triplets, {len({t.rollout_id for t in triplets})} episodes, "
          f"{len({t.group_id for t in triplets})} groups", flush=True)
    default = "base-grpo,base-verl,new-grpo,new-verl" if args.baseline else "new-grpo,new-verl"
    sides = (args.sides or default).split(",")
    if any(s.startswith("base-") for s in sides) and not args.baseline:
        raise SystemExit("base-* sides need --baseline DIR (a tree of the baseline commit: git archive)")
    results: dict[str, list[dict[str, Any]]] = {s: [] for s in sides}
    for r in range(args.rounds):
        for label in sides:
            res = run_child(args, label)
            results[label].append(res)
            print(f"round {r + 1} {label}: {', '.join(f'{s:.1f}' for s in res['seconds'])} s", flush=True)
    report(results)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
