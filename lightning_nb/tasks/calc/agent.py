"""The default agent: answers arithmetic word problems, optionally calling a calculator tool.

SmolLM2-135M has no native tool calling, so the tool protocol is plain text,
taught by the system prompt and two worked examples (RL then shapes it): one step
(``CALC: 12 + 30``), and two operations in one ``CALC`` (``CALC: 3 * 12 - 7``). The second
shows that one expression may hold every number of the question; without it the model copies
the first example's two numbers and never solves a two-operation task (0/22 held out, before
and after training: README, "Past the one-step plateau"). Its operations (``*`` then ``-``) are
those of no task in ``datasets/calc``, so it does not give away an answer's pattern:

* ``CALC: <expression>`` asks the calculator; the agent replies ``RESULT: <value>``;
* ``ANSWER: <number>`` ends the episode. Without ``ANSWER:``, the last number counts.

The system prompt is :data:`SYSTEM_PROMPT` unless the rollout's resources set holds a
:class:`~lightning_nb.types.PromptTemplate` named :data:`SYSTEM_PROMPT_RESOURCE` (``"system_prompt"``):
then the agent uses ``template.format(question=...)``, so an algorithm (APO) can change it by publishing a
new resources version. :data:`PROMPT_VARIABLES` are the fields it fills (``question``). The tunable default,
:data:`PROMPT_TEMPLATE`, is the problem (``{question}``) followed by :data:`SYSTEM_PROMPT`, so a prompt
written for this agent says where the task goes; publish it with
``store.add_resources(calc_resources(proxy.as_resource()))``. Without that resource (the demo, notebooks
01-05) the agent sends :data:`SYSTEM_PROMPT` as it is; the question is the last user message either way.

Reward: 1.0 when the final number equals the task's answer, else 0.0. With
``all_numbers_bonus`` > 0 the agent also emits one shaping term, an intermediate reward
named ``calc_uses_all_numbers`` (AIR, Agent Lightning §3.4), for its first ``CALC`` that
uses every number of the question: a separate reward component, never part of the final reward.
"""

from __future__ import annotations

import ast
import operator
import re
from typing import Any, Optional

from lightning_nb import semconv
from lightning_nb.tracing.tracer import emit_intermediate_reward, tool_span
from lightning_nb.errors import ConfigError
from lightning_nb.types import MAIN_LLM, LLMResource, PromptTemplate

__all__ = ["calc_agent", "calc_reward", "calculator", "parse_final_number", "SYSTEM_PROMPT", "build_messages",
           "uses_all_numbers", "ALL_NUMBERS_COMPONENT", "SYSTEM_PROMPT_RESOURCE", "PROMPT_VARIABLES",
           "calc_resources", "system_prompt", "PROMPT_TEMPLATE"]

SYSTEM_PROMPT = (
    "Solve the math problem. You have a calculator: write CALC: <expression> to use it. "
    "Then write ANSWER: <number>."
)
#: The resources name of the system prompt template the agent reads (:func:`system_prompt`).
SYSTEM_PROMPT_RESOURCE = "system_prompt"
#: The fields :func:`calc_agent` fills in its system prompt template (the task's ``question``).
PROMPT_VARIABLES = ("question",)
#: The system prompt as a template (:func:`calc_resources`' default, what APO starts from): the problem in
#: ``{question}``, then :data:`SYSTEM_PROMPT`. Held-out reward of SmolLM2-135M on ``load_tasks("val")[:32]``
#: (greedy, 48 tokens, 2026-11-28): 0.406 with this, 0.438 with :data:`SYSTEM_PROMPT` alone (one task apart),
#: 0.219 with the problem *after* :data:`SYSTEM_PROMPT`.
PROMPT_TEMPLATE = "The problem: {question}\n" + SYSTEM_PROMPT
EXAMPLE = [
    {"role": "user", "content": "Tom has 12 pens and gets 30 more. How many pens does Tom have now?"},
    {"role": "assistant", "content": "CALC: 12 + 30"},
    {"role": "user", "content": "RESULT: 42"},
    {"role": "assistant", "content": "ANSWER: 42"},
    {"role": "user", "content": "Ana buys 3 boxes of 12 eggs and then uses 7 eggs. How many eggs does Ana have left?"},
    {"role": "assistant", "content": "CALC: 3 * 12 - 7"},
    {"role": "user", "content": "RESULT: 29"},
    {"role": "assistant", "content": "ANSWER: 29"},
]
_CALC = re.compile(r"CALC:\s*([0-9+\-*/(). ]+)")
_ANSWER = re.compile(r"ANSWER:\s*(-?\d+(?:\.\d+)?)")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
ALL_NUMBERS_COMPONENT = "calc_uses_all_numbers"
_UNSIGNED_NUMBER = re.compile(r"\d+(?:\.\d+)?")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculator(expression: str) -> str:
    """Evaluate + - * / and parentheses safely; returns the value or an error message as text."""
    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError("unsupported expression")
    try:
        value = ev(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError) as exc:
        return f"error: {exc}"
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def parse_final_number(text: str) -> Optional[float]:
    """The number after ``ANSWER:``, else the last number in ``text``, else None."""
    m = _ANSWER.search(text)
    if m:
        return float(m.group(1))
    nums = _NUMBER.findall(text.replace(",", ""))
    return float(nums[-1]) if nums else None


def calc_reward(final_text: str, task: dict[str, Any]) -> float:
    """1.0 if the final number in ``final_text`` equals ``task["answer"]``, else 0.0."""
    value = parse_final_number(final_text)
    return 1.0 if value is not None and abs(value - float(task["answer"])) < 1e-6 else 0.0


def uses_all_numbers(expression: str, question: str) -> bool:
    """Whether ``expression`` contains every number of ``question``, each as often as the question has it.

    ``uses_all_numbers("29 + 16 - 12", "... 29 marbles, gets 16 more, then gives away 12 ...")`` is True;
    ``"29 - 12"`` is False. Numbers are unsigned decimal literals; a question without numbers gives False.
    """
    want = _UNSIGNED_NUMBER.findall(question.replace(",", ""))
    have = _UNSIGNED_NUMBER.findall(expression)
    return bool(want) and all(have.count(n) >= want.count(n) for n in set(want))


def build_messages(question: str, system_prompt: str = SYSTEM_PROMPT) -> list[dict[str, str]]:
    return [{"role": "system", "content": system_prompt}, *EXAMPLE, {"role": "user", "content": question}]


def calc_resources(llm: LLMResource, prompt: str | PromptTemplate = PROMPT_TEMPLATE) -> dict[str, Any]:
    """The resources set the calc agent reads: ``{"main_llm": llm, "system_prompt": PromptTemplate(prompt)}``.

    ``store.add_resources(calc_resources(proxy.as_resource()))`` publishes the default prompt,
    :data:`PROMPT_TEMPLATE` (it uses ``{question}``), as a tunable resource (what
    :class:`~lightning_nb.algorithm.apo.APO` starts from).

    Raises:
        ConfigError: ``prompt`` uses a variable other than :data:`PROMPT_VARIABLES`, or does not parse.
    """
    template = prompt if isinstance(prompt, PromptTemplate) else PromptTemplate(template=prompt)
    unknown = sorted(template.variables - set(PROMPT_VARIABLES))
    if unknown:
        raise ConfigError(f"calc_resources(prompt=...): the calc agent fills only {list(PROMPT_VARIABLES)}, "
                          f"the template also uses {unknown}")
    return {MAIN_LLM: llm, SYSTEM_PROMPT_RESOURCE: template}


def system_prompt(task: dict[str, Any], resources: Optional[dict[str, Any]] = None) -> str:
    """The system prompt of ``task``'s episode: the resources' :data:`SYSTEM_PROMPT_RESOURCE` template filled
    with ``question=task["question"]``, or :data:`SYSTEM_PROMPT` when there is none.

    Raises:
        ConfigError: that resource is not a PromptTemplate, or it uses a variable other than ``question``
            (the attempt fails with this error, naming the variable).
    """
    template = (resources or {}).get(SYSTEM_PROMPT_RESOURCE)
    if template is None:
        return SYSTEM_PROMPT
    if not isinstance(template, PromptTemplate):
        raise ConfigError(f"resources[{SYSTEM_PROMPT_RESOURCE!r}] is a {type(template).__name__}; the calc agent "
                          "reads its system prompt from a PromptTemplate there")
    return template.format(question=task["question"])


def calc_agent(task: dict[str, Any], llm: LLMResource, *, resources: Optional[dict[str, Any]] = None,
               max_turns: int = 3, reward_fn: Any = None, all_numbers_bonus: float = 0.0) -> float:
    """Run one episode with the OpenAI SDK against ``llm.endpoint`` and return its (final) reward.

    ``resources``: the rollout's resources set (the runner passes it); its ``"system_prompt"``
    PromptTemplate, if any, replaces :data:`SYSTEM_PROMPT` (:func:`system_prompt`).
    Sampling comes from ``llm.sampling_parameters`` (temperature, max_tokens).
    ``reward_fn(final_text, task) -> float`` defaults to :func:`calc_reward`.

    ``all_numbers_bonus`` (default 0: off): after the first ``CALC`` whose expression uses every
    number of the question (:func:`uses_all_numbers`), emit an intermediate reward of this value
    named :data:`ALL_NUMBERS_COMPONENT` (``"calc_uses_all_numbers"``), credited to that LLM call
    (:func:`lightning_nb.emit_intermediate_reward`; the trainer adds it per ``GRPOConfig.credit``).
    It shows as its own row in ``store.rewards_df()`` (column ``component``); the returned final
    reward stays 1.0 only for the right answer. Use it with ``functools.partial(calc_agent,
    all_numbers_bonus=0.2)``.
    """
    import openai

    messages = build_messages(task["question"], system_prompt(task, resources))
    client = openai.OpenAI(base_url=llm.endpoint, api_key=llm.api_key, max_retries=0, timeout=600)
    sampling = {"temperature": 1.0, "max_tokens": 48, **llm.sampling_parameters}
    text = ""
    shaped = False
    try:
        for turn in range(max_turns):
            reply = client.chat.completions.create(model=llm.model, messages=messages, **sampling)
            text = reply.choices[0].message.content or ""
            messages.append({"role": "assistant", "content": text})
            call = _CALC.search(text)
            if _ANSWER.search(text) or call is None or turn == max_turns - 1:
                break
            with tool_span("calculator", call.group(1).strip()) as span:
                result = calculator(call.group(1))
                span.set_attribute(semconv.TOOL_OUTPUT, result)
            if all_numbers_bonus and not shaped and uses_all_numbers(call.group(1), task["question"]):
                emit_intermediate_reward(all_numbers_bonus, name=ALL_NUMBERS_COMPONENT, expression=call.group(1).strip())
                shaped = True
            messages.append({"role": "user", "content": f"RESULT: {result}"})
    finally:
        client.close()
    return (reward_fn or calc_reward)(text, task)
