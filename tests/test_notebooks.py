"""Every notebook runs top to bottom with small parameters (LIGHTNING_NB_SMOKE=1)."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
# what each notebook's outputs must contain (text, or a MIME type among the outputs' data)
EXPECTED = {
    "01_quickstart.ipynb": ["held-out reward before training", "held-out reward after training",
                            "'paused'"],  # trainer.state shown after pause()
    "02_widgets.ipynb": ["application/vnd.jupyter.widget-view+json",  # the dashboard
                         "'running'", "InMemoryStore</b>", "RunnerGroup</b>"],  # trainer.state and the HTML reprs
}


def test_every_notebook_has_expectations():
    assert sorted(EXPECTED) == [p.name for p in NOTEBOOKS]


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_executes(path, monkeypatch):
    monkeypatch.setenv("LIGHTNING_NB_SMOKE", "1")
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    text = "\n".join(str(o.get("text", "")) + "".join(f"{k}\n{v}" for k, v in o.get("data", {}).items())
                     for o in outputs)
    for expected in EXPECTED[path.name]:
        assert expected in text, f"{path.name}: no {expected!r} in the outputs"
