"""The Trainer contract: what updates the policy's weights from a batch of triplets, and nothing else.

A trainer turns one batch of :class:`~lightning_nb.types.Triplet` into new weights that the
engine serves. The loop around it (enqueue rollouts, wait, adapt spans, decide when to update,
pause at step boundaries, count the steps, keep the metrics rows, checkpoint the run) is the algorithm's
(:class:`~lightning_nb.algorithm.base.Algorithm`: :class:`~lightning_nb.algorithm.lightning_rl.LightningRL`,
:class:`~lightning_nb.algorithm.traffic.TrafficLearner`). A trainer holds no reference to an algorithm.
Two implementations stand side by side:
:class:`~lightning_nb.trainers.grpo.trainer.GRPOTrainer` (GRPO, Dr. GRPO and DAPO written out
in torch) and :class:`~lightning_nb.trainers.verl.trainer.VerlTrainer` (verl's own actor);
``tests/test_trainer_contract.py`` runs one suite over both.

The notebook verbs (``start``, ``pause``, ``resume``, ``stop``, ``wait``, ``progress``, ``state``,
``save``, ``load``, ``metrics_df``) are the algorithm's: ``trainer.start(algo)`` of earlier versions is
``algo.start()``. For one release, reading one of them on a trainer raises
:class:`~lightning_nb.errors.MovedAttributeError` (an ``AttributeError``) naming the replacement, and
``trainer.step`` (renamed :attr:`Trainer.updates_applied`: it counts the trainer's updates, not the run's
steps) still works with a ``DeprecationWarning``.
"""

from __future__ import annotations

import abc
import contextlib
import threading
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Sequence

from lightning_nb.errors import ConfigError, MovedAttributeError
from lightning_nb.types import Triplet, html_view

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["Trainer", "ProgressCallback", "progress_ticker", "config_edits", "MOVED_TO_ALGORITHM"]

#: ``on_progress(done, total, unit)``: what :meth:`Trainer.update` calls as its work advances
#: (``unit``: ``"micro-batches"`` for GRPOTrainer, ``"stages"`` for VerlTrainer).
ProgressCallback = Callable[[int, int, str], None]


def progress_ticker(report: ProgressCallback, total: int, unit: str) -> Callable[[], None]:
    """A function to call after each of ``total`` pieces of work (``unit``): reports ``report(done, total, unit)``;
    reports 0 at once."""
    done = 0
    report(0, total, unit)

    def tick() -> None:
        nonlocal done
        done += 1
        report(done, total, unit)

    return tick


def config_edits(applied: dict[str, Any], now: dict[str, Any]) -> list[tuple[str, Any, Any, str]]:
    """``(field, old, new, text)`` for each field of ``now`` that differs from ``applied`` (two ``asdict`` snapshots).

    ``text`` reads ``"learning_rate 2e-05 → 1e-05"``: what the metrics' ``config_changes`` show.
    Trainers and algorithms call this on the loop's thread to apply and record edits made while paused.
    """
    return [(k, applied.get(k), v, f"{k} {applied.get(k)!r} → {v!r}") for k, v in now.items() if v != applied.get(k)]


#: the run's verbs that moved from the trainer to the algorithm (``LightningRL``, ``TrafficLearner``, ``APO``):
#: old name -> what to write now. Reading one on a trainer raises MovedAttributeError saying so (for one release).
MOVED_TO_ALGORITHM = {
    "start": "algo.start()", "pause": "algo.pause()", "resume": "algo.resume()", "stop": "algo.stop()",
    "wait": "algo.wait()", "progress": "algo.progress", "state": "algo.state", "metrics_df": "algo.metrics_df()",
    "save": "algo.save(path) (the run's checkpoint; trainer.state_dict() is the trainer's part)",
    "load": "algo.load(path) (the run's checkpoint; trainer.load_state_dict(state) restores the trainer's part)",
}


class Trainer(abc.ABC):
    """The contract every trainer implements: update the engine's weights from triplets.

    **What update takes and returns.** :meth:`update` takes one batch of triplets (one per LLM call,
    those of several episodes, ``Triplet.group_id`` naming each episode's GRPO group) and returns the
    update's metrics row, a flat ``dict`` (also kept as :attr:`last_metrics`; the algorithm keeps the run's rows).
    Every implementation reports
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
    states) is the algorithm's: ``LightningRL.save`` / ``load``.

    **What others may read** (the algorithm, the widgets, :mod:`lightning_nb.inspect`): ``engine``,
    ``model``, ``config`` (a dataclass, edited while paused and applied at the next update),
    ``updates_applied`` (updates applied: the LR schedule's position; ``step`` before, deprecated), ``last_metrics`` (the last update's row),
    ``last_config_changes`` (``{"field", "old", "new"}`` per config edit the last update applied),
    ``last_triplets``, ``last_advantages`` (rollout id -> advantage), ``last_turn_advantages``
    (``(rollout_id, turn)`` -> advantage) and ``last_batch`` (one dict per trained sequence, see
    ``GRPOTrainer.update``).

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
        self.updates_applied = 0  # the position of the LR schedule (the run's step is the algorithm's)
        self.last_metrics: dict[str, Any] = {}  # the last update's row (the run's rows are the algorithm's)
        self.last_config_changes: list[dict[str, Any]] = []  # {"field", "old", "new"} applied at the last update
        self.last_triplets: list[Triplet] = []
        self.last_advantages: dict[str, float] = {}
        self.last_turn_advantages: dict[tuple[str, int], float] = {}  # (rollout_id, Triplet.turn) -> advantage
        self.last_batch: list[dict[str, Any]] = []  # the optimizer's-eye view of the last update
        self._updating = threading.Lock()  # held by update(), load_state_dict(), save_pretrained() and frozen()

    # ----- names of earlier versions (kept for one release) --------------------------------
    @property
    def step(self) -> int:
        """Deprecated name of :attr:`updates_applied` (DeprecationWarning): it counts this trainer's updates, which
        is not the run's step (``algo.progress.step``, the metrics rows' ``step``) once a run was resumed or
        skipped updates."""
        warnings.warn("trainer.step is renamed trainer.updates_applied (the trainer's updates applied, not the "
                      "run's step: that is algo.progress.step); trainer.step goes in the next release",
                      DeprecationWarning, stacklevel=2)
        return self.updates_applied

    @step.setter
    def step(self, value: int) -> None:
        warnings.warn("trainer.step is renamed trainer.updates_applied; trainer.step goes in the next release",
                      DeprecationWarning, stacklevel=2)
        self.updates_applied = value

    def __getattr__(self, name: str) -> Any:
        """Only for names not found otherwise: a run verb that moved to the algorithm raises
        :class:`~lightning_nb.errors.MovedAttributeError` naming its replacement (:data:`MOVED_TO_ALGORITHM`).

        Raises:
            MovedAttributeError: ``name`` is one of the run's verbs (an AttributeError, so ``hasattr`` is False).
            AttributeError: any other unknown name.
        """
        if name in MOVED_TO_ALGORITHM:
            raise MovedAttributeError(
                f"{type(self).__name__}.{name} moved to the algorithm: use {MOVED_TO_ALGORITHM[name]}, e.g. "
                f"algo = LightningRL(store, trainer, ...); the trainer only updates weights")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # ----- the contract -------------------------------------------------------------------
    @abc.abstractmethod
    def update(self, triplets: Sequence[Triplet], *, on_progress: Optional[ProgressCallback] = None) -> dict[str, Any]:
        """One update on ``triplets``; returns its metrics row (also kept as :attr:`last_metrics`), with
        :data:`METRIC_KEYS` among its keys, and advances :attr:`updates_applied` by one.

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

        Waits for an update in progress. Holds at least ``step`` and ``config``; a trainer that owns weights adds
        them and its optimizer's state.
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

    # ----- inspection -------------------------------------------------------------------------
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
