"""Run an algorithm's loop in a background thread that a notebook cell can pause, resume and stop.

:class:`BackgroundLoop` is the control surface every trainer shares (``start``,
``pause``, ``resume``, ``stop``, ``wait``, ``state``). The loop itself (an
algorithm such as :class:`~lightning_nb.algorithm.LightningRL`) calls
:meth:`BackgroundLoop.at_boundary` at each point where nothing is in flight: before a
step collects rollouts, between dynamic-sampling rounds, before the weight update and
before an evaluation. That is where it parks while paused and where it ends when stopped.

Why an event and not ``Thread.is_alive()``: a ``KeyboardInterrupt`` (Jupyter's
"interrupt kernel") that lands inside ``Thread.join()`` can leave CPython believing a live
thread has finished (cpython#90882), so ``state``, ``wait()`` and the guard in ``start()``
read the loop's own ``done`` event, set only when the loop function returns, and every
wait here is a short, interruptible ``Event.wait``.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Optional

from lightning_nb.errors import LightningNbError

__all__ = ["BackgroundLoop", "TrainerStopped", "config_edits"]

log = logging.getLogger(__name__)


def config_edits(applied: dict[str, Any], now: dict[str, Any]) -> list[tuple[str, Any, Any, str]]:
    """``(field, old, new, text)`` for each field of ``now`` that differs from ``applied`` (two ``asdict`` snapshots).

    ``text`` reads ``"learning_rate 2e-05 → 1e-05"``: what the metrics' ``config_changes`` show.
    Trainers and algorithms call this on the loop's thread to apply and record edits made while paused.
    """
    return [(k, applied.get(k), v, f"{k} {applied.get(k)!r} → {v!r}") for k, v in now.items() if v != applied.get(k)]


class TrainerStopped(LightningNbError):
    """Raised inside the training loop when :meth:`BackgroundLoop.stop` was called."""


class BackgroundLoop:
    """Pause/resume/stop control of one background loop; mixed into trainers.

    States (:attr:`state`): ``idle`` (never started), ``running``, ``pausing`` (a pause
    was asked; the loop has not reached its next step boundary yet), ``paused`` (parked
    at a step boundary), ``stopped``, ``failed`` (:attr:`error` holds the exception),
    ``finished``.
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

    # ----- the loop's side ------------------------------------------------------------
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
        self._done.clear()

        def target() -> None:
            try:
                body()
            except TrainerStopped:
                log.info("trainer stopped at step %s", getattr(self, "step", "?"))
            except BaseException as exc:  # surfaced through .state and .error
                self.error = exc
                log.exception("training loop failed at step %s", getattr(self, "step", "?"))
            finally:
                with self._control:
                    self._parked = False
                    self._control.notify_all()
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
            t0 = time.monotonic()
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

    # ----- the notebook's side ----------------------------------------------------------
    def pause(self, wait: bool = True, timeout: Optional[float] = None) -> bool:
        """Pause the loop at its next step boundary.

        With ``wait`` this returns once the loop is parked there: no weight update is
        running, the algorithm enqueues nothing, the step's rollouts already enqueued
        have finished (the loop waits for them before it parks), and the engine serves
        ``engine.chat()`` at once. A pause during a collection round therefore waits for
        that round's rollouts (seconds to a minute on CPU).

        Returns True when the loop is parked (or no loop runs), False if ``timeout``
        seconds passed first (the pause stays requested; :attr:`state` is ``pausing``).
        """
        with self._control:
            self._pause_requested = True
        if not wait:
            return self._parked or self._done.is_set()
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._control:
            while not self._parked and not self._done.is_set():
                if deadline is not None and time.monotonic() >= deadline:
                    return False
                self._control.wait(0.2)
        return True

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

    def wait(self, timeout: Optional[float] = None, progress: bool = False) -> bool:
        """Block until the loop ends (or ``timeout`` seconds pass); re-raise its error if it failed.

        ``progress`` shows a tqdm.auto bar of training steps. Interrupting this call
        (Jupyter's "interrupt kernel") leaves the loop running, and :attr:`state` true.
        Returns True when the loop has ended.
        """
        bar = None
        if progress and self._loop_steps is not None:
            from tqdm.auto import tqdm

            first, last = self._loop_steps
            bar = tqdm(total=last - first, desc="training", unit="step")
        try:
            done = self._wait_done(timeout, bar)
        finally:
            if bar is not None:
                bar.close()
        if self.error is not None:
            raise self.error
        return done

    def _wait_done(self, timeout: Optional[float], bar: Any = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._done.wait(0.2):
            if bar is not None and self._loop_steps is not None:
                bar.update(max(0, getattr(self, "step", 0) - self._loop_steps[0]) - bar.n)
            if deadline is not None and time.monotonic() >= deadline:
                return False
        if bar is not None and self._loop_steps is not None:
            bar.update(max(0, getattr(self, "step", 0) - self._loop_steps[0]) - bar.n)
        return True

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
