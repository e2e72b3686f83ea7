"""Issue 53, item 1: every wait shows its live line at once in a notebook kernel and stays quiet in a script unless
asked; the stall warning waits for the wait's own pace; a step's bar keeps one total and one clock across its sample
rounds; the stall advice matches the state.

The kernel is a real one (nbclient executing a small notebook), the script a real subprocess, the agents real
functions that return a reward after a short sleep, without a model (none is needed to wait for them).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from lightning_nb import AlgorithmConfig, GRPOConfig, GRPOTrainer, InMemoryStore, LightningRL
from lightning_nb._notebook import in_kernel, show_progress
from lightning_nb.algorithm.base import Algorithm
from lightning_nb.errors import WaitWarning

ROOT = Path(__file__).resolve().parents[1]

SETUP = """
import time, warnings
from lightning_nb import InMemoryStore, start_runners
from lightning_nb.algorithm import Algorithm
from lightning_nb.types import LLMResource
warnings.filterwarnings("ignore", message="start_runners: the LLM endpoint")  # the agent never calls it
store = InMemoryStore()
store.add_resources({"main_llm": LLMResource(endpoint="http://127.0.0.1:9/v1", model="m")})
def agent(task, llm):
    time.sleep(0.3)
    return 1.0
agent.calls_model = False  # it never calls the (dead) endpoint: the runners must not hold the queue for it
class NoConfig:
    def validate(self):
        pass
class Batches(Algorithm):
    \"\"\"Each step enqueues 4 rollouts and waits for them, reporting its progress as LightningRL does.\"\"\"
    def __init__(self, store):
        super().__init__(store, None, NoConfig())
    def run(self, steps):
        for _ in range(steps):
            self.step()
    def step(self):
        self.at_boundary("before collect")
        ids = [r.rollout_id for r in self.store.enqueue_rollouts(range(4))]
        step = self.global_step + 1
        self.wait_for(ids, on_progress=lambda d, t: self.report_progress("rollouts", d, t, unit="rollouts", step=step))
        return self.record({})
    state_dict = load_state_dict = save = load = None
runners = start_runners(agent, store, n=2)
"""
# one cell each; {progress}: "" (the default) or ", progress=True"
CELLS = [
    "ids = [store.enqueue_rollout(i).rollout_id for i in range(6)]\n"
    "done = store.wait_for_rollouts(ids, timeout=60{progress})",
    "algo = Batches(store).start(steps=2)\nassert algo.wait(timeout=60{progress})",
    "quiet = Batches(store).start(steps=1)\nassert quiet.wait(timeout=60, progress=False)",
    "runners = start_runners(agent, store, n=2)  # the cell run again",
    "print('done')",
]


def _widget_texts(output) -> str:
    return output.get("data", {}).get("text/plain", "") if "application/vnd.jupyter.widget-view+json" in \
        output.get("data", {}) else ""


def test_waits_show_their_live_line_at_once_in_a_kernel():
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(SETUP)]
                                  + [nbformat.v4.new_code_cell(c.format(progress="")) for c in CELLS])
    NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
    outs = [c.outputs for c in nb.cells[1:]]
    assert not [o for cell in outs for o in cell if o.get("output_type") == "error"]
    bars = [[_widget_texts(o) for o in cell if _widget_texts(o)] for cell in outs]
    # store.wait_for_rollouts: the bar at once, with the rollouts' queue as its live line
    assert len(bars[0]) == 1 and re.search(r"rollouts: .*0/6 .*\d queued, \d running", bars[0][0]), bars[0]
    # algo.wait(): the steps' bar at once, the loop's step and phase after its time
    assert len(bars[1]) == 1 and re.search(r"training: .*/2 steps .*step 1 · ", bars[1][0]), bars[1]
    assert bars[2] == []  # progress=False is honoured in a kernel too
    # a re-run's replacement: a plain line on stdout, no warning on stderr
    streams = {o.get("name"): o.get("text", "") for o in outs[3] if o.get("output_type") == "stream"}
    assert "start_runners: stopped the previous group of 2 runner(s)" in streams.get("stdout", ""), outs[3]
    assert "stderr" not in streams, streams
    # the bars' last frames (the widgets' saved state): both counts reached their end
    widgets = nb.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"].values()
    state = "\n".join(str(w["state"].get("value", "")) for w in widgets).replace("\u2007", " ")
    assert re.search(r"6/6 \[.*0 queued, 0 running\]", state) and "2.00/2 steps" in state, state


def _script(progress: str, tmp_path: Path) -> subprocess.CompletedProcess:
    path = tmp_path / "waits.py"
    path.write_text(SETUP + "\n".join(c.format(progress=progress) for c in CELLS) + "\nrunners.stop()\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=120, env=env,
                          cwd=tmp_path)


def test_waits_stay_quiet_in_a_script_unless_asked(tmp_path):
    quiet = _script("", tmp_path)
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stdout == "done\n" and quiet.stderr == "", (quiet.stdout, quiet.stderr)  # no bar, no line
    asked = _script(", progress=True", tmp_path)
    assert asked.returncode == 0, asked.stderr
    frames = re.split(r"[\r\n]+", asked.stderr)
    assert any(re.search(r"rollouts: .*\| 0/6 .*queued, \d running\]", f) for f in frames), asked.stderr
    assert any(re.search(r"rollouts: .*\| 6/6 ", f) for f in frames), asked.stderr
    assert any(re.search(r"training: .*\| 0.00/2 steps .*step 1 · ", f) for f in frames), asked.stderr
    assert any(re.search(r"training: .*\| 2.00/2 steps", f) for f in frames), asked.stderr
    assert not any("step 1 · " in f and "training" not in f for f in frames)  # progress=False stayed quiet


def test_show_progress_honours_what_the_user_set():
    assert not in_kernel()  # pytest is a script
    assert show_progress(True) is True and show_progress(False) is False and show_progress(None) is False
    seen = []
    worker = threading.Thread(target=lambda: seen.append(show_progress(True)))
    worker.start()
    worker.join()
    assert seen == [True]  # asked for, a bar shows from any thread


class _Paced(Algorithm):
    """A step reports ``units`` moves ``gap_s`` apart; then, in step ``stall_at``, it stops moving for ``stall_s``."""

    def __init__(self, units: int, gap_s: float, stall_at: int, stall_s: float):
        super().__init__(None, None, _NoConfig())
        self.units, self.gap_s, self.stall_at, self.stall_s = units, gap_s, stall_at, stall_s

    def run(self, steps):
        for _ in range(steps):
            self.step()

    def step(self):
        self.at_boundary("before collect")
        for done in range(self.units + 1):
            self.report_progress("rollouts", done, self.units, unit="rollouts", step=self.global_step + 1)
            time.sleep(self.stall_s if (self.global_step + 1, done) == (self.stall_at, 1) else self.gap_s)
        return self.record({})

    state_dict = load_state_dict = save = load = None


class _NoConfig:
    def validate(self):
        pass


def test_the_stall_warning_waits_for_the_waits_own_pace_and_says_it():
    """Issue 53: a healthy APO run (rollouts that all finish together after a minute) warned 'no progress for 60 s'.
    Here the loop moves every 0.4 s with ``stall_s=0.25``: a wait that measured its pace stays quiet, and warns once
    the loop stops for more than 3 × 0.4 s (before it saw a move, it gives the loop 3 × ``stall_s``)."""
    algo = _Paced(units=3, gap_s=0.4, stall_at=2, stall_s=3.0).start(steps=2)
    t0 = time.monotonic()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert algo.wait(timeout=60, progress=False, stall_s=0.25) is True
    finally:
        algo.stop(timeout=10)
    told = [w for w in caught if issubclass(w.category, WaitWarning)]
    assert len(told) == 1, [str(w.message) for w in told]  # the 3 s stop, not each 0.4 s gap
    message = str(told[0].message)
    m = re.match(r"_Paced\.wait\(\): still waiting, no progress for (\d\.\d) s \(before, at most (0\.\d) s between "
                 r"two moves\)\. Waiting at: step 2 · rollouts 1/3\.$", message)
    assert m, message
    assert 1.2 <= float(m.group(1)) < 3.0 and 0.4 <= float(m.group(2)) < 1.0, message
    assert time.monotonic() - t0 > 5  # (the run took its time: 2 steps of 4 moves, one 3 s stop)
    # a loop that never moves: the first warning after 3 × stall_s, and it says so
    algo = _Paced(units=3, gap_s=0.4, stall_at=1, stall_s=3.0).start(steps=1)
    try:
        time.sleep(1.0)  # parked at step 1, 1/3 (the wait sees no move from its start)
        with pytest.warns(WaitWarning, match=r"still waiting, no progress for 0\.[6-9] s \(it has not moved since the "
                                             r"wait began\)\. Waiting at: step 1 · rollouts 1/3"):
            assert algo.wait(timeout=1.4, progress=False, stall_s=0.2) is False
    finally:
        algo.stop(timeout=10)


@pytest.mark.slow
def test_a_steps_bar_keeps_one_total_and_one_clock_across_sample_rounds(pristine, proxied_store, agent_with_reward,
                                                                         capsys):
    """Issue 53: the bar of ``algo.step()`` sat at 0/32 rollouts, then restarted at 46/52 with its clock reset when a
    second sample round began. Rewards all equal: no group has signal, so dynamic sampling runs its 2 rounds."""
    trainer = GRPOTrainer(pristine, GRPOConfig(track_reference_kl=False))
    algo = LightningRL(proxied_store, trainer, [{"id": str(i), "question": f"{i} + 1?"} for i in range(8)],
                       config=AlgorithmConfig(tasks_per_step=1, group_size=2, max_tokens=2, max_sample_rounds=2))
    from lightning_nb import start_runners

    with start_runners(agent_with_reward([0.5]), proxied_store, n=2):
        row = algo.step(progress=True)
    assert row["sample_rounds"] == 2
    frames = [f for f in re.split(r"[\r\n]+", capsys.readouterr().err)
              if f.startswith("step 1: rollouts") and re.search(r"\| \d+/\d+ rollouts", f)]
    counts = [tuple(map(int, re.search(r"\| (\d+)/(\d+) rollouts", f).groups())) for f in frames]
    clocks = [re.search(r"\[(\d\d):(\d\d)", f).groups() for f in frames]
    seconds = [60 * int(m) + int(s) for m, s in clocks]
    assert counts[0] == (0, 2) and counts[-1] == (4, 4) and {t for _, t in counts} == {2, 4}, counts
    assert counts == sorted(counts) and seconds == sorted(seconds), (counts, seconds)  # never restarted
    assert all("sample round 2" in f for f, (_, t) in zip(frames, counts) if t == 4), frames
    assert not any("sample round" in f for f, (_, t) in zip(frames, counts) if t == 2), frames
    # a script's step is quiet by default
    with start_runners(agent_with_reward([0.5]), proxied_store, n=2):
        algo.step()
    assert "step 2" not in capsys.readouterr().err


class _Sleeper(Algorithm):
    """A step that works 3.5 s without reporting, as one long micro-batch of an update on a CPU does."""

    def __init__(self):
        super().__init__(InMemoryStore(), None, _NoConfig())

    def step(self, progress=None):
        with self.step_bar(progress):
            self.report_progress("update", 0, 1, unit="micro-batches", step=1)
            time.sleep(3.5)
            self.report_progress("update", 1, 1, unit="micro-batches", step=1)
        return self.record({})

    run = state_dict = load_state_dict = save = load = None


class _NoConfig:
    def validate(self):
        pass


def test_a_steps_bar_clock_moves_while_the_step_reports_nothing(capsys):
    """Issue 53: a cell is never silent for long. The step's bar is redrawn each second by its own clock thread, so
    its time moves while the step's thread reports nothing (measured: nb05's step cell was silent 10.7 s, one
    micro-batch)."""
    _Sleeper().step(progress=True)
    frames = [f for f in re.split(r"[\r\n]+", capsys.readouterr().err) if "0/1 micro-batches" in f]
    clocks = {re.search(r"\[(\d\d:\d\d)", f).group(1) for f in frames}
    assert {"00:00", "00:01", "00:02", "00:03"} <= clocks, frames
    _Sleeper().step()  # a script: quiet by default, no clock thread drawing
    assert capsys.readouterr().err == ""


@pytest.mark.filterwarnings("ignore:start_runners. the LLM endpoint")  # the agent never calls it
def test_a_rollout_waits_bar_clock_moves_between_finishes(capsys):
    """Issue 53: ``store.wait_for_rollouts(progress=True)`` redraws each second, not only when a rollout finishes
    (nb05's wait cell at full size was silent 15.4 s between two finishes)."""
    from lightning_nb import start_runners
    from lightning_nb.types import LLMResource

    def agent(task, llm):
        time.sleep(task)
        return 1.0

    agent.calls_model = False
    store = InMemoryStore()
    store.add_resources({"main_llm": LLMResource(endpoint="http://127.0.0.1:9/v1", model="m")})
    with start_runners(agent, store, n=1):  # one runner: the first finishes at once, the second 3.5 s later
        ids = [r.rollout_id for r in store.enqueue_rollouts([0.1, 3.5])]
        done = store.wait_for_rollouts(ids, timeout=30, progress=True)
    assert [r.status for r in done] == ["succeeded"] * 2
    frames = [f for f in re.split(r"[\r\n]+", capsys.readouterr().err) if "| 1/2 " in f]
    clocks = sorted({int(m) * 60 + int(s) for m, s in (re.search(r"\[(\d\d):(\d\d)", f).groups() for f in frames)})
    assert len(clocks) >= 3 and clocks[-1] - clocks[0] >= 2, frames  # the clock moved while 1/2 stood still
