"""How often SmolLM2-135M-Instruct finishes a gym episode through GEMRunner, and whether GRPO raises its reward.

Workload: the default engine (``TransformersEngine.from_default()``, CPU, float32) behind an LLMProxy, runner
threads calling a :class:`~lightning_nb.agents.GEMRunner` on one environment (default: gymnasium's FrozenLake-v1
through :class:`~lightning_nb.agents.TextEnv`, a 3x3 lake drawn from each seed, not slippery, at most
``--max-steps`` moves). It measures

1. before training: ``--episodes`` held-out episodes (seeds 1000..; temperature ``--eval-temperature``);
2. ``--steps`` GRPO steps of LightningRL on ``seed_tasks`` (seeds 0..; each group = ``--group-size`` episodes of
   one seed), printing each step's mean train reward, turn forks and seconds;
3. the same held-out episodes again.

Per evaluation it prints: episodes *finished* (the environment ended them itself: the goal or a hole, GEM's
``terminated``; the rest ran out of moves), episodes that reached the goal, the share of moves that named a valid
action (the rest scored -0.1), and the mean episode reward (sum of step rewards).

Measured with the defaults on the 2-core dev VM (CPU, other jobs beside it; 6 steps took 25 min), FrozenLake-v1
3x3, at most 4 moves of 16 tokens, 16 held-out episodes at temperature 1.0::

               finished  goal   valid moves  reward mean
    before     1/16      0/16    7/62        -0.344
    after      2/16      0/16   42/62        -0.125

    train reward_mean by step: -0.300 -0.344 -0.269 -0.300 -0.219 -0.231; turn_forks by step: 3 3 1 5 1 1

The reward rises because the model learns to name a valid move (the -0.1 per move without one); in 6 steps it
reaches no goal, and few episodes end on their own (a hole), most run out of moves. Turn forks (a later turn's
prompt not extending the previous prompt + reply token for token) come from the proxy's re-render of a reply:
a non-canonical token split the model sampled, or a reply cut mid-character at max_tokens.

Usage::

    .venv/bin/python bench/gym_episodes.py                                   # defaults below (~15 min here)
    .venv/bin/python bench/gym_episodes.py --env game:GuessTheNumber-v0-easy --size 0
    .venv/bin/python bench/gym_episodes.py --steps 0 --episodes 32           # finish rate only
"""

from __future__ import annotations

import argparse
import json
import time

from lightning_nb import semconv
from lightning_nb import (AlgorithmConfig, GRPOConfig, GRPOTrainer, InMemoryStore, LightningRL, LLMProxy,
                          TransformersEngine, start_runners)
from lightning_nb.agents.agent_runner import seed_tasks
from lightning_nb.agents.gem_runner import GEMRunner


def evaluate(store, tasks, sampling: dict) -> dict:
    """Run ``tasks`` once each and summarise their episodes from the stored spans."""
    t0 = time.perf_counter()
    ids = [r.rollout_id for r in store.enqueue_rollouts(tasks, mode="val",
                                                        metadata={"sampling_parameters": sampling})]
    rollouts = store.wait_for_rollouts(ids, timeout=3600)
    finished = goal = moves = valid = 0
    rewards = []
    for r in rollouts:
        spans = store.query_spans(r.rollout_id, attempt_id="latest")
        final = next((s.attributes for s in spans if s.name == "reward"), None)
        if final is None:
            continue
        steps = [float(s.attributes[semconv.REWARD]) for s in spans if s.name == "intermediate_reward"]
        rewards.append(float(final[semconv.REWARD]))
        finished += final.get("episode.exit_reason") == "terminated"
        goal += any(x > 0 for x in steps)
        moves += len(steps)
        valid += sum(1 for x in steps if x != -0.1)
    n = len(rollouts)
    return {"episodes": n, "failed": n - len(rewards), "finished": finished, "goal": goal,
            "valid_moves": f"{valid}/{moves}", "reward_mean": round(sum(rewards) / max(len(rewards), 1), 4),
            "seconds": round(time.perf_counter() - t0, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--env", default="FrozenLake-v1")
    p.add_argument("--size", type=int, default=3, help="FrozenLake side; 0: no env_kwargs (other envs)")
    p.add_argument("--max-steps", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--episodes", type=int, default=16)
    p.add_argument("--eval-temperature", type=float, default=1.0)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--tasks-per-step", type=int, default=4)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--runners", type=int, default=8)
    args = p.parse_args()

    engine = TransformersEngine.from_default(max_batch_size=8)
    store = InMemoryStore()
    proxy = LLMProxy(engine, store).start()
    store.add_resources({"main_llm": proxy.as_resource()})
    agent = GEMRunner(args.env, env_kwargs={"size": args.size} if args.size else None, max_steps=args.max_steps)
    runners = start_runners(agent, store, n=args.runners)
    trainer = GRPOTrainer(engine, GRPOConfig(learning_rate=args.lr, micro_batch_size=4))
    cfg = AlgorithmConfig(tasks_per_step=args.tasks_per_step, group_size=args.group_size, max_tokens=args.max_tokens,
                          temperature=1.0, max_sample_rounds=1)
    algo = LightningRL(store, trainer, seed_tasks(64), [], cfg)
    held_out = seed_tasks(args.episodes, start=1000)
    sampling = {"temperature": args.eval_temperature, "max_tokens": args.max_tokens}
    try:
        before = evaluate(store, held_out, sampling)
        print("before", json.dumps(before), flush=True)
        for _ in range(args.steps):
            row = algo.step()
            print("step", row["step"], json.dumps({k: row.get(k) for k in (
                "reward_mean", "turn_forks", "sequences_trained", "episodes", "step_seconds")}, default=str), flush=True)
        after = evaluate(store, held_out, sampling) if args.steps else before
        print("after ", json.dumps(after), flush=True)
    finally:
        algo.stop()
        runners.stop()
        proxy.stop()
        engine.stop()


if __name__ == "__main__":
    main()
