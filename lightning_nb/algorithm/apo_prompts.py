"""What APO's proposer reads and writes: the critic's and editor's prompts, and how their replies are read.

APO (:mod:`lightning_nb.algorithm.apo`) follows ProTeGi (Pryzant et al. 2023, "Automatic Prompt Optimization
with 'Gradient Descent' and Beam Search", EMNLP): a *critic* LLM reads the current prompt and episodes it
failed and writes why (the textual "gradient"); an *editor* LLM reads the prompt and that critique and
writes new prompts (the step against the gradient). Both prompts are ``str.format`` templates, module
constants here, and ``APOConfig.critic_prompt`` / ``APOConfig.editor_prompt`` replace them:

* :data:`CRITIC_PROMPT` may use ``{prompt}`` (the candidate's text) and ``{failures}`` (:func:`failures_text`);
* :data:`EDITOR_PROMPT` may use ``{prompt}``, ``{critique}`` (the critic's reply) and ``{failures}``.

The editor is asked for ``APOConfig.branch_factor`` choices in one call (the OpenAI ``n`` parameter); each
choice gives at most one candidate (:func:`candidate_text`).
"""

from __future__ import annotations

import re
from typing import Any, Optional, Sequence

__all__ = ["CRITIC_PROMPT", "EDITOR_PROMPT", "CRITIC_VARIABLES", "EDITOR_VARIABLES", "candidate_text",
           "failures_text"]

#: The critic's prompt (ProTeGi's "gradient" prompt, shortened for small models). Fields: ``{prompt}``,
#: ``{failures}``.
CRITIC_PROMPT = (
    "I am writing a system prompt for an AI assistant. My current prompt is:\n"
    "\"{prompt}\"\n\n"
    "With this prompt the assistant got these examples wrong:\n"
    "{failures}\n\n"
    "Give at most three short reasons why the prompt could have led to these mistakes."
)
#: The editor's prompt (ProTeGi's "edit" prompt). Fields: ``{prompt}``, ``{critique}``, ``{failures}``.
EDITOR_PROMPT = (
    "I am writing a system prompt for an AI assistant. My current prompt is:\n"
    "\"{prompt}\"\n\n"
    "A reviewer says what is wrong with it:\n"
    "{critique}\n\n"
    "Write an improved system prompt that fixes these problems. Reply with the new prompt only, "
    "between <prompt> and </prompt>."
)
#: The fields each proposer prompt may use.
CRITIC_VARIABLES = frozenset({"prompt", "failures"})
EDITOR_VARIABLES = frozenset({"prompt", "critique", "failures"})

_TAGGED = re.compile(r"<prompt>(.*?)(?:</prompt>|$)", re.IGNORECASE | re.DOTALL)
_QUOTES = "\"'`“”"


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
