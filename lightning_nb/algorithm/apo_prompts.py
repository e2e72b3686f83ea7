"""What APO's proposer reads and writes: the critic's and editor's prompts, and how their replies are read.

APO (:mod:`lightning_nb.algorithm.apo`) follows ProTeGi (Pryzant et al. 2023, "Automatic Prompt Optimization
with 'Gradient Descent' and Beam Search", EMNLP): a *critic* LLM reads the current prompt and episodes it
failed and writes why (the textual "gradient"); an *editor* LLM reads the prompt and that critique and
writes new prompts (the step against the gradient). Both prompts are ``str.format`` templates, module
constants here, and ``APOConfig.critic_prompt`` / ``APOConfig.editor_prompt`` replace them:

* :data:`CRITIC_PROMPT` may use ``{prompt}`` (the candidate's text) and ``{failures}`` (:func:`failures_text`);
* :data:`EDITOR_PROMPT` may use ``{prompt}``, ``{critique}`` (the critic's reply), ``{failures}`` and
  ``{variables}`` (:func:`variables_text`: the sentence asking to keep the fields the agent fills).

The editor is asked for ``APOConfig.branch_factor`` choices in one call (the OpenAI ``n`` parameter); each
choice gives at most one candidate (:func:`candidate_text`), and none when :func:`not_a_prompt` finds it is a
critique or an answer rather than a prompt.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Optional, Sequence

__all__ = ["CRITIC_PROMPT", "EDITOR_PROMPT", "CRITIC_VARIABLES", "EDITOR_VARIABLES", "candidate_text",
           "failures_text", "not_a_prompt", "variables_text"]

#: The critic's prompt (ProTeGi's "gradient" prompt, shortened for small models). Fields: ``{prompt}``,
#: ``{failures}``.
CRITIC_PROMPT = (
    "I am writing a system prompt for an AI assistant. My current prompt is:\n"
    "\"{prompt}\"\n\n"
    "With this prompt the assistant got these examples wrong:\n"
    "{failures}\n\n"
    "Give at most three short reasons why the prompt could have led to these mistakes."
)
#: The editor's prompt (ProTeGi's "edit" prompt). Fields: ``{prompt}``, ``{critique}``, ``{failures}``,
#: ``{variables}``.
EDITOR_PROMPT = (
    "I am writing a system prompt for an AI assistant. My current prompt is:\n"
    "\"{prompt}\"\n\n"
    "A reviewer says what is wrong with it:\n"
    "{critique}\n\n"
    "Write an improved system prompt that fixes these problems.{variables} Reply with the new prompt only, "
    "between <prompt> and </prompt>."
)
#: The fields each proposer prompt may use.
CRITIC_VARIABLES = frozenset({"prompt", "failures"})
EDITOR_VARIABLES = frozenset({"prompt", "critique", "failures", "variables"})

_TAGGED = re.compile(r"<prompt>(.*?)(?:</prompt>|$)", re.IGNORECASE | re.DOTALL)
_QUOTES = "\"'`“”"
# A reply that speaks *about* a prompt (a critique), not *to* the assistant: "the prompt", "the original prompt" ...
_ABOUT_PROMPT = re.compile(r"\b(?:the|this|that|my|your|current|original|old|new|improved|revised|above|previous|"
                           r"system)\s+prompt\b", re.IGNORECASE)
# How critiques and answers open: "1. The ...", "The correct response ...", "The answer is ...", "ANSWER: 42"
_CRITIQUE_OR_ANSWER = re.compile(
    r"^\W*(?:\d+\s*[.):]\s*\S|(?:here\s+(?:is|are)|reasons?|because|the\s+(?:reviewer|mistake|issue|reason|"
    r"problem\s+(?:is|was)|answer|response|output|result)|the\s+\w+\s+(?:answer|response|output|result|reply))\b"
    r"|answer\s*:|result\s*:)", re.IGNORECASE)
_WORD = re.compile(r"\w+")


def failures_text(failures: Sequence[dict[str, Any]], max_chars: int = 300) -> str:
    """The ``{failures}`` field: one numbered block per failed episode, each part cut to ``max_chars`` characters.

    Each failure is a dict: ``input`` (the task as text), ``replies`` (the model's completions of the
    rollout's latest attempt, in turn order, from its LLM spans), ``reward`` (final; a failed rollout's is
    0) and ``error`` (the attempt's error, or None).
    """
    def cut(text: str) -> str:
        text = " ".join(str(text).split())
        return text if len(text) <= max_chars else text[:max_chars - 3] + "..."

    blocks = []
    for k, f in enumerate(failures, 1):
        lines = [f"Example {k}", f"Input: {cut(f['input'])}",
                 f"Assistant replies: {cut(' | '.join(f['replies'])) if f['replies'] else '(none)'}",
                 f"Reward: {f['reward']:g}"]
        if f.get("error"):
            lines.append(f"Error: {cut(f['error'])}")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def variables_text(names: Iterable[str], engine: str = "format") -> str:
    """The ``{variables}`` field: " Keep {question} in it: the assistant's input goes there." for the fields the
    agent fills (``{{ question }}`` for a jinja2 template), or "" when it fills none."""
    names = sorted(names)
    if not names:
        return ""
    shown = ", ".join("{{ %s }}" % n if engine == "jinja2" else "{%s}" % n for n in names)
    return f" Keep {shown} in it: the assistant's input goes there."


def candidate_text(reply: Optional[str]) -> Optional[str]:
    """The candidate prompt in one editor reply, or None when it holds none.

    The text between ``<prompt>`` and ``</prompt>`` (or the end of the reply, when a reply cut at
    ``max_tokens`` never closed the tag); in a reply without the tag, the whole reply. Surrounding
    whitespace and quotes are stripped. None: the reply, or the tagged part, is empty.
    """
    if reply is None:
        return None
    match = _TAGGED.search(reply)
    text = match.group(1) if match else reply
    text = text.strip().strip(_QUOTES).strip()
    return text or None


def not_a_prompt(text: str, critique: str = "") -> Optional[str]:
    """Why an editor's candidate ``text`` is a critique or an answer rather than a prompt, or None when it may be one.

    Small editors (SmolLM2-135M) often reply with the critique again or with a task's answer ("1. The original
    prompt was too wordy ...", "The correct response to the question asks for the capital of Spain ...", "The
    correct output for the input 41 is 141."). Such a reply is refused when it

    * opens as a critique or an answer does: a numbered point (``1.``), "Here is", "Because", "Reasons", "The
      reviewer/mistake/issue/reason/answer/response/output/result", "The problem is", "The <word> answer/response/
      output/result/reply" ("The correct response"), ``ANSWER:``, ``RESULT:``;
    * speaks about a prompt ("the prompt", "the original prompt", "this system prompt", ...) instead of to the
      assistant;
    * repeats the critique: half or more of its word 4-grams (of at least 4) are in ``critique``.

    These are text rules, so a prompt that happens to match one is refused too (the reason says which rule); the
    editor's prompt asks for the new prompt alone between ``<prompt>`` tags, which passes them.
    """
    opening = _CRITIQUE_OR_ANSWER.match(text)
    if opening:
        return f"it opens like a critique or an answer ({opening.group(0).strip()!r}), not a prompt"
    about = _ABOUT_PROMPT.search(text)
    if about:
        return f"it speaks about a prompt ({about.group(0)!r}): a critique, not a prompt"
    grams = _ngrams(text, 4)
    if len(grams) >= 4 and critique:
        copied = len(grams & _ngrams(critique, 4)) / len(grams)
        if copied >= 0.5:
            return f"it repeats the critique ({copied:.0%} of its word 4-grams are the critique's)"
    return None


def _ngrams(text: str, n: int) -> set[tuple[str, ...]]:
    words = [w.lower() for w in _WORD.findall(text)]
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}
