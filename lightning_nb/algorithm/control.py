"""Run an algorithm's loop in a background thread that a notebook cell can pause, resume and stop.

:class:`BackgroundLoop` is the control surface of every algorithm, which owns its loop
(the base of :class:`~lightning_nb.algorithm.base.Algorithm`: ``pause``, ``resume``, ``stop``, ``wait``,
``state``, ``progress``; ``start`` is the Algorithm's). The loop itself (the algorithm's ``run``) calls
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
import warnings
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, Optional

from lightning_nb.algorithm.waiting import default_stall_advice, rollouts_waiting_for
from lightning_nb.errors import ConfigError, LightningNbError, WaitWarning
# the config-edit rule lives with the trainers, which apply their own config's edits too
from lightning_nb.trainers.base import config_edits

__all__ = ["BackgroundLoop", "LoopProgress", "TrainerStopped", "config_edits"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoopProgress:
    """Where an algorithm's loop is: the snapshot ``algo.progress`` returns.

    The algorithm's loop (:class:`BackgroundLoop`) replaces it as it works; the trainer's update moves it
    through its ``on_progress`` callback. Reading it costs nothing.

    Attributes:
        step: the step the loop works on, numbered as its metrics row will be: ``algo.global_step + 1``
            while it collects rollouts and updates, ``algo.global_step`` while it evaluates after the update
            (0 before any start).
        phase: ``"idle"`` (never started), ``"starting"``, ``"rollouts"`` (collecting the step's
            training rollouts), ``"update"`` (the weight update), ``"evaluate"`` (held-out evaluation),
            ``"paused"`` (parked at the step boundary ``boundary``; ``done``/``total`` are those the
            phase before reached), ``"ended"`` (the loop returned, was stopped or failed: see ``state``).
        done, total: units of the phase finished and planned; 0/0 until the phase has counted.
            ``rollouts``: rollouts of the step finished of those enqueued so far (every sample round:
            ``total`` grows when dynamic sampling adds a round); ``update``: micro-batches (forward
            passes) done of the update's; ``evaluate``: evaluation rollouts finished of enqueued.
        unit: what ``done``/``total`` count (``"rollouts"``, ``"micro-batches"``, ...).
        boundary: the step boundary the loop is parked at (``"before update"``) when ``phase`` is ``"paused"``.
    """

    step: int = 0
    phase: str = "idle"
    done: int = 0
    total: int = 0
    unit: str = ""
    boundary: str = ""

    @property
    def fraction(self) -> float:
        """``done / total`` in [0, 1]; 0.0 while ``total`` is 0."""
        return min(1.0, self.done / self.total) if self.total > 0 else 0.0

    def __str__(self) -> str:
        """``"step 2 · update 3/4 micro-batches"``, ``"step 2 · rollouts 5/16"``, ``"step 2 · paused before update"``,
        ``"ended in step 3"``."""
        if self.phase == "paused":
            return f"step {self.step} · paused {self.boundary}".rstrip()
        if self.phase in ("idle", "ended"):
            return self.phase if self.phase == "idle" else f"ended in step {self.step}"
        unit = "" if self.unit == self.phase else f" {self.unit}"
        counts = f" {self.done}/{self.total}{unit}" if self.total else ""
        return f"step {self.step} · {self.phase}{counts}"

    def paused_at(self, boundary: str) -> "LoopProgress":
        """This snapshot as it reads while the loop is parked at ``boundary``."""
        return replace(self, phase="paused", boundary=boundary)


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

    The class it is mixed into (:class:`~lightning_nb.algorithm.base.Algorithm`) has ``global_step`` (the steps
    done), ``metrics`` (rows that time them), a ``store`` (whose rollouts :meth:`wait_for` waits for) and a
    ``run(steps)`` method, the loop itself; its ``start`` runs ``run`` in a daemon thread (:meth:`_start_loop`).
    States (:attr:`state`): ``idle`` (never started), ``running``, ``pausing`` (a pause
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
    def _steps_done(self) -> int:
        """Steps done (the algorithm's ``global_step``); what ``wait(until_step=)`` and the bars count."""
        return int(getattr(self, "global_step", 0))

    def _start_loop(self, body: Callable[[], Any], first_step: int, last_step: Optional[int]) -> None:
        """Run ``body()`` in a daemon thread; raises if a loop is still running."""
        if not self._done.is_set():
            raise LightningNbError("this algorithm's loop is already running; call stop() or wait() first")
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
                log.info("loop stopped at step %s", self._steps_done())
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

    #: Seconds without progress after which :meth:`wait` says what it waits for and why (``wait(stall_s=...)``).
    STALL_S = 60.0

    def wait(self, timeout: Optional[float] = None, progress: bool = False,
             until_step: Optional[int] = None, *, stall_s: Optional[float] = None) -> bool:
        """Block until the loop ends (or ``timeout`` seconds pass); re-raise its error if it failed.

        ``until_step`` also returns once ``global_step >= until_step`` (that step's update is done;
        the loop goes on: e.g. ``wait(until_step=1)`` then :meth:`pause`). ``progress`` shows a
        tqdm.auto bar of training steps (to ``until_step`` when given) that moves inside a step:
        completed steps plus the fraction of the current one (its rollouts, then its update
        micro-batches, weighed by the previous step's ``rollout_seconds`` and ``update_seconds``,
        half each before any), with the step and phase after the time (:attr:`progress`) and what
        the loop waits for (:meth:`waiting_for`: ``16 queued, 0 running in the store``, ``2 unlabelled``). It
        shows no ETA until a whole step's worth of progress was measured since the call, and its
        clock leaves out the time the loop spent paused.

        It says why it waits: when neither the step nor :attr:`progress` moved for ``stall_s`` seconds
        (default :attr:`STALL_S`, 60 s), it warns once (:class:`~lightning_nb.errors.WaitWarning`, shown
        under the cell) with what the loop waits for, why it may not move and what to do
        (:meth:`stall_advice`), and again after each later stall. A ``timeout`` that expires warns the same
        way (the loop goes on) and returns False.

        Interrupting this call (Jupyter's "interrupt kernel") leaves the loop running, and
        :attr:`state` true. Returns True when the loop has ended or ``until_step`` was reached,
        False when ``timeout`` passed first.

        Raises:
            ConfigError: ``stall_s`` is not a number of seconds > 0.
            BaseException: the loop's own error (:attr:`error`) when it failed.
        """
        stall = self.STALL_S if stall_s is None else stall_s
        if isinstance(stall, bool) or not isinstance(stall, (int, float)) or not stall > 0:
            raise ConfigError(f"wait(stall_s=...) must be a number of seconds > 0 (the default is "
                              f"BackgroundLoop.STALL_S = {self.STALL_S:g}), got {stall_s!r}")
        t0 = time.monotonic()
        bar = self._step_bar(until_step) if progress and not self._reached(until_step) else None
        try:
            done = self._wait_done(timeout, bar, until_step, stall_s=stall)
        finally:
            if bar is not None:
                bar.close()
        if self.error is not None:
            raise self.error
        if not done:
            goal = "the loop's end" if until_step is None else f"step {until_step} (at step {self._steps_done()})"
            self._warn_waiting(f"timeout={timeout:g} s expired after {time.monotonic() - t0:.1f} s, before {goal}; "
                               "the loop goes on (wait() again, or stop())", stacklevel=3)
        return done

    def _reached(self, until_step: Optional[int]) -> bool:
        return until_step is not None and self._steps_done() >= until_step

    def _wait_done(self, timeout: Optional[float], bar: Optional[_Bar] = None,
                   until_step: Optional[int] = None, stall_s: Optional[float] = None) -> bool:
        """Wait for the loop's end or ``until_step``; move ``bar``; warn after ``stall_s`` s without progress."""
        deadline = None if timeout is None else time.monotonic() + timeout
        watch: list[Any] = [None, time.monotonic(), False]  # (step, progress) last seen, since when, warned
        while not (self._reached(until_step) or self._done.wait(0.2)):
            if bar is not None:
                bar.move(*self._step_position(bar.first))
            if stall_s is not None:
                self._check_stall(watch, stall_s)
            if deadline is not None and time.monotonic() >= deadline:
                return False
        if bar is not None:
            bar.move(*self._step_position(bar.first))
        return True

    def _check_stall(self, watch: list[Any], stall_s: float) -> None:
        """Warn once when the step and :attr:`progress` stayed as ``watch`` saw them for ``stall_s`` seconds."""
        key, now = (self._steps_done(), self.progress), time.monotonic()
        if key != watch[0]:
            watch[:] = [key, now, False]
        elif not watch[2] and now - watch[1] >= stall_s:
            watch[2], quiet = True, now - watch[1]
            self._warn_waiting(f"no progress for {quiet:.{1 if quiet < 10 else 0}f} s", stacklevel=5)

    def _warn_waiting(self, what: str, stacklevel: int) -> None:
        """Warn (:class:`~lightning_nb.errors.WaitWarning`) with ``what``, the live line and :meth:`stall_advice`."""
        self._live = None  # read afresh
        advice = self._hook_text(self.stall_advice)
        message = f"{type(self).__name__}.wait(): {what}. Waiting at: {self._live_line()}."
        warnings.warn(WaitWarning(f"{message} {advice}" if advice else message), stacklevel=stacklevel)

    def _live_line(self) -> str:
        """``str(progress)``, then what :meth:`waiting_for` adds; the hook is read at most once a second (it may
        query the store) and again whenever :attr:`progress` changed."""
        p, now = self.progress, time.monotonic()
        live = getattr(self, "_live", None)
        if live is None or live[1] != p or now - live[0] >= 1.0:
            extra = self._hook_text(self.waiting_for)
            live = self._live = (now, p, f"{p} · {extra}" if extra else str(p))
        return live[2]

    def _hook_text(self, hook: Callable[[], str]) -> str:
        """``hook()``, or ``""`` when it fails (a store that went away must not break a wait)."""
        try:
            return hook()
        except Exception:  # the wait goes on without the text
            log.debug("%s failed", getattr(hook, "__name__", hook), exc_info=True)
            return ""

    def waiting_for(self) -> str:
        """What the loop waits for beyond :attr:`progress`, in a few words (``""``: nothing to add).

        :meth:`wait` shows it after the phase on its bar and in its warnings; it is read about once a second
        while a bar shows, so it may query the store. The default, while the phase counts rollouts: the
        store's unfinished rollouts, ``"16 queued, 0 running in the store"``
        (:func:`~lightning_nb.algorithm.waiting.rollouts_waiting_for`). Algorithms add their own.
        """
        return rollouts_waiting_for(self.progress, getattr(self, "store", None))

    def stall_advice(self) -> str:
        """Why the loop may not move where it is now, and what to do: the end of :meth:`wait`'s warnings (``""``:
        nothing to say). The default (:func:`~lightning_nb.algorithm.waiting.default_stall_advice`) covers a pause,
        rollouts no runner takes, rollouts that run long and the weight update; algorithms add their own."""
        return default_stall_advice(self.progress, getattr(self, "store", None))

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
        """``(steps done since step first, with the fraction of the step in progress; the live line)``.

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
        return max(0.0, step - first + min(within, 0.999)), self._live_line()

    def _rollout_share(self) -> float:
        """The last step's rollout seconds over its rollout + update seconds, in [0.05, 0.95]; 0.5 before any."""
        rows = getattr(self, "metrics", None) or [{}]
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
