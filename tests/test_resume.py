"""Exact resume: a run saved at step N and continued in a new process is the run that would have happened.

Each run is its own process (``tests/_resume_run.py``) on the real SmolLM2-135M, with one
runner so the engine decodes one request at a time: sampling then draws from the torch
RNG in a fixed order, and on CPU every number is reproducible bit for bit.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("_resume_run.py")
N = 1  # steps before the checkpoint, and after it


def _run(tmp_path: Path, name: str, *args: str) -> dict:
    out = tmp_path / f"{name}.json"
    proc = subprocess.run([sys.executable, str(WORKER), str(out), *args], capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """2N steps in one process, saving a checkpoint after step N (saving must not change the run)."""
    tmp = tmp_path_factory.mktemp("resume")
    ckpt = tmp / "ckpt.pt"
    result = _run(tmp, "straight", "--steps", str(2 * N), "--save-at", str(N), "--checkpoint", str(ckpt))
    yield result, ckpt
    ckpt.unlink(missing_ok=True)


def test_save_load_in_a_new_process_continues_bit_for_bit(straight, tmp_path):
    result, ckpt = straight
    assert [r["step"] for r in result["rows"]] == list(range(1, 2 * N + 1))
    assert result["rows"][N]["tokens_trained"], "the step after the checkpoint trained nothing: comparing it " \
        "would not test the resumed update"
    resumed = _run(tmp_path, "resumed", "--steps", str(2 * N), "--load", str(ckpt))
    # the same per-step losses, gradient norms and rewards (bitwise on CPU), so the same tasks were
    # sampled (task sampler state), the same completions drawn (torch RNG state) and the same update made
    # (weights + AdamW state), and the same final weights
    assert resumed["rows"] == result["rows"][N:]
    assert resumed["weights"] == result["weights"]
    assert resumed["weight_version"] == result["weight_version"]


def test_pause_and_resume_at_step_boundaries_equal_an_uninterrupted_run(straight, tmp_path):
    """Pauses (with a save while paused inside step N+1) change nothing, and that checkpoint continues the run."""
    result, _ = straight
    ckpt = tmp_path / "mid-step.pt"
    paused = _run(tmp_path, "paused", "--steps", str(2 * N), "--pauses", "--save-at", str(N),
                  "--checkpoint", str(ckpt))
    assert len(paused["pauses"]) >= 2, paused["pauses"]
    assert all(p["at"] and p["chat"] for p in paused["pauses"]), paused["pauses"]
    assert paused["rows"] == result["rows"]
    assert paused["weights"] == result["weights"]
    saved = [p for p in paused["pauses"] if p.get("saved")]
    assert [(p["step"], p["at"]) for p in saved] == [(N, "before update")], paused["pauses"]
    # Saved after step N+1 drew its tasks and sampled its completions, before its update: the checkpoint is
    # step N's (the state at the start of step N+1), so the continued run redoes step N+1 as the
    # uninterrupted run did. Saving the state as it was at the pause would draw the next tasks instead.
    resumed = _run(tmp_path, "resumed-mid-step", "--steps", str(2 * N), "--load", str(ckpt))
    assert resumed["rows"] == result["rows"][N:]
    assert resumed["weights"] == result["weights"]
