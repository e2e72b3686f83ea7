"""A group of runner threads: starting, replacing and stopping them together.

:func:`~lightning_nb.runners.start_runners` starts one (:func:`start_thread_runners`) and returns its
:class:`RunnerGroup`; a Ray group (:class:`~lightning_nb.runners.ray.RayRunnerGroup`) shares its
lifecycle (:class:`GroupLifecycle`). What one runner does with one attempt is
:mod:`lightning_nb.runners.runner`.

Re-running ``start_runners``
----------------------------
``start_runners(agent, store)`` stops the runner threads still running on the same
``store`` object before starting the new ones (they finish their current attempt,
for at most :data:`REPLACE_STOP_TIMEOUT_S` seconds): re-running the cell no longer leaves the old group, with the
old agent, pulling from the same queue. That is what re-running is for, so it says so in an info line (a plain
line under the cell, :func:`lightning_nb._notebook.info_line`); only a replacement that ended attempts in flight
(runners aborted or abandoned) is a ``UserWarning``. ``replace=False`` keeps both. Runner threads are tracked per store
with weak references only. The group ``start_runners`` started last on a store is its
:func:`~lightning_nb.runners.live.live_runner_group`, which the dashboard's runner panel follows; the panel's
**Start runners** button (:meth:`RunnerGroup.restart`) goes through the same rule.

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

import logging
import time
import warnings
from typing import Any, Optional

import pandas as pd

from lightning_nb._notebook import info_line
from lightning_nb.errors import ConfigError
from lightning_nb.runners.failures import FailureNotices
from lightning_nb.runners.calling import declares_model_calls
from lightning_nb.runners.gate import EndpointGate, hold_if_llm_endpoint_dead
from lightning_nb.runners.live import LIVE
from lightning_nb.runners.runner import Agent, Runner
from lightning_nb.store.base import LightningStore
from lightning_nb.tracing.tracer import Tracer
from lightning_nb.types import html_view

__all__ = ["GroupLifecycle", "RunnerGroup", "start_thread_runners", "REPLACE_STOP_TIMEOUT_S"]

log = logging.getLogger(__name__)
# start_runners(replace=True): how long the previous group may finish its attempts. A rollout of the default CPU
# model takes seconds to tens of seconds on a loaded machine, and an aborted one is lost to its training step.
REPLACE_STOP_TIMEOUT_S = 60.0


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

    def _repr_html_(self) -> Optional[str]:
        return html_view(self)


class RunnerGroup(GroupLifecycle):
    """Handle on runner threads started by :func:`~lightning_nb.runners.start_runners`.

    Attributes:
        runners: the :class:`Runner` objects, one per thread.
        started_at: when the group was made (seconds since the epoch).
        replaced: what starting it did to the runners it replaced on its store (``"start_runners: stopped the
            previous group of 2 runner(s) ..."``, the line it printed or warned), ``""`` when it replaced none.
    """

    def __init__(self, runners: list[Runner]) -> None:
        if not runners:
            raise ConfigError("a RunnerGroup needs at least one Runner")
        self.runners = runners
        self.started_at = time.time()
        self.replaced = ""

    @property
    def store(self) -> LightningStore:
        """The store the group's runners work on."""
        return self.runners[0].store

    def restart(self) -> "RunnerGroup":
        """Start the same agent and settings again as a new group, through ``start_runners(replace=True)``.

        A Python thread cannot be started twice, so this makes a new group of as many
        runners, each carrying on its predecessor's counts, and it goes through the same
        rule as re-running a ``start_runners`` cell: runner threads still running on the
        store (this group's, or a newer group's) are stopped first, said the same way (an info line, or a
        ``UserWarning`` when attempts in flight were ended; the new group's :attr:`replaced`). The new group becomes the store's :func:`live_runner_group`.
        This is what the runner panel's **Start runners** button does.

        Returns:
            The new group (this one stays stopped).
        """
        first = self.runners[0]
        return start_thread_runners(first.agent, first.store, len(self.runners), tracer=first.tracer,
                                    default_timeout_s=first.default_timeout_s, llm_resource=first.llm_resource,
                                    heartbeat_interval_s=first.heartbeat_interval_s, replace=True,
                                    carry_from=self.runners, hooks=list(first.hooks))

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
        """One row per runner: state, current rollout, counts (``judge_errors``: LLM-judge calls that gave no score,
        recorded on their attempts; ``no_llm_call``: succeeded attempts whose agent never called the model),
        seconds since last heartbeat."""
        now = time.time()
        return pd.DataFrame([
            {"worker_id": r.worker_id, "state": r.stats.state, "alive": r.alive,
             "current_rollout": r.stats.current_rollout, "succeeded": r.stats.succeeded,
             "failed": r.stats.failed, "timed_out": r.stats.timed_out, "abandoned": r.stats.abandoned,
             "judge_errors": r.stats.judge_errors, "no_llm_call": r.stats.no_llm_call,
             "heartbeat_age_s": round(now - r.stats.last_heartbeat, 1)}
            for r in self.runners
        ])


def start_thread_runners(agent: Agent, store: LightningStore, n: int, *, tracer: Optional[Tracer],
                         default_timeout_s: Optional[float], llm_resource: str, heartbeat_interval_s: float,
                         replace: bool, carry_from: Optional[list[Runner]] = None,
                         hooks: Optional[list[Any]] = None) -> RunnerGroup:
    """Make ``n`` runners sharing one tracer, failure notices and endpoint gate; replace, register and start them.

    What ``start_runners(backend="threads")`` and :meth:`RunnerGroup.restart` do (the arguments are
    :func:`~lightning_nb.runners.start_runners`'s, checked there); ``carry_from``: runners whose
    counts the new ones carry on, one for one; ``hooks``: the same Hook instances go to every runner.
    """
    gate = EndpointGate(store, llm_resource)  # closed (holding the queue) when the LLM endpoint is dead now
    hold_if_llm_endpoint_dead(store, gate, hold=declares_model_calls(agent) is not False, stacklevel=4)
    tracer = tracer or Tracer(store)
    notices = FailureNotices()  # first failure of each kind warns once per group
    runners = [Runner(agent, store, tracer, default_timeout_s=default_timeout_s, llm_resource=llm_resource,
                      heartbeat_interval_s=heartbeat_interval_s, notices=notices, gate=gate, hooks=hooks)
               for _ in range(n)]
    for old, new in zip(carry_from or [], runners):
        for counter in ("succeeded", "failed", "timed_out", "judge_errors", "no_llm_call"):
            setattr(new.stats, counter, getattr(old.stats, counter))
    replaced = _replace_running(store, n) if replace else ""
    group = RunnerGroup(runners)
    group.replaced = replaced
    LIVE.register_group(group)
    for r in runners:
        r.group = group  # a running thread keeps its group alive, so live_runner_group finds it
        r.start()
    return group


def _replace_running(store: LightningStore, n_new: int) -> str:
    """Stop the runner threads running on ``store`` (see ``start_runners(replace=True)``) and say so: an info line,
    or a warning when attempts in flight were ended (runners aborted or abandoned). Returns what it said (``""``:
    nothing was running)."""
    previous = LIVE.running(store)
    if not previous:
        return ""
    ids = [r.worker_id for r in previous]
    t0 = time.monotonic()
    abandoned = RunnerGroup(previous).stop(timeout=REPLACE_STOP_TIMEOUT_S)
    late = [r.worker_id for r in previous if r.abort_requested]
    note = (f"; {len(late)} did not finish their attempt within {REPLACE_STOP_TIMEOUT_S:g} s and were aborted "
            f"(their rollouts are requeued per retry policy)" if late else "")
    if abandoned:
        note += f"; {len(abandoned)} could not be stopped and were abandoned: {', '.join(abandoned)}"
    message = (f"start_runners: stopped the previous group of {len(previous)} runner(s) on this store "
               f"({', '.join(ids)}) in {time.monotonic() - t0:.1f} s and replaced it with {n_new} new one(s)"
               f"{note}; pass replace=False to keep both")
    if late or abandoned:  # attempts in flight were ended: news that costs rollouts
        warnings.warn(message, UserWarning, stacklevel=4)
    else:
        info_line(message, log)
    return message
