"""Where an algorithm's loop is, and the tqdm bars that show it.

:class:`LoopProgress` is the snapshot ``algo.progress`` returns (step, phase, done of total); the loop
(:class:`~lightning_nb.algorithm.control.LoopControl`) replaces it as it works. :class:`LoopBar` is the tqdm.auto
bar of ``wait()``, ``pause()`` and a step run from a cell (in a notebook kernel by default), whose ETA leaves out
the time the loop spent parked.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

__all__ = ["LoopProgress", "LoopBar"]


@dataclass(frozen=True)
class LoopProgress:
    """Where an algorithm's loop is: the snapshot ``algo.progress`` returns.

    The algorithm's loop (:class:`~lightning_nb.algorithm.control.LoopControl`) replaces it as it works; the
    trainer's update moves it through its ``on_progress`` callback. Reading it costs nothing.

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
        sample_round: the step's sample round (1, 2, ...) while ``rollouts`` counts a step that may take
            more than one (dynamic sampling); 0 otherwise.
    """

    step: int = 0
    phase: str = "idle"
    done: int = 0
    total: int = 0
    unit: str = ""
    boundary: str = ""
    sample_round: int = 0

    @property
    def fraction(self) -> float:
        """``done / total`` in [0, 1]; 0.0 while ``total`` is 0."""
        return min(1.0, self.done / self.total) if self.total > 0 else 0.0

    def __str__(self) -> str:
        """``"step 2 · update 3/4 micro-batches"``, ``"step 2 · rollouts 5/16"``,
        ``"step 2 · rollouts 20/24 · sample round 2"``, ``"step 2 · paused before update"``, ``"ended in step 3"``."""
        if self.phase == "paused":
            return f"step {self.step} · paused {self.boundary}".rstrip()
        if self.phase in ("idle", "ended"):
            return self.phase if self.phase == "idle" else f"ended in step {self.step}"
        unit = "" if self.unit == self.phase else f" {self.unit}"
        counts = f" {self.done}/{self.total}{unit}" if self.total else ""
        rounds = f" · sample round {self.sample_round}" if self.sample_round > 1 else ""
        return f"step {self.step} · {self.phase}{counts}{rounds}"

    def paused_at(self, boundary: str) -> "LoopProgress":
        """This snapshot as it reads while the loop is parked at ``boundary``."""
        return replace(self, phase="paused", boundary=boundary)



_NO_ETA = "{l_bar}{bar}| {n:.%df}/{total_fmt} {unit} [{elapsed}{postfix}]"
_WITH_ETA = "{l_bar}{bar}| {n:.%df}/{total_fmt} {unit} [{elapsed}<{remaining}{postfix}]"


class LoopBar:
    """A tqdm.auto bar that shows no ETA until a whole unit was measured while it was open, and whose clock
    leaves out the time the loop spent parked (so the ETA is the working rate's).

    tqdm's own ETA is ``(total - n) / rate``, with ``rate`` from the first update: a bar opened after some
    steps had finished and caught up in one update read "ETA 1 s". Here ``initial`` is where the bar opens,
    ``smoothing=0`` makes the rate ``(n - initial) / elapsed``, and ``{remaining}`` enters the format
    only once ``n - initial >= 1``.
    """

    def __init__(self, paused_total: Callable[[], float], total: Optional[float], initial: float, desc: str,
                 unit: str, decimals: int, postfix: str = "") -> None:
        """``paused_total()``: seconds the loop spent parked so far (:meth:`LoopControl.paused_total`), left out of
        the bar's clock; ``total`` None: a bar without an end; ``decimals``: digits of the count shown; ``postfix``:
        the live line shown from the first frame (what the bar waits for)."""
        from tqdm.auto import tqdm

        self.paused_total, self.decimals, self.initial = paused_total, decimals, initial
        self.eta = False
        self.paused = paused_total()
        self.tqdm = tqdm(total=total, initial=initial, desc=desc, unit=unit, smoothing=0,
                         bar_format=_NO_ETA % decimals, postfix=postfix or None)
        self.postfix = postfix
        self.shown = time.monotonic()
        self.first = 0  # wait(): the step the count starts at
        self.key: Any = None  # pause(): the (step, phase, total) counted

    def move(self, n: float, postfix: str) -> None:
        """Show ``n`` (never below the bar's current value) and ``postfix``; redraw when they changed or each second."""
        if self.tqdm.disable:  # TQDM_DISABLE=1 or no display: tqdm keeps no clock
            return
        paused = self.paused_total()
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
        """Count another quantity from ``n`` (the rate and ETA start over; the postfix is cleared)."""
        self.tqdm.set_description_str(desc, refresh=False)  # before reset(), whose frame shows the new quantity
        self.tqdm.set_postfix_str("", refresh=False)
        self.postfix = ""
        self.tqdm.unit, self.eta = unit, False
        self.tqdm.bar_format = _NO_ETA % self.decimals
        self.tqdm.initial = self.initial = n
        self.tqdm.reset(total=total)
        self.tqdm.total = total
        self.tqdm.n = n

    def retotal(self, total: float) -> None:
        """The same count to a new ``total`` (a step's next sample round): the clock, the rate and the count go on."""
        if self.tqdm.disable or total == self.tqdm.total:
            return
        self.tqdm.total = total  # (tqdm's reset(total) would restart the clock)
        container = getattr(self.tqdm, "container", None)  # tqdm.notebook's widget: [description, bar, counts]
        if container is not None:
            container.children[-2].max = total

    def close(self) -> None:
        """Close the tqdm bar."""
        self.tqdm.close()
