"""Repository hygiene: environment.yml agrees with pyproject, notebooks are committed clean, docs are right."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def _pyproject_requirements() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = set(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        reqs |= {r for r in extra if not r.startswith("lightning-nb")}
    return reqs


def test_environment_yml_mirrors_pyproject():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    assert {r for r in pip if not r.startswith("-e")} == _pyproject_requirements()


def test_notebooks_are_committed_without_outputs():
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        nb = json.loads(path.read_text())
        for cell in nb["cells"]:
            if cell["cell_type"] == "code":
                assert cell["outputs"] == [] and cell["execution_count"] is None, f"{path.name} has outputs"


def test_readme_commands_are_the_ones_ci_and_make_use():
    readme = (ROOT / "README.md").read_text()
    assert "make demo" in readme and "make test" in readme
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^demo: setup", makefile, re.M) and re.search(r"^test: setup", makefile, re.M)


def test_cli_help_documents_demo():
    out = subprocess.run([sys.executable, "-m", "lightning_nb", "demo", "--help"], capture_output=True,
                         text=True, check=True, cwd=ROOT).stdout
    for flag in ("--steps", "--out", "--group-size", "--val-size"):
        assert flag in out


def test_library_does_not_import_ui_packages():
    for path in (ROOT / "lightning_nb").rglob("*.py"):
        text = path.read_text()
        for ui in ("ipywidgets", "anywidget", "plotly", "IPython"):
            assert not re.search(rf"^\s*(import|from) {ui}\b", text, re.M), f"{path} imports {ui}"


def test_readme_example_names_exist():
    import lightning_nb

    readme = (ROOT / "README.md").read_text()
    block = readme.split("```python", 1)[1].split("```", 1)[0]
    for name in re.findall(r"from lightning_nb import ([\w, ]+)", block):
        for n in name.split(","):
            assert hasattr(lightning_nb, n.strip()), n
