"""PromptTemplate: str.format and jinja2 engines, its variables, missing ones named, bad templates refused at
construction, stored sets of before the engine field still loading, and the calc agent's system prompt read from
the resources (no model: the agent's prompt function is called directly)."""

from __future__ import annotations

import pytest

from lightning_nb.errors import ConfigError
from lightning_nb.store.rules import coerce_resources
from lightning_nb.tasks.calc.agent import (
    SYSTEM_PROMPT, SYSTEM_PROMPT_RESOURCE, build_messages, calc_resources, system_prompt,
)
from lightning_nb.types import LLMResource, PromptTemplate, ResourcesUpdate

LLM = LLMResource(endpoint="http://127.0.0.1:9/v1", model="m")
TASK = {"id": 1, "question": "Tom has 2 pens and gets 3 more. How many?", "answer": 5}


def test_format_engine_fills_named_fields_and_lists_its_variables():
    t = PromptTemplate(template="Solve: {question} (as {user.name}, row {rows[0]:>3}) {{literal}}")
    assert t.engine == "format"
    assert t.variables == {"question", "user", "rows"}

    class User:
        name = "ana"

    assert t.format(question="2+2", user=User(), rows=[7], unused="extra fields are fine") == \
        "Solve: 2+2 (as ana, row   7) {literal}"
    assert PromptTemplate(template="no fields").variables == frozenset()


def test_a_missing_variable_is_a_config_error_naming_it_and_the_template():
    t = PromptTemplate(template="Q: {question} A: {answer}")
    with pytest.raises(ConfigError) as info:
        t.format(question="x")
    message = str(info.value)
    assert "['answer']" in message and "Q: {question} A: {answer}" in message and "['question']" in message


@pytest.mark.parametrize("text, names", [
    ("Solve {", "template"), ("{} and {0}", "positional"), ("{x!z}", "conversion"),
    ("{q.__class__}", "private"),
])
def test_a_format_template_that_does_not_parse_is_refused_at_construction(text, names):
    with pytest.raises(ConfigError, match="PromptTemplate.template") as info:
        PromptTemplate(template=text)
    assert names in str(info.value)


def test_jinja2_engine_renders_strictly_and_names_its_undeclared_variables():
    t = PromptTemplate(template="{% for n in numbers %}{{ n }}+{% endfor %}= ? {{ question | upper }}",
                       engine="jinja2")
    assert t.variables == {"numbers", "question"}  # the loop variable n is not one
    assert t.format(numbers=[1, 2], question="sum", other=0) == "1+2+= ? SUM"
    with pytest.raises(ConfigError, match=r"missing variable\(s\) \['question'\]"):
        t.format(numbers=[1])  # StrictUndefined: never an empty string
    with pytest.raises(ConfigError, match="PromptTemplate.template: not a jinja2 template"):
        PromptTemplate(template="{% if %}", engine="jinja2")
    with pytest.raises(ConfigError, match="SecurityError"):  # the sandbox: an LLM-written template stays harmless
        PromptTemplate(template="{{ q.__class__.__mro__ }}", engine="jinja2").format(q="x")
    with pytest.raises(ConfigError, match="PromptTemplate.engine"):
        PromptTemplate(template="x", engine="mako")


def test_stored_sets_without_the_engine_field_load_and_bad_ones_name_the_resource():
    old = '{"resources_id": "r", "resources": {"p": {"kind": "prompt_template", "template": "Hi {name}"}}}'
    loaded = ResourcesUpdate.model_validate_json(old).resources["p"]
    assert loaded == PromptTemplate(template="Hi {name}") and loaded.engine == "format"
    assert coerce_resources({"p": {"kind": "prompt_template", "template": "{{ x }}", "engine": "jinja2"}})["p"] \
        .variables == {"x"}
    with pytest.raises(ConfigError, match=r"resources\['p'\]: PromptTemplate.template"):
        coerce_resources({"p": {"kind": "prompt_template", "template": "oops {"}})


def test_the_calc_agent_reads_its_system_prompt_from_the_resources(store):
    assert system_prompt(TASK, None) == SYSTEM_PROMPT == system_prompt(TASK, {"main_llm": LLM})
    resources = calc_resources(LLM, "Answer this: {question}")
    assert system_prompt(TASK, resources) == f"Answer this: {TASK['question']}"
    assert build_messages(TASK["question"], system_prompt(TASK, resources))[0]["content"].startswith("Answer this")
    stored = store.add_resources(calc_resources(LLM))  # the default as a resource: the question, then the same text
    assert stored.resources[SYSTEM_PROMPT_RESOURCE].variables == {"question"}
    assert system_prompt(TASK, stored.resources) == f"The problem: {TASK['question']}\n{SYSTEM_PROMPT}"
    with pytest.raises(ConfigError, match=r"fills only \['question'\].*\['name'\]"):
        calc_resources(LLM, "Hi {name}")
    with pytest.raises(ConfigError, match=r"missing variable\(s\) \['name'\]"):  # a set published by hand
        system_prompt(TASK, {SYSTEM_PROMPT_RESOURCE: PromptTemplate(template="Hi {name}")})
    with pytest.raises(ConfigError, match="reads its system prompt from a PromptTemplate"):
        system_prompt(TASK, {SYSTEM_PROMPT_RESOURCE: LLM})
