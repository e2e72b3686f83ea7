"""Learning from labelled traffic on the calc task: held-out reward before and after a few TrafficLearner updates.

"Users" send calc questions through ``Runner.step(task, reward_required=False)`` (an agent that answers and
computes no reward); a stand-in "human" reads each reply (the last LLM call's completion in the store) and
labels it with ``calc_reward`` through ``store.label``, leaving a share unlabelled; :class:`TrafficLearner`
updates on the labelled ones. Each round's traffic mixes repeated questions (GRPO groups) and questions asked
once (trained against the running baseline). The held-out reward is LightningRL.evaluate's (greedy, val tasks).

    .venv/bin/python bench/traffic_learning.py --rounds 4 --val 64      # about 8-10 min on 2 cores

Prints one JSON line per round and a summary line.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import time
from concurrent.futures import ThreadPoolExecutor


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=4, help="traffic rounds, one update each")
    p.add_argument("--tasks", type=int, default=4, help="questions asked repeatedly per round")
    p.add_argument("--repeats", type=int, default=4, help="times each repeated question is asked")
    p.add_argument("--singletons", type=int, default=8, help="questions asked once per round")
    p.add_argument("--label-frac", type=float, default=0.75, help="share of replies the human labels")
    p.add_argument("--val", type=int, default=64, help="held-out val tasks")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    from lightning_nb import GRPOTrainer, InMemoryStore, LightningRL, LLMProxy, TransformersEngine, start_runners
    from lightning_nb import semconv
    from lightning_nb.algorithm.traffic import TrafficConfig, TrafficLearner
    from lightning_nb.runners import Runner
    from lightning_nb.tasks.calc import calc_agent, load_tasks
    from lightning_nb.tasks.calc.agent import calc_reward
    from lightning_nb.tracing import Tracer
    from lightning_nb.trainers.grpo import GRPOConfig

    t0 = time.time()
    rng = random.Random(args.seed)
    engine = TransformersEngine.from_default(max_batch_size=8)
    store = InMemoryStore()
    proxy = LLMProxy(engine, store).start()
    store.add_resources({"main_llm": proxy.as_resource(temperature=0.7, max_tokens=48)})
    runners = start_runners(calc_agent, store, n=8)  # for the evaluations (queued val rollouts)
    trainer = GRPOTrainer(engine, GRPOConfig(track_reference_kl=False))
    val = load_tasks("val", limit=args.val)
    evaluator = LightningRL(store, trainer, load_tasks("train"), val)
    before = evaluator.evaluate(progress=False)
    print(json.dumps({"phase": "before", "val_reward": before, "seconds": round(time.time() - t0, 1)}), flush=True)

    user_agent = functools.partial(calc_agent, reward_fn=lambda text, task: None)  # answers, knows no reward
    learner = TrafficLearner(store, trainer, TrafficConfig(min_labelled=8, max_batch=64, keep_checkpoints=1),
                             since=time.time())
    train = load_tasks("train")
    by_id = {}
    for rnd in range(1, args.rounds + 1):
        asked = rng.sample(train, args.tasks + args.singletons)
        tasks = [t for t in asked[:args.tasks] for _ in range(args.repeats)] + asked[args.tasks:]
        rng.shuffle(tasks)
        t1 = time.time()
        with ThreadPoolExecutor(8) as pool:
            ids = list(pool.map(lambda t: Runner(user_agent, store, Tracer(store)).step(
                t, reward_required=False).rollout_id, tasks))
        for rid, task in zip(ids, tasks):
            by_id[rid] = task
        ok = {r.rollout_id for r in store.query_rollouts(rollout_ids=ids) if r.status == "succeeded"}
        labelled = [rid for rid in ids if rid in ok and rng.random() < args.label_frac]  # failed ones score 0
        for rid in labelled:  # the "human": reads the last reply, checks it against the answer
            calls = [s for s in store.query_spans(rid, "latest") if s.name == semconv.LLM_SPAN]
            store.label(rid, calc_reward(str(calls[-1].attributes.get(semconv.COMPLETION, "")), by_id[rid]))
        traffic_s = time.time() - t1
        row = learner.step()
        print(json.dumps({"round": rnd, "sent": len(ids), "succeeded": len(ok), "labelled": len(labelled),
                          "label_mean": sum(store.final_rewards(labelled).values()) / max(1, len(labelled)),
                          "updated_on": row and row["n"], "baselined": row and row["baselined"],
                          "waiting_for": None if row else learner.last_poll.get("waiting_for"),
                          "traffic_seconds": round(traffic_s, 1),
                          "seconds": round(time.time() - t0, 1)}), flush=True)
    after = evaluator.evaluate(progress=False)
    df = learner.updates_df()
    print(json.dumps({"phase": "summary", "val_before": before, "val_after": after, "val_n": len(val),
                      "updates": len(df), "rollouts_trained": int(df["n"].sum()) if len(df) else 0,
                      "minutes": round((time.time() - t0) / 60, 2)}), flush=True)
    learner.close()
    runners.stop()
    proxy.stop()
    engine.close()


if __name__ == "__main__":
    main()
