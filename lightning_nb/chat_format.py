"""Tool calls for models that write them as text (Hermes style), as used by Qwen2.5, Hermes and our SmolLM2.

OpenAI clients send ``tools`` and expect ``tool_calls`` back; a small chat model only
reads and writes text. The LLM proxy bridges the two for an engine whose
``tool_format`` is ``"hermes"``:

* :func:`render_tools` turns the request into plain chat messages: the tool schemas go
  into the system message inside ``<tools></tools>``; an earlier assistant turn's
  ``tool_calls`` become ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` text;
  ``tool`` results become a ``user`` turn wrapping each result in
  ``<tool_response></tool_response>`` (the layout of Qwen2.5's chat template);
* :func:`parse_tool_calls` reads ``<tool_call>`` JSON blocks back out of the reply text.

The span keeps the raw completion tokens; parsing only changes what the client sees.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Optional, Sequence

from lightning_nb.errors import ConfigError

__all__ = ["render_tools", "parse_tool_calls", "TOOL_SYSTEM_PROMPT"]

TOOL_SYSTEM_PROMPT = (
    "You can call these tools. Their JSON schemas are inside <tools></tools>:\n"
    "<tools>\n{tools}\n</tools>\n"
    "To call a tool, reply with only this, and nothing else:\n"
    "<tool_call>\n{{\"name\": \"TOOL_NAME\", \"arguments\": {{ARGUMENTS_AS_JSON}}}}\n</tool_call>\n"
    "A tool's result comes back inside <tool_response></tool_response>. "
    "When you know the answer, reply with plain text."
)

_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    raise ConfigError(f"message content must be a string or a list of text parts, got {type(content).__name__}")


def _tool_names(tools: Sequence[dict[str, Any]]) -> list[str]:
    names = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type", "function") != "function" or not isinstance(fn, dict) or not fn.get("name"):
            raise ConfigError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., "
                              f"'parameters': {{...}}}}}}; got {json.dumps(tool)[:200]}")
        names.append(str(fn["name"]))
    return names


def render_tools(messages: Sequence[dict[str, Any]], tools: Optional[Sequence[dict[str, Any]]],
                 tool_choice: Any = "auto") -> list[dict[str, str]]:
    """Plain ``{"role", "content"}`` messages that show ``tools`` and earlier tool calls as Hermes text.

    Args:
        messages: OpenAI chat messages (roles system, developer, user, assistant, tool).
        tools: OpenAI function tools, or None.
        tool_choice: ``"auto"``, ``"none"`` (tools are not shown), ``"required"`` or
            ``{"type": "function", "function": {"name": ...}}`` (the prompt asks for a call).

    Raises:
        ConfigError: a malformed tool, or a ``tool_choice`` naming an unknown tool.
    """
    names = _tool_names(tools or [])
    out: list[dict[str, str]] = []
    pending_results: list[str] = []

    def flush() -> None:
        if pending_results:
            out.append({"role": "user", "content": "\n".join(pending_results)})
            pending_results.clear()

    for m in messages:
        role = "system" if m["role"] == "developer" else m["role"]
        if role == "tool":
            pending_results.append(f"<tool_response>\n{_text(m.get('content'))}\n</tool_response>")
            continue
        flush()
        content = _text(m.get("content"))
        if role == "assistant" and m.get("tool_calls"):
            calls = []
            for call in m["tool_calls"]:
                fn = call.get("function", {})
                args = fn.get("arguments", "{}")
                try:
                    args = json.loads(args) if isinstance(args, str) else args
                except json.JSONDecodeError:
                    pass  # keep the model's own (invalid) text: it is what it wrote
                calls.append("<tool_call>\n" + json.dumps({"name": fn.get("name"), "arguments": args}) + "\n</tool_call>")
            content = "\n".join(([content] if content else []) + calls)
        out.append({"role": role, "content": content})
    flush()
    if not names or tool_choice == "none":
        return out
    block = TOOL_SYSTEM_PROMPT.format(tools="\n".join(json.dumps(t) for t in tools or []),
                                      example=_example_call(tools or []))
    if tool_choice == "required":
        block += "\nYou must call a tool now."
    elif isinstance(tool_choice, dict):
        wanted = (tool_choice.get("function") or {}).get("name")
        if wanted not in names:
            raise ConfigError(f"tool_choice names {wanted!r}, which is not in tools ({names})")
        block += f"\nYou must call the tool {wanted} now."
    elif tool_choice not in (None, "auto"):
        raise ConfigError(f"tool_choice must be 'auto', 'none', 'required' or {{'type': 'function', 'function': "
                          f"{{'name': ...}}}}; got {tool_choice!r}")
    if out and out[0]["role"] == "system":
        out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{block}" if out[0]["content"] else block}
    else:
        out.insert(0, {"role": "system", "content": block})
    return out


_EXAMPLE_VALUES = {"string": "...", "integer": 1, "number": 1, "boolean": True, "array": [], "object": {}}


def _example_call(tools: Sequence[dict[str, Any]]) -> str:
    """A ``<tool_call>`` block for the first tool, its required arguments filled with placeholders by type."""
    if not tools:
        return ""
    fn = tools[0]["function"]
    params = fn.get("parameters") or {}
    props = params.get("properties") or {}
    names = list(params.get("required") or props)
    args = {k: _EXAMPLE_VALUES.get((props.get(k) or {}).get("type"), "...") for k in names}
    return "<tool_call>\n" + json.dumps({"name": fn["name"], "arguments": args}) + "\n</tool_call>"


def parse_tool_calls(text: str, tool_names: Optional[Sequence[str]] = None) -> tuple[Optional[str], list[dict[str, Any]]]:
    """Split a Hermes-style reply into ``(content, tool_calls)`` in the OpenAI shape.

    A block counts as a call when it holds a JSON object with a string ``name`` (one of
    ``tool_names`` when given) and ``arguments`` that is an object (or a JSON string of
    one); an unclosed final block counts too (the stop token may end it). Anything
    else stays in ``content``, which is None when nothing but calls was written.
    Each call gets a fresh ``call_<hex>`` id and ``arguments`` as a JSON string.
    """
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    pos = 0
    for match in _CALL_RE.finditer(text):
        call = _one_call(match.group(1), tool_names)
        if call is None:
            continue
        kept.append(text[pos:match.start()])
        pos = match.end()
        calls.append(call)
    kept.append(text[pos:])
    content = "".join(kept).strip() if calls else text
    return (content or None), calls


def _one_call(body: str, tool_names: Optional[Sequence[str]]) -> Optional[dict[str, Any]]:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
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
