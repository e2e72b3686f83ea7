"""Write notebooks/08_your_task.ipynb (committed without outputs).

Run: python notebooks/make_08_your_task.py

The notebook writes a task family of its own in a cell (a reasoning-gym dataset, its own prompt and reward),
registers it, and trains it with GRPO: held-out reward before and after, with standard errors. docs/your-task.md
walks through the same code. tests/test_notebooks.py executes it with nbclient; ``LIGHTNING_NB_SMOKE=1`` selects
small parameters.
"""

from __future__ import annotations

from pathlib import Path

from _nbgen import main  # notebooks/_nbgen.py: build_notebook(CELLS) is the notebook

OUT = Path(__file__).resolve().parent / "08_your_task.ipynb"

CELLS = [
    ("md", """# Train on your own task

The kit's tasks (`calc`, `reasoning_gym:<dataset>`, `textarena:<game>`; docs, "Tasks by name") are task
**families**: a function that makes one task per seed, an agent, and a reward. Yours is a few lines in a cell. This
notebook writes one around reasoning-gym's `number_format` dataset (pick the largest or smallest of numbers written
in different formats: `407,119,368.772`, `4.071193668910000e+08`), with its own prompt and reward, registers it
under a name, and trains SmolLM2-135M-Instruct on it with GRPO on the CPU:

1. the family: tasks by seed, the agent, the reward, checked without a model;
2. the untrained model's held-out reward, with its standard error;
3. GRPO steps, then the held-out reward again on the same tasks, and the gain with its paired standard error.

At full size (the defaults below) the notebook took 9 min on an idle 2-core CPU (2026-11-29): held-out reward
0.031 ± 0.022 before training and 0.375 ± 0.061 after 12 steps (seed 0; one run, an example rather than a claim).
Set `LIGHTNING_NB_SMOKE=1` before the first code cell runs for small sizes (the tests do): uncomment its `%env`
line."""),
    ("code", """# %env LIGHTNING_NB_SMOKE=1      # uncomment for the smoke run with small sizes
import os

SMOKE = os.environ.get("LIGHTNING_NB_SMOKE") == "1"
STEPS = 1 if SMOKE else 12            # GRPO steps
TASKS_PER_STEP = 2 if SMOKE else 4    # distinct tasks a step
GROUP_SIZE = 2 if SMOKE else 4        # rollouts per task: the GRPO group
HELDOUT = 4 if SMOKE else 64          # held-out tasks, evaluated greedily before and after
N_RUNNERS = 4 if SMOKE else 16        # runner threads (and the engine's batch)
MAX_TOKENS = 24                       # completion tokens a call"""),
    ("md", """## 1. The task family

* **Tasks.** One per seed: `reasoning_gym.create_dataset(name, seed=a, size=n)` makes items `a .. a+n-1`, each
  drawn from its own `Random(a + i)`, so a seed range is a set of tasks and disjoint ranges never share one. A task
  is a dict with an `"id"` (the GRPO group key); `num_candidates` is its slice.
* **Agent.** One chat completion. reasoning-gym's own prompt asks for `<answer>` tags, which this 135M model mostly
  ignores (it explains instead of answering: 0.14 held-out). The prompt here shows the reply wanted, twice: the
  untrained model does worse with it (0.03), and 12 GRPO steps lifted it to 0.375 (the run quoted above).
* **Reward.** The dataset's own `score_answer` of the reply's first line: 1.0 for the right number, else 0.0.

`TaskSet` puts them together; `train_seeds` and `heldout_seeds` default to `range(0, 10_000)` and
`range(10_000_000, 10_001_000)`, and ranges that overlap are refused."""),
    ("code", """import openai
import reasoning_gym

from lightning_nb.tasks import TaskFamily, TaskSet, load_task, register_task_family

DATASET = "number_format"
SCORER = reasoning_gym.create_dataset(DATASET, seed=0, size=1)   # its score_answer(answer, entry)
PROMPT = \"\"\"Reply with one of the candidates, copied exactly, and nothing else.

Question: pick the largest number of the following candidates: 5.2e+01 51.5 51,9
Reply: 5.2e+01

Question: pick the smallest number of the following candidates: 1,204.5 1203.9 1.2041e+03
Reply: 1203.9\"\"\"


def make_tasks(seeds):
    items = reasoning_gym.create_dataset(DATASET, seed=seeds.start, size=len(seeds))
    return [{"id": f"{DATASET}-{seed}", "question": item["question"], "answer": item["answer"],
             "metadata": item["metadata"], "num_candidates": item["metadata"]["num_candidates"]}
            for seed, item in zip(seeds, items)]


def number_reward(reply, task):
    first_line = (reply or "").strip().splitlines()[0] if (reply or "").strip() else ""
    return float(SCORER.score_answer(first_line.removeprefix("Reply:").strip(), task))


def number_agent(task, llm):
    client = openai.OpenAI(base_url=llm.endpoint, api_key=llm.api_key, max_retries=0)
    reply = client.chat.completions.create(
        model=llm.model, messages=[{"role": "system", "content": PROMPT},
                                   {"role": "user", "content": task["question"]}],
        **{"max_tokens": 24, **llm.sampling_parameters})
    return number_reward(reply.choices[0].message.content, task)


register_task_family(TaskFamily(
    "pick_number", lambda target, options: TaskSet("pick_number", number_agent, make_tasks, slice_by="num_candidates",
                                                   source="reasoning-gym number_format", reward=number_reward),
    usage="pick_number", summary="the largest or smallest of numbers in mixed formats (reasoning-gym)"),
    replace=True)  # running the cell again replaces it
task = load_task("pick_number")
example = task.heldout_tasks(1)[0]
print(example["question"])
print("answer:", example["answer"], "| reward of the answer:", task.reward(example["answer"], example),
      "| of a wrong one:", task.reward("12", example))"""),
    ("md", """## 2. The untrained model, on held-out seeds

The model runs in this process (`TransformersEngine`); the LLM proxy records every call's token IDs for training.
`evaluate()` runs each held-out task once, greedily; `last_eval_rewards` holds each task's reward, the spread behind
the mean."""),
    ("code", """import math
import statistics

from lightning_nb import AlgorithmConfig, GRPOConfig, GRPOTrainer, InMemoryStore, LightningRL, LLMProxy
from lightning_nb import TransformersEngine, start_runners

engine = TransformersEngine.from_default(max_batch_size=N_RUNNERS)
store = InMemoryStore()
proxy = LLMProxy(engine, store).start()
store.add_resources({"main_llm": proxy.as_resource()})
runners = start_runners(task.agent, store, n=N_RUNNERS)
trainer = GRPOTrainer(engine, GRPOConfig(learning_rate=2e-5))
algo = LightningRL(store, trainer, task.train_tasks(STEPS * TASKS_PER_STEP), task.heldout_tasks(HELDOUT),
                   AlgorithmConfig(steps=STEPS, tasks_per_step=TASKS_PER_STEP, group_size=GROUP_SIZE,
                                   max_tokens=MAX_TOKENS, temperature=0.7, seed=0), slice_by=task.slice_by)


def se(values):
    return statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else float("nan")


before = algo.evaluate(by=task.slice_by)
rewards_before = list(algo.last_eval_rewards)
print(f"held-out reward before training: {before.mean:.3f} ± {se(rewards_before):.3f} (s.e., {before.n} tasks)")
before"""),
    ("md", """## 3. Train, then the same held-out tasks again

`algo.start()` runs the steps in the background, and `algo.wait()` shows their bar until they end (the kernel
stays free without the wait: `algo.pause()`, `algo.resume()`, `algo.state`). The gain's standard error is
paired: the same tasks, before and after."""),
    ("code", """algo.start()
algo.wait()
after = algo.evaluate(by=task.slice_by)
rewards_after = list(algo.last_eval_rewards)
gains = [a - b for a, b in zip(rewards_after, rewards_before)]
print(f"held-out reward after training: {after.mean:.3f} ± {se(rewards_after):.3f} (s.e.)")
print(f"gain: {statistics.fmean(gains):+.3f} ± {se(gains):.3f} (paired s.e.)")
algo.metrics_df()[["step", "reward_mean", "loss", "step_seconds"]]"""),
    ("md", """The command line knows the kit's own families: `python -m lightning_nb demo --task
reasoning_gym:number_format` trains the same dataset with reasoning-gym's prompt.
`bench/task_seeds.py runs NAME --seeds 0 1 2` trains a task set on several seeds and prints the table of their
held-out gains."""),
    ("code", """runners.stop()
proxy.stop()
engine.close()"""),
]

if __name__ == "__main__":
    main(CELLS, OUT)
