"""Experiment logging: send every training step's metrics row to TensorBoard, Weights & Biases or MLflow.

``LightningRL(..., loggers=["tensorboard", "wandb", "mlflow"])`` (or logger objects with
settings: :class:`TensorBoardLogger`, :class:`WandbLogger`, :class:`MLflowLogger`) hands
each completed step's row to every logger; the row also stays in ``algo.metrics_df()``.
The libraries are used as they are, through their own writers and clients.

What goes where (the same for every backend):
  * ``row["step"]`` is the x axis (TensorBoard's ``global_step``, wandb's step metric
    ``step``, MLflow's metric ``step``); it is not logged as a value of its own;
  * numbers (bool as 0/1, NaN kept as NaN) are scalars named by their column
    (``loss``, ``reward_mean``, ``val_reward``...);
  * non-empty strings (``config_changes``) are text: TensorBoard text summaries, wandb
    history strings, MLflow run tags ``config_changes/step_<N>``; empty strings and
    ``None`` are skipped, as are values of any other type;
  * values added to a logged row later (``algo.add_metrics(step, val_reward=...)``)
    are logged at that row's step.

Life cycle: a logger opens its run on the first value, writes each row through at once
(TensorBoard is flushed after every row), stays open across ``run()`` calls so one
algorithm is one logged run, and closes on :meth:`MetricLogger.close` (which
``LightningRL.close_loggers()`` calls for every logger; ``LightningRL.run`` calls it
when the loop is stopped or fails). A value logged after ``close()`` opens
the run again (same TensorBoard folder, same MLflow run, wandb ``resume="allow"`` with
the same id; offline, that is a second ``offline-run-*`` folder of the same run id).
Rows already in ``algo.metrics`` when the loggers start (a checkpoint loaded with
``algo.load``) are not sent again: logging starts at the next step.
"""

from __future__ import annotations

import importlib
import json
import numbers
import os
import threading
import time
from typing import Any, Iterable, Optional, Union

from lightning_nb.errors import ConfigError, MissingDependencyError

__all__ = ["MLflowLogger", "MetricLogger", "TensorBoardLogger", "WandbLogger", "make_loggers", "split_values"]

CLOSE_STATUSES = ("finished", "stopped", "failed")


def _require(module: str, package: str, extra: str) -> Any:
    """Import ``module`` or raise MissingDependencyError naming the pip package and the extra."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingDependencyError(
            f"{package} is not installed, and this logger needs it; install it with "
            f"pip install 'lightning-nb[{extra}]' (or pip install {package})") from exc


def split_values(values: dict[str, Any]) -> tuple[dict[str, float], dict[str, str]]:
    """``(scalars, texts)`` of a metrics row or of values added to one, without ``step``.

    Numbers (``numbers.Real``, numpy scalars included; bool as 0.0/1.0) go to ``scalars``
    as float, NaN included; non-empty strings go to ``texts``. Empty strings, ``None`` and
    any other type are skipped.
    """
    scalars: dict[str, float] = {}
    texts: dict[str, str] = {}
    for key, value in values.items():
        if key == "step":
            continue
        if isinstance(value, numbers.Real):
            scalars[key] = float(value)
        elif isinstance(value, str) and value:
            texts[key] = value
    return scalars, texts


class MetricLogger:
    """Contract of a destination for metrics rows; one instance is one logged run.

    Implementations must define :meth:`_open` (start the run), :meth:`_write` (log
    ``scalars`` and ``texts`` at ``step``; may be called again for a step already
    written, to add values to it) and :meth:`_close` (finish the run with a status of
    :data:`CLOSE_STATUSES`); :meth:`_flush` only if the library buffers. They must import
    their library in ``__init__`` through :func:`_require`, so a missing package fails
    when the logger is built, not at the first step. The public methods below hold a
    lock: rows come from the training thread, added values from a notebook cell.
    """

    def __init__(self, config: Optional[dict[str, Any]] = None) -> None:
        self.config = config  # the run's config; LightningRL fills in both configs when None
        self.logged_steps: set[int] = set()
        self.is_open = False
        self._lock = threading.Lock()

    # ----- the algorithm's side ---------------------------------------------------------
    def log_row(self, row: dict[str, Any]) -> None:
        """Log one completed step's metrics row (it must have ``step``)."""
        step = int(row["step"])
        scalars, texts = split_values(row)
        with self._lock:
            self._ensure_open()
            self._write(step, scalars, texts)
            self._flush()
            self.logged_steps.add(step)

    def log_added(self, step: int, values: dict[str, Any]) -> None:
        """Log ``values`` added to the row of ``step`` after it was logged (e.g. ``val_reward``).

        Values of a step not logged yet are ignored here: they go out with its row.
        """
        if int(step) not in self.logged_steps:
            return
        scalars, texts = split_values(values)
        if not scalars and not texts:
            return
        with self._lock:
            self._ensure_open()
            self._write(int(step), scalars, texts)
            self._flush()

    def flush(self) -> None:
        """Write what the library buffers to disk (or its server)."""
        with self._lock:
            if self.is_open:
                self._flush()

    def close(self, status: str = "finished") -> None:
        """Finish the run: ``status`` is ``finished``, ``stopped`` or ``failed``. Closing twice is a no-op.

        Raises:
            ConfigError: another status.
        """
        if status not in CLOSE_STATUSES:
            raise ConfigError(f"close(status={status!r}); use one of {', '.join(CLOSE_STATUSES)}")
        with self._lock:
            if self.is_open:
                self._close(status)
                self.is_open = False

    def _ensure_open(self) -> None:
        if not self.is_open:
            self._open()
            self.is_open = True

    # ----- what implementations define --------------------------------------------------
    def _open(self) -> None:
        raise NotImplementedError

    def _write(self, step: int, scalars: dict[str, float], texts: dict[str, str]) -> None:
        raise NotImplementedError

    def _flush(self) -> None:
        pass

    def _close(self, status: str) -> None:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({'open' if self.is_open else 'closed'}, {len(self.logged_steps)} steps logged)"


class TensorBoardLogger(MetricLogger):
    """TensorBoard event files through ``torch.utils.tensorboard.SummaryWriter``.

    Args:
        log_dir: the run's folder (default: SummaryWriter's ``runs/<date>_<host>``).
            View it with ``tensorboard --logdir <its parent>``.
        config: written once as the text ``config`` (JSON) at step 0 (default: both configs
            of the LightningRL it is given to, as ``algorithm.<field>`` / ``trainer.<field>``).

    Scalars via ``add_scalar`` (stored as float32), texts via ``add_text`` (tag
    ``<column>/text_summary`` in the event file).

    Raises:
        MissingDependencyError: tensorboard is not installed (the ``tensorboard`` extra).
    """

    def __init__(self, log_dir: Optional[Union[str, os.PathLike]] = None,
                 config: Optional[dict[str, Any]] = None) -> None:
        super().__init__(config)
        _require("tensorboard", "tensorboard", "tensorboard")
        self.log_dir = None if log_dir is None else str(log_dir)
        self.writer: Any = None

    def _open(self) -> None:
        from torch.utils.tensorboard import SummaryWriter

        first = not self.logged_steps  # not when opened again after close()
        self.writer = SummaryWriter(log_dir=self.log_dir)
        self.log_dir = self.writer.log_dir
        if self.config and first:
            self.writer.add_text("config", "```\n" + json.dumps(self.config, indent=1, default=str) + "\n```", 0)

    def _write(self, step: int, scalars: dict[str, float], texts: dict[str, str]) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, global_step=step)
        for key, text in texts.items():
            self.writer.add_text(key, text, global_step=step)

    def _flush(self) -> None:
        self.writer.flush()

    def _close(self, status: str) -> None:
        self.writer.close()
        self.writer = None


class WandbLogger(MetricLogger):
    """A Weights & Biases run; offline by default, so it needs no account and no network.

    Args:
        project: wandb project (default ``lightning-nb``).
        name: run name (default: wandb's).
        dir: folder under which wandb writes ``wandb/offline-run-*`` (default: the working directory).
        mode: ``"offline"``, ``"online"`` or ``"disabled"``. Default: ``"offline"``, unless
            the ``WANDB_MODE`` environment variable is set, which then decides.
            Upload an offline run later with ``wandb sync <run folder>``.
        config: logged as the run's config (default: both configs of the LightningRL it is given to).
        **init_kwargs: passed on to ``wandb.init`` (e.g. ``entity``, ``tags``, ``group``).

    Every row is one ``run.log`` call that carries ``step``, declared as the step metric
    of all others (``define_metric``), so a value added to an earlier step later lands at
    that step. ``run`` is the ``wandb.Run`` while open; ``run_id`` stays after close.

    Raises:
        MissingDependencyError: wandb is not installed (the ``wandb`` extra).
    """

    def __init__(self, project: str = "lightning-nb", name: Optional[str] = None,
                 dir: Optional[Union[str, os.PathLike]] = None, mode: Optional[str] = None,
                 config: Optional[dict[str, Any]] = None, **init_kwargs: Any) -> None:
        super().__init__(config)
        self._wandb = _require("wandb", "wandb", "wandb")
        if mode is None and not os.environ.get("WANDB_MODE"):
            mode = "offline"
        self.project, self.name, self.mode = project, name, mode
        self.dir = None if dir is None else str(dir)
        self.init_kwargs = init_kwargs
        self.run: Any = None
        self.run_id: Optional[str] = None

    def _open(self) -> None:
        if self.dir is not None:
            os.makedirs(self.dir, exist_ok=True)
        kwargs = {"reinit": "create_new", **self.init_kwargs}
        if self.run_id:  # opened again after close(): continue the same run
            kwargs.update(id=self.run_id, resume="allow")
        self.run = self._wandb.init(project=self.project, name=self.name, dir=self.dir, mode=self.mode,
                                    config=self.config, **kwargs)
        self.run_id = self.run.id
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def _write(self, step: int, scalars: dict[str, float], texts: dict[str, str]) -> None:
        self.run.log({"step": step, **scalars, **texts})

    def _close(self, status: str) -> None:
        self.run.finish(exit_code=1 if status == "failed" else 0)
        self.run = None


class MLflowLogger(MetricLogger):
    """An MLflow run, written through ``mlflow.tracking.MlflowClient`` (not the global active run).

    Args:
        tracking_uri: where runs go, e.g. ``"sqlite:///mlflow.db"`` or an ``http://`` server.
            Default: MLflow's own (``MLFLOW_TRACKING_URI``, else ``sqlite:///mlflow.db`` in the
            working directory). MLflow 3 refuses a file store (``./mlruns``) unless
            ``MLFLOW_ALLOW_FILE_STORE=true`` is set.
        experiment: experiment name, created if missing (default ``lightning-nb``).
        run_name: run name (default: MLflow's).
        config: logged as the run's params, values as text (default: both configs of the LightningRL
            it is given to).

    Scalars via ``log_batch`` at ``step``; texts as run tags ``<column>/step_<N>``. Close
    sets the run's status: FINISHED, KILLED (stopped) or FAILED. ``run_id`` is set once open.
    MLflow refuses ``=`` in names, so a per-slice column ``val_reward/ops=2`` is logged as
    ``val_reward/ops:2`` (:func:`mlflow_name`); every other name is kept.

    Raises:
        MissingDependencyError: mlflow-skinny is not installed (the ``mlflow`` extra).
    """

    def __init__(self, tracking_uri: Optional[str] = None, experiment: str = "lightning-nb",
                 run_name: Optional[str] = None, config: Optional[dict[str, Any]] = None) -> None:
        super().__init__(config)
        self._mlflow = _require("mlflow", "mlflow-skinny", "mlflow")
        self.tracking_uri, self.experiment, self.run_name = tracking_uri, experiment, run_name
        self.client: Any = None
        self.run_id: Optional[str] = None

    def _open(self) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(self.tracking_uri)
        if self.run_id is not None:  # opened again after close()
            self.client.update_run(self.run_id, status="RUNNING")
            return
        found = self.client.get_experiment_by_name(self.experiment)
        experiment_id = found.experiment_id if found is not None else self.client.create_experiment(self.experiment)
        self.run_id = self.client.create_run(experiment_id, run_name=self.run_name).info.run_id
        params = [Param(k, str(v)) for k, v in (self.config or {}).items()]
        for i in range(0, len(params), 100):  # log_batch takes at most 100 params
            self.client.log_batch(self.run_id, params=params[i: i + 100])

    def _write(self, step: int, scalars: dict[str, float], texts: dict[str, str]) -> None:
        from mlflow.entities import Metric, RunTag

        now_ms = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(mlflow_name(k), v, now_ms, step) for k, v in scalars.items()],
                              tags=[RunTag(mlflow_name(f"{k}/step_{step}"), v) for k, v in texts.items()])

    def _close(self, status: str) -> None:
        self.client.set_terminated(self.run_id, {"finished": "FINISHED", "stopped": "KILLED",
                                                 "failed": "FAILED"}[status])


def mlflow_name(name: str) -> str:
    """A metrics-row column as an MLflow metric or tag name: ``=`` (refused by MLflow) becomes ``:``."""
    return name.replace("=", ":")


SHORTHANDS = {"tensorboard": TensorBoardLogger, "wandb": WandbLogger, "mlflow": MLflowLogger}


def make_loggers(loggers: Iterable[Union[MetricLogger, str]], config: Optional[dict[str, Any]] = None
                 ) -> list[MetricLogger]:
    """Logger objects for ``loggers``: each a :class:`MetricLogger` or one of the shorthands
    ``"tensorboard"``, ``"wandb"``, ``"mlflow"`` (that logger with its default settings).
    A logger whose ``config`` is None gets ``config`` as its run's config.

    Raises:
        ConfigError: an unknown shorthand, a value of another type, or ``loggers`` is a single string.
        MissingDependencyError: a shorthand's package is missing (the message names the extra).
    """
    if isinstance(loggers, (str, MetricLogger)):
        raise ConfigError(f"loggers={loggers!r} must be a list, e.g. loggers=[{loggers!r}]")
    out: list[MetricLogger] = []
    for item in loggers:
        if isinstance(item, str) and item.lower() in SHORTHANDS:
            item = SHORTHANDS[item.lower()]()
        if not isinstance(item, MetricLogger):
            raise ConfigError(f"loggers: {item!r} is neither a MetricLogger nor one of {', '.join(SHORTHANDS)}; "
                              "pass e.g. loggers=['tensorboard'] or loggers=[WandbLogger(project='x')]")
        if item.config is None:
            item.config = config
        out.append(item)
    return out
