"""APO's numbers match the user's (issue 53, item 5): its rollouts sample as the agent does unless
``APOConfig.temperature`` is set, ``best()`` says which, and a tie on the training tasks is broken on held-out.

The agent is real (real runner threads, a real store) and makes no LLM call: its reward depends only on its system
prompt. The critic and the editor are a small real OpenAI-compatible HTTP server (``conftest.FixedChatServer``) that
answers the critic with a fixed critique and the editor with a fixed prompt, so the candidates are known in advance
and the test needs no model.
"""

from __future__ import annotations

import pytest

from lightning_nb.algorithm.apo import APO, APOConfig
from lightning_nb.errors import ConfigError
from lightning_nb.runners import start_runners
from lightning_nb.store import InMemoryStore
from lightning_nb.types import LLMResource, PromptTemplate

from conftest import FixedChatServer

CHECKS = "Solve it, then check your work."
CRITIQUE = "Ask the solver to check the result."


def tasks(split: str, checks: list[bool]) -> list[dict]:
    return [{"id": f"{split}-{i}", "question": f"What is {i} + {i}?", "check": c} for i, c in enumerate(checks)]


@pytest.fixture
def check_run():
    """``(store, proxy server, temperatures the agent saw)``: 2 runner threads of an agent whose reward is 1.0 when
    its system prompt asks for a check exactly when the task wants one; its LLM resource samples at 0.9."""
    # the critic's request holds "CRITIC" (APOConfig.critic_prompt below); the editor's gets the fixed prompt
    proposer = FixedChatServer(lambda text: CRITIQUE if "CRITIC" in text else f"<prompt>{CHECKS}</prompt>")
    store = InMemoryStore()
    seen: list = []

    def agent(task, llm, *, resources):
        seen.append(llm.sampling_parameters.get("temperature"))
        return 1.0 if ("check" in resources["system_prompt"].format().lower()) == task["check"] else 0.0

    store.add_resources({"main_llm": LLMResource(endpoint=proposer.url, model="fixed",
                                                 sampling_parameters={"temperature": 0.9}),
                         "system_prompt": PromptTemplate(template="Solve the task.")}, resources_id="target")
    runners = start_runners(agent, store, n=2)
    try:
        yield store, proposer, seen
    finally:
        runners.stop()
        proposer.close()


def _apo(store, **config) -> APO:
    # training tasks: one wants a check, one does not, so the start ("Solve the task.") and the editor's prompt
    # (asks for a check) score 0.5 each there: a tie. Held out, every task wants a check: the editor's prompt is better.
    cfg = dict(rounds=1, beam_width=2, branch_factor=1, batch_size=2, critic_prompt="CRITIC: say what to fix.",
               editor_prompt="Rewrite: {prompt}", **config)
    return APO(store, tasks("train", [True, False]), tasks("val", [True] * 4), resources_id="target",
               config=APOConfig(**cfg))


def test_a_tie_on_the_training_tasks_is_measured_on_held_out_before_the_winner_is_chosen(check_run):
    store, proposer, seen = check_run
    apo = _apo(store)
    apo.run()
    round1 = apo.beam_df()
    assert round1.set_index("candidate_id")["score"].to_dict() == {"c0": 0.5, "c1": 0.5}  # a tie on training
    assert apo.winner().id == "c0" and apo.tied() == ["c0", "c1"]  # the beam keeps the older first
    assert apo.candidates["c1"].template.template == CHECKS
    best = apo.best()
    # both tied candidates were run on every held-out task; the better one there is the winner, and it is published
    assert len(apo.candidates["c1"].held_out) == 4 and len(apo.candidates["c0"].held_out) == 4
    assert (best.winner_id, best.winner_score, best.start_score, best.n) == ("c1", 1.0, 0.0, 4)
    assert best.tied == (("c0", 0.0), ("c1", 1.0)) and best.keeps_winner
    assert "tied on the training tasks: c0 0.000, c1 1.000 held-out" in str(best)
    assert apo.published[-1]["candidate_id"] == "c1"
    assert store.get_resources_by_id("target").resources["system_prompt"].template == CHECKS


def test_apo_samples_as_the_agent_does_unless_its_temperature_is_set_and_says_which(check_run):
    store, _, seen = check_run
    apo = _apo(store, publish=False)
    assert apo.evaluate("c0") == 0.0  # start: no check asked, every val task wants one
    assert set(seen) == {0.9}  # the agent's own sampling (its resource's temperature), not greedy
    val = [r for r in store.query_rollouts() if r.mode == "val"]
    assert val and all("temperature" not in r.metadata["sampling_parameters"] for r in val)
    assert apo.sampling() == ("the agent's own sampling (temperature 0.9 from the 'main_llm' resource; "
                              "APOConfig.temperature=None)")
    assert "sampling: the agent's own sampling (temperature 0.9" in str(apo.best())

    seen.clear()
    greedy = _apo(store, publish=False, temperature=0.0)
    greedy.evaluate("Solve the task, with a check.")
    assert set(seen) == {0.0}
    assert greedy.sampling() == "temperature 0 (APOConfig.temperature, not the agent's own sampling)"
    assert "sampling: temperature 0 (APOConfig.temperature" in str(greedy.best())


def test_apo_config_temperature_takes_none_or_a_number_in_range():
    assert APOConfig().temperature is None
    for bad in (-0.1, 5.5, "0", True):
        with pytest.raises(ConfigError, match=r"APOConfig.temperature must be None \(the agent's own sampling\) or "
                                              r"a number in \[0, 5\]"):
            APOConfig(temperature=bad)
