"""Store throughput: lightning-nb's stores vs agentlightning 0.3.0's InMemoryLightningStore, one workload, one run.

Installs nothing. Run it in a side venv where both packages import (agentlightning
pins its own dependency versions, so keep it out of the project's .venv)::

    python3 -m venv /tmp/al
    /tmp/al/bin/pip install agentlightning==0.3.0 torch==2.13.0
    /tmp/al/bin/pip install -e /work/main          # this repo (lightning-nb)
    /tmp/al/bin/python bench/store_vs_agentlightning.py            # N=1000 K=4 S=8
    /tmp/al/bin/python bench/store_vs_agentlightning.py -n 2000 -k 8 -s 16
    /tmp/al/bin/python bench/store_vs_agentlightning.py --synchronous FULL   # SqliteStore durability modes to run

Workload, identical for every store (timed from the first enqueue to the last query):

1. enqueue N rollouts;
2. K runner threads each loop: dequeue a rollout (the thread exits when none is left),
   fetch the latest resources, add S spans, mark the attempt succeeded;
3. query the spans of every rollout (and check there are S each).

Spans start as finished OpenTelemetry ``ReadableSpan`` objects and go in through each kit's
own tracer path: for agentlightning ``add_otel_span`` as each span ends (its ``OtelTracer``
does so); for lightning-nb ``StoreSpanProcessor.on_end``, with the attempt opened first and
closed after its spans as our ``Runner`` does, so its spans go in with one ``add_spans``
(``--span-writes each``: no open attempt, ``add_span`` as each span ends). ``--enqueue batch``
enqueues all N in one call on both sides (our ``enqueue_rollouts``, agentlightning's
``enqueue_many_rollouts``); by default each task is its own call, as agentlightning's
algorithms enqueue (ours enqueue a GRPO group per call). By default the S spans are made once with the OTel SDK
before timing and re-sent for every rollout (ours gets a cheap ``ReadableSpan`` copy carrying
the rollout/attempt ids, which is how our tracer tags spans), so the time is the stores' own.
``--sdk-spans`` makes every span with the OTel SDK inside the timed loop instead (the agent
side's cost, the same for both stores, then dilutes the ratio).

agentlightning's store is async. It is driven the way its shared-memory execution
strategy drives it: the store is wrapped in ``LightningStoreThreaded`` (a lock around every
call), and every runner thread runs its own event loop (``asyncio.run``) that awaits the
store calls its ``LitAgentRunner`` makes (``dequeue_rollout``, ``get_latest_resources``,
``add_otel_span``, ``update_attempt``). Our runners also mark the attempt ``running``
before the agent starts (one more call per rollout than theirs).

``SqliteStore`` runs once per ``--synchronous`` mode (FULL and NORMAL by default; the file
goes in the system temp folder unless ``--tmp`` names another, and its disk's fsync time
dominates FULL). Prints rollouts/s per store and the ratios. The machine's other load matters: run it
on an idle machine for numbers you quote.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

from opentelemetry.sdk.trace import TracerProvider


_ATTRS = {"tool.name": "calc", "tool.input": "12 * 7", "tool.output": "84", "reward": 0.5,
          "gen_ai.usage.input_tokens": 42, "completion_token_ids": [1, 2, 3, 4, 5, 6, 7, 8]}


def _span_factory(s: int, sdk_spans: bool, tag_ids: bool) -> Callable[[str, str, int], Any]:
    """``make(rollout_id, attempt_id, i)`` -> the i-th finished ReadableSpan of an attempt.

    ``tag_ids`` adds lightning-nb's rollout/attempt attributes (our tracer sets them on start).
    """
    from opentelemetry.sdk.trace import ReadableSpan

    otel = TracerProvider().get_tracer("bench")

    def sdk_span(i: int, extra: dict[str, str]) -> Any:
        span = otel.start_span(f"tool:step{i}", attributes={**extra, **_ATTRS})
        span.end()
        return span

    def ids(rollout_id: str, attempt_id: str) -> dict[str, str]:
        return {"lightning_nb.rollout_id": rollout_id, "lightning_nb.attempt_id": attempt_id} if tag_ids else {}

    if sdk_spans:
        return lambda rollout_id, attempt_id, i: sdk_span(i, ids(rollout_id, attempt_id))
    templates = [sdk_span(i, {}) for i in range(s)]
    if not tag_ids:
        return lambda rollout_id, attempt_id, i: templates[i]

    def tagged(rollout_id: str, attempt_id: str, i: int) -> Any:
        t = templates[i]
        return ReadableSpan(name=t.name, context=t.context, parent=t.parent, resource=t.resource,
                            attributes={**t.attributes, **ids(rollout_id, attempt_id)}, status=t.status,
                            start_time=t.start_time, end_time=t.end_time)

    return tagged


async def agl_runner_loop(store: Any, worker: str, s: int, make: Callable[[str, str, int], Any]) -> int:
    """agentlightning's runner loop on ``store`` (its store or its HTTP client): dequeue, fetch the latest
    resources, add ``s`` spans made by ``make``, mark the attempt succeeded; returns the rollouts it ran."""
    count = 0
    while True:
        item = await store.dequeue_rollout(worker_id=worker)
        if item is None:
            return count
        rid, aid = item.rollout_id, item.attempt.attempt_id
        await store.get_latest_resources()
        for i in range(s):
            await store.add_otel_span(rid, aid, make(rid, aid, i))
        await store.update_attempt(rid, aid, status="succeeded")
        count += 1


def _run_threads(k: int, target: Callable[[], int]) -> int:
    done: list[int] = []
    threads = [threading.Thread(target=lambda: done.append(target())) for _ in range(k)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(done)


# ----- lightning-nb -------------------------------------------------------------------------
def bench_ours(store: Any, n: int, k: int, s: int, sdk_spans: bool, span_writes: str = "batch",
               enqueue: str = "each") -> dict[str, float]:
    from lightning_nb.tracing.tracer import StoreSpanProcessor
    from lightning_nb.types import LLMResource

    make = _span_factory(s, sdk_spans, tag_ids=True)
    # batch: what our Runner does (Tracer.open_attempt -> one add_spans when the attempt closes); each: add_span
    # as every span ends (a span of an attempt nobody opened, e.g. the proxy's)
    processor = StoreSpanProcessor(store, flush_s=0.5 if span_writes == "batch" else 0.0)
    store.add_resources({"main_llm": LLMResource(endpoint="http://127.0.0.1:9/v1", model="m")})
    t0 = time.perf_counter()
    if enqueue == "batch":
        ids = [r.rollout_id for r in store.enqueue_rollouts([{"q": i} for i in range(n)])]
    else:
        ids = [store.enqueue_rollout({"q": i}).rollout_id for i in range(n)]
    t1 = time.perf_counter()

    def runner() -> int:
        worker = f"w-{threading.get_ident()}"
        count = 0
        while True:
            item = store.dequeue_rollout(worker, timeout=0.0)
            if item is None:
                return count
            rid, aid = item.rollout.rollout_id, item.attempt.attempt_id
            store.get_latest_resources()
            store.update_attempt(rid, aid, status="running", worker_id=worker)
            processor.open(rid, aid)
            for i in range(s):
                processor.on_end(make(rid, aid, i))
            processor.close(rid, aid)
            store.update_attempt(rid, aid, status="succeeded")
            count += 1

    ran = _run_threads(k, runner)
    t2 = time.perf_counter()
    spans = sum(len(store.query_spans(rid)) for rid in ids)
    t3 = time.perf_counter()
    assert ran == n and spans == n * s, (ran, spans)
    return {"enqueue_s": t1 - t0, "run_s": t2 - t1, "query_s": t3 - t2, "total_s": t3 - t0}


# ----- agentlightning -----------------------------------------------------------------------
def bench_agentlightning(n: int, k: int, s: int, sdk_spans: bool, enqueue: str = "each") -> dict[str, float]:
    from agentlightning import LLM
    from agentlightning.types import EnqueueRolloutRequest
    from agentlightning.store import InMemoryLightningStore
    from agentlightning.store.threading import LightningStoreThreaded

    make = _span_factory(s, sdk_spans, tag_ids=False)
    enqueue_mode = enqueue
    store = LightningStoreThreaded(InMemoryLightningStore())
    asyncio.run(store.add_resources({"main_llm": LLM(endpoint="http://127.0.0.1:9/v1", model="m")}))

    async def enqueue() -> list[str]:
        if enqueue_mode == "batch":
            many = await store.enqueue_many_rollouts([EnqueueRolloutRequest(input={"q": i}) for i in range(n)])
            return [r.rollout_id for r in many]
        return [(await store.enqueue_rollout(input={"q": i})).rollout_id for i in range(n)]

    t0 = time.perf_counter()
    ids = asyncio.run(enqueue())
    t1 = time.perf_counter()

    ran = _run_threads(k, lambda: asyncio.run(agl_runner_loop(store, f"w-{threading.get_ident()}", s, make)))
    t2 = time.perf_counter()

    async def query() -> int:
        total = 0
        for rid in ids:
            total += len(list(await store.query_spans(rid)))
        return total

    spans = asyncio.run(query())
    t3 = time.perf_counter()
    assert ran == n and spans == n * s, (ran, spans)
    return {"enqueue_s": t1 - t0, "run_s": t2 - t1, "query_s": t3 - t2, "total_s": t3 - t0}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", "--rollouts", type=int, default=1000, help="rollouts enqueued (N)")
    parser.add_argument("-k", "--threads", type=int, default=4, help="runner threads (K)")
    parser.add_argument("-s", "--spans", type=int, default=8, help="spans per rollout (S)")
    parser.add_argument("--sdk-spans", action="store_true",
                        help="make every span with the OTel SDK inside the timed loop (agent-side cost included)")
    parser.add_argument("--synchronous", default="FULL,NORMAL",
                        help="SqliteStore synchronous modes to run, comma-separated (default: FULL,NORMAL)")
    parser.add_argument("--span-writes", choices=("batch", "each"), default="batch",
                        help="ours: batch = one add_spans per attempt, as our Runner's tracer writes them (default); "
                             "each = add_span as every span ends. agentlightning's tracer writes each span as it ends")
    parser.add_argument("--enqueue", choices=("each", "batch"), default="each",
                        help="each = enqueue_rollout per task on both sides (default; agent-lightning's algorithms "
                             "enqueue so); batch = one call for all N (our enqueue_rollouts, its enqueue_many_rollouts)")
    parser.add_argument("--tmp", default=None, help="folder for the SQLite file (default: the system temp folder; "
                        "fsync cost depends on its disk)")
    args = parser.parse_args(argv)
    n, k, s = args.rollouts, args.threads, args.spans
    try:
        import agentlightning
    except ImportError:
        print("agentlightning is not importable here; make the side venv described at the top of this file:\n"
              "  python3 -m venv /tmp/al && /tmp/al/bin/pip install agentlightning==0.3.0 torch==2.13.0 && "
              "/tmp/al/bin/pip install -e .", file=sys.stderr)
        return 2
    from importlib.metadata import version

    from lightning_nb.store import InMemoryStore, SqliteStore

    print(f"agentlightning {version('agentlightning')}, lightning-nb {version('lightning-nb')}, "
          f"python {sys.version.split()[0]}; N={n} rollouts, K={k} threads, S={s} spans/rollout, "
          f"spans made {'in the loop by the OTel SDK' if args.sdk_spans else 'once before timing'}; "
          f"our span writes: {args.span_writes}; enqueue: {args.enqueue}; load average {os.getloadavg()[0]:.2f}")
    sdk, shape = args.sdk_spans, {"span_writes": args.span_writes, "enqueue": args.enqueue}
    results = {"agentlightning InMemoryLightningStore": bench_agentlightning(n, k, s, sdk, args.enqueue),
               "lightning-nb InMemoryStore": bench_ours(InMemoryStore(), n, k, s, sdk, **shape)}
    for mode in args.synchronous.split(","):
        with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
            sqlite = SqliteStore(Path(tmp) / "bench.db", synchronous=mode)
            try:
                results[f"lightning-nb SqliteStore {mode}"] = bench_ours(sqlite, n, k, s, sdk, **shape)
            finally:
                sqlite.close()
    theirs = n / results["agentlightning InMemoryLightningStore"]["total_s"]
    print(f"{'store':40s} {'enqueue s':>10s} {'run s':>8s} {'query s':>8s} {'rollouts/s':>11s} {'vs agl':>7s}")
    for name, r in results.items():
        rate = n / r["total_s"]
        print(f"{name:40s} {r['enqueue_s']:10.3f} {r['run_s']:8.3f} {r['query_s']:8.3f} {rate:11.1f} "
              f"{rate / theirs:6.1f}x")
    ours = n / results["lightning-nb InMemoryStore"]["total_s"]
    sqlite_ratios = ", ".join(f"{name.split()[-1]} {n / r['total_s'] / theirs:.1f}x" for name, r in results.items()
                              if "SqliteStore" in name)
    print(f"ratio InMemoryStore / agentlightning: {ours / theirs:.1f}x (target >= 10x); "
          f"SqliteStore / agentlightning: {sqlite_ratios}")
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")
    del agentlightning
    return 0


if __name__ == "__main__":
    sys.exit(main())
