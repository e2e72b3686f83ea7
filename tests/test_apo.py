"""APO with the real SmolLM2-135M as agent, critic and editor, through the real proxy and runner threads.

One smoke-size calc run (2 rounds, beam 2, 2 candidates per parent, 3 tasks, 12 tokens per call) checks the
mechanism: every candidate runs on the same tasks, the beam keeps the top scores, a pause parks the loop at a
round boundary, the start and the winner are scored on the same held-out tasks and the winner is published only if
it beat the start (a rollout enqueued afterwards runs with what the set holds), every editor reply that is not a
prompt is recorded and never run, and save/load round-trips.

Whether a 135M editor writes a prompt at all is luck (it never writes ``{question}`` back, even when asked to
repeat it), so the publishing rule is checked with runs whose outcome is known: ``check_agent`` is a real agent
(real runners, store and proxy) whose reward depends only on its system prompt, which fills no variable, and the
real 135M editor is asked, at temperature 0, to repeat a given text (``EDITOR_SAYS``). It answered "I'm ready to
help. Solve it, then check your work: ..." (a prompt that asks for a check) and repeated the critique word for word.
Whether a 135M proposer finds a *better* calc prompt is bench/apo_calc.py's question, not these tests'.
"""

from __future__ import annotations

import json

import pytest

from lightning_nb import semconv
from lightning_nb.algorithm.apo import APO, APOConfig
from lightning_nb.errors import ConfigError, LightningNbError
from lightning_nb.runners import start_runners
from lightning_nb.store import InMemoryStore
from lightning_nb.tasks.calc import calc_agent, load_tasks
from lightning_nb.tasks.calc.agent import PROMPT_TEMPLATE, calc_resources
from lightning_nb.types import LLMResource, PromptTemplate

SMOKE = dict(rounds=2, beam_width=2, branch_factor=2, batch_size=3, max_tokens=12, proposer_max_tokens=48)
# An editor prompt (APOConfig.editor_prompt) the 135M model follows at temperature 0: repeat the given text
EDITOR_SAYS = "Repeat exactly this text and nothing else:\n<prompt>{reply}</prompt>"
CHECKS = "Solve it, then check your work."  # check_agent's reward is 1.0 on tasks that want a check
CRITIQUE = "The correct response to the question asks for the capital of Spain, which is Madrid."  # issue 43's


@pytest.fixture(scope="module")
def calc_store(engine):
    """``(store, proxy)``: the calc agent's set (``main_llm`` and ``system_prompt``) published as ``"calc"``,
    with 8 runner threads consuming the store."""
    from lightning_nb.proxy.proxy import LLMProxy

    store = InMemoryStore()
    proxy = LLMProxy(engine, store).start()
    store.add_resources(calc_resources(proxy.as_resource()), resources_id="calc")
    runners = start_runners(calc_agent, store, n=8)
    yield store, proxy
    runners.stop()
    proxy.stop()


@pytest.fixture(scope="module")
def finished_run(calc_store, tmp_path_factory):
    """One APO run, paused once at a round boundary and resumed; ``(apo, paused_at, state while paused)``."""
    store, _ = calc_store
    apo = APO(store, load_tasks("train")[:3], load_tasks("val")[:3], config=APOConfig(**SMOKE))
    apo.start()
    assert apo.pause(timeout=300)
    paused_at, state, rounds_when_paused = apo.paused_at, apo.state, apo.round
    saved = apo.save(tmp_path_factory.mktemp("apo") / "paused.json")
    apo.resume()
    assert apo.wait(timeout=600)
    return apo, (paused_at, state, rounds_when_paused, saved)


def check_agent(task, llm, *, resources):
    """A real agent whose reward depends only on its system prompt: 1.0 when the prompt asks for a check exactly
    when the task wants one (``task["check"]``), else 0.0. It makes no LLM call, so its rollouts take milliseconds."""
    return 1.0 if ("check" in resources["system_prompt"].format().lower()) == task["check"] else 0.0


def check_resources(proxy) -> dict:
    return {"main_llm": proxy.as_resource(), "system_prompt": PromptTemplate(template="Solve the task.")}


def check_tasks(split: str, n: int, check: bool) -> list[dict]:
    return [{"id": f"{split}-{i}", "question": f"What is {i} + {i}?", "check": check} for i in range(n)]


@pytest.fixture(scope="module")
def check_store(engine):
    """``(store, proxy)`` with 4 runner threads of ``check_agent``; each test publishes its own target set."""
    from lightning_nb.proxy.proxy import LLMProxy

    store = InMemoryStore()
    proxy = LLMProxy(engine, store).start()
    store.add_resources(check_resources(proxy))
    runners = start_runners(check_agent, store, n=4)
    yield store, proxy
    runners.stop()
    proxy.stop()


def check_apo(check_store, name: str, val_check: bool, editor_reply: str, **config) -> APO:
    """An APO on a fresh target set ``name`` (start: ``Solve the task.``, reward 0 on the training tasks, which want
    a check) whose editor, the real 135M model at temperature 0, is asked to repeat ``editor_reply``."""
    store, proxy = check_store
    store.add_resources(check_resources(proxy), resources_id=name)
    cfg = dict(rounds=1, beam_width=2, branch_factor=1, batch_size=2, proposer_temperature=0.0, proposer_max_tokens=40,
               critic_prompt="Say: use a check.", editor_prompt=EDITOR_SAYS.format(reply=editor_reply))
    return APO(store, check_tasks("train", 2, True), check_tasks(f"{name}-val", 4, val_check), resources_id=name,
               config=APOConfig(**{**cfg, **config}))


def test_candidates_run_on_the_same_tasks_and_the_beam_keeps_the_top_scores(finished_run, calc_store):
    apo, _ = finished_run
    store, _ = calc_store
    assert apo.state == "finished" and apo.round == 2
    beam = apo.beam_df()
    made = [c for call in apo.calls for c in call["candidates"] if c is not None]
    for r, rows in beam.groupby("round"):
        assert (rows["n"] == 3).all()  # every candidate of the round scored on all 3 tasks
        kept, dropped = rows[rows["kept"]], rows[~rows["kept"]]
        assert len(kept) == min(2, len(rows)) and list(rows["rank"]) == list(range(1, len(rows) + 1))
        if len(dropped):
            assert kept["score"].min() >= dropped["score"].max()
        # ... and "the same tasks" is what the store ran: each candidate's rollouts hold the same inputs
        inputs = {}
        for ro in store.query_rollouts():
            meta = ro.metadata.get("apo", {})
            if meta.get("run") == apo.run_id and ro.mode == "train" and meta.get("candidate") in set(rows["candidate_id"]):
                inputs.setdefault(meta["candidate"], set()).add(ro.input["id"])
        assert len({frozenset(v) for v in inputs.values()}) == 1 and len(next(iter(inputs.values()))) == 3
    new = beam[beam["new"]]
    assert set(new["candidate_id"]) == set(made)
    critiques = {(c["round"], c["parent"]): c["replies"][0] for c in apo.calls if c["role"] == "critic" and c["replies"]}
    for _, row in new.iterrows():  # each new prompt carries the critique of its parent in its round
        assert row["critique"] == critiques[(row["round"], row["parent"])]
        assert "{question}" in row["text"]  # a prompt for the calc agent says where the question goes
    assert set(new["parent"]) <= set(beam["candidate_id"])
    assert list(beam[(beam["round"] == 2) & beam["kept"]]["candidate_id"]) == apo.beam
    critic = apo.calls_df().query("role == 'critic' and errors.str.len() == 0")
    assert critic["prompt"].map(lambda p: "Assistant replies:" in p and "Reward: 0" in p).all()


def test_every_editor_reply_that_is_not_a_prompt_is_recorded_and_never_run(finished_run, calc_store):
    """Whatever the 135M editor wrote in the calc run: each choice gave a candidate or an error, never both."""
    apo, _ = finished_run
    store, _ = calc_store
    editor = apo.calls_df().query("role == 'editor'")
    assert len(editor), "the editor was never asked"
    for _, call in editor.iterrows():
        assert len(call["candidates"]) == len(call["replies"])
        refused = [c for c in call["candidates"] if c is None]
        assert len(refused) == len(call["errors"])  # one "choice k: why" per refused reply
    ran = {ro.metadata["apo"]["candidate"] for ro in store.query_rollouts()
           if ro.metadata.get("apo", {}).get("run") == apo.run_id}
    assert ran == set(apo.candidates)  # only candidates run; a refused reply is no candidate


def test_a_critique_from_the_editor_is_refused_and_the_start_stays(check_store):
    store, _ = check_store
    apo = check_apo(check_store, "critique", True, CRITIQUE)
    apo.run()
    editor = apo.calls_df().query("role == 'editor'").iloc[0]
    assert editor["candidates"] == [None] and "opens like a critique" in editor["errors"][0], editor["replies"]
    assert set(apo.candidates) == {"c0"} and set(apo.beam_df()["candidate_id"]) == {"c0"}
    assert {ro.metadata["apo"]["candidate"] for ro in store.query_rollouts()
            if ro.metadata.get("apo", {}).get("run") == apo.run_id} == {"c0"}  # the critique never ran
    best = apo.best()
    assert best.winner_id == "c0" and not best.keeps_winner and "the start stays" in str(best)
    assert store.get_resources_by_id("critique").resources["system_prompt"].template == "Solve the task."


def test_a_winner_is_published_only_if_it_beats_the_start_on_held_out_by_more_than_the_margin(check_store):
    store, _ = check_store
    apo = check_apo(check_store, "margin", True, CHECKS, publish_margin=1.0)  # a gain of 1.0 is not > 1.0
    apo.run()
    best = apo.best()
    assert best.winner_id == "c1" and "check your work" in best.winner.template, apo.calls_df()["replies"].tolist()
    assert (best.start_score, best.winner_score, best.n, best.margin) == (0.0, 1.0, 4, 1.0)
    target = store.get_resources_by_id("margin")
    assert not best.keeps_winner and best.template == best.start and "the start stays" in str(best)
    assert target.resources["system_prompt"] == best.start and target.version == 2  # rewritten: the latest again
    assert store.get_latest_resources().resources_id == "margin" and apo.published[-1]["candidate_id"] == "c0"
    apo.config.publish_margin = 0.05  # the same measured gain, the default margin: run() now publishes the winner
    with pytest.warns(DeprecationWarning, match=r"run\(steps=\.\.\.\)"):  # the contract's name; rounds= warns
        apo.run(rounds=0)
    target = store.get_resources_by_id("margin")
    assert target.resources["system_prompt"] == best.winner and target.version == 3
    assert apo.published[-1]["candidate_id"] == "c1" and "APO keeps the winner" in str(apo.best())


def test_a_winner_better_on_training_tasks_but_worse_held_out_is_not_published(check_store):
    """The issue's case: the winner beats the start on the training tasks and loses on held-out tasks."""
    store, _ = check_store
    apo = check_apo(check_store, "overfit", False, CHECKS)  # the val tasks want no check
    apo.run()
    rounds = apo.beam_df()
    assert list(rounds["candidate_id"]) == ["c1", "c0"] and list(rounds["score"]) == [1.0, 0.0]  # c1 wins on train
    best = apo.best()
    assert (best.winner_id, best.start_score, best.winner_score) == ("c1", 1.0, 0.0)
    assert not best.keeps_winner and best.candidate_id == "c0" and best.score == 1.0
    assert store.get_resources_by_id("overfit").resources["system_prompt"] == best.start
    table = best.df()
    assert list(table.index) == ["start", "winner"] and list(table["held_out"]) == [1.0, 0.0]
    assert list(table["kept"]) == [True, False] and list(table["candidate_id"]) == ["c0", "c1"]


def test_the_start_and_the_winner_are_scored_on_the_same_held_out_tasks(finished_run, calc_store):
    apo, _ = finished_run
    store, _ = calc_store
    best = apo.best()
    start, winner = apo.candidates["c0"], apo.winner()
    val = [t["id"] for t in load_tasks("val")[:3]]
    assert set(start.held_out) == set(winner.held_out) == set(val) and best.n == 3
    assert best.start_score == sum(start.held_out.values()) / 3
    assert best.winner_score == sum(winner.held_out.values()) / 3
    assert best.start == start.template and (best.winner_id, best.winner) == (winner.id, winner.template)
    held_out = {}
    for ro in store.query_rollouts():
        meta = ro.metadata.get("apo", {})
        if meta.get("run") == apo.run_id and ro.mode == "val":
            held_out.setdefault(meta["candidate"], set()).add(ro.input["id"])
    assert held_out["c0"] == set(val) == held_out[winner.id]  # the store ran both on the same val tasks
    assert best == apo.best()  # held-out rewards are kept per task: no second run


def test_what_run_published_is_what_a_later_rollout_runs_with(finished_run, calc_store):
    apo, _ = finished_run
    store, _ = calc_store
    best = apo.best()
    latest = store.get_latest_resources()
    assert latest.resources_id == "calc" and latest.version == 2 == apo.published[-1]["version"]
    assert apo.published[-1]["candidate_id"] == best.candidate_id  # the winner only if it beat the start
    assert latest.resources["system_prompt"] == best.template and isinstance(latest.resources["main_llm"], LLMResource)
    task = load_tasks("val")[10]
    rollout = store.enqueue_rollout(task, metadata={"sampling_parameters": {"temperature": 0.0, "max_tokens": 8}})
    assert rollout.resources_id == "calc"
    assert store.wait_for_rollouts([rollout.rollout_id], timeout=120)[0].status == "succeeded"
    llm = [s for s in store.query_spans(rollout.rollout_id) if s.name == semconv.LLM_SPAN][0]
    system = json.loads(llm.attributes[semconv.PROMPT])[0]
    assert system == {"role": "system", "content": best.template.format(question=task["question"])}


def test_the_calc_prompt_takes_the_question_and_a_candidate_must_too(calc_store):
    store, proxy = calc_store
    start = calc_resources(proxy.as_resource())["system_prompt"]
    assert start.template == PROMPT_TEMPLATE and start.variables == {"question"}
    apo = APO(store, load_tasks("train")[:2], resources_id="calc", config=APOConfig(publish=False))
    parent = apo.candidates["c0"]
    assert "uses ['num']; the agent fills only ['question']" in apo._candidate("Add {num} and {question}", parent,
                                                                                 "why", 1)[1]
    assert "uses none of the agent's variables ['question']" in apo._candidate("Use the calculator.", parent,
                                                                                "why", 1)[1]
    cand, error = apo._candidate("Use CALC: for every step of {question}", parent, "why", 1)
    assert error is None and cand.template.variables == {"question"}


@pytest.mark.parametrize("reply, why", [
    ("The correct response to the question asks for the capital of Spain. {question}", "opens like a critique"),
    ("The correct output for the input 41 is 141. {question}", "opens like a critique"),
    ("1. The original prompt was too wordy. {question}", "opens like a critique"),
    ("ANSWER: 42 {question}", "opens like a critique or an answer"),
    ("Solve {question}, because the prompt was too short", "speaks about a prompt"),
    ("The reviewer is right about {question}", "opens like a critique"),
])
def test_a_reply_that_answers_or_criticises_is_no_candidate(calc_store, reply, why):
    store, _ = calc_store
    apo = APO(store, load_tasks("train")[:2], resources_id="calc", config=APOConfig(publish=False))
    cand, error = apo._candidate(reply, apo.candidates["c0"], "why", 1)
    assert cand is None and why in error
    copied = "the assistant used only two of the three numbers in its calculation of {question}"
    assert "repeats the critique" in apo._candidate(copied, apo.candidates["c0"], copied.upper(), 1)[1]


def test_a_pause_parks_at_a_round_boundary_and_save_load_round_trips(finished_run, calc_store, tmp_path):
    apo, (paused_at, state, rounds_when_paused, saved) = finished_run
    store, _ = calc_store
    assert state == "paused"
    assert paused_at in ("before round", "before propose", "before evaluate candidates")
    copy = APO(store, load_tasks("train")[:3], load_tasks("val")[:3], config=APOConfig(**SMOKE), resources_id="calc")
    copy.load(saved)
    assert copy.round == rounds_when_paused and copy.run_id == apo.run_id
    path = apo.save(tmp_path / "done.json")
    copy.load(path)
    assert copy.beam == apo.beam and copy.round == 2
    assert copy.beam_df().equals(apo.beam_df()) and copy.calls == apo.calls
    assert copy.winner().template == apo.winner().template
    assert copy.candidates["c0"].rewards == apo.candidates["c0"].rewards
    assert json.loads(path.read_text())["format"] == "lightning_nb.apo/1"
    (tmp_path / "other.json").write_text("{}")
    with pytest.raises(ConfigError, match="not an APO save file"):
        copy.load(tmp_path / "other.json")
    with pytest.raises(ConfigError, match=r"APO.load\(\) takes no options.*resume_mode"):  # the contract's **options
        copy.load(path, resume_mode="auto")


def test_bad_input_is_refused_with_the_field_named(calc_store, engine):
    store, proxy = calc_store
    tasks = load_tasks("train")[:2]
    with pytest.raises(ConfigError, match="beam_width must be an int >= 1"):
        APOConfig(beam_width=0)
    with pytest.raises(ConfigError, match="publish_margin must be a number >= 0"):
        APOConfig(publish_margin=-0.1)
    with pytest.raises(ConfigError, match=r"critic_prompt uses \['answer'\]"):
        APOConfig(critic_prompt="Why did {prompt} fail on {answer}?")
    with pytest.raises(ConfigError, match=r"publish=True needs val_tasks.*APOConfig\(publish=False\)"):
        APO(store, tasks, resources_id="calc")
    bare = InMemoryStore()
    bare.add_resources({"main_llm": proxy.as_resource()}, resources_id="no-prompt")
    with pytest.raises(ConfigError, match="'system_prompt'.*calc_resources"):
        APO(bare, tasks, config=APOConfig(publish=False))
    with pytest.raises(ConfigError, match="attempt's URL"):
        APO(store, tasks, critic=LLMResource(endpoint=proxy.endpoint("ro-1", "at-1"), model="m"),
            resources_id="calc", config=APOConfig(publish=False))
    apo = APO(store, tasks, resources_id="calc", config=APOConfig(variables=["question"], publish=False))
    parent = apo.candidates["c0"]
    assert apo._candidate("", parent, "why", 1)[0] is None and "no candidate" in apo._candidate("", parent, "why", 1)[1]
    assert "no candidate" in apo._candidate("<prompt> </prompt>", parent, "why", 1)[1]
    assert "uses ['answer']" in apo._candidate("Say {answer}", parent, "why", 1)[1]
    assert "not a valid template" in apo._candidate("Use { braces", parent, "why", 1)[1]
    assert "same prompt as c0" in apo._candidate(parent.template.template, parent, "why", 1)[1]
    cand, error = apo._candidate("<prompt>Think, then write ANSWER: {question}</prompt> notes", parent, "why", 1)
    assert error is None and cand.template == PromptTemplate(template="Think, then write ANSWER: {question}")
    with pytest.raises(ConfigError, match="has none"):
        apo.best()
    with pytest.raises(ConfigError, match="'c99' is not a candidate"):
        apo.evaluate("c99", tasks)
    dead = APO(store, tasks, resources_id="calc", critic=LLMResource(endpoint="http://127.0.0.1:9/v1", model="m"),
               config=APOConfig(publish=False))
    with pytest.raises(LightningNbError, match="critic at http://127.0.0.1:9/v1"):
        dead._call(1, "critic", "c0", dead.critic, "Why?", 1)
    assert dead.calls_df()["errors"][0][0].startswith("APIConnectionError")  # recorded before it raised
