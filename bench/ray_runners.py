"""Rollouts/s with 1 and 2 Ray runner actors (``start_runners(..., backend="ray")``) on this machine.

Run from the repo root with the project's venv (Ray comes with the ``ray`` extra)::

    .venv/bin/python bench/ray_runners.py                 # N=300 rollouts per run, actors 1 and 2
    .venv/bin/python bench/ray_runners.py -n 1000 --actors 1 2 4

A local Ray cluster is started (``init_local_ray``: ``ray.init(num_cpus=<cores>, include_dashboard=False)``).
The store is an ``InMemoryStore`` served on 127.0.0.1 by ``StoreServer`` (started by
``start_runners``), so every store call of an actor is an HTTP request. The agent is cheap
(no model): one tool span, a returned reward (a reward span) and the agent span, 3 spans
per rollout. For each actor count: start the actors (timed separately), enqueue N rollouts,
wait until all are terminal; rollouts/s = N / (enqueue + wait). The same workload with the
thread backend (in-process store, no HTTP) is printed for reference.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from lightning_nb import InMemoryStore, semconv, start_runners, tool_span
from lightning_nb.types import LLMResource


def cheap_agent(task, llm):
    with tool_span("square", task) as span:
        span.set_attribute(semconv.TOOL_OUTPUT, str(task * task))
    return float(task % 2)


def run_once(n: int, runners: int, backend: str, **options) -> dict[str, float]:
    store = InMemoryStore()
    store.add_resources({"main_llm": LLMResource(endpoint="http://127.0.0.1:9/v1", model="m")})
    t0 = time.perf_counter()
    group = start_runners(cheap_agent, store, n=runners, backend=backend, **options)
    t1 = time.perf_counter()
    try:
        ids = [store.enqueue_rollout(i).rollout_id for i in range(n)]
        done = store.wait_for_rollouts(ids, timeout=600)
        t2 = time.perf_counter()
    finally:
        group.stop(timeout=30)
    ok = sum(r.status == "succeeded" for r in done)
    spans = len(store.query_spans())
    assert ok == n and spans == 3 * n, (ok, spans)
    return {"start_s": t1 - t0, "run_s": t2 - t1, "rate": n / (t2 - t1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", "--rollouts", type=int, default=300)
    parser.add_argument("--actors", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args(argv)
    from lightning_nb.runners.ray import init_local_ray

    cores = os.cpu_count() or 1
    t0 = time.perf_counter()
    ray = init_local_ray(max(cores, max(args.actors)))
    print(f"ray {ray.__version__}: local cluster with {cores} cores started in {time.perf_counter() - t0:.1f} s; "
          f"N={args.rollouts} rollouts, 3 spans each; python {sys.version.split()[0]}")
    print(f"{'backend':8s} {'runners':>7s} {'start s':>8s} {'run s':>7s} {'rollouts/s':>11s}")
    try:
        for k in args.actors:
            r = run_once(args.rollouts, k, "ray", num_cpus=1)
            print(f"{'ray':8s} {k:7d} {r['start_s']:8.1f} {r['run_s']:7.2f} {r['rate']:11.1f}")
        for k in args.actors:
            r = run_once(args.rollouts, k, "threads")
            print(f"{'threads':8s} {k:7d} {r['start_s']:8.2f} {r['run_s']:7.2f} {r['rate']:11.1f}")
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
