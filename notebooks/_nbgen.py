"""Shared by the notebook generators (notebooks/make_*.py): cells → a notebook without outputs, and writing it.

A generator defines ``CELLS`` (``("md" | "code", source)`` pairs) and ``OUT``, and calls :func:`main`.
Run a generator as ``python notebooks/make_<name>.py``; tests/test_notebooks.py checks that the committed
notebook is what its generator writes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook


def build_notebook(cells: Sequence[tuple[str, str]]) -> nbformat.NotebookNode:
    """A Python 3 notebook of ``cells``, with stable cell ids (``cell-00``, ``cell-01``, ...) and no outputs."""
    nb = new_notebook(cells=[new_markdown_cell(src) if kind == "md" else new_code_cell(src) for kind, src in cells])
    nb.metadata = {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
                   "language_info": {"name": "python"}}
    for i, cell in enumerate(nb.cells):
        cell["id"] = f"cell-{i:02d}"
    return nb


def main(cells: Sequence[tuple[str, str]], out: Path) -> None:
    """Write the notebook of ``cells`` to ``out``."""
    nbformat.write(build_notebook(cells), out)
    print(f"wrote {out}")
