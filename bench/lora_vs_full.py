"""LoRA vs full fine-tuning on the demo task, back to back in one run.

Runs ``python -m lightning_nb demo`` twice with the same seed, tasks, engine and steps: once training
the full weights (``--lr 2e-5``, the demo default) and once training LoRA adapters
(``--lora-rank R --lora-alpha A --lr LR``). Prints, for each, the held-out reward before and after
(64 val tasks, greedy), the training minutes, the mean seconds per step, and the checkpoint size.

    .venv/bin/python bench/lora_vs_full.py                       # 12 steps, vLLM engine, rank 32
    .venv/bin/python bench/lora_vs_full.py --steps 4 --engine transformers --lora-lr 1e-4

Each run writes its usual output folder under ``--out`` (metrics.csv, reward_curve.png, summary.json).
The two runs are sequential, so the machine's load can differ between them: quote the load.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def run(name: str, out: Path, args: argparse.Namespace, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "lightning_nb", "demo", "--steps", str(args.steps), "--engine", args.engine,
           "--seed", str(args.seed), "--out", str(out / name), *extra]
    print("$", " ".join(cmd), flush=True)
    t0 = time.time()
    subprocess.run(cmd, check=True)
    summary = json.loads((out / name / "summary.json").read_text())
    summary["wall_minutes"] = (time.time() - t0) / 60
    summary["checkpoint_mb"] = Path(summary["checkpoint"]).stat().st_size / 1e6
    return summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--engine", default="vllm", choices=["vllm", "transformers"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lora-rank", type=int, default=32)
    p.add_argument("--lora-alpha", type=float, default=32.0)
    p.add_argument("--lora-lr", type=float, default=2e-4)
    p.add_argument("--full-lr", type=float, default=2e-5)
    p.add_argument("--only", choices=["full", "lora"], default=None, help="run one side only")
    p.add_argument("--out", type=Path, default=Path("runs/lora_vs_full"))
    args = p.parse_args()
    results = {}
    if args.only in (None, "full"):
        results["full"] = run("full", args.out, args, ["--lr", str(args.full_lr)])
    if args.only in (None, "lora"):
        results["lora"] = run("lora", args.out, args, ["--lr", str(args.lora_lr), "--lora-rank", str(args.lora_rank),
                                                       "--lora-alpha", str(args.lora_alpha)])
    print(f"\n{'run':<6} {'lr':>8} {'val before':>11} {'val after':>10} {'rise':>6} {'train min':>10} "
          f"{'s/step':>7} {'ckpt MB':>8}")
    for name, s in results.items():
        print(f"{name:<6} {s['learning_rate']:>8.0e} {s['val_reward_before']:>11.3f} {s['val_reward_after']:>10.3f} "
              f"{s['val_reward_after'] - s['val_reward_before']:>+6.3f} {s['minutes']:>10.1f} "
              f"{s['step_seconds'] or float('nan'):>7.1f} {s['checkpoint_mb']:>8.0f}")
    (args.out / "lora_vs_full.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
