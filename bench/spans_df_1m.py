"""Build N spans (default 1,000,000) in an InMemoryStore; print the spans_df build time and peak RSS.

    .venv/bin/python bench/spans_df_1m.py                      # 1M spans, no memory bound
    .venv/bin/python bench/spans_df_1m.py --max-spans 100000   # bounded: spans of finished rollouts evicted
    .venv/bin/python bench/spans_df_1m.py --max-spans 100000 --spill runs/spill.db   # ... spilled to SQLite

Workload: rollouts of ``--spans-per-rollout`` spans (LLM-call-like attributes: token counts,
model name, a short completion; the last span of each rollout is a reward span), added through
the public ``add_span`` one at a time, as runners do. Prints seconds to add, seconds to build
``spans_df()`` (twice: the second call shows there is no hidden cache), peak RSS (MiB, from
``resource.getrusage``) and, when bounded, how many spans are in memory / evicted / spilled.
Not a test: timings depend on the machine.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time

from lightning_nb import semconv
from lightning_nb.store import InMemoryStore
from lightning_nb.types import Span


def peak_rss_mib() -> float:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 1024 / (1024 if sys.platform == "darwin" else 1)  # bytes on macOS, KiB on Linux


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spans", type=int, default=1_000_000)
    ap.add_argument("--spans-per-rollout", type=int, default=20)
    ap.add_argument("--max-spans", type=int, default=None)
    ap.add_argument("--spill", default=None, help="SQLite file for spilled spans (needs --max-spans)")
    args = ap.parse_args()

    store = InMemoryStore(max_spans=args.max_spans, spill_path=args.spill)
    per = args.spans_per_rollout
    rss0 = peak_rss_mib()
    t0 = time.perf_counter()
    added = 0
    while added < args.spans:
        item = store.start_rollout({"question": f"q{added}"}, worker_id="bench")
        rid, aid = item.rollout.rollout_id, item.attempt.attempt_id
        store.update_attempt(rid, aid, status="running")
        n = min(per, args.spans - added)
        for k in range(n):
            t = 1.7e9 + added + k
            if k == n - 1:
                attrs = {semconv.REWARD: float(k % 2)}
                name = "reward"
            else:
                attrs = {"gen_ai.usage.input_tokens": 100 + k, "gen_ai.usage.output_tokens": 20 + k,
                         "gen_ai.request.model": "SmolLM2-135M-Instruct", "gen_ai.completion": f"CALC: {k} + 1"}
                name = "llm"
            store.add_span(Span(rollout_id=rid, attempt_id=aid, trace_id=f"{added:032x}", span_id=f"{k:016x}",
                                name=name, start_time=t, end_time=t + 0.25, status="ok", attributes=attrs))
        store.update_attempt(rid, aid, status="succeeded")
        added += n
    add_s = time.perf_counter() - t0
    rss_added = peak_rss_mib()

    t1 = time.perf_counter()
    df = store.spans_df()
    build_s = time.perf_counter() - t1
    t2 = time.perf_counter()
    df2 = store.spans_df()
    build2_s = time.perf_counter() - t2
    assert len(df) == len(df2)

    print(f"spans added:            {added:,} in {add_s:.1f} s ({added / add_s:,.0f} spans/s)")
    print(f"spans_df rows x cols:   {len(df):,} x {df.shape[1]}")
    print(f"spans_df build seconds: {build_s:.3f} (again: {build2_s:.3f})")
    print(f"peak RSS MiB:           {peak_rss_mib():,.0f} (at start {rss0:,.0f}, after adding {rss_added:,.0f})")
    if args.max_spans:
        print(f"in memory / evicted:    {len(store._table):,} / {store.evicted_spans:,}"
              + (f" / spilled {store._spill.count:,}" if store._spill is not None else ""))


if __name__ == "__main__":
    main()
