"""Repository hygiene: environment.yml agrees with pyproject, notebooks are committed clean, docs are right."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


def _pyproject_requirements() -> set[str]:
    """Every requirement of pyproject but the [gpu] extra's (environment.yml is the CPU environment)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = set(project["dependencies"])
    for name, extra in project["optional-dependencies"].items():
        if name != "gpu":
            reqs |= {r for r in extra if not r.startswith("lightning-nb")}
    return reqs


def test_environment_yml_mirrors_pyproject():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    assert {r for r in pip if not r.startswith("-e")} == _pyproject_requirements()


def _name(requirement: str) -> str:
    """The distribution name of a requirement string: ``"verl[vllm]==0.9.1"`` -> ``"verl"``."""
    return re.split(r"[\[<>=!~; ]", requirement, maxsplit=1)[0].lower()


def test_verl_is_an_extra_not_a_core_dependency():
    """verl (and what it pins: transformers < 5.11, ray, hydra) stays out of `pip install lightning-nb`; the [verl]
    and [gpu] extras bring it for VerlTrainer, and [dev] for CI (tests/test_advantages.py compares with it).
    tests/test_install_core.py installs the core alone and trains one step."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert "verl" not in {_name(r) for r in project["dependencies"]}
    for extra in ("verl", "gpu"):
        assert "verl" in {_name(r) for r in extras[extra]}, extra
    dev_includes = {e.strip() for r in extras["dev"] if r.startswith("lightning-nb[")
                    for e in r.split("[", 1)[1].split("]")[0].split(",")}
    assert "verl" in dev_includes
    assert re.search(r"^verl==", (ROOT / "constraints.txt").read_text(), re.M), "constraints.txt pins verl's tested version"


def test_grpo_trainer_never_imports_verl():
    """GRPOTrainer's math is its own (lightning_nb/credit/normalize.py, trainers/grpo/losses.py): no module of the
    GRPO trainer imports verl, not even inside a function, so it trains where verl is not installed (the shared
    modules it uses: tests/test_trainer_imports.py)."""
    for path in sorted((ROOT / "lightning_nb" / "trainers" / "grpo").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            bad = [n for n in names if n.split(".")[0] == "verl"]
            assert not bad, f"{path.relative_to(ROOT)}:{node.lineno} imports {bad[0]}"


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
    for target, command in (("demo", "-m lightning_nb demo"), ("test", "-m pytest")):
        recipe = re.search(rf"^{target}:.*\n((?:\t.*\n)+)", makefile, re.M)
        assert recipe, f"the Makefile has no {target} target with a recipe"
        lines = recipe.group(1).splitlines()
        # set-up first (both venvs side by side: $(MAKE) -j2 setup ...), then the command itself
        assert "$(MAKE) -j2 setup" in lines[0] and command in lines[-1], lines


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


def _readme_python_blocks() -> list[str]:
    """The ```python blocks of README.md and of the manual's pages (docs/*.md), where the longer examples moved."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return [b for p in pages for b in re.findall(r"^```python\n(.*?)^```", p.read_text(), re.S | re.M)]


def _ten_lines_block() -> str:
    readme = (ROOT / "README.md").read_text()
    m = re.search(r"^## Ten lines\n+```python\n(.*?)^```", readme, re.S | re.M)
    assert m, "README.md has no ```python block right under '## Ten lines'"
    return m.group(1)


def test_every_public_name_imports():
    """Everything in lightning_nb.__all__ exists, and `from lightning_nb import *` works."""
    import lightning_nb

    assert len(set(lightning_nb.__all__)) == len(lightning_nb.__all__)
    missing = [n for n in lightning_nb.__all__ if not hasattr(lightning_nb, n)]
    assert not missing, f"lightning_nb.__all__ lists names it does not define: {missing}"
    namespace: dict = {}
    exec("from lightning_nb import *", namespace)
    assert set(lightning_nb.__all__) <= set(namespace)
    for name in ("SqliteStore", "StoreServer", "StoreClient", "Tracer", "RolloutConfig"):  # documented in docs/stores.md
        assert name in lightning_nb.__all__, name


def test_readme_python_blocks_parse_and_their_lightning_nb_imports_exist():
    """Fast check (no model): every python block of README.md and docs/*.md compiles and its
    `from lightning_nb... import` names exist."""
    import importlib

    blocks = _readme_python_blocks()
    assert blocks and _ten_lines_block() in blocks
    checked = 0
    for block in blocks:
        for node in ast.walk(ast.parse(block)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "lightning_nb":
                module = importlib.import_module(node.module)
                for alias in node.names:
                    assert hasattr(module, alias.name), f"README: {node.module} has no {alias.name}"
                    checked += 1
    assert checked >= 9  # the ten-line example alone imports 9 names


# (old text, small replacement): each must occur exactly once in the README's ten-line example, so a README edit
# that changes these sizes makes the test below fail loudly instead of silently training 10 full steps.
TEN_LINES_SMALL = [
    ("steps=10)", "steps=1)"),
    ("n=8)", "n=2)"),
    ("config=AlgorithmConfig()",
     "config=AlgorithmConfig(tasks_per_step=1, group_size=2, max_tokens=16, max_sample_rounds=1)"),
]


@pytest.mark.slow
def test_readme_ten_lines_example_trains_one_step():
    """Execute the README's "Ten lines" block for real (SmolLM2-135M, ~1 min) with small sizes."""
    code = _ten_lines_block()
    for old, new in TEN_LINES_SMALL:
        assert code.count(old) == 1, f"README ten-line example: expected {old!r} exactly once"
        code = code.replace(old, new)
    ns: dict = {"__name__": "readme_ten_lines"}
    try:
        exec(compile(code, "README.md:ten-lines", "exec"), ns)
        algo = ns["algo"]
        algo.wait(timeout=600)
        assert algo.state == "finished", (algo.state, algo.error)
        assert algo.global_step == 1
        metrics = algo.metrics_df()
        assert len(metrics) == 1 and metrics["step"].tolist() == [1]
        assert metrics["rollouts"].iloc[0] == 2 and metrics["transitions"].iloc[0] >= 1  # one group of 2
    finally:
        # clean up whatever the block got to create, even if it failed half-way
        for name in ("algo", "runners", "proxy", "engine"):
            if name in ns:
                ns[name].stop()
