"""Write notebooks/07_replay_and_branch.ipynb (committed without outputs).

Run: python notebooks/make_07_replay_and_branch.py

The notebook re-scores a stored run's episodes with a new reward (what-if), replays an episode exactly, branches it
at its tool call, and trains one step on branch groups. tests/test_notebooks.py executes it with nbclient;
``LIGHTNING_NB_SMOKE=1`` selects small parameters.
"""

from __future__ import annotations

from pathlib import Path

from _nbgen import main  # notebooks/_nbgen.py: build_notebook(CELLS) is the notebook

OUT = Path(__file__).resolve().parent / "07_replay_and_branch.ipynb"

CELLS = [
    ("md", """# Replay and branch: new rewards on old episodes, exact replays, and branches at call k

Every span, token ID and tool result of every episode is already in the store. This notebook uses them without
running the episodes again:

1. **what-if rewards**: re-score a stored run's episodes with a new reward function (no agent, no model), and see
   which GRPO groups gain or lose signal under the trainer's own advantage estimator;
2. **exact replay**: re-run the agent with every LLM call answered from the record, and see it reach the same
   tokens and reward (or where it diverges);
3. **branching**: replay an episode up to its tool call, then sample the rest anew, four times: a group of
   continuations of one shared prefix (Tree-GRPO, ARPO), and train one step on such groups.

The run here is the calc task on SmolLM2-135M (`TransformersEngine`, in this process), with the shaping term
`calc_uses_all_numbers` (+0.2 for a `CALC` that uses every number of the question) on. Set `LIGHTNING_NB_SMOKE=1`
before the first code cell runs for small sizes (the tests do): uncomment its `%env` line.

At full size (the defaults: 8 groups of 4 episodes, 4 branches) the notebook took 85 s on an idle 2-core CPU
(2026-11-28): the run 63 s, the training step on branch groups 18 s, the replay, the what-if table and the branches
about 5 s together. The smoke run (the tests use it) took 38 s."""),
    ("code", """# %env LIGHTNING_NB_SMOKE=1      # uncomment for the smoke run with small sizes
import os

SMOKE = os.environ.get("LIGHTNING_NB_SMOKE") == "1"
TASKS = 2 if SMOKE else 8        # tasks of "yesterday's run", each run GROUP_SIZE times
GROUP_SIZE = 4                   # rollouts per task: the GRPO group
BRANCHES = 2 if SMOKE else 4     # continuations per branch point
N_RUNNERS = 4 if SMOKE else 8    # runner threads (and the engine's batch)"""),
    ("md", """## 1. Yesterday's run, in a SQLite store

`TASKS` GRPO groups of the calc task (the demo's sampling: temperature 0.7, 32 tokens a call), written to a SQLite
file: after a kernel restart, `SqliteStore(path)` opens it again with every episode in it. Everything below reads
what the file holds."""),
    ("code", """import functools, tempfile
from pathlib import Path

from lightning_nb import AlgorithmConfig, GRPOConfig, GRPOTrainer, LightningRL, LLMProxy, SqliteStore
from lightning_nb import TransformersEngine, start_runners
from lightning_nb.tasks.calc import calc_agent, load_tasks

workdir = Path(tempfile.mkdtemp(prefix="lnb-replay-"))
engine = TransformersEngine.from_default(max_batch_size=N_RUNNERS)
store = SqliteStore(workdir / "run.db")
proxy = LLMProxy(engine, store).start()
store.add_resources({"main_llm": proxy.as_resource()})
agent = functools.partial(calc_agent, all_numbers_bonus=0.2)
runners = start_runners(agent, store, n=N_RUNNERS)
sampling = {"temperature": 0.7, "max_tokens": 32}
ids = []
for task in load_tasks("train")[100:100 + TASKS]:
    ids += [r.rollout_id for r in store.enqueue_rollouts([task] * GROUP_SIZE, metadata={
        "group_id": task["id"], "sampling_parameters": sampling})]
store.wait_for_rollouts(ids, progress=True)
# the algorithm whose trainer config (the advantage estimator) and slices what_if reads below
algo = LightningRL(store, GRPOTrainer(engine, GRPOConfig()), load_tasks("train"), [], slice_by="ops")
print(f"yesterday's run: {len(ids)} episodes in {store.path}")"""),
    ("md", """## 2. One episode, as you read it

`store.episode(rollout_id)` builds one object from the spans: the task, each LLM call's messages, reply, token IDs
and finish reason, the traced tool calls and results, the final reward and its components."""),
    ("code", """episodes = store.episodes(mode="train")
with_tool = [e for e in episodes if e.tools and len(e.calls) >= 2]
ep = next((e for e in with_tool if e.reward == 1.0), with_tool[0] if with_tool else episodes[0])  # a solved one
print(f"{len(with_tool)} of {len(episodes)} episodes called the calculator and answered after it")
ep"""),
    ("md", """## 3. What-if: the calc reward without its shaping term

A reward function takes the task and the episode; here the calc reward is written that way (the final number of the
last reply against the task's answer), without the +0.2 shaping term. `what_if` scores every stored episode with it
and compares the advantages the trainer would give (its own estimator: GRPO's group normalisation, the group-size
rule), nothing sampled, nothing stored changed."""),
    ("code", """from lightning_nb.replay import what_if, what_if_groups, what_if_slices
from widgets import what_if_figure
from lightning_nb.tasks.calc import calc_reward

def final_only(task, episode):
    \"\"\"The calc reward on a stored episode: 1.0 when the last reply's final number is the answer.\"\"\"
    return calc_reward(episode.final_reply, task)

table = what_if(final_only, algo=algo)
groups = what_if_groups(table)
print("what-if:", groups["change"].value_counts().to_dict())
table.head(8)"""),
    ("code", """display(what_if_slices(table))
what_if_figure(table)"""),
    ("md", """To train on it from the next step: `algo.set_reward(final_only)` (while the loop is paused or idle; logged in
`config_changes`; the reward spans stay as the agent recorded them)."""),
    ("md", """## 4. Exact replay

`replay` re-runs the agent on the episode's task; the proxy answers each call from the record (same text, token IDs,
log-probs) as long as the agent's request equals the recorded one, and refuses with a 409 naming the call and the
field where it does not."""),
    ("code", """from lightning_nb.replay import replay

again = replay(ep.rollout_id, store=store)
same = [a.completion_ids == b.completion_ids for a, b in zip(again.calls, ep.calls)]
print(f"replayed exactly: {all(same) and len(again.calls) == len(ep.calls)}, reward {ep.reward} -> {again.reward}, "
      f"divergence {again.divergence}")"""),
    ("md", """## 5. Branch at the tool call

`branch(rollout_id, at_call=k, n=...)` replays calls 1..k from the record and samples the rest anew, `n` times,
with the current weights (or other sampling, or another resources set). Branching right after the calculator's
result asks: from this state, how often does the model get the answer? The branches are rollouts of their own,
linked to their parent, in one GRPO group."""),
    ("code", """from lightning_nb.replay import branch, branch_tree

k = ep.tools[0].after_call if ep.tools else max(1, len(ep.calls) - 1)
kids = branch(ep.rollout_id, at_call=min(k, len(ep.calls)), n=BRANCHES, sampling={"temperature": 1.0}, store=store)
print(f"branches of {ep.rollout_id} at call {k}: rewards {[kid.reward for kid in kids]}")
branch_tree(store, ep.rollout_id)"""),
    ("md", """The `SpanBrowser` (notebook 02) shows the same family as a tree when you click one of these rollouts.

## 6. One training step on branch groups

`LightningRL(..., branch=BranchConfig(...))` branches some of each step's episodes after a tool result and trains
on the branch groups with the step's own groups: advantages relative within each branch group, and only the calls
sampled after the branch point trained (the replayed ones belong to the parent)."""),
    ("code", """from lightning_nb.replay import BranchConfig

step_config = AlgorithmConfig(tasks_per_step=1 if SMOKE else 2, group_size=GROUP_SIZE, max_tokens=32,
                              dynamic_sampling=False, seed=2)
trainer = GRPOTrainer(engine, GRPOConfig())
learner = LightningRL(store, trainer, load_tasks("train"), [], step_config,
                      branch=BranchConfig(parents=1 if SMOKE else 2, n=BRANCHES))
row = learner.step()
print({k: row[k] for k in ("reward_mean", "branch_groups", "branch_groups_with_signal", "branch_rollouts",
                           "tokens_trained", "groups_with_signal")})"""),
    ("code", """import shutil

runners.stop()
proxy.stop()
engine.close()
store.close()
shutil.rmtree(workdir, ignore_errors=True)"""),
]

if __name__ == "__main__":
    main(CELLS, OUT)
