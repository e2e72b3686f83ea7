"""An agent that declares ``resources`` gets its rollout's pinned resources set; ``Runner.step(...,
reward_required=False)`` keeps an unlabelled rollout (traffic) instead of failing it."""

from __future__ import annotations

from lightning_nb.runners import NO_REWARD_ERROR, Runner
from lightning_nb.tracing import Tracer
from lightning_nb.types import LLMResource, PromptTemplate

LLM = LLMResource(endpoint="http://127.0.0.1:9/v1", model="m")


def test_an_agent_with_a_resources_parameter_gets_the_set_its_rollout_was_pinned_to(store):
    seen = []

    def agent(task, llm, *, resources):
        seen.append((resources["system"].template, resources["main_llm"].endpoint == llm.endpoint))
        return 1.0

    store.add_resources({"main_llm": LLM, "system": PromptTemplate(template="v1")}, resources_id="main")
    pinned = store.enqueue_rollout({"q": 1})  # pinned to version 1 of "main" ...
    store.add_resources({"main_llm": LLM, "system": PromptTemplate(template="v2")}, resources_id="other")
    runner = Runner(agent, store, Tracer(store))
    runner.run_attempt(store.dequeue_rollout("w"))  # ... so it runs with v1 although v2 is now the latest
    runner.step({"q": 2})  # no resources_id given at start: the latest set
    assert pinned.resources_id == "main"
    # the LLM resource an agent gets in `resources` is the one attributed to its attempt, as `llm`
    assert seen == [("v1", True), ("v2", True)]


def test_a_two_argument_agent_is_called_as_before(store):
    store.add_resources({"main_llm": LLM, "system": PromptTemplate(template="v1")})
    rollout = Runner(lambda task, llm: 0.5, store, Tracer(store)).step({"q": 1})
    assert rollout.status == "succeeded" and store.final_reward(rollout.rollout_id) == 0.5


def test_step_without_a_required_reward_keeps_an_unlabelled_rollout(store):
    store.add_resources({"main_llm": LLM})
    runner = Runner(lambda task, llm: None, store, Tracer(store))
    unlabelled = runner.step({"q": 1}, reward_required=False)
    assert unlabelled.status == "succeeded" and store.final_reward(unlabelled.rollout_id) is None
    strict = runner.step({"q": 2})  # the default still refuses a forgotten reward
    assert strict.status == "failed"
    assert store.query_attempts(strict.rollout_id)[-1].error == NO_REWARD_ERROR
    assert runner._reward_optional == set()  # nothing left behind for later attempts
