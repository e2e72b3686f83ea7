"""Write notebooks/05_any_agent.ipynb (committed without outputs).

Run: python notebooks/make_05_any_agent.py

The notebook runs four agent shapes side by side on one store, behind one LLM proxy and one runner group: a plain
function agent, a LangGraph agent, ROLL's AgentRunner on a gym environment (reference doc 004) and a remote rollout
server (reference doc 002); shows every span as one DataFrame, and trains one GRPO step on all four.
tests/test_notebooks.py executes it with nbclient; ``LIGHTNING_NB_SMOKE=1`` selects small parameters.
"""

from __future__ import annotations

from pathlib import Path

from _nbgen import main  # notebooks/_nbgen.py: build_notebook(CELLS) is the notebook

OUT = Path(__file__).resolve().parent / "05_any_agent.ipynb"

CELLS = [
    ("md", """# Any agent: four shapes on one store

The trainer learns from token IDs the LLM proxy records, whatever wrote the agent loop. This notebook runs four
shapes of agent side by side, behind **one** LLM proxy and **one** runner group, on **one** store, and trains one
GRPO step on all of them:

| shape | what the user writes | reference |
|---|---|---|
| function | `agent(task, llm) -> reward`, plain `openai` SDK code | doc 000 (Agent Lightning) |
| LangGraph | a `create_agent` (LangChain's ReAct agent on a LangGraph graph) with a tool, pointed at `llm.endpoint` | doc 000 |
| AgentRunner | `GEMRunner("FrozenLake-v1")`: ROLL's runner over a gym-style text environment | doc 004 (ROLL) |
| remote rollout server | `RemoteRolloutAgent(url)`: the agent loop runs in another service and calls back | doc 002 |

The runners take each rollout's `shape` from its task and call that agent. The proxy attributes every LLM call to its
attempt, so the spans, the triplets and the training step do not care which shape made them.

At full size (the defaults: one round of 8 rollouts, then one training step of 32) the notebook took 6.7 min on an
idle 2-core CPU (2026-11-28, `bench/notebook_cell_times.py`): the round 51 s, the training step 335 s, the rest 15 s.
With other jobs sharing the two cores (load average 5-8) it took 22 min: the round 300 s (six of its eight rollouts
ran past the runners' 300 s timeout), the training step 992 s; on 2026-11-29 beside two other jobs, 18 min (the
training step 17 min). A smoke run (the tests use it: one round of 4
rollouts, then one step of 8 with one sampling round) took 131 s with other jobs on the cores. Set
`LIGHTNING_NB_SMOKE=1` before the first code cell runs for it: uncomment its `%env` line, or start Jupyter with
`LIGHTNING_NB_SMOKE=1 jupyter lab`. The LangGraph cell needs the `agents` extra (`pip install -e '.[agents]'`), the gym cell the `envs` extra."""),
    ("code", """# %env LIGHTNING_NB_SMOKE=1      # uncomment for the smoke run with small sizes
import os

SMOKE = os.environ.get("LIGHTNING_NB_SMOKE") == "1"
TASKS_PER_SHAPE = 1 if SMOKE else 2   # tasks of each shape per step (each run GROUP_SIZE times)
GROUP_SIZE = 2 if SMOKE else 4        # rollouts per task: the GRPO group
SAMPLE_ROUNDS = 1 if SMOKE else 3     # DAPO dynamic sampling: resample groups whose rewards are all equal
MAX_TOKENS = 48 if SMOKE else 64      # completion tokens per LLM call
N_RUNNERS = 4 if SMOKE else 8         # runner threads (and the engine's batch)"""),
    ("md", """## 1. One engine, one proxy, one store

The engine serves SmolLM2-135M-Instruct in this process; the proxy is the only URL any agent gets."""),
    ("code", """from lightning_nb import InMemoryStore, LLMProxy, TransformersEngine

engine = TransformersEngine.from_default(max_batch_size=N_RUNNERS)
store = InMemoryStore()
proxy = LLMProxy(engine, store).start()
store.add_resources({"main_llm": proxy.as_resource()})
print("proxy at", proxy.url)"""),
    ("md", """## 2. Four agents

**Function** and **LangGraph**: ordinary code that calls `llm.endpoint` (the proxy's URL for this attempt).
The calculator agent of the default task is the function; the LangGraph agent is a ReAct agent with one tool.

**AgentRunner** (ROLL, doc 004): `run_job(seed) -> EpisodeResult(status, score, step_scores, ...)`. `GEMRunner`
plays a gym-style text environment, one LLM call per move: here gymnasium's FrozenLake on a 3x3 lake drawn from the
seed, through the kit's text wrapper. A task is `{"seed": s}`, so a GRPO group is episodes of one lake.

**Remote rollout server** (doc 002): the agent loop lives in another service. `RolloutServer` is the reference one
the kit ships (calculator tools `add`, `subtract`, `multiply`, `divide`; from a shell:
`python -m lightning_nb.agents.rollout_server --port 9000`). For each rollout `RemoteRolloutAgent` POSTs `/rollout`
with a `server_url` attributed to the attempt; the server calls back `{server_url}/v1/chat/completions` with a
`response_mask` that the proxy checks against the tokens it served."""),
    ("code", """from langchain.agents import create_agent   # LangGraph 1.0's replacement for create_react_agent
from langchain_openai import ChatOpenAI

from lightning_nb.agents.gem_runner import GEMRunner
from lightning_nb.agents.remote import RemoteRolloutAgent, final_text
from lightning_nb.agents.rollout_server import RolloutServer
from lightning_nb.tasks.calc import calc_agent, calc_reward, calculator


def langgraph_agent(task, llm):
    def calc(expression: str) -> str:
        \"\"\"Evaluate an arithmetic expression such as 17 * 23.\"\"\"
        return calculator(expression)

    model = ChatOpenAI(base_url=llm.endpoint, api_key=llm.api_key, model=llm.model, max_retries=0)
    state = create_agent(model, [calc]).invoke({"messages": [("user", task["question"])]}, {"recursion_limit": 6})
    return calc_reward(str(state["messages"][-1].content), task)


gym_agent = GEMRunner("FrozenLake-v1", env_kwargs={"size": 3}, max_steps=4)
server = RolloutServer(tokenizer=engine.tokenizer).start()
remote_agent = RemoteRolloutAgent(server.url, reward_fn=lambda task, messages: calc_reward(final_text(messages), task),
                                  max_turns=3)
AGENTS = {"function": calc_agent, "langgraph": langgraph_agent, "gym": gym_agent, "remote": remote_agent}


def any_agent(task, llm):
    \"\"\"The agent of the task's shape (one runner group runs all four).\"\"\"
    return AGENTS[task["shape"]](task, llm)"""),
    ("md", """## 3. Tasks, and one round of rollouts

The calculator tasks (`datasets/calc`) serve the function, LangGraph and remote shapes; the gym shape takes seeds.
The runners preflight each agent that has a `preflight()` (the remote one asks its server for `GET /tools`)."""),
    ("code", """from lightning_nb import start_runners
from lightning_nb.agents.agent_runner import seed_tasks
from lightning_nb.tasks.calc import load_tasks

calc_tasks = load_tasks("train", limit=3 * TASKS_PER_SHAPE)
TASKS = ([{**t, "shape": "function"} for t in calc_tasks[:TASKS_PER_SHAPE]]
         + [{**t, "shape": "langgraph"} for t in calc_tasks[TASKS_PER_SHAPE:2 * TASKS_PER_SHAPE]]
         + [{**t, "shape": "remote"} for t in calc_tasks[2 * TASKS_PER_SHAPE:]]
         + seed_tasks(TASKS_PER_SHAPE, shape="gym"))
runners = start_runners(any_agent, store, n=N_RUNNERS)
sampling = {"temperature": 0.7, "max_tokens": MAX_TOKENS}
ids = [store.enqueue_rollout(t, metadata={"sampling_parameters": sampling}).rollout_id for t in TASKS]
store.wait_for_rollouts(ids, timeout=600)
episodes = store.episodes_df(by="shape")
episodes[["slice", "status", "llm_calls", "reward", "duration_s", "error"]]"""),
    ("md", """## 4. Every span, one DataFrame

One row per span: the LLM calls (with token counts) of all four shapes, the tool calls, the rewards. The `shape`
column comes from each rollout's task."""),
    ("code", """shape_of = {r.rollout_id: r.input["shape"] for r in store.query_rollouts()}
spans = store.spans_df()
spans.insert(0, "shape", spans["rollout_id"].map(shape_of))
print("shapes on one store:", spans.groupby("shape")["name"].value_counts().unstack(fill_value=0).to_dict("index"))
spans[["shape", "rollout_id", "name", "prompt_tokens", "completion_tokens", "reward", "duration_s"]].head(20)"""),
    ("md", """## 5. One training step on all four

`LightningRL` enqueues GRPO groups of these tasks, waits, turns the spans into triplets and asks the trainer for one
update. The packed multi-turn episodes (the gym's moves, the remote server's tool turns) are one sequence each:
`turn_forks` counts the turns that could not be packed. The update forwards its sequences as prefix trees, so a
token that several of them share after the same tokens (a group's prompt, a system prompt) is forwarded once:
`forwarded_tokens` is what the forwards held, `prefix_shared_tokens` what sharing saved."""),
    ("code", """from lightning_nb import AlgorithmConfig, GRPOConfig, GRPOTrainer, LightningRL

trainer = GRPOTrainer(engine, GRPOConfig(learning_rate=2e-5))
algo = LightningRL(store, trainer, TASKS, config=AlgorithmConfig(
    tasks_per_step=len(TASKS), group_size=GROUP_SIZE, max_tokens=MAX_TOKENS, temperature=0.7,
    max_sample_rounds=SAMPLE_ROUNDS))
row = algo.step()
print("training step 1:", {k: row[k] for k in ("reward_mean", "sequences_trained", "turn_forks", "loss",
                                               "forwarded_tokens", "prefix_shared_tokens") if k in row})"""),
    ("md", """## 6. Clean up

Stop the runners, the rollout server and the proxy, and free the engine."""),
    ("code", """runners.stop()
server.stop()
proxy.stop()
engine.close()"""),
]

if __name__ == "__main__":
    main(CELLS, OUT)
