"""``spans_df()`` over spans whose attribute keys never repeat: seconds and peak memory, InMemoryStore and SqliteStore.

    .venv/bin/python bench/spans_df_fresh_keys.py                     # 100k spans, both stores
    .venv/bin/python bench/spans_df_fresh_keys.py --spans 5000 --stores memory

Workload (about agent-lightning's store benchmark shape): rollouts of 14 spans, each span
with 14 attributes of about 210 characters (about 3 kB per span) whose keys are fresh
for every span, as OpenTelemetry instrumentations write them (``gen_ai.prompt.<n>.content``
with an index that keeps growing), plus the LLM proxy's usual keys on every span
(``gen_ai.request.model``, token counts) and a ``reward`` on each rollout's last span.
Spans are added through the public ``add_span``; the SqliteStore file uses
``synchronous="NORMAL"`` (filling is not what is measured).

For each store it prints the frame's shape, the seconds of ``spans_df()`` (best of
``--repeat`` calls, without tracing), and its peak memory: the traced peak of Python
allocations during one more call (``tracemalloc``, MiB above what was allocated before
the call) and the process's peak RSS (``getrusage``) before the first ``spans_df()`` and at
the end (run one store per process to read its RSS alone). Target from issue 12:
under 2 s and under 1 GB for 100k spans. Not a test: timings depend on the machine.
"""

from __future__ import annotations

import argparse
import gc
import resource
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

from lightning_nb import semconv
from lightning_nb.store import InMemoryStore, SqliteStore
from lightning_nb.types import Span

SPANS_PER_ROLLOUT = 14
FRESH_KEYS_PER_SPAN = 14


def peak_rss_mib() -> float:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 1024 / (1024 if sys.platform == "darwin" else 1)  # bytes on macOS, KiB on Linux


def fill(store, n_spans: int) -> tuple[float, int]:
    """Add ``n_spans`` spans (fresh attribute keys each); return the seconds it took and the distinct keys."""
    t0 = time.perf_counter()
    added = 0
    keys: set[str] = set()
    while added < n_spans:
        item = store.start_rollout({"question": f"q{added}"}, worker_id="bench")
        rid, aid = item.rollout.rollout_id, item.attempt.attempt_id
        store.update_attempt(rid, aid, status="running")
        n = min(SPANS_PER_ROLLOUT, n_spans - added)
        for k in range(n):
            i = added + k
            attrs = {f"gen_ai.prompt.{i * FRESH_KEYS_PER_SPAN + j}.content":
                     f"span {i} part {j}: " + "lorem ipsum dolor sit amet " * 7 for j in range(FRESH_KEYS_PER_SPAN)}
            attrs.update({"gen_ai.request.model": "SmolLM2-135M-Instruct", "gen_ai.usage.input_tokens": 100 + k,
                          "gen_ai.usage.output_tokens": 20 + k})
            if k == n - 1:
                attrs[semconv.REWARD] = float(i % 2)
            keys.update(attrs)
            t = 1.7e9 + i
            store.add_span(Span(rollout_id=rid, attempt_id=aid, trace_id=f"{added:032x}", span_id=f"{i:016x}",
                                name="llm" if k < n - 1 else "reward", start_time=t, end_time=t + 0.25,
                                status="ok", attributes=attrs))
        store.update_attempt(rid, aid, status="succeeded")
        added += n
    return time.perf_counter() - t0, len(keys)


def measure(name: str, store, n_spans: int, repeat: int) -> None:
    add_s, distinct = fill(store, n_spans)
    rss_filled = peak_rss_mib()
    times = []
    for _ in range(repeat):
        gc.collect()
        t0 = time.perf_counter()
        df = store.spans_df()
        times.append(time.perf_counter() - t0)
        del df
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    df = store.spans_df()
    peak = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    print(f"{name:>7}: {len(df):,} spans added in {add_s:.1f} s; spans_df() {len(df):,} x {df.shape[1]} "
          f"({distinct:,} distinct attribute keys) in {min(times):.3f} s (best of {repeat}); "
          f"traced peak {peak / 2**20:,.0f} MiB; process peak RSS {peak_rss_mib():,.0f} MiB "
          f"({rss_filled:,.0f} MiB before spans_df)")
    sys.stdout.flush()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spans", type=int, default=100_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--stores", nargs="+", choices=["memory", "sqlite"], default=["memory", "sqlite"])
    args = ap.parse_args()
    print(f"peak RSS at start: {peak_rss_mib():,.0f} MiB")
    for name in args.stores:
        if name == "memory":
            measure(name, InMemoryStore(), args.spans, args.repeat)
        else:
            with tempfile.TemporaryDirectory() as tmp, SqliteStore(Path(tmp) / "bench.db",
                                                                    synchronous="NORMAL") as store:
                measure(name, store, args.spans, args.repeat)
        gc.collect()


if __name__ == "__main__":
    main()
