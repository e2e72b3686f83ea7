"""The demo on several seeds, and the per-slice table before and after training for each (issue 14).

Runs ``python -m lightning_nb demo --seed S --out OUT/seed-S`` once per seed, one after another (each starts
its own engine; the demo's other options are its defaults unless given after ``--``), then prints one row per
seed from each run's ``summary.json``: held-out reward on val before and after training, per ``ops`` slice as
solved/n, the rise, val_ood before and after, and the minutes taken, and checks issue 14's goal:

* the held-out reward rises by at least +0.30 over the untrained model (same prompt);
* two-operation tasks (``ops=2``) reach at least 8/22 solved, one-operation tasks (``ops=1``) stay at least 40/42.

With ``--before REF`` (a git commit) the same seeds also run on that commit, checked out as a detached worktree
beside this one and run with this checkout's venvs (``PYTHONPATH`` = the worktree, ``LIGHTNING_NB_VLLM_PYTHON`` =
this checkout's ``.venv-vllm``), before and after alternating from seed to seed so load drifting over the window
hits both alike; its runs go to ``OUT/before-seed-S``. A second table then sets the two side by side per seed: the
minutes, the mean training step (``step_seconds``), the mean update (``update_seconds``), the update's trained
tokens per second (``tokens_trained / update_seconds``), forwarded tokens per trained token (``forwarded_tokens``
where the run reports it, else the trained sequences' tokens over ``1 - padding_fraction``, the padded rows), the
held-out reward and ``val_ood`` before and after, and ``val_ood``'s two-operation slice (issue 49).

Usage::

    .venv/bin/python bench/demo_seeds.py                        # seeds 0 1 2, runs/demo-seeds/seed-S (~10 min each here)
    .venv/bin/python bench/demo_seeds.py --before 5d435d2        # and the same seeds at 5d435d2, side by side
    .venv/bin/python bench/demo_seeds.py --seeds 0 -- --all-numbers-bonus 0 --slice-weights none   # an ablation
    .venv/bin/python bench/demo_seeds.py --table-only --out runs/demo-seeds   # reprint the table of finished runs

Exits 0 when every seed met the goal, 1 otherwise (2: a run failed).
"""

from __future__ import annotations

import argparse
import json
import os
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


def speed(out: Path) -> dict:
    """The run's speed from its metrics.csv: mean ``step_s`` and ``update_s``, ``trained_per_s`` (trained tokens per
    update second) and ``forwarded_per_trained`` (forwarded tokens per trained token; see the module docstring)."""
    import pandas as pd

    df = pd.read_csv(out / "metrics.csv")
    df = df[df["update_seconds"].notna()] if "update_seconds" in df else df.iloc[0:0]
    trained = df["tokens_trained"].sum()
    if "forwarded_tokens" in df:
        forwarded = df["forwarded_tokens"].sum()
    else:  # before issue 49: tokens_per_s is the trained sequences' tokens per second; rows were padded
        forwarded = (df["tokens_per_s"] * df["update_seconds"] / (1 - df["padding_fraction"].fillna(0.0))).sum()
    return {"step_s": df["step_seconds"].mean(), "update_s": df["update_seconds"].mean(),
            "trained_per_s": trained / df["update_seconds"].sum(), "forwarded_per_trained": forwarded / trained}


def side_by_side(seeds: list[int], out: Path) -> None:
    """Print the before/after table of ``--before`` (see the module docstring)."""
    print("\n| seed | commit | min | step (s) | update (s) | trained tok/s | forwarded / trained | held-out | val_ood "
          "| val_ood ops=2 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for seed in seeds:
        for side, folder in (("before", out / f"before-seed-{seed}"), ("after", out / f"seed-{seed}")):
            path = folder / "summary.json"
            if not path.exists():
                print(f"| {seed} | {side} | no {path} | | | | | | | |")
                continue
            s, v = json.loads(path.read_text()), speed(folder)
            ood = (f"{s['val_ood_before']:.3f} → {s['val_ood_after']:.3f}" if s.get("val_ood_before") is not None
                   else "-")
            print(f"| {seed} | {side} ({s.get('commit', '?')}) | {s['minutes']:.1f} | {v['step_s']:.1f} | "
                  f"{v['update_s']:.1f} | {v['trained_per_s']:.0f} | {v['forwarded_per_trained']:.1f} | "
                  f"{s['val_reward_before']:.3f} → {s['val_reward_after']:.3f} | {ood} | "
                  f"{_solved(s, 'val_ood_slices_before', 'ops=2')} → {_solved(s, 'val_ood_slices_after', 'ops=2')} |")


def _worktree(ref: str) -> Path:
    """A detached worktree of ``ref`` (made once, reused), beside this checkout's git folder."""
    root = Path(__file__).resolve().parents[1]
    sha = subprocess.check_output(["git", "-C", str(root), "rev-parse", "--short", ref], text=True).strip()
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"lightning-nb-{sha}"
    if not path.exists():
        subprocess.check_call(["git", "-C", str(root), "worktree", "add", "--detach", str(path), sha])
    return path


def _run(cmd: list[str], out: Path, tree: Path | None) -> int:
    """Run one demo (``tree``: from that worktree) and stamp its summary.json with the commit it ran."""
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = str(tree)
        env.setdefault("LIGHTNING_NB_VLLM_PYTHON", str(root / ".venv-vllm" / "bin" / "python"))
    print("[demo_seeds]", f"PYTHONPATH={tree}" if tree else "", " ".join(cmd), flush=True)
    rc = subprocess.call(cmd, env=env, cwd=str(tree or root))
    summary = out / "summary.json"
    if rc == 0 and summary.exists():
        sha = subprocess.check_output(["git", "-C", str(tree or root), "rev-parse", "--short", "HEAD"],
                                      text=True).strip()
        dirty = subprocess.call(["git", "-C", str(tree or root), "diff", "--quiet", "HEAD", "--", "lightning_nb"])
        data = json.loads(summary.read_text())
        data["commit"] = sha + ("+" if dirty else "")
        summary.write_text(json.dumps(data, indent=2))
    return rc


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
    p.add_argument("--before", metavar="REF", help="also run each seed at this git commit, side by side")
    args = p.parse_args(argv)
    args.out = args.out.resolve()
    tree = _worktree(args.before) if args.before and not args.table_only else None
    for i, seed in enumerate(args.seeds):
        if args.table_only:
            continue
        sides = [("after", args.out / f"seed-{seed}", None)]
        if tree is not None:
            sides.append(("before", args.out / f"before-seed-{seed}", tree))
            sides = sides[::-1] if i % 2 == 0 else sides
        for side, out, where in sides:
            cmd = [sys.executable, "-m", "lightning_nb", "demo", "--seed", str(seed), "--out", str(out), *extra]
            if _run(cmd, out, where) != 0:
                print(f"[demo_seeds] seed {seed} ({side}): the demo failed", file=sys.stderr)
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
    if args.before or any((args.out / f"before-seed-{s}").exists() for s in args.seeds):
        side_by_side(args.seeds, args.out)
    return 0 if all_met else 1


if __name__ == "__main__":
    raise SystemExit(main())
