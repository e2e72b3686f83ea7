"""Waiting on an algorithm's loop: ``wait()``'s bar and warnings, and waiting for a step's rollouts.

:func:`wait_loop` is :meth:`~lightning_nb.algorithm.base.Algorithm.wait`: it shows the loop's phase
(``algo.progress``) and what the algorithm's ``waiting_for()`` adds, at once in a notebook kernel (``progress``
None, the default: :func:`lightning_nb._notebook.show_progress`). When nothing moved for well past the wait's own
pace (:data:`PACE_FACTOR` times the longest time between two moves it saw, and at least its ``stall_s``
seconds; :data:`PACE_FACTOR` × ``stall_s`` before it saw any move), or its ``timeout`` expired, it warns with the
algorithm's ``stall_advice()`` (why the loop may not move, and what to do). It reads the algorithm through
:class:`Waited`, the part of the contract it needs. The defaults of those two hooks, for any loop whose phase
counts rollouts of a store, are the functions here (:func:`rollouts_waiting_for`, :func:`default_stall_advice`);
an algorithm overrides the hooks with its own (``TrafficLearner``: labelled and unlabelled traffic).
:func:`wait_for_rollouts` is the loop's own wait for the rollouts it enqueued.
"""

from __future__ import annotations

import logging
import time
import warnings
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol

from lightning_nb._notebook import show_progress
from lightning_nb.algorithm.control import LoopControl, LoopStopped
from lightning_nb.algorithm.progress import LoopBar, LoopProgress
from lightning_nb.errors import ConfigError, LightningNbError, WaitWarning

if TYPE_CHECKING:
    from lightning_nb.store.base import LightningStore

__all__ = ["Waited", "wait_loop", "wait_for_rollouts", "store_queue", "rollouts_waiting_for",
           "default_stall_advice", "rollout_share", "STALL_S", "PACE_FACTOR"]

log = logging.getLogger(__name__)

#: Seconds without progress before ``wait()`` may say what it waits for and why (``wait(stall_s=...)``): the floor
#: of its stall warning, which waits for :data:`PACE_FACTOR` times the wait's own pace when that is longer.
STALL_S = 60.0
#: ``wait()`` warns of a stall only after this many times the longest time between two moves of the loop it saw
#: (a step's rollouts that all finish together after a minute are its pace, not a stall).
PACE_FACTOR = 3.0

_QUEUED = ("queuing", "requeuing")
_STARTED = ("preparing", "running")


def store_queue(store: "LightningStore") -> tuple[int, int]:
    """``(queued, started)``: the store's rollouts waiting for a runner, and those a runner took and has not finished."""
    active = store.query_rollouts(status=[*_QUEUED, *_STARTED])
    queued = sum(1 for r in active if r.status in _QUEUED)
    return queued, len(active) - queued


def rollouts_waiting_for(progress: LoopProgress, store: "Optional[LightningStore]") -> str:
    """``"16 queued, 0 running in the store"`` while ``progress`` (a ``LoopProgress``) counts rollouts; else ``""``."""
    if progress.unit != "rollouts" or progress.phase == "paused" or store is None:
        return ""
    queued, running = store_queue(store)
    return f"{queued} queued, {running} running in the store"


def default_stall_advice(progress: LoopProgress, store: "Optional[LightningStore]") -> str:
    """Why a loop at ``progress`` may not move, and what to do (``""``: nothing to say).

    A pause (call ``resume()``); rollouts queued and none started (no runner consumes the store:
    ``start_runners(agent, store)``, with the count of runners the store has not seen stop); rollouts running
    (a slow agent or engine: ``store.attempts_df()``); the weight update (micro-batches on a CPU).
    """
    if progress.phase == "paused":
        return f"The loop is paused {progress.boundary}: call resume() to go on."
    if progress.unit == "rollouts" and store is not None:
        queued, running = store_queue(store)
        if queued and not running:
            alive = sum(1 for w in store.query_workers() if w.status != "stopped")
            return (f"{queued} rollouts queued, none started: are runners running? start_runners(agent, store) runs "
                    f"them ({alive} runner(s) not stopped in store.workers_df()).")
        if running:
            return (f"{running} rollouts running, none finished meanwhile: long agent runs, or a busy engine; "
                    "store.attempts_df() shows their attempts (the rollout's timeout ends one).")
    if progress.phase == "update":
        return ("The weight update runs: each micro-batch is a forward and backward pass, minutes on a CPU for long "
                "sequences (a smaller micro_batch_size or max_tokens is faster).")
    return ""


class Waited(Protocol):
    """What :func:`wait_loop` reads of an algorithm (:class:`~lightning_nb.algorithm.base.Algorithm` has it all)."""

    loop: LoopControl
    global_step: int

    def waiting_for(self) -> str:
        """What the loop waits for beyond its progress (``""``: nothing to add)."""

    def stall_advice(self) -> str:
        """Why the loop may not move, and what to do (``""``: nothing to say)."""

    def rollout_share(self) -> float:
        """The share of a step's time its rollouts take, in [0, 1] (the rest is the update)."""


def wait_loop(host: Waited, timeout: Optional[float] = None, progress: Optional[bool] = None,
              until_step: Optional[int] = None, *, stall_s: Optional[float] = None, stacklevel: int = 3) -> bool:
    """``host.wait(...)``: block until the loop ends, ``until_step`` is reached or ``timeout`` seconds pass.

    See :meth:`~lightning_nb.algorithm.base.Algorithm.wait` for the bar and the warnings. ``stacklevel``: the
    frame the warnings point at, this function being 1 (3, the default: the caller of ``host.wait``).

    Raises:
        ConfigError: ``stall_s`` is not a number of seconds > 0.
        BaseException: the loop's own error (``host.loop.error``) when it failed.
    """
    stall = STALL_S if stall_s is None else stall_s
    if isinstance(stall, bool) or not isinstance(stall, (int, float)) or not stall > 0:
        raise ConfigError(f"wait(stall_s=...) must be a number of seconds > 0 (the default is "
                          f"STALL_S = {STALL_S:g}), got {stall_s!r}")
    waiter = _Waiter(host, until_step, stall, stacklevel)
    t0 = time.monotonic()
    bar = waiter.step_bar() if show_progress(progress) and not waiter.reached() else None
    waiter.bar = bar
    try:
        done = host.loop.wait_done(timeout, until=waiter.reached, tick=waiter.tick)
        if bar is not None:
            bar.move(*waiter.position(bar.first))
    finally:
        if bar is not None:
            bar.close()
    if host.loop.error is not None:
        raise host.loop.error
    if not done:
        goal = "the loop's end" if until_step is None else f"step {until_step} (at step {host.global_step})"
        waiter.warn(f"timeout={timeout:g} s expired after {time.monotonic() - t0:.1f} s, before {goal}; "
                    "the loop goes on (wait() again, or stop())", stacklevel)
    return done


class _Waiter:
    """One :func:`wait_loop` call: its bar, what it last saw (for the stall warning) and its live line."""

    def __init__(self, host: Waited, until_step: Optional[int], stall_s: float, stacklevel: int) -> None:
        self.host, self.until_step, self.stall_s, self.stacklevel = host, until_step, stall_s, stacklevel
        self.bar: Optional[LoopBar] = None
        self.seen: Any = None  # (step, progress) last seen
        self.since = time.monotonic()
        self.longest: Optional[float] = None  # the longest time between two moves seen (seconds): the wait's pace
        self.warned = False
        self.live: Optional[tuple[float, LoopProgress, str]] = None

    def reached(self) -> bool:
        return self.until_step is not None and self.host.global_step >= self.until_step

    def tick(self) -> None:
        """Move the bar; warn once when the step and the progress stayed as last seen for longer than
        :meth:`stall_after`."""
        if self.bar is not None:
            self.bar.move(*self.position(self.bar.first))
        key, now = (self.host.global_step, self.host.loop.progress), time.monotonic()
        if key != self.seen:
            if self.seen is not None and not self.warned:  # (a stall it warned about is no pace)
                self.longest = max(self.longest or 0.0, now - self.since)
            self.seen, self.since, self.warned = key, now, False
        elif not self.warned and now - self.since >= self.stall_after():
            self.warned, quiet = True, now - self.since
            pace = (" (it has not moved since the wait began)" if self.longest is None else
                    f" (before, at most {_secs(self.longest)} s between two moves)"
                    if PACE_FACTOR * self.longest > self.stall_s else "")
            # frames: warn, tick, LoopControl.wait_done, wait_loop, then wait_loop's caller
            self.warn(f"still waiting, no progress for {_secs(quiet)} s{pace}", self.stacklevel + 2)

    def stall_after(self) -> float:
        """Seconds without a move before the stall warning: ``stall_s``, or :data:`PACE_FACTOR` times the longest
        time between two moves seen so far when that is longer; before the wait saw any move (no pace yet), the
        generous :data:`PACE_FACTOR` × ``stall_s`` (3 minutes by default)."""
        if self.longest is None:
            return PACE_FACTOR * self.stall_s
        return max(self.stall_s, PACE_FACTOR * self.longest)

    def warn(self, what: str, stacklevel: int) -> None:
        """Warn (:class:`~lightning_nb.errors.WaitWarning`) with ``what``, the live line and the stall advice."""
        self.live = None  # read afresh
        advice = _hook_text(self.host.stall_advice)
        message = f"{type(self.host).__name__}.wait(): {what}. Waiting at: {self.live_line()}."
        warnings.warn(WaitWarning(f"{message} {advice}" if advice else message), stacklevel=stacklevel + 1)

    def live_line(self) -> str:
        """``str(progress)``, then what ``waiting_for()`` adds; the hook is read at most once a second (it may
        query the store) and again whenever the progress changed."""
        p, now = self.host.loop.progress, time.monotonic()
        live = self.live
        if live is None or live[1] != p or now - live[0] >= 1.0:
            extra = _hook_text(self.host.waiting_for)
            live = self.live = (now, p, f"{p} · {extra}" if extra else str(p))
        return live[2]

    def step_bar(self) -> Optional[LoopBar]:
        """The bar, counting steps from the running loop's first (None when no loop runs)."""
        loop = self.host.loop
        if not loop.running:
            return None
        first = loop.loop_steps[0] if loop.loop_steps is not None else self.host.global_step
        last = self.until_step if self.until_step is not None else (loop.loop_steps or (0, None))[1]
        desc = "training" if self.until_step is None else f"training to step {self.until_step}"
        n, live = self.position(first)
        bar = LoopBar(loop.paused_total, None if last is None else last - first, n, desc, "steps", decimals=2,
                      postfix=live)
        bar.first = first
        return bar

    def position(self, first: int) -> tuple[float, str]:
        """``(steps done since step first, with the fraction of the step in progress; the live line)``.

        The fraction is ``share × rollouts done/total`` while collecting and ``share + (1 − share) ×
        micro-batches done/total`` while updating, ``share`` the host's ``rollout_share()`` (the previous
        step's part of rollout time in rollout + update time); evaluation comes after the step counted whole.
        """
        step = self.host.global_step
        p = self.host.loop.progress
        within = 0.0
        if p.step == step + 1 and p.phase in ("rollouts", "update"):
            share = self.host.rollout_share()
            within = share * p.fraction if p.phase == "rollouts" else share + (1 - share) * p.fraction
        return max(0.0, step - first + min(within, 0.999)), self.live_line()


def _secs(seconds: float) -> str:
    """``"0.4"``, ``"12"``: seconds with a decimal below 10."""
    return f"{seconds:.{1 if seconds < 10 else 0}f}"


def _hook_text(hook: Callable[[], str]) -> str:
    """``hook()``, or ``""`` when it fails (a store that went away must not break a wait)."""
    try:
        return hook()
    except Exception:  # the wait goes on without the text
        log.debug("%s failed", getattr(hook, "__name__", hook), exc_info=True)
        return ""


def rollout_share(metrics: list[dict[str, Any]]) -> float:
    """The last row's ``rollout_seconds`` over its ``rollout_seconds + update_seconds``, in [0.05, 0.95]; 0.5
    before any row (or without those columns)."""
    rows = metrics or [{}]
    r, u = rows[-1].get("rollout_seconds"), rows[-1].get("update_seconds")
    if not isinstance(r, (int, float)) or not isinstance(u, (int, float)) or not r + u > 0:
        return 0.5
    return min(0.95, max(0.05, r / (r + u)))


def wait_for_rollouts(store: "LightningStore", loop: LoopControl, rollout_ids: list[str], desc: Optional[str] = None,
                      start_timeout_s: Optional[float] = None,
                      on_progress: Optional[Callable[[int, int], None]] = None) -> bool:
    """Wait until every rollout of ``store`` in ``rollout_ids`` is terminal; a tqdm.auto bar named ``desc`` if given.

    Returns True when all are terminal. With ``start_timeout_s``, returns False (having
    cancelled them) when none has left the queue after that many seconds: no runner is
    consuming the store. ``on_progress(finished, total)`` is called at each poll (about
    once a second) with the count of terminal rollouts of ``rollout_ids`` and ``len(rollout_ids)``.

    Raises:
        LoopStopped: ``loop`` was stopped while waiting (the rollouts are cancelled).
    """
    bar = None
    if desc:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(rollout_ids), desc=desc, unit="rollout")
    try:
        t0 = time.monotonic()
        while True:
            done = store.wait_for_rollouts(rollout_ids, timeout=1.0, progress=False)
            if bar is not None:
                bar.update(len(done) - bar.n)
            if on_progress is not None:
                on_progress(len(done), len(rollout_ids))
            if len(done) == len(rollout_ids):
                return True
            stopped = loop.stop_requested
            idle = start_timeout_s is not None and time.monotonic() - t0 > start_timeout_s and all(
                r.status == "queuing" for r in store.query_rollouts(rollout_ids=rollout_ids))
            if stopped or idle:
                _cancel(store, rollout_ids)
                if stopped:
                    raise LoopStopped("stopped while waiting for rollouts")
                return False
    finally:
        if bar is not None:
            bar.close()


def _cancel(store: "LightningStore", rollout_ids: list[str]) -> None:
    for rid in rollout_ids:
        try:
            store.cancel_rollout(rid)
        except LightningNbError:
            pass  # already terminal
