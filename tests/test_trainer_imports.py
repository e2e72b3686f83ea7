"""The trainers side by side: ``trainers/grpo`` and ``trainers/verl`` share ``trainers/`` and never import each other.

What both trainers use (the config fields, the batch, credit and advantages, the in-place weights side,
packing, micro-batches, metrics, checkpoints) lives in ``lightning_nb/trainers/`` and imports neither trainer
package; the two packages' ``__init__`` modules import their names on first access (PEP 562).
``.importlinter`` checks the same rule (contracts ``trainers-apart`` and ``trainers-shared``), but import-linter
leaves out ``if TYPE_CHECKING:`` imports and cannot see what a module actually loads at run time; these tests
check both.

The run-time checks start a fresh interpreter and import the real package root: ``lightning_nb/__init__.py``
imports the trainers and the in-process engines on first access (PEP 562, ``lightning_nb._lazy.lazy_names``), so
neither ``import lightning_nb`` nor importing one trainers module through it loads a trainer or the transformers
engine; ``from lightning_nb import GRPOTrainer`` still works.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TRAINERS = ROOT / "lightning_nb" / "trainers"
PACKAGES = ("lightning_nb.trainers.grpo", "lightning_nb.trainers.verl")

def _loaded_after(code: str) -> set[str]:
    """The names in ``sys.modules`` after running ``code`` in a fresh interpreter (which must not fail)."""
    script = textwrap.dedent(code) + textwrap.dedent("""
        import json as _json, sys as _sys
        print(_json.dumps(sorted(m for m, mod in _sys.modules.items() if mod is not None)))
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{code.strip()} failed in a fresh interpreter:\n{proc.stderr[-3000:]}"
    return set(json.loads(proc.stdout.strip().splitlines()[-1]))


# Neither import lightning_nb nor a config module may load these: a trainer, the in-place weights side, the
# in-process engines, or the heavy libraries they import when used.
HEAVY = ("lightning_nb.trainers.grpo.trainer", "lightning_nb.trainers.verl.trainer", "lightning_nb.trainers.verl.bridge",
         "lightning_nb.trainers.inplace", "lightning_nb.trainers.batch", "lightning_nb.engines.transformers",
         "lightning_nb.engines.continuous", "lightning_nb.engines.vllm", "torch", "transformers", "verl", "litellm")


def _under(loaded: set[str], package: str) -> list[str]:
    return sorted(m for m in loaded if m == package or m.startswith(package + "."))


def test_the_package_root_loads_no_trainer_and_no_engine():
    """``import lightning_nb`` loads the public names' light modules only: no trainer (neither package's
    ``__init__`` even), no in-process engine, no torch; the lazy names are in ``dir()`` and ``__all__``."""
    loaded = _loaded_after("""
        import lightning_nb
        names = set(dir(lightning_nb))
        assert {"GRPOTrainer", "GRPOConfig", "VerlTrainer", "TransformersEngine", "VLLMEngine"} <= names, names
        assert set(lightning_nb.__all__) <= names, set(lightning_nb.__all__) - names
    """)
    assert "lightning_nb" in loaded and "lightning_nb.store" in loaded and "lightning_nb.algorithm" in loaded
    for package in PACKAGES:
        assert not _under(loaded, package), f"import lightning_nb loaded {_under(loaded, package)}"
    for name in HEAVY:
        assert name not in loaded, f"import lightning_nb loaded {name}"


def test_the_trainer_views_are_registered_without_importing_the_trainers():
    """The root registers the trainers' HTML view by their dotted names; a trainer imported later finds it."""
    _loaded_after("""
        import sys
        import lightning_nb
        from lightning_nb.types import html_view
        assert "lightning_nb.trainers.grpo.trainer" not in sys.modules
        from lightning_nb import GRPOTrainer, VerlTrainer
        class Unregistered:
            pass
        for cls in (GRPOTrainer, VerlTrainer):
            obj = cls.__new__(cls)
            try:
                found = html_view(obj) is not None
            except Exception:  # the view ran on an instance without its state: it was found
                found = True
            assert found, f"no HTML view for {cls.__name__}"
        assert html_view(Unregistered()) is None
    """)


def test_the_verl_config_loads_no_trainer_and_no_torch():
    """``trainers.verl.config`` needs the shared config (and micro-batch sizing, which imports torch inside its
    function), not the GRPO package, either trainer, the in-place weights side, an engine, torch or verl; and
    through the real package root, which it imports first, neither."""
    loaded = _loaded_after("import lightning_nb.trainers.verl.config")
    assert "lightning_nb.trainers.verl.config" in loaded and "lightning_nb.trainers.config" in loaded
    assert "lightning_nb" in loaded and "lightning_nb.algorithm" in loaded  # the real root ran
    assert not _under(loaded, "lightning_nb.trainers.grpo"), _under(loaded, "lightning_nb.trainers.grpo")
    for name in HEAVY:
        assert name not in loaded, f"importing lightning_nb.trainers.verl.config loaded {name}"


def test_the_grpo_config_loads_nothing_of_verl_and_no_trainer():
    loaded = _loaded_after("import lightning_nb.trainers.grpo.config")
    assert "lightning_nb.trainers.grpo.config" in loaded
    assert not _under(loaded, "lightning_nb.trainers.verl"), _under(loaded, "lightning_nb.trainers.verl")
    for name in HEAVY:
        assert name not in loaded, f"importing lightning_nb.trainers.grpo.config loaded {name}"


@pytest.mark.parametrize("module", ["lightning_nb.trainers.inplace", "lightning_nb.trainers.batch",
                                    "lightning_nb.trainers.metrics", "lightning_nb.trainers.credit", "lightning_nb.credit"])
def test_a_shared_module_imports_first_and_loads_neither_trainer(module):
    """Each shared module imports on its own in a fresh interpreter (``trainers.inplace`` used to close the cycle
    ``inplace -> grpo/__init__ -> grpo.trainer -> inplace`` and failed when imported first) and loads neither
    trainer package."""
    loaded = _loaded_after(f"import {module}")
    for package in PACKAGES:
        assert not _under(loaded, package), f"importing {module} loaded {_under(loaded, package)}"


def test_the_package_names_import_on_first_access():
    """``from lightning_nb.trainers.grpo import GRPOConfig`` loads the config only; ``GRPOTrainer`` loads the trainer
    when asked for; the same objects as in their modules; submodules and the package root's names still work."""
    loaded = _loaded_after("""
        from lightning_nb.trainers.grpo import GRPOConfig
        from lightning_nb.trainers.verl import VerlConfig
        import sys
        assert "lightning_nb.trainers.grpo.trainer" not in sys.modules
        assert "lightning_nb.trainers.verl.trainer" not in sys.modules
        assert GRPOConfig is sys.modules["lightning_nb.trainers.grpo.config"].GRPOConfig
        assert VerlConfig is sys.modules["lightning_nb.trainers.verl.config"].VerlConfig
    """)
    assert "lightning_nb.trainers.grpo.trainer" not in loaded and "lightning_nb.trainers.verl.trainer" not in loaded
    loaded = _loaded_after("""
        import lightning_nb
        from lightning_nb.trainers import grpo, verl
        from lightning_nb.trainers.grpo import GRPOConfig, GRPOTrainer, losses
        from lightning_nb.trainers.grpo.trainer import GRPOTrainer as home
        from lightning_nb.trainers.verl import VerlConfig, VerlTrainer
        from lightning_nb.trainers.config import TrainerConfig
        assert GRPOTrainer is home is lightning_nb.GRPOTrainer and GRPOConfig is lightning_nb.GRPOConfig
        assert VerlTrainer is lightning_nb.VerlTrainer and VerlConfig is lightning_nb.VerlConfig
        assert isinstance(VerlConfig(), TrainerConfig) and not isinstance(VerlConfig(), GRPOConfig)
        assert {"GRPOConfig", "GRPOTrainer"} <= set(dir(grpo)) and {"VerlConfig", "VerlTrainer"} <= set(dir(verl))
        for package in (grpo, verl):
            try:
                package.NoSuchName
            except AttributeError as exc:
                assert "NoSuchName" in str(exc)
            else:
                raise AssertionError("an unknown name must raise AttributeError")
    """)
    assert "lightning_nb.trainers.grpo.trainer" in loaded


# ----- the source: what each module's import statements name ----------------------------------------------------

def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_names(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` of every import in ``path``: top level, inside functions and inside ``if TYPE_CHECKING:``
    alike (relative imports resolved), and of ``importlib.import_module("...")`` / ``__import__("...")`` calls."""
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            out += [(node.lineno, base)] + [(node.lineno, f"{base}.{a.name}") for a in node.names]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str) \
                and ast.unparse(node.func) in ("importlib.import_module", "import_module", "__import__"):
            out.append((node.lineno, node.args[0].value))
    return out


def _names(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


@pytest.mark.parametrize("package, other", [PACKAGES, PACKAGES[::-1]])
def test_the_trainer_packages_import_nothing_from_each_other(package, other):
    """No import statement of ``trainers/grpo`` names ``lightning_nb.trainers.verl``, and none of ``trainers/verl``
    names ``lightning_nb.trainers.grpo``: not at the top, not inside a function, not under ``if TYPE_CHECKING:``
    either (stricter than import-linter, which skips those: an annotation-only import still ties one trainer's code
    to the other's). What they share they import from ``lightning_nb.trainers``."""
    folder = TRAINERS / package.rsplit(".", 1)[1]
    seen, bad = set(), []
    for path in sorted(folder.rglob("*.py")):
        for line, module in _imported_names(path):
            seen.add(module)
            if _names(module, other):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert not bad, "\n".join(bad)
    assert "lightning_nb.trainers.batch" in seen, "the check read no import of the shared batch; is it parsing?"


def test_the_shared_trainer_modules_import_neither_trainer_package_nor_verl():
    """The modules of ``lightning_nb/trainers/`` itself (the shared layer) name neither trainer package in any
    import, nor verl: GRPOTrainer imports them, and it trains where verl is not installed (tests/test_packaging.py
    checks the same of ``trainers/grpo/``)."""
    bad = [f"{path.relative_to(ROOT)}:{line} imports {module}"
           for path in sorted(TRAINERS.glob("*.py")) for line, module in _imported_names(path)
           if any(_names(module, p) for p in (*PACKAGES, "verl"))]
    assert not bad, "\n".join(bad)
