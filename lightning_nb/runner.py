"""Runners: background threads that take rollouts from the store and run the agent.

:meth:`Runner.step` runs one rollout on demand instead (online mode).

An agent is a plain function ``agent(task, llm) -> reward | None``: ``task`` is
the rollout input, ``llm`` an :class:`~lightning_nb.types.LLMResource` whose
``endpoint`` is an OpenAI-compatible base URL attributed to the current attempt.
Returning a number records it as the final reward; returning None means the
agent called :func:`~lightning_nb.tracer.emit_reward` itself.

When an attempt succeeds, and when it fails
-------------------------------------------
An attempt ends ``succeeded`` only when the agent returned, every span of the
attempt reached the store, and it has a reward. Otherwise it ends ``failed`` (and
is retried per the rollout's ``retry_condition``/``max_attempts``), with an error:

* the agent raised: its traceback. When the exception chain shows a failed connect
  to the LLM endpoint of the store's resources (``openai.APIConnectionError`` over
  ``httpx.ConnectError`` over ``ConnectionRefusedError``, ...), the error starts with
  one line naming the endpoint and how to publish a restarted proxy again
  (see :func:`unreachable_endpoint_hint`); a stale endpoint is typical after a
  kernel restart with a reopened ``SqliteStore``. :func:`start_runners` probes the
  endpoint once and warns before any rollout runs, but never blocks a start on it:
  agents that never call the LLM must keep working. After such a failure the group's
  runners hold off the queue until the store's latest resources name an endpoint that
  answers, and then put the rollouts that failed only for that reason back in the queue
  (:class:`~lightning_nb.endpoint_gate.EndpointGate`), so a dead proxy does not turn the
  whole queue into failures.
* a span could not be stored (after the tracer's retries of transient errors, see
  :mod:`lightning_nb.tracer`): one line per span, e.g. ``span 'reward' could not be
  stored after 3 tries: ...``, so a lost reward is never passed off as a success.
* the agent returned None and no reward span of the attempt was stored (a forgotten
  ``return``): ``NO_REWARD_ERROR``, which says how to return or emit a reward.

The first failed attempt of each kind (exception type, ``"unreachable LLM
endpoint"``, ``"lost span"``, ``"no reward"``, ``"timeout"``) in a runner group also
raises a ``RuntimeWarning`` with the one-line error and a pointer to
``store.attempts_df()``, so mistakes show in the notebook; later ones of that kind
are only recorded on their attempts (:class:`FailureNotices`).

Re-running ``start_runners``
----------------------------
``start_runners(agent, store)`` stops the runner threads still running on the same
``store`` object before starting the new ones (they finish their current attempt,
for at most ``REPLACE_STOP_TIMEOUT_S`` seconds) and says so in a ``UserWarning``: re-running
the cell no longer leaves the old group, with the old agent, pulling from the
same queue. ``replace=False`` keeps both. Runner threads are tracked per store
with weak references only. The group ``start_runners`` started last on a store is its
:func:`live_runner_group`, which the dashboard's runner panel follows; the panel's
**Start runners** button (:meth:`RunnerGroup.restart`) goes through the same rule.

Heartbeats and the watchdog
---------------------------
While an agent runs, its runner thread (not the agent thread) sends a heartbeat
(``store.update_attempt(..., heartbeat=True)``) every ``heartbeat_interval_s``
seconds, or every third of the rollout's ``unresponsive_seconds`` if smaller; an
idle runner stamps its worker record with ``store.update_worker``. The store's
watchdog ends attempts whose heartbeats stop (``unresponsive``) or that run past
``timeout_seconds`` (``timeout``) and requeues their rollouts per
``retry_condition``/``max_attempts``. If a heartbeat shows the attempt already ended
(by the watchdog, or its rollout was cancelled), the runner abandons the agent thread
and takes the next rollout. A hung agent never blocks other runners: each agent runs
in its own daemon thread, and its runner gives up on it at the timeout.

Abort semantics (as in the Agent Lightning design)
--------------------------------------------------
* The algorithm finishes: leave ``with start_runners(...) as group:`` normally (or
  call ``group.stop()``): runners finish their current attempt and exit.
* Failure or user interrupt (an exception, ``KeyboardInterrupt`` / Jupyter
  "interrupt kernel" inside the ``with`` block, or ``group.abort()``): every runner
  is told to abort; within about one second each ends its in-flight attempt
  ``failed`` (error ``"aborted: ..."``), which requeues the rollout per its retry
  policy, and exits. ``Runner.step`` interrupted in the caller's thread does the same
  for its attempt and re-raises.
* A runner that does not stop in time (``stop(timeout)`` then a short grace for
  abort) is abandoned: it is a daemon thread, so it never keeps the process alive,
  and the group ends its in-flight attempt ``failed`` itself; if even that store call
  fails, the store's watchdog ends the attempt once heartbeats stop. Either way no
  attempt stays ``running`` forever (set ``unresponsive_seconds`` for the watchdog
  backstop). Queued rollouts stay queued for the next runners.
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
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional
from urllib.parse import urlsplit

import pandas as pd

from lightning_nb.endpoint_gate import EndpointGate, check_llm_endpoint
from lightning_nb.errors import ConfigError, LightningNbError
from lightning_nb.store.base import LightningStore
from lightning_nb.tracer import AttemptSpans, Tracer, emit_reward
from lightning_nb.types import ATTEMPT_TERMINAL, AttemptedRollout, LLMResource, Rollout

__all__ = ["Agent", "Runner", "RunnerGroup", "FailureNotices", "start_runners", "live_runner_group",
           "attributed_llm", "unreachable_endpoint_hint", "REPLACE_STOP_TIMEOUT_S"]

log = logging.getLogger(__name__)
Agent = Callable[[Any, LLMResource], Any]
_RUNNER_IDS = itertools.count()
REPLACE_STOP_TIMEOUT_S = 10.0  # start_runners(replace=True): how long the previous group may finish its attempts
UNREACHABLE = "unreachable LLM endpoint"  # the failure kind of an attempt whose LLM endpoint refused the connect
NO_REWARD_ERROR = ("the agent returned None and emitted no reward span; return a float reward from the agent, "
                   "or call lightning_nb.emit_reward(value) inside it")


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


# ----- failure notices ----------------------------------------------------------------------
class FailureNotices:
    """Warns (``RuntimeWarning``) on the first failed attempt of each kind; shared by the runners of one group.

    The kind is the exception type name for an agent that raised, or one of
    ``"unreachable LLM endpoint"``, ``"no reward"``, ``"lost span"``, ``"timeout"``,
    ``"ConfigError"`` (no LLM resource). Later failures of a kind already warned about
    are only recorded on their attempts (``store.attempts_df()``).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.kinds: set[str] = set()

    def first(self, kind: str) -> bool:
        """True exactly once per ``kind`` (thread-safe)."""
        with self._lock:
            if kind in self.kinds:
                return False
            self.kinds.add(kind)
            return True

    def notify(self, kind: str, worker_id: str, rollout_id: str, summary: str) -> None:
        if not self.first(kind):
            return
        message = (f"lightning_nb {worker_id}: rollout {rollout_id} failed: {summary} (see store.attempts_df() "
                   f"for the full traceback; later {kind!r} failures of this runner group are not warned about)")
        try:  # the message names the rollout, so Python's once-per-location filter never hides it
            warnings.warn(message, RuntimeWarning, stacklevel=1)
        except Exception:  # warnings turned into errors: never crash the runner over a notice
            log.warning("%s", message)


def _chain(exc: Optional[BaseException]) -> Iterator[BaseException]:
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def _host_port(url: str) -> tuple[str, Optional[int]]:
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    return (parts.hostname or "").lower(), port or {"http": 80, "https": 443}.get(parts.scheme)


def unreachable_endpoint_hint(exc: BaseException, endpoint: str, llm_resource: str = "main_llm") -> Optional[str]:
    """One line saying the LLM ``endpoint`` is unreachable, when ``exc`` came from failing to connect to it; else None.

    Looks down the exception chain (``__cause__`` / ``__context__``) for a failed connect:
    ``ConnectionRefusedError``, ``socket.gaierror``, or httpx/httpcore ``ConnectError`` /
    ``ConnectTimeout`` (what ``openai.APIConnectionError`` wraps). A failed connect to another
    host (a tool's web service, a remote store) gets no hint: the URL of the failed request,
    where the chain carries one, must have the endpoint's host and port. A read timeout is
    not a failed connect.
    """
    import socket

    chain = list(_chain(exc))
    names = [{c.__name__ for c in type(e).__mro__} for e in chain]
    connect = [e for e, n in zip(chain, names)
               if isinstance(e, (ConnectionRefusedError, socket.gaierror)) or n & {"ConnectError", "ConnectTimeout"}]
    if not connect:
        return None
    for e in chain:  # the request that failed, if the chain says (openai and httpx errors carry it)
        try:
            request = getattr(e, "request", None)
        except Exception:  # httpx raises when the request is not set
            request = None
        url = getattr(request, "url", None)
        if url is not None:
            if _host_port(str(url)) != _host_port(endpoint):
                return None
            break
    if any(isinstance(e, ConnectionRefusedError) or "connection refused" in str(e).lower() for e in connect):
        reason = "connection refused"
    elif any("ConnectTimeout" in n for n in names):
        reason = "no answer to the connect (timed out)"
    elif any(isinstance(e, socket.gaierror) for e in chain):
        reason = "host name not resolved"
    else:
        reason = f"{type(connect[-1]).__name__}: {_first_line(connect[-1])}"
    return (f"the LLM endpoint {endpoint} in the store's resources is unreachable ({reason}); if the proxy was "
            f"restarted (e.g. after a kernel restart), publish it again with "
            f"store.add_resources({{'{llm_resource}': proxy.as_resource()}})")


# ----- live runners per store ---------------------------------------------------------------
class _LiveRunners:
    """The runner threads started on each store, for ``start_runners(replace=True)``.

    Held weakly both ways: the store by a weak reference (its entry goes when it is
    collected; a store that cannot be weakly referenced is not tracked) and the runners
    in a ``WeakSet`` (a running thread keeps its runner alive, a finished one is dropped).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_store: dict[int, tuple[weakref.ref, "weakref.WeakSet[Runner]"]] = {}
        self._groups: dict[int, weakref.ref] = {}  # id(store) -> the latest RunnerGroup start_runners registered

    def _entry(self, store: LightningStore) -> Optional[tuple[weakref.ref, "weakref.WeakSet[Runner]"]]:
        """The store's entry, made if missing (call with the lock held); None for a store without weakrefs."""
        key = id(store)
        entry = self._by_store.get(key)
        if entry is None or entry[0]() is not store:
            try:
                ref = weakref.ref(store, lambda r, key=key: self._drop(key, r))
            except TypeError:
                return None
            entry = self._by_store[key] = (ref, weakref.WeakSet())
            self._groups.pop(key, None)
        return entry

    def add(self, runner: "Runner") -> None:
        with self._lock:
            entry = self._entry(runner.store)
            if entry is not None:
                entry[1].add(runner)

    def register_group(self, group: "RunnerGroup") -> None:
        """Make ``group`` the store's live group (what :func:`live_runner_group` returns)."""
        with self._lock:
            if self._entry(group.store) is not None:
                self._groups[id(group.store)] = weakref.ref(group)

    def group(self, store: LightningStore) -> Optional["RunnerGroup"]:
        with self._lock:
            entry, ref = self._by_store.get(id(store)), self._groups.get(id(store))
            if entry is None or entry[0]() is not store or ref is None:
                return None
            return ref()

    def _drop(self, key: int, ref: weakref.ref) -> None:
        with self._lock:
            if key in self._by_store and self._by_store[key][0] is ref:
                del self._by_store[key]
                self._groups.pop(key, None)

    def running(self, store: LightningStore) -> list["Runner"]:
        """Runners on ``store`` whose thread runs and was not asked to stop, oldest first."""
        with self._lock:
            entry = self._by_store.get(id(store))
            if entry is None or entry[0]() is not store:
                return []
            runners = list(entry[1])
        return sorted((r for r in runners if r.alive and not r._stop.is_set()), key=lambda r: r._seq)

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_store)


_LIVE = _LiveRunners()


def live_runner_group(store: LightningStore) -> Optional["RunnerGroup"]:
    """The runner group :func:`start_runners` (threads) started last on ``store``, or None.

    That is the group a re-run of the ``start_runners`` cell replaced the earlier one with;
    the dashboard's runner panel follows it. It is returned while it exists (its runner
    threads keep it alive, and so does any handle on it), even once stopped.
    """
    return _LIVE.group(store)


@dataclass
class RunnerStats:
    state: str = "idle"  # idle | running | stopping | stopped
    current_rollout: Optional[str] = None
    succeeded: int = 0
    failed: int = 0
    timed_out: int = 0
    abandoned: int = 0  # attempts ended elsewhere (watchdog, cancel) while the agent still ran
    last_heartbeat: float = field(default_factory=time.time)


class Runner:
    """One worker thread. Use :func:`start_runners` to start several.

    Args:
        agent: the agent function.
        store: where rollouts come from and results go.
        tracer: shared OpenTelemetry tracer writing to ``store``.
        default_timeout_s: per-attempt limit when the rollout sets none.
        llm_resource: name of the LLMResource in the resources set.
        heartbeat_interval_s: seconds between heartbeats to the store (see the module docstring).
        notices: warns on the first failure of each kind; :func:`start_runners` shares one
            among the runners of a group (a new one per runner when None).
        gate: holds the runner off the queue while the LLM endpoint refuses connections
            (:class:`~lightning_nb.endpoint_gate.EndpointGate`); :func:`start_runners` shares
            one among the runners of a group (a new one per runner when None).
    """

    def __init__(self, agent: Agent, store: LightningStore, tracer: Tracer, *,
                 default_timeout_s: Optional[float] = 300.0, llm_resource: str = "main_llm",
                 poll_interval_s: float = 0.2, heartbeat_interval_s: float = 5.0,
                 notices: Optional[FailureNotices] = None, gate: Optional[EndpointGate] = None) -> None:
        if not callable(agent):
            raise ConfigError(f"agent must be callable (task, llm) -> reward, got {type(agent).__name__}")
        if not heartbeat_interval_s > 0:
            raise ConfigError(f"heartbeat_interval_s must be positive seconds, got {heartbeat_interval_s!r}")
        self.heartbeat_interval_s = float(heartbeat_interval_s)
        self._abort = threading.Event()
        self._abort_reason = ""
        self.current: Optional[tuple[str, str]] = None  # (rollout_id, attempt_id) while an agent runs
        self.agent, self.store, self.tracer = agent, store, tracer
        self.default_timeout_s = default_timeout_s
        self.llm_resource = llm_resource
        self.poll_interval_s = poll_interval_s
        self._seq = next(_RUNNER_IDS)
        self.worker_id = f"runner-{self._seq}"
        self.notices = notices if notices is not None else FailureNotices()
        self.gate = gate if gate is not None else EndpointGate(store, llm_resource)
        self.group: Optional["RunnerGroup"] = None  # the group start_runners made it in (kept alive by its thread)
        self.stats = RunnerStats()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"lightning_nb-{self.worker_id}", daemon=True)

    def start(self) -> "Runner":
        self._thread.start()
        _LIVE.add(self)  # so that a later start_runners on this store can replace it
        return self

    def stop(self) -> None:
        """Ask the thread to finish after its current attempt."""
        self._stop.set()
        self.stats.state = "stopping"

    def abort(self, reason: str = "aborted by the caller") -> None:
        """Ask the thread to end its in-flight attempt ``failed`` (error ``"aborted: <reason>"``) and exit.

        Returns at once; the runner notices within about one second.
        """
        self._abort_reason = reason
        self._abort.set()
        self.stop()

    def join(self, timeout: Optional[float] = None) -> None:
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.stats.state = "stopped"

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _worker_heartbeat(self, status: str) -> None:
        """Stamp this runner's worker record; a failing store is logged, never raised."""
        try:
            self.store.update_worker(self.worker_id, status=status, heartbeat_stats={
                "succeeded": self.stats.succeeded, "failed": self.stats.failed,
                "timed_out": self.stats.timed_out, "abandoned": self.stats.abandoned})
        except Exception as exc:
            log.warning("%s: worker heartbeat failed: %s", self.worker_id, exc)

    def _loop(self) -> None:
        next_beat = 0.0
        while not self._stop.is_set():
            self.stats.last_heartbeat = time.time()
            if time.monotonic() >= next_beat:
                self._worker_heartbeat("idle")
                next_beat = time.monotonic() + self.heartbeat_interval_s
            if not self.gate.ready():  # the LLM endpoint refused a connection: hold off the queue
                self._stop.wait(self.poll_interval_s)
                continue
            try:
                item = self.store.dequeue_rollout(self.worker_id, timeout=self.poll_interval_s)
            except Exception:  # keep the runner alive; the store logs its own errors
                log.exception("%s: dequeue failed", self.worker_id)
                time.sleep(self.poll_interval_s)
                continue
            if item is not None:
                self.run_attempt(item)
                next_beat = 0.0
        self._worker_heartbeat("stopped")
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
        """Run the agent on one attempt and record its outcome; returns the attempt's final status.

        ``succeeded`` needs all of: the agent returned (no exception), every span of the
        attempt reached the store, and a reward was returned or emitted. Otherwise the
        attempt ends ``failed`` with an error saying which (see the module docstring).
        """
        rollout, attempt = item.rollout, item.attempt
        rid, aid = rollout.rollout_id, attempt.attempt_id
        self.stats.state, self.stats.current_rollout = "running", rid
        try:
            resources = (self.store.get_resources_by_id(rollout.resources_id) if rollout.resources_id
                         else self.store.get_latest_resources())
            if resources is None or self.llm_resource not in resources.resources:
                raise ConfigError(f"no {self.llm_resource!r} resource in the store; call store.add_resources("
                                  f"{{'{self.llm_resource}': proxy.as_resource()}}) before enqueuing rollouts")
            resource = resources.resources[self.llm_resource]
            llm = attributed_llm(resource, rid, aid, rollout.metadata.get("sampling_parameters"))
        except LightningNbError as exc:
            summary = f"{type(exc).__name__}: {exc}"
            self.notices.notify(type(exc).__name__, self.worker_id, rid, summary)
            return self._finish(rid, aid, "failed", summary)
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
        self.current = (rid, aid)
        self.tracer.open_attempt(rid, aid)  # counts its reward spans and records spans the store lost
        worker.start()
        timeout = rollout.config.timeout_seconds or self.default_timeout_s
        deadline = None if timeout is None else time.monotonic() + timeout
        beat = self.heartbeat_interval_s
        if rollout.config.unresponsive_seconds is not None:
            beat = min(beat, rollout.config.unresponsive_seconds / 3)
        next_beat = time.monotonic() + beat
        try:
            while worker.is_alive():
                now = time.monotonic()
                wake = min(1.0, next_beat - now, (deadline - now) if deadline is not None else 1.0)
                worker.join(max(0.0, wake))
                self.stats.last_heartbeat = time.time()
                if not worker.is_alive():
                    break
                if self._abort.is_set():
                    return self._finish(rid, aid, "failed", f"aborted: {self._abort_reason}")
                if deadline is not None and time.monotonic() >= deadline:
                    # Threads cannot be killed: the agent thread is abandoned (daemon) and whatever it
                    # records later stays attached to this timed-out attempt.
                    error = f"agent ran past timeout_seconds={timeout}"
                    self.notices.notify("timeout", self.worker_id, rid, error)
                    return self._finish(rid, aid, "timeout", error)
                if time.monotonic() >= next_beat:
                    next_beat = time.monotonic() + beat
                    ended = self._heartbeat(rid, aid)
                    if ended is not None:  # ended elsewhere (watchdog, cancel): leave the agent behind
                        self.stats.abandoned += 1
                        self.stats.state, self.stats.current_rollout = "idle", None
                        return ended
        except BaseException:  # KeyboardInterrupt in Runner.step: end the attempt, then re-raise
            self._finish(rid, aid, "failed", "aborted: interrupted (KeyboardInterrupt) while the agent ran")
            raise
        finally:
            self.current = None
            spans = self.tracer.close_attempt(rid, aid)  # also on the early returns: nothing is left open
        status, error, kind, summary = self._verdict(outcome, spans, rid, aid, resource.endpoint)
        if kind is not None:
            self.notices.notify(kind, self.worker_id, rid, summary)
        status = self._finish(rid, aid, status, error)
        if kind == UNREACHABLE:  # after the attempt is recorded: the gate may requeue its rollout
            self.gate.close(resource.endpoint, rid)
        return status

    def _verdict(self, outcome: dict[str, Any], spans: AttemptSpans, rid: str, aid: str,
                 endpoint: str) -> tuple[str, Optional[str], Optional[str], str]:
        """``(status, error, failure kind or None, one-line summary)`` of an attempt whose agent returned."""
        lost = "\n".join(spans.lost)
        if "error" in outcome:
            exc = outcome.get("exc")
            hint = unreachable_endpoint_hint(exc, endpoint, self.llm_resource) if exc is not None else None
            kind = UNREACHABLE if hint else type(exc).__name__ if exc is not None else "agent error"
            summary = hint or (f"{type(exc).__name__}: {_first_line(exc)}" if exc is not None
                               else outcome["error"].strip().splitlines()[-1])
            error = "\n".join(part for part in (hint, outcome["error"].rstrip(), lost) if part)
            return "failed", error, kind, summary
        if spans.lost:  # the attempt's record is incomplete (its reward, maybe): do not pass it off as succeeded
            return "failed", lost, "lost span", spans.lost[0]
        if outcome.get("returned_none") and spans.rewards_stored == 0 and not self._reward_in_store(rid, aid):
            return "failed", NO_REWARD_ERROR, "no reward", NO_REWARD_ERROR
        return "succeeded", None, None, ""

    def _reward_in_store(self, rid: str, aid: str) -> bool:
        """Whether the store has a reward span of the attempt written by other means than this runner's tracer."""
        try:
            return any(s.name == "reward" for s in self.store.query_spans(rid, aid))
        except Exception as exc:  # cannot tell: the tracer counted none
            log.warning("%s: could not look up the reward spans of %s: %s", self.worker_id, aid, exc)
            return False

    def _call_agent(self, task: Any, llm: LLMResource, rid: str, aid: str, outcome: dict) -> None:
        try:
            with self.tracer.trace_context(rid, aid):
                result = self.agent(task, llm)
                if inspect.isawaitable(result):
                    result = asyncio.run(result)
                if result is not None:
                    emit_reward(result)
                else:
                    outcome["returned_none"] = True
        except BaseException as exc:  # the traceback is kept on the attempt
            outcome["error"] = traceback.format_exc()
            outcome["exc"] = exc

    def _heartbeat(self, rid: str, aid: str) -> Optional[str]:
        """Send one attempt heartbeat; the attempt's terminal status if it was ended elsewhere, else None."""
        try:
            attempt = self.store.update_attempt(rid, aid, heartbeat=True)
        except Exception as exc:  # a remote store briefly unreachable: keep running, the watchdog decides
            log.warning("%s: heartbeat for %s failed: %s", self.worker_id, aid, exc)
            return None
        return attempt.status if attempt.status in ATTEMPT_TERMINAL else None

    def _finish(self, rid: str, aid: str, status: str, error: Optional[str]) -> str:
        try:
            self.store.update_attempt(rid, aid, status=status, error=error)
        except Exception as exc:  # e.g. the watchdog ended it or the rollout was cancelled meanwhile
            log.warning("%s: could not record %s for %s: %s", self.worker_id, status, aid, exc)
        counter = {"succeeded": "succeeded", "failed": "failed", "timeout": "timed_out"}[status]
        setattr(self.stats, counter, getattr(self.stats, counter) + 1)
        self.stats.state, self.stats.current_rollout = "idle", None
        return status


class GroupLifecycle:
    """What every runner group handle shares: ``with`` stops or aborts it, and its HTML summary.

    Subclasses provide ``stop()``, ``abort(reason)`` and ``status()``.
    """

    def __enter__(self):
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.stop()  # the algorithm side finished: runners finish their attempts
        else:  # failure or KeyboardInterrupt: both sides stop now
            self.abort(f"{exc_type.__name__} in the algorithm side")

    def _repr_html_(self) -> str:
        from lightning_nb._repr import runner_group_html

        return runner_group_html(self)


class RunnerGroup(GroupLifecycle):
    """Handle on runner threads started by :func:`start_runners`.

    Attributes:
        runners: the :class:`Runner` objects, one per thread.
        started_at: when the group was made (seconds since the epoch).
    """

    def __init__(self, runners: list[Runner]) -> None:
        if not runners:
            raise ConfigError("a RunnerGroup needs at least one Runner")
        self.runners = runners
        self.started_at = time.time()

    @property
    def store(self) -> LightningStore:
        """The store the group's runners work on."""
        return self.runners[0].store

    def restart(self) -> "RunnerGroup":
        """Start the same agent and settings again as a new group, through ``start_runners(replace=True)``.

        A Python thread cannot be started twice, so this makes a new group of as many
        runners, each carrying on its predecessor's counts, and it goes through the same
        rule as re-running a ``start_runners`` cell: runner threads still running on the
        store (this group's, or a newer group's) are stopped first, with the same
        ``UserWarning``. The new group becomes the store's :func:`live_runner_group`.
        This is what the runner panel's **Start runners** button does.

        Returns:
            The new group (this one stays stopped).
        """
        first = self.runners[0]
        return _start_thread_runners(first.agent, first.store, len(self.runners), tracer=first.tracer,
                                     default_timeout_s=first.default_timeout_s, llm_resource=first.llm_resource,
                                     heartbeat_interval_s=first.heartbeat_interval_s, replace=True,
                                     carry_from=self.runners)

    def stop(self, timeout: float = 30.0, *, grace_s: float = 3.0) -> list[str]:
        """Stop all runners after their current attempts; abort the ones still running after ``timeout`` s.

        Runners still alive ``grace_s`` seconds after the abort are abandoned (daemon
        threads) and their in-flight attempts are ended ``failed`` here. Returns the
        worker ids abandoned (empty when every runner stopped).
        """
        for r in self.runners:
            r.stop()
        self._join(time.monotonic() + timeout)
        late = [r for r in self.runners if r.alive]
        return self._abort(late, f"runner did not stop within {timeout} s", grace_s) if late else []

    def abort(self, reason: str = "aborted by the caller", grace_s: float = 3.0) -> list[str]:
        """Abort now (failure or user interrupt): in-flight attempts end ``failed``; see the module docstring.

        Returns the worker ids abandoned after ``grace_s`` seconds.
        """
        return self._abort(list(self.runners), reason, grace_s)

    def _abort(self, runners: list[Runner], reason: str, grace_s: float) -> list[str]:
        for r in runners:
            r.abort(reason)
        self._join(time.monotonic() + grace_s, runners)
        abandoned = []
        for r in runners:
            if not r.alive:
                continue
            abandoned.append(r.worker_id)
            r.stats.state = "abandoned"
            current = r.current
            if current is not None:
                try:  # fails harmlessly if the runner got there first
                    r.store.update_attempt(*current, status="failed",
                                           error=f"aborted: {reason}; runner {r.worker_id} abandoned")
                except Exception as exc:
                    log.warning("could not end attempt %s of abandoned %s (the watchdog will): %s",
                                current[1], r.worker_id, exc)
        return abandoned

    def _join(self, deadline: float, runners: Optional[list[Runner]] = None) -> None:
        for r in self.runners if runners is None else runners:
            r.join(max(0.0, deadline - time.monotonic()))

    def status(self) -> pd.DataFrame:
        """One row per runner: state, current rollout, counts, seconds since last heartbeat."""
        now = time.time()
        return pd.DataFrame([
            {"worker_id": r.worker_id, "state": r.stats.state, "alive": r.alive,
             "current_rollout": r.stats.current_rollout, "succeeded": r.stats.succeeded,
             "failed": r.stats.failed, "timed_out": r.stats.timed_out, "abandoned": r.stats.abandoned,
             "heartbeat_age_s": round(now - r.stats.last_heartbeat, 1)}
            for r in self.runners
        ])


def start_runners(agent: Agent, store: LightningStore, n: int = 4, *, tracer: Optional[Tracer] = None,
                  default_timeout_s: Optional[float] = 300.0, llm_resource: str = "main_llm",
                  backend: str = "threads", heartbeat_interval_s: float = 5.0, replace: bool = True,
                  **backend_options: Any) -> RunnerGroup:
    """Start ``n`` runner threads and return at once. Stop them with ``group.stop()``.

    Use it as ``with start_runners(...) as group:`` around the algorithm side to get the
    abort semantics of the module docstring; ``heartbeat_interval_s`` (seconds) is the
    threads' heartbeat period.

    ``replace=True`` (the default): runner threads still running on this same ``store``
    object (typically the group of an earlier run of the same notebook cell, whose handle
    was overwritten) are stopped first, so no rollout is run by an outdated agent or
    reward function: they finish their current attempt (up to ``REPLACE_STOP_TIMEOUT_S``
    seconds, then they are aborted as by ``group.stop``) and a ``UserWarning`` names
    them. ``replace=False`` keeps them running beside the new group, both pulling from the
    same queue. Re-run the ``start_runners`` cell after redefining the agent or its reward
    function: running runners keep the function they were given. With ``backend="ray"``
    ``replace`` does not apply; stop the previous group yourself (``group.stop()``).

    ``backend="ray"`` starts ``n`` Ray actors instead (see :mod:`lightning_nb.runners_ray`:
    the store is served over HTTP; ``backend_options`` such as ``num_cpus``, ``address``,
    ``actor_options`` go to :func:`~lightning_nb.runners_ray.start_ray_runners`) and returns
    a ``RayRunnerGroup`` with the same ``stop()`` / ``status()``.

    Before any runner starts, the endpoint of ``llm_resource`` in the store's latest
    resources is probed once (``GET {endpoint}/models``, at most 3 s); if it does not
    answer, a ``RuntimeWarning`` names it and says to ``store.add_resources`` the running
    proxy (a reopened ``SqliteStore`` after a kernel restart still names the dead one).
    It only warns: agents that never call the LLM keep working. Once an attempt fails
    because that endpoint refused the connection, the group's runners hold off the queue
    until the latest resources name an endpoint that answers, then requeue the rollouts
    that failed only for that reason (:mod:`lightning_nb.endpoint_gate`).

    Raises:
        ConfigError: ``n`` < 1, ``agent`` not callable, unknown ``backend``, or options the backend lacks.
        MissingDependencyError: ``backend="ray"`` without Ray installed.
    """
    if backend == "ray":
        if tracer is not None:
            raise ConfigError("tracer cannot be passed with backend='ray': each Ray actor makes its own Tracer")
        from lightning_nb.runners_ray import start_ray_runners

        warn_if_llm_endpoint_dead(store, llm_resource)
        return start_ray_runners(agent, store, n, default_timeout_s=default_timeout_s,  # type: ignore[return-value]
                                 llm_resource=llm_resource, heartbeat_interval_s=heartbeat_interval_s,
                                 **backend_options)
    if backend != "threads":
        raise ConfigError(f"backend must be 'threads' (default) or 'ray', got {backend!r}")
    if backend_options:
        raise ConfigError(f"unknown option(s) for backend='threads': {sorted(backend_options)}; "
                          f"they apply to backend='ray' only")
    if n < 1:
        raise ConfigError(f"n must be >= 1 runner, got {n}")
    return _start_thread_runners(agent, store, n, tracer=tracer, default_timeout_s=default_timeout_s,
                                 llm_resource=llm_resource, heartbeat_interval_s=heartbeat_interval_s, replace=replace)


def warn_if_llm_endpoint_dead(store: LightningStore, llm_resource: str, stacklevel: int = 3) -> None:
    """Probe the store's latest LLM endpoint once and warn (``RuntimeWarning``) if it does not answer.

    What :func:`start_runners` does before starting any runner; see
    :func:`lightning_nb.endpoint_gate.check_llm_endpoint`.
    """
    dead = check_llm_endpoint(store, llm_resource)
    if dead is not None:
        warnings.warn(f"start_runners: {dead.message(llm_resource)}", RuntimeWarning, stacklevel=stacklevel)


def _start_thread_runners(agent: Agent, store: LightningStore, n: int, *, tracer: Optional[Tracer],
                          default_timeout_s: Optional[float], llm_resource: str, heartbeat_interval_s: float,
                          replace: bool, carry_from: Optional[list[Runner]] = None) -> RunnerGroup:
    """Make ``n`` runners sharing one tracer, failure notices and endpoint gate; replace, register and start them."""
    warn_if_llm_endpoint_dead(store, llm_resource, stacklevel=4)
    tracer = tracer or Tracer(store)
    notices = FailureNotices()  # first failure of each kind warns once per group
    gate = EndpointGate(store, llm_resource)
    runners = [Runner(agent, store, tracer, default_timeout_s=default_timeout_s, llm_resource=llm_resource,
                      heartbeat_interval_s=heartbeat_interval_s, notices=notices, gate=gate) for _ in range(n)]
    for old, new in zip(carry_from or [], runners):
        new.stats.succeeded, new.stats.failed, new.stats.timed_out = (
            old.stats.succeeded, old.stats.failed, old.stats.timed_out)
    if replace:
        _replace_running(store, n)
    group = RunnerGroup(runners)
    _LIVE.register_group(group)
    for r in runners:
        r.group = group  # a running thread keeps its group alive, so live_runner_group finds it
        r.start()
    return group


def _replace_running(store: LightningStore, n_new: int) -> None:
    """Stop the runner threads running on ``store`` (see ``start_runners(replace=True)``) and warn once."""
    previous = _LIVE.running(store)
    if not previous:
        return
    ids = [r.worker_id for r in previous]
    t0 = time.monotonic()
    abandoned = RunnerGroup(previous).stop(timeout=REPLACE_STOP_TIMEOUT_S)
    late = [r.worker_id for r in previous if r._abort.is_set()]
    note = (f"; {len(late)} did not finish their attempt within {REPLACE_STOP_TIMEOUT_S:g} s and were aborted "
            f"(their rollouts are requeued per retry policy)" if late else "")
    if abandoned:
        note += f"; {len(abandoned)} could not be stopped and were abandoned: {', '.join(abandoned)}"
    warnings.warn(f"start_runners: stopped the previous group of {len(previous)} runner(s) on this store "
                  f"({', '.join(ids)}) in {time.monotonic() - t0:.1f} s and replaced it with {n_new} new one(s)"
                  f"{note}; pass replace=False to keep both", UserWarning, stacklevel=4)
