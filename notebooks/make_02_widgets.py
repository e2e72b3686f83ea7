"""Write notebooks/02_widgets.ipynb (committed without outputs). Run: python notebooks/make_02_widgets.py

The notebook is short on purpose: tests/test_browser.py opens it in JupyterLab in
headless Chromium, runs every cell and clicks the widgets; tests/test_notebooks.py
executes it with nbclient. ``LIGHTNING_NB_SMOKE=1`` selects small parameters.
"""

from __future__ import annotations

from pathlib import Path

from _nbgen import main  # notebooks/_nbgen.py: build_notebook(CELLS) is the notebook

OUT = Path(__file__).resolve().parent / "02_widgets.ipynb"

CELLS = [
    ("md", """# Live widgets: watch and steer training from the notebook

One call shows everything while GRPO trains in the background:

* **run panel**: step, tokens/s, loss, KL, reward; **Pause / Resume / Save checkpoint** (the algorithm's `pause()`, `resume()`, `save()`); a chat box that asks the current policy while training is paused;
* **runner panel**: every runner thread's state, current rollout, counts and last heartbeat; Start / Stop;
* **reward curve** (plotly): mean reward per training step with min/max, validation reward, and reward per batch of finished rollouts;
* **span browser**: the latest spans as a table; click a row to see that rollout's span tree (agent → LLM calls → tools → reward) with prompt, completion and token counts.

The panels poll the store and the algorithm on background threads: cells never block, and `dash.close()` stops them.

Every cell returns within seconds (loading the model takes about 30 s); training then runs in the background.
On a 2-core CPU the default 12 steps take about 15 minutes (each step 1 to 2 minutes, plus a 16-task held-out
evaluation every 4 steps). For a smoke run with small sizes (4 short steps, a few minutes; the tests use it), set
`LIGHTNING_NB_SMOKE=1` before the first code cell runs: uncomment its `%env LIGHTNING_NB_SMOKE=1` line, or start
Jupyter with `LIGHTNING_NB_SMOKE=1 jupyter lab`."""),
    ("code", """# %env LIGHTNING_NB_SMOKE=1      # uncomment for a smoke run with small sizes
import os

SMOKE = os.environ.get("LIGHTNING_NB_SMOKE") == "1"
STEPS = 4 if SMOKE else 12          # training steps
TASKS_PER_STEP = 2 if SMOKE else 4  # distinct tasks per step
GROUP_SIZE = 3 if SMOKE else 4      # rollouts per task (the GRPO group)
SAMPLE_ROUNDS = 1 if SMOKE else 3   # DAPO dynamic sampling: resample groups whose rewards are all equal
MAX_TOKENS = 24 if SMOKE else 48    # completion tokens per LLM call
N_RUNNERS = 6 if SMOKE else 8       # runner threads
VAL_EVERY = 0 if SMOKE else 4       # evaluate on held-out tasks every N steps (0: never)"""),
    ("md", """## Model, store, proxy, runners, trainer and algorithm

The same set-up as `01_quickstart.ipynb`. The algorithm (`LightningRL`) owns the run: its loop, step counter,
metrics and checkpoint; the trainer only updates the weights. Nothing trains yet."""),
    ("code", """from lightning_nb import (AlgorithmConfig, GRPOConfig, GRPOTrainer, InMemoryStore, LightningRL, LLMProxy,
                          TransformersEngine, start_runners)
from lightning_nb.tasks.calc import calc_agent, load_tasks
from lightning_nb.tasks.calc.agent import SYSTEM_PROMPT

engine = TransformersEngine.from_default(max_batch_size=8)
store = InMemoryStore()
proxy = LLMProxy(engine, store).start()
store.add_resources({"main_llm": proxy.as_resource()})
trainer = GRPOTrainer(engine, GRPOConfig(learning_rate=2e-5))
algo = LightningRL(store, trainer, load_tasks("train"), load_tasks("val", limit=16),
                   AlgorithmConfig(tasks_per_step=TASKS_PER_STEP, group_size=GROUP_SIZE, max_tokens=MAX_TOKENS,
                                   val_every=VAL_EVERY, max_sample_rounds=SAMPLE_ROUNDS))"""),
    ("md", """The runners get a cell of their own: after you edit the agent or its reward, re-run just this cell. The
new group replaces the old one (its runners finish their current rollout first, and a warning says so), and
the dashboard's runner panel follows the new group."""),
    ("code", """runners = start_runners(calc_agent, store, n=N_RUNNERS)"""),
    ("md", """## The dashboard

`dashboard(store, runners, algo)` shows every panel; each one also works alone
(`RunPanel(algo)`, `RunnerPanel(runners)`, `RewardCurve(store)`, `SpanBrowser(store)`)."""),
    ("code", """from widgets import dashboard

dash = dashboard(store, runners, algo, batch_size=TASKS_PER_STEP * GROUP_SIZE, chat_system=SYSTEM_PROMPT)
dash"""),
    ("md", """## Train in the background

`algo.start` returns at once; scroll up and watch the panels fill. Press **Pause**, ask the policy something in
the chat box, then **Resume**."""),
    ("code", """algo.start(steps=STEPS)
algo.state"""),
    ("md", """Displaying the main objects in a cell shows a summary (`_repr_html_`):"""),
    ("code", """store"""),
    ("code", """runners"""),
    ("md", """Re-running the `start_runners` cell never adds threads: the kernel runs one group per store."""),
    ("code", """import threading

print("runner threads in this kernel:", sum(t.name.startswith("lightning_nb-runner-") for t in threading.enumerate()))"""),
    ("md", """## When you are done

Close the dashboard (its polling threads stop) and the background threads:"""),
    ("code", """def shutdown():
    dash.close()
    algo.stop()
    runners.stop()
    proxy.stop()

# shutdown()"""),
]


if __name__ == "__main__":
    main(CELLS, OUT)
