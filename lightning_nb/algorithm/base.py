"""The Algorithm contract: what owns a run. Its loop, its step counter, its metrics rows and its checkpoint.

An algorithm decides what to run and learn from, and when. A trainer only updates weights
(:class:`~lightning_nb.trainers.base.Trainer`); the algorithm calls it and holds everything else of the
run. Three implementations stand side by side: :class:`~lightning_nb.algorithm.lightning_rl.LightningRL`
(GRPO steps over a task set), :class:`~lightning_nb.algorithm.apo.APO` (prompt search: a step is a round,
no trainer) and :class:`~lightning_nb.algorithm.traffic.TrafficLearner` (a step is an update on labelled
traffic). ``tests/test_algorithm_contract.py`` runs one suite over all three.

The notebook verbs are every algorithm's; the background thread behind them is the component
:attr:`Algorithm.loop` (:class:`~lightning_nb.algorithm.control.LoopControl`)::

    algo = LightningRL(store, trainer, tasks)
    algo.start(steps=10)      # returns at once; the loop runs in a background thread
    algo.pause()              # parks at the next step boundary; algo.state == "paused"
    algo.metrics_df()         # one row per step
    algo.save("run.pt"); algo.resume(); algo.wait(); algo.stop()   # wait(): a live bar in a notebook

Earlier versions spelt the verbs on the trainer; ``trainer.start(algo, steps)`` is now ``algo.start(steps)``.
"""

from __future__ import annotations

import abc
import contextlib
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol, Sequence

from lightning_nb.algorithm.control import LoopControl, LoopProgress
from lightning_nb.algorithm.waiting import (STALL_S, default_stall_advice, rollout_share, rollouts_waiting_for,
                                            wait_for_rollouts, wait_loop)
from lightning_nb.errors import LightningNbError
from lightning_nb.trainers.base import Update
from lightning_nb.trainers.edits import ConfigChange
from lightning_nb.types import html_view

if TYPE_CHECKING:
    import pandas as pd

    from lightning_nb.store.base import LightningStore
    from lightning_nb.trainers.base import Trainer

__all__ = ["Algorithm", "RunConfig"]

# trainer -> (a weak reference to) the algorithm whose loop last started on it: one loop at a time may update a
# trainer's weights. Kept here, not on the trainer: a trainer holds no reference to an algorithm. Both sides weak,
# so the entry never keeps a trainer, its engine or the algorithm alive.
_RUNNING_ON: "weakref.WeakKeyDictionary[Any, weakref.ref[Algorithm]]" = weakref.WeakKeyDictionary()


class RunConfig(Protocol):
    """What an algorithm's config is: a dataclass (``asdict`` logs it) that checks itself.

    ``AlgorithmConfig``, ``APOConfig`` and ``TrafficConfig`` are three.
    """

    def validate(self) -> None:
        """Raise ConfigError naming the first field out of range (``resume()`` runs it after edits)."""


class Algorithm(abc.ABC):
    """The contract every algorithm implements: own one run and drive it step by step.

    **A step** (:meth:`step`) is the algorithm's unit of progress, run from a cell or by the background loop
    (:meth:`run`). It must: call :meth:`at_boundary` wherever nothing is in flight (where ``pause()`` parks
    and ``stop()`` ends the loop); call :meth:`report_progress` as it works (``progress`` and the bars read
    it); and, when it completed, append its row with :meth:`record` (which advances :attr:`global_step`).
    It returns that row, or None when there was nothing to do yet (TrafficLearner without enough labels).

    **What it owns and others may read** (the attributes below, set by :meth:`__init__`): the loop's
    ``state``, ``running``, ``paused_at``, ``progress`` and ``error`` are :attr:`loop`'s.

    **The run's checkpoint.** :meth:`state_dict` / :meth:`load_state_dict` are the algorithm's own state
    (with :meth:`run_record`: step counter, metrics, config log); :meth:`save` / :meth:`load` write and read
    the whole run: for a trainer-based algorithm also the trainer's ``state_dict()`` and the RNG states
    (:func:`~lightning_nb.algorithm.checkpoint.save_run`).

    Implementations call ``super().__init__(store, trainer, config)`` first in their constructor.

    Attributes:
        store: the store the runners read (None only for an algorithm that needs none).
        trainer: updates the weights; None for an algorithm that updates none (APO).
        config: a dataclass (:class:`RunConfig`), edited while paused and checked on ``resume()``.
        global_step: steps done, the run's step counter.
        metrics: one dict per step, the ``step`` key equal to the step's number (1-based).
        config_changes: ``{"step", "config", "field", "old", "new"}`` per edit applied at a step (``config``:
            ``"trainer"`` or ``"algorithm"``).
        last_update: what the trainer's last update in this run returned (None before one).
        checkpoint_resources_id: the store's resources id of the last checkpoint loaded (None: none loaded).
        loop: the background thread's control (:class:`~lightning_nb.algorithm.control.LoopControl`).
    """

    store: "Optional[LightningStore]"
    trainer: "Optional[Trainer]"
    config: RunConfig
    global_step: int
    metrics: list[dict[str, Any]]
    config_changes: list[dict[str, Any]]
    last_update: "Optional[Update]"
    checkpoint_resources_id: Optional[str]
    loop: LoopControl

    #: Seconds without progress after which :meth:`wait` says what it waits for and why (``wait(stall_s=...)``).
    STALL_S = STALL_S

    def __init__(self, store: "Optional[LightningStore]", trainer: "Optional[Trainer]", config: RunConfig) -> None:
        self.store, self.trainer, self.config = store, trainer, config
        self.global_step = 0
        self.metrics = []
        self.config_changes = []
        self.last_update = None
        self.checkpoint_resources_id = None
        self.loop = LoopControl(lambda: self.global_step)

    # ----- the contract ---------------------------------------------------------------------------
    @abc.abstractmethod
    def step(self, progress: Optional[bool] = None) -> Optional[dict[str, Any]]:
        """One step of the run (see the class docstring); returns its metrics row, or None when none was due.

        ``progress``: a bar of the step while it runs (``with self.step_bar(progress):`` around the work; None: in
        a notebook kernel only); :meth:`run` passes False, since ``wait()`` shows the background loop's bar. An
        implementation without a bar may leave the argument out."""

    @abc.abstractmethod
    def run(self, steps: Optional[int] = None) -> None:
        """Run ``steps`` steps (None: :meth:`default_steps`, or until stopped); what :meth:`start` runs in its
        thread. Raises :class:`~lightning_nb.algorithm.control.LoopStopped` when stopped."""

    @abc.abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """This algorithm's own state, plain values only (includes :meth:`run_record`)."""

    @abc.abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (the config is not changed: edits since are yours)."""

    @abc.abstractmethod
    def save(self, path: str | Path) -> Path:
        """Write the run's checkpoint to ``path`` at a step boundary (paused, or after ``wait()``); returns it."""

    @abc.abstractmethod
    def load(self, path: str | Path, **options: Any) -> None:
        """Continue from a :meth:`save` checkpoint.

        Raises:
            FileNotFoundError: ``path`` does not exist.
            ConfigError: not a checkpoint this algorithm reads (the implementation says which).
        """

    def default_steps(self) -> Optional[int]:
        """The steps :meth:`start` and :meth:`run` take when given None (None: until stopped)."""
        return None

    def checkpoint_state(self) -> tuple[dict[str, Any], Optional[dict[str, Any]]]:
        """``(state_dict, global RNG states or None)`` a checkpoint saved now holds: by default ``(state_dict(),
        None)`` (the RNG states are the current ones); LightningRL's, inside a step before its update, the state
        at the step's start."""
        return self.state_dict(), None

    def check_before_resume(self) -> None:
        """Raise ConfigError for invalid edits made while paused (``resume()`` calls it): the config's
        ``validate()``, and the trainer's ``check_config()`` when there is a trainer."""
        if self.trainer is not None:
            self.trainer.check_config()
        self.config.validate()

    # ----- the loop ---------------------------------------------------------------------------------
    def start(self, steps: Optional[int] = None) -> "Algorithm":
        """Run :meth:`run` (``steps`` steps; None: :meth:`default_steps`) in a background thread and return at once.

        Raises:
            LightningNbError: this algorithm's loop, or another algorithm's loop on the same trainer, is running.
        """
        ref = _RUNNING_ON.get(self.trainer) if self.trainer is not None else None
        other = ref() if ref is not None else None
        if other is not None and other is not self and other.running:
            raise LightningNbError(f"the trainer is already running another algorithm's loop "
                                   f"({type(other).__name__}); call its stop() or wait() first")
        n = steps if steps is not None else self.default_steps()
        first = self.global_step
        self.loop.start(lambda: self.run(n), first, None if n is None else first + n)
        if self.trainer is not None:
            _RUNNING_ON[self.trainer] = weakref.ref(self)
        return self

    def at_boundary(self, where: str = "") -> None:
        """A step boundary of the loop: park here while paused, raise LoopStopped when stopped
        (:meth:`LoopControl.at_boundary <lightning_nb.algorithm.control.LoopControl.at_boundary>`)."""
        self.loop.at_boundary(where)

    def report_progress(self, phase: str, done: int, total: int, *, unit: str, step: int,
                        sample_round: int = 0) -> None:
        """Where the loop is now: :attr:`progress` becomes this snapshot
        (:meth:`LoopControl.report_progress <lightning_nb.algorithm.control.LoopControl.report_progress>`)."""
        self.loop.report_progress(phase, done, total, unit=unit, step=step, sample_round=sample_round)

    def step_bar(self, show: Optional[bool]) -> contextlib.AbstractContextManager[None]:
        """A bar of the step's phases while the block runs, for a step run from a cell (``show`` False: none; None:
        in a notebook kernel only)."""
        return self.loop.step_bar(show, f"step {self.global_step + 1}")

    def wait_for(self, rollout_ids: list[str], desc: Optional[str] = None, start_timeout_s: Optional[float] = None,
                 on_progress: Optional[Callable[[int, int], None]] = None) -> bool:
        """Wait until every rollout of ``rollout_ids`` is terminal
        (:func:`~lightning_nb.algorithm.waiting.wait_for_rollouts` on :attr:`store`).

        Raises:
            LoopStopped: the loop was stopped while waiting (the rollouts are cancelled).
            LightningNbError: this algorithm has no store.
        """
        if self.store is None:
            raise LightningNbError(f"{type(self).__name__} has no store to wait for rollouts in")
        return wait_for_rollouts(self.store, self.loop, rollout_ids, desc, start_timeout_s, on_progress)

    # ----- the notebook's verbs -------------------------------------------------------------------
    def pause(self, wait: bool = True, timeout: Optional[float] = None, progress: Optional[bool] = None) -> bool:
        """Pause the loop at its next step boundary; True once parked (or no loop runs), False after ``timeout``
        seconds (:meth:`LoopControl.pause <lightning_nb.algorithm.control.LoopControl.pause>`; its bar, by default,
        in a notebook kernel only)."""
        return self.loop.pause(wait, timeout, progress)

    def resume(self) -> None:
        """Leave a pause; edits made while paused are checked first (:meth:`check_before_resume`).

        Raises:
            ConfigError: an edited config is invalid; the loop stays paused.
        """
        self.check_before_resume()
        self.loop.resume()

    def stop(self, timeout: float = 600.0) -> bool:
        """Ask the loop to end at its next step boundary and wait up to ``timeout`` seconds; True once it ended.
        Rollouts the loop is waiting for are cancelled."""
        return self.loop.stop(timeout)

    def wait(self, timeout: Optional[float] = None, progress: Optional[bool] = None,
             until_step: Optional[int] = None, *, stall_s: Optional[float] = None) -> bool:
        """Block until the loop ends (or ``timeout`` seconds pass); re-raise its error if it failed.

        ``until_step`` also returns once ``global_step >= until_step`` (that step's update is done;
        the loop goes on: e.g. ``wait(until_step=1)`` then :meth:`pause`). ``progress`` (None, the default: in a
        notebook kernel, not in a script; True/False as given) shows at once a
        tqdm.auto bar of training steps (to ``until_step`` when given) that moves inside a step:
        completed steps plus the fraction of the current one (its rollouts, then its update
        micro-batches, weighed by :meth:`rollout_share`), with the step and phase after the time
        (:attr:`progress`) and what the loop waits for (:meth:`waiting_for`). It shows no ETA until a whole
        step's worth of progress was measured since the call, and its clock leaves out the time the loop spent
        paused.

        It says why it waits: when neither the step nor :attr:`progress` moved for well past the wait's own
        pace (:data:`~lightning_nb.algorithm.waiting.PACE_FACTOR` times the longest time between two moves it
        saw so far) and at least ``stall_s`` seconds (default :attr:`STALL_S`, 60 s; before it saw the loop move
        at all, ``PACE_FACTOR × stall_s``), it warns once
        (:class:`~lightning_nb.errors.WaitWarning`, shown under the cell) with what the loop waits for, why it may
        not move and what to do (:meth:`stall_advice`), and again after each later stall. A ``timeout`` that
        expires warns the same way (the loop goes on) and returns False.

        Interrupting this call (Jupyter's "interrupt kernel") leaves the loop running, and
        :attr:`state` true. Returns True when the loop has ended or ``until_step`` was reached,
        False when ``timeout`` passed first.

        Raises:
            ConfigError: ``stall_s`` is not a number of seconds > 0.
            BaseException: the loop's own error (:attr:`error`) when it failed.
        """
        return wait_loop(self, timeout, progress, until_step,
                         stall_s=self.STALL_S if stall_s is None else stall_s, stacklevel=3)

    def waiting_for(self) -> str:
        """What the loop waits for beyond :attr:`progress`, in a few words (``""``: nothing to add).

        :meth:`wait` shows it after the phase on its bar and in its warnings; it is read about once a second
        while a bar shows, so it may query the store. The default, while the phase counts rollouts: the
        store's unfinished rollouts, ``"16 queued, 0 running in the store"``
        (:func:`~lightning_nb.algorithm.waiting.rollouts_waiting_for`). Algorithms add their own.
        """
        return rollouts_waiting_for(self.progress, self.store)

    def stall_advice(self) -> str:
        """Why the loop may not move where it is now, and what to do: the end of :meth:`wait`'s warnings (``""``:
        nothing to say). The default (:func:`~lightning_nb.algorithm.waiting.default_stall_advice`) covers a pause,
        rollouts no runner takes, rollouts that run long and the weight update; algorithms add their own."""
        return default_stall_advice(self.progress, self.store)

    def rollout_share(self) -> float:
        """The share of a step's time its rollouts take, in [0, 1]: how :meth:`wait`'s bar weighs the rollouts
        against the update. The default: the last row's ``rollout_seconds`` over ``rollout_seconds +
        update_seconds`` (:func:`~lightning_nb.algorithm.waiting.rollout_share`; 0.5 before any)."""
        return rollout_share(self.metrics)

    @property
    def progress(self) -> LoopProgress:
        """Where the loop is (:class:`~lightning_nb.algorithm.progress.LoopProgress`): step, phase, done/total."""
        return self.loop.progress

    @property
    def state(self) -> str:
        """idle | running | pausing | paused | stopped | failed | finished (:attr:`LoopControl.state
        <lightning_nb.algorithm.control.LoopControl.state>`)."""
        return self.loop.state

    @property
    def running(self) -> bool:
        """True while the background loop has not ended (running, pausing or paused)."""
        return self.loop.running

    @property
    def paused_at(self) -> str:
        """The boundary the loop is parked at (e.g. ``'before update'``), or ``''``."""
        return self.loop.paused_at

    @property
    def error(self) -> Optional[BaseException]:
        """The exception the loop failed with (None unless :attr:`state` is ``"failed"``)."""
        return self.loop.error

    @property
    def paused_seconds(self) -> float:
        """Seconds the loop spent parked, in all."""
        return self.loop.paused_seconds

    @property
    def stop_requested(self) -> bool:
        """True once :meth:`stop` was called (until the next :meth:`start`)."""
        return self.loop.stop_requested

    # ----- the run's record -------------------------------------------------------------------------
    def record(self, row: dict[str, Any], update: "Optional[Update]" = None,
               changes: Sequence[ConfigChange] = ()) -> dict[str, Any]:
        """Close a step: :attr:`global_step` + 1, ``row["step"]`` set to it, the row appended to :attr:`metrics`.

        ``update`` (what the trainer's update of the step returned) becomes :attr:`last_update`, and the config
        edits it applied join :attr:`config_changes` as the ``"trainer"``'s; ``changes`` (this algorithm's own
        config edits applied at the step) join as the ``"algorithm"``'s. Returns ``row``. An :class:`Update` given as
        ``row`` (``algo.record(trainer.update(triplets))``) is both: its metrics row is recorded.
        """
        if isinstance(row, Update):
            update, row = update or row, row.metrics
        self.global_step += 1
        row["step"] = self.global_step
        self.metrics.append(row)
        if update is not None:
            self.last_update = update
            self.config_changes.extend(c.record(self.global_step, "trainer") for c in update.config_changes)
        self.config_changes.extend(c.record(self.global_step, "algorithm") for c in changes)
        return row

    def add_metrics(self, step: int, **values: Any) -> None:
        """Attach ``values`` (e.g. ``val_reward``) to the metrics row of ``step`` (a new row when there is none);
        loggers that already logged that row log them too (:meth:`metrics_added`)."""
        for row in self.metrics:
            if row["step"] == step:
                row.update(values)
                break
        else:
            self.metrics.append({"step": step, **values})
        self.metrics_added(step, values)

    def metrics_added(self, step: int, values: dict[str, Any]) -> None:
        """Hook: ``values`` were added to the row of ``step`` (LightningRL forwards them to its loggers)."""

    def metrics_df(self) -> "pd.DataFrame":
        """One row per step (:attr:`metrics`; the columns are the implementation's ``step`` rows)."""
        import pandas as pd

        return pd.DataFrame(self.metrics)

    def run_record(self) -> dict[str, Any]:
        """``{"global_step", "metrics", "config_changes"}``: the part of :meth:`state_dict` every algorithm has."""
        from lightning_nb.trainers.checkpoint import plain

        return {"global_step": self.global_step, "metrics": plain(self.metrics),
                "config_changes": plain(self.config_changes)}

    def load_run_record(self, state: dict[str, Any]) -> None:
        """Restore :meth:`run_record` from ``state``."""
        self.global_step = int(state["global_step"])
        self.metrics = [dict(r) for r in state["metrics"]]
        self.config_changes = [dict(c) for c in state["config_changes"]]

    def _repr_html_(self) -> Optional[str]:
        return html_view(self)  # lightning_nb.inspect.run_html, registered by the package root
