"""Execute a notebook at full size (no LIGHTNING_NB_SMOKE) and print each code cell's wall time.

    .venv/bin/python bench/notebook_cell_times.py notebooks/01_quickstart.ipynb [--smoke] [--out times.csv]

Runs in a scratch folder (a full run of notebook 01 writes a 1.6 GB checkpoint under ``runs/``, deleted after),
with nbclient and the ``python3`` kernel of this venv. Prints one line per code cell: its index, seconds and
first source line, then the total; ``--out`` also writes them as CSV. This is how the time claims in the
notebooks' introductions are measured (say the machine and its load when you quote them).
"""

from __future__ import annotations

import argparse
import csv
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebook", type=Path)
    parser.add_argument("--smoke", action="store_true", help="set LIGHTNING_NB_SMOKE=1 (the test suite's sizes)")
    parser.add_argument("--out", type=Path, help="also write index,seconds,first_line as CSV here")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds one cell may take")
    args = parser.parse_args()
    nb = nbformat.read(args.notebook, as_version=4)
    work = Path(tempfile.mkdtemp(prefix="nb-times-"))
    os.environ.pop("LIGHTNING_NB_SMOKE", None)
    if args.smoke:
        os.environ["LIGHTNING_NB_SMOKE"] = "1"
    os.environ.setdefault("PYTHONPATH", str(Path(__file__).resolve().parents[1]))
    rows: list[tuple[int, float, str]] = []
    started: dict[int, float] = {}

    def on_start(cell, cell_index, **_):
        started[cell_index] = time.monotonic()

    def on_done(cell, cell_index, **_):
        seconds = time.monotonic() - started.pop(cell_index, time.monotonic())
        first = next((line for line in cell.source.splitlines() if line.strip() and not line.startswith("#")), "")
        rows.append((cell_index, seconds, first[:80]))
        print(f"cell {cell_index:3d}  {seconds:8.1f} s  {first[:80]}", flush=True)

    client = NotebookClient(nb, timeout=args.timeout, kernel_name="python3", resources={"metadata": {"path": str(work)}},
                            on_cell_execute=on_start, on_cell_executed=on_done)
    t0 = time.monotonic()
    try:
        client.execute()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    total = time.monotonic() - t0
    print(f"total {total:.0f} s ({total / 60:.1f} min), code cells {sum(r[1] for r in rows):.0f} s")
    if args.out:
        with args.out.open("w", newline="") as f:
            csv.writer(f).writerows([("index", "seconds", "first_line"), *rows])
    return 0


if __name__ == "__main__":
    sys.exit(main())
