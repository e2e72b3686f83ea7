"""Names a package imports on first access (PEP 562): one helper for the package root and the packages under it.

A package whose public names live in heavy modules (a trainer, the transformers engine) lists them here instead
of importing them, so importing the package, or any of its light submodules, does not load them::

    __getattr__, __dir__ = lazy_names(__name__, {"GRPOTrainer": "lightning_nb.trainers.grpo.trainer"})

Nothing here imports anything of ``lightning_nb``: it is the bottom layer.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable, Mapping

__all__ = ["lazy_names"]


def lazy_names(package: str, homes: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module-level ``__getattr__`` and ``__dir__`` of ``package`` (its ``__name__``) for ``homes``, a map of
    each lazy name to the module that defines it (absolute name).

    ``__getattr__(name)`` imports ``homes[name]`` on the first access of ``name``, keeps the value in the package
    (so later accesses do not come back here) and returns it; a name not in ``homes`` raises ``AttributeError``
    naming the package and the name, as a plain module does. ``__dir__()`` lists the package's globals, its
    ``__all__`` and the lazy names, imported or not (so ``dir()`` and tab completion show them).
    """
    homes = dict(homes)

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(home), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        namespace = vars(sys.modules[package])
        return sorted({*namespace, *namespace.get("__all__", ()), *homes})

    return __getattr__, __dir__
