"""Write notebooks/04_verl_trainer.ipynb (committed without outputs).

Run: python notebooks/make_04_verl_trainer.py

The notebook trains the calculator agent with ``VerlTrainer``: verl's own GRPO advantage and PPO actor
update, run in the notebook's process without Ray, behind the trainer surface of ``GRPOTrainer`` and driven
by ``LightningRL`` (the algorithm owns the run's verbs, metrics and checkpoint): the config as verl sees it, background training, pause, verl's metrics and the last batch, resume, a
checkpoint in verl's layout, a simulated kernel restart and load, and the lines to change on a GPU.
tests/test_notebooks.py executes it with nbclient; ``LIGHTNING_NB_SMOKE=1`` selects small parameters.
"""

from __future__ import annotations

from pathlib import Path

from _nbgen import main  # notebooks/_nbgen.py: build_notebook(CELLS) is the notebook

OUT = Path(__file__).resolve().parent / "04_verl_trainer.ipynb"

CELLS = [
    ("md", """# Train the calculator agent with verl's actor: `VerlTrainer`

`VerlTrainer` does each GRPO step with [verl](https://github.com/volcengine/verl)'s own code: verl's GRPO advantage
(`compute_grpo_outcome_advantage`) and verl's PPO actor update (its FSDP engine and `ppo_loss`: PPO clip with dual
clip, the KL loss, verl's loss aggregation, gradient clipping, the optimizer step). It runs **in this process,
without Ray**: verl's actor adopts the model the engine serves and trains it in place.

Everything around it is what `03_inspect_and_steer.ipynb` uses: the same calculator agent, runner threads, LLM
proxy, store and `LightningRL` algorithm, and the same controls: the algorithm's `start` in the background, `pause`
at a step boundary, `resume`, `wait`, `metrics_df()`, `save` and `load` (the algorithm owns the run), and the
trainer's `last_batch_df()`. What changes:

1. the config is a `VerlConfig`: `GRPOConfig`'s field names, each mapped onto a key of verl's `ppo_trainer.yaml`,
   plus `overrides` for any other verl key;
2. the metrics carry verl's own names (`actor/pg_loss`, `actor/pg_clipfrac`, `actor/ppo_kl`, ...);
3. checkpoints use verl's folder layout (`global_step_N/`, `latest_checkpointed_iteration.txt`).

To run on a GPU, change only the parameter cell: `DEVICE = "cuda"` (the sizes and the precision follow), and
`MODEL_DIR` for a bigger model; the last section says what else the GPU path offers.

Everything runs on CPU. A smoke run with small sizes (the tests use it) took just over 2 minutes (131 s) on a 2-core
CPU: loading the model twice, 3 training steps, and writing and reading a 1.6 GB checkpoint. To run it, set
`LIGHTNING_NB_SMOKE=1` before the first code cell runs: uncomment its `%env LIGHTNING_NB_SMOKE=1` line, or start
Jupyter with `LIGHTNING_NB_SMOKE=1 jupyter lab`. The full sizes (16 rollouts per step, up to 3 sampling rounds, 5
steps) take several times longer; they were not timed."""),
    ("code", """# %env LIGHTNING_NB_SMOKE=1      # uncomment for the smoke run with small sizes
import os
import time

DEVICE = os.environ.get("LIGHTNING_NB_DEVICE", "cpu")  # "cuda" (or "cuda:N") on a GPU: precision and sizes follow
ENGINE = "transformers"     # "vllm": a vLLM server (make setup-vllm; on a GPU, vLLM's CUDA build) serves the policy
MODEL_DIR = None            # None: SmolLM2-135M-Instruct; or a local Hugging Face model folder (0.5B-1.5B on one GPU)
GPU = DEVICE.startswith("cuda")
DTYPE = "bfloat16" if GPU else "float32"  # bfloat16 weights; the optimizer keeps float32 master weights
GRADIENT_CHECKPOINTING = GPU              # recompute activations in the backward pass: less memory

SMOKE = os.environ.get("LIGHTNING_NB_SMOKE") == "1"  # small sizes: a few minutes in all
STEPS = 2 if SMOKE else 4                           # training steps before the checkpoint (one more after loading it)
TASKS_PER_STEP = 2 if SMOKE else 16 if GPU else 4   # distinct tasks per step
GROUP_SIZE = 2 if SMOKE else 8 if GPU else 4        # rollouts per task (the GRPO group)
SAMPLE_ROUNDS = 1 if SMOKE else 3                   # DAPO dynamic sampling: resample groups whose rewards are all equal
MAX_TOKENS = 24 if SMOKE else 48                    # completion tokens per LLM call
N_RUNNERS = 4 if SMOKE else 64 if GPU else 8        # runner threads (and the engine's batch)
MICRO_BATCH_SIZE = 16 if GPU else 4                 # verl's tokens per forward: this many times the longest row
LEARNING_RATE = 2e-5
print(f"{DEVICE}, {DTYPE}, {ENGINE} engine: {TASKS_PER_STEP} tasks x {GROUP_SIZE} rollouts per step, "
      f"{N_RUNNERS} runners, micro-batch {MICRO_BATCH_SIZE}")"""),
    ("md", """## 1. Set-up

One function builds everything a kernel needs before training, so that section 4 can build it again as a new
kernel would: the engine serving the model (SmolLM2-135M-Instruct) in this process, the store, the
OpenAI-compatible LLM proxy, runner threads running the calculator agent (`lightning_nb.tasks.calc.calc_agent`, tasks
from `datasets/calc`), the trainer and the algorithm. Only the trainer's line differs from notebook 03. The
engine and the config take `DEVICE`, `DTYPE` and the sizes from the parameter cell.

`VerlConfig` takes `GRPOConfig`'s fields (`learning_rate`, `ppo_epochs`, `mini_batch_size`, `clip_ratio`,
`kl_coef`, `lora_rank`, `device`, `dtype`, ...). `overrides` passes any other key of verl's `ppo_trainer.yaml` as a
Hydra override; here verl's entropy bonus. A key that a field already sets is refused (set the field)."""),
    ("code", """from lightning_nb import AlgorithmConfig, InMemoryStore, LightningRL, LLMProxy, TransformersEngine, start_runners
from lightning_nb.tasks.calc import calc_agent, load_tasks
from lightning_nb.trainers.verl.trainer import VerlConfig, VerlTrainer


def make_engine():
    \"\"\"The engine of the parameter cell: ENGINE serving MODEL_DIR (None: the default model) on DEVICE in DTYPE.\"\"\"
    if ENGINE == "vllm":  # a server on DEVICE; the trainer moves the in-process copy it trains to DEVICE too
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from lightning_nb.engines.vllm import VLLMEngine

        if MODEL_DIR is None:
            return VLLMEngine.from_default(device=DEVICE, dtype=DTYPE)
        return VLLMEngine(AutoModelForCausalLM.from_pretrained(MODEL_DIR), AutoTokenizer.from_pretrained(MODEL_DIR),
                          model_name=os.path.basename(os.path.normpath(MODEL_DIR)), device=DEVICE, dtype=DTYPE)
    if MODEL_DIR is None:
        return TransformersEngine.from_default(device=DEVICE, dtype=DTYPE, max_batch_size=N_RUNNERS)
    return TransformersEngine.from_pretrained(MODEL_DIR, device=DEVICE, dtype=DTYPE, max_batch_size=N_RUNNERS)


def set_up():
    \"\"\"Engine, store, proxy, runners, trainer and algorithm, from the parameter cell.\"\"\"
    engine = make_engine()
    store = InMemoryStore()
    proxy = LLMProxy(engine, store).start()                             # binds 127.0.0.1 on a free port
    store.add_resources({"main_llm": proxy.as_resource()})
    runners = start_runners(calc_agent, store, n=N_RUNNERS)             # background threads; returns at once
    config = VerlConfig(learning_rate=LEARNING_RATE, device=DEVICE, dtype=DTYPE,  # or VerlConfig.one_gpu_lora()
                        gradient_checkpointing=GRADIENT_CHECKPOINTING, micro_batch_size=MICRO_BATCH_SIZE,
                        overrides=["actor_rollout_ref.actor.entropy_coeff=0.001"])
    trainer = VerlTrainer(engine, config)                               # verl checks the config here
    algo = LightningRL(store, trainer, load_tasks("train"),
                       config=AlgorithmConfig(tasks_per_step=TASKS_PER_STEP, group_size=GROUP_SIZE,
                                              max_tokens=MAX_TOKENS, temperature=0.7,
                                              max_sample_rounds=SAMPLE_ROUNDS))
    return engine, store, proxy, runners, trainer, algo


engine, store, proxy, runners, trainer, algo = set_up()
display(trainer)  # not a bare `trainer`: IPython's Out cache would keep it, and its engine, alive after a restart"""),
    ("md", """### The config as verl sees it

`config.hydra_overrides()` lists the verl keys the fields map to, followed by `overrides`.
`config.verl_config()` composes verl's own `ppo_trainer.yaml` with them and runs verl's checks (the trainer did
that when it was built, and `resume()` does it again after edits made while paused); `config.to_yaml()` prints
its actor section (about 160 lines; `to_yaml(None)` prints all of verl's config). Below: the overrides, then the
actor's PPO keys from the YAML."""),
    ("code", """config = trainer.config
print("verl overrides:")
for override in config.hydra_overrides():
    print("  " + override)

actor_yaml = config.to_yaml()
ppo_keys = ("clip_ratio", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "loss_agg_mode", "entropy_coeff",
            "use_kl_loss", "kl_loss_coef", "ppo_epochs", "grad_clip")
print(f"\\nverl's actor section ({len(actor_yaml.splitlines())} lines of YAML), its PPO keys:")
print("\\n".join(line for line in actor_yaml.splitlines() if line.split(":")[0] in ppo_keys))"""),
    ("md", """## 2. Train in the background, then pause

`algo.start(steps=...)` returns at once and trains in a background thread, so the notebook stays usable.
Wait for the first step, then `algo.pause()`: it returns True once the loop is parked at the next **step
boundary**: no verl update running, no rollouts enqueued (those already enqueued have finished), and the engine
free to serve (`engine.chat(...)` answers at once). The weights stay exactly as they are until you resume.
`algo.paused_at` names the boundary: `'before update'`, or `'between sample rounds'` when the next step had
already started collecting before the pause was asked (the rest of that step waits for `resume()`)."""),
    ("code", """algo.start(steps=STEPS)
while algo.global_step < 1 and algo.running:     # about a minute
    time.sleep(1)
if algo.error is not None:
    raise algo.error
parked = algo.pause(timeout=600)
print(f"paused at step boundary: {algo.paused_at!r} (parked: {parked}, step {algo.global_step}, state {algo.state!r})")
print("the model, while paused:", engine.chat("What is 2 + 3?", max_tokens=12))"""),
    ("md", """`algo.metrics_df()` has one row per step. Its `trainer` column says `verl`; the columns shared with
`GRPOTrainer` (`reward_mean`, `loss`, `grad_norm`, `groups_with_signal`, `tokens_trained`, ...) mean the same, and
every metric verl's loss reported is there under verl's own name."""),
    ("code", """metrics = algo.metrics_df()
verl_columns = [c for c in metrics.columns if c.startswith("actor/")]
print("verl metrics:", ", ".join(verl_columns))
metrics[["step", "trainer", "reward_mean", "loss", "grad_norm", "groups_with_signal", "tokens_trained",
         *verl_columns]]"""),
    ("md", """`trainer.last_batch_df()` is the optimizer's-eye view of the last update: one row per packed sequence verl
trained on, with its group, verl's GRPO `advantage`, the sequence length and its trained tokens, the PPO ratio,
the largest `|trainer − engine|` log-prob gap (nats) and the text. A group whose rewards were all equal gets
advantage 0 (verl still forwards it; it adds no policy gradient)."""),
    ("code", """batch = trainer.last_batch_df()
batch"""),
    ("md", """The same sequences token by token: context tokens in grey, trained tokens green for a positive advantage and
red for a negative one; hover a token for its log-probs."""),
    ("code", """from IPython.display import HTML

HTML(trainer.last_batch_html(max_rows=4))"""),
    ("md", """Resume, and wait for the remaining steps. (Config edits made while paused, e.g.
`trainer.config.learning_rate = 1e-5`, are checked by verl when you resume, as in notebook 03.)"""),
    ("code", """algo.resume()
algo.wait(progress=True)                 # blocks until the remaining steps are done
algo.state, algo.global_step"""),
    ("md", """## 3. Save a checkpoint in verl's layout

`algo.save(folder)` takes a folder, which plays verl's `trainer.default_local_dir`: it writes
`folder/global_step_N/trainer.pt` (the weights, the AdamW state, the RNG states, the task sampler, the step, the
metrics and the config; about **1.6 GB** for SmolLM2-135M in float32), then verl's tracker file
`folder/latest_checkpointed_iteration.txt`, and returns the step's folder. Here the folder is temporary and the
last cell deletes it; to continue after a real kernel restart, save to a folder of your own, e.g.
`runs/verl/checkpoints`."""),
    ("code", """import shutil
import tempfile
from pathlib import Path

run_dir = Path(tempfile.mkdtemp(prefix="verl-trainer-"))
step_dir = algo.save(run_dir)
size = sum(f.stat().st_size for f in step_dir.rglob("*") if f.is_file())
print(f"saved step {algo.global_step} to {step_dir.relative_to(run_dir)} ({size / 1e9:.2f} GB)")
print("latest_checkpointed_iteration.txt:", (run_dir / "latest_checkpointed_iteration.txt").read_text())"""),
    ("md", """## 4. Restart, load, continue

Now "restart": stop everything and build a fresh engine, store, proxy, runners, trainer and algorithm, exactly as a
new kernel would. After a real kernel restart (Kernel ▸ Restart) you would rerun the parameter cell and the set-up
cell (section 1) instead; the engine then starts from the default model's initial weights again.

`algo.load(folder)` uses verl's `resume_mode="auto"`: it loads the step named by
`latest_checkpointed_iteration.txt`. To load one step in particular:
`algo.load(folder / "global_step_2", resume_mode="resume_path")`. Either restores the weights (and serves them),
the optimizer, the RNG states, the step, the metrics, the config and the task sampler's state into the new
algorithm and its trainer; verl's actor is rebuilt from the restored config."""),
    ("code", """import gc

algo.stop()
runners.stop()
proxy.stop()
engine.close()
del engine, store, proxy, runners, trainer, algo, batch
gc.collect()

engine, store, proxy, runners, trainer, algo = set_up()        # what a new kernel runs first
algo.load(run_dir)                                             # resume_mode="auto": the latest step
print(f"loaded: step {algo.global_step}, {len(algo.metrics_df())} metrics rows, weight version {engine.weight_version}")"""),
    ("md", """Train one more step. The step counter, the metrics and the task sampler continue where the saved run stopped."""),
    ("code", """saved_step = algo.global_step
algo.start(steps=1)
algo.wait(progress=True)
assert algo.global_step == saved_step + 1
algo.metrics_df()[["step", "trainer", "reward_mean", "loss", "actor/pg_loss", "actor/pg_clipfrac", "lr"]]"""),
    ("md", """## On a GPU

Install the GPU extra (verl with vLLM, a CUDA build of torch) on a machine with an NVIDIA GPU:

```bash
pip install -e '.[gpu]'      # verl[vllm]==0.9.1, vllm 0.24, torch 2.11
```

Then change the parameter cell only, and run the notebook top to bottom:

```python
DEVICE = "cuda"                                   # bfloat16, gradient checkpointing, 16 tasks x 8 rollouts per
                                                  # step and 64 runners follow
MODEL_DIR = "/path/to/Qwen2.5-0.5B-Instruct"     # optional: any local Hugging Face model folder, 0.5B-1.5B
```

(or leave the cell as it is and start Jupyter with `LIGHTNING_NB_DEVICE=cuda`).

* `from_pretrained` (used when `MODEL_DIR` is set) reads a folder that exists with `local_files_only=True` (anything
  else is taken as a hub id and needs network); `device` and `dtype` load the weights there.
* For LoRA, replace the `VerlConfig(...)` line in `set_up()` with `VerlConfig.one_gpu_lora()`, verl's one-GPU
  LoRA recipe (`examples/tuning/0.5b/qwen2-0.5b_grpo-lora_1_h100_fsdp_vllm.sh`): CUDA, bfloat16, gradient
  checkpointing, LoRA rank 32 on all linear layers, learning rate 3e-5, a 0.001 KL loss (`low_var_kl`) to the base
  model and a 0.001 entropy bonus. It raises `ConfigError` on a machine without CUDA;
  `VerlConfig.one_gpu_lora(device="cpu", dtype="float32").hydra_overrides()` shows its verl keys anywhere.
  Keyword arguments replace fields, and `overrides` adds verl keys as above.
* For faster rollouts, set `ENGINE = "vllm"`: `lightning_nb.engines.vllm.VLLMEngine` starts a vLLM server (from the
  interpreter that has vLLM installed, `make setup-vllm`; on a GPU, vLLM's CUDA build) that the proxy forwards to,
  and keeps the model in this process for verl to train on `DEVICE`; after each verl update the trainer hands the
  new weights to the server (`engine.load_weights`), so every rollout comes from the current policy. Its docstring
  lists the server's settings.

**Pause** means the same on a GPU: the loop parks at a step boundary, with no verl update running and no rollouts
enqueued; the engine keeps serving, so you can chat with the model (`engine.chat(...)`) or look at
`trainer.last_batch_df()` while the GPU is otherwise idle. **After a kernel restart**, run the parameter cell and
the set-up cell again (the same engine, store, proxy, runners, `VerlTrainer` and `LightningRL`), then
`algo.load(folder)` with the folder you saved to, and `algo.start(steps=...)`: the run continues from
the latest `global_step_N`."""),
    ("code", """import torch

if torch.cuda.is_available():
    gpu_config = VerlConfig.one_gpu_lora()
else:  # the preset raises ConfigError without CUDA: build it for the CPU just to show its verl keys
    gpu_config = VerlConfig.one_gpu_lora(device="cpu", dtype="float32")
print(f"one_gpu_lora: LoRA rank {gpu_config.lora_rank}, verl overrides:")
print("\\n".join("  " + override for override in gpu_config.hydra_overrides()))"""),
    ("md", """## Clean up

Stop the background threads, close the engine and delete the checkpoint's temporary folder (no 1.6 GB file is
left behind)."""),
    ("code", """runners.stop()
proxy.stop()
engine.close()
shutil.rmtree(run_dir)
algo.state"""),
]


if __name__ == "__main__":
    main(CELLS, OUT)
