"""The main command's code path, end to end with tiny parameters (a subprocess, as a user runs it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_demo_writes_metrics_curve_and_summary(tmp_path):
    out = tmp_path / "demo"
    cmd = [sys.executable, "-m", "lightning_nb", "demo", "--steps", "1", "--val-size", "4", "--tasks-per-step", "2",
           "--group-size", "2", "--runners", "4", "--max-tokens", "24", "--sample-rounds", "1", "--ood-size", "4",
           "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "held-out reward: before" in proc.stdout and "(vllm engine)" in proc.stdout  # the default engine
    assert "before training, reward by ops:" in proc.stdout and "after training, reward by ops:" in proc.stdout
    df = pd.read_csv(out / "metrics.csv")
    assert [c for c in df.columns if c.startswith("val_reward/")] == ["val_reward/ops=1", "val_reward/ops=2"]
    assert list(df.columns[:6]) == ["step", "reward_mean", "val_reward", "loss", "kl", "step_seconds"]
    assert df["step"].tolist() == [1] and df["step_seconds"].iloc[0] > 0
    summary = json.loads((out / "summary.json").read_text())
    assert 0.0 <= summary["val_reward_before"] <= 1.0 and df["val_reward"].iloc[0] == summary["val_reward_after"]
    assert sorted(summary["val_slices_after"]) == ["ops=1", "ops=2"]  # the first 4 val tasks have both
    assert df["val_reward/ops=2"].iloc[0] == summary["val_slices_after"]["ops=2"]["mean"]
    assert (out / "reward_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the demo's defaults against the two-operation plateau, recorded with the run
    assert summary["all_numbers_bonus"] == 0.2 and summary["slice_weights"] == {"ops=2": 3.0} and summary["seed"] == 0
    # val_ood: other wordings and number ranges, reported beside val before and after
    assert "val_ood reward before training (4 tasks" in proc.stdout and "val_ood after training, reward by ops:" \
        in proc.stdout
    assert summary["ood_size"] == 4 and df["val_ood_reward"].iloc[0] == summary["val_ood_after"]
    assert 0.0 <= summary["val_ood_before"] <= 1.0 and sum(v["n"] for v in summary["val_ood_slices_after"].values()) == 4
    # the final checkpoint is in the output folder; --resume continues from it, eval --checkpoint reads it
    ckpt = out / "checkpoint.pt"
    assert summary["checkpoint"] == str(ckpt) and ckpt.stat().st_size > 100_000_000
    # the checkpoint holds weights, not an engine: resume and eval it on the in-process engine (no server start-up)
    proc = subprocess.run([*cmd, "--steps", "2", "--resume", str(ckpt), "--val-size", "2", "--ood-size", "0",
                           "--engine", "transformers"],
                          capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from {ckpt} at step 1" in proc.stdout
    assert pd.read_csv(out / "metrics.csv")["step"].tolist() == [1, 2]
    proc = subprocess.run([sys.executable, "-m", "lightning_nb", "eval", "--checkpoint", str(ckpt), "--val-size", "2",
                           "--runners", "2", "--engine", "transformers", "--ood-size", "2"],
                          capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "held-out reward on 2 val tasks (greedy, step 2)" in proc.stdout
    assert "[eval] reward by ops:" in proc.stdout and "ops=2" in proc.stdout  # the first 2 val tasks: two operations
    assert "[eval] val_ood reward (greedy, step 2) (2 tasks with other wordings and numbers):" in proc.stdout
    ckpt.unlink()


def test_demo_rejects_bad_steps():
    proc = subprocess.run([sys.executable, "-m", "lightning_nb", "demo", "--steps", "0"], capture_output=True,
                          text=True, cwd=ROOT)
    assert proc.returncode == 2 and "--steps must be >= 1" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "lightning_nb", "demo", "--sample-rounds", "0"], capture_output=True,
                          text=True, cwd=ROOT)
    assert proc.returncode == 2 and "--sample-rounds must be >= 1" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "lightning_nb", "demo", "--resume", "/nonexistent/ck.pt"],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2 and "no such checkpoint file" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "lightning_nb", "demo", "--trainer", "verl", "--resume",
                           "/nonexistent/checkpoints"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2 and "no such checkpoint folder (--trainer verl writes OUT/checkpoints)" in proc.stderr


@pytest.mark.parametrize("args, message", [
    (["--slice-weights", "ops=2"], "--slice-weights 'ops=2': 'ops=2' is not LABEL:WEIGHT with a weight >= 0"),
    (["--slice-weights", "ops=2:-1"], "'ops=2:-1' is not LABEL:WEIGHT with a weight >= 0"),
    (["--slice-by", "none"], "--slice-weights ops=2:3 weighs tasks by --slice-by labels, and --slice-by is none"),
    (["--all-numbers-bonus", "-0.5"], "--all-numbers-bonus must be a finite number >= 0 (0: off), got -0.5"),
    (["--all-numbers-bonus", "nan"], "--all-numbers-bonus must be a finite number >= 0"),
])
def test_demo_rejects_bad_shaping_and_sampling_flags(capsys, args, message):
    from lightning_nb.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["demo", *args])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_parse_slice_weights():
    import argparse

    from lightning_nb.cli import _parse_slice_weights

    parser = argparse.ArgumentParser()
    assert _parse_slice_weights("ops=2:3, ops=1:0.5", parser) == {"ops=2": 3.0, "ops=1": 0.5}
    assert _parse_slice_weights("none", parser) is None and _parse_slice_weights("", parser) is None
    assert _parse_slice_weights("kind=a:b:2", parser) == {"kind=a:b": 2.0}  # the weight follows the last colon
