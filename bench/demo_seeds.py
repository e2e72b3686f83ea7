"""The demo on several seeds, and the per-slice table before and after training for each (issue 14).

Runs ``python -m lightning_nb demo --seed S --out OUT/seed-S`` once per seed, one after another (each starts
its own engine; the demo's other options are its defaults unless given after ``--``), then prints one row per
seed from each run's ``summary.json``: held-out reward on val before and after training, per ``ops`` slice as
solved/n, the rise, val_ood before and after, and the minutes taken, and checks issue 14's goal:

* the held-out reward rises by at least +0.30 over the untrained model (same prompt);
* two-operation tasks (``ops=2``) reach at least 8/22 solved, one-operation tasks (``ops=1``) stay at least 40/42.

Usage::

    .venv/bin/python bench/demo_seeds.py                        # seeds 0 1 2, runs/demo-seeds/seed-S (~10 min each here)
    .venv/bin/python bench/demo_seeds.py --seeds 0 -- --all-numbers-bonus 0 --slice-weights none   # an ablation
    .venv/bin/python bench/demo_seeds.py --table-only --out runs/demo-seeds   # reprint the table of finished runs

Exits 0 when every seed met the goal, 1 otherwise (2: a run failed).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

RISE, OPS2_SOLVED, OPS1_SOLVED = 0.30, 8, 40  # the goal (with the default val size, 64: 42 + 22 tasks)


def _solved(summary: dict, key: str, label: str) -> str:
    s = (summary.get(key) or {}).get(label)
    return f"{s['solved']}/{s['n']}" if s else "-"


def row(seed: int, summary: dict) -> tuple[str, bool]:
    """One table row for ``summary`` (a demo's summary.json) and whether it met the goal."""
    before, after = summary["val_reward_before"], summary["val_reward_after"]
    after_slices = summary.get("val_slices_after") or {}
    ops1, ops2 = after_slices.get("ops=1", {}), after_slices.get("ops=2", {})
    met = (after - before >= RISE - 1e-9 and ops2.get("solved", 0) >= OPS2_SOLVED
           and ops1.get("solved", 0) >= OPS1_SOLVED)
    ood = (f"{summary['val_ood_before']:.3f} → {summary['val_ood_after']:.3f}"
           if summary.get("val_ood_before") is not None else "-")
    cells = [str(seed), f"{before:.3f} → {after:.3f}", f"{after - before:+.3f}",
             f"{_solved(summary, 'val_slices_before', 'ops=1')} → {_solved(summary, 'val_slices_after', 'ops=1')}",
             f"{_solved(summary, 'val_slices_before', 'ops=2')} → {_solved(summary, 'val_slices_after', 'ops=2')}",
             ood, f"{summary['minutes']:.1f}", "yes" if met else "no"]
    return "| " + " | ".join(cells) + " |", met


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--out", type=Path, default=Path("runs/demo-seeds"), help="one seed-S folder per seed here")
    p.add_argument("--table-only", action="store_true", help="run nothing; print the table of OUT/seed-S")
    args = p.parse_args(argv)
    for seed in args.seeds:
        out = args.out / f"seed-{seed}"
        if args.table_only:
            continue
        cmd = [sys.executable, "-m", "lightning_nb", "demo", "--seed", str(seed), "--out", str(out), *extra]
        print("[demo_seeds]", " ".join(cmd), flush=True)
        if subprocess.call(cmd) != 0:
            print(f"[demo_seeds] seed {seed}: the demo failed", file=sys.stderr)
            return 2
    print(f"\ngoal: rise >= +{RISE:.2f}, ops=2 >= {OPS2_SOLVED} solved, ops=1 >= {OPS1_SOLVED} solved"
          + (f"; demo options: {' '.join(extra)}" if extra else ""))
    print("| seed | val before → after | rise | ops=1 solved | ops=2 solved | val_ood before → after | min | goal |")
    print("|---|---|---|---|---|---|---|---|")
    all_met = True
    for seed in args.seeds:
        path = args.out / f"seed-{seed}" / "summary.json"
        if not path.exists():
            print(f"| {seed} | no {path} | | | | | | no |")
            all_met = False
            continue
        line, met = row(seed, json.loads(path.read_text()))
        all_met &= met
        print(line)
    return 0 if all_met else 1


if __name__ == "__main__":
    raise SystemExit(main())
