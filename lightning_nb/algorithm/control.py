"""The background thread of an algorithm's loop, which a notebook cell pauses, resumes and stops.

:class:`LoopControl` is a component every algorithm owns (``algo.loop``; the algorithm's verbs ``pause``,
``resume``, ``stop``, ``state`` and ``progress`` are its). The loop itself (the algorithm's ``run``) calls
:meth:`LoopControl.at_boundary` at each point where nothing is in flight: before a step collects rollouts,
between dynamic-sampling rounds, before the weight update and before an evaluation. That is where it parks
while paused and where it ends when stopped (:class:`LoopStopped`). As it works, the loop also calls
:meth:`LoopControl.report_progress`: :attr:`LoopControl.progress` says which step and phase it is in and how
far that phase is (rollouts finished of enqueued, micro-batches done of the update's), and the bars of
``wait()`` and ``pause()`` (shown by default in a notebook kernel) move with it inside a step. What ``wait()``
shows and says while it waits is :mod:`lightning_nb.algorithm.waiting`'s.

Why an event and not ``Thread.is_alive()``: a ``KeyboardInterrupt`` (Jupyter's
"interrupt kernel") that lands inside ``Thread.join()`` can leave CPython believing a live
thread has finished (cpython#90882), so ``state``, ``wait()`` and the guard in ``start()``
read the loop's own ``done`` event, set only when the loop function returns, and every
wait here is a short, interruptible ``Event.wait``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import replace
from typing import Any, Callable, Iterator, Optional

from lightning_nb._notebook import show_progress
from lightning_nb.algorithm.progress import LoopBar, LoopProgress
from lightning_nb.errors import LightningNbError
# the config-edit rule lives with the trainers, which apply their own config's edits too (kept importable here)
from lightning_nb.trainers.base import config_edits

__all__ = ["LoopControl", "LoopProgress", "LoopStopped", "TrainerStopped", "config_edits"]

log = logging.getLogger(__name__)


class LoopStopped(LightningNbError):
    """Raised inside an algorithm's loop when its ``stop()`` was called; the loop's thread ends quietly with it."""


#: The name of :class:`LoopStopped` before the loop became the algorithm's (APO has no trainer); kept one release.
TrainerStopped = LoopStopped


class LoopControl:
    """Pause/resume/stop control of one background loop: the component ``algo.loop`` of every algorithm.

    States (:attr:`state`): ``idle`` (never started), ``running``, ``pausing`` (a pause
    was asked; the loop has not reached its next step boundary yet), ``paused`` (parked
    at a step boundary), ``stopped``, ``failed`` (:attr:`error` holds the exception),
    ``finished``. Inside a step, :attr:`progress` says where the loop is (:class:`LoopProgress`).

    Args:
        steps_done: the owner's step counter (``lambda: algo.global_step``), named in the log when the loop ends.
    """

    def __init__(self, steps_done: Callable[[], int]) -> None:
        self.steps_done = steps_done
        self.error: Optional[BaseException] = None
        self.paused_seconds = 0.0  # total time the loop spent parked (seconds)
        #: (first step, last step) of the running loop, None without a step count (run until stopped)
        self.loop_steps: Optional[tuple[int, int]] = None
        self._control = threading.Condition()
        self._pause_requested = False
        self._parked = False
        self._parked_at = ""
        self._stop = threading.Event()
        self._done = threading.Event()
        self._done.set()  # no loop running
        self._thread: Optional[threading.Thread] = None
        self._parked_since = 0.0  # time.monotonic() when the loop parked
        self._progress = LoopProgress()
        self._cell_bar: Optional[LoopBar] = None  # step_bar(): a step run from a cell shows its phase
        self._cell_bar_lock = threading.Lock()  # the step's thread and the bar's clock thread both draw it

    # ----- the loop's side ------------------------------------------------------------
    def start(self, body: Callable[[], Any], first_step: int, last_step: Optional[int]) -> None:
        """Run ``body()`` in a daemon thread; the loop counts steps ``first_step + 1`` to ``last_step`` (None: no end).

        Raises:
            LightningNbError: a loop is still running.
        """
        if not self._done.is_set():
            raise LightningNbError("this algorithm's loop is already running; call stop() or wait() first")
        self._stop.clear()
        with self._control:
            self._pause_requested = False
            self._parked = False
        self.error = None
        self.loop_steps = (first_step, last_step) if last_step is not None else None
        self._progress = LoopProgress(step=first_step + 1, phase="starting")
        self._done.clear()
        self._thread = threading.Thread(target=self._target, args=(body,), name="lightning_nb-loop", daemon=True)
        self._thread.start()

    def _target(self, body: Callable[[], Any]) -> None:
        try:
            body()
        except LoopStopped:
            log.info("loop stopped at step %s", self.steps_done())
        except BaseException as exc:  # surfaced through .state and .error
            self.error = exc
            log.exception("the loop failed at step %s", self.steps_done())
        finally:
            with self._control:
                self._parked = False
                self._control.notify_all()
            self._progress = replace(self._progress, phase="ended")
            self._done.set()

    def in_loop_thread(self) -> bool:
        """True when called from the background loop's own thread."""
        return threading.current_thread() is self._thread

    def sleep(self, seconds: float) -> bool:
        """Wait ``seconds`` (interruptible by :meth:`stop`); returns True when the loop was stopped meanwhile."""
        return self._stop.wait(seconds)

    def at_boundary(self, where: str = "") -> None:
        """Called by the loop at a step boundary: park here while paused; raise when stopped.

        Only the background loop's own thread parks: a step run directly from a cell
        never blocks here. ``where`` names the boundary (shown by :attr:`paused_at`).

        Raises:
            LoopStopped: :meth:`stop` was called.
        """
        if self._stop.is_set():
            raise LoopStopped(f"stopped {where}".strip())
        if threading.current_thread() is not self._thread:
            return
        with self._control:
            if not self._pause_requested:
                return
            t0 = self._parked_since = time.monotonic()
            self._parked_at = where
            while self._pause_requested and not self._stop.is_set():
                if not self._parked:  # (again, if a resume() and a new pause() came between two wake-ups)
                    self._parked = True
                    self._control.notify_all()
                self._control.wait(0.5)
            self._parked = False
            self.paused_seconds += time.monotonic() - t0
        if self._stop.is_set():
            raise LoopStopped(f"stopped while paused {where}".strip())

    def report_progress(self, phase: str, done: int, total: int, *, unit: str, step: int,
                        sample_round: int = 0) -> None:
        """Called by the loop as it works: :attr:`progress` becomes this snapshot (:class:`LoopProgress`).

        Cheap (one small object; I/O and a lock only while a cell's step bar is open): the algorithm calls it at
        each poll of its rollouts (about once a second) and the trainer's update after each micro-batch. A call
        from another thread while a background loop runs (a cell's ``evaluate()`` while the loop
        is paused) is ignored, so the record stays the loop's. ``sample_round`` (1, 2, ...): the step's
        sample round, when ``done`` and ``total`` count every round so far (the bar of a step keeps one
        count and one clock across them); 0: the phase is not counted in rounds.
        """
        if not self._done.is_set() and threading.current_thread() is not self._thread:
            return
        self._progress = LoopProgress(step=step, phase=phase, done=done, total=total, unit=unit,
                                      sample_round=sample_round)
        if self._cell_bar is None:
            return
        with self._cell_bar_lock:  # a step run from a cell: its bar follows the phase
            bar = self._cell_bar
            if bar is None:
                return
            key = (step, phase, total) if not sample_round else (step, phase, "rounds")
            if bar.key != key:
                bar.key = key
                bar.restart(total or None, done, f"step {step}: {phase}", unit)
            elif total:
                bar.retotal(total)  # the next sample round: one total, one clock
            bar.move(done, f"sample round {sample_round}" if sample_round > 1 else "")

    @contextlib.contextmanager
    def step_bar(self, show: Optional[bool], desc: str = "step") -> Iterator[None]:
        """While the block runs, a tqdm.auto bar named ``desc`` that :meth:`report_progress` moves: the phase of the
        step being run (``step N: rollouts``, its sample rounds as a postfix, then ``step N: update`` micro-batches,
        then ``evaluate``). ``show`` False, or a bar already open: none; None: in a notebook kernel only
        (:func:`lightning_nb._notebook.show_progress`).

        The bar's clock moves every second even while the step's own thread reports nothing (one micro-batch of
        an update can take tens of seconds on a CPU): a daemon thread redraws it, so the cell is never silent."""
        if not show_progress(show) or self._cell_bar is not None:
            yield
            return
        self._cell_bar = LoopBar(self.paused_total, None, 0, desc, "rollouts", decimals=0)
        ended = threading.Event()
        clock = threading.Thread(target=self._tick_cell_bar, args=(ended,), name="lightning-nb-step-bar", daemon=True)
        clock.start()
        try:
            yield
        finally:
            ended.set()
            with self._cell_bar_lock:
                bar, self._cell_bar = self._cell_bar, None
            bar.close()

    def _tick_cell_bar(self, ended: threading.Event) -> None:
        """Redraw :meth:`step_bar`'s bar each second (its clock), until ``ended`` is set."""
        while not ended.wait(1.0):
            with self._cell_bar_lock:
                bar = self._cell_bar
                if bar is not None:
                    bar.move(bar.tqdm.n, bar.postfix)

    @property
    def progress(self) -> LoopProgress:
        """Where the loop is (:class:`LoopProgress`): step, phase, done/total of the phase.

        While the loop is parked the phase reads ``"paused"`` (``boundary`` names where), whatever the
        phase before; once it ended, ``"ended"``.
        """
        p = self._progress
        if self._parked and not self._done.is_set():
            return p.paused_at(self._parked_at)
        return p

    def paused_total(self) -> float:
        """Seconds the loop spent parked, the current park included."""
        with self._control:
            now = time.monotonic() - self._parked_since if self._parked else 0.0
            return self.paused_seconds + now

    # ----- the notebook's side ----------------------------------------------------------
    def pause(self, wait: bool = True, timeout: Optional[float] = None, progress: Optional[bool] = None) -> bool:
        """Pause the loop at its next step boundary.

        With ``wait`` this returns once the loop is parked there: no weight update is
        running, the algorithm enqueues nothing, the step's rollouts already enqueued
        have finished (the loop waits for them before it parks), and the engine serves
        ``engine.chat()`` at once. A pause during a collection round therefore waits for
        that round's rollouts (seconds to a minute on CPU), one during the update for its
        remaining micro-batches. ``progress`` (with ``wait``) shows a tqdm.auto bar of what the
        pause waits for: the phase's rollouts or micro-batches (:attr:`progress`); None (the default): in a
        notebook kernel, not in a script (:func:`lightning_nb._notebook.show_progress`).

        Returns True when the loop is parked (or no loop runs), False if ``timeout``
        seconds passed first (the pause stays requested; :attr:`state` is ``pausing``).
        Interrupting the call leaves the pause requested.
        """
        with self._control:
            self._pause_requested = True
        if not wait:
            return self._parked or self._done.is_set()
        deadline = None if timeout is None else time.monotonic() + timeout
        bar = None
        progress = show_progress(progress)
        try:
            while True:
                with self._control:
                    if self._parked or self._done.is_set():
                        return True
                    if deadline is not None and time.monotonic() >= deadline:
                        return False
                    self._control.wait(0.2)
                if progress and not self._parked and not self._done.is_set():
                    bar = self._pause_bar(bar)
        finally:
            if bar is not None:
                bar.close()

    def _pause_bar(self, bar: Optional[LoopBar]) -> LoopBar:
        """Open or move the bar of :meth:`pause`: the current phase's done of total."""
        p = self._progress
        desc = f"pausing: step {p.step} {p.phase}"
        if bar is None:
            bar = LoopBar(self.paused_total, p.total or None, p.done, desc, p.unit, decimals=0)
        elif bar.key != (p.step, p.phase, p.total):  # the phase began counting, or ended between two polls
            bar.restart(p.total or None, p.done, desc, p.unit)
        bar.key = (p.step, p.phase, p.total)
        bar.move(p.done, "")
        return bar

    def resume(self) -> None:
        """Leave a pause (the owner checks config edits first: ``Algorithm.resume``)."""
        with self._control:
            self._pause_requested = False
            self._parked = False  # running from here on, even before the loop's thread wakes
            self._control.notify_all()

    def stop(self, timeout: float = 600.0) -> bool:
        """Ask the loop to end at its next step boundary and wait up to ``timeout`` seconds.

        Rollouts the loop is waiting for are cancelled. Returns True once the loop has ended.
        """
        self._stop.set()
        with self._control:
            self._control.notify_all()
        return self.wait_done(timeout)

    def wait_done(self, timeout: Optional[float], until: Optional[Callable[[], bool]] = None,
                  tick: Optional[Callable[[], None]] = None) -> bool:
        """Wait until the loop ended or ``until()`` holds, calling ``tick()`` about 5 times a second meanwhile.

        Returns True then, False when ``timeout`` seconds passed first (None: no limit).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while not ((until is not None and until()) or self._done.wait(0.2)):
            if tick is not None:
                tick()
            if deadline is not None and time.monotonic() >= deadline:
                return False
        return True

    @property
    def stop_requested(self) -> bool:
        """True once :meth:`stop` was called (until the next :meth:`start`)."""
        return self._stop.is_set()

    @property
    def running(self) -> bool:
        """True while the background loop has not ended (running, pausing or paused)."""
        return not self._done.is_set()

    @property
    def paused_at(self) -> str:
        """The boundary the loop is parked at (e.g. ``'before update'``), or ``''``."""
        return self._parked_at if self._parked else ""

    @property
    def state(self) -> str:
        """idle | running | pausing | paused | stopped | failed | finished (see the class docstring)."""
        if self.error is not None:
            return "failed"
        if not self._done.is_set():
            if self._parked:
                return "paused"
            return "pausing" if self._pause_requested else "running"
        if self._stop.is_set():
            return "stopped"
        return "finished" if self._thread is not None else "idle"
