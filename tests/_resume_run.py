"""One deterministic training run in its own process, for tests/test_resume.py.

    python tests/_resume_run.py OUT.json --steps 4 [--save-at 2 --checkpoint C.pt] [--load C.pt] [--pauses]

One runner thread, so the engine decodes one request at a time and the torch RNG
stream that sampling draws from is consumed in a fixed order. Writes the metrics
row of every step it ran and a SHA-256 of the final weights.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
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


def _pauser(trainer, engine, log: list) -> None:
    """Pause at a few points of the run, chat greedily while paused, then resume."""
    for delay in (0.5, 1.5, 1.5, 3.0):
        time.sleep(delay)
        if not trainer.running:
            return
        if trainer.pause(timeout=300):
            log.append({"step": trainer.step, "at": trainer.paused_at,
                        "chat": engine.chat("What is 2 + 2?", max_tokens=6)})
            time.sleep(0.5)
        trainer.resume()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, required=True, help="train until trainer.step == steps")
    parser.add_argument("--save-at", type=int, default=0)
    parser.add_argument("--checkpoint", default=None)
    parser.add_argument("--load", default=None)
    parser.add_argument("--pauses", action="store_true", help="run in the background and pause/resume it")
    args = parser.parse_args()

    import torch

    from lightning_nb import (AlgorithmConfig, GRPOConfig, GRPOTrainer, InMemoryStore, LightningRL, LLMProxy,
                              TransformersEngine, start_runners)
    from lightning_nb.calc import calc_agent, load_tasks

    torch.manual_seed(1234)
    engine = TransformersEngine.from_default(max_batch_size=8)
    store = InMemoryStore()
    proxy = LLMProxy(engine, store).start()
    store.add_resources({"main_llm": proxy.as_resource()})
    runners = start_runners(calc_agent, store, n=1)
    trainer = GRPOTrainer(engine, GRPOConfig(learning_rate=5e-5, micro_batch_size=2))
    algo = LightningRL(store, trainer, load_tasks("train"), config=AlgorithmConfig(
        tasks_per_step=2, group_size=3, max_tokens=16, temperature=1.0, max_sample_rounds=1, seed=7))
    if args.load:
        trainer.load(args.load)
    first = trainer.step
    pauses: list = []
    try:
        if args.pauses:
            pauser = threading.Thread(target=_pauser, args=(trainer, engine, pauses), daemon=True)
            trainer.start(algo, steps=args.steps - trainer.step)
            pauser.start()
            trainer.wait(timeout=900)
        else:
            while trainer.step < args.steps:
                algo.step()
                if args.checkpoint and trainer.step == args.save_at:
                    trainer.save(args.checkpoint)
    finally:
        runners.stop()
        proxy.stop()
    keys = ("step", "loss", "pg_loss", "grad_norm", "reward_mean", "tokens_trained", "kl")
    rows = [{k: (None if isinstance(m.get(k), float) and math.isnan(m[k]) else m.get(k)) for k in keys}
            for m in trainer.metrics if m["step"] > first]
    with open(args.out, "w") as f:
        json.dump({"rows": rows, "weights": weights_sha256(engine.model), "pauses": pauses,
                   "val_history": algo.val_history, "weight_version": engine.weight_version}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
