"""The Trainer contract: what updates the policy's weights from a batch of triplets, and nothing else.

A trainer turns one batch of :class:`~lightning_nb.types.Triplet` into new weights that the
engine serves. The loop around it (enqueue rollouts, wait, adapt spans, decide when to update,
pause at step boundaries, checkpoint the run) is the algorithm's
(:class:`~lightning_nb.algorithm.lightning_rl.LightningRL`, which mixes in
:class:`~lightning_nb.algorithm.control.BackgroundLoop`). Two implementations stand side by side:
:class:`~lightning_nb.trainers.grpo.trainer.GRPOTrainer` (GRPO, Dr. GRPO and DAPO written out
in torch) and :class:`~lightning_nb.trainers.verl.trainer.VerlTrainer` (verl's own actor);
``tests/test_trainer_contract.py`` runs one suite over both.

The notebook verbs ``trainer.start(algo, steps=)``, ``pause()``, ``resume()``, ``stop()``,
``wait()``, ``progress``, ``state``, ``save()`` and ``load()`` are kept on every trainer as thin
delegations to the attached algorithm (:meth:`Trainer.attach`), which owns the loop and the
run's checkpoint.
"""

from __future__ import annotations

import abc
import contextlib
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Sequence

from lightning_nb.errors import ConfigError, LightningNbError
from lightning_nb.types import Triplet, html_view

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["Trainer", "LoopProgress", "ProgressCallback", "config_edits"]

#: ``on_progress(done, total, unit)``: what :meth:`Trainer.update` calls as its work advances
#: (``unit``: ``"micro-batches"`` for GRPOTrainer, ``"stages"`` for VerlTrainer).
ProgressCallback = Callable[[int, int, str], None]


def config_edits(applied: dict[str, Any], now: dict[str, Any]) -> list[tuple[str, Any, Any, str]]:
    """``(field, old, new, text)`` for each field of ``now`` that differs from ``applied`` (two ``asdict`` snapshots).

    ``text`` reads ``"learning_rate 2e-05 → 1e-05"``: what the metrics' ``config_changes`` show.
    Trainers and algorithms call this on the loop's thread to apply and record edits made while paused.
    """
    return [(k, applied.get(k), v, f"{k} {applied.get(k)!r} → {v!r}") for k, v in now.items() if v != applied.get(k)]


@dataclass(frozen=True)
class LoopProgress:
    """Where a training loop is: the snapshot ``trainer.progress`` (and ``algo.progress``) returns.

    The algorithm's loop (:class:`~lightning_nb.algorithm.control.BackgroundLoop`) replaces it as it
    works; the trainer's update moves it through its ``on_progress`` callback. Reading it costs nothing.
    It is defined here, below the algorithm, because a trainer with no algorithm attached reads idle.

    Attributes:
        step: the step the loop works on, numbered as its metrics row will be: ``trainer.step + 1``
            while it collects rollouts and updates, ``trainer.step`` while it evaluates after the update
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


class Trainer(abc.ABC):
    """The contract every trainer implements: update the engine's weights from triplets.

    **What update takes and returns.** :meth:`update` takes one batch of triplets (one per LLM call,
    those of several episodes, ``Triplet.group_id`` naming each episode's GRPO group) and returns the
    update's metrics row, a flat ``dict`` also appended to :attr:`metrics`. Every implementation reports
    at least :data:`METRIC_KEYS` with these meanings; more columns are welcome (verl's own names).
    An update takes the engine's lock while it changes the weights.

    **How it reaches the engine's weights.** Implementations must train the engine's own model
    (``engine.model``, the Engine contract's ``model``/``lock``/``tokenizer``) in place and then call
    ``engine.load_weights(model)``, which serves the new weights (in place for TransformersEngine, pushed
    to the server for VLLMEngine) and bumps ``engine.weight_version``: the engine generates differently
    after an update that changed the weights.

    **State.** :meth:`state_dict` returns everything a continued run needs from the trainer (tensors,
    numbers, strings, lists and dicts only, so it loads with ``torch.load(weights_only=True)``);
    :meth:`load_state_dict` restores it. :meth:`save_pretrained` exports the trained policy as a
    folder transformers and vLLM load. The run's checkpoint (this state, the algorithm's, the RNG
    states) is the algorithm's: ``LightningRL.save`` / ``load`` (also :meth:`save` / :meth:`load` here).

    **What others may read** (the algorithm, the widgets, :mod:`lightning_nb.inspect`): ``engine``,
    ``model``, ``config`` (a dataclass, edited while paused and applied at the next update), ``step``
    (updates done), ``metrics`` (rows), ``config_changes``, ``last_triplets``, ``last_advantages``
    (rollout id -> advantage), ``last_turn_advantages`` (``(rollout_id, turn)`` -> advantage),
    ``last_batch`` (one dict per trained sequence, see ``GRPOTrainer.update``), ``algorithm`` (the
    attached one, or None), and the loop's ``state``, ``running``, ``paused_at``, ``progress``, ``error``
    (delegated to the algorithm; idle without one).

    Implementations must call :meth:`_init_trainer` in their constructor.
    """

    #: Columns every implementation's metrics row has (see ``GRPOTrainer.update`` for their meaning).
    METRIC_KEYS = ("step", "loss", "pg_loss", "kl", "ppo_kl", "pg_clipfrac", "logprob_diff_max", "reward_mean",
                   "reward_std", "episodes", "groups", "groups_with_signal", "groups_dropped", "episodes_dropped",
                   "transitions", "stale_episodes_dropped", "staleness_max", "sequences_trained", "tokens_trained",
                   "grad_norm", "update_seconds", "tokens_per_s", "lr", "optimizer_steps", "turn_forks",
                   "truncated_responses", "intermediate_rewards", "config_changes")

    engine: Any
    model: Any
    config: Any

    def _init_trainer(self, engine: Any, config: Any) -> None:
        """Set the attributes of the contract (see the class docstring)."""
        self.engine = engine
        self.config = config
        self.step = 0
        self.metrics: list[dict[str, Any]] = []
        self.config_changes: list[dict[str, Any]] = []  # {"step", "field", "old", "new"} per edit applied
        self.last_triplets: list[Triplet] = []
        self.last_advantages: dict[str, float] = {}
        self.last_turn_advantages: dict[tuple[str, int], float] = {}  # (rollout_id, Triplet.turn) -> advantage
        self.last_batch: list[dict[str, Any]] = []  # the optimizer's-eye view of the last update
        self.algorithm: Any = None  # the attached algorithm (LightningRL), which owns the loop
        self.pending_algorithm_state: Optional[dict[str, Any]] = None  # from load() before an algorithm attached
        self.checkpoint_resources_id: Optional[str] = None  # the resources id of the last checkpoint loaded
        self._updating = threading.Lock()  # held by update(), load_state_dict(), save_pretrained() and frozen()

    # ----- the contract -------------------------------------------------------------------
    @abc.abstractmethod
    def update(self, triplets: Sequence[Triplet], *, on_progress: Optional[ProgressCallback] = None) -> dict[str, Any]:
        """One update on ``triplets``; returns its metrics row (also appended to :attr:`metrics`), with
        :data:`METRIC_KEYS` among its keys, and advances :attr:`step` by one.

        ``on_progress(done, total, unit)`` is called as the update advances (0 of the total first).

        Raises:
            ConfigError: no triplets, a triplet with an empty response, or a batch the config refuses.
        """

    @abc.abstractmethod
    def signal_groups(self, triplets: Sequence[Triplet]) -> set[str]:
        """Group ids of ``triplets`` that :meth:`update` would learn from (the algorithm's dynamic sampling)."""

    @abc.abstractmethod
    def check_config(self) -> None:
        """Raise ConfigError when :attr:`config`, as edited while paused, cannot be applied (``resume()`` calls it)."""

    @abc.abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Everything a continued run needs from this trainer (loads with ``torch.load(weights_only=True)``).

        Waits for an update in progress. Holds at least ``step``, ``metrics``, ``config`` and
        ``config_changes``; a trainer that owns weights adds them and its optimizer's state.
        """

    @abc.abstractmethod
    def load_state_dict(self, state: dict[str, Any], *, keep_config: bool = False, source: Any = "the state") -> None:
        """Restore :meth:`state_dict` (also into the engine, which serves the weights at once).

        ``keep_config`` keeps this trainer's config instead of the saved one (the difference is applied at
        the next update). ``source`` names where ``state`` came from in error messages.

        Raises:
            ConfigError: ``state`` was saved from another model or by a trainer built otherwise.
        """

    @abc.abstractmethod
    def save_pretrained(self, path: str | Path, *, merged: bool = True) -> Path:
        """Export the trained policy as a folder that transformers and vLLM load; returns ``path``."""

    # ----- the checkpoint's layout ----------------------------------------------------------
    def write_checkpoint(self, path: str | Path, state: dict[str, Any]) -> Path:
        """Write a run checkpoint ``state`` where ``save(path)`` puts it; returns what was written.

        The default writes one file atomically (:func:`~lightning_nb.trainers.checkpoint.write_file`);
        VerlTrainer writes verl's ``global_step_N`` folders instead.
        """
        from lightning_nb.trainers.checkpoint import write_file

        return write_file(Path(path), state)

    def find_checkpoint(self, path: str | Path, **options: Any) -> Optional[Path]:
        """The file ``load(path, **options)`` reads (None: load nothing). The default is ``path`` itself.

        Raises:
            ConfigError: ``options`` this layout does not take.
        """
        if options:
            raise ConfigError(f"{type(self).__name__}.load() takes no options {sorted(options)}")
        return Path(path)

    @contextlib.contextmanager
    def frozen(self) -> Iterator[None]:
        """Hold the update lock and the engine's lock: no update runs and the weights stay as they are inside.

        A checkpoint is assembled and written inside (``LightningRL.save``), so it is of one step.
        """
        with self._updating, self.engine.lock:
            yield

    # ----- the algorithm that drives this trainer ---------------------------------------------
    def attach(self, algorithm: Any) -> None:
        """Make ``algorithm`` the one the notebook verbs act on (LightningRL calls this when it is built).

        A checkpoint loaded before any algorithm was attached hands it its state now.

        Raises:
            LightningNbError: another algorithm's loop is running on this trainer (stop() it first).
        """
        if self.algorithm is not None and self.algorithm is not algorithm and self.algorithm.running:
            raise LightningNbError("the trainer is already running another algorithm's loop; call trainer.stop() "
                                   "or trainer.wait() before building or starting another algorithm with it")
        self.algorithm = algorithm
        if self.pending_algorithm_state is not None:
            algorithm.load_state_dict(self.pending_algorithm_state)
            self.pending_algorithm_state = None

    def start(self, algorithm: Any, steps: Optional[int] = None) -> "Trainer":
        """Run ``algorithm``'s loop in the background (``algorithm.start(steps)``) and return at once.

        Raises:
            LightningNbError: a loop started earlier is still running (even if a wait() was interrupted).
            ConfigError: ``algorithm`` was built with another trainer.
        """
        if getattr(algorithm, "trainer", self) is not self:
            raise ConfigError("algorithm.trainer is a different trainer; build the algorithm with this trainer")
        algorithm.start(steps)  # attaches it first: attach() refuses while another algorithm's loop runs
        return self

    def pause(self, wait: bool = True, timeout: Optional[float] = None, progress: bool = False) -> bool:
        """The attached algorithm's ``pause`` (:meth:`BackgroundLoop.pause`); True when no loop runs."""
        return True if self.algorithm is None else self.algorithm.pause(wait=wait, timeout=timeout, progress=progress)

    def resume(self) -> None:
        """The attached algorithm's ``resume``: config edits made while paused are checked first.

        Raises:
            ConfigError: an edited config is invalid; the loop stays paused.
        """
        if self.algorithm is None:
            self.check_config()
        else:
            self.algorithm.resume()

    def stop(self, timeout: float = 600.0) -> bool:
        """The attached algorithm's ``stop``: end the loop at its next step boundary; True once it ended."""
        return True if self.algorithm is None else self.algorithm.stop(timeout=timeout)

    def wait(self, timeout: Optional[float] = None, progress: bool = False, until_step: Optional[int] = None) -> bool:
        """The attached algorithm's ``wait`` (:meth:`BackgroundLoop.wait`); True when no loop runs."""
        if self.algorithm is None:
            return True
        return self.algorithm.wait(timeout=timeout, progress=progress, until_step=until_step)

    @property
    def progress(self) -> LoopProgress:
        """Where the loop is (:class:`LoopProgress`); ``idle`` without an algorithm."""
        return LoopProgress() if self.algorithm is None else self.algorithm.progress

    @property
    def state(self) -> str:
        """idle | running | pausing | paused | stopped | failed | finished (the algorithm's loop; idle without one)."""
        return "idle" if self.algorithm is None else self.algorithm.state

    @property
    def running(self) -> bool:
        """True while the algorithm's background loop has not ended (running, pausing or paused)."""
        return self.algorithm is not None and self.algorithm.running

    @property
    def paused_at(self) -> str:
        """The boundary the loop is parked at (e.g. ``'before update'``), or ``''``."""
        return "" if self.algorithm is None else self.algorithm.paused_at

    @property
    def error(self) -> Optional[BaseException]:
        """The exception the loop failed with, or None."""
        return None if self.algorithm is None else self.algorithm.error

    @property
    def stop_requested(self) -> bool:
        return self.algorithm is not None and self.algorithm.stop_requested

    # ----- the run's checkpoint (the algorithm's; a trainer alone checkpoints itself) ----------
    def save(self, path: str | Path) -> Path:
        """Write the run's checkpoint: ``LightningRL.save`` of the attached algorithm (see there).

        Without an algorithm the checkpoint holds this trainer's :meth:`state_dict` and the RNG states;
        an algorithm built later with this trainer starts from its own state.
        """
        if self.algorithm is not None:
            return self.algorithm.save(path)
        from lightning_nb.trainers.checkpoint import run_checkpoint

        with self.frozen():
            return self.write_checkpoint(path, run_checkpoint(self))

    def load(self, path: str | Path, *, keep_config: bool = False, **options: Any) -> None:
        """Continue from a :meth:`save` checkpoint: ``LightningRL.load`` of the attached algorithm (see there).

        Without an algorithm this restores the trainer's state and the RNG states, and keeps the
        checkpoint's algorithm state for the algorithm built next with this trainer (:meth:`attach`).
        ``options``: the layout's (VerlTrainer: ``resume_mode``).
        """
        if self.algorithm is not None:
            self.algorithm.load(path, keep_config=keep_config, **options)
            return
        from lightning_nb.trainers.checkpoint import restore_checkpoint, set_rng_state

        run = restore_checkpoint(self, path, keep_config=keep_config, **options)
        if run is not None:
            set_rng_state(run["rng"])
            self.pending_algorithm_state = run.get("algorithm")

    # ----- inspection -------------------------------------------------------------------------
    def add_metrics(self, step: int, **values: Any) -> None:
        """Attach values (e.g. val_reward, step_seconds) to the metrics row of ``step``.

        When the attached algorithm's loggers already logged that row, the values are
        logged at its step too (``LightningRL.metrics_added``).
        """
        for row in self.metrics:
            if row["step"] == step:
                row.update(values)
                break
        else:
            self.metrics.append({"step": step, **values})
        if self.algorithm is not None:
            self.algorithm.metrics_added(step, values)

    def metrics_df(self) -> "pd.DataFrame":
        """One row per training step (see :meth:`update` and ``LightningRL.step`` for the columns)."""
        import pandas as pd

        return pd.DataFrame(self.metrics)

    def last_batch_df(self) -> "pd.DataFrame":
        """The optimizer's-eye view of the last update: one row per packed sequence in the loss.

        Columns (:func:`lightning_nb.inspect.audit.batch_df`): ``rollout_id``, ``group_id``,
        ``advantage``, ``tokens``, ``response_tokens``, ``mean_ratio``,
        ``max_abs_logprob_diff`` (nats), ``response_text``. The triplets themselves, one row
        per LLM call: ``lightning_nb.adapter.triplets_df(trainer.last_triplets, trainer.last_turn_advantages)``.
        """
        from lightning_nb.inspect.audit import batch_df

        return batch_df(self.last_batch, self.engine.tokenizer)

    def last_batch_html(self, max_rows: int = 16) -> str:
        """The last update's sequences token by token, shaded by response mask and coloured by advantage,
        with engine and trainer log-probs and the ratio on hover (:func:`lightning_nb.inspect.audit.batch_html`).
        Show it with ``IPython.display.HTML(trainer.last_batch_html())``."""
        from lightning_nb.inspect.audit import batch_html

        clip = self.config.clip_ratio_high if self.config.clip_ratio_high is not None else self.config.clip_ratio
        return batch_html(self.last_batch, self.engine.tokenizer, max_rows=max_rows, clip_ratio=clip)

    def _repr_html_(self) -> Optional[str]:
        return html_view(self)
