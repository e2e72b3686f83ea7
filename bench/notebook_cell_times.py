"""Execute a notebook at full size (no LIGHTNING_NB_SMOKE) and print each code cell's wall time and longest silence.

    .venv/bin/python bench/notebook_cell_times.py notebooks/01_quickstart.ipynb [--smoke] [--out times.csv]

Runs in a scratch folder (a full run of notebook 01 writes a 1.6 GB checkpoint under ``runs/``, deleted after),
with nbclient and the ``python3`` kernel of this venv. Prints one line per code cell: its index, seconds, its
longest silence and first source line, then the total; ``--out`` also writes them as CSV. This is how the time
claims in the notebooks' introductions are measured (say the machine and its load when you quote them).

A cell's *longest silence* is the longest time in seconds during which the user saw nothing change: between the
cell's start, each message the kernel sent that changes what the cell shows (a stream, a display or its update, a
result, an error, or a widget's state, which is how a notebook progress bar moves) and the cell's end. Issue 53
asks that no cell stay silent for more than 10 s.
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


# what the kernel sends that changes what a cell shows (a notebook progress bar moves by widget state: comm_msg)
_SHOWN = frozenset({"stream", "display_data", "update_display_data", "execute_result", "error", "comm_msg",
                    "clear_output"})


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
    rows: list[tuple[int, float, float, str]] = []
    started: dict[int, float] = {}
    last_seen: dict[int, float] = {}
    silence: dict[int, tuple[float, float]] = {}  # cell -> (longest gap, seconds into the cell it began)

    def on_start(cell, cell_index, **_):
        started[cell_index] = last_seen[cell_index] = time.monotonic()
        silence[cell_index] = (0.0, 0.0)

    def on_done(cell, cell_index, **_):
        now = time.monotonic()
        seconds = now - started.pop(cell_index, now)
        last = last_seen.pop(cell_index, now)
        quiet, at = max(silence.pop(cell_index, (0.0, 0.0)), (now - last, seconds - (now - last)))
        first = next((line for line in cell.source.splitlines() if line.strip() and not line.startswith("#")), "")
        rows.append((cell_index, seconds, quiet, first[:80]))
        print(f"cell {cell_index:3d}  {seconds:8.1f} s  silent ≤ {quiet:6.1f} s (from {at:.0f} s)  {first[:80]}",
              flush=True)

    class Client(NotebookClient):
        def process_message(self, msg, cell, cell_index):
            if msg.get("msg_type") in _SHOWN and cell_index in last_seen:
                now = time.monotonic()
                gap = (now - last_seen[cell_index], last_seen[cell_index] - started[cell_index])
                silence[cell_index] = max(silence[cell_index], gap)
                last_seen[cell_index] = now
            return super().process_message(msg, cell, cell_index)

    client = Client(nb, timeout=args.timeout, kernel_name="python3", resources={"metadata": {"path": str(work)}},
                    on_cell_execute=on_start, on_cell_executed=on_done)
    t0 = time.monotonic()
    try:
        client.execute()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    total = time.monotonic() - t0
    quietest = max(rows, key=lambda r: r[2], default=(0, 0.0, 0.0, ""))
    print(f"total {total:.0f} s ({total / 60:.1f} min), code cells {sum(r[1] for r in rows):.0f} s; longest silence "
          f"{quietest[2]:.1f} s (cell {quietest[0]})")
    if args.out:
        with args.out.open("w", newline="") as f:
            csv.writer(f).writerows([("index", "seconds", "longest_silence_s", "first_line"), *rows])
    return 0


if __name__ == "__main__":
    sys.exit(main())
