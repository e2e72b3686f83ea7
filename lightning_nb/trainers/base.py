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
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Sequence

from lightning_nb.errors import ConfigError, MovedAttributeError
from lightning_nb.trainers.edits import ConfigChange, config_edits
from lightning_nb.types import Triplet, html_view

if TYPE_CHECKING:
    import pandas as pd

    from lightning_nb.engines.base import Engine
    from lightning_nb.trainers.config import TrainerConfig

__all__ = ["Trainer", "Update", "ProgressCallback", "progress_ticker", "config_edits", "MOVED_TO_ALGORITHM"]

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


@dataclass(eq=False)
class Update(MutableMapping[str, Any]):
    """What one :meth:`Trainer.update` returns: its metrics row and everything else the algorithm records of it.

    Indexing reads and writes the metrics row (``update["loss"]``, ``update["note"] = ...``, ``dict(update)``): the
    dict ``update()`` returned in earlier versions. The algorithm keeps the last one as ``algo.last_update``; the trainer keeps none.

    Attributes:
        metrics: the update's metrics row, a flat dict with :attr:`Trainer.METRIC_KEYS` among its keys.
        config_changes: the edits of the trainer's config this update applied
            (:class:`~lightning_nb.trainers.edits.ConfigChange`: field, old, new).
        triplets: the batch it was given (the trained triplets, then the ``left_out`` ones).
        advantages: kept episode (rollout id) -> advantage (turns whose advantages differ: the mean over its turns).
        turn_advantages: ``(rollout_id, Triplet.turn)`` -> advantage of each kept triplet.
        batch: one dict per trained sequence (``GRPOTrainer.update`` lists the keys), the optimizer's-eye view
            that :meth:`batch_df` shows.
    """

    metrics: dict[str, Any]
    config_changes: list[ConfigChange] = field(default_factory=list)
    triplets: list[Triplet] = field(default_factory=list)
    advantages: dict[str, float] = field(default_factory=dict)
    turn_advantages: dict[tuple[str, int], float] = field(default_factory=dict)
    batch: list[dict[str, Any]] = field(default_factory=list)

    def __getitem__(self, key: str) -> Any:
        return self.metrics[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self.metrics[key] = value

    def __delitem__(self, key: str) -> None:
        del self.metrics[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.metrics)

    def __len__(self) -> int:
        return len(self.metrics)

    def batch_df(self, tokenizer: Any) -> "pd.DataFrame":
        """One row per packed sequence in the loss (:func:`lightning_nb.inspect.audit.batch_df`); ``tokenizer``
        decodes the responses (``engine.tokenizer``)."""
        from lightning_nb.inspect.audit import batch_df

        return batch_df(self.batch, tokenizer)


#: The trainer attributes of earlier versions -> the field of :class:`Update` that replaced each.
_LAST = {"last_metrics": "metrics", "last_triplets": "triplets", "last_advantages": "advantages",
         "last_turn_advantages": "turn_advantages", "last_batch": "batch"}


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
    those of several episodes, ``Triplet.group_id`` naming each episode's group) that carry their per-token
    advantages (:attr:`Triplet.advantages`: rewards → credit → advantages is the algorithm's step,
    :mod:`lightning_nb.credit`; the trainer computes none) and returns an
    :class:`Update`: the update's metrics row (indexing the Update reads it), the config edits it applied, the
    advantages it trained with and the trained sequences. The algorithm keeps what it records; the trainer keeps
    no record of its updates. Every implementation reports at least :data:`METRIC_KEYS` with these meanings;
    more columns are welcome (verl's own names). An update takes the engine's lock while it changes the weights.

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
    ``model``, ``config`` (a dataclass, edited while paused and applied at the next update) and
    ``updates_applied`` (the LR schedule's position; ``step`` in earlier versions, deprecated). ``last_metrics``, ``last_triplets``, ``last_advantages``,
    ``last_turn_advantages``, ``last_batch`` and ``last_config_changes`` of earlier versions are the fields of
    the :class:`Update` that :meth:`update` returns (``algo.last_update``); reading them here warns for one
    release.

    Implementations call ``super().__init__(engine, config)``.
    """

    #: Columns every implementation's metrics row has (see ``GRPOTrainer.update`` for their meaning).
    METRIC_KEYS = ("step", "loss", "pg_loss", "kl", "ppo_kl", "pg_clipfrac", "logprob_diff_max", "reward_mean",
                   "reward_std", "episodes", "groups", "groups_with_signal", "groups_dropped", "episodes_dropped",
                   "transitions", "stale_episodes_dropped", "staleness_max", "sequences_trained", "tokens_trained",
                   "grad_norm", "update_seconds", "tokens_per_s", "lr", "optimizer_steps", "turn_forks",
                   "truncated_responses", "intermediate_rewards", "config_changes")

    engine: "Engine"
    model: Any  # a torch.nn.Module (torch is imported on first use)
    config: "TrainerConfig"
    updates_applied: int

    def __init__(self, engine: "Engine", config: "TrainerConfig") -> None:
        """Set the attributes of the contract (see the class docstring)."""
        self.engine = engine
        self.config = config
        self.updates_applied = 0  # the position of the LR schedule (the run's step is the algorithm's)
        self._updating = threading.Lock()  # held by update(), load_state_dict(), save_pretrained() and frozen()
        self._last: Update = Update({})  # only for the deprecated last_* properties below

    def _deprecated_last(self, name: str) -> Any:
        """A ``last_*`` attribute of earlier versions, read from the last :class:`Update` with a DeprecationWarning."""
        field_name = _LAST.get(name, "config_changes")
        warnings.warn(f"trainer.{name} is deprecated: trainer.update() returns an Update, and the algorithm keeps "
                      f"the last one as algo.last_update (read its .{field_name})", DeprecationWarning, stacklevel=3)
        if name == "last_config_changes":
            return [{"field": c.field, "old": c.old, "new": c.new} for c in self._last.config_changes]
        return getattr(self._last, field_name)

    last_metrics = property(lambda self: self._deprecated_last("last_metrics"),
                            doc="Deprecated: ``algo.last_update.metrics``.")
    last_triplets = property(lambda self: self._deprecated_last("last_triplets"),
                             doc="Deprecated: ``algo.last_update.triplets``.")
    last_advantages = property(lambda self: self._deprecated_last("last_advantages"),
                               doc="Deprecated: ``algo.last_update.advantages``.")
    last_turn_advantages = property(lambda self: self._deprecated_last("last_turn_advantages"),
                                    doc="Deprecated: ``algo.last_update.turn_advantages``.")
    last_batch = property(lambda self: self._deprecated_last("last_batch"), doc="Deprecated: ``algo.last_update.batch``.")
    last_config_changes = property(lambda self: self._deprecated_last("last_config_changes"),
                                   doc="Deprecated: ``algo.last_update.config_changes``.")

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
    def update(self, triplets: Sequence[Triplet], *, on_progress: Optional[ProgressCallback] = None,
               left_out: Sequence[Triplet] = ()) -> Update:
        """One update on ``triplets``, which carry their per-token advantages (:attr:`Triplet.advantages`, the
        algorithm's credit: :mod:`lightning_nb.credit`); returns its :class:`Update` (the metrics row, with
        :data:`METRIC_KEYS` among its keys, and what else the algorithm records) and advances :attr:`updates_applied`
        by one. The trainer trains on the advantages as given and computes none.

        ``left_out``: triplets of the same batch that the credit does not train (a group under its
        ``min_group_size``); counted in the metrics (``groups_dropped``, ``episodes_dropped``, ``transitions``), not
        trained. Episodes sampled more than ``config.max_staleness`` weight versions ago are dropped either way
        (:meth:`stale_rollouts`). ``on_progress(done, total, unit)`` is called as the update advances (0 of the
        total first).

        Deprecated, for one release: triplets without advantages (and no ``left_out``) are credited as earlier
        versions did, from the config's credit fields (a DeprecationWarning).

        Raises:
            ConfigError: no triplets, a triplet with an empty response, some triplets with advantages and some
                without, or a batch the config refuses.
        """

    def stale_rollouts(self, triplets: Sequence[Triplet]) -> set[str]:
        """Rollout ids of ``triplets`` sampled more than ``config.max_staleness`` weight versions before the engine's
        (``engine.weight_version``): :meth:`update` drops them, so the algorithm's credit leaves them out of its
        group statistics."""
        from lightning_nb.trainers.batch import staleness_of

        ages = staleness_of(triplets, self.engine.weight_version)
        return {r for r, age in ages.items() if age > self.config.max_staleness}

    def signal_groups(self, triplets: Sequence[Triplet]) -> set[str]:
        """Deprecated: ``algo.signal_groups(triplets)`` (credit is the algorithm's); here, the groups with a non-zero
        advantage under this config's deprecated credit fields (DeprecationWarning)."""
        from lightning_nb.trainers.batch import signal_groups

        warnings.warn("trainer.signal_groups(triplets) is deprecated: credit is the algorithm's step, use "
                      "algo.signal_groups(triplets) (AlgorithmConfig.credit); it goes in the next release",
                      DeprecationWarning, stacklevel=2)
        return signal_groups(self.config, triplets)

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
    def batch_df(self, update: Update) -> "pd.DataFrame":
        """The optimizer's-eye view of ``update`` (what :meth:`update` returned, ``algo.last_update``): one row per
        packed sequence in the loss.

        Columns (:func:`lightning_nb.inspect.audit.batch_df`): ``rollout_id``, ``group_id``,
        ``advantage``, ``tokens``, ``response_tokens``, ``mean_ratio``,
        ``max_abs_logprob_diff`` (nats), ``response_text``. The triplets themselves, one row
        per LLM call: ``lightning_nb.adapter.triplets_df(update.triplets, update.turn_advantages)``.
        """
        return update.batch_df(self.engine.tokenizer)

    def batch_html(self, update: Update, max_rows: int = 16) -> str:
        """``update``'s sequences token by token, shaded by response mask and coloured by advantage,
        with engine and trainer log-probs and the ratio on hover (:func:`lightning_nb.inspect.audit.batch_html`).
        Show it with ``IPython.display.HTML(trainer.batch_html(algo.last_update))``."""
        from lightning_nb.inspect.audit import batch_html

        clip = self.config.clip_ratio_high if self.config.clip_ratio_high is not None else self.config.clip_ratio
        return batch_html(update.batch, self.engine.tokenizer, max_rows=max_rows, clip_ratio=clip)

    def last_batch_df(self) -> "pd.DataFrame":
        """:meth:`batch_df` of the last update (deprecated: ``trainer.batch_df(algo.last_update)``)."""
        warnings.warn("trainer.last_batch_df() is deprecated: trainer.batch_df(algo.last_update)", DeprecationWarning,
                      stacklevel=2)
        return self.batch_df(self._last)

    def last_batch_html(self, max_rows: int = 16) -> str:
        """:meth:`batch_html` of the last update (deprecated: ``trainer.batch_html(algo.last_update)``)."""
        warnings.warn("trainer.last_batch_html() is deprecated: trainer.batch_html(algo.last_update)",
                      DeprecationWarning, stacklevel=2)
        return self.batch_html(self._last, max_rows=max_rows)

    def _repr_html_(self) -> Optional[str]:
        return html_view(self)
