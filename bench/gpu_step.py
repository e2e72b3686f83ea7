"""A demo training step on the GPU, by phase, each against its limit measured in the same run (issue 42, item 1).

Runs ``--steps`` (3) steps of the demo's run (the calc agent on SmolLM2-135M, the demo's CUDA sizes: 16 tasks x 8
rollouts, 64 runner threads, bf16, gradient checkpointing; either trainer, either engine) and prints per step::

    python bench/gpu_step.py                                    # CUDA, GRPOTrainer, TransformersEngine
    python bench/gpu_step.py --trainer verl --out runs/gpu_step # VerlTrainer; JSON lines under runs/gpu_step
    python bench/gpu_step.py --engine vllm                      # VLLMEngine(device="cuda") where vLLM imports
    python bench/gpu_step.py --batching continuous --cb-options '{"use_cuda_graph": true}'  # continuous batching
    python bench/gpu_step.py --device cpu --steps 1 --tasks-per-step 2 --group-size 2 --runners 4  # smoke run

Phases (seconds; timed by wrapping the parts in this process, nothing in the library changes):

* ``rollout``: the step's collect wall time (``rollout_seconds``: enqueue, the runners, the proxy, the engine);
  ``decode``: the seconds the in-process engine spent decoding batches within it, its tokens/s and its batch
  occupancy (rows per batch / ``max_batch_size``; ``fill``: tokens kept / rows x the batch's longest row);
  ``not_decoding`` = rollout - decode: the proxy, runners, agent code and batch gathering.
* ``adapt``: the adapter turning spans into triplets. ``logprobs``: the no-grad forwards of the update (π_old and
  π_ref: ``GRPOTrainer._score_at_start`` / ``_reference_logprobs``; verl's ``compute_log_prob``).
  ``update``: the trainer's whole update (``update_seconds``, the log-probs included). ``weight_sync``:
  ``engine.load_weights``. ``evaluate``: one greedy pass over ``--val-size`` held-out tasks after the steps.

Limits, measured after the steps on the same card and model:

* generation: the last step's prompts as one static batch through ``model.generate`` (transformers' plain path;
  vLLM standalone is not measured here), the step's ``max_tokens``, temperature 1: tokens/s, and the rollout
  phase's ratio = rollout seconds / (the step's completion tokens / that rate).
* update: the plain forward+backward+AdamW of ``bench/gpu_update.py`` on the last step's triplets of the groups
  the update learned from (the others are not forwarded; the better of micro-batches of 16 and 64 rows): the update's ratio = update seconds / (the tokens / that rate).

Each result is printed (flushed) and appended to ``OUT/gpu_step.jsonl`` as soon as it exists.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_generate import static_call  # noqa: E402  (bench/ is not a package)
from gpu_update import plain_pass, timed  # noqa: E402


class Phases:
    """Seconds (and counts) accumulated per phase by wrapped callables, reset per step."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.seconds: dict[str, float] = {}
        self.batches: list[tuple[int, int, int]] = []  # (rows, tokens kept, rows x longest row)

    def reset(self) -> None:
        self.seconds, self.batches = {}, []

    def wrap(self, obj: Any, name: str, phase: str, sync: bool = False,
             after: Optional[Callable[[Any, tuple], None]] = None) -> None:
        """Replace ``obj.name`` by a wrapper that adds its wall seconds to ``phase`` (CUDA-synchronized if asked)."""
        inner = getattr(obj, name)

        @functools.wraps(inner)
        def clocked(*args: Any, **kwargs: Any) -> Any:
            if sync and self.cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = inner(*args, **kwargs)
            if sync and self.cuda:
                torch.cuda.synchronize()
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - t0
            if after is not None:
                after(out, args)
            return out

        setattr(obj, name, clocked)

    def on_batch(self, generations: Any, args: tuple) -> None:
        """After ``TransformersEngine._run_batch``: rows, tokens kept, rows x the longest row."""
        lengths = [len(g.completion_ids) for g in generations]
        self.batches.append((len(lengths), sum(lengths), len(lengths) * max(lengths, default=0)))


def emit(out: Optional[Path], record: dict[str, Any]) -> None:
    """Print ``record`` as one line and append it to ``out/gpu_step.jsonl``."""
    print(json.dumps(record, default=float), flush=True)
    if out is not None:
        with open(out / "gpu_step.jsonl", "a") as f:
            f.write(json.dumps(record, default=float) + "\n")


def build(args: argparse.Namespace, engine: Any, store: Any) -> tuple[Any, Any]:
    """The demo's trainer and LightningRL on ``engine`` and ``store`` (the demo's CUDA defaults unless set)."""
    from lightning_nb import AlgorithmConfig, GRPOConfig, GRPOTrainer, LightningRL, VerlConfig, VerlTrainer
    from lightning_nb.cli.demo import DEMO_SLICE_WEIGHTS
    from lightning_nb.tasks.calc import load_tasks

    trainer_cls, config_cls = (VerlTrainer, VerlConfig) if args.trainer == "verl" else (GRPOTrainer, GRPOConfig)
    trainer = trainer_cls(engine, config_cls(learning_rate=2e-5, device=args.device, dtype=args.dtype,
                                             gradient_checkpointing=args.device != "cpu", kl_coef=0.0))
    config = AlgorithmConfig(steps=args.steps, tasks_per_step=args.tasks_per_step, group_size=args.group_size,
                             seed=0, temperature=0.7, max_tokens=32, dynamic_sampling=True, max_sample_rounds=3,
                             slice_weights=dict(DEMO_SLICE_WEIGHTS))
    algo = LightningRL(store, trainer, load_tasks("train"), load_tasks("val", limit=args.val_size), config,
                       slice_by="ops")
    return trainer, algo


def instrument(phases: Phases, engine: Any, trainer: Any, algo: Any) -> None:
    """Wrap the parts whose seconds each phase sums."""
    if hasattr(engine, "_run_batch"):  # TransformersEngine
        phases.wrap(engine, "_run_batch", "decode", after=phases.on_batch)
    phases.wrap(engine, "load_weights", "weight_sync", sync=True)
    phases.wrap(algo.adapter, "adapt", "adapt")
    if hasattr(trainer, "actor"):  # VerlTrainer: verl's no-grad forwards
        phases.wrap(trainer.actor, "compute_log_prob", "logprobs", sync=True)
        if trainer.reference_actor is not None:
            phases.wrap(trainer.reference_actor, "compute_log_prob", "logprobs", sync=True)
    else:
        phases.wrap(trainer, "_score_at_start", "logprobs", sync=True)
        phases.wrap(trainer, "_reference_logprobs", "logprobs", sync=True)


def step_record(k: int, row: dict[str, Any], phases: Phases, engine: Any) -> dict[str, Any]:
    """One step's phases from its metrics row and the wrapped timers."""
    s = phases.seconds
    rows, kept, capacity = (sum(b[i] for b in phases.batches) for i in range(3))
    decode = s.get("decode", float("nan"))
    return {
        "step": k, "step_s": row["step_seconds"], "rollout_s": row["rollout_seconds"], "decode_s": decode,
        "not_decoding_s": row["rollout_seconds"] - decode if phases.batches else float("nan"),
        "engine_tok_s": kept / decode if phases.batches and decode > 0 else float("nan"),
        "batches": len(phases.batches), "occupancy": rows / len(phases.batches) / engine.max_batch_size
        if phases.batches and hasattr(engine, "max_batch_size") else float("nan"),
        "fill": kept / capacity if capacity else float("nan"),
        "adapt_s": s.get("adapt", 0.0), "logprobs_s": s.get("logprobs", 0.0), "update_s": row["update_seconds"],
        "weight_sync_s": s.get("weight_sync", 0.0), "rollouts": row["rollouts"],
        "tokens_trained": row.get("tokens_trained"), "reward_mean": row["reward_mean"],
        "logprob_diff_max": row.get("logprob_diff_max"), "tis_weight_mean": row.get("tis_weight_mean"),
        "micro_batch_tokens": row.get("micro_batch_tokens"),
    }


def generation_limit(engine: Any, prompts: list[list[int]], max_tokens: int, device: str) -> dict[str, Any]:
    """tokens/s of ``prompts`` as one static left-padded batch through ``model.generate`` (gpu_generate's
    ``static_call``: after a warm-up call)."""
    static_call(engine, prompts, device, max_tokens)
    tokens, seconds = static_call(engine, prompts, device, max_tokens)
    return {"limit": "generation", "rows": len(prompts), "tokens": tokens, "seconds": seconds,
            "tok_s": tokens / seconds}


def update_limit(engine: Any, triplets: list[Any], cuda: bool) -> dict[str, Any]:
    """tokens/s of the plain forward+backward+AdamW on ``triplets`` at its better micro-batch (16 or 64 rows)."""
    model = engine.model
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-9)
    tokens = sum(len(t.prompt_ids) + len(t.response_ids) for t in triplets)
    best: dict[str, Any] = {}
    for rows in (16, 64):
        seconds, _ = timed(functools.partial(plain_pass, model, optimizer, triplets, rows, engine.pad_token_id), 1,
                           cuda)
        rate = tokens / seconds
        if rate > best.get("tok_s", 0):
            best = {"limit": "update", "rows": rows, "tokens": tokens, "tok_s": rate}
    model.eval()
    del optimizer
    return best


def summarize(records: list[dict[str, Any]], gen: dict[str, Any], upd: dict[str, Any],
              out: Optional[Path]) -> None:
    """Each step's rollout and update against the limits; a table."""
    print(f"{'step':>4} {'step s':>7} {'rollout':>8} {'decode':>7} {'eng tok/s':>9} {'occ':>5} {'adapt':>6} "
          f"{'logprob':>7} {'update':>7} {'sync':>6} {'gen x':>6} {'upd x':>6}", flush=True)
    for r in records:
        gen_s = r["completion_tokens"] / gen["tok_s"] if gen else float("nan")
        upd_s = r["trained_tokens_all"] / upd["tok_s"] if upd else float("nan")
        r["rollout_vs_limit"], r["update_vs_limit"] = r["rollout_s"] / gen_s, r["update_s"] / upd_s
        print(f"{r['step']:>4} {r['step_s']:7.1f} {r['rollout_s']:8.1f} {r['decode_s']:7.1f} "
              f"{r['engine_tok_s']:9.0f} {r['occupancy']:5.2f} {r['adapt_s']:6.2f} {r['logprobs_s']:7.2f} "
              f"{r['update_s']:7.2f} {r['weight_sync_s']:6.3f} {r['rollout_vs_limit']:6.1f} "
              f"{r['update_vs_limit']:6.1f}", flush=True)
        emit(out, {"summary_step": r["step"], "rollout_vs_limit": r["rollout_vs_limit"],
                   "update_vs_limit": r["update_vs_limit"]})
    print("gen x / upd x: the phase's seconds over its limit's seconds for the same tokens (1.0 = at the limit)")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default=None, help="bfloat16 (CUDA default) or float32 (CPU default)")
    p.add_argument("--trainer", choices=["grpo", "verl"], default="grpo")
    p.add_argument("--engine", choices=["transformers", "vllm"], default="transformers")
    p.add_argument("--batching", choices=["static", "continuous"], default="static",
                   help="the TransformersEngine's batching (continuous: transformers' continuous batching)")
    p.add_argument("--cb-options", type=json.loads, default=None,
                   help='JSON ContinuousBatchingConfig fields for --batching continuous, e.g. \'{"use_cuda_graph": true}\'')
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--tasks-per-step", type=int, default=16)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--runners", type=int, default=64)
    p.add_argument("--val-size", type=int, default=32)
    p.add_argument("--out", type=Path, default=None, help="a folder for gpu_step.jsonl")
    p.add_argument("--profile", action="store_true", help="profile the last step (torch.profiler; OUT/profile.txt)")
    return p.parse_args(argv)


def profiled(fn: Callable[[], Any], out: Optional[Path]) -> Any:
    """``fn()`` under ``torch.profiler`` (CPU and CUDA): the 25 ops with the most self CPU time and the 25 with the
    most self CUDA time, printed and written to ``out/profile.txt``."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        result = fn()
    avg = prof.key_averages()
    text = avg.table(sort_by="self_cpu_time_total", row_limit=25)
    if torch.cuda.is_available():
        text += "\n" + avg.table(sort_by="self_cuda_time_total", row_limit=25)
    print(text, flush=True)
    if out is not None:
        (out / "profile.txt").write_text(text)
    return result


def trained_triplets(trainer: Any, triplets: list[Any]) -> list[Any]:
    """The triplets of the groups the update learned from (the others are not forwarded)."""
    signal = trainer.signal_groups(triplets)
    return [t for t in triplets if t.group_id in signal]


def run_steps(args: argparse.Namespace, engine: Any, store: Any, phases: Phases) -> tuple[list, Any, Any]:
    """The steps, each recorded as it ends; returns (records, trainer, algo)."""
    trainer, algo = build(args, engine, store)
    instrument(phases, engine, trainer, algo)
    records = []
    for k in range(1, args.steps + 1):
        phases.reset()
        one = functools.partial(algo.step, progress=False)
        row = profiled(one, args.out) if args.profile and k == args.steps else one()
        rec = step_record(k, row, phases, engine)
        last = list(getattr(trainer, "last_triplets", []) or [])
        trained = trained_triplets(trainer, last)
        rec["completion_tokens"] = sum(len(t.response_ids) for t in last)
        rec["trained_tokens_all"] = sum(len(t.prompt_ids) + len(t.response_ids) for t in trained)
        records.append(rec)
        emit(args.out, {"trainer": args.trainer, "engine": args.engine, **rec})
    return records, trainer, algo


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.engine != "transformers" and (args.batching != "static" or args.cb_options is not None):
        print("--batching and --cb-options are TransformersEngine's: pass --engine transformers, or drop them")
        return 2
    if args.cb_options is not None and args.batching != "continuous":
        print("--cb-options configures continuous batching: add --batching continuous, or drop it")
        return 2
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        print(f"bench/gpu_step.py needs a CUDA GPU: torch {torch.__version__} sees none; --device cpu for a smoke run")
        return 2
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    from lightning_nb.cli.demo import _serving

    torch.manual_seed(0)
    phases = Phases(cuda)
    t0 = time.perf_counter()
    options = None
    if args.engine == "transformers" and args.batching == "continuous":
        options = {"batching": "continuous", "continuous_options": args.cb_options}
    with _serving(args.runners, args.engine, 0.0, device=args.device, dtype=args.dtype,
                  engine_options=options) as (engine, store):
        emit(args.out, {"setup_s": time.perf_counter() - t0, "device": torch.cuda.get_device_name() if cuda else
                        "cpu", "trainer": args.trainer, "engine": args.engine})
        records, trainer, algo = run_steps(args, engine, store, phases)
        t1 = time.perf_counter()
        val = algo.evaluate(progress=False)
        emit(args.out, {"evaluate_s": time.perf_counter() - t1, "val_reward": val, "val_size": args.val_size})
        last = list(trainer.last_triplets)
        gen: dict[str, Any] = {}
        in_process = hasattr(engine, "_run_batch")  # TransformersEngine: its module is the trainer's
        if in_process:
            gen = generation_limit(engine, [t.prompt_ids for t in last], 32, args.device)
            emit(args.out, gen)
        # VLLMEngine serves a copy elsewhere: the plain loop runs on the trainer's in-process model
        owner = engine if in_process else SimpleNamespace(model=trainer.model, pad_token_id=engine.pad_token_id)
        upd = update_limit(owner, trained_triplets(trainer, last), cuda)
        emit(args.out, upd)
        summarize(records, gen, upd, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
