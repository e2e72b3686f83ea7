"""The shape of the code: its layers, its sizes, its one span schema, its public API and the README's module table.

These are the properties of issue 28 that a later change could silently undo, so CI checks them:

* the layers of ``.importlinter`` hold (``lint-imports``: no module imports a layer above its own, no circle);
* mypy finds no error in the contracts' packages (``lightning_nb/algorithm``, ``trainers``, ``store``:
  ``[tool.mypy]`` of pyproject.toml);
* no module over 600 lines and no function over 60 lines of code in ``lightning_nb/`` and ``widgets/``;
* no module but ``semconv.py`` writes a span attribute key (any of them), a distinctive span name, or a key's
  name from before the naming rule as a string literal;
* the widgets use only public names of ``lightning_nb``;
* the README's module table lists exactly the packages and top-level modules of ``lightning_nb``, and every
  name the README imports from ``lightning_nb`` is in ``lightning_nb.__all__``.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import lightning_nb
from lightning_nb import semconv

ROOT = Path(__file__).resolve().parents[1]
CODE = [ROOT / "lightning_nb", ROOT / "widgets"]
MAX_MODULE_LINES = 600
MAX_FUNCTION_CODE_LINES = 60
# Every attribute key has a "." (tests/test_semconv.py checks the naming rule), so every one is searched for. Span
# names are words the kit also uses otherwise ("reward" is a DataFrame column, "agent" and "judge" reward sources):
# those with a "." or a ":" are distinctive, and so is the intermediate reward's span name.
DISTINCTIVE_KEYS = {"intermediate_reward"}


def _modules() -> list[Path]:
    return sorted(p for root in CODE for p in root.rglob("*.py"))


def _docstring_nodes(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings (of the module, classes and functions)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                out.add(id(first.value))
    return out


def code_lines(lines: list[str], node: ast.AST, docstrings: set[int]) -> int:
    """Lines of code of ``node``: without docstrings, blank lines and comment-only lines."""
    doc_lines = set()
    for sub in ast.walk(node):
        if isinstance(sub, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and sub.body:
            first = sub.body[0]
            if isinstance(first, ast.Expr) and id(first.value) in docstrings:
                doc_lines.update(range(first.lineno, first.end_lineno + 1))
    return sum(1 for i in range(node.lineno, node.end_lineno + 1)
               if i not in doc_lines and lines[i - 1].strip() and not lines[i - 1].strip().startswith("#"))


def test_the_import_layers_hold():
    """``lint-imports`` keeps every contract of ``.importlinter`` (the layers, no UI import, trainers apart)."""
    lint = Path(sys.executable).with_name("lint-imports")
    assert lint.exists(), f"import-linter is not installed next to {sys.executable} (pip install -e '.[dev]')"
    run = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"lint-imports found broken contracts:\n{run.stdout}\n{run.stderr}"


def test_mypy_finds_no_error_in_the_contracts(tmp_path):
    """``python -m mypy`` over ``[tool.mypy] files`` (the algorithm, trainers and store packages): 0 errors, so an
    attribute a contract reads and nobody declares fails here (issue 51)."""
    run = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "mypy")], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert "No module named mypy" not in run.stderr, "mypy is not installed (pip install -e '.[dev]')"
    assert run.returncode == 0, f"mypy found errors:\n{run.stdout}\n{run.stderr}"


def test_no_module_or_function_is_too_long():
    """No module over 600 lines; no function over 60 lines of code (docstrings, comments, blank lines not counted)."""
    long_modules, long_functions = [], []
    for path in _modules():
        text = path.read_text()
        lines = text.splitlines()
        rel = path.relative_to(ROOT)
        if len(lines) > MAX_MODULE_LINES:
            long_modules.append(f"{rel}: {len(lines)} lines")
        tree = ast.parse(text)
        docstrings = _docstring_nodes(tree)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = code_lines(lines, node, docstrings)
                if n > MAX_FUNCTION_CODE_LINES:
                    long_functions.append(f"{rel}:{node.lineno} {node.name}: {n} lines of code")
    assert not long_modules and not long_functions, (
        f"modules over {MAX_MODULE_LINES} lines: {long_modules or 'none'}; functions over "
        f"{MAX_FUNCTION_CODE_LINES} lines of code: {long_functions or 'none'} (split them where a reader would pause)")


def _schema_values() -> dict[str, str]:
    """Every attribute key and the distinctive span names of :mod:`lightning_nb.semconv`, and the keys' names from
    before the naming rule that have a "." (``"tool.output"``...): value -> the constant to use."""
    out = {}
    for name in semconv.__all__:
        value = getattr(semconv, name)
        if isinstance(value, str) and (value in semconv.ATTRIBUTE_KEYS or "." in value or ":" in value
                                       or value in DISTINCTIVE_KEYS):
            out[value] = name
    current = {getattr(semconv, name): name for name in semconv.__all__ if isinstance(getattr(semconv, name), str)}
    for renamed in semconv.RENAMED_KEYS.values():
        out.update({old: current[new] for old, new in renamed.items() if "." in old and old not in out})
    return out


def test_the_schema_exists_and_the_check_below_has_something_to_find():
    values = _schema_values()
    assert {"llm.chat.completions", "gen_ai.prompt", "intermediate_reward", "tool:"} <= set(values)
    assert set(semconv.ATTRIBUTE_KEYS) <= set(values)  # every key, whatever it looks like
    assert {"tool.output", "reward.name", "gen_ai.request.tools"} <= set(values)  # and the old dotted names


def _all_names(tree: ast.Module) -> set[int]:
    """ids of the string constants listed in the module's ``__all__`` (names of functions, not keys)."""
    return {id(c) for node in tree.body if isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
            for c in ast.walk(node.value) if isinstance(c, ast.Constant)}


def test_span_names_and_keys_are_written_only_in_semconv():
    """No module but ``semconv.py`` has a string literal (docstrings aside) equal to a distinctive schema value."""
    values = _schema_values()
    offenders = []
    for path in _modules():
        if path == ROOT / "lightning_nb" / "semconv.py":
            continue
        tree = ast.parse(path.read_text())
        skip = _docstring_nodes(tree) | _all_names(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip \
                    and node.value in values:
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.value!r} "
                                 f"(use semconv.{values[node.value]})")
    assert not offenders, "span names or attribute keys written as literals:\n" + "\n".join(offenders)


# The rollout-metadata and resource keys several packages share: each is a constant of lightning_nb.types.
SHARED_KEYS = {"group_id": "GROUP_ID_KEY", "sampling_parameters": "SAMPLING_PARAMETERS_KEY", "main_llm": "MAIN_LLM",
               "traffic": "TRAFFIC_KEY"}


def test_rollout_metadata_and_resource_keys_are_written_only_in_types():
    """No module but ``types.py`` has a string literal (docstrings aside) equal to a shared metadata or resource key:
    one spelled twice can drift apart (``TripletAdapter(group_key=...)`` once read a key ``LightningRL`` never wrote)."""
    import lightning_nb.types as types

    assert {getattr(types, name) for name in SHARED_KEYS.values()} == set(SHARED_KEYS)
    offenders = []
    for path in _modules():
        if path == ROOT / "lightning_nb" / "types.py":
            continue
        tree = ast.parse(path.read_text())
        skip = _docstring_nodes(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip \
                    and node.value in SHARED_KEYS:
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.value!r} "
                                 f"(use lightning_nb.types.{SHARED_KEYS[node.value]})")
    assert not offenders, "shared keys written as literals:\n" + "\n".join(offenders)


def test_widgets_use_only_public_names_of_lightning_nb():
    """The widgets import no ``_private`` module or name from ``lightning_nb``."""
    private = []
    for path in sorted((ROOT / "widgets").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "lightning_nb":
                parts = node.module.split(".") + [a.name for a in node.names]
            elif isinstance(node, ast.Import):
                parts = [p for a in node.names if a.name.split(".")[0] == "lightning_nb" for p in a.name.split(".")]
            else:
                continue
            if any(p.startswith("_") for p in parts):
                private.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
    assert not private, "widgets import private names of lightning_nb:\n" + "\n".join(private)


def _readme() -> str:
    return (ROOT / "README.md").read_text()


def _module_table_rows() -> list[str]:
    """First cells (without backticks) of the README's module table, the one whose header is ``| module | what |``."""
    lines = _readme().splitlines()
    start = next((i for i, line in enumerate(lines) if re.match(r"^\|\s*module\s*\|\s*what\s*\|", line)), None)
    assert start is not None, "README.md has no module table (a table whose header is | module | what |)"
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append(line.split("|")[1].strip().strip("`"))
    return rows


def _real_modules() -> set[str]:
    """``lightning_nb``'s packages (``lightning_nb/x/``) and public top-level modules (``lightning_nb/x.py``)."""
    pkg = ROOT / "lightning_nb"
    packages = {f"lightning_nb/{p.name}/" for p in pkg.iterdir() if (p / "__init__.py").is_file()}
    modules = {f"lightning_nb/{p.name}" for p in pkg.glob("*.py") if not p.name.startswith("_")}
    return packages | modules


def test_readme_module_table_lists_exactly_the_real_modules():
    rows = _module_table_rows()
    listed = {r for r in rows if r.startswith("lightning_nb/")}
    real = _real_modules()
    assert listed == real, (f"README module table and lightning_nb/ differ: missing rows {sorted(real - listed)}, "
                            f"rows for no module {sorted(listed - real)}")
    assert len(listed) == len([r for r in rows if r.startswith("lightning_nb/")]), "a module has two rows"
    for other in (r for r in rows if not r.startswith("lightning_nb/")):
        assert (ROOT / other).exists(), f"the README module table names {other}, which does not exist"


def _readme_and_docs() -> str:
    """README.md and the manual's pages (docs/*.md, where the README's longer examples moved)."""
    return "\n".join([_readme(), *(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))])


def test_readme_imports_only_public_names():
    """Every name the README or a docs page imports ``from lightning_nb import ...`` is in ``lightning_nb.__all__``."""
    names = set()
    for match in re.finditer(r"from lightning_nb import (\([^)]*\)|[^\n]*)", _readme_and_docs()):
        statement = ast.parse("from lightning_nb import " + match.group(1)).body[0]
        names |= {alias.name for alias in statement.names}
    assert {"AlgorithmConfig", "GRPOTrainer", "start_runners"} <= names, names  # the parse found the ten lines
    missing = sorted(names - set(lightning_nb.__all__))
    assert not missing, (f"README.md or docs/ imports {missing} from lightning_nb, which lightning_nb.__all__ "
                         "leaves out")
