"""APO with the real SmolLM2-135M as agent, critic and editor, through the real proxy and runner threads.

One smoke-size run (2 rounds, beam 2, 2 candidates per parent, 4 tasks, 12 tokens per call) checks the
mechanism: every candidate runs on the same tasks, the beam keeps the top scores, a pause parks the loop at a
round boundary, the winner is published as a new version of the runners' resources set and a rollout enqueued
afterwards runs with it (its pinned set, version and the system message the proxy recorded), and save/load
round-trips. Whether a 135M proposer finds a *better* prompt is bench/apo_calc.py's question, not this test's.
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
from lightning_nb.tasks.calc.agent import calc_resources
from lightning_nb.types import LLMResource, PromptTemplate

SMOKE = dict(rounds=2, beam_width=2, branch_factor=2, batch_size=3, max_tokens=12, proposer_max_tokens=48)


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


def test_candidates_run_on_the_same_tasks_and_the_beam_keeps_the_top_scores(finished_run, calc_store):
    apo, _ = finished_run
    store, _ = calc_store
    assert apo.state == "finished" and apo.round == 2
    beam = apo.beam_df()
    made = [c for call in apo.calls for c in call["candidates"] if c is not None]
    assert made, f"the editor gave no candidate: {apo.calls_df()[['role', 'errors']]}"
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
    assert set(new["parent"]) <= set(beam["candidate_id"])
    assert list(beam[(beam["round"] == 2) & beam["kept"]]["candidate_id"]) == apo.beam
    critic = apo.calls_df().query("role == 'critic' and errors.str.len() == 0")
    assert critic["prompt"].map(lambda p: "Assistant replies:" in p and "Reward: 0" in p).all()


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


def test_the_winner_is_published_and_a_later_rollout_runs_with_it(finished_run, calc_store):
    apo, _ = finished_run
    store, _ = calc_store
    best, score = apo.best()
    assert best == apo.winner().template and 0.0 <= score <= 1.0
    assert score == apo.evaluate(apo.winner().id)  # held-out rewards are kept per task: no second run
    latest = store.get_latest_resources()
    assert latest.resources_id == "calc" and latest.version == 2 == apo.published[-1]["version"]
    assert latest.resources["system_prompt"] == best and isinstance(latest.resources["main_llm"], LLMResource)
    task = load_tasks("val")[10]
    rollout = store.enqueue_rollout(task, metadata={"sampling_parameters": {"temperature": 0.0, "max_tokens": 8}})
    assert rollout.resources_id == "calc"
    assert store.wait_for_rollouts([rollout.rollout_id], timeout=120)[0].status == "succeeded"
    llm = [s for s in store.query_spans(rollout.rollout_id) if s.name == semconv.LLM_SPAN][0]
    system = json.loads(llm.attributes[semconv.PROMPT])[0]
    assert system == {"role": "system", "content": best.format(question=task["question"])}


def test_bad_input_is_refused_with_the_field_named(calc_store, engine):
    store, proxy = calc_store
    tasks = load_tasks("train")[:2]
    with pytest.raises(ConfigError, match="beam_width must be an int >= 1"):
        APOConfig(beam_width=0)
    with pytest.raises(ConfigError, match=r"critic_prompt uses \['answer'\]"):
        APOConfig(critic_prompt="Why did {prompt} fail on {answer}?")
    bare = InMemoryStore()
    bare.add_resources({"main_llm": proxy.as_resource()}, resources_id="no-prompt")
    with pytest.raises(ConfigError, match="'system_prompt'.*calc_resources"):
        APO(bare, tasks)
    with pytest.raises(ConfigError, match="attempt's URL"):
        APO(store, tasks, critic=LLMResource(endpoint=proxy.endpoint("ro-1", "at-1"), model="m"),
            resources_id="calc")
    apo = APO(store, tasks, resources_id="calc", config=APOConfig(variables=["question"]))
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
    dead = APO(store, tasks, resources_id="calc", critic=LLMResource(endpoint="http://127.0.0.1:9/v1", model="m"))
    with pytest.raises(LightningNbError, match="critic at http://127.0.0.1:9/v1"):
        dead._call(1, "critic", "c0", dead.critic, "Why?", 1)
    assert dead.calls_df()["errors"][0][0].startswith("APIConnectionError")  # recorded before it raised
