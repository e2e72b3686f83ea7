"""Runners: background threads that take rollouts from the store and run the agent.

:meth:`Runner.step` runs one rollout on demand instead (online mode).

An agent is a plain function ``agent(task, llm) -> reward | None``: ``task`` is
the rollout input, ``llm`` an :class:`~lightning_nb.types.LLMResource` whose
``endpoint`` is an OpenAI-compatible base URL attributed to the current attempt.
Returning a number records it as the final reward; returning None means the
agent called :func:`~lightning_nb.tracing.tracer.emit_reward` itself. An agent that declares a
``resources`` parameter (``agent(task, llm, *, resources)``) also gets the rollout's resources set as
``{name: LLMResource | PromptTemplate}``, e.g. a system prompt that APO tunes.

When an attempt succeeds, and when it fails
-------------------------------------------
An attempt ends ``succeeded`` only when the agent returned, every span of the
attempt reached the store, and it has a reward. Otherwise it ends ``failed`` (and
is retried per the rollout's ``retry_condition``/``max_attempts``), with an error:

* the agent raised: its traceback. When the exception chain shows a failed connect
  to the LLM endpoint of the store's resources (``openai.APIConnectionError`` over
  ``httpx.ConnectError`` over ``ConnectionRefusedError``, ...), the error starts with
  one line naming the endpoint and how to publish a restarted proxy again (see
  :func:`~lightning_nb.runners.failures.unreachable_endpoint_hint`); a stale endpoint is typical
  after a kernel restart with a reopened ``SqliteStore``.
  :func:`~lightning_nb.runners.start_runners` probes the endpoint once before any rollout runs;
  when it is dead the group's runners hold the whole queue from the start (unless the agent
  declares ``calls_model = False``) and say so. After such a failure (the endpoint died later)
  the group's runners hold off the queue until the store's
  latest resources name an endpoint that answers, and then put the rollouts that failed only
  for that reason back in the queue (:class:`~lightning_nb.runners.gate.EndpointGate`), so a
  dead proxy does not turn the whole queue into failures.
* a span could not be stored (after the tracer's retries of transient errors, see
  :mod:`lightning_nb.tracing.tracer`): one line per span, e.g. ``span 'reward' could not be
  stored after 3 tries: ...``, so a lost reward is never passed off as a success.
* the agent returned None and no reward span of the attempt was stored (a forgotten
  ``return``): ``NO_REWARD_ERROR``, which says how to return or emit a reward.

The first failed attempt of each kind (exception type, ``"unreachable LLM
endpoint"``, ``"lost span"``, ``"no reward"``, ``"timeout"``) in a runner group also
raises a ``RuntimeWarning`` with the one-line error and a pointer to
``store.attempts_df()``, so mistakes show in the notebook; later ones of that kind
are only recorded on their attempts
(:class:`~lightning_nb.runners.failures.FailureNotices`).

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

Agents that never call the model
--------------------------------
A succeeded attempt whose agent made no LLM call (none reached its ``llm.endpoint``) has a reward
and nothing to train on. It is counted in ``RunnerStats.no_llm_call`` (a runner group's status) and
flagged in ``store.rollouts_df()``'s ``no_llm_call`` column. An agent that declares
``calls_model = True`` (an attribute of the agent object or function;
:class:`~lightning_nb.agents.remote.RemoteRolloutAgent` does) has such an attempt refused instead: it
ends ``failed`` with ``NO_LLM_CALL_ERROR``.

Lifecycle hooks
---------------
``hooks=[...]`` (:class:`~lightning_nb.runners.hooks.Hook` instances) are called in list order around
each attempt: ``on_rollout_start``, then in the agent thread inside the trace context
``on_trace_start`` and ``on_trace_end``, then ``on_rollout_end`` once the attempt is final in the
store. A hook that raises never kills the runner; what happens to the attempt is in
:mod:`lightning_nb.runners.hooks` ("Errors in a hook").

How runner threads are started (:func:`~lightning_nb.runners.start_runners`), replaced and stopped
as a group (:class:`~lightning_nb.runners.group.RunnerGroup`) is in :mod:`lightning_nb.runners.group`;
why an attempt failed, said once, in :mod:`lightning_nb.runners.failures`.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import itertools
import logging
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from lightning_nb.errors import ConfigError, LightningNbError
from lightning_nb.runners.calling import Agent, accepts_resources, attributed_llm, declares_model_calls
from lightning_nb.runners.failures import (NO_LLM_CALL, NO_LLM_CALL_ERROR, NO_REWARD_ERROR, UNREACHABLE,
                                           FailureNotices, first_line, unreachable_endpoint_hint)
from lightning_nb.runners.gate import EndpointGate
from lightning_nb.runners.hooks import call_hooks, check_hooks, hook_error_span, hook_error_text, warn_hook_error
from lightning_nb.runners.live import LIVE
from lightning_nb.semconv import REWARD_SPAN
from lightning_nb.store.base import LightningStore
from lightning_nb.tracing.tracer import AttemptSpans, Tracer, emit_reward
from lightning_nb.types import (ATTEMPT_TERMINAL, MAIN_LLM, SAMPLING_PARAMETERS_KEY, TRAFFIC_KEY, AttemptedRollout,
                                LLMResource, Rollout)

if TYPE_CHECKING:
    from lightning_nb.runners.group import RunnerGroup

__all__ = ["Agent", "Runner", "RunnerStats", "attributed_llm"]

log = logging.getLogger(__name__)
_RUNNER_IDS = itertools.count()


@dataclass
class RunnerStats:
    state: str = "idle"  # idle | running | stopping | stopped
    current_rollout: Optional[str] = None
    succeeded: int = 0
    failed: int = 0
    timed_out: int = 0
    abandoned: int = 0  # attempts ended elsewhere (watchdog, cancel) while the agent still ran
    judge_errors: int = 0  # LLM-judge calls of its attempts that gave no score (rewards.Judge, on_error="record")
    no_llm_call: int = 0  # succeeded attempts whose agent never called the model (rollouts_df's no_llm_call)
    last_heartbeat: float = field(default_factory=time.time)


class Runner:
    """One worker thread. Use :func:`~lightning_nb.runners.start_runners` to start several.

    Args:
        agent: the agent function.
        store: where rollouts come from and results go.
        tracer: shared OpenTelemetry tracer writing to ``store``.
        default_timeout_s: per-attempt limit when the rollout sets none.
        llm_resource: name of the LLMResource in the resources set.
        heartbeat_interval_s: seconds between heartbeats to the store (see the module docstring).
        notices: warns on the first failure of each kind; :func:`~lightning_nb.runners.start_runners`
            shares one among the runners of a group (a new one per runner when None).
        gate: holds the runner off the queue while the LLM endpoint refuses connections
            (:class:`~lightning_nb.runners.gate.EndpointGate`); :func:`~lightning_nb.runners.start_runners`
            shares one among the runners of a group (a new one per runner when None).
        hooks: :class:`~lightning_nb.runners.hooks.Hook` instances called in list order around each attempt.

    Raises:
        ConfigError: ``agent`` not callable, ``heartbeat_interval_s`` not positive, or a ``hooks`` item not a Hook.
    """

    def __init__(self, agent: Agent, store: LightningStore, tracer: Tracer, *,
                 default_timeout_s: Optional[float] = 300.0, llm_resource: str = MAIN_LLM,
                 poll_interval_s: float = 0.2, heartbeat_interval_s: float = 5.0,
                 notices: Optional[FailureNotices] = None, gate: Optional[EndpointGate] = None,
                 hooks: Optional[list[Any]] = None) -> None:
        if not callable(agent):
            raise ConfigError(f"agent must be callable (task, llm) -> reward, got {type(agent).__name__}")
        if not heartbeat_interval_s > 0:
            raise ConfigError(f"heartbeat_interval_s must be positive seconds, got {heartbeat_interval_s!r}")
        self.heartbeat_interval_s = float(heartbeat_interval_s)
        self.hooks = check_hooks(hooks)
        self._abort = threading.Event()
        self._abort_reason = ""
        self.current: Optional[tuple[str, str]] = None  # (rollout_id, attempt_id) while an agent runs
        self._reward_optional: set[str] = set()  # attempt ids of step(..., reward_required=False)
        self._wants_resources = accepts_resources(agent)
        self._calls_model = declares_model_calls(agent) is True  # an attempt without an LLM call is then refused
        self.agent, self.store, self.tracer = agent, store, tracer
        self.default_timeout_s = default_timeout_s
        self.llm_resource = llm_resource
        self.poll_interval_s = poll_interval_s
        self.seq = next(_RUNNER_IDS)  # start order; the live registry lists runners oldest first
        self.worker_id = f"runner-{self.seq}"
        self.notices = notices if notices is not None else FailureNotices()
        self.gate = gate if gate is not None else EndpointGate(store, llm_resource)
        self.group: Optional["RunnerGroup"] = None  # the group start_runners made it in (kept alive by its thread)
        self.stats = RunnerStats()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"lightning_nb-{self.worker_id}", daemon=True)

    def start(self) -> "Runner":
        self._thread.start()
        LIVE.add(self)  # so that a later start_runners on this store can replace it
        return self

    def stop(self) -> None:
        """Ask the thread to finish after its current attempt."""
        self._stop.set()
        self.stats.state = "stopping"

    @property
    def stop_requested(self) -> bool:
        """Whether :meth:`stop` (or :meth:`abort`) was called: the thread ends after its current attempt."""
        return self._stop.is_set()

    def abort(self, reason: str = "aborted by the caller") -> None:
        """Ask the thread to end its in-flight attempt ``failed`` (error ``"aborted: <reason>"``) and exit.

        Returns at once; the runner notices within about one second.
        """
        self._abort_reason = reason
        self._abort.set()
        self.stop()

    @property
    def abort_requested(self) -> bool:
        """Whether :meth:`abort` was called: the in-flight attempt ends ``failed``."""
        return self._abort.is_set()

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
                "timed_out": self.stats.timed_out, "abandoned": self.stats.abandoned,
                "judge_errors": self.stats.judge_errors})
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

    def step(self, task: Any, resources: Optional[dict[str, Any]] = None, *, reward_required: bool = True) -> Rollout:
        """Run one rollout of ``task`` now, in the caller's thread and context (online mode).

        The runner's thread need not be started: ``Runner(agent, store, Tracer(store)).step(task)``.
        The rollout is created with :meth:`LightningStore.start_rollout` (never queued, so
        no other runner takes it; its metadata ``{"traffic": "runner"}``, :data:`~lightning_nb.types.TRAFFIC_KEY`,
        marks it as traffic a user started), then run like a dequeued one (:meth:`run_attempt`):
        spans and rewards land in the store while the agent runs; the agent runs in a
        helper thread that copies the caller's ``contextvars`` and is bounded by
        ``default_timeout_s``. The rollout has one attempt (``max_attempts=1``).

        Args:
            task: the rollout input handed to the agent.
            resources: ``{name: LLMResource | PromptTemplate | dict}`` stored with
                ``store.add_resources`` (so it also becomes the store's latest set) and
                referenced by the rollout's ``resources_id``; None uses the latest set.
            reward_required: True (default): an agent that returns None and emits no reward fails the attempt
                (``NO_REWARD_ERROR``). False, for traffic users send (reference doc 000, continuous learning): the
                rollout ends ``succeeded`` without a reward (its final reward is None, "unlabelled") until
                ``store.label(rollout_id, reward)`` or a judge gives it one.

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
        item = self.store.start_rollout(task, resources_id=resources_id, worker_id=self.worker_id,
                                        metadata={TRAFFIC_KEY: "runner"})
        if not reward_required:
            self._reward_optional.add(item.attempt.attempt_id)
        try:
            self.run_attempt(item)
        finally:
            self._reward_optional.discard(item.attempt.attempt_id)
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
            resource = self._llm_resource(rollout)
            llm = attributed_llm(resource, rid, aid, rollout.metadata.get(SAMPLING_PARAMETERS_KEY))
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
        failure = self._call_hooks(item, "on_rollout_start", self.agent, self, item)
        if failure is not None:  # the agent is not called
            status = self._finish(rid, aid, "failed", failure)
        else:
            status = self._run_agent(item, llm, resource)
        self._call_hooks(item, "on_rollout_end", self.agent, self, item, status)
        return status

    def _call_hooks(self, item: AttemptedRollout, method: str, *args: Any) -> Optional[str]:
        """Call ``method`` on the hooks in order; on an exception record it and return the attempt error text.

        The error is stored as a :data:`~lightning_nb.runners.hooks.HOOK_ERROR_SPAN` span on the attempt
        and warned once per group (kind ``"hook error"``); None when every hook returned.
        """
        failed = call_hooks(self.hooks, method, *args)
        if failed is None:
            return None
        where, exc, tb = failed
        rid, aid = item.rollout.rollout_id, item.attempt.attempt_id
        text = hook_error_text(where, exc, tb)
        log.warning("%s: %s", self.worker_id, text.splitlines()[0])
        try:
            self.store.add_span(hook_error_span(rid, aid, where, exc, tb))
        except Exception as store_exc:  # the attempt error (or this log line) still says it
            log.warning("%s: could not store the hook error span of %s: %s", self.worker_id, aid, store_exc)
        if self.notices.first("hook error"):
            warn_hook_error(self.worker_id, rid, text.splitlines()[0], final=method == "on_rollout_end")
        return text

    def _run_agent(self, item: AttemptedRollout, llm: LLMResource, resource: LLMResource) -> str:
        """Run the agent thread of a started attempt, watch it and record its outcome; the final status."""
        rid, aid = item.rollout.rollout_id, item.attempt.attempt_id
        outcome: dict[str, Any] = {}
        ctx = contextvars.copy_context()
        worker = threading.Thread(target=ctx.run, args=(self._call_agent, item, llm, outcome),
                                  name=f"{self.worker_id}-agent", daemon=True)
        self.current = (rid, aid)
        self.tracer.open_attempt(rid, aid)  # counts its reward spans and records spans the store lost
        worker.start()
        try:
            ended = self._watch(worker, item.rollout, rid, aid)
            if ended is not None:  # aborted, timed out, or ended elsewhere: the agent thread is left behind
                return ended
        except BaseException:  # KeyboardInterrupt in Runner.step: end the attempt, then re-raise
            self._finish(rid, aid, "failed", "aborted: interrupted (KeyboardInterrupt) while the agent ran")
            raise
        finally:
            self.current = None
            spans = self.tracer.close_attempt(rid, aid)  # also on the early returns: nothing is left open
            self.stats.judge_errors += spans.judge_errors
        if spans.lost and (ended := self._heartbeat(rid, aid)) is not None:  # ended elsewhere: its spans refused
            self.stats.abandoned += 1
            self.stats.state, self.stats.current_rollout = "idle", None
            return ended
        status, error, kind, summary = self._verdict(outcome, spans, rid, aid, resource.endpoint)
        if status == "succeeded" and not self._called_model(rid, aid):
            if self._calls_model:
                status, error, kind, summary = "failed", NO_LLM_CALL_ERROR, NO_LLM_CALL, NO_LLM_CALL_ERROR
            else:
                self.stats.no_llm_call += 1
        if kind is not None:
            self.notices.notify(kind, self.worker_id, rid, summary)
        status = self._finish(rid, aid, status, error)
        if kind == UNREACHABLE:  # after the attempt is recorded: the gate may requeue its rollout
            self.gate.close(resource.endpoint, rid)
        return status

    def _agent_resources(self, rollout: Rollout, llm: LLMResource) -> dict[str, Any]:
        """The rollout's resources set as ``{name: resource}``, with the attempt's attributed ``llm`` in it."""
        resources = (self.store.get_resources_by_id(rollout.resources_id) if rollout.resources_id
                     else self.store.get_latest_resources())
        return {**(resources.resources if resources is not None else {}), self.llm_resource: llm}

    def _llm_resource(self, rollout: Rollout) -> LLMResource:
        """The rollout's LLM resource named ``llm_resource``: from its resources set, else the store's latest.

        Raises:
            ConfigError: the set has no resource of that name (none was published).
        """
        resources = (self.store.get_resources_by_id(rollout.resources_id) if rollout.resources_id
                     else self.store.get_latest_resources())
        if resources is None or self.llm_resource not in resources.resources:
            raise ConfigError(f"no {self.llm_resource!r} resource in the store; call store.add_resources("
                              f"{{'{self.llm_resource}': proxy.as_resource()}}) before enqueuing rollouts")
        return resources.resources[self.llm_resource]

    def _watch(self, worker: threading.Thread, rollout: Rollout, rid: str, aid: str) -> Optional[str]:
        """Wait for the agent thread, sending the attempt's heartbeats; None once the agent returned.

        Returns the attempt's final status when it ended before the agent did: ``"failed"`` on
        :meth:`abort`, ``"timeout"`` past the rollout's ``timeout_seconds`` (else
        ``default_timeout_s``), or the terminal status a heartbeat found (the watchdog or a cancel
        ended it elsewhere).
        """
        timeout = rollout.config.timeout_seconds or self.default_timeout_s
        deadline = None if timeout is None else time.monotonic() + timeout
        beat = self.heartbeat_interval_s
        if rollout.config.unresponsive_seconds is not None:
            beat = min(beat, rollout.config.unresponsive_seconds / 3)
        next_beat = time.monotonic() + beat
        while worker.is_alive():
            now = time.monotonic()
            wake = min(1.0, next_beat - now, (deadline - now) if deadline is not None else 1.0)
            worker.join(max(0.0, wake))
            self.stats.last_heartbeat = time.time()
            if not worker.is_alive():
                break
            if self._abort.is_set():
                return self._finish(rid, aid, "failed", f"aborted: {self._abort_reason}", flush=True)
            if deadline is not None and time.monotonic() >= deadline:
                # Threads cannot be killed: the agent thread is abandoned (daemon) and whatever it
                # records later stays attached to this timed-out attempt.
                error = f"agent ran past timeout_seconds={timeout}"
                self.notices.notify("timeout", self.worker_id, rid, error)
                return self._finish(rid, aid, "timeout", error, flush=True)
            if time.monotonic() >= next_beat:
                next_beat = time.monotonic() + beat
                ended = self._heartbeat(rid, aid)
                if ended is not None:  # ended elsewhere (watchdog, cancel): leave the agent behind
                    self.stats.abandoned += 1
                    self.stats.state, self.stats.current_rollout = "idle", None
                    return ended
        return None

    def _verdict(self, outcome: dict[str, Any], spans: AttemptSpans, rid: str, aid: str,
                 endpoint: str) -> tuple[str, Optional[str], Optional[str], str]:
        """``(status, error, failure kind or None, one-line summary)`` of an attempt whose agent returned."""
        lost = "\n".join(spans.lost)
        hook_error = outcome.get("hook_error")
        if "error" in outcome:
            exc = outcome.get("exc")
            hint = unreachable_endpoint_hint(exc, endpoint, self.llm_resource) if exc is not None else None
            kind = UNREACHABLE if hint else type(exc).__name__ if exc is not None else "agent error"
            summary = hint or (f"{type(exc).__name__}: {first_line(exc)}" if exc is not None
                               else outcome["error"].strip().splitlines()[-1])
            error = "\n".join(part for part in (hint, outcome["error"].rstrip(), hook_error, lost) if part)
            return "failed", error, kind, summary
        if hook_error is not None:  # on_trace_start or on_trace_end raised (already warned once as "hook error")
            return "failed", "\n".join(part for part in (hook_error, lost) if part), None, ""
        if spans.lost:  # the attempt's record is incomplete (its reward, maybe): do not pass it off as succeeded
            return "failed", lost, "lost span", spans.lost[0]
        if (outcome.get("returned_none") and aid not in self._reward_optional and spans.rewards_stored == 0
                and not self._reward_in_store(rid, aid)):
            return "failed", NO_REWARD_ERROR, "no reward", NO_REWARD_ERROR
        return "succeeded", None, None, ""

    def _called_model(self, rid: str, aid: str) -> bool:
        """Whether the attempt (its rollout's latest) has an LLM span in the store; True when the store cannot say."""
        try:
            return self.store.llm_call_counts([rid])[rid] > 0
        except Exception as exc:
            log.warning("%s: could not count the LLM calls of %s: %s", self.worker_id, aid, exc)
            return True

    def _reward_in_store(self, rid: str, aid: str) -> bool:
        """Whether the store has a reward span of the attempt written by other means than this runner's tracer."""
        try:
            return any(s.name == REWARD_SPAN for s in self.store.query_spans(rid, aid))
        except Exception as exc:  # cannot tell: the tracer counted none
            log.warning("%s: could not look up the reward spans of %s: %s", self.worker_id, aid, exc)
            return False

    def _call_agent(self, item: AttemptedRollout, llm: LLMResource, outcome: dict) -> None:
        """The agent thread: the trace context, the trace hooks around the agent, its reward; fills ``outcome``."""
        rid, aid = item.rollout.rollout_id, item.attempt.attempt_id
        try:
            with self.tracer.trace_context(rid, aid):
                try:
                    failure = self._call_hooks(item, "on_trace_start", self.agent, self, self.tracer, item)
                    if failure is not None:
                        outcome["hook_error"] = failure
                    else:
                        self._agent_result(item, llm, outcome)
                finally:
                    failure = self._call_hooks(item, "on_trace_end", self.agent, self, self.tracer, item)
                    if failure is not None:
                        outcome.setdefault("hook_error", failure)
        except BaseException as exc:  # the traceback is kept on the attempt
            outcome["error"] = traceback.format_exc()
            outcome["exc"] = exc

    def _agent_result(self, item: AttemptedRollout, llm: LLMResource, outcome: dict) -> None:
        """Call the agent and emit its returned reward, inside the trace context; an exception goes to ``outcome``.

        An agent with a ``resources`` parameter also gets the rollout's whole resources set (``{name: resource}``,
        the one pinned at enqueue; its LLM resource is ``llm``, attributed to the attempt), so it can read a
        :class:`~lightning_nb.types.PromptTemplate` an algorithm tunes.
        """
        try:
            if self._wants_resources:
                result = self.agent(item.rollout.input, llm, resources=self._agent_resources(item.rollout, llm))
            else:
                result = self.agent(item.rollout.input, llm)
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

    def _finish(self, rid: str, aid: str, status: str, error: Optional[str], *, flush: bool = False) -> str:
        """Record the attempt's end; ``flush``: first write the spans the tracer buffers for it (an attempt ended
        while its agent still runs), since the store refuses spans of an attempt that ended without success."""
        # counted first: whoever sees the attempt final in the store (wait_for_rollouts) then sees it in status()
        counter = {"succeeded": "succeeded", "failed": "failed", "timeout": "timed_out"}[status]
        setattr(self.stats, counter, getattr(self.stats, counter) + 1)
        if flush:
            self.tracer.processor.close(rid, aid)  # later spans of the abandoned agent are written, and refused
        try:
            self.store.update_attempt(rid, aid, status=status, error=error)
        except Exception as exc:  # e.g. the watchdog ended it or the rollout was cancelled meanwhile
            log.warning("%s: could not record %s for %s: %s", self.worker_id, status, aid, exc)
        self.stats.state, self.stats.current_rollout = "idle", None
        return status
