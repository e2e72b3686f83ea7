"""The judges' prompts: documented module constants a user can override (pass others to ``Judge``/``GroupJudge``).

Both prompts are few-shot: a model as small as SmolLM2-135M copies a format it has seen far more reliably than one
it was only told about (measured in ``bench/judge_agreement.py``: the parse rate). ``{rubric}``, ``{lo}`` and
``{hi}`` in a system prompt are filled with the judge's rubric and scale (``str.format``); an example's score is
written as ``lo`` or ``hi`` of the judge's scale, so the examples fit any scale.
"""

from __future__ import annotations

from typing import Any, Sequence

from lightning_nb.errors import ConfigError

__all__ = ["JUDGE_SYSTEM_PROMPT", "JUDGE_USER_TEMPLATE", "JUDGE_EXAMPLES", "DEFAULT_RUBRIC",
           "GROUP_SYSTEM_PROMPT", "GROUP_EXAMPLES", "judge_messages", "group_messages", "fmt_score"]

#: What a judge grades against when no rubric is given ({lo}/{hi}: the judge's scale).
DEFAULT_RUBRIC = "{hi} if the response correctly does the task, {lo} if it does not."

#: The single judge's system prompt: a short verdict, then a last line ``SCORE: <number>`` (parsed by
#: :func:`lightning_nb.rewards.parse_score`: the last such line counts).
JUDGE_SYSTEM_PROMPT = (
    "You grade a response to a task. Rubric: {rubric}\n"
    "Write one short sentence about the response, then a last line: SCORE: <a number from {lo} to {hi}>."
)
#: The user turn of each example and of the graded response.
JUDGE_USER_TEMPLATE = "Task: {task}\nResponse: {response}"
#: Worked examples ``(task, response, verdict, good)``: the assistant turn is ``verdict`` then ``SCORE: hi`` when
#: ``good`` else ``SCORE: lo``.
JUDGE_EXAMPLES: tuple[tuple[str, str, str, bool], ...] = (
    ("What is 3 + 4?", "ANSWER: 7", "The answer 7 is right.", True),
    ("Name the capital of France.", "Berlin", "Berlin is wrong; it is Paris.", False),
    ("What is 9 - 5?", "ANSWER: 2", "The answer 2 is wrong; 9 - 5 is 4.", False),
    ("Write a greeting.", "Hello, nice to meet you!", "It is a friendly greeting.", True),
)

#: The group judge's system prompt (RULER-style, OpenPipe ART: every trajectory of a group in one call, scored
#: relative to the others): one line ``SCORE <n>: <number>`` per trajectory and nothing else (SmolLM2-135M, asked
#: for a reason after each score, wrote one long line and stopped; without them it writes the lines).
GROUP_SYSTEM_PROMPT = (
    "You compare several responses to the same task. Rubric: {rubric}\n"
    "Score them relative to each other: a better response gets a higher score. "
    "Write one line per response, in order: SCORE <n>: <a number from {lo} to {hi}>."
)
#: Worked examples ``(task, responses, good flags)`` for the group judge. Each is shown cut to the group's size
#: ``n`` (its first ``n`` responses; all of them when it has fewer), so the judge sees replies with exactly one
#: ``SCORE <k>: <hi or lo>`` line per response of a group of that size: a small model copies the count.
GROUP_EXAMPLES: tuple[tuple[str, tuple[str, ...], tuple[bool, ...]], ...] = (
    ("What is 3 + 4?",
     ("ANSWER: 12", "ANSWER: 7", "3 + 4 = 7", "ANSWER: 1", "It is 7.", "ANSWER: 34", "ANSWER: 8", "7"),
     (False, True, True, False, True, False, False, True)),
    ("Name the capital of France.",
     ("Paris", "Berlin", "Paris.", "London", "It is Paris.", "Rome", "France", "The capital is Paris."),
     (True, False, True, False, True, False, False, True)),
)


def fmt_score(value: float) -> str:
    """A score as the prompts write it: ``1`` rather than ``1.0``."""
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def _system(template: str, rubric: str, lo: float, hi: float) -> str:
    """The system prompt with the rubric and scale filled in.

    Raises:
        ConfigError: the rubric or system prompt has a ``{field}`` other than ``{lo}``/``{hi}`` (and ``{rubric}``);
            write a literal brace as ``{{`` or ``}}``.
    """
    lo_s, hi_s = fmt_score(lo), fmt_score(hi)
    try:
        return template.format(rubric=rubric.format(lo=lo_s, hi=hi_s), lo=lo_s, hi=hi_s)
    except (KeyError, IndexError, ValueError) as exc:
        raise ConfigError(f"judge rubric / system_prompt: {{{exc.args[0] if exc.args else ''}}} is not a field they "
                          "may use ({lo}, {hi}; the system prompt also {rubric}); write a literal brace as {{ or }}"
                          ) from None


def judge_messages(task: str, response: str, *, rubric: str, scale: tuple[float, float], system_prompt: str,
                   user_template: str, examples: Sequence[tuple[str, str, str, bool]]) -> list[dict[str, Any]]:
    """The single judge's chat messages: system, the examples (user/assistant pairs), then the graded response."""
    lo, hi = scale
    out = [{"role": "system", "content": _system(system_prompt, rubric, lo, hi)}]
    for ex_task, ex_response, verdict, good in examples:
        out += [{"role": "user", "content": user_template.format(task=ex_task, response=ex_response)},
                {"role": "assistant", "content": f"{verdict}\nSCORE: {fmt_score(hi if good else lo)}"}]
    out.append({"role": "user", "content": user_template.format(task=task, response=response)})
    return out


def _group_user(task: str, responses: Sequence[str]) -> str:
    return f"Task: {task}\n\n" + "\n\n".join(f"Response {i}:\n{r}" for i, r in enumerate(responses, 1))


def group_messages(task: str, responses: Sequence[str], *, rubric: str, scale: tuple[float, float],
                   system_prompt: str, examples: Sequence[tuple[str, Sequence[str], Sequence[bool]]]
                   ) -> list[dict[str, Any]]:
    """The group judge's chat messages: system, the examples (each cut to ``len(responses)`` responses), then the
    task and the numbered trajectories."""
    lo, hi = scale
    out = [{"role": "system", "content": _system(system_prompt, rubric, lo, hi)}]
    n = len(responses)
    for ex_task, ex_responses, good in examples:
        lines = [f"SCORE {i}: {fmt_score(hi if g else lo)}" for i, g in enumerate(good[:n], 1)]
        out += [{"role": "user", "content": _group_user(ex_task, ex_responses[:n])},
                {"role": "assistant", "content": "\n".join(lines)}]
    out.append({"role": "user", "content": _group_user(task, responses)})
    return out
