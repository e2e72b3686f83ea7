"""Run an algorithm's loop in a background thread that a notebook cell can pause, resume and stop.

:class:`BackgroundLoop` is the control surface of the algorithm that owns the training loop
(mixed into :class:`~lightning_nb.algorithm.lightning_rl.LightningRL`: ``start``, ``pause``,
``resume``, ``stop``, ``wait``, ``state``, ``progress``; every trainer's verbs of the same names
delegate here). The loop itself (the algorithm's ``run``) calls
:meth:`BackgroundLoop.at_boundary` at each point where nothing is in flight: before a
step collects rollouts, between dynamic-sampling rounds, before the weight update and
before an evaluation. That is where it parks while paused and where it ends when stopped.
As it works, the loop also calls :meth:`BackgroundLoop.report_progress`: :attr:`BackgroundLoop.progress`
says which step and phase it is in and how far that phase is (rollouts finished of enqueued,
micro-batches done of the update's), and the bars of ``wait(progress=True)`` and
``pause(progress=True)`` move with it inside a step.

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

from lightning_nb.errors import LightningNbError
# the progress record and the config-edit rule live with the trainers, which report and apply them too
from lightning_nb.trainers.base import LoopProgress, config_edits

__all__ = ["BackgroundLoop", "LoopProgress", "TrainerStopped", "config_edits"]

log = logging.getLogger(__name__)


class TrainerStopped(LightningNbError):
    """Raised inside the training loop when :meth:`BackgroundLoop.stop` was called."""


_NO_ETA = "{l_bar}{bar}| {n:.%df}/{total_fmt} {unit} [{elapsed}{postfix}]"
_WITH_ETA = "{l_bar}{bar}| {n:.%df}/{total_fmt} {unit} [{elapsed}<{remaining}{postfix}]"


class _Bar:
    """A tqdm.auto bar that shows no ETA until a whole unit was measured while it was open, and whose clock
    leaves out the time the loop spent parked (so the ETA is the working rate's).

    tqdm's own ETA is ``(total - n) / rate``, with ``rate`` from the first update: a bar opened after some
    steps had finished and caught up in one update read "ETA 1 s". Here ``initial`` is where the bar opens,
    ``smoothing=0`` makes the rate ``(n - initial) / elapsed``, and ``{remaining}`` enters the format
    only once ``n - initial >= 1``.
    """

    def __init__(self, loop: "BackgroundLoop", total: Optional[float], initial: float, desc: str, unit: str,
                 decimals: int) -> None:
        from tqdm.auto import tqdm

        self.loop, self.decimals, self.initial = loop, decimals, initial
        self.eta = False
        self.paused = loop._paused_total()
        self.tqdm = tqdm(total=total, initial=initial, desc=desc, unit=unit, smoothing=0,
                         bar_format=_NO_ETA % decimals)
        self.postfix = ""
        self.shown = time.monotonic()
        self.first = 0  # wait(): the step the count starts at
        self.key: Any = None  # pause(): the (step, phase, total) counted

    def move(self, n: float, postfix: str) -> None:
        """Show ``n`` (never below the bar's current value) and ``postfix``; redraw when they changed or each second."""
        if self.tqdm.disable:  # TQDM_DISABLE=1 or no display: tqdm keeps no clock
            return
        paused = self.loop._paused_total()
        self.tqdm.start_t += paused - self.paused  # parked time is not working time
        self.paused = paused
        changed = n > self.tqdm.n or postfix != self.postfix
        self.tqdm.n = max(self.tqdm.n, n)
        if not self.eta and self.tqdm.n - self.initial >= 1:
            self.eta, changed = True, True
            self.tqdm.bar_format = _WITH_ETA % self.decimals
        if postfix != self.postfix:
            self.postfix = postfix
            self.tqdm.set_postfix_str(postfix, refresh=False)
        if changed or time.monotonic() - self.shown >= 1.0:
            self.tqdm.refresh()
            self.shown = time.monotonic()

    def restart(self, total: Optional[float], n: float, desc: str, unit: str) -> None:
        """Count another quantity from ``n`` (the rate and ETA start over)."""
        self.tqdm.reset(total=total)
        self.tqdm.total = total
        self.tqdm.n = self.tqdm.initial = self.initial = n
        self.tqdm.unit, self.eta = unit, False
        self.tqdm.bar_format = _NO_ETA % self.decimals
        self.tqdm.set_description_str(desc, refresh=False)

    def close(self) -> None:
        self.tqdm.close()


class BackgroundLoop:
    """Pause/resume/stop control of one background loop; mixed into the algorithm that owns the loop.

    The class it is mixed into has a ``trainer`` (whose ``step`` counts the steps done and whose
    ``metrics`` rows time them), a ``store`` (whose rollouts :meth:`wait_for` waits for) and a
    ``run(steps)`` method, the loop itself; :meth:`start` runs
    ``run`` in a daemon thread. States (:attr:`state`): ``idle`` (never started), ``running``, ``pausing`` (a pause
    was asked; the loop has not reached its next step boundary yet), ``paused`` (parked
    at a step boundary), ``stopped``, ``failed`` (:attr:`error` holds the exception),
    ``finished``. Inside a step, :attr:`progress` says where the loop is (:class:`LoopProgress`).
    """

    def _init_loop(self) -> None:
        self.error: Optional[BaseException] = None
        self.paused_seconds = 0.0  # total time the loop spent parked (seconds)
        self._control = threading.Condition()
        self._pause_requested = False
        self._parked = False
        self._parked_at = ""
        self._stop = threading.Event()
        self._done = threading.Event()
        self._done.set()  # no loop running
        self._thread: Optional[threading.Thread] = None
        self._loop_steps: Optional[tuple[int, int]] = None  # (first step, last step) of the running loop
        self._parked_since = 0.0  # time.monotonic() when the loop parked
        self._progress = LoopProgress()
        self._cell_bar: Optional[_Bar] = None  # step_bar(): a step run from a cell shows its phase

    # ----- the loop's side ------------------------------------------------------------
    def start(self, steps: Optional[int] = None) -> "BackgroundLoop":
        """Run ``self.run(steps)`` in a background thread and return at once (``steps`` None: ``config.steps``).

        Raises:
            LightningNbError: a loop started earlier on this trainer is still running (even if a wait()
                was interrupted).
        """
        if getattr(self.trainer, "algorithm", None) is not self and hasattr(self.trainer, "attach"):
            self.trainer.attach(self)  # refuses while another algorithm's loop runs on the trainer
        n = steps if steps is not None else getattr(getattr(self, "config", None), "steps", None)
        first = self._steps_done()
        self._start_loop(lambda: self.run(steps), first, None if n is None else first + n)
        return self

    def _steps_done(self) -> int:
        """The trainer's step: updates done."""
        return int(getattr(self.trainer, "step", 0))

    def _start_loop(self, body: Callable[[], Any], first_step: int, last_step: Optional[int]) -> None:
        """Run ``body()`` in a daemon thread; raises if a loop is still running."""
        if not self._done.is_set():
            raise LightningNbError("the trainer is already running; call stop() or wait() first")
        self._stop.clear()
        with self._control:
            self._pause_requested = False
            self._parked = False
        self.error = None
        self._loop_steps = (first_step, last_step) if last_step is not None else None
        self._progress = LoopProgress(step=first_step + 1, phase="starting")
        self._done.clear()

        def target() -> None:
            try:
                body()
            except TrainerStopped:
                log.info("trainer stopped at step %s", self._steps_done())
            except BaseException as exc:  # surfaced through .state and .error
                self.error = exc
                log.exception("training loop failed at step %s", self._steps_done())
            finally:
                with self._control:
                    self._parked = False
                    self._control.notify_all()
                self._progress = replace(self._progress, phase="ended")
                self._done.set()

        self._thread = threading.Thread(target=target, name="lightning_nb-trainer", daemon=True)
        self._thread.start()

    def at_boundary(self, where: str = "") -> None:
        """Called by the loop at a step boundary: park here while paused; raise when stopped.

        Only the background loop's own thread parks: a step run directly from a cell
        never blocks here. ``where`` names the boundary (shown by :attr:`paused_at`).

        Raises:
            TrainerStopped: :meth:`stop` was called.
        """
        if self._stop.is_set():
            raise TrainerStopped(f"stopped {where}".strip())
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
            raise TrainerStopped(f"stopped while paused {where}".strip())

    def wait_for(self, rollout_ids: list[str], desc: Optional[str] = None,
                 start_timeout_s: Optional[float] = None,
                 on_progress: Optional[Callable[[int, int], None]] = None) -> bool:
        """Wait until every rollout is terminal; a tqdm.auto bar named ``desc`` if given.

        Returns True when all are terminal. With ``start_timeout_s``, returns False (having
        cancelled them) when none has left the queue after that many seconds: no runner is
        consuming the store. ``on_progress(finished, total)`` is called at each poll (about
        once a second) with the count of terminal rollouts of ``rollout_ids`` and ``len(rollout_ids)``.

        Raises:
            TrainerStopped: the loop was stopped while waiting (the rollouts are cancelled).
        """
        bar = None
        if desc:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(rollout_ids), desc=desc, unit="rollout")
        try:
            return self._wait_loop(rollout_ids, bar, start_timeout_s, on_progress)
        finally:
            if bar is not None:
                bar.close()

    def _wait_loop(self, rollout_ids: list[str], bar: Any, start_timeout_s: Optional[float],
                   on_progress: Optional[Callable[[int, int], None]]) -> bool:
        t0 = time.monotonic()
        while True:
            done = self.store.wait_for_rollouts(rollout_ids, timeout=1.0)
            if bar is not None:
                bar.update(len(done) - bar.n)
            if on_progress is not None:
                on_progress(len(done), len(rollout_ids))
            if len(done) == len(rollout_ids):
                return True
            stopped = self.stop_requested
            idle = start_timeout_s is not None and time.monotonic() - t0 > start_timeout_s and all(
                r.status == "queuing" for r in self.store.query_rollouts(rollout_ids=rollout_ids))
            if stopped or idle:
                for rid in rollout_ids:
                    try:
                        self.store.cancel_rollout(rid)
                    except LightningNbError:
                        pass  # already terminal
                if stopped:
                    raise TrainerStopped("stopped while waiting for rollouts")
                return False

    def report_progress(self, phase: str, done: int, total: int, *, unit: str, step: int) -> None:
        """Called by the loop as it works: :attr:`progress` becomes this snapshot (:class:`LoopProgress`).

        Cheap (one small object, no I/O, no lock): the algorithm calls it at each poll of its
        rollouts (about once a second) and the trainer's update after each micro-batch. A call
        from another thread while a background loop runs (a cell's ``evaluate()`` while the loop
        is paused) is ignored, so the record stays the loop's.
        """
        if not self._done.is_set() and threading.current_thread() is not self._thread:
            return
        self._progress = LoopProgress(step=step, phase=phase, done=done, total=total, unit=unit)
        bar = self._cell_bar
        if bar is not None:  # a step run from a cell: its bar follows the phase
            if bar.key != (step, phase, total):
                bar.key = (step, phase, total)
                bar.restart(total or None, done, f"step {step}: {phase}", unit)
            bar.move(done, "")

    @contextlib.contextmanager
    def step_bar(self, show: bool) -> Iterator[None]:
        """While the block runs, a tqdm.auto bar that :meth:`report_progress` moves: the phase of the step being
        run (``step N: rollouts``, then ``step N: update`` micro-batches, then ``evaluate``). ``show`` False, or a
        bar already open: none."""
        if not show or self._cell_bar is not None:
            yield
            return
        self._cell_bar = _Bar(self, None, 0, "step", "rollouts", decimals=0)
        try:
            yield
        finally:
            bar, self._cell_bar = self._cell_bar, None
            bar.close()

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

    def _paused_total(self) -> float:
        """Seconds the loop spent parked, the current park included."""
        with self._control:
            now = time.monotonic() - self._parked_since if self._parked else 0.0
            return self.paused_seconds + now

    # ----- the notebook's side ----------------------------------------------------------
    def pause(self, wait: bool = True, timeout: Optional[float] = None, progress: bool = False) -> bool:
        """Pause the loop at its next step boundary.

        With ``wait`` this returns once the loop is parked there: no weight update is
        running, the algorithm enqueues nothing, the step's rollouts already enqueued
        have finished (the loop waits for them before it parks), and the engine serves
        ``engine.chat()`` at once. A pause during a collection round therefore waits for
        that round's rollouts (seconds to a minute on CPU), one during the update for its
        remaining micro-batches. ``progress`` (with ``wait``) shows a tqdm.auto bar of what the
        pause waits for: the phase's rollouts or micro-batches (:attr:`progress`).

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

    def _pause_bar(self, bar: Optional[_Bar]) -> _Bar:
        """Open or move the bar of :meth:`pause`: the current phase's done of total."""
        p = self._progress
        desc = f"pausing: step {p.step} {p.phase}"
        if bar is None:
            bar = _Bar(self, p.total or None, p.done, desc, p.unit, decimals=0)
        elif bar.key != (p.step, p.phase, p.total):  # the phase began counting, or ended between two polls
            bar.restart(p.total or None, p.done, desc, p.unit)
        bar.key = (p.step, p.phase, p.total)
        bar.move(p.done, "")
        return bar

    def resume(self) -> None:
        """Leave a pause; edits made while paused are checked first (see :meth:`_check_before_resume`).

        Raises:
            ConfigError: an edited config is invalid; the loop stays paused.
        """
        self._check_before_resume()
        with self._control:
            self._pause_requested = False
            self._parked = False  # running from here on, even before the loop's thread wakes
            self._control.notify_all()

    def _check_before_resume(self) -> None:
        """Hook: raise ConfigError for invalid edits made while paused."""

    def stop(self, timeout: float = 600.0) -> bool:
        """Ask the loop to end at its next step boundary and wait up to ``timeout`` seconds.

        Rollouts the loop is waiting for are cancelled. Returns True once the loop has ended.
        """
        self._stop.set()
        with self._control:
            self._control.notify_all()
        return self._wait_done(timeout)

    def wait(self, timeout: Optional[float] = None, progress: bool = False,
             until_step: Optional[int] = None) -> bool:
        """Block until the loop ends (or ``timeout`` seconds pass); re-raise its error if it failed.

        ``until_step`` also returns once ``trainer.step >= until_step`` (that step's update is done;
        the loop goes on: e.g. ``wait(until_step=1)`` then :meth:`pause`). ``progress`` shows a
        tqdm.auto bar of training steps (to ``until_step`` when given) that moves inside a step:
        completed steps plus the fraction of the current one (its rollouts, then its update
        micro-batches, weighed by the previous step's ``rollout_seconds`` and ``update_seconds``,
        half each before any), with the step and phase after the time (:attr:`progress`). It
        shows no ETA until a whole step's worth of progress was measured since the call, and its
        clock leaves out the time the loop spent paused.

        Interrupting this call (Jupyter's "interrupt kernel") leaves the loop running, and
        :attr:`state` true. Returns True when the loop has ended or ``until_step`` was reached,
        False when ``timeout`` passed first.

        Raises:
            BaseException: the loop's own error (:attr:`error`) when it failed.
        """
        bar = self._step_bar(until_step) if progress and not self._reached(until_step) else None
        try:
            done = self._wait_done(timeout, bar, until_step)
        finally:
            if bar is not None:
                bar.close()
        if self.error is not None:
            raise self.error
        return done

    def _reached(self, until_step: Optional[int]) -> bool:
        return until_step is not None and self._steps_done() >= until_step

    def _wait_done(self, timeout: Optional[float], bar: Optional[_Bar] = None,
                   until_step: Optional[int] = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not (self._reached(until_step) or self._done.wait(0.2)):
            if bar is not None:
                bar.move(*self._step_position(bar.first))
            if deadline is not None and time.monotonic() >= deadline:
                return False
        if bar is not None:
            bar.move(*self._step_position(bar.first))
        return True

    def _step_bar(self, until_step: Optional[int]) -> Optional[_Bar]:
        """The bar of :meth:`wait`, counting steps from the running loop's first (None when no loop runs)."""
        if self._done.is_set():
            return None
        first = self._loop_steps[0] if self._loop_steps is not None else self._steps_done()
        last = until_step if until_step is not None else (self._loop_steps or (0, None))[1]
        desc = "training" if until_step is None else f"training to step {until_step}"
        n, _ = self._step_position(first)
        bar = _Bar(self, None if last is None else last - first, n, desc, "steps", decimals=2)
        bar.first = first
        return bar

    def _step_position(self, first: int) -> tuple[float, str]:
        """``(steps done since step first, with the fraction of the step in progress; the text of progress)``.

        The fraction is ``share × rollouts done/total`` while collecting and ``share + (1 − share) ×
        micro-batches done/total`` while updating, ``share`` the previous step's part of rollout time
        in rollout + update time (0.5 before any step); evaluation comes after the step counted whole.
        """
        step = self._steps_done()
        p = self._progress
        within = 0.0
        if p.step == step + 1 and p.phase in ("rollouts", "update"):
            share = self._rollout_share()
            within = share * p.fraction if p.phase == "rollouts" else share + (1 - share) * p.fraction
        return max(0.0, step - first + min(within, 0.999)), str(self.progress)

    def _rollout_share(self) -> float:
        """The last step's rollout seconds over its rollout + update seconds, in [0.05, 0.95]; 0.5 before any."""
        rows = getattr(self.trainer, "metrics", None) or [{}]
        r, u = rows[-1].get("rollout_seconds"), rows[-1].get("update_seconds")
        if not isinstance(r, (int, float)) or not isinstance(u, (int, float)) or not r + u > 0:
            return 0.5
        return min(0.95, max(0.05, r / (r + u)))

    @property
    def stop_requested(self) -> bool:
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
