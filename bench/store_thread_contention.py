"""Where InMemoryStore's extra CPU with many runner threads goes: one store, agent-lightning's spans, four variants.

A diagnostic for ``store_agl_workload.py``, not a comparison: agentlightning's store is not run. It
records agent-lightning's benchmark agent once (``store_agl_workload.make_recorder``: N tasks, ~14 spans
and ~41 kB of attributes each, fresh keys), then drives one ``InMemoryStore`` per run as
``store_agl_workload.py`` drives ours: ``--runners`` threads, each looping ``dequeue_rollout`` (timeout
0.2 s), ``get_resources_by_id``, ``update_attempt(running)``, one ``add_otel_spans`` of the recorded
``ReadableSpan`` objects (as our ``Tracer`` writes; a ``lightning_nb`` without it: the ``span_from_otel``
conversion and one ``add_spans``), ``update_attempt(succeeded)``; the main thread enqueues batches of
``--batch-size``, polls
``wait_for_rollouts(timeout=0)`` every 2 ms and reads each finished rollout's spans
(``query_spans(rid, "latest")``). No agent-lightning code runs in the timed part. Variants:

* ``plain``: as above;
* ``gate``: one process-wide lock held around each runner's whole iteration (dequeue to the last
  update), so at most one runner thread is busy at a time; the others wait on that lock, not on the GIL;
* ``fewer-calls``: without ``get_resources_by_id`` and ``update_attempt(running)`` (3 store calls per
  rollout on the runner side instead of 5);
* ``plain`` again with ``--switch-interval`` (``sys.setswitchinterval``; CPython's default is 0.005 s).

Prints per run: wall seconds, the main thread's CPU, the runner threads' CPU per rollout (µs), and the
process's voluntary / involuntary context switches during the run (``getrusage``). Same side venv as
``store_agl_workload.py``::

    LITELLM_LOCAL_MODEL_COST_MAP=True /tmp/al/bin/python bench/store_thread_contention.py \\
        --agl-benchmark /tmp/agl-src/tests/benchmark/benchmark_store.py            # 2048 rollouts, 32 runners
    ... --variants plain --runners 1                                                 # one runner thread
    ... --variants plain --switch-interval 0.05
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import resource
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
import store_agl_workload as agl_workload  # noqa: E402  (this folder's script: agl's benchmark loader)

VARIANTS = ("plain", "gate", "fewer-calls")


def run_once(tasks: list[str], spans_of: dict[str, list[Any]], runners: int, batch_size: int,
             variant: str) -> dict[str, float]:
    from lightning_nb.store import InMemoryStore
    from lightning_nb.tracing.tracer import span_from_otel
    from lightning_nb.types import LLMResource

    store = InMemoryStore()
    res = store.add_resources({"llm": LLMResource(endpoint="http://127.0.0.1:9/v1", model="m")})
    gate = threading.Lock() if variant == "gate" else None
    full = variant != "fewer-calls"
    otel = hasattr(store, "add_otel_spans")  # a lightning_nb before it: converted, one add_spans
    stop, start = threading.Event(), threading.Barrier(runners + 1)
    runner_cpu: list[float] = []

    def one(item: Any) -> None:
        rid, aid = item.rollout.rollout_id, item.attempt.attempt_id
        if full:
            store.get_resources_by_id(item.rollout.resources_id)
            store.update_attempt(rid, aid, status="running", worker_id="w")
        if otel:  # what our Tracer does: the ReadableSpans to the store, which converts them
            store.add_otel_spans(rid, aid, spans_of[item.rollout.input])
        else:
            store.add_spans([span_from_otel(s, rid, aid) for s in spans_of[item.rollout.input]])
        store.update_attempt(rid, aid, status="succeeded")

    def runner() -> None:
        start.wait()
        c0 = time.thread_time()
        while not stop.is_set():
            if gate is None:
                item = store.dequeue_rollout("w", timeout=0.2)
                if item is not None:
                    one(item)
                continue
            with gate:  # dequeue without waiting: a runner must not sleep holding the gate
                item = store.dequeue_rollout("w", timeout=0.0)
                if item is not None:
                    one(item)
            if item is None:
                time.sleep(0.002)
        runner_cpu.append(time.thread_time() - c0)

    threads = [threading.Thread(target=runner, daemon=True) for _ in range(runners)]
    for t in threads:
        t.start()
    gc.collect()
    u0 = resource.getrusage(resource.RUSAGE_SELF)
    start.wait()
    t0, c0 = time.perf_counter(), time.thread_time()
    for b in range(0, len(tasks), batch_size):
        left = {store.enqueue_rollout(t, resources_id=res.resources_id).rollout_id for t in tasks[b:b + batch_size]}
        while left:
            for r in store.wait_for_rollouts(list(left), timeout=0):
                store.query_spans(r.rollout_id, "latest")
                left.discard(r.rollout_id)
            if left:
                time.sleep(0.002)
    wall, main_cpu = time.perf_counter() - t0, time.thread_time() - c0
    u1 = resource.getrusage(resource.RUSAGE_SELF)
    stop.set()
    for t in threads:
        t.join()
    return {"wall": wall, "main_cpu": main_cpu, "runner_us": sum(runner_cpu) / len(tasks) * 1e6,
            "vol": u1.ru_nvcsw - u0.ru_nvcsw, "invol": u1.ru_nivcsw - u0.ru_nivcsw}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agl-benchmark", required=True,
                        help="agent-lightning's tests/benchmark/benchmark_store.py (v0.3.0), utils.py beside it")
    parser.add_argument("-n", "--total-tasks", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--runners", type=int, default=32, help="runner threads")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {VARIANTS}")
    parser.add_argument("--repeats", type=int, default=3, help="runs per variant, interleaved")
    parser.add_argument("--switch-interval", type=float, default=None,
                        help="sys.setswitchinterval for the whole run (default: leave CPython's 0.005 s)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {unknown}; choose from {VARIANTS}")
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    random.seed(args.seed)
    bm = agl_workload.load_agl_benchmark(args.agl_benchmark, 0.02)
    record: Callable[[str], Any] = agl_workload.make_recorder(bm, 6, 0.0)
    tasks = [f"task-{i}-generated" for i in range(args.total_tasks)]
    spans_of = {t: asyncio.run(record(t)) for t in tasks}
    print(f"{agl_workload.describe(spans_of)}; runners={args.runners}, batch={args.batch_size}, "
          f"switch interval {sys.getswitchinterval():.3g} s")
    print(f"{'variant':<12} {'wall s':>7} {'main CPU s':>10} {'runner CPU µs/rollout':>22} "
          f"{'ctx vol':>8} {'invol':>6}")
    for _ in range(args.repeats):
        for v in variants:
            r = run_once(tasks, spans_of, args.runners, args.batch_size, v)
            print(f"{v:<12} {r['wall']:>7.2f} {r['main_cpu']:>10.2f} {r['runner_us']:>22.0f} "
                  f"{r['vol']:>8} {r['invol']:>6}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
