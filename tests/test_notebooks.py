"""Every notebook runs top to bottom with small parameters (LIGHTNING_NB_SMOKE=1)."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
# what each notebook's outputs must contain (text, or a MIME type among the outputs' data)
EXPECTED = {
    "01_quickstart.ipynb": ["held-out reward before training", "held-out reward after training",
                            "'paused'",  # algo.state shown after pause()
                            "checkpoint.pt (",  # the save cell printed the checkpoint's path and size
                            "<b>Reward by ops</b>"],  # evaluate(by="ops")'s per-slice table rendered as HTML
    "02_widgets.ipynb": ["application/vnd.jupyter.widget-view+json",  # the dashboard
                         "'running'", "InMemoryStore</b>", "RunnerGroup</b>"],  # algo.state and the HTML reprs
    "03_inspect_and_steer.ipynb": ["<b>Preflight</b>",  # algo.preflight()'s report rendered as HTML
                                   "'paused'",  # algo.state after pause()
                                   "max_abs_logprob_diff", "<b>Last batch</b>",  # last_batch_df and last_batch_html
                                   "LLM calls in",  # the token-fidelity audit's count of checked calls
                                   "learning_rate 2e-05 → 1e-05",  # metrics' config_changes records the edit
                                   "loaded: step 2"],  # algo.load() with a fresh trainer continued the saved step
    "04_verl_trainer.ipynb": ["paused at step boundary:",  # algo.pause() parked the background loop
                              "verl metrics: actor/",  # metrics_df() has verl's own metric names
                              "<b>Last batch</b>",  # last_batch_html()
                              "loaded: step 2"],  # algo.load(folder) with a fresh trainer found global_step_2
    "05_any_agent.ipynb": ["shapes on one store:",  # the spans of the four agent shapes in one DataFrame
                           "'langgraph'", "'gym'", "'remote'", "'function'",  # each shape made spans
                           "training step 1:", "'turn_forks'"],  # one GRPO step on all four
    "06_prompts_judges_traffic.ipynb": ["held-out reward: start",  # APO's best() against the starting prompt
                                        "versions of 'calc'",  # the winner published as a new resources version
                                        "judge spans: 3",  # judge_reward recorded one judge span per summary
                                        "'undone': True"],  # the traffic update, then undo()
    "07_replay_and_branch.ipynb": ["yesterday's run:", "<b>episode ",  # the stored run; Episode's HTML view
                                   "what-if:",  # the groups' change of signal under the new reward
                                   "replayed exactly: True",  # the replay reached the same tokens
                                   "branches of", "'branch_groups': 1"],  # branch(); one step on branch groups
    "08_your_task.ipynb": ["| reward of the answer: 1.0 | of a wrong one: 0.0",  # the family's reward, no model
                           "held-out reward before training:", "held-out reward after training:",
                           "gain: ", "(paired s.e.)",
                           "<b>Reward by num_candidates</b>"],  # evaluate(by=...) on the family's slice field
}
# Issue 53: a wait in a notebook shows its live line at once, without progress=True. The first frame of each bar is
# a widget output whose text/plain these read: what it waits for and how far it is.
LIVE_LINES = {
    "05_any_agent.ipynb": ["rollouts:   0%",  # store.wait_for_rollouts(ids): the finished rollouts...
                           " running]",  # ...and, after the time, how many of the others are queued and running
                           "0/? rollouts ["],  # algo.step(): the step's bar, its phase from the first frame
    "06_prompts_judges_traffic.ipynb": ["training: ",  # apo.wait(): the rounds' bar...
                                        "steps [00:00, step 1 · ",  # ...with the loop's step and phase after the time
                                        "training to step 1: "],  # learner.wait(until_step=1)
}
# what a healthy smoke run never shows: a stall warning (issue 53: APO's held-out rollouts that all finish together
# after a minute are its pace, not a stall)
NEVER = {"06_prompts_judges_traffic.ipynb": ["WaitWarning"]}
# notebooks written by a script: notebooks/make_<notebook name>.py writes notebooks/<notebook name>.ipynb (its OUT)
GENERATORS = sorted((ROOT / "notebooks").glob("make_*.py"))
BIG_FILE = 10_000_000  # bytes: a smoke run may leave small temp files, never a checkpoint (~1.6 GB)


def test_the_your_task_page_shows_the_notebooks_task_family_cell_as_it_runs(monkeypatch):
    """docs/your-task.md's first code block is notebook 08's task-family cell, which the suite executes."""
    import re

    monkeypatch.syspath_prepend(str(ROOT / "notebooks"))  # notebooks/_nbgen.py
    spec = importlib.util.spec_from_file_location("make_08", ROOT / "notebooks" / "make_08_your_task.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    block = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "your-task.md").read_text(), re.S)[0].strip()
    assert block in [source.strip() for kind, source in module.CELLS if kind == "code"]


def test_every_notebook_has_expectations():
    assert sorted(EXPECTED) == [p.name for p in NOTEBOOKS]


@pytest.mark.parametrize("generator", GENERATORS, ids=[p.name for p in GENERATORS])
def test_notebook_is_what_its_generator_writes(generator, monkeypatch):
    """Generated notebooks (02_widgets, 03_inspect_and_steer, 04_verl_trainer) are committed without outputs: edit
    the generator notebooks/make_*.py and rerun it, never the .ipynb."""
    monkeypatch.syspath_prepend(str(generator.parent))  # as `python notebooks/make_*.py` has it: notebooks/_nbgen.py
    spec = importlib.util.spec_from_file_location(generator.stem, generator)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.OUT.parent == generator.parent and module.OUT.name in EXPECTED
    committed = json.loads(module.OUT.read_text())
    from _nbgen import build_notebook

    assert committed == json.loads(nbformat.writes(build_notebook(module.CELLS))), \
        f"run `python notebooks/{generator.name}` to regenerate notebooks/{module.OUT.name}"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_executes(path, monkeypatch, tmp_path):
    monkeypatch.setenv("LIGHTNING_NB_SMOKE", "1")
    # The kernel's tempfile.mkdtemp() lands here (the quickstart saves its smoke checkpoint to one), so this test
    # can check that the notebook removed what it wrote, and removes it itself whatever happened.
    kernel_tmp = tmp_path / "kernel_tmp"
    kernel_tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(kernel_tmp))
    full_run_checkpoint = ROOT / "runs" / "quickstart" / "checkpoint.pt"  # where a full (not smoke) run saves
    before = full_run_checkpoint.stat().st_mtime_ns if full_run_checkpoint.exists() else None
    nb = nbformat.read(path, as_version=4)
    try:
        NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
        left = [p for p in kernel_tmp.rglob("*") if p.is_file() and p.stat().st_size > BIG_FILE]
        assert not left, f"{path.name} left large files behind: {left}"
    finally:
        shutil.rmtree(kernel_tmp, ignore_errors=True)
    after = full_run_checkpoint.stat().st_mtime_ns if full_run_checkpoint.exists() else None
    assert after == before, f"{path.name} wrote {full_run_checkpoint} in a smoke run"
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    text = "\n".join(str(o.get("text", "")) + "".join(f"{k}\n{v}" for k, v in o.get("data", {}).items())
                     for o in outputs)
    for expected in EXPECTED[path.name] + LIVE_LINES.get(path.name, []):
        assert expected in text, f"{path.name}: no {expected!r} in the outputs"
    for unexpected in NEVER.get(path.name, []):
        assert unexpected not in text, f"{path.name}: {unexpected!r} in the outputs"
    # a judge configuration's failures warn once, however many Judge objects the agent made (one per call)
    assert text.count("gave no score") <= 1, f"{path.name}: more than one judge-failure warning"
