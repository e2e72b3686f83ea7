"""Write notebooks/06_prompts_judges_traffic.ipynb (committed without outputs).

Run: python notebooks/make_06_prompts_judges_traffic.py

Beyond weight updates from hand-written rewards (reference doc 000: "Algorithm", "Online/Continuous Learning"): APO
tunes the calc agent's system prompt, a resource, instead of weights; an LLM judge scores replies that have no
checkable answer, alone and as a GRPO group (RULER-style); and cells send traffic through the proxy, a person labels
a few replies, and one update trains on them. tests/test_notebooks.py executes it with nbclient;
``LIGHTNING_NB_SMOKE=1`` selects small parameters.
"""

from __future__ import annotations

from pathlib import Path

from _nbgen import main  # notebooks/_nbgen.py: build_notebook(CELLS) is the notebook

OUT = Path(__file__).resolve().parent / "06_prompts_judges_traffic.ipynb"

CELLS = [
    ("md", """# Prompts, judges and traffic: learning beyond hand-written rewards

Three things the training loop of notebook 01 does not do, on one engine, one proxy and one store:

1. **APO** (automatic prompt optimisation): the algorithm changes a `PromptTemplate` resource, the agent's system
   prompt, instead of the weights. A critic LLM reads failed episodes, an editor LLM writes new prompts, and a beam
   keeps the best. The starting prompt is candidate zero: the winner is published as a new version of the resources
   (so runners pick it up) only if it beats the start on held-out tasks, else the start stays.
2. **LLM-judge rewards** for a task with no checkable answer: `judge_reward` inside an agent (the judge's call is a
   span of its own, never trained on), and a `GroupJudge` that scores a whole GRPO group in one call (RULER-style).
3. **Learning from traffic**: cells send requests through the proxy's `/traffic` route as users would, a person
   labels a few replies with `store.label`, and `TrafficLearner` runs one update on exactly those, which
   `updates_df()` lists and `undo()` rolls back.

Everything runs on SmolLM2-135M on the CPU, which is a weak critic, editor and judge: this notebook shows the
mechanisms, not what a strong proposer achieves ([Prompts, judges and traffic](../docs/prompts-judges-traffic.md)
and [Performance](../docs/performance.md#prompts-judges-and-traffic) have the measured numbers). At these sizes the
notebook took 2.7 min on an idle 2-core CPU (the APO cell 1.9 min, the judge cells 17 s, the traffic cells 14 s),
and 33 min when other jobs shared the two cores (load average 4-7: the APO cell 29 min, the judge cells 3.5 min)
(2026-11-28, `bench/notebook_cell_times.py` measures it), and 4.0 min beside one other job (the APO cell 3.3 min;
2026-11-29). The smoke run the tests use took 1.1 min idle, 12 min shared. Set `LIGHTNING_NB_SMOKE=1` before the first code cell runs for it: uncomment its `%env` line, or start Jupyter
with `LIGHTNING_NB_SMOKE=1 jupyter lab`."""),
    ("code", """# %env LIGHTNING_NB_SMOKE=1      # uncomment for the smoke run with small sizes
import os
import tempfile

SMOKE = os.environ.get("LIGHTNING_NB_SMOKE") == "1"
APO_TASKS = 3 if SMOKE else 8        # training tasks each APO round runs every prompt on
APO_VAL = 2 if SMOKE else 32         # held-out tasks the start and the winner are scored on
APO_ROUNDS = 1 if SMOKE else 2       # APO rounds
MAX_TOKENS = 24 if SMOKE else 48     # the agent's completion tokens per LLM call
N_RUNNERS = 4 if SMOKE else 8        # runner threads (and the engine's batch)
WORK = tempfile.mkdtemp(prefix="lightning_nb_06_")   # APO's save file and the traffic update's checkpoint"""),
    ("md", """## 1. The prompt is a resource

`calc_resources(llm)` is the calc agent's resources set: the proxy's endpoint and its system prompt as a
`PromptTemplate` named `"system_prompt"`. The agent declares a `resources` parameter, so each rollout hands it the
set it was pinned to when it was enqueued; without a `"system_prompt"` it falls back to the constant. The template
fills `{question}`, the agent's one variable: a prompt written for this agent says where the problem goes."""),
    ("code", """from lightning_nb import InMemoryStore, LLMProxy, PromptTemplate, TransformersEngine, start_runners
from lightning_nb.tasks.calc import calc_agent, calc_resources, load_tasks

engine = TransformersEngine.from_default(max_batch_size=N_RUNNERS)
store = InMemoryStore()
proxy = LLMProxy(engine, store).start()
store.add_resources(calc_resources(proxy.as_resource()), resources_id="calc")
runners = start_runners(calc_agent, store, n=N_RUNNERS)
start = store.get_resources_by_id("calc").resources["system_prompt"]
print("variables:", sorted(start.variables), "| template:", start.template[:80])"""),
    ("code", """# A template is checked when it is made and when it is filled: a missing variable names itself.
try:
    PromptTemplate(template="Solve: {question} in {units}").format(question="2 + 2")
except ValueError as exc:
    print(type(exc).__name__, "-", exc)
PromptTemplate(template="Solve {{ question }} step by step.", engine="jinja2").format(question="2 + 2")"""),
    ("md", """## 2. APO: beam search over prompts

Each round runs every prompt of the beam on the same training tasks (each candidate in its own resources set, its
rollouts pinned to it), shows the critic the failures, asks the editor for new prompts, runs those on the same
tasks and keeps the top `beam_width`. The critic and editor here are the same 135M model through the proxy's plain
URL (served, never recorded as spans); pass `critic=`/`editor=` an `LLMResource` for a stronger endpoint.
`start()` runs in the background like `LightningRL`: `pause()` parks it at a round boundary. The training tasks
here are two-operation ones, which the untrained model mostly gets wrong, so the critic has failures to read.

The starting prompt is candidate `c0` and competes in the beam like any other. An editor reply that is not a prompt
for this agent (no `{question}` in it, or a critique or an answer instead of a prompt) is no candidate: `calls_df()`
says why in `errors`, and it is never run. A 135M editor writes few prompts, so expect many such rows."""),
    ("code", """from lightning_nb import APO, APOConfig

two_ops = [t for t in load_tasks("train") if t["ops"] == 2]
apo = APO(store, two_ops[:APO_TASKS], load_tasks("val")[:APO_VAL], config=APOConfig(
    rounds=APO_ROUNDS, beam_width=2, branch_factor=2, batch_size=APO_TASKS, max_tokens=MAX_TOKENS,
    proposer_max_tokens=48 if SMOKE else 160))
apo.start()
apo.wait(timeout=3600)   # 2 min on an idle 2-core CPU, 29 on a busy one (see the top)
apo.beam_df()[["round", "candidate_id", "score", "n", "kept", "parent", "text"]]"""),
    ("code", """apo.calls_df()[["round", "role", "parent", "candidates", "errors"]]   # every critic and editor call"""),
    ("md", """When the rounds end, APO scores the start (`c0`) and the winner (the top of the beam, chosen on the
training tasks) on the same held-out tasks, and publishes the winner only if it beats the start there by more than
`APOConfig.publish_margin` (0.05 of mean reward: 2 of 32 tasks); else the start stays (`"calc"` is written again
unchanged, only so that it is the store's latest set again). `apo.best()` returns both scores and the verdict (it
reuses the held-out rewards `run()` measured)."""),
    ("code", """best = apo.best()             # the start (c0) and the winner, on the same held-out tasks
print(best)                   # the verdict in one line
print(f"held-out reward: start {best.start_score:.3f} -> winner {best.winner_score:.3f} ({best.n} tasks)")
calc = store.get_resources_by_id("calc")
print(f"published: {'the winner ' + best.winner_id if best.keeps_winner else 'not the winner: the start stays'}; "
      f"{calc.version} versions of 'calc', the latest holds {best.candidate_id}")
apo.save(os.path.join(WORK, "apo.json"))
best.df()"""),
    ("md", """## 3. Judge rewards

A one-sentence summary has no checkable answer. The agent asks a judge: `judge_reward` calls the judge on the
proxy's plain URL (so the judge's tokens are never trained on), records a `judge` span with the prompt, the verdict
and the score, and lists the score in `rewards_df()` as the reward component `"judge"`. Here the agent returns the
judge's score as its final reward, beside a hand-written length check. A verdict without a usable score is
recorded, not raised: `score()` returns None (the agent gives 0 then) and `rewards_df()` shows why in its
`judge_error` column. `Runner.step` runs one rollout in this cell's thread."""),
    ("code", """from openai import OpenAI
from tqdm.auto import tqdm

from lightning_nb.rewards import GroupJudge, Judge, JudgeError
from lightning_nb.runners import Runner
from lightning_nb.tracing import Tracer, emit_intermediate_reward

TEXT = ("The town library will close for two weeks in July to replace its roof. Books can be returned at the "
        "school next door, and the reading club meets in the park instead.")
RUBRIC = "A good summary is one sentence that keeps the main fact: the library closes for two weeks for repairs."


def summary_agent(task, llm):
    client = OpenAI(base_url=llm.endpoint, api_key=llm.api_key)
    reply = client.chat.completions.create(model=llm.model, max_tokens=40, messages=[
        {"role": "user", "content": "Write a one-sentence summary of this text: " + task["text"]}])
    summary = reply.choices[0].message.content or ""
    emit_intermediate_reward(1.0 if summary.count(".") <= 1 else 0.0, name="one_sentence")  # hand-written
    score = Judge(llm, rubric=RUBRIC).score(summary, task=task["text"])
    # None: the judge gave no usable score; recorded (its span keeps the verdict, rewards_df() its judge_error)
    return 0.0 if score is None else score


runner = Runner(summary_agent, store, Tracer(store))
# a bar with one tick per rollout (the agent and its judge: seconds each)
summaries = [runner.step({"text": TEXT}).rollout_id for _ in tqdm(range(3), desc="summaries")]
rewards = store.rewards_df().query("rollout_id in @summaries")
print("judge calls without a score:", rewards["judge_error"].notna().sum())
rewards.pivot_table("reward", "rollout_id", "component")"""),
    ("code", """from lightning_nb import semconv

spans = store.spans_df(flatten=[semconv.JUDGE_VERDICT, semconv.JUDGE_SCORE]).query("rollout_id in @summaries")
print("judge spans:", (spans["name"] == semconv.JUDGE_SPAN).sum(), "| LLM spans, the only ones a trainer reads:",
      (spans["name"] == semconv.LLM_SPAN).sum())
spans[spans["name"] == semconv.JUDGE_SPAN][["rollout_id", semconv.JUDGE_VERDICT, semconv.JUDGE_SCORE]]"""),
    ("md", """**A group judge** (RULER-style) sees the whole group at once and scores each reply relative to the others, in one
call. `LightningRL(..., group_judge=GroupJudge(...))` runs it after each round's rollouts finish, before the adapter
reads the rewards; here it scores the three summaries above. With `as_reward=True` (the default) its score becomes
each rollout's final reward; the reward it replaced stays listed as the component `"agent"`."""),
    ("code", """group = GroupJudge(rubric=RUBRIC)
try:
    print("group scores:", group.score_group(store, summaries))
except JudgeError as exc:   # a 135M judge may not give one score per reply: the spans keep its verdict
    print("group judge:", exc)
store.rewards_df().query("rollout_id in @summaries").pivot_table("reward", "rollout_id", "component")"""),
    ("md", """## 4. Learning from traffic

People already send the agent work. Requests to the proxy's opt-in `/traffic/v1` route become one-call rollouts,
unlabelled; the response names its rollout in the `X-Rollout-Id` header. A person labels some replies with
`store.label(rollout_id, reward)`, and `TrafficLearner` trains on labelled traffic it has not used yet, while people
keep working. Equal requests whose labels differ form GRPO groups; every other labelled request (seen once, or
labelled like its equals) trains against a running baseline, so one label is enough. `learner.wait()` shows what
it waits for (labelled, unlabelled) on its bar and, when nothing moves well past its own pace, says why and what
to do."""),
    ("code", """import pandas as pd

client = OpenAI(base_url=proxy.traffic_endpoint(), api_key="not-needed")
questions = ["What is 12 + 7?", "What is 9 * 3?", "What is 12 + 7?", "What is 9 * 3?"]
sent = {}
for q in questions:
    raw = client.chat.completions.with_raw_response.create(
        model=proxy.served_models[0], messages=[{"role": "user", "content": q}], max_tokens=16, temperature=0.9)
    sent[raw.headers["X-Rollout-Id"]] = (q, raw.parse().choices[0].message.content)
pd.DataFrame([(r, q, a) for r, (q, a) in sent.items()], columns=["rollout_id", "question", "reply"])"""),
    ("code", """from lightning_nb import GRPOConfig, GRPOTrainer
from lightning_nb.algorithm.traffic import TrafficConfig, TrafficLearner, is_traffic

trainer = GRPOTrainer(engine, GRPOConfig(learning_rate=2e-5))
learner = TrafficLearner(store, trainer, TrafficConfig(min_labelled=4, poll_s=0.5),
                         select=lambda r: is_traffic(r) and r.rollout_id in sent, checkpoint_dir=WORK)
learner.start()       # polls in the background; nothing is labelled yet, so it waits
print(learner.poll())"""),
    ("code", """# A person reads the replies above and labels them: 1.0 right, 0.0 wrong. Here, the first of each question
# is called right and the second wrong, so each group has a signal whatever the model wrote.
ids = list(sent)
store.label(ids[0], 1.0, note="labelled right in this cell")
store.label(ids[1], 1.0, note="labelled right in this cell")
store.label(ids[2], 0.0, note="labelled wrong in this cell")
store.label(ids[3], 0.0, note="labelled wrong in this cell")
learner.wait(until_step=1, timeout=900)
learner.pause()
learner.updates_df()[["update", "n", "rollout_ids", "reward_mean", "weight_version_before", "weight_version_after"]]"""),
    ("code", """learner.undo()        # the weights before update 1 again; its rollouts stay used
print("after undo:", learner.updates_df()[["update", "undone"]].to_dict("records"))"""),
    ("md", """## 5. Clean up

Stop the learner and the runners, the proxy, and free the engine and the files written."""),
    ("code", """import shutil

learner.stop(); learner.close()
runners.stop()
proxy.stop()
engine.close()
shutil.rmtree(WORK, ignore_errors=True)"""),
]

if __name__ == "__main__":
    main(CELLS, OUT)
