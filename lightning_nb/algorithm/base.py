"""The Algorithm contract: what owns a run. Its loop, its step counter, its metrics rows and its checkpoint.

An algorithm decides what to run and learn from, and when. A trainer only updates weights
(:class:`~lightning_nb.trainers.base.Trainer`); the algorithm calls it and holds everything else of the
run. Three implementations stand side by side: :class:`~lightning_nb.algorithm.lightning_rl.LightningRL`
(GRPO steps over a task set), :class:`~lightning_nb.algorithm.apo.APO` (prompt search: a step is a round,
no trainer) and :class:`~lightning_nb.algorithm.traffic.TrafficLearner` (a step is an update on labelled
traffic). ``tests/test_algorithm_contract.py`` runs one suite over all three.

The notebook verbs are every algorithm's, from :class:`~lightning_nb.algorithm.control.BackgroundLoop`::

    algo = LightningRL(store, trainer, tasks)
    algo.start(steps=10)      # returns at once; the loop runs in a background thread
    algo.pause()              # parks at the next step boundary; algo.state == "paused"
    algo.metrics_df()         # one row per step
    algo.save("run.pt"); algo.resume(); algo.wait(progress=True); algo.stop()

Earlier versions spelt the verbs on the trainer; ``trainer.start(algo, steps)`` is now ``algo.start(steps)``.
"""

from __future__ import annotations

import abc
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from lightning_nb.algorithm.control import BackgroundLoop
from lightning_nb.errors import LightningNbError
from lightning_nb.types import html_view

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["Algorithm"]

# trainer -> (a weak reference to) the algorithm whose loop last started on it: one loop at a time may update a
# trainer's weights. Kept here, not on the trainer: a trainer holds no reference to an algorithm. Both sides weak,
# so the entry never keeps a trainer, its engine or the algorithm alive.
_RUNNING_ON: "weakref.WeakKeyDictionary[Any, weakref.ref[Algorithm]]" = weakref.WeakKeyDictionary()


class Algorithm(BackgroundLoop, abc.ABC):
    """The contract every algorithm implements: own one run and drive it step by step.

    **A step** (:meth:`step`) is the algorithm's unit of progress, run from a cell or by the background loop
    (:meth:`run`). It must: call :meth:`at_boundary` wherever nothing is in flight (where ``pause()`` parks
    and ``stop()`` ends the loop); call :meth:`report_progress` as it works (``progress`` and the bars read
    it); and, when it completed, append its row with :meth:`record` (which advances :attr:`global_step`).
    It returns that row, or None when there was nothing to do yet (TrafficLearner without enough labels).

    **What it owns and others may read.** ``store``; ``trainer`` (None for an algorithm that updates no
    weights, such as APO); ``config`` (a dataclass, edited while paused, checked on ``resume()``);
    :attr:`global_step` (steps done: the run's step counter); :attr:`metrics` (one dict per step, the
    ``step`` key equal to the step's number, 1-based); :attr:`config_changes` (``{"step", "config", "field",
    "old", "new"}`` per edit applied at a step, ``config`` ``"trainer"`` or ``"algorithm"``); and the loop's
    ``state``, ``running``,
    ``paused_at``, ``progress`` and ``error`` (:class:`~lightning_nb.algorithm.control.BackgroundLoop`).

    **The run's checkpoint.** :meth:`state_dict` / :meth:`load_state_dict` are the algorithm's own state
    (with :meth:`run_record`: step counter, metrics, config log); :meth:`save` / :meth:`load` write and read
    the whole run: for a trainer-based algorithm also the trainer's ``state_dict()`` and the RNG states
    (:class:`~lightning_nb.algorithm.checkpoint.RunCheckpoint`).

    Implementations call :meth:`_init_algorithm` in their constructor.
    """

    store: Any
    trainer: Any
    config: Any

    def _init_algorithm(self, store: Any, trainer: Any) -> None:
        """Set the attributes of the contract (see the class docstring) and the loop's controls."""
        self.store, self.trainer = store, trainer
        self.global_step = 0
        self.metrics: list[dict[str, Any]] = []
        self.config_changes: list[dict[str, Any]] = []
        self.checkpoint_resources_id: Optional[str] = None  # the resources id of the last checkpoint loaded
        self._init_loop()

    # ----- the contract ---------------------------------------------------------------------------
    @abc.abstractmethod
    def step(self) -> Optional[dict[str, Any]]:
        """One step of the run (see the class docstring); returns its metrics row, or None when none was due."""

    @abc.abstractmethod
    def run(self, steps: Optional[int] = None) -> None:
        """Run ``steps`` steps (None: the config's count, or until stopped); what :meth:`start` runs in its thread."""

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

    # ----- the loop ---------------------------------------------------------------------------------
    def start(self, steps: Optional[int] = None) -> "Algorithm":
        """Run :meth:`run` (``steps`` steps; None: ``config.steps``) in a background thread and return at once.

        Raises:
            LightningNbError: this algorithm's loop, or another algorithm's loop on the same trainer, is running.
        """
        ref = _RUNNING_ON.get(self.trainer) if self.trainer is not None else None
        other = ref() if ref is not None else None
        if other is not None and other is not self and other.running:
            raise LightningNbError(f"the trainer is already running another algorithm's loop "
                                   f"({type(other).__name__}); call its stop() or wait() first")
        n = steps if steps is not None else getattr(self.config, "steps", None)
        first = self.global_step
        self._start_loop(lambda: self.run(steps), first, None if n is None else first + n)
        if self.trainer is not None:
            _RUNNING_ON[self.trainer] = weakref.ref(self)
        return self

    # ----- the run's record -------------------------------------------------------------------------
    def record(self, row: dict[str, Any]) -> dict[str, Any]:
        """Close a step: :attr:`global_step` + 1, ``row["step"]`` set to it, the row appended to :attr:`metrics`.

        The structured config edits the trainer applied at this update (``trainer.last_config_changes``) join
        :attr:`config_changes`. Returns ``row``.
        """
        self.global_step += 1
        row["step"] = self.global_step
        self.metrics.append(row)
        for change in getattr(self.trainer, "last_config_changes", None) or ():
            self.config_changes.append({"step": self.global_step, "config": "trainer", **change})
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

    def _repr_html_(self) -> Optional[str]:
        return html_view(self)  # lightning_nb.inspect.run_html, registered by the package root

    def load_run_record(self, state: dict[str, Any]) -> None:
        """Restore :meth:`run_record` from ``state``."""
        self.global_step = int(state["global_step"])
        self.metrics = [dict(r) for r in state["metrics"]]
        self.config_changes = [dict(c) for c in state["config_changes"]]
