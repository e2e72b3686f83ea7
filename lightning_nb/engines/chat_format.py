"""Chat messages as the model reads them: prompt token IDs, and tool calls written as text (Hermes style).

:func:`prompt_token_ids` renders chat messages with a tokenizer's chat template: every engine
(:meth:`~lightning_nb.engines.base.Engine.apply_chat_template`) and the token-fidelity audit render
prompts through it, so they agree on the tokens.

Tool calls, for models that write them as text (Hermes style, as Qwen2.5, Hermes and our SmolLM2 do):
OpenAI clients send ``tools`` and expect ``tool_calls`` back; a small chat model only
reads and writes text. The LLM proxy bridges the two for an engine whose
``tool_format`` is ``"hermes"``:

* :func:`render_tools` turns the request into plain chat messages: the tool schemas
  (``name``, ``description``, ``parameters``, without ``title``/``additionalProperties``/``strict``)
  and a worked example call open the system message (:data:`TOOL_SYSTEM_PROMPT`; the
  application's own system text follows), and a short hint with the example goes in front
  of every user message (:data:`TOOL_HINT`); an earlier assistant turn that made tool calls is
  rendered as the model sampled it when the caller knows that text (``sampled``), else its
  ``tool_calls`` become ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` text;
  ``tool`` results become a ``user`` turn wrapping each result in
  ``<tool_response></tool_response>`` (the layout of Qwen2.5's chat template);
* :func:`parse_tool_calls` reads ``<tool_call>`` JSON blocks back out of the reply text.

The span keeps the raw completion tokens; parsing only changes what the client sees.

Multi-turn episodes stay one sequence: every LLM call of an episode renders the earlier turns exactly
as the previous call did, so its prompt extends the previous prompt and completion token for token
(what :func:`lightning_nb.trainers.packing.pack_episode` packs into one sequence under a response
mask). Two rules keep it so: the tool hint is the same on a user message whether or not it is the
last one, and an assistant turn is rendered as sampled (its text, tool-call markup and any leftover
words included), not re-written from the parsed ``tool_calls``.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Mapping, Optional, Sequence

from lightning_nb.errors import ConfigError

__all__ = ["prompt_token_ids", "render_tools", "rendered_prompt_ids", "native_prompt_ids", "parse_tool_calls",
           "sampled_turn_key", "count_sampled_turns", "TOOL_SYSTEM_PROMPT", "TOOL_HINT", "TOOL_HINT_AUTO"]

# Chosen with bench/tool_call_rate.py on SmolLM2-135M-Instruct (its docstring has the workload and the
# table). With the schemas and instructions in the system message alone the model never wrote a
# parseable call (0/16 greedy and sampled, three wordings, also SmolLM2's own function-calling system
# prompt); a worked example in the system message plus TOOL_HINT in front of the user's question is
# what makes it call at all. In the layouts agent frameworks send (their own system text, tool schemas
# with titles and strict flags), greedy first replies went from 0/20 to 4-10/20 by putting the tools
# before the application's system text, compacting the schemas and dropping a "You must call a tool
# now." line. Sampling at temperature 1.0 stays near 0%: train with a lower temperature.
TOOL_SYSTEM_PROMPT = (
    "You can call these tools. Their JSON schemas are inside <tools></tools>:\n"
    "<tools>\n{tools}\n</tools>\n"
    "To call a tool, reply with only a <tool_call> block, and nothing else. For example:\n"
    "{example}\n"
    "A tool's result comes back inside <tool_response></tool_response>. "
    "When you know the answer, reply with plain text."
)
# Put in front of every user message (not tool results), on every call, so that a later call renders
# an earlier question exactly as the first call did (before, only the last message got it, and each
# later turn of a tool episode forked from the previous prompt). TOOL_HINT for tool_choice "required"
# or a named tool, TOOL_HINT_AUTO for "auto". ``{example}`` is a call of the first tool (of the named
# one). A softer auto hint ("If a tool helps, ...") made the model call less than half as often, so
# both are the same.
TOOL_HINT = "Reply with a <tool_call> block, like:\n{example}\n\n"
TOOL_HINT_AUTO = TOOL_HINT

_OPEN = "<tool_call>"
_CLOSE_RE = re.compile(r"\s*</tool_call>")
_WS_RE = re.compile(r"\s*")
_DECODER = json.JSONDecoder()


def text_content(content: Any) -> str:
    """OpenAI message content (a string or a list of text parts) as plain text.

    Raises:
        ConfigError: content of another type.
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    raise ConfigError(f"message content must be a string or a list of text parts, got {type(content).__name__}")


def prompt_token_ids(tokenizer: Any, messages: Sequence[dict[str, Any]]) -> list[int]:
    """Token IDs of ``messages`` rendered with ``tokenizer``'s chat template plus the assistant header.

    Role ``developer`` is rendered as ``system``; content parts are joined as text.
    """
    clean = [{"role": "system" if m["role"] == "developer" else m["role"],
              "content": text_content(m.get("content"))} for m in messages]
    return list(tokenizer.apply_chat_template(clean, tokenize=True, add_generation_prompt=True, return_dict=False))


def _tool_names(tools: Sequence[dict[str, Any]]) -> list[str]:
    names = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type", "function") != "function" or not isinstance(fn, dict) or not fn.get("name"):
            raise ConfigError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., "
                              f"'parameters': {{...}}}}}}; got {json.dumps(tool)[:200]}")
        names.append(str(fn["name"]))
    return names


def sampled_turn_key(tool_calls: Sequence[dict[str, Any]]) -> str:
    """The key of an assistant turn in a ``sampled`` map (:func:`render_tools`): its tool-call ids, comma-joined."""
    return ",".join(str(c.get("id", "")) for c in tool_calls)


def _same_calls(text: str, tool_calls: Sequence[dict[str, Any]]) -> bool:
    """Whether ``text`` (a sampled reply) parses to the calls of ``tool_calls`` (names and arguments; ids aside)."""
    _, parsed = parse_tool_calls(text)

    def canon(calls: Sequence[dict[str, Any]]) -> list[tuple[Any, Any]]:
        return [((c.get("function") or {}).get("name"), json.dumps(_arguments(c), sort_keys=True)) for c in calls]

    return canon(parsed) == canon(tool_calls)


def _assistant_text(m: dict[str, Any], sampled: Optional[Mapping[str, str]]) -> str:
    """An assistant turn as the model reads it: as sampled when ``sampled`` has it, else re-written."""
    content = text_content(m.get("content"))
    calls = m.get("tool_calls") or []
    if not calls:
        return content
    text = (sampled or {}).get(sampled_turn_key(calls))
    if text is not None and _same_calls(text, calls):
        return text
    written = ["<tool_call>\n" + json.dumps({"name": (call.get("function") or {}).get("name"),
                                              "arguments": _arguments(call)}) + "\n</tool_call>" for call in calls]
    return "\n".join(([content] if content else []) + written)


def _arguments(call: dict[str, Any]) -> Any:
    """A tool call's ``arguments`` as an object, or its own text when that is not valid JSON (it is what the model
    wrote)."""
    args = (call.get("function") or {}).get("arguments", "{}")
    try:
        return json.loads(args) if isinstance(args, str) else args
    except json.JSONDecodeError:
        return args


def count_sampled_turns(messages: Sequence[dict[str, Any]], sampled: Optional[Mapping[str, str]]) -> tuple[int, int]:
    """``(as_sampled, rewritten)``: how many assistant turns with tool calls :func:`render_tools` renders from
    ``sampled`` and how many it re-writes from their ``tool_calls``."""
    as_sampled = rewritten = 0
    for m in messages:
        calls = m.get("tool_calls") if m.get("role") == "assistant" else None
        if calls:
            text = (sampled or {}).get(sampled_turn_key(calls))
            if text is not None and _same_calls(text, calls):
                as_sampled += 1
            else:
                rewritten += 1
    return as_sampled, rewritten


def _hint_for(tools: Sequence[dict[str, Any]], names: list[str], tool_choice: Any) -> tuple[str, str]:
    """``(hint, example)`` for ``tool_choice``; raises ConfigError on an unknown choice or tool name."""
    example_tools = list(tools)
    hint = TOOL_HINT_AUTO
    if tool_choice == "required":
        hint = TOOL_HINT
    elif isinstance(tool_choice, dict):
        wanted = (tool_choice.get("function") or {}).get("name")
        if wanted not in names:
            raise ConfigError(f"tool_choice names {wanted!r}, which is not in tools ({names})")
        hint = TOOL_HINT
        example_tools = [example_tools[names.index(wanted)]]
    elif tool_choice not in (None, "auto"):
        raise ConfigError(f"tool_choice must be 'auto', 'none', 'required' or {{'type': 'function', 'function': "
                          f"{{'name': ...}}}}; got {tool_choice!r}")
    example = _example_call(example_tools)
    return hint.format(example=example) if hint else "", example


def render_tools(messages: Sequence[dict[str, Any]], tools: Optional[Sequence[dict[str, Any]]],
                 tool_choice: Any = "auto", sampled: Optional[Mapping[str, str]] = None) -> list[dict[str, str]]:
    """Plain ``{"role", "content"}`` messages that show ``tools`` and earlier tool calls as Hermes text.

    Args:
        messages: OpenAI chat messages (roles system, developer, user, assistant, tool).
        tools: OpenAI function tools, or None.
        tool_choice: ``"auto"``, ``"none"`` (tools are not shown), ``"required"`` or
            ``{"type": "function", "function": {"name": ...}}`` (the hint in front of each user
            message shows a call of that tool). Which hint goes where: see :data:`TOOL_HINT`.
        sampled: the text the model sampled for earlier assistant turns that made tool calls, keyed by
            :func:`sampled_turn_key` of their ``tool_calls`` (the LLM proxy keeps the replies it served).
            A turn whose echoed calls parse the same from that text is rendered as that text, so the
            prompt extends the earlier prompt and completion token for token; other turns are re-written
            from their ``tool_calls``.

    Raises:
        ConfigError: a malformed tool, or a ``tool_choice`` naming an unknown tool.
    """
    names = _tool_names(tools or [])
    show = bool(names) and tool_choice != "none"
    hint, example = _hint_for(tools or [], names, tool_choice) if show else ("", "")
    out: list[dict[str, str]] = []
    pending_results: list[str] = []

    def flush() -> None:
        if pending_results:
            out.append({"role": "user", "content": "\n".join(pending_results)})
            pending_results.clear()

    for m in messages:
        role = "system" if m["role"] == "developer" else m["role"]
        if role == "tool":
            pending_results.append(f"<tool_response>\n{text_content(m.get('content'))}\n</tool_response>")
            continue
        flush()
        if role == "assistant":
            out.append({"role": role, "content": _assistant_text(m, sampled)})
        else:
            content = text_content(m.get("content"))
            out.append({"role": role, "content": hint + content if role == "user" else content})
    flush()
    if not show:
        return out
    block = TOOL_SYSTEM_PROMPT.format(tools="\n".join(json.dumps(_compact(t)) for t in tools or []), example=example)
    if out and out[0]["role"] == "system":  # the tools first: the model follows them more often (see above)
        out[0] = {"role": "system", "content": f"{block}\n\n{out[0]['content']}" if out[0]["content"] else block}
    else:
        out.insert(0, {"role": "system", "content": block})
    return out


def rendered_prompt_ids(tokenizer: Any, messages: Sequence[dict[str, Any]],
                        tools: Optional[Sequence[dict[str, Any]]] = None, tool_choice: Any = "auto",
                        sampled: Optional[Mapping[str, str]] = None) -> list[int]:
    """The prompt token IDs a Hermes-format engine is given for a chat request with ``tools``.

    :func:`render_tools` then :func:`prompt_token_ids` with ``tokenizer`` (the served model's). A rollout
    server computing doc 002's ``response_mask`` needs this length before it calls the proxy.

    Raises:
        ConfigError: a malformed tool or ``tool_choice`` (as :func:`render_tools`).
    """
    return prompt_token_ids(tokenizer, render_tools(messages, tools, tool_choice, sampled))


def native_prompt_ids(tokenizer: Any, messages: Sequence[dict[str, Any]],
                      tools: Optional[Sequence[dict[str, Any]]] = None) -> list[int]:
    """The prompt token IDs of ``messages`` as a client counts them with the model's own chat template:
    ``tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True)``, the messages as sent.

    What reference doc 002's rollout server sizes its ``response_mask`` on (its ``RolloutSession``), and not what
    a Hermes-format engine is given (:func:`rendered_prompt_ids`: the tools and tool calls written as text):
    the LLM proxy counts both to check a mask.

    Raises:
        Exception: whatever the template raises on these messages (e.g. a content it cannot render).
    """
    return list(tokenizer.apply_chat_template(list(messages), tools=list(tools) if tools else None, tokenize=True,
                                              add_generation_prompt=True, return_dict=False))


def _compact(tool: dict[str, Any]) -> dict[str, Any]:
    """``{"name", "description", "parameters"}`` of a function tool, without JSON-schema noise
    (``title``, ``additionalProperties``, ``strict``) that frameworks add and a small model trips over."""
    fn = tool["function"]
    out = {"name": fn["name"], "description": fn.get("description") or ""}
    if fn.get("parameters") is not None:
        out["parameters"] = _strip_schema(fn["parameters"])
    return out


def _strip_schema(schema: Any) -> Any:
    if isinstance(schema, list):
        return [_strip_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in ("title", "additionalProperties"):
            continue
        if key in ("properties", "$defs", "definitions") and isinstance(value, dict):  # maps of names to schemas
            out[key] = {name: _strip_schema(sub) for name, sub in value.items()}
        else:
            out[key] = _strip_schema(value)
    return out


_EXAMPLE_VALUES = {"string": "...", "integer": 1, "number": 1, "boolean": True, "array": [], "object": {}}


def _example_value(schema: dict[str, Any]) -> Any:
    """A placeholder for one argument: the first ``enum`` value when there is one (a small model copies the
    example, and ``"..."`` is never a valid choice), else a value of its type."""
    enum = schema.get("enum")
    if isinstance(enum, list) and enum:
        return enum[0]
    return _EXAMPLE_VALUES.get(schema.get("type"), "...")


def _example_call(tools: Sequence[dict[str, Any]]) -> str:
    """A ``<tool_call>`` block for the first tool, its required arguments filled with placeholders by type."""
    if not tools:
        return ""
    fn = tools[0]["function"]
    params = fn.get("parameters") or {}
    props = params.get("properties") or {}
    names = list(params.get("required") or props)
    args = {k: _example_value(props.get(k) or {}) for k in names}
    return "<tool_call>\n" + json.dumps({"name": fn["name"], "arguments": args}) + "\n</tool_call>"


def parse_tool_calls(text: str, tool_names: Optional[Sequence[str]] = None) -> tuple[Optional[str], list[dict[str, Any]]]:
    """Split a Hermes-style reply into ``(content, tool_calls)`` in the OpenAI shape.

    A ``<tool_call>`` block counts when the JSON right after the tag is an object with a
    string ``name`` (one of ``tool_names`` when given) and ``arguments`` that is an object
    (or a JSON string of one), or a list of such objects (the layout SmolLM2's larger sizes
    were tuned on). The closing ``</tool_call>`` may be missing (the stop token or
    ``max_tokens`` may end the reply), and text after the JSON stays content (small models
    keep talking). Anything else stays in ``content``, which is None when nothing but calls
    was written. Each call gets a fresh ``call_<hex>`` id and ``arguments`` as a JSON string.
    """
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    pos = search = 0
    while (start := text.find(_OPEN, search)) >= 0:
        body = start + len(_OPEN)
        found = _decode_calls(text, body, tool_names)
        if found is None:
            search = body
            continue
        block_calls, end = found
        close = _CLOSE_RE.match(text, end)
        end = close.end() if close else end
        kept.append(text[pos:start])
        pos = search = end
        calls.extend(block_calls)
    kept.append(text[pos:])
    content = "".join(kept).strip() if calls else text
    return (content or None), calls


def _decode_calls(text: str, at: int, tool_names: Optional[Sequence[str]]) -> Optional[tuple[list[dict[str, Any]], int]]:
    """The calls in the JSON value starting at ``text[at:]`` (after whitespace) and where it ends; None if invalid."""
    at = _WS_RE.match(text, at).end()
    try:
        obj, end = _DECODER.raw_decode(text, at)
    except json.JSONDecodeError:
        return None
    objs = obj if isinstance(obj, list) and obj else [obj]
    calls = [_one_call(o, tool_names) for o in objs]
    if any(c is None for c in calls):
        return None
    return calls, end  # type: ignore[return-value]


def _one_call(obj: Any, tool_names: Optional[Sequence[str]]) -> Optional[dict[str, Any]]:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if tool_names is not None and obj["name"] not in tool_names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args)}}
