"""Token in, token out for multi-turn episodes: an earlier reply is given back to the model as the tokens it sampled.

An agent sends its conversation back as text, and the engine's chat template tokenizes it again. A
sampled reply can be a split of its text that the tokenizer would never write (greedy SmolLM2-135M
wrote ``"}`` then ``}}`` where its tokenizer writes ``"}}`` then ``}``), so the next prompt no longer
extends the previous prompt and completion token for token, and the episode forks into two training
sequences at that point. Re-writing text cannot fix a split, so the LLM proxy fixes the tokens: it
keeps each attempt's previous call (:class:`ServedCall`), and when the new prompt, rendered as the
engine would render it, starts with the previous prompt followed by the previous reply's text tokenized
again, :func:`splice_previous_reply` puts the sampled tokens back in its place. The proxy then asks the
engine for that exact prompt (``Engine.submit``, the token-level path every weight engine has) and
:func:`generations_response` makes the chat response from it.

Only the previous call of the same attempt is spliced: a prompt that does not start with it (another
branch of the agent, an edited history) goes to the engine as text, and ``turn_forks`` counts it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Hashable, Optional, Sequence

from lightning_nb.engines import Engine, Generation
from lightning_nb.engines.base import chat_completion_payload

__all__ = ["remember", "REMEMBERED_TURNS", "ServedCall", "splice_previous_reply", "can_submit_tokens", "submit_kwargs",
           "generations_response"]

#: How many sampled assistant turns (and attempts' served lengths) the proxy remembers, newest kept.
REMEMBERED_TURNS = 16384


def remember(table: "OrderedDict[Any, Any]", key: Hashable, value: Any) -> None:
    """Put ``key`` last in ``table`` with ``value``, dropping the oldest entries beyond :data:`REMEMBERED_TURNS`."""
    table[key] = value
    table.move_to_end(key)
    while len(table) > REMEMBERED_TURNS:
        table.popitem(last=False)


@dataclass(frozen=True)
class ServedCall:
    """An attempt's previous LLM call as served.

    Attributes:
        prompt_ids: the prompt token IDs the engine was given (earlier replies as sampled).
        completion_ids: the sampled completion token IDs (the stop token last when the model stopped).
        text: the completion's text.
        rendered_ids: the prompt as the chat template renders the messages (earlier replies re-tokenized);
            equal to ``prompt_ids`` unless that call was spliced.
        cut: the reply was cut at ``max_tokens`` (finish reason ``"length"``): it has no stop token, and may end
            inside a character.
        n_messages: how many messages the call's request had (a rollout server's next call starts with them).
    """

    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    text: str
    rendered_ids: tuple[int, ...]
    cut: bool = False
    n_messages: int = 0

    @property
    def length(self) -> int:
        """Prompt plus completion tokens: where the next call's new tokens start."""
        return len(self.prompt_ids) + len(self.completion_ids)


def splice_previous_reply(rendered_ids: Sequence[int], prev: ServedCall, tokenizer: Any,
                          stop_token_ids: Sequence[int]) -> Optional[list[int]]:
    """The prompt to serve for ``rendered_ids`` with every earlier reply of the attempt as sampled, or None.

    By induction over the attempt's calls: when ``rendered_ids`` (the chat template's render of the new
    messages) starts with the previous call's render, then the previous reply's text tokenized again and
    a stop token, the prompt to serve is the previous served prompt, the previous sampled completion, and
    the rest of ``rendered_ids`` (with the stop token that closes the turn when the reply was cut at
    ``max_tokens`` and so had none). None when no splice is needed (``rendered_ids`` already extends the
    previous prompt and completion as served) or none applies (the prompt does not start that way, the
    turn is not closed by a stop token, e.g. ``<|im_end|>``, or the reply neither ended with one nor was cut).

    Args:
        rendered_ids: the new prompt as the engine would render it (token IDs).
        prev: the attempt's previous call.
        tokenizer: the served model's tokenizer.
        stop_token_ids: the engine's stop tokens.
    """
    served = list(prev.prompt_ids) + list(prev.completion_ids)
    if list(rendered_ids[:len(served)]) == served:
        return None  # already extends: nothing to splice
    n_rendered = len(prev.rendered_ids)
    if list(rendered_ids[:n_rendered]) != list(prev.rendered_ids):
        return None
    stopped = bool(prev.completion_ids) and prev.completion_ids[-1] in stop_token_ids
    if not (stopped or prev.cut):
        return None  # cut at a stop string: its tokens are not in the text, and splicing them in would add words
    again = list(tokenizer.encode(prev.text, add_special_tokens=False))
    end = n_rendered + len(again)
    if list(rendered_ids[n_rendered:end]) != again or end >= len(rendered_ids) or rendered_ids[end] not in \
            stop_token_ids or (stopped and rendered_ids[end] != prev.completion_ids[-1]):
        return None
    return served + list(rendered_ids[end + 1 if stopped else end:])


def can_submit_tokens(engine: Engine, kwargs: dict[str, Any]) -> bool:
    """Whether ``engine`` can complete a token prompt with everything the request's ``kwargs`` (LiteLLM's) ask.

    The token-level path (:meth:`Engine.submit`) takes ``max_tokens``, ``temperature``, ``top_p``, ``seed``
    and ``stop``; a request that also sets penalties, a response format or top log-probs goes as text.
    """
    if type(engine).submit is Engine.submit or getattr(engine, "tokenizer", None) is None:
        return False
    return not any(kwargs.get(k) for k in ("response_format", "frequency_penalty", "presence_penalty",
                                           "top_logprobs"))


def submit_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The :meth:`Engine.submit` sampling arguments of LiteLLM ``kwargs``."""
    return {k: kwargs[k] for k in ("max_tokens", "temperature", "top_p", "seed", "stop") if k in kwargs}


def generations_response(gens: Sequence[Generation], tokenizer: Any, model: str) -> dict[str, Any]:
    """Generations of one prompt as the chat response dict the proxy reads from LiteLLM (``model_dump()`` of a vLLM
    reply with ``return_token_ids``): :func:`~lightning_nb.engines.base.chat_completion_payload` with log-probs and
    token IDs."""
    return chat_completion_payload(gens, tokenizer, model, logprobs=True, token_ids=True)
