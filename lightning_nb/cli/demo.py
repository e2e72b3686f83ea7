"""The demo and eval runs of the command line: :class:`DemoSettings` and :func:`run_demo` (train the calc agent, or
another task set by name, on SmolLM2-135M, write metrics.csv, reward_curve.png and summary.json), :func:`run_eval`, and what they share (the
engine, store, proxy and runners of :func:`_serving`, the held-out evaluations, the reward curve)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

from lightning_nb.slices import Slicer, slicer_name
from lightning_nb.tasks import CalcTaskSet, TaskSet
from lightning_nb.types import MAIN_LLM

__all__ = ["DemoSettings", "run_demo", "run_eval", "DEMO_ALL_NUMBERS_BONUS", "DEMO_SLICE_WEIGHTS"]

# The demo's defaults against the two-operation plateau (issue 14; measured in README, "Past the one-step plateau"):
DEMO_ALL_NUMBERS_BONUS = 0.2  # calc_agent's shaping term for a CALC that uses every number of the question
DEMO_SLICE_WEIGHTS = {"ops=2": 3.0}  # two-operation tasks drawn 3x as often as one-operation ones
# the trainer config's fields summary.json records (micro_batch_tokens: where the config has it)
_PLACEMENT_KEYS = ("device", "dtype", "gradient_checkpointing", "micro_batch_size", "micro_batch_tokens")


def _plot(metrics_csv: Path, out_png: Path, before: float, after: float,
          before_slices: Optional[dict[str, float]] = None, ood_before: Optional[float] = None,
          title: str = "calc agent") -> list[str]:
    """Draw the reward curve to ``out_png``; returns the legend's texts.

    Lines: train reward per step, its rolling mean, the held-out reward (``before`` at step 0,
    then the ``val_reward`` column), one held-out line per ``val_reward/<slice>`` column of
    ``metrics_csv`` (labelled ``held-out <slice>``, starting at ``before_slices[slice]`` when given),
    ``held-out val_ood`` from ``ood_before`` at step 0 to the ``val_ood_reward`` column, and one thin line per
    ``reward/<component>`` column (a shaping term's mean per training rollout, labelled ``shaping <component>``).
    ``title`` names what was trained (the task set's name for other tasks than calc).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    df = pd.read_csv(metrics_csv)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(df["step"], df["reward_mean"], marker="o", label="train reward (mean of step)")
    ax.plot(df["step"], df["reward_mean"].rolling(3, min_periods=1).mean(), label="train reward (rolling 3)")
    val = df.dropna(subset=["val_reward"]) if "val_reward" in df else df.iloc[0:0]
    ax.plot([0, *val["step"]], [before, *val["val_reward"]], marker="s", label="held-out val reward")
    for col in [c for c in df.columns if c.startswith("val_reward/")]:
        label = col.split("/", 1)[1]
        part = df.dropna(subset=[col])
        start = (before_slices or {}).get(label)
        xs, ys = ([0], [start]) if start is not None else ([], [])
        ax.plot([*xs, *part["step"]], [*ys, *part[col]], marker=".", linestyle="--", label=f"held-out {label}")
    if "val_ood_reward" in df:
        part = df.dropna(subset=["val_ood_reward"])
        xs, ys = ([0], [ood_before]) if ood_before is not None else ([], [])
        ax.plot([*xs, *part["step"]], [*ys, *part["val_ood_reward"]], marker="D", linestyle=":",
                label="held-out val_ood (other wordings, numbers)")
    for col in [c for c in df.columns if c.startswith("reward/")]:
        ax.plot(df["step"], df[col].fillna(0.0), linewidth=1, linestyle="-.", label=f"shaping {col.split('/', 1)[1]}")
    ax.set_xlabel("training step")
    ax.set_ylabel("reward")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(f"{title} on SmolLM2-135M: val {before:.2f} → {after:.2f}")
    legend = ax.legend(loc="lower right", fontsize="small")
    texts = [t.get_text() for t in legend.get_texts()]
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return texts


def _slices_json(report) -> dict:
    """A SliceReport's slices as JSON: ``{label: {"mean", "n", "solved"}}``."""
    return {label: {"mean": mean, "n": n, "solved": solved} for label, (mean, n, solved) in report.slices.items()}


@contextlib.contextmanager
def _serving(runners: int, engine_kind: str = "vllm", all_numbers_bonus: float = 0.0, *, device: str = "cpu",
             dtype: str = "float32", engine_options: Optional[dict] = None, agent: Any = None) -> Iterator[tuple]:
    """Engine + store + LLM proxy + runner threads for ``agent`` (None: the calc agent); torn down on exit (Ctrl-C
    included).

    ``engine_kind``: ``"transformers"`` (in-process, its model on ``device`` in ``dtype``) or ``"vllm"`` (a
    server from ``make setup-vllm`` on ``device`` in ``dtype``; the trainer moves the in-process copy it trains
    to ``device``).
    ``all_numbers_bonus``: :func:`~lightning_nb.tasks.calc.calc_agent`'s shaping term (0: off).
    ``engine_options``: extra :class:`~lightning_nb.engines.transformers.TransformersEngine` arguments (e.g.
    ``{"batching": "continuous"}``; the transformers engine only).
    """
    from lightning_nb import InMemoryStore, LLMProxy, TransformersEngine, start_runners
    from lightning_nb.tasks.calc import calc_agent

    print(f"[lightning-nb] loading SmolLM2-135M-Instruct ({engine_kind} engine) on {device} in {dtype} ...", flush=True)
    t0 = time.time()
    if engine_kind == "vllm":
        from lightning_nb.errors import MissingDependencyError
        from lightning_nb.engines.vllm import VLLMEngine

        try:
            engine = VLLMEngine.from_default(device=device, dtype=dtype)  # the server on the trainer's device
        except MissingDependencyError as exc:
            raise MissingDependencyError(f"{exc}; or pass --engine transformers (in-process, no set-up, "
                                         "slower: see README, Engines)") from None
    else:
        engine = TransformersEngine.from_default(device=device, dtype=dtype, max_batch_size=runners,
                                                 **(engine_options or {}))
    print(f"[lightning-nb] engine ready in {time.time() - t0:.1f} s", flush=True)
    store = InMemoryStore()
    proxy = LLMProxy(engine, store).start()
    store.add_resources({MAIN_LLM: proxy.as_resource()})
    if agent is None:
        agent = functools.partial(calc_agent, all_numbers_bonus=all_numbers_bonus) if all_numbers_bonus else calc_agent
    group = start_runners(agent, store, n=runners)
    try:
        yield engine, store
    finally:
        group.stop()
        proxy.stop()
        engine.close()


def _demo_loggers(names: Sequence[str], out: Path) -> list:
    """The demo's experiment loggers, writing under ``out``: ``out/tensorboard``, ``out/wandb`` (offline unless
    WANDB_MODE is set) and ``out/mlflow.db`` (unless MLFLOW_TRACKING_URI is set)."""
    from lightning_nb.loggers import MLflowLogger, TensorBoardLogger, WandbLogger

    make = {"tensorboard": lambda: TensorBoardLogger(out / "tensorboard"),
            "wandb": lambda: WandbLogger(dir=out),
            "mlflow": lambda: MLflowLogger(os.environ.get("MLFLOW_TRACKING_URI")
                                           or f"sqlite:///{(out / 'mlflow.db').resolve()}")}
    return [make[name]() for name in dict.fromkeys(names)]


@dataclass
class DemoSettings:
    """The settings of one demo run: the ``demo`` subcommand's options as parsed (:func:`run_demo`'s argument).

    ``steps`` training steps, results under ``out``; every other field is the command line's option of the same
    meaning (``python -m lightning_nb demo --help``: ``learning_rate`` is ``--lr``, ``loggers`` ``--logger``,
    ``trainer_kind`` ``--trainer``), with the CPU defaults; the command line takes one GPU's on CUDA
    (:data:`~lightning_nb.cli.commands.DEVICE_DEFAULTS`). ``task`` is ``--task``: a task set's name or the
    :class:`~lightning_nb.tasks.TaskSet` itself (default ``"calc"``); ``all_numbers_bonus``, ``slice_weights`` and
    ``ood_size`` are calc's (set them to 0, None and 0 for another task set).
    """

    steps: int
    out: Path
    tasks_per_step: int = 4
    group_size: int = 4
    val_size: int = 64
    runners: int = 16
    learning_rate: float = 2e-5
    temperature: float = 0.7
    seed: int = 0
    max_tokens: int = 32
    kl_coef: float = 0.0
    val_every: int = 0
    sample_rounds: int = 3
    checkpoint_every: int = 0
    resume: Optional[Path] = None
    engine: str = "vllm"
    loggers: Sequence[str] = ()
    lora_rank: int = 0
    lora_alpha: float = 32.0
    trainer_kind: str = "grpo"
    slice_by: Optional[Slicer] = "ops"
    ood_size: Optional[int] = None
    all_numbers_bonus: float = DEMO_ALL_NUMBERS_BONUS
    slice_weights: Optional[dict[str, float]] = field(default_factory=lambda: dict(DEMO_SLICE_WEIGHTS))
    device: str = "cpu"
    dtype: str = "float32"
    gradient_checkpointing: bool = False
    micro_batch_size: Optional[int] = None
    overlong_filter: bool = False
    task: Any = "calc"


def run_demo(settings: DemoSettings, *, after_step: Optional[Callable[[Any, dict], None]] = None) -> dict:
    """Train the calculator agent (or the task set ``settings.task`` names) on SmolLM2-135M and write metrics.csv,
    reward_curve.png, summary.json.

    summary.json holds the held-out reward before and after (``val_reward_before``/``_after``) with their standard
    errors over the held-out tasks and that of the paired gain (:func:`_held_out_spread`: ``val_reward_before_se``,
    ``val_reward_after_se``, ``val_reward_gain_se``).

    ``task``: ``"calc"`` (the default: everything below as it was), or another task set's name or
    :class:`~lightning_nb.tasks.TaskSet` (``"reasoning_gym:basic_arithmetic"``, ``"textarena:GuessTheNumber-v0-raw"``;
    docs/tasks.md). Such a run makes the first ``steps * tasks_per_step * sample_rounds`` training tasks and the first
    ``val_size`` held-out ones, slices by the task set's ``slice_by`` unless told otherwise, has no shaping term and
    no val_ood, and its summary.json adds ``task`` (:meth:`TaskSet.describe`: name, source, slice_by, and the seed
    ranges of the training and held-out tasks it made, which never overlap).

    ``after_step(algo, row)``, when given, is called after every training step with the
    :class:`~lightning_nb.algorithm.lightning_rl.LightningRL` and the step's metrics row (``algo.last_update``'s
    ``batch`` and ``triplets`` are that step's; ``bench/logprob_agreement.py`` reads them).

    The final checkpoint is written to ``out/checkpoint.pt`` (also every ``checkpoint_every``
    steps when > 0, overwritten); ``resume`` continues a run from such a checkpoint up to
    ``steps`` steps in all (the same run that an uninterrupted one would have been).
    ``loggers`` (``tensorboard``, ``wandb``, ``mlflow``) also log every step under ``out``
    (:func:`_demo_loggers`). ``lora_rank`` > 0 trains LoRA adapters instead of the weights
    (``GRPOConfig.lora_rank``; pass a higher ``learning_rate``, e.g. 2e-4). ``trainer_kind="verl"`` trains with
    :class:`~lightning_nb.trainers.verl.trainer.VerlTrainer` (verl's actor update); its checkpoints go to the folder
    ``out/checkpoints`` in verl's layout, and ``resume`` is that folder. ``slice_by`` (a task field, default
    ``"ops"``: one- vs two-operation problems; None: off) breaks every held-out evaluation down by slice: printed
    before and after training, ``val_reward/<slice>`` columns in metrics.csv, one line per slice in
    reward_curve.png, ``val_slices_before``/``val_slices_after`` in summary.json. ``ood_size`` > 0 (None: as
    many as ``val_size``) also evaluates that many ``val_ood`` tasks (other wordings and number ranges than training's,
    :func:`lightning_nb.tasks.calc.dataset.generate_ood`) before and after: printed beside val, a ``val_ood_reward``
    column (last step) in metrics.csv and a line in reward_curve.png, ``val_ood_*`` keys in summary.json.
    ``all_numbers_bonus`` > 0: the agent's shaping term, an intermediate reward ``calc_uses_all_numbers`` for a
    ``CALC`` that uses every number of the question (:func:`~lightning_nb.tasks.calc.calc_agent`; a ``reward/...``
    column in metrics.csv, its own component in ``store.rewards_df()``). ``slice_weights``: training tasks drawn
    with these weights per ``slice_by`` label (:attr:`AlgorithmConfig.slice_weights`; needs ``slice_by``).
    ``overlong_filter``: DAPO's overlong filter (:attr:`TrainerConfig.overlong_filter`: replies cut at
    ``max_tokens`` add no gradient; GRPOTrainer only, VerlConfig refuses it). Off by default: it stops the demo's
    drift to cut replies, but did not make it rise more often (docs/performance.md).
    ``device`` (``"cpu"``, ``"cuda"``, ``"cuda:N"``) and ``dtype`` (``"float32"``, ``"bfloat16"``) go to the engine
    (``TransformersEngine.from_default(device=, dtype=)``) and, with ``gradient_checkpointing`` and
    ``micro_batch_size`` (rows per forward/backward; None: the config's default), to the trainer's config; the
    command line picks one GPU's values on CUDA (:data:`DEVICE_DEFAULTS`).

    Raises:
        ConfigError: ``device`` is not available here, or another setting is out of range (from the configs).
    """
    import torch

    from lightning_nb import AlgorithmConfig, GRPOConfig, GRPOTrainer, LightningRL, VerlConfig, VerlTrainer

    s, task = _task_settings(settings)
    calc = isinstance(task, CalcTaskSet)
    trainer_cls, config_cls = (VerlTrainer, VerlConfig) if s.trainer_kind == "verl" else (GRPOTrainer, GRPOConfig)
    t_start = time.time()
    torch.manual_seed(s.seed)
    s.out.mkdir(parents=True, exist_ok=True)
    micro = {"micro_batch_size": s.micro_batch_size} if s.micro_batch_size is not None else {}
    # calc trains on its whole train file; a seeded task set makes only the tasks a run can draw
    n_train = None if calc else min(len(task.train_seeds), s.steps * s.tasks_per_step * s.sample_rounds)
    train_tasks, val_tasks = task.train_tasks(n_train), task.heldout_tasks(s.val_size)
    agent = task.shaped_agent(s.all_numbers_bonus) if calc else task.agent
    with _serving(s.runners, s.engine, s.all_numbers_bonus, device=s.device, dtype=s.dtype, agent=agent) as (served,
                                                                                                             store):
        trainer = trainer_cls(served, config_cls(
            learning_rate=s.learning_rate, kl_coef=s.kl_coef, lora_rank=s.lora_rank, lora_alpha=s.lora_alpha, device=s.device,
            dtype=s.dtype, gradient_checkpointing=s.gradient_checkpointing, overlong_filter=s.overlong_filter,
            **micro))
        config = AlgorithmConfig(steps=s.steps, tasks_per_step=s.tasks_per_step, group_size=s.group_size, seed=s.seed,
                                 temperature=s.temperature, max_tokens=s.max_tokens, val_every=s.val_every,
                                 dynamic_sampling=s.sample_rounds > 1, max_sample_rounds=s.sample_rounds,
                                 slice_weights=dict(s.slice_weights) if s.slice_weights else None)
        algo = LightningRL(store, trainer, train_tasks, val_tasks, config, loggers=_demo_loggers(s.loggers, s.out),
                           slice_by=s.slice_by)
        checkpoint = s.out / ("checkpoints" if s.trainer_kind == "verl" else "checkpoint.pt")
        if s.resume is not None:
            algo.load(s.resume)
            print(f"[demo] resumed from {s.resume} at step {algo.global_step}", flush=True)
        print(f"[demo] evaluating on {s.val_size} held-out tasks (greedy) ...", flush=True)
        before, before_report, rewards_before = _evaluate_val(algo, s.slice_by, "before training")
        n_ood = s.val_size if s.ood_size is None else s.ood_size
        ood_tasks = task.ood_tasks(n_ood) if calc and n_ood > 0 else []
        ood_before = _evaluate_ood(algo, ood_tasks, s.slice_by, "demo", "before training")
        _train(algo, s.steps, s.checkpoint_every, checkpoint, after_step)
        after, after_report, rewards_after = _evaluate_after_training(algo, s.steps, s.slice_by)
        ood_after = _evaluate_ood(algo, ood_tasks, s.slice_by, "demo", "after training")
        if ood_after is not None:
            algo.add_metrics(algo.global_step, val_ood_reward=ood_after[0])
        algo.close_loggers()
        _save_final(algo, checkpoint)
    df = _write_metrics(algo, s.out, before, after, before_report, ood_before, "calc agent" if calc else task.name)
    summary = {"val_reward_before": before, "val_reward_after": after, "steps": s.steps, "val_size": s.val_size,
               **_held_out_spread(rewards_before, rewards_after), "minutes": (time.time() - t_start) / 60,
               "out": str(s.out), "checkpoint": str(checkpoint),
               "engine": s.engine, "trainer": s.trainer_kind, "lora_rank": s.lora_rank, "learning_rate": s.learning_rate,
               **{k: getattr(trainer.config, k, None) for k in _PLACEMENT_KEYS}, "runners": s.runners,
               "tasks_per_step": s.tasks_per_step, "group_size": s.group_size, "overlong_filter": s.overlong_filter,
               "rollout_seconds_per_step": float(df["rollout_seconds"].mean()) if "rollout_seconds" in df else None,
               "step_seconds": float(df["step_seconds"].mean()) if "step_seconds" in df else None,
               "slice_by": s.slice_by if s.slice_by is None else slicer_name(s.slice_by), "seed": s.seed, "all_numbers_bonus": s.all_numbers_bonus,
               "slice_weights": dict(s.slice_weights) if s.slice_weights else None,
               "val_slices_before": _slices_json(before_report) if before_report is not None else None,
               "val_slices_after": _slices_json(after_report) if after_report is not None else None,
               "ood_size": len(ood_tasks), **_ood_json(ood_before, ood_after)}
    if not calc:  # calc's summary stays as it was; another task set says what it is and which seeds it drew
        summary["task"] = task.describe(len(train_tasks), len(val_tasks))
    (s.out / "summary.json").write_text(json.dumps(summary, indent=2))
    _print_outcome(s.out, summary)
    return summary


def _held_out_spread(before: list[Optional[float]], after: list[Optional[float]]) -> dict[str, Optional[float]]:
    """summary.json's standard errors of the held-out reward: ``val_reward_before_se`` and ``val_reward_after_se``
    (sample standard deviation of the per-task final rewards / sqrt(n)), and ``val_reward_gain_se``, the standard
    error of the mean paired gain (after - before on the same task; the same held-out tasks are evaluated before
    and after). ``before``/``after``: per-task rewards in task order, None where the rollout was cancelled (left
    out). None where fewer than 2 values."""
    def se(values: list[float]) -> Optional[float]:
        return statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else None

    gains = [a - b for b, a in zip(before, after) if a is not None and b is not None]
    return {"val_reward_before_se": se([x for x in before if x is not None]),
            "val_reward_after_se": se([x for x in after if x is not None]), "val_reward_gain_se": se(gains)}


def _ood_json(before: Optional[tuple], after: Optional[tuple]) -> dict:
    """summary.json's ``val_ood_before``/``_after`` (means) and ``val_ood_slices_before``/``_after`` (None: not run)."""
    return {f"val_ood{part}_{when}": (result[i] if result is not None else None)
            for part, i in (("", 0), ("_slices", 1)) for when, result in (("before", before), ("after", after))}


def _evaluate_val(algo: Any, slice_by: Optional[Slicer], when: str) -> tuple[float, Any, list[Optional[float]]]:
    """Held-out reward (greedy) on the val tasks, printed, per ``slice_by`` slice too; ``(mean, SliceReport or None,
    each task's reward)``."""
    report = algo.evaluate(by=slice_by) if slice_by else None
    mean = report.mean if report is not None else algo.evaluate()
    print(f"[demo] val reward {when}: {mean:.3f}", flush=True)
    if report is not None:
        print(f"[demo] {when}, {report}", flush=True)
    return mean, report, list(algo.last_eval_rewards)


def _train(algo: Any, steps: int, checkpoint_every: int, checkpoint: Path,
           after_step: Optional[Callable[[Any, dict], None]] = None) -> None:
    """Run ``algo.step()`` until the run is at ``steps``, with a tqdm bar (reward, loss, and KL on the steps that
    measured it: with ``--kl-coef`` > 0), the held-out reward of the steps that evaluated it, and a checkpoint every
    ``checkpoint_every`` steps (0: none) before the last; ``after_step(algo, row)`` after each step (None: nothing)."""
    from tqdm.auto import tqdm

    bar = tqdm(total=steps, initial=algo.global_step, desc="training", unit="step", file=sys.stdout, mininterval=0)
    while algo.global_step < steps:
        row = algo.step(progress=False)  # this bar counts the steps
        bar.update(1)
        if after_step is not None:
            after_step(algo, row)
        shown = {"reward": f"{row['reward_mean']:.2f}", "loss": f"{row['loss']:.3f}"}
        if not math.isnan(row.get("kl", math.nan)):  # measured (kl_coef > 0); NaN otherwise
            shown["kl"] = f"{row['kl']:.4f}"
        bar.set_postfix(**shown)
        if "val_reward" in row:
            per = "".join(f", {k.split('/', 1)[1]} {v:.3f}" for k, v in row.items() if k.startswith("val_reward/"))
            bar.write(f"[demo] step {row['step']}: val reward {row['val_reward']:.3f}{per}")
        if checkpoint_every and algo.global_step % checkpoint_every == 0 and algo.global_step < steps:
            algo.save(checkpoint)
            bar.write(f"[demo] step {algo.global_step}: checkpoint {checkpoint}")
    bar.close()


def _evaluate_after_training(algo: Any, steps: int,
                             slice_by: Optional[Slicer]) -> tuple[float, Any, list[Optional[float]]]:
    """Held-out reward after training, printed: the last step's when ``val_every`` evaluated it, else evaluated now
    and added to the last metrics row (with its slices). ``(mean, SliceReport or None, each task's reward)``."""
    after_report = None
    if algo.metrics and "val_reward" in algo.metrics[-1]:
        after = algo.metrics[-1]["val_reward"]  # val_every already evaluated the last step
        after_report = algo.last_report if slice_by else None
    elif slice_by:
        after_report = algo.evaluate(by=slice_by)
        after = after_report.mean
        algo.add_metrics(algo.global_step, val_reward=after, **after_report.metrics())
    else:
        after = algo.evaluate()
        algo.add_metrics(algo.global_step, val_reward=after)
    print(f"[demo] val reward after {steps} steps: {after:.3f}", flush=True)
    if after_report is not None:
        print(f"[demo] after training, {after_report}", flush=True)
    return after, after_report, list(algo.last_eval_rewards)


def _save_final(algo: Any, checkpoint: Path) -> None:
    """Save the final checkpoint and print its size and the command that evaluates it."""
    written = algo.save(checkpoint)  # the file, or VerlTrainer's global_step_N folder
    file = written / "trainer.pt" if written.is_dir() else written
    print(f"[demo] final checkpoint {written} ({file.stat().st_size / 1e9:.2f} GB; "
          f"evaluate it with: python -m lightning_nb eval --checkpoint {file})", flush=True)


def _write_metrics(algo: Any, out: Path, before: float, after: float, before_report: Any,
                   ood_before: Optional[tuple[float, Optional[dict]]], title: str = "calc agent") -> Any:
    """Write ``out/metrics.csv`` (main columns first) and ``out/reward_curve.png`` (titled ``title``); returns the
    metrics DataFrame."""
    df = algo.metrics_df()
    cols = ["step", "reward_mean", "val_reward", "loss", "kl", "step_seconds"]
    df = df.reindex(columns=cols + [c for c in df.columns if c not in cols])
    df.to_csv(out / "metrics.csv", index=False)
    _plot(out / "metrics.csv", out / "reward_curve.png", before, after,
          {k: v[0] for k, v in before_report.slices.items()} if before_report is not None else None,
          ood_before=ood_before[0] if ood_before is not None else None, title=title)
    return df


def _task_settings(settings: DemoSettings) -> tuple[DemoSettings, Any]:
    """``settings`` with its task set loaded, and that task set. For a task set other than calc, calc's defaults
    (``slice_by="ops"``, ``slice_weights`` :data:`DEMO_SLICE_WEIGHTS`, ``all_numbers_bonus``
    :data:`DEMO_ALL_NUMBERS_BONUS`, ``ood_size`` None) become the task set's own (its ``slice_by``, uniform, 0, 0).

    Raises:
        ConfigError: for a task set other than calc, a shaping bonus, val_ood tasks or slice weights other than
            calc's defaults (they are calc's).
    """
    from lightning_nb.errors import ConfigError
    from lightning_nb.tasks import load_task

    task = settings.task if isinstance(settings.task, TaskSet) else load_task(settings.task)
    if isinstance(task, CalcTaskSet):
        return settings, task
    s = dataclasses.replace(settings, task=task)
    if s.slice_by == "ops" and s.slice_weights == DEMO_SLICE_WEIGHTS and s.all_numbers_bonus == DEMO_ALL_NUMBERS_BONUS:
        s = dataclasses.replace(s, slice_by=task.slice_by, slice_weights=None, all_numbers_bonus=0.0)
    if s.ood_size is None:
        s = dataclasses.replace(s, ood_size=0)
    for name, value in (("all_numbers_bonus", s.all_numbers_bonus), ("ood_size", s.ood_size)):
        if value:
            raise ConfigError(f"DemoSettings.{name}={value!r} is the calc task's (its shaping term, its val_ood "
                              f"split); task {task.name!r} has none: set it to 0")
    return s, task


def _print_outcome(out: Path, summary: dict) -> None:
    """The demo's last lines: the files written, and whether the held-out reward rose."""
    before, after = summary["val_reward_before"], summary["val_reward_after"]
    ood_before, ood_after = summary["val_ood_before"], summary["val_ood_after"]
    print(f"[demo] wrote {out / 'metrics.csv'}, {out / 'reward_curve.png'}, {out / 'summary.json'}")
    ood = (f"; val_ood (other wordings and numbers) {ood_before:.3f} -> {ood_after:.3f}"
           if ood_before is not None and ood_after is not None else "")
    gain_se = summary.get("val_reward_gain_se")
    spread = (f", a gain of {after - before:+.3f} ± {gain_se:.3f} (s.e., paired over {summary['val_size']} tasks)"
              if gain_se is not None else "")
    print(f"[demo] held-out reward: before {before:.3f} -> after {after:.3f} "
          f"({'rose' if after > before else 'did NOT rise'}{spread}){ood} in {summary['minutes']:.1f} min")


def _evaluate_ood(algo: Any, tasks: list, slice_by: Optional[Slicer], who: str,
                  when: str) -> Optional[tuple[float, Optional[dict]]]:
    """Evaluate the ``val_ood`` tasks (none: None) and print the result; ``(mean, slices as JSON or None)``."""
    if not tasks:
        return None
    report = algo.evaluate(tasks, by=slice_by) if slice_by else None
    mean = report.mean if report is not None else algo.evaluate(tasks)
    print(f"[{who}] val_ood reward {when} ({len(tasks)} tasks with other wordings and numbers): {mean:.3f}",
          flush=True)
    if report is not None:
        print(f"[{who}] val_ood {when}, {report}", flush=True)
    return mean, _slices_json(report) if report is not None else None


def run_eval(val_size: int, *, checkpoint: Optional[Path] = None, runners: int = 16, max_tokens: int = 32,
             engine: str = "vllm", slice_by: Optional[str] = "task", ood_size: Optional[int] = None,
             device: str = "cpu", dtype: str = "float32", task: Any = "calc") -> float:
    """Held-out reward (greedy) of the default model, or of a trainer checkpoint; also printed per ``slice_by``
    slice (a task field; ``"task"``, the default: the task set's own, ``"ops"`` for calc; None: off), and on the
    first ``ood_size`` ``val_ood`` tasks (None: as
    many as ``val_size``; 0: off). The model runs on ``device`` in ``dtype`` (a float32 checkpoint is cast).
    Returns the overall mean on the held-out tasks.

    ``task``: ``"calc"`` (the default: its ``val`` file), or another task set's name or
    :class:`~lightning_nb.tasks.TaskSet` (docs/tasks.md): its agent on the tasks of its first ``val_size``
    held-out seeds. ``ood_size`` is calc's (None and 0 are the same for another task set).

    Raises:
        ConfigError: ``device`` is not available here; the task name does not exist; ``ood_size`` > 0 for a task
            set other than calc.
    """
    from lightning_nb import AlgorithmConfig, GRPOConfig, GRPOTrainer, LightningRL
    from lightning_nb.errors import ConfigError
    from lightning_nb.tasks import CalcTaskSet, TaskSet, load_task

    task = task if isinstance(task, TaskSet) else load_task(task)
    calc = isinstance(task, CalcTaskSet)
    if slice_by == "task":
        slice_by = task.slice_by if isinstance(task.slice_by, str) else None
    if not calc and ood_size:
        raise ConfigError(f"ood_size={ood_size} is the calc task's val_ood split; task {task.name!r} has none: set it "
                          "to 0")
    with _serving(runners, engine, device=device, dtype=dtype, agent=None if calc else task.agent) as (engine, store):
        trainer = GRPOTrainer(engine, GRPOConfig(track_reference_kl=False, device=device, dtype=dtype,
                                                 **_lora_fields(checkpoint)))
        val = task.heldout_tasks(val_size)
        algo = LightningRL(store, trainer, val, val, AlgorithmConfig(max_tokens=max_tokens))
        if checkpoint is not None:
            algo.load(checkpoint)
        report = algo.evaluate(by=slice_by) if slice_by else None
        reward = report.mean if report is not None else algo.evaluate()
        what = "val tasks" if calc else f"held-out tasks of {task.name} (seeds {task.seeds('held-out', len(val))})"
        se = _held_out_spread([], algo.last_eval_rewards)["val_reward_after_se"]
        print(f"[eval] held-out reward on {len(val)} {what} (greedy, step {algo.global_step}): {reward:.3f}"
              + (f" ± {se:.3f} (s.e.)" if se is not None else ""))
        if report is not None:
            print(f"[eval] {report}")
        ood_size = (val_size if ood_size is None else ood_size) if calc else 0
        _evaluate_ood(algo, task.ood_tasks(ood_size) if ood_size > 0 else [], slice_by, "eval",
                      f"(greedy, step {algo.global_step})")
    return reward


def _lora_fields(checkpoint: Optional[Path]) -> dict:
    """The LoRA fields of a checkpoint's GRPOConfig (empty for none, or a full fine-tuning one), read memory-mapped."""
    if checkpoint is None or not checkpoint.is_file():
        return {}
    import torch

    try:
        config = torch.load(checkpoint, map_location="cpu", weights_only=True, mmap=True).get("config") or {}
    except Exception:  # not a checkpoint: algo.load() says so with the fix
        return {}
    return {k: config[k] for k in ("lora_rank", "lora_alpha", "lora_target_modules") if k in config}
