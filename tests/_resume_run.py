"""One deterministic training run in its own process, for tests/test_resume.py and tests/test_verl_trainer.py.

    python tests/_resume_run.py OUT.json --steps 4 [--save-at 2 --checkpoint C.pt] [--load C.pt] [--pauses]
    python tests/_resume_run.py OUT.json --trainer verl --steps 2 --save-at 1 --checkpoint DIR --background-pause
    python tests/_resume_run.py OUT.json --trainer verl --steps 2 --load DIR

The calculator agent on SmolLM2-135M behind the LLM proxy, with one runner thread, so the engine
decodes one request at a time and the torch RNG stream that sampling draws from is consumed in a
fixed order. ``--trainer verl`` trains with VerlTrainer (checkpoints are folders in verl's layout).
With ``--background-pause`` the steps after ``--save-at`` run in the background (``algo.start``),
paused at once: the loop parks at the first step boundary it reaches inside the next step, the run is
inspected there (metrics, the last batch, a greedy chat with the model) and resumed. With ``--pauses``
and ``--checkpoint``, the checkpoint is saved while paused inside step ``--save-at`` + 1, after its
rollouts were collected and before its update (as a notebook's Pause then Save does). Writes the
metrics row of every step it ran, what the pauses showed, timings and a SHA-256 of the final weights.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import sys
import threading
import time

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def weights_sha256(model) -> str:
    h = hashlib.sha256()
    for name, p in model.state_dict().items():
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _pauser(algo, engine, log: list, store, checkpoint=None, save_at: int = 0, per_step: int = 0) -> None:
    """Pause at a few points of the run, chat greedily while paused, then resume.

    With ``checkpoint``: the timed pauses stop once step ``save_at`` is done; then the run is paused while
    step ``save_at`` + 1 collects (its ``per_step`` rollouts enqueued), so it parks before that step's
    update, and the checkpoint is saved there.
    """
    for delay in (0.5, 1.5, 1.5, 3.0):
        time.sleep(delay)
        if not algo.running or (checkpoint and algo.global_step >= save_at):
            break
        if algo.pause(timeout=300) and algo.paused_at:  # not when the run ended before it parked
            log.append({"step": algo.global_step, "at": algo.paused_at,
                        "chat": engine.chat("What is 2 + 2?", max_tokens=6)})
            time.sleep(0.5)
        algo.resume()
    if not checkpoint:
        return
    while algo.running and not (algo.global_step == save_at and len(store.query_rollouts()) > per_step * save_at):
        time.sleep(0.005)
    if algo.pause(timeout=300) and algo.paused_at:
        algo.save(checkpoint)
        log.append({"step": algo.global_step, "at": algo.paused_at, "saved": True,
                    "chat": engine.chat("What is 2 + 2?", max_tokens=6)})
    algo.resume()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, required=True, help="train until algo.global_step == steps")
    parser.add_argument("--save-at", type=int, default=0)
    parser.add_argument("--checkpoint", default=None)
    parser.add_argument("--load", default=None)
    parser.add_argument("--pauses", action="store_true", help="run in the background and pause/resume it")
    parser.add_argument("--background-pause", action="store_true",
                        help="run the steps after --save-at in the background, pausing once inside the first")
    parser.add_argument("--trainer", choices=["grpo", "verl"], default="grpo")
    args = parser.parse_args()

    import numpy
    import torch

    from lightning_nb import (AlgorithmConfig, GRPOConfig, GRPOTrainer, InMemoryStore, LightningRL, LLMProxy,
                              TransformersEngine, VerlConfig, VerlTrainer, start_runners)
    from lightning_nb.tasks.calc import calc_agent, load_tasks

    t_start = time.perf_counter()
    torch.manual_seed(1234)
    random.seed(1234)  # all three RNG states a checkpoint holds start the same in every run (the Python and
    numpy.random.seed(1234)  # numpy ones are seeded from the OS otherwise), so checkpoints compare entry for entry
    engine = TransformersEngine.from_default(max_batch_size=8)
    store = InMemoryStore()
    proxy = LLMProxy(engine, store).start()
    store.add_resources({"main_llm": proxy.as_resource()})
    runners = start_runners(calc_agent, store, n=1)
    trainer_cls, config_cls = (VerlTrainer, VerlConfig) if args.trainer == "verl" else (GRPOTrainer, GRPOConfig)
    trainer = trainer_cls(engine, config_cls(learning_rate=5e-5, micro_batch_size=2))
    # seed 3: step 2 (the step after the checkpoint, the one the resume tests compare) has rewards that differ
    # within a group, so it makes a real update with both trainers (measured: GRPO 114 tokens trained, verl
    # grad_norm 3.0); with seed 7 and groups of 3 it had reward 0 everywhere and no policy gradient
    algo = LightningRL(store, trainer, load_tasks("train"), config=AlgorithmConfig(
        tasks_per_step=2, group_size=2, max_tokens=16, temperature=1.0, max_sample_rounds=1, seed=3))
    if args.load:
        algo.load(args.load)
    first = algo.global_step
    pauses: list = []
    step_seconds: list[float] = []
    try:
        if args.background_pause:
            while algo.global_step < args.save_at:
                algo.step()
            if args.checkpoint:
                algo.save(args.checkpoint)
            t0 = time.perf_counter()
            algo.start(steps=args.steps - algo.global_step)
            parked = algo.pause(timeout=600)  # at the first boundary the loop reaches
            batch = trainer.last_batch_df()
            pauses.append({"parked": parked, "step": algo.global_step, "at": algo.paused_at,
                           "metrics_rows": len(algo.metrics_df()), "batch_rows": len(batch),
                           "batch_columns": list(batch.columns), "chat": engine.chat("What is 2 + 2?", max_tokens=6)})
            algo.resume()
            algo.wait(timeout=900)
            step_seconds.append(time.perf_counter() - t0)
        elif args.pauses:
            pauser = threading.Thread(target=_pauser, args=(algo, engine, pauses, store, args.checkpoint,
                                                             args.save_at, 2 * 2), daemon=True)  # tasks x group
            algo.start(steps=args.steps - algo.global_step)
            pauser.start()
            algo.wait(timeout=900)
        else:
            while algo.global_step < args.steps:
                algo.step()
                if args.checkpoint and algo.global_step == args.save_at:
                    algo.save(args.checkpoint)
    finally:
        runners.stop()
        proxy.stop()
    keys = ("step", "trainer", "loss", "pg_loss", "grad_norm", "reward_mean", "tokens_trained", "kl", "ppo_kl",
            "actor/pg_clipfrac", "optimizer_steps", "sequences_trained")
    rows = [{k: (None if isinstance(m.get(k), float) and math.isnan(m[k]) else m.get(k)) for k in keys}
            for m in algo.metrics if m["step"] > first]
    with open(args.out, "w") as f:
        json.dump({"rows": rows, "weights": weights_sha256(engine.model), "pauses": pauses,
                   "val_history": algo.val_history, "weight_version": engine.weight_version,
                   "step_seconds": step_seconds, "seconds": time.perf_counter() - t_start}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
