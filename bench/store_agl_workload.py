"""Store throughput on agent-lightning's own store benchmark workload: agentlightning 0.3.0 vs lightning-nb, one run.

Installs nothing and contains none of agent-lightning's code: it imports agent-lightning's
``tests/benchmark/benchmark_store.py`` (and its ``utils.py`` beside it) at run time from the path
given with ``--agl-benchmark``. Run it in a side venv where both packages import::

    python3 -m venv /tmp/al
    /tmp/al/bin/pip install agentlightning==0.3.0 torch==2.13.0   # the CPU build on this machine's disk
                                                              # (as the Makefile installs it); unpinned pulls CUDA
    /tmp/al/bin/pip install -e /work/main                         # this repo (lightning-nb)
    # agent-lightning's repository (microsoft/agent-lightning) at tag v0.3.0, checked out in /tmp/agl-src
    LITELLM_LOCAL_MODEL_COST_MAP=True /tmp/al/bin/python bench/store_agl_workload.py \\
        --agl-benchmark /tmp/agl-src/tests/benchmark/benchmark_store.py   # N=2048, batches of 256, 32 runners
    ... --keys repeated          # attribute keys reused across spans instead of fresh ones
    ... --stores memory,sqlite-FULL --runners 1 --profile /tmp/p     # ours only, cProfile top 25
    ... --store-cpu              # also: CPU inside store calls per rollout, ratio to agentlightning

What is agent-lightning's (used as is, imported from ``--agl-benchmark``):

* the agent, ``make_agent(max_rounds, sleep_seconds)``: 1..max_rounds rounds, each an ``agent{i}``
  span with two nested ``round{i}_1``/``round{i}_2`` spans carrying ``generate_attributes()``
  (a random nested dict flattened to dotted keys: random key strings, fresh for every span,
  values of 5-300 random characters; the task name on one span), a reward (``agl.emit_reward``)
  after half of the rounds, then a ``final`` span with attributes and a final reward. With the
  CI "minimal production scale" setting (``--max-rounds 6``) that is ~14 spans and ~40 kB of
  attributes per rollout; the script prints what it got. The OTel SDK's default span limits
  apply (at most 128 attributes per span), as in agent-lightning's own runs;
* the algorithm, ``AlgorithmBatch(mode="batch").algorithm_batch``: per batch it adds a
  resources set, enqueues ``--batch-size`` rollouts (``task-<i>-generated``), then polls
  ``wait_for_rollouts(timeout=0)``, reads every finished rollout's spans
  (``query_spans(rollout_id, attempt_id="latest")``) and checks them with its ``check_spans``
  (task found, final reward in [1, 2]), until the batch is done, then the next batch;
* ``check_spans`` and ``agl.find_final_reward`` on our spans too (they read ``name``/``attributes``).

What is adapted (nothing else):

* the algorithm's ``await asyncio.sleep(5.0)`` between polls becomes ``--poll-s`` (default
  0.02 s): the module's ``asyncio`` name is replaced by a copy whose ``sleep`` maps exactly
  5.0 s to ``--poll-s`` (a 5 s poll would measure the sleep, not the store);
* the agent sleeps ``--sleep-seconds`` (default 0; agent-lightning's CI uses 0.5 to mimic an LLM);
* by default the agent runs before timing: every task's spans are recorded once
  (``make_agent``'s coroutine under an OTel SDK ``TracerProvider`` whose processor keeps the
  finished ``ReadableSpan`` objects) and every store gets exactly the same spans, so the time is
  the stores' own. ``--agent-in-loop`` runs the agent inside the timed loop instead (its cost,
  the same for every store, then dilutes the ratios; spans/s then counts the recorded spans, while
  the loop makes new ones: same distribution, a slightly different total);
* ``--keys repeated`` replaces ``generate_attributes`` by one that reuses the keys of a pool of
  ``--key-pool`` dicts drawn from the real ``generate_attributes`` once, with fresh values of the
  same lengths (agent-lightning's generator itself has no such switch); ``fresh`` (default) is
  agent-lightning's own;
* agent-lightning runs its stores in a separate server with 32 runner *processes*; here
  everything is one process (2-core VM), runners are threads.

How each store is driven (timed: from the algorithm's first call to its return, i.e. all
batches enqueued, run, polled, span-queried and checked; runner threads are started before and
idle-poll until then):

* agentlightning ``InMemoryLightningStore`` as its shared-memory execution strategy drives it:
  wrapped in ``LightningStoreThreaded``; the algorithm runs in the main thread's event loop
  (``asyncio.run``); each of ``--runners`` threads runs its own event loop that awaits the
  calls its ``LitAgentRunner`` makes per rollout: ``dequeue_rollout(worker_id=...)`` (sleeps
  ``--runner-poll-s`` when it returns None), ``get_resources_by_id``/``get_latest_resources``,
  ``add_otel_span`` per span, ``update_attempt(status="succeeded")``. (Its runners' heartbeat
  loop, one ``update_worker`` per 10 s, is left out.)
* lightning-nb ``InMemoryStore``, ``SqliteStore(path, synchronous="FULL")`` (the durable
  default) and ``"NORMAL"``: the same algorithm coroutine in the main thread's event loop, through
  ``AglStoreAdapter`` (async methods that call our synchronous, thread-safe store directly);
  each runner thread is a plain thread, no event loop, doing what our ``Runner`` does per rollout:
  ``dequeue_rollout(worker, timeout=--dequeue-timeout-s)`` (a wait that the next enqueue ends;
  default: ``Runner``'s ``poll_interval_s``, 0.2 s), the resources,
  ``update_attempt(status="running")`` (one call more than theirs), the spans converted from the
  ``ReadableSpan`` to ``lightning_nb.types.Span`` (ids, name, times, status, flat attribute dict:
  ``tracer.span_from_otel``, what our ``StoreSpanProcessor`` does) and written with one
  ``add_spans`` (our ``Tracer`` buffers an attempt's spans and writes them when the attempt ends,
  or ``span_flush_s`` after a span ended; this agent runs in well under that; where the store has
  ``add_otel_spans``, as our ``Tracer`` then does, the ``ReadableSpan`` objects go to it as they
  are and the store converts them), then
  ``update_attempt(status="succeeded")``. ``--span-writes each`` writes them one ``add_span`` at a
  time instead, as agent-lightning's runner does (and as ``Tracer(span_flush_s=0)`` would).
* the ceiling, ``MinimalStore`` (issue 32): only the calls the harness makes, on dicts and a deque
  behind one lock and a condition, no copies, no checks, no status machine, workers or watchdog,
  driven by exactly our runner loop and adapter. ``ceiling`` keeps the runners' ``ReadableSpan``
  objects as they are (agent-lightning's ``check_spans`` reads them); ``ceiling-aglspan`` converts
  each with agent-lightning's own ``Span.from_opentelemetry`` (what its ``add_otel_span`` does). No
  store that copies what it is given and hands out copies, as ours must, can reach ``ceiling``; it
  says how much of a run is the harness's own (its algorithm, ``check_spans``, polls, threads).

Prints per store: seconds, process CPU seconds, the CPU seconds of the algorithm thread / of all
runner threads (``alg/run``; the runners' includes their idle polling), rollouts/s, spans/s and
the ratio to agentlightning, then ``spans_df()`` seconds on each of our stores after its run, then for
each of our stores its ratio to agentlightning (targets from issues 12 and 32: InMemoryStore >= 10x,
SqliteStore FULL >= 2x) and to each ceiling run (ours / ceiling: 1.0 would be a store that costs nothing). ``--store-cpu`` also sums the CPU time
spent inside the store calls (every thread; ours with the runners' span conversion, which
agent-lightning's ``add_otel_span`` does inside its store) and prints it per rollout and per call,
with the ratio to agentlightning's: the store's own work, without the benchmark's algorithm
(``check_spans``, its polls) and the threads' hand-offs. ``--profile PATH`` profiles every
thread of our stores' runs (one cProfile per thread, merged; each on its thread's CPU clock,
``time.thread_time``, so time blocked on a lock or waiting for the GIL does not count) and prints
the top 25 by tottime. The machine's other
load matters: quote numbers with the load they were measured under (Linux's load average also
counts this script's runnable threads).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import gc
import importlib
import io
import os
import pstats
import random
import sys
import tempfile
import threading
import time
import types
from collections import deque
from pathlib import Path
from typing import Any, Callable, Optional

_ALGORITHM_POLL_S = 5.0  # the constant in AlgorithmBatch.algorithm_batch's `await asyncio.sleep(5.0)`


# ----- agent-lightning's benchmark module, imported from a path --------------------------------
def load_agl_benchmark(path: str, poll_s: float) -> types.ModuleType:
    """Import ``benchmark_store.py`` as a submodule of a package whose folder is its own (so ``from .utils`` works)."""
    file = Path(path).resolve()
    if not file.is_file() or not (file.parent / "utils.py").is_file():
        raise SystemExit(f"--agl-benchmark {path}: need agent-lightning's tests/benchmark/benchmark_store.py "
                         "with its utils.py in the same folder")
    pkg = types.ModuleType("_agl_benchmark")
    pkg.__path__ = [str(file.parent)]
    sys.modules["_agl_benchmark"] = pkg
    module = importlib.import_module(f"_agl_benchmark.{file.stem}")

    real_sleep = asyncio.sleep

    async def sleep(delay: float, result: Any = None) -> Any:
        return await real_sleep(poll_s if delay == _ALGORITHM_POLL_S else delay, result)

    shim = types.ModuleType("asyncio_shim")
    shim.__dict__.update({k: v for k, v in vars(asyncio).items() if not k.startswith("__")})
    shim.sleep = sleep
    module.asyncio = shim
    return module


def make_recorder(bm: types.ModuleType, max_rounds: int, sleep_seconds: float) -> Callable[[str], Any]:
    """``await record(task)`` -> the finished ReadableSpans of one run of agent-lightning's agent on ``task``."""
    import agentlightning as agl
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider

    from opentelemetry.sdk.trace import SpanProcessor

    class SpanCapture(SpanProcessor):
        """Keeps finished spans per thread (one agent runs per thread at a time)."""

        def __init__(self) -> None:
            self.buffers: dict[int, list[Any]] = {}

        def on_end(self, span: Any) -> None:
            buf = self.buffers.get(threading.get_ident())
            if buf is not None:
                buf.append(span)

    provider = TracerProvider()
    capture = SpanCapture()
    provider.add_span_processor(capture)
    trace.set_tracer_provider(provider)  # agl's get_tracer() (the agent's spans) reads the global provider
    # agl.emit_reward goes through agl's active tracer: an OtelTracer on the same provider, without its
    # LightningSpanProcessor (the spans are sent to the stores by the runners, below).
    from agentlightning.tracer.base import get_active_tracer, set_active_tracer

    if get_active_tracer() is None:
        tracer = agl.OtelTracer()
        tracer._tracer_provider = provider
        set_active_tracer(tracer)
    agent = bm.make_agent(max_rounds=max_rounds, sleep_seconds=sleep_seconds)
    resources = {"llm": agl.LLM(endpoint="http://localhost:0/v1", model="test-model-0")}
    rollout = agl.Rollout(rollout_id="ro-record", input="", start_time=time.time())

    async def record(task: str) -> list[Any]:
        key = threading.get_ident()
        capture.buffers[key] = []
        try:
            await agent.rollout_async(task, resources=resources, rollout=rollout)
            return capture.buffers[key]
        finally:
            del capture.buffers[key]

    return record


def use_repeated_keys(bm: types.ModuleType, pool_size: int) -> None:
    """Make ``bm.generate_attributes`` reuse the keys of ``pool_size`` dicts from the real one (values fresh)."""
    real = bm.generate_attributes
    random_string = sys.modules["_agl_benchmark.utils"].random_string
    pool = [{k: len(v) for k, v in real().items()} for _ in range(pool_size)]

    def generate_attributes() -> dict[str, Any]:
        return {k: random_string(n) for k, n in random.choice(pool).items()}

    bm.generate_attributes = generate_attributes


def describe(recordings: dict[str, list[Any]]) -> str:
    spans = sum(len(v) for v in recordings.values())
    nbytes = sum(len(k) + len(str(v)) for rec in recordings.values() for s in rec for k, v in s.attributes.items())
    keys = {k for rec in recordings.values() for s in rec for k in s.attributes}
    return (f"{spans} spans ({spans / len(recordings):.1f}/rollout), {nbytes / len(recordings) / 1000:.1f} kB of "
            f"attributes per rollout, {len(keys):,} distinct attribute keys")


# ----- lightning-nb behind the async API agent-lightning's algorithm calls ---------------------
def to_span(rollout_id: str, attempt_id: str, span: Any) -> Any:
    """An OTel ReadableSpan as a ``lightning_nb.types.Span``: our tracer's own conversion (``span_from_otel``)."""
    from lightning_nb.tracing.tracer import span_from_otel

    return span_from_otel(span, rollout_id, attempt_id)


class AglStoreAdapter:
    """agent-lightning's async store calls used by its benchmark, mapped onto our synchronous store.

    Algorithm side: ``add_resources``, ``enqueue_rollout``, ``wait_for_rollouts``, ``query_spans``,
    ``query_workers`` (only on a stall). Runner side (sync, our runners are threads):
    ``add_otel_span`` -> ``add_span(to_span(...))``. Our ``Rollout``/``Span`` objects are returned as
    they are: the algorithm reads ``rollout_id``/``status``, ``check_spans`` reads ``name``/``attributes``.
    """

    def __init__(self, store: Any, convert: Callable[[str, str, Any], Any] = to_span) -> None:
        self.store, self.convert = store, convert

    async def add_resources(self, resources: dict[str, Any]) -> Any:
        from lightning_nb.types import LLMResource

        ours = {name: LLMResource(endpoint=r.endpoint, model=r.model, sampling_parameters=dict(r.sampling_parameters))
                for name, r in resources.items()}
        return self.store.add_resources(ours)

    async def enqueue_rollout(self, input: Any, mode: Optional[str] = None, **kwargs: Any) -> Any:
        return self.store.enqueue_rollout(input, mode=mode or "train", **kwargs)

    async def wait_for_rollouts(self, *, rollout_ids: list[str], timeout: Optional[float] = None) -> list[Any]:
        return self.store.wait_for_rollouts(rollout_ids, timeout=timeout)

    async def query_spans(self, rollout_id: str, attempt_id: Optional[str] = None) -> list[Any]:
        return self.store.query_spans(rollout_id, attempt_id)

    async def query_workers(self) -> list[Any]:
        return self.store.query_workers()

    def add_otel_span(self, rollout_id: str, attempt_id: str, span: Any) -> Any:
        return self.store.add_span(self.convert(rollout_id, attempt_id, span))


# ----- the ceiling: a minimal store -------------------------------------------------------------
class MinimalStore:
    """Only what the harness calls, as little as a store can do: the ceiling a store could reach here.

    Not a store: dicts and a deque behind one lock and one condition (a runner's
    ``dequeue_rollout(timeout=...)`` waits on it as on ours), no copies in or out, no checks, no
    status machine beyond ``status = <what update_attempt says>``, no workers, no watchdog. Spans
    are kept as given: ``ReadableSpan`` objects with :func:`minimal_raw` (agent-lightning's
    ``check_spans`` reads them as they are), or agent-lightning's own ``Span`` with
    :func:`minimal_agl_span` (the conversion its ``add_otel_span`` does). Driven by the same runner
    loop and algorithm adapter as ours (:func:`bench_ours`), so the difference to ours is the store.
    """

    class _Rollout:
        __slots__ = ("rollout_id", "input", "status", "resources_id")

        def __init__(self, rollout_id: str, input: Any, resources_id: Optional[str]) -> None:
            self.rollout_id, self.input, self.status, self.resources_id = rollout_id, input, "queuing", resources_id

    class _Item:
        __slots__ = ("rollout", "attempt", "attempt_id")

        def __init__(self, rollout: Any, attempt_id: str) -> None:
            self.rollout, self.attempt, self.attempt_id = rollout, self, attempt_id

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queued = threading.Condition(self._lock)
        self._rollouts: dict[str, Any] = {}
        self._queue: deque[Any] = deque()
        self._spans: dict[str, list[Any]] = {}  # attempt_id -> spans as given
        self._latest: dict[str, str] = {}  # rollout_id -> its attempt_id
        self._resources: dict[str, Any] = {}
        self._next = 0

    def add_resources(self, resources: dict[str, Any]) -> Any:
        with self._lock:
            rid = f"res-{len(self._resources)}"
            self._resources[rid] = types.SimpleNamespace(resources_id=rid, resources=resources)
            return self._resources[rid]

    def get_resources_by_id(self, resources_id: str) -> Any:
        return self._resources[resources_id]

    def get_latest_resources(self) -> Any:
        return self._resources[next(reversed(self._resources))] if self._resources else None

    def enqueue_rollout(self, input: Any, **kwargs: Any) -> Any:
        with self._lock:
            self._next += 1
            res = next(reversed(self._resources)) if self._resources else None
            rollout = self._rollouts[f"ro-{self._next}"] = self._Rollout(f"ro-{self._next}", input, res)
            self._queue.append(rollout)
            self._queued.notify()
            return rollout

    def dequeue_rollout(self, worker_id: Optional[str] = None, timeout: float = 0.0) -> Any:
        deadline = time.monotonic() + timeout
        with self._lock:
            while not self._queue:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._queued.wait(remaining)
            rollout = self._queue.popleft()
            rollout.status = "preparing"
            aid = self._latest[rollout.rollout_id] = f"at-{rollout.rollout_id}"
            self._spans[aid] = []
            return self._Item(rollout, aid)

    def update_attempt(self, rollout_id: str, attempt_id: str, *, status: Optional[str] = None, **kwargs: Any) -> None:
        with self._lock:
            self._rollouts[rollout_id].status = status

    def add_spans(self, items: list[tuple[str, Any]]) -> None:
        with self._lock:
            for attempt_id, span in items:
                self._spans[attempt_id].append(span)

    def wait_for_rollouts(self, rollout_ids: list[str], timeout: Optional[float] = None) -> list[Any]:
        with self._lock:  # the harness polls (timeout=0)
            return [r for r in map(self._rollouts.__getitem__, rollout_ids) if r.status == "succeeded"]

    def query_spans(self, rollout_id: str, attempt_id: Optional[str] = None) -> list[Any]:
        with self._lock:
            return self._spans[self._latest[rollout_id]]

    def query_workers(self) -> list[Any]:
        return []


CEILING = "minimal dict store (ceiling)"
CEILING_AGL_SPAN = "minimal dict store + agl span conversion"


def minimal_raw(rollout_id: str, attempt_id: str, span: Any) -> tuple[str, Any]:
    """:class:`MinimalStore`'s span as the runner has it: the OTel ``ReadableSpan`` itself."""
    return attempt_id, span


def minimal_agl_span(rollout_id: str, attempt_id: str, span: Any) -> tuple[str, Any]:
    """:class:`MinimalStore`'s span as agent-lightning's ``add_otel_span`` converts it (``Span.from_opentelemetry``)."""
    from agentlightning.types import Span as AglSpan

    return attempt_id, AglSpan.from_opentelemetry(span, rollout_id=rollout_id, attempt_id=attempt_id, sequence_id=0)


# ----- the run ---------------------------------------------------------------------------------
class Profiles:
    """One cProfile per thread, merged at the end (cProfile sees only the thread that enabled it)."""

    def __init__(self, on: bool) -> None:
        self.on, self.done, self.lock = on, [], threading.Lock()

    @contextlib.contextmanager
    def thread(self) -> Any:
        if not self.on:
            yield
            return
        prof = cProfile.Profile(time.thread_time)  # this thread's CPU: time blocked on a lock does not count
        prof.enable()
        try:
            yield
        finally:
            prof.disable()
            with self.lock:
                self.done.append(prof)

    def stats(self) -> Optional[pstats.Stats]:
        if not self.done:
            return None
        stats = pstats.Stats(self.done[0])
        for prof in self.done[1:]:
            stats.add(prof)
        return stats


class StoreCpu:
    """CPU seconds spent inside store calls, per call name, summed over every thread (``--store-cpu``).

    Wraps the methods the benchmark calls on the store object the algorithm and runners use
    (agent-lightning: its ``LightningStoreThreaded``, lock wait included, as ours), with
    ``time.thread_time`` around each call; ours also counts the runners' ReadableSpan -> Span
    conversion (``span_from_otel``), which agent-lightning's ``add_otel_span`` does inside the store.
    About 1 µs per call of overhead, in both runs.
    """

    def __init__(self) -> None:
        self.cpu: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._lock = threading.Lock()
        self._local = threading.local()  # only the outermost timed call of a thread counts

    def add(self, name: str, seconds: float) -> None:
        with self._lock:
            self.cpu[name] = self.cpu.get(name, 0.0) + seconds
            self.calls[name] = self.calls.get(name, 0) + 1

    def wrap(self, obj: Any, names: list[str]) -> None:
        """Replace ``obj.<name>`` (sync or async methods) by timed versions, on the instance."""
        for name in names:
            fn = getattr(obj, name, None)
            if fn is None:  # the minimal store has only the calls the harness makes
                continue
            setattr(obj, name, self.timed_async(name, fn) if asyncio.iscoroutinefunction(fn)
                    else self.timed(name, fn))

    def timed(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        local = self._local

        def timed(*args: Any, **kwargs: Any) -> Any:
            if getattr(local, "inside", False):  # a store call made by another (add_otel_spans -> add_spans)
                return fn(*args, **kwargs)
            local.inside, cpu = True, time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                local.inside = False
                self.add(name, time.thread_time() - cpu)
        return timed

    def timed_async(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        async def timed(*args: Any, **kwargs: Any) -> Any:
            cpu = time.thread_time()
            try:
                return await fn(*args, **kwargs)
            finally:
                self.add(name, time.thread_time() - cpu)
        return timed

    def total(self) -> float:
        return sum(self.cpu.values())


_AGL_CALLS = ["add_resources", "enqueue_rollout", "wait_for_rollouts", "query_spans", "query_workers",
              "dequeue_rollout", "get_resources_by_id", "get_latest_resources", "add_otel_span", "update_attempt"]
_OUR_CALLS = ["add_resources", "enqueue_rollout", "wait_for_rollouts", "query_spans", "query_workers",
              "dequeue_rollout", "get_resources_by_id", "get_latest_resources", "add_spans", "add_span",
              "add_otel_spans", "update_attempt"]


def run_workload(bm: types.ModuleType, store: Any, runner_target: Callable[[threading.Event], int], n: int,
                 batch_size: int, runners: int, profiles: Profiles) -> dict[str, float]:
    """Start the runner threads, time agent-lightning's batch algorithm on ``store``, stop the runners."""
    stop = threading.Event()
    done: list[int] = []
    runner_cpu: list[float] = []

    def runner() -> None:
        with profiles.thread():
            cpu = time.thread_time()
            done.append(runner_target(stop))
            runner_cpu.append(time.thread_time() - cpu)

    threads = [threading.Thread(target=runner, daemon=True) for _ in range(runners)]
    for t in threads:
        t.start()
    algorithm = bm.AlgorithmBatch(mode="batch", total_tasks=n, batch_size=batch_size)
    algorithm.set_store(store)
    cpu0, t0, alg_cpu0 = time.process_time(), time.perf_counter(), time.thread_time()
    try:
        with profiles.thread(), contextlib.redirect_stdout(io.StringIO()):  # its "Submitting batch" lines
            asyncio.run(algorithm.algorithm_batch(n, batch_size))
        seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        alg_cpu = time.thread_time() - alg_cpu0
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert sum(done) == n, (sum(done), n)
    return {"s": seconds, "cpu_s": cpu, "alg_cpu_s": alg_cpu, "runner_cpu_s": sum(runner_cpu)}


def bench_agentlightning(bm, spans_for, n, batch_size, runners, runner_poll_s,
                         store_cpu: Optional[StoreCpu] = None) -> dict[str, float]:
    from agentlightning.store import InMemoryLightningStore
    from agentlightning.store.threading import LightningStoreThreaded

    store = LightningStoreThreaded(InMemoryLightningStore())
    if store_cpu is not None:
        store_cpu.wrap(store, _AGL_CALLS)

    async def loop(stop: threading.Event) -> int:
        worker, count = f"w-{threading.get_ident()}", 0
        while not stop.is_set():
            item = await store.dequeue_rollout(worker_id=worker)
            if item is None:
                await asyncio.sleep(runner_poll_s)
                continue
            rid, aid = item.rollout_id, item.attempt.attempt_id
            if item.resources_id:
                await store.get_resources_by_id(item.resources_id)
            else:
                await store.get_latest_resources()
            for span in await spans_for(item.input):
                await store.add_otel_span(rid, aid, span)
            await store.update_attempt(rid, aid, status="succeeded")
            count += 1
        return count

    result = run_workload(bm, store, lambda stop: asyncio.run(loop(stop)), n, batch_size, runners, Profiles(False))
    if store_cpu is not None:
        result["store_cpu"] = store_cpu
    return result


def bench_ours(bm, store, spans_for, n, batch_size, runners, dequeue_timeout_s, agent_in_loop, profiles,
               batched: bool = True, store_cpu: Optional[StoreCpu] = None,
               to_store: Callable[[str, str, Any], Any] = to_span) -> dict:
    """Our runner loop on ``store`` (ours, or :class:`MinimalStore` with its own ``to_store`` conversion)."""
    convert = to_store
    if store_cpu is not None:
        store_cpu.wrap(store, _OUR_CALLS)
        convert = store_cpu.timed("span_from_otel" if to_store is to_span else "span conversion", to_store)
    adapter = AglStoreAdapter(store, convert)
    otel = batched and to_store is to_span and hasattr(store, "add_otel_spans")  # our stores (the ceiling: no)

    def loop(stop: threading.Event) -> int:
        worker, count = f"w-{threading.get_ident()}", 0
        event_loop = asyncio.new_event_loop() if agent_in_loop else None  # only to run agl's async agent
        try:
            while not stop.is_set():
                item = store.dequeue_rollout(worker, timeout=dequeue_timeout_s)
                if item is None:
                    continue
                rollout, rid, aid = item.rollout, item.rollout.rollout_id, item.attempt.attempt_id
                if rollout.resources_id:
                    store.get_resources_by_id(rollout.resources_id)
                else:
                    store.get_latest_resources()
                store.update_attempt(rid, aid, status="running", worker_id=worker)
                spans = spans_for(rollout.input)
                spans = event_loop.run_until_complete(spans) if event_loop else spans
                if otel:  # as our Tracer writes an open attempt's spans: one add_otel_spans when it closes
                    store.add_otel_spans(rid, aid, spans)
                elif batched:  # the ceiling (and a lightning_nb without add_otel_spans): converted, one add_spans
                    store.add_spans([convert(rid, aid, span) for span in spans])
                else:
                    for span in spans:
                        adapter.add_otel_span(rid, aid, span)
                store.update_attempt(rid, aid, status="succeeded")
                count += 1
        finally:
            if event_loop is not None:
                event_loop.close()
        return count

    result = run_workload(bm, adapter, loop, n, batch_size, runners, profiles)
    if store_cpu is not None:
        result["store_cpu"] = store_cpu
    if hasattr(store, "spans_df"):
        t0 = time.perf_counter()
        df = store.spans_df()
        result["spans_df_s"], result["spans_df_rows"] = time.perf_counter() - t0, len(df)
    return result


def print_store_cpu(results: dict[str, dict[str, Any]], n: int) -> None:
    """``--store-cpu``: CPU µs per rollout inside store calls, per call and in all, with the ratio to agentlightning."""
    base = results.get("agentlightning InMemoryLightningStore", {}).get("store_cpu")
    print("CPU inside store calls (all threads), µs per rollout; ratio: agentlightning's total / this store's")
    for label, r in results.items():
        acc = r["store_cpu"]
        ratio = f" ({base.total() / acc.total():.1f}x)" if base is not None else ""
        calls = ", ".join(f"{name} {cpu / n * 1e6:.0f}" for name, cpu in sorted(acc.cpu.items(), key=lambda x: -x[1]))
        print(f"  {label}: {acc.total() / n * 1e6:.0f}{ratio}; {calls}")


_CEILINGS = {"ceiling": (CEILING, minimal_raw), "ceiling-aglspan": (CEILING_AGL_SPAN, minimal_agl_span)}


def print_ratios(results: dict[str, dict[str, Any]], n: int) -> None:
    """Each of our stores against agentlightning (targets of issue 32) and against the minimal store (the ceiling)."""
    rate = {label: n / r["s"] for label, r in results.items()}
    theirs = rate.get("agentlightning InMemoryLightningStore")
    targets = {"lightning-nb InMemoryStore": 10, "lightning-nb SqliteStore FULL": 2}
    for label in rate:
        if not label.startswith("lightning-nb"):
            continue
        parts = []
        if theirs:
            ratio = rate[label] / theirs
            met = f" (target >= {targets[label]}x: {'met' if ratio >= targets[label] else 'MISSED'})" \
                if label in targets else ""
            parts.append(f"/ agentlightning {ratio:.1f}x{met}")
        for ceiling in (CEILING, CEILING_AGL_SPAN):
            if ceiling in rate:
                parts.append(f"/ {ceiling} {rate[label] / rate[ceiling]:.2f}")
        print(f"{label} " + "; ".join(parts))
    if theirs:
        for ceiling in (CEILING, CEILING_AGL_SPAN):
            if ceiling in rate:
                print(f"{ceiling} / agentlightning: {rate[ceiling] / theirs:.1f}x")


def _runner_poll_default() -> float:
    """Our Runner's default ``poll_interval_s``: the timeout it passes to ``dequeue_rollout``."""
    import inspect

    from lightning_nb.runners.runner import Runner

    return inspect.signature(Runner.__init__).parameters["poll_interval_s"].default


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agl-benchmark", required=True,
                        help="agent-lightning's tests/benchmark/benchmark_store.py (v0.3.0), utils.py beside it")
    parser.add_argument("-n", "--total-tasks", type=int, default=2048, help="rollouts (agl: --total-tasks)")
    parser.add_argument("--batch-size", type=int, default=256, help="rollouts per batch (agl: --batch-size)")
    parser.add_argument("--runners", type=int, default=32, help="runner threads (agl: --n-runners, processes there)")
    parser.add_argument("--max-rounds", type=int, default=6, help="agent rounds at most (agl CI minimal scale: 6)")
    parser.add_argument("--sleep-seconds", type=float, default=0.0, help="agent sleep per span, up to (agl CI: 0.5)")
    parser.add_argument("--keys", choices=("fresh", "repeated"), default="fresh",
                        help="fresh: agl's generate_attributes (new random keys per span); repeated: keys from a pool")
    parser.add_argument("--key-pool", type=int, default=8, help="attribute dicts whose keys --keys repeated reuses")
    parser.add_argument("--agent-in-loop", action="store_true", help="run agl's agent inside the timed loop")
    parser.add_argument("--span-writes", choices=("batch", "each"), default="batch",
                        help="our runners: batch = one add_spans per attempt (what our Tracer does), "
                        "each = one add_span per span (what agl's runner does)")
    parser.add_argument("--poll-s", type=float, default=0.02, help="algorithm's poll interval (agl: 5.0)")
    parser.add_argument("--runner-poll-s", type=float, default=0.01,
                        help="agl's runners: sleep between dequeue_rollout calls that found nothing")
    parser.add_argument("--dequeue-timeout-s", type=float, default=_runner_poll_default(),
                        help="our runners: dequeue_rollout's timeout, a wait woken by the next enqueue (default: "
                        "lightning_nb.runners.runner.Runner's poll_interval_s)")
    parser.add_argument("--stores", default="agl,ceiling,ceiling-aglspan,memory,sqlite-FULL,sqlite-NORMAL",
                        help="comma-separated subset of agl, ceiling (MinimalStore keeping the ReadableSpans), "
                        "ceiling-aglspan (MinimalStore with agl's span conversion), memory, sqlite-FULL, "
                        "sqlite-NORMAL")
    parser.add_argument("--tmp", default=None, help="folder for the SQLite files (default: the system temp folder)")
    parser.add_argument("--seed", type=int, default=0, help="random seed for agl's generator")
    parser.add_argument("--store-cpu", action="store_true",
                        help="also sum the CPU time spent inside store calls (every thread; ours with the span "
                        "conversion) and print it per rollout with its ratio to agentlightning's")
    parser.add_argument("--profile", default=None, metavar="PATH",
                        help="cProfile our stores' runs (all threads, merged) into PATH.<store>; "
                        "print the top 25 by tottime")
    args = parser.parse_args(argv)
    try:
        import agentlightning  # noqa: F401
    except ImportError:
        print("agentlightning is not importable here; make the side venv described at the top of this file",
              file=sys.stderr)
        return 2
    from importlib.metadata import version

    from lightning_nb.store import InMemoryStore, SqliteStore

    random.seed(args.seed)
    bm = load_agl_benchmark(args.agl_benchmark, args.poll_s)
    if args.keys == "repeated":
        use_repeated_keys(bm, args.key_pool)
    record = make_recorder(bm, args.max_rounds, args.sleep_seconds)
    n, b, k = args.total_tasks, args.batch_size, args.runners
    tasks = [f"task-{i}-generated" for i in range(n)]  # the names algorithm_batch gives them
    print(f"agentlightning {version('agentlightning')}, lightning-nb {version('lightning-nb')}, python "
          f"{sys.version.split()[0]}; N={n}, batch={b}, runners={k}, max_rounds={args.max_rounds}, "
          f"keys={args.keys}, agent {'in the timed loop' if args.agent_in_loop else 'recorded before timing'}, "
          f"our span writes: {args.span_writes}; "
          f"load average {os.getloadavg()[0]:.2f}")

    t0 = time.perf_counter()

    async def record_all() -> dict[str, list[Any]]:
        return {task: await record(task) for task in tasks}

    recordings = asyncio.run(record_all())
    print(f"agent output ({time.perf_counter() - t0:.1f} s to make): {describe(recordings)}")
    total_spans = sum(len(v) for v in recordings.values())
    if args.agent_in_loop:
        ours_spans_for, agl_spans_for = record, record  # ours: a coroutine the runner thread's loop runs
    else:
        async def agl_spans_for(task: str) -> list[Any]:
            return recordings[task]

        ours_spans_for, agl_spans_for = recordings.__getitem__, agl_spans_for
    if args.agent_in_loop:
        del recordings  # spans are made again in the loop (other random draws, same distribution)

    results: dict[str, dict[str, float]] = {}
    for name in args.stores.split(","):
        gc.collect()
        load = os.getloadavg()[0]
        if name == "agl":
            label = "agentlightning InMemoryLightningStore"
            results[label] = bench_agentlightning(bm, agl_spans_for, n, b, k, args.runner_poll_s,
                                                  StoreCpu() if args.store_cpu else None)
        elif name in _CEILINGS:
            label, convert = _CEILINGS[name]
            results[label] = bench_ours(bm, MinimalStore(), ours_spans_for, n, b, k, args.dequeue_timeout_s,
                                        args.agent_in_loop, Profiles(False), args.span_writes == "batch",
                                        StoreCpu() if args.store_cpu else None, to_store=convert)
        elif name == "memory" or name.startswith("sqlite-"):
            profiles = Profiles(args.profile is not None)
            with contextlib.ExitStack() as stack:
                if name == "memory":
                    label, store = "lightning-nb InMemoryStore", InMemoryStore()
                else:
                    mode = name.split("-", 1)[1]
                    tmp = stack.enter_context(tempfile.TemporaryDirectory(dir=args.tmp))
                    label, store = f"lightning-nb SqliteStore {mode}", SqliteStore(Path(tmp) / "bench.db",
                                                                                    synchronous=mode)
                    stack.callback(store.close)
                results[label] = bench_ours(bm, store, ours_spans_for, n, b, k, args.dequeue_timeout_s,
                                            args.agent_in_loop, profiles, args.span_writes == "batch",
                                            StoreCpu() if args.store_cpu else None)
                del store
            stats = profiles.stats()
            if stats is not None:
                path = f"{args.profile}.{name}"
                stats.dump_stats(path)
                print(f"--- profile of {label} (all threads, cProfile, {path}), top 25 by tottime ---")
                stats.sort_stats("tottime").print_stats(25)
        else:
            parser.error(f"unknown store {name!r}")
        results[label]["load"] = load
        print(f"  done: {label} in {results[label]['s']:.2f} s (load average before: {load:.2f})", flush=True)

    base = results.get("agentlightning InMemoryLightningStore")
    theirs = n / base["s"] if base else None
    print(f"{'store':40s} {'seconds':>8s} {'CPU s':>7s} {'alg/run':>11s} {'rollouts/s':>11s} {'spans/s':>9s} "
          f"{'vs agl':>7s} {'spans_df s':>10s}")
    for label, r in results.items():
        rate = n / r["s"]
        ratio = f"{rate / theirs:6.1f}x" if theirs else "     -"
        sdf = f"{r['spans_df_s']:10.3f}" if "spans_df_s" in r else f"{'-':>10s}"
        split = f"{r['alg_cpu_s']:.2f}/{r['runner_cpu_s']:.2f}"
        print(f"{label:40s} {r['s']:8.2f} {r['cpu_s']:7.2f} {split:>11s} {rate:11.1f} "
              f"{total_spans / r['s']:9.0f} {ratio} {sdf}")
    print_ratios(results, n)
    if args.store_cpu:
        print_store_cpu(results, n)
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
