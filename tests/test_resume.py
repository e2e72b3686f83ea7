"""Exact resume: a run saved at step N and continued in a new process is the run that would have happened.

Each run is its own process (``tests/_resume_run.py``) on the real SmolLM2-135M, with one
runner so the engine decodes one request at a time: sampling then draws from the torch
RNG in a fixed order, and on CPU every number is reproducible bit for bit.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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
    """Pauses (with a save while paused inside step N+1) change nothing, and that checkpoint is the one the
    uninterrupted run saved after step N, so it continues the run as that one does."""
    result, straight_ckpt = straight
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
    # step N's (the state at the start of step N+1), so a run continued from it redoes step N+1 as the
    # uninterrupted run did. Saving the state as it was at the pause would hold the sampler and RNG states after
    # step N+1's draws (and the next tasks would be drawn). So it equals, entry for entry, the checkpoint the
    # uninterrupted run saved after step N (whose continuation in a new process is bit for bit the run's,
    # test_save_load_in_a_new_process_continues_bit_for_bit): weights, AdamW state, update count, the torch /
    # numpy / Python RNG states, the task sampler, the step counter and metrics rows. Only wall-clock readings in
    # the rows differ, and the store's id of the proxy's resources (a new random id in each process, which load
    # only records as algo.checkpoint_resources_id).
    differences = _differences(_load(straight_ckpt), _load(ckpt))
    allowed = [p for p in differences
               if p == ("resources_id",) or p[:2] == ("algorithm", "metrics") and p[-1] in WALL_CLOCK]
    assert differences == allowed, sorted({p[:2] for p in differences if p not in allowed}, key=str)
    ckpt.unlink()


# the metrics-row entries that are wall-clock measurements (they differ between any two runs)
WALL_CLOCK = {"rollout_seconds", "step_seconds", "update_seconds", "tokens_per_s", "seconds", "time"}


def _load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)  # mmap: 1.6 GB each, read as compared


def _differences(a, b, path: tuple = ()) -> list[tuple]:
    """The paths (keys / indices) at which two checkpoint dicts differ: tensors by ``torch.equal`` (and dtype),
    NaN equal to NaN, a differing set of keys or length as one difference at its container."""
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [path + ("<keys>",)]
        return [d for k in a for d in _differences(a[k], b[k], path + (k,))]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [path + ("<len>",)]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, path + (i,))]
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b))
    else:
        same = a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))
    return [] if same else [path]
