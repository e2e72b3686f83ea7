"""InMemoryStore's CPU per call on agent-lightning's store workload, one thread: where a rollout's store work goes.

A companion of ``store_agl_workload.py`` (same side venv, same ``--agl-benchmark`` file): it records
agent-lightning's benchmark agent on ``-n`` tasks once, then replays the calls that script's runner loop
and algorithm make, on one thread and without agent-lightning's code in the timed part: per batch of
256, ``add_resources``, the enqueues; per rollout ``dequeue_rollout``, ``get_resources_by_id``,
``update_attempt(running)``, the ``span_from_otel`` conversion of its ~14 spans, one ``add_spans``
(where the store has ``add_otel_spans``, as our ``Tracer`` then writes: one ``add_otel_spans`` of the
``ReadableSpan`` objects, counted under ``add_spans``, ``convert`` 0), ``update_attempt(succeeded)``;
then ``--polls`` ``wait_for_rollouts(ids, timeout=0)`` over the batch and
``query_spans(rid, "latest")`` of each finished rollout. Prints the CPU µs per rollout of each step
(``time.thread_time``, best of ``--reps`` fresh stores), so no lock or GIL hand-over is in it.

``--lightning-nb PATH`` imports ``lightning_nb`` from ``PATH`` (a folder holding an export of another commit,
``git archive <commit> lightning_nb | tar -x -C PATH``) instead of the installed one, for before/after::

    LITELLM_LOCAL_MODEL_COST_MAP=True /tmp/al/bin/python bench/store_agl_calls.py --agl-benchmark $AGL
    ... --lightning-nb /tmp/before
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import sys
import time
from pathlib import Path

STEPS = ("enqueue", "dequeue", "resources", "running", "convert", "add_spans", "succeeded", "wait", "query_spans")


def replay(store, tasks, recordings, batch, polls) -> dict[str, float]:
    """One pass over ``tasks`` on ``store``; CPU seconds per step."""
    from lightning_nb.tracing.tracer import span_from_otel
    from lightning_nb.types import LLMResource

    t = dict.fromkeys(STEPS, 0.0)
    otel = hasattr(store, "add_otel_spans")
    clock = time.thread_time
    for b0 in range(0, len(tasks), batch):
        store.add_resources({"llm": LLMResource(endpoint="http://localhost:0/v1", model="m")})
        t0 = clock()
        ids = [store.enqueue_rollout(task, mode="train").rollout_id for task in tasks[b0:b0 + batch]]
        t["enqueue"] += clock() - t0
        for _ in ids:
            t0 = clock()
            item = store.dequeue_rollout("w-1", timeout=0.2)
            t1 = clock()
            rid, aid = item.rollout.rollout_id, item.attempt.attempt_id
            store.get_resources_by_id(item.rollout.resources_id)
            t2 = clock()
            store.update_attempt(rid, aid, status="running", worker_id="w-1")
            t3 = clock()
            if otel:  # what our Tracer does: the ReadableSpans to the store, which converts them
                t4 = clock()
                store.add_otel_spans(rid, aid, recordings[item.rollout.input])
            else:
                spans = [span_from_otel(s, rid, aid) for s in recordings[item.rollout.input]]
                t4 = clock()
                store.add_spans(spans)
            t5 = clock()
            store.update_attempt(rid, aid, status="succeeded")
            t6 = clock()
            for step, (a, b) in zip(STEPS[1:7], ((t0, t1), (t1, t2), (t2, t3), (t3, t4), (t4, t5), (t5, t6))):
                t[step] += b - a
        t0 = clock()
        for _ in range(polls):
            done = store.wait_for_rollouts(ids, timeout=0.0)
        t["wait"] += clock() - t0
        t0 = clock()
        for r in done:
            store.query_spans(r.rollout_id, "latest")
        t["query_spans"] += clock() - t0
    return t


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agl-benchmark", required=True, help="agent-lightning's tests/benchmark/benchmark_store.py")
    parser.add_argument("-n", type=int, default=512, help="rollouts (tasks) per pass")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--polls", type=int, default=4, help="wait_for_rollouts calls per batch")
    parser.add_argument("--reps", type=int, default=7, help="passes (fresh stores); the best of each step counts")
    parser.add_argument("--lightning-nb", default=None, help="import lightning_nb from this folder instead")
    args = parser.parse_args()
    if args.lightning_nb:  # ahead of the installed (editable) package and its import finder
        sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
        sys.path.insert(0, str(Path(args.lightning_nb).resolve()))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import store_agl_workload as workload

    import lightning_nb
    from lightning_nb.store import InMemoryStore

    random.seed(0)
    bm = workload.load_agl_benchmark(args.agl_benchmark, 0.02)
    record = workload.make_recorder(bm, 6, 0.0)
    tasks = [f"task-{i}-generated" for i in range(args.n)]

    async def record_all():
        return {task: await record(task) for task in tasks}

    recordings = asyncio.run(record_all())
    best = None
    for _ in range(args.reps):
        gc.collect()
        t = replay(InMemoryStore(), tasks, recordings, args.batch_size, args.polls)
        best = t if best is None else {k: min(best[k], t[k]) for k in t}
    print(f"lightning_nb from {Path(lightning_nb.__file__).parent}; {args.n} rollouts, "
          f"{workload.describe(recordings)}")
    print("CPU µs per rollout (best of passes): " + ", ".join(f"{k} {v / args.n * 1e6:.1f}" for k, v in best.items())
          + f"; total {sum(best.values()) / args.n * 1e6:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
