"""Runners: background threads that take rollouts from the store and run the agent.

:meth:`Runner.step` runs one rollout on demand instead (online mode).

An agent is a plain function ``agent(task, llm) -> reward | None``: ``task`` is
the rollout input, ``llm`` an :class:`~lightning_nb.types.LLMResource` whose
``endpoint`` is an OpenAI-compatible base URL attributed to the current attempt.
Returning a number records it as the final reward; returning None means the
agent called :func:`~lightning_nb.tracer.emit_reward` itself.
"""

from __future__ import annotations

import contextvars
import inspect
import asyncio
import itertools
import logging
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import pandas as pd

from lightning_nb.errors import ConfigError, LightningNbError
from lightning_nb.store.base import LightningStore
from lightning_nb.tracer import Tracer, emit_reward
from lightning_nb.types import AttemptedRollout, LLMResource, Rollout

__all__ = ["Agent", "Runner", "RunnerGroup", "start_runners", "attributed_llm"]

log = logging.getLogger(__name__)
Agent = Callable[[Any, LLMResource], Any]
_RUNNER_IDS = itertools.count()


def attributed_llm(resource: LLMResource, rollout_id: str, attempt_id: str, overrides: Optional[dict] = None) -> LLMResource:
    """The resource with its endpoint pointed at ``/rollout/{id}/attempt/{id}/v1`` on the same proxy.

    Endpoints not ending in ``/v1`` (a third-party server) are left unchanged.
    ``overrides`` (e.g. ``{"temperature": 0.0}`` for validation) update the sampling parameters.
    """
    base = resource.endpoint.rstrip("/")
    endpoint = base
    if base.endswith("/v1") and "/rollout/" not in base:
        endpoint = f"{base[:-3]}/rollout/{rollout_id}/attempt/{attempt_id}/v1"
    sampling = {**resource.sampling_parameters, **(overrides or {})}
    return resource.model_copy(update={"endpoint": endpoint, "sampling_parameters": sampling})


@dataclass
class RunnerStats:
    state: str = "idle"  # idle | running | stopping | stopped
    current_rollout: Optional[str] = None
    succeeded: int = 0
    failed: int = 0
    timed_out: int = 0
    last_heartbeat: float = field(default_factory=time.time)


class Runner:
    """One worker thread. Use :func:`start_runners` to start several.

    Args:
        agent: the agent function.
        store: where rollouts come from and results go.
        tracer: shared OpenTelemetry tracer writing to ``store``.
        default_timeout_s: per-attempt limit when the rollout sets none.
        llm_resource: name of the LLMResource in the resources set.
    """

    def __init__(self, agent: Agent, store: LightningStore, tracer: Tracer, *,
                 default_timeout_s: Optional[float] = 300.0, llm_resource: str = "main_llm",
                 poll_interval_s: float = 0.2) -> None:
        if not callable(agent):
            raise ConfigError(f"agent must be callable (task, llm) -> reward, got {type(agent).__name__}")
        self.agent, self.store, self.tracer = agent, store, tracer
        self.default_timeout_s = default_timeout_s
        self.llm_resource = llm_resource
        self.poll_interval_s = poll_interval_s
        self.worker_id = f"runner-{next(_RUNNER_IDS)}"
        self.stats = RunnerStats()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"lightning_nb-{self.worker_id}", daemon=True)

    def start(self) -> "Runner":
        self._thread.start()
        return self

    def stop(self) -> None:
        """Ask the thread to finish after its current attempt."""
        self._stop.set()
        self.stats.state = "stopping"

    def join(self, timeout: Optional[float] = None) -> None:
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.stats.state = "stopped"

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.stats.last_heartbeat = time.time()
            try:
                item = self.store.dequeue_rollout(self.worker_id, timeout=self.poll_interval_s)
            except Exception:  # keep the runner alive; the store logs its own errors
                log.exception("%s: dequeue failed", self.worker_id)
                time.sleep(self.poll_interval_s)
                continue
            if item is not None:
                self.run_attempt(item)
        self.stats.state = "stopped"

    def step(self, task: Any, resources: Optional[dict[str, Any]] = None) -> Rollout:
        """Run one rollout of ``task`` now, in the caller's thread and context (online mode).

        The runner's thread need not be started: ``Runner(agent, store, Tracer(store)).step(task)``.
        The rollout is created with :meth:`LightningStore.start_rollout` (never queued, so
        no other runner takes it), then run like a dequeued one (:meth:`run_attempt`):
        spans and rewards land in the store while the agent runs; the agent runs in a
        helper thread that copies the caller's ``contextvars`` and is bounded by
        ``default_timeout_s``. The rollout has one attempt (``max_attempts=1``).

        Args:
            task: the rollout input handed to the agent.
            resources: ``{name: LLMResource | PromptTemplate | dict}`` stored with
                ``store.add_resources`` (so it also becomes the store's latest set) and
                referenced by the rollout's ``resources_id``; None uses the latest set.

        Returns:
            The rollout as finally stored: ``succeeded``, or ``failed`` with the error
            (traceback, timeout, missing resource) on ``store.query_attempts(rollout_id)``.

        Raises:
            ConfigError: ``resources`` is neither None nor a valid resources dict.
        """
        if resources is not None and not isinstance(resources, dict):
            raise ConfigError(f"resources must be a dict of name -> LLMResource | PromptTemplate or None "
                              f"(latest), got {type(resources).__name__}")
        resources_id = self.store.add_resources(resources).resources_id if resources is not None else None
        item = self.store.start_rollout(task, resources_id=resources_id, worker_id=self.worker_id)
        self.run_attempt(item)
        return self.store.get_rollout_by_id(item.rollout.rollout_id)

    def run_attempt(self, item: AttemptedRollout) -> str:
        """Run the agent on one attempt and record its outcome; returns the attempt's final status."""
        rollout, attempt = item.rollout, item.attempt
        rid, aid = rollout.rollout_id, attempt.attempt_id
        self.stats.state, self.stats.current_rollout = "running", rid
        try:
            resources = (self.store.get_resources_by_id(rollout.resources_id) if rollout.resources_id
                         else self.store.get_latest_resources())
            if resources is None or self.llm_resource not in resources.resources:
                raise ConfigError(f"no {self.llm_resource!r} resource in the store; call store.add_resources("
                                  f"{{'{self.llm_resource}': proxy.as_resource()}}) before enqueuing rollouts")
            llm = attributed_llm(resources.resources[self.llm_resource], rid, aid,
                                 rollout.metadata.get("sampling_parameters"))
        except LightningNbError as exc:
            return self._finish(rid, aid, "failed", f"{type(exc).__name__}: {exc}")
        try:
            self.store.update_attempt(rid, aid, status="running", worker_id=self.worker_id, heartbeat=True)
        except LightningNbError as exc:  # e.g. cancelled meanwhile, or a remote store unreachable
            log.warning("%s: could not start attempt %s: %s", self.worker_id, aid, exc)
            self.stats.state, self.stats.current_rollout = "idle", None
            return "failed"
        outcome: dict[str, Any] = {}
        ctx = contextvars.copy_context()
        worker = threading.Thread(target=ctx.run, args=(self._call_agent, rollout.input, llm, rid, aid, outcome),
                                  name=f"{self.worker_id}-agent", daemon=True)
        worker.start()
        timeout = rollout.config.timeout_seconds or self.default_timeout_s
        deadline = None if timeout is None else time.monotonic() + timeout
        while worker.is_alive():
            worker.join(1.0 if deadline is None else max(0.0, min(1.0, deadline - time.monotonic())))
            self.stats.last_heartbeat = time.time()
            if deadline is not None and time.monotonic() >= deadline and worker.is_alive():
                # Threads cannot be killed: the agent thread is abandoned (daemon) and whatever it
                # records later stays attached to this timed-out attempt.
                return self._finish(rid, aid, "timeout", f"agent ran past timeout_seconds={timeout}")
        if "error" in outcome:
            return self._finish(rid, aid, "failed", outcome["error"])
        return self._finish(rid, aid, "succeeded", None)

    def _call_agent(self, task: Any, llm: LLMResource, rid: str, aid: str, outcome: dict) -> None:
        try:
            with self.tracer.trace_context(rid, aid):
                result = self.agent(task, llm)
                if inspect.isawaitable(result):
                    result = asyncio.run(result)
                if result is not None:
                    emit_reward(result)
        except BaseException:  # the traceback is kept on the attempt
            outcome["error"] = traceback.format_exc()

    def _finish(self, rid: str, aid: str, status: str, error: Optional[str]) -> str:
        try:
            self.store.update_attempt(rid, aid, status=status, error=error)
        except LightningNbError as exc:  # e.g. the rollout was cancelled meanwhile
            log.warning("%s: could not record %s for %s: %s", self.worker_id, status, aid, exc)
        counter = {"succeeded": "succeeded", "failed": "failed", "timeout": "timed_out"}[status]
        setattr(self.stats, counter, getattr(self.stats, counter) + 1)
        self.stats.state, self.stats.current_rollout = "idle", None
        return status


class RunnerGroup:
    """Handle on runner threads started by :func:`start_runners`."""

    def __init__(self, runners: list[Runner]) -> None:
        self.runners = runners

    def stop(self, timeout: float = 30.0) -> None:
        """Stop all runners after their current attempts (waits up to ``timeout`` seconds)."""
        for r in self.runners:
            r.stop()
        deadline = time.monotonic() + timeout
        for r in self.runners:
            r.join(max(0.0, deadline - time.monotonic()))

    def status(self) -> pd.DataFrame:
        """One row per runner: state, current rollout, counts, seconds since last heartbeat."""
        now = time.time()
        return pd.DataFrame([
            {"worker_id": r.worker_id, "state": r.stats.state, "alive": r.alive,
             "current_rollout": r.stats.current_rollout, "succeeded": r.stats.succeeded,
             "failed": r.stats.failed, "timed_out": r.stats.timed_out,
             "heartbeat_age_s": round(now - r.stats.last_heartbeat, 1)}
            for r in self.runners
        ])

    def __enter__(self) -> "RunnerGroup":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _repr_html_(self) -> str:
        return f"<b>RunnerGroup</b> ({len(self.runners)} runners)" + self.status().to_html(index=False)


def start_runners(agent: Agent, store: LightningStore, n: int = 4, *, tracer: Optional[Tracer] = None,
                  default_timeout_s: Optional[float] = 300.0, llm_resource: str = "main_llm") -> RunnerGroup:
    """Start ``n`` runner threads and return at once. Stop them with ``group.stop()``.

    Raises:
        ConfigError: ``n`` < 1 or ``agent`` not callable.
    """
    if n < 1:
        raise ConfigError(f"n must be >= 1 runner, got {n}")
    tracer = tracer or Tracer(store)
    runners = [Runner(agent, store, tracer, default_timeout_s=default_timeout_s, llm_resource=llm_resource)
               for _ in range(n)]
    for r in runners:
        r.start()
    return RunnerGroup(runners)
