"""The main command's code path, end to end with tiny parameters (a subprocess, as a user runs it)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

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
    assert summary["overlong_filter"] is False  # DAPO's overlong filter is opt-in (--overlong-filter)
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

    from lightning_nb.cli.commands import _parse_slice_weights

    parser = argparse.ArgumentParser()
    assert _parse_slice_weights("ops=2:3, ops=1:0.5", parser) == {"ops=2": 3.0, "ops=1": 0.5}
    assert _parse_slice_weights("none", parser) is None and _parse_slice_weights("", parser) is None
    assert _parse_slice_weights("kind=a:b:2", parser) == {"kind=a:b": 2.0}  # the weight follows the last colon


# ----- --device / --dtype: one GPU's defaults where the user set nothing ---------------------------------------------

CPU = {"dtype": "float32", "gradient_checkpointing": False, "tasks_per_step": 4, "group_size": 4, "runners": 16}
CUDA = {"dtype": "bfloat16", "gradient_checkpointing": True, "tasks_per_step": 16, "group_size": 8, "runners": 64}


def _resolved(*argv):
    from lightning_nb.cli import build_parser, resolve_device_settings

    return resolve_device_settings(build_parser().parse_args(list(argv)))


def test_cpu_defaults_are_unchanged():
    import dataclasses

    from lightning_nb.cli import DemoSettings, build_parser

    assert _resolved("demo") == CPU
    assert _resolved("demo", "--device", "cpu") == CPU
    assert _resolved("eval") == {"dtype": "float32", "runners": 16}
    # the same numbers as DemoSettings' defaults (run_demo's settings): the CPU demo runs as before; the micro-batch is left to the
    # trainer config (None: not passed) unless set
    defaults = {f.name: f.default for f in dataclasses.fields(DemoSettings)}
    assert {k: defaults[k] for k in CPU} == CPU and defaults["micro_batch_size"] is None
    assert build_parser().parse_args(["demo"]).micro_batch_size is None


@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_cuda_takes_one_gpus_defaults_where_the_user_set_nothing(device):
    assert _resolved("demo", "--device", device) == CUDA
    assert _resolved("eval", "--device", device) == {"dtype": "bfloat16", "runners": 64}


def test_an_explicit_flag_always_wins():
    got = _resolved("demo", "--device", "cuda", "--runners", "8", "--dtype", "float32", "--no-gradient-checkpointing")
    assert got == {**CUDA, "runners": 8, "dtype": "float32", "gradient_checkpointing": False}
    got = _resolved("demo", "--device", "cuda", "--tasks-per-step", "2", "--group-size", "3")
    assert got == {**CUDA, "tasks_per_step": 2, "group_size": 3}
    # a value equal to the cpu default is still the user's: not replaced on cuda
    assert _resolved("demo", "--device", "cuda", "--runners", "16")["runners"] == 16
    # and on cpu the GPU-side choices are taken when asked for
    assert _resolved("demo", "--gradient-checkpointing", "--dtype", "bfloat16") == {
        **CPU, "gradient_checkpointing": True, "dtype": "bfloat16"}
    assert _resolved("eval", "--device", "cuda", "--dtype", "float32", "--runners", "2") == {
        "dtype": "float32", "runners": 2}


@pytest.mark.parametrize("argv, message", [
    (["demo", "--dtype", "float16"], "argument --dtype: invalid choice: 'float16'"),
    (["demo", "--micro-batch-size", "0"], "--micro-batch-size must be >= 1, got 0"),
    (["demo", "--runners", "0"], "--runners must be >= 1, got 0"),
    (["demo", "--device", "gpu"], "--device='gpu' must be 'cpu' (the default), 'cuda' or 'cuda:N'"),
    (["eval", "--device", "tpu"], "--device='tpu' must be 'cpu' (the default), 'cuda' or 'cuda:N'"),
    (["eval", "--gradient-checkpointing"], "unrecognized arguments: --gradient-checkpointing"),  # no backward in eval
])
def test_bad_device_options_exit_2_naming_the_flag(capsys, argv, message):
    from lightning_nb.cli import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    out = capsys.readouterr()
    assert exc.value.code == 2 and message in out.err
    assert "loading SmolLM2" not in out.out  # refused before anything loads


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the request would be valid")
@pytest.mark.parametrize("command", ["demo", "eval"])
def test_a_cuda_request_without_cuda_fails_fast_naming_device(command):
    """As a user runs it: exit 2 naming --device and the fix, before any model loads (no 'loading' line, and
    quicker than a model load)."""
    import time

    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "lightning_nb", command, "--device", "cuda"], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "--device='cuda' but torch.cuda.is_available() is False on this machine" in proc.stderr
    assert "use 'cpu'" in proc.stderr and "Traceback" not in proc.stderr
    assert "loading SmolLM2" not in proc.stdout and time.monotonic() - t0 < 60


def test_the_resolved_settings_are_printed_with_what_the_user_set(capsys):
    from lightning_nb.cli.commands import _device_settings, build_parser

    settings = _device_settings(build_parser().parse_args(["demo", "--runners", "8", "--dtype", "bfloat16"]))
    assert settings == {**CPU, "runners": 8, "dtype": "bfloat16"}
    assert capsys.readouterr().out == ("[lightning-nb] device cpu: dtype bfloat16, gradient checkpointing off, tasks "
                                       "per step 4, group size 4, runners 8 (cpu defaults; set on the command line: "
                                       "--dtype --runners)\n")
    _device_settings(build_parser().parse_args(["demo", "--micro-batch-size", "16"]))
    assert "runners 16, micro batch size 16 (cpu defaults; set on the command line: --micro-batch-size)" in \
        capsys.readouterr().out


def _make_demo(*assignments, env=None):
    """The commands `make -n demo ...` would run (sub-makes print theirs too: -n passes down)."""
    import os

    proc = subprocess.run(["make", "-n", "demo", *assignments], capture_output=True, text=True, cwd=ROOT, timeout=60,
                          env={**{k: v for k, v in os.environ.items() if k not in ("ENGINE", "DEVICE", "DTYPE")},
                               **(env or {})})
    assert proc.returncode == 0, proc.stderr
    return " ".join(proc.stdout.replace("\\\n", " ").split())


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_demo_passes_device_and_dtype_through():
    plain = _make_demo()
    assert "-m lightning_nb demo --steps 16 --seed 0 --out runs/demo --engine vllm --device cpu" in plain
    assert "--dtype" not in plain and "setup-vllm" in plain  # unchanged: cpu, vLLM, the CLI's dtype
    gpu = _make_demo("DEVICE=cuda")
    assert "--engine transformers --device cuda" in gpu and "--dtype" not in gpu
    assert "setup-vllm" not in gpu  # the GPU machine has no vllm: no vLLM venv is set up for it
    assert "--engine transformers --device cuda:1 --dtype float32 --trainer verl" in _make_demo(
        "DEVICE=cuda:1", "DTYPE=float32", "ARGS=--trainer verl")
    assert "--engine vllm --device cuda" in _make_demo("DEVICE=cuda", "ENGINE=vllm")  # a given ENGINE wins
    assert "--engine vllm --device cuda" in _make_demo("DEVICE=cuda", env={"ENGINE": "vllm"})


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("trainer", ["grpo", "verl"])
def test_demo_on_cuda_trains_with_one_gpus_defaults(tmp_path, trainer):
    """`python -m lightning_nb demo --device cuda`, one short step on the in-process engine: bf16 and gradient
    checkpointing reach the trainer (summary.json), sizes kept small by explicit flags."""
    if trainer == "verl":
        pytest.importorskip("verl", reason="--trainer verl needs the [verl] or [gpu] extra")
    out = tmp_path / "demo"
    cmd = [sys.executable, "-m", "lightning_nb", "demo", "--device", "cuda", "--engine", "transformers",
           "--trainer", trainer, "--steps", "1", "--val-size", "4", "--ood-size", "0", "--tasks-per-step", "2",
           "--group-size", "4", "--runners", "8", "--max-tokens", "24", "--sample-rounds", "1", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[lightning-nb] device cuda: dtype bfloat16, gradient checkpointing on" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert {k: summary[k] for k in ("device", "dtype", "gradient_checkpointing", "runners", "group_size")} == {
        "device": "cuda", "dtype": "bfloat16", "gradient_checkpointing": True, "runners": 8, "group_size": 4}
    assert pd.read_csv(out / "metrics.csv")["step"].tolist() == [1]
