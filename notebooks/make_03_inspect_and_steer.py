"""Write notebooks/03_inspect_and_steer.ipynb (committed without outputs).

Run: python notebooks/make_03_inspect_and_steer.py

The notebook walks a researcher through what the optimizer sees and how to steer a run:
preflight, background training, pause, the last batch token by token, the token-fidelity
audit, a config edit while paused, save, a simulated kernel restart and load.
tests/test_notebooks.py executes it with nbclient; ``LIGHTNING_NB_SMOKE=1`` selects small parameters.
"""

from __future__ import annotations

from pathlib import Path

from _nbgen import main  # notebooks/_nbgen.py: build_notebook(CELLS) is the notebook

OUT = Path(__file__).resolve().parent / "03_inspect_and_steer.ipynb"

CELLS = [
    ("md", """# Inspect and steer: what the optimizer sees, and how to change course mid-run

`01_quickstart.ipynb` trains the calculator agent end to end. This notebook is about the checks a researcher wants
*before* and *during* a run:

1. **set-up**: the default model (SmolLM2-135M-Instruct) behind the LLM proxy, the calculator agent, `LightningRL` (the
   algorithm: it owns the run, its loop, step counter, metrics and checkpoint) + `GRPOTrainer` (it updates the weights);
2. **preflight**: one collection round without an update, reporting anything that would make training useless;
3. **train in the background**, then **pause** at a step boundary;
4. the **optimizer's-eye view** of the last batch: one row per trained sequence, and the tokens coloured by advantage;
5. the **token-fidelity audit** of the rollouts the trainer just learned from;
6. a **config edit while paused**, recorded in the metrics;
7. **save**, "restart" (a fresh engine, trainer and algorithm, as in a new kernel), **load**, and keep training.

The last section lists the three lines to change on a GPU.

Everything runs on CPU. On a 2-core CPU a full run took 12 minutes (loading the model twice, a one-minute preflight
round, 5 training steps of 1 to 2 minutes each, and writing and reading a 1.6 GB checkpoint). For a smoke run with
small sizes (2 to 3 minutes; the tests use it), set `LIGHTNING_NB_SMOKE=1` before the first code cell runs:
uncomment its `%env LIGHTNING_NB_SMOKE=1` line, or start Jupyter with `LIGHTNING_NB_SMOKE=1 jupyter lab`."""),
    ("code", """# %env LIGHTNING_NB_SMOKE=1      # uncomment for the smoke run with small sizes
import os

SMOKE = os.environ.get("LIGHTNING_NB_SMOKE") == "1"  # small sizes: a few minutes in all
STEPS = 2 if SMOKE else 4           # training steps before the checkpoint (one more after loading it)
TASKS_PER_STEP = 2 if SMOKE else 4  # distinct tasks per step
GROUP_SIZE = 2 if SMOKE else 4      # rollouts per task (the GRPO group)
SAMPLE_ROUNDS = 1 if SMOKE else 3   # DAPO dynamic sampling: resample groups whose rewards are all equal
MAX_TOKENS = 32 if SMOKE else 48    # completion tokens per LLM call
N_RUNNERS = 4 if SMOKE else 8       # runner threads (on a GPU: bigger batch sizes, see the last section)"""),
    ("md", """## 1. Set-up

One function builds everything a kernel needs before training, so that section 7 can build it again as a new
kernel would: the engine serving the model in this process, the store, the OpenAI-compatible LLM proxy, runner
threads running the calculator agent (`lightning_nb.tasks.calc.calc_agent`, tasks from `datasets/calc`), the trainer and
the algorithm. Nothing trains yet."""),
    ("code", """from lightning_nb import (AlgorithmConfig, GRPOConfig, GRPOTrainer, InMemoryStore, LightningRL, LLMProxy,
                          TransformersEngine, start_runners)
from lightning_nb.tasks.calc import calc_agent, load_tasks


def set_up():
    \"\"\"Engine, store, proxy, runners, trainer and algorithm (the GPU lines are marked; see the last section).\"\"\"
    engine = TransformersEngine.from_default(max_batch_size=8)          # GPU: a bigger model, see the last section
    store = InMemoryStore()
    proxy = LLMProxy(engine, store).start()                             # binds 127.0.0.1 on a free port
    store.add_resources({"main_llm": proxy.as_resource()})
    runners = start_runners(calc_agent, store, n=N_RUNNERS)             # background threads; returns at once
    trainer = GRPOTrainer(engine, GRPOConfig(learning_rate=2e-5))       # GPU: device="cuda", dtype="bfloat16"
    algo = LightningRL(store, trainer, load_tasks("train"),
                       config=AlgorithmConfig(tasks_per_step=TASKS_PER_STEP, group_size=GROUP_SIZE,
                                              max_tokens=MAX_TOKENS, temperature=0.7,
                                              max_sample_rounds=SAMPLE_ROUNDS))
    return engine, store, proxy, runners, trainer, algo


engine, store, proxy, runners, trainer, algo = set_up()
display(trainer)  # not a bare `trainer`: IPython's Out cache would keep it, and its engine, alive after a restart"""),
    ("md", """## 2. Preflight: is there anything to learn from?

Hours of compute are easily spent on a batch with nothing in it: no reward reached the store, the token IDs are
missing, every response mask is zero, every group's rewards are equal (GRPO's advantage is then 0 everywhere), or
most responses were cut at `max_tokens`. `algo.preflight()` runs **one collection round without an update** (the
weights, the optimizer, the step and the task sampler stay exactly as they were) and reports each problem with its
fix. **Blockers** make the update useless or make it raise; **warnings** waste compute or weaken the signal (turn
forks and chat-template mismatches; `strict=True` makes them blockers). `report.ok` is True when nothing blocks.

A smoke run samples very few groups, so a `no_signal` or `truncated` finding is expected there; in a real run, fix
the blockers before you train. This notebook trains anyway so you can see the rest."""),
    ("code", """report = algo.preflight(progress=True)
report"""),
    ("md", """The same report as text (`print(report)`) and as a DataFrame (`report.to_frame()`); `report.stats` has the
round's counts and `report.fidelity` the token-fidelity audit of its rollouts (section 5)."""),
    ("code", """print(report)
report.ok, report.names()"""),
    ("md", """## 3. Train in the background, then pause

`algo.start(steps=...)` returns at once and trains in a background thread, so the notebook stays usable.
Wait for the first step, then `algo.pause()`: it returns once the loop is parked at the next **step boundary**
(nothing in flight: no update running, no rollouts enqueued, the engine free). The weights stay exactly as they
are until you resume. `algo.paused_at` names the boundary: `'before update'` or `'between sample rounds'` when
the next step had already started collecting before the pause was asked (the rest of that step waits for
`resume()`)."""),
    ("code", """algo.start(steps=STEPS)
algo.wait(until_step=1, progress=True)   # a bar through step 1's rollouts and update; re-raises a failure
algo.pause(progress=True)                # a bar of what the pause waits for
algo.state, algo.global_step, algo.paused_at"""),
    ("code", """algo.metrics_df()[["step", "reward_mean", "loss", "grad_norm", "groups_with_signal",
                   "tokens_trained"]]"""),
    ("md", """## 4. The optimizer's-eye view of the last batch

`trainer.last_batch_df()` has one row per packed sequence of the last update: its group, the GRPO `advantage`
given to every trained token, the sequence length (`tokens`) and the trained tokens (`response_tokens`, response
mask 1), the mean PPO ratio `exp(trainer − engine log-prob)` over the trained tokens, the largest per-token
`|trainer − engine|` log-prob (`max_abs_logprob_diff`, nats: near 0 means the trainer and the engine saw the same
tokens and weights), and the trained text. A group whose rewards were all equal gets advantage 0 everywhere: it
teaches nothing, and is not even forwarded (`skip_zero_advantage`), so its ratio columns are NaN. One row per LLM
call instead: `lightning_nb.adapter.triplets_df(trainer.last_triplets, trainer.last_advantages)`."""),
    ("code", """batch = trainer.last_batch_df()
batch"""),
    ("md", """The same sequences token by token: context tokens (prompt, tool results; mask 0, not trained) in grey, trained
tokens shaded green for a positive advantage and red for a negative one. Hover a token for its id, the engine's
("old") and the trainer's ("new") log-prob and their ratio; a wavy red underline marks tokens whose ratio lies
outside the clip range."""),
    ("code", """from IPython.display import HTML

HTML(trainer.last_batch_html(max_rows=4))"""),
    ("md", """## 5. Token fidelity of the rollouts just trained on

The trainer learns from the exact token IDs the engine served, never from re-tokenized text. `token_fidelity`
checks two things for each LLM call of the given rollouts (their latest attempts):

* **render**: the recorded messages, rendered through the tokenizer's chat template, give the served prompt tokens
  (a mismatch means the engine and the trainer disagree about the template or the tokenizer);
* **fork**: each turn's prompt extends the previous turn's prompt + completion token for token, so the turns pack
  into one sequence. The `cause` column tells why one did not: `history_edited` (the agent changed earlier
  messages) or `retokenized` (the sampled reply, sent back as text, tokenizes differently: correct, but the turn
  then trains as a separate sequence).

One row per mismatch: an empty table means every checked call matched; `attrs` says how many were checked."""),
    ("code", """from lightning_nb.inspect.audit import token_fidelity

fidelity = token_fidelity(store, batch["rollout_id"].unique().tolist(), engine.tokenizer)
print(f"checked {fidelity.attrs['calls_checked']} LLM calls in {fidelity.attrs['rollouts_checked']} rollouts; "
      f"mismatches: {len(fidelity)}")
fidelity"""),
    ("md", """## 6. Change the config while paused

While paused, edit `trainer.config` (`learning_rate`, `clip_ratio_high`, `ppo_epochs`, ...) or `algo.config`
(`temperature`, `tasks_per_step`, ...). `algo.resume()` validates the edits first (an invalid value raises
`ConfigError` and the loop stays paused), and they apply from the next step. (`kl_coef > 0` needs a reference
model, which a trainer keeps only when built with `kl_coef > 0` or `track_reference_kl=True`.) Here: halve the learning rate and
turn on DAPO's clip-higher (ε_high = 0.28 leaves low-probability tokens room to grow)."""),
    ("code", """trainer.config.learning_rate = 1e-5      # was 2e-5
trainer.config.clip_ratio_high = 0.28    # was None: the same as clip_ratio, 0.2
edited_at = algo.global_step + 1         # the edits apply from the next step
algo.resume()
algo.wait(progress=True)                 # blocks until the remaining steps are done
algo.state, algo.global_step"""),
    ("md", """Each step's metrics row records the edits applied at that step in `config_changes`; `lr` is read from the
optimizer, so it shows the new learning rate. `algo.config_changes` lists the same edits one field at a time."""),
    ("code", """metrics = algo.metrics_df()
for row in metrics[metrics["config_changes"].fillna("") != ""].itertuples():
    print(f"step {row.step}: {row.config_changes}")
assert "learning_rate" in metrics.set_index("step").loc[edited_at, "config_changes"]
metrics[["step", "lr", "reward_mean", "loss", "pg_clipfrac", "config_changes"]]"""),
    ("md", """## 7. Save, restart, load, continue

`algo.save(path)` writes everything a continued run needs: the weights and the AdamW state, the torch, numpy
and Python RNG states, the task sampler's state, the step, the metrics and the config edits (about **1.6 GB** for
SmolLM2-135M in float32). Here it goes to a temporary folder that the last cell deletes; to continue after a real
kernel restart, save to a folder of your own, e.g. `runs/steer/checkpoint.pt`."""),
    ("code", """import shutil
import tempfile
from pathlib import Path

run_dir = Path(tempfile.mkdtemp(prefix="inspect-and-steer-"))
checkpoint = algo.save(run_dir / "checkpoint.pt")
print(f"saved step {algo.global_step} to {checkpoint} ({checkpoint.stat().st_size / 1e9:.2f} GB)")"""),
    ("md", """Now "restart": stop everything and build a fresh engine, store, proxy, runners, trainer and algorithm, exactly
as a new kernel would. After a real kernel restart (Kernel ▸ Restart) you would rerun the parameter cell and the
set-up cell (section 1) instead; the engine then starts from the default model's initial weights again.

`algo.load(path)` restores the weights (and serves them), the optimizer, the RNG states, the step, the metrics
and the task sampler's state into the new algorithm and its trainer, and the trainer's config the run was saved with:
the edits of section 6 come back (each replaced field is logged as a warning). `algo.load(path, keep_config=True)`
keeps the config of the set-up cell instead and records the difference as a config change at the next step. The
new proxy has a new URL; `set_up()` already published it with `store.add_resources`."""),
    ("code", """import gc

algo.stop()
runners.stop()
proxy.stop()
engine.close()
del engine, store, proxy, runners, trainer, algo, batch
gc.collect()

engine, store, proxy, runners, trainer, algo = set_up()        # what a new kernel runs first
algo.load(checkpoint)
print(f"loaded: step {algo.global_step}, {len(algo.metrics_df())} metrics rows, weight version {engine.weight_version}")
print(f"config from the checkpoint: learning_rate {trainer.config.learning_rate}, "
      f"clip_ratio_high {trainer.config.clip_ratio_high}")
assert (trainer.config.learning_rate, trainer.config.clip_ratio_high) == (1e-5, 0.28)  # the edits of section 6"""),
    ("md", """Train one more step. The step counter, the metrics and the task sampler continue where the saved run stopped."""),
    ("code", """saved_step = algo.global_step
algo.start(steps=1)
algo.wait(progress=True)
assert algo.global_step == saved_step + 1
algo.metrics_df()[["step", "lr", "reward_mean", "loss", "config_changes"]]"""),
    ("md", """## Moving to a GPU

The same notebook runs on one GPU by changing three lines: two in `set_up()` (the engine and the trainer) and the
batch sizes in the parameter cell:

```python
engine = TransformersEngine.from_pretrained("/path/to/model_dir", device="cuda", dtype="bfloat16",
                                            max_batch_size=64)      # any local Hugging Face model directory
trainer = GRPOTrainer(engine, GRPOConfig(learning_rate=2e-5, device="cuda", dtype="bfloat16",
                                         gradient_checkpointing=True))
TASKS_PER_STEP, GROUP_SIZE, N_RUNNERS = 16, 8, 64                  # batch sizes: 128 rollouts per step
```

* `from_pretrained` reads a directory that exists with `local_files_only=True` (anything else is taken as a hub id
  and needs network); `from_default()` stays the GGUF SmolLM2-135M. `device` and `dtype` load the weights there.
* `GRPOConfig(device=..., dtype=...)` moves the engine's model (the engine generates on the model's device);
  with bfloat16, AdamW keeps float32 master weights. These fields are fixed when the trainer is built.
* Bigger batches give GRPO more groups with signal per step; `GRPOConfig.micro_batch_size` bounds the memory of
  one forward/backward.

The manual's "Moving to a GPU" page (`docs/gpu.md`) says the same, with the measured bf16/float32 log-prob gap."""),
    ("md", """## Clean up

Stop the background threads and delete the checkpoint's temporary folder (no 1.6 GB file is left behind)."""),
    ("code", """runners.stop()
proxy.stop()
engine.close()
shutil.rmtree(run_dir)
algo.state"""),
]


if __name__ == "__main__":
    main(CELLS, OUT)
