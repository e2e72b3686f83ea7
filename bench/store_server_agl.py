"""Store servers over HTTP: lightning-nb's StoreServer + StoreClient vs agentlightning 0.3.0's LightningStoreServer +
LightningStoreClient, in agent-lightning's deployment shape (a store server, runner processes over HTTP), one run.

Installs nothing. Run it in the side venv where both packages import (see bench/README.md)::

    LITELLM_LOCAL_MODEL_COST_MAP=True /tmp/al/bin/python bench/store_server_agl.py          # N=1000, K=2, S=8
    ... -n 2000 -k 4 --modes agl,batch          # other sizes, a subset of the runs

Workload: the one of ``store_vs_agentlightning.py`` (N rollouts, S small spans each: a tool
call's attributes, 8 token ids), moved into agent-lightning's shape. Timed from the first enqueue
to the last span query, identical for every server:

1. the algorithm (this process, where the server also runs in a thread, as agent-lightning's
   ``LightningStoreServer(launch_mode="thread")`` and our ``StoreServer`` do) enqueues N rollouts
   through its client;
2. K runner *processes* (started, imported and connected before timing; default 2, what two
   cores host fairly beside the server), each with its own client, loop: dequeue a rollout (the
   process stops when none is left), fetch the latest resources, send S spans, mark the attempt
   succeeded;
3. the algorithm queries the spans of every rollout (and checks there are S each).

Per rollout, over HTTP:

* ``agl``: agentlightning's client as its runner uses it: ``dequeue_rollout``,
  ``get_latest_resources``, ``add_otel_span`` per span (its client makes two requests per span:
  ``/spans/next`` for the sequence id, then ``/spans``) and ``update_attempt(succeeded)``.
* ``batch``: our client as our ``Runner`` uses it: ``dequeue_rollout``, ``get_latest_resources``,
  ``update_attempt(running)`` (one call more than agent-lightning's runner), the S spans written
  with one ``add_otel_spans`` (our ``Tracer`` buffers an open attempt's ``ReadableSpan``s and writes
  them so when it closes; ``StoreClient`` converts them and the server answers with their sequence
  ids), ``update_attempt(succeeded)``.
* ``each``: as ``batch``, but every span is its own request through ``StoreSpanProcessor.on_end``
  (one ``add_span`` per span, as ``Tracer(span_flush_s=0)`` would).

The spans are made once per runner process by the OTel SDK before timing (as in
``store_vs_agentlightning.py``; ours get a ``ReadableSpan`` copy with the rollout/attempt ids, as
our tracer tags them). Both servers hold an in-memory store (``InMemoryLightningStore`` /
``InMemoryStore``). Prints seconds per phase, rollouts/s and the ratio to agentlightning. The
machine's other load matters: quote numbers with the load printed before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import multiprocessing as mp
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from store_vs_agentlightning import _span_factory, agl_runner_loop  # noqa: E402  (that bench's spans and loop)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----- runner processes ------------------------------------------------------------------------
def _agl_runner(url: str, s: int, start: Any, done: Any) -> None:
    from agentlightning.store.client_server import LightningStoreClient

    make = _span_factory(s, False, tag_ids=False)

    async def loop() -> tuple[int, float]:
        client = LightningStoreClient(url)
        await client.get_latest_resources()  # connect before timing
        done.put(None)  # ready
        start.wait()
        cpu = time.process_time()
        try:
            count = await agl_runner_loop(client, f"w-{os.getpid()}", s, make)
            return count, time.process_time() - cpu
        finally:
            await client.close()

    done.put(asyncio.run(loop()))


def _our_runner(url: str, s: int, batched: bool, start: Any, done: Any) -> None:
    from lightning_nb.store import StoreClient
    from lightning_nb.tracing.tracer import StoreSpanProcessor

    make = _span_factory(s, False, tag_ids=True)
    client = StoreClient(url)
    processor = StoreSpanProcessor(client)
    client.get_latest_resources()  # connect before timing
    done.put(None)  # ready
    start.wait()
    cpu = time.process_time()
    worker, count = f"w-{os.getpid()}", 0
    while True:
        item = client.dequeue_rollout(worker, timeout=0.0)
        if item is None:
            break
        rid, aid = item.rollout.rollout_id, item.attempt.attempt_id
        client.get_latest_resources()
        client.update_attempt(rid, aid, status="running", worker_id=worker)
        if batched:
            client.add_otel_spans(rid, aid, [make(rid, aid, i) for i in range(s)])
        else:
            for i in range(s):
                processor.on_end(make(rid, aid, i))
        client.update_attempt(rid, aid, status="succeeded")
        count += 1
    client.close()
    done.put((count, time.process_time() - cpu))


def _run_runners(ctx: Any, target: Any, args: tuple, k: int) -> tuple[list[Any], Any, Any]:
    """Start ``k`` runner processes and return once each has imported, connected and said it is ready."""
    start, done = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, start, done), daemon=True) for _ in range(k)]
    for p in procs:
        p.start()
    for _ in procs:
        assert done.get(timeout=300) is None
    time.sleep(1.0)  # let their start-up CPU settle
    return procs, start, done


# ----- the two sides ---------------------------------------------------------------------------
def bench_agl(ctx: Any, n: int, k: int, s: int) -> dict[str, float]:
    from agentlightning import LLM
    from agentlightning.store import InMemoryLightningStore
    from agentlightning.store.client_server import LightningStoreClient, LightningStoreServer

    port = _free_port()
    server = LightningStoreServer(InMemoryLightningStore(), host="127.0.0.1", port=port, launch_mode="thread")
    url = f"http://127.0.0.1:{port}"

    async def main() -> dict[str, float]:
        await server.start()
        client = LightningStoreClient(url)
        await client.add_resources({"main_llm": LLM(endpoint="http://127.0.0.1:9/v1", model="m")})
        procs, start, done = _run_runners(ctx, _agl_runner, (url, s), k)
        t0, cpu0 = time.perf_counter(), time.process_time()
        ids = [(await client.enqueue_rollout(input={"q": i})).rollout_id for i in range(n)]
        t1 = time.perf_counter()
        start.set()
        results = [done.get() for _ in procs]
        t2 = time.perf_counter()
        spans = 0
        for rid in ids:
            spans += len(list(await client.query_spans(rid)))
        t3, cpu = time.perf_counter(), time.process_time() - cpu0
        for p in procs:
            p.join()
        await client.close()
        await server.stop()
        assert sum(c for c, _ in results) == n and spans == n * s, (results, spans)
        return _phases(t0, t1, t2, t3, cpu, results)

    return asyncio.run(main())


def bench_ours(ctx: Any, n: int, k: int, s: int, batched: bool) -> dict[str, float]:
    from lightning_nb.store import InMemoryStore, StoreClient, StoreServer
    from lightning_nb.types import LLMResource

    with StoreServer(InMemoryStore()) as server, StoreClient(server.url) as client:
        client.add_resources({"main_llm": LLMResource(endpoint="http://127.0.0.1:9/v1", model="m")})
        procs, start, done = _run_runners(ctx, _our_runner, (server.url, s, batched), k)
        t0, cpu0 = time.perf_counter(), time.process_time()
        ids = [client.enqueue_rollout({"q": i}).rollout_id for i in range(n)]
        t1 = time.perf_counter()
        start.set()
        results = [done.get() for _ in procs]
        t2 = time.perf_counter()
        spans = sum(len(client.query_spans(rid)) for rid in ids)
        t3, cpu = time.perf_counter(), time.process_time() - cpu0
        for p in procs:
            p.join()
    assert sum(c for c, _ in results) == n and spans == n * s, (results, spans)
    return _phases(t0, t1, t2, t3, cpu, results)


def _phases(t0: float, t1: float, t2: float, t3: float, cpu: float, results: list) -> dict[str, float]:
    return {"enqueue_s": t1 - t0, "run_s": t2 - t1, "query_s": t3 - t2, "total_s": t3 - t0,
            "server_cpu_s": cpu, "runner_cpu_s": sum(c for _, c in results)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", "--rollouts", type=int, default=1000, help="rollouts enqueued (N)")
    parser.add_argument("-k", "--runners", type=int, default=2, help="runner processes (K), the same on both sides")
    parser.add_argument("-s", "--spans", type=int, default=8, help="spans per rollout (S)")
    parser.add_argument("--modes", default="agl,batch,each",
                        help="comma-separated subset of agl, batch (ours, one add_otel_spans per rollout), "
                        "each (ours, one request per span)")
    args = parser.parse_args(argv)
    import importlib.util

    if importlib.util.find_spec("agentlightning") is None:
        print("agentlightning is not importable here; use the side venv of bench/README.md", file=sys.stderr)
        return 2
    from importlib.metadata import version

    n, k, s = args.rollouts, args.runners, args.spans
    ctx = mp.get_context("spawn")  # the servers run threads in this process: no fork
    # our server's uvicorn picks uvloop when it is installed (loop="auto"); agentlightning's asks for asyncio's loop
    loop = f"uvloop {version('uvloop')}" if importlib.util.find_spec("uvloop") else "asyncio's loop (no uvloop)"
    print(f"agentlightning {version('agentlightning')}, lightning-nb {version('lightning-nb')}, python "
          f"{sys.version.split()[0]}, our server on {loop}; N={n} rollouts, K={k} runner processes, S={s} "
          f"spans/rollout; load average {os.getloadavg()[0]:.2f}", flush=True)
    labels = {"agl": "agentlightning LightningStoreServer", "batch": "lightning-nb StoreServer, add_otel_spans",
              "each": "lightning-nb StoreServer, span per request"}
    results = {}
    for mode in args.modes.split(","):
        if mode not in labels:
            parser.error(f"unknown mode {mode!r}")
        # each run starts from a collected heap: the run after agentlightning's otherwise pays, at random, for a
        # full collection over the ~870k objects its imports (litellm, ...) leave in this process (0.5 s)
        gc.collect()
        load = os.getloadavg()[0]
        results[mode] = bench_agl(ctx, n, k, s) if mode == "agl" else bench_ours(ctx, n, k, s, mode == "batch")
        print(f"  done: {labels[mode]} in {results[mode]['total_s']:.2f} s (load average before: {load:.2f})",
              flush=True)
    theirs = n / results["agl"]["total_s"] if "agl" in results else None
    print(f"{'server':40s} {'enqueue s':>9s} {'run s':>7s} {'query s':>7s} {'main CPU s':>10s} {'runners CPU s':>13s} "
          f"{'rollouts/s':>10s} {'vs agl':>7s}")
    for mode, r in results.items():
        rate = n / r["total_s"]
        ratio = f"{rate / theirs:6.1f}x" if theirs else "     -"
        print(f"{labels[mode]:40s} {r['enqueue_s']:9.3f} {r['run_s']:7.3f} {r['query_s']:7.3f} "
              f"{r['server_cpu_s']:10.2f} {r['runner_cpu_s']:13.2f} {rate:10.1f} {ratio}")
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
