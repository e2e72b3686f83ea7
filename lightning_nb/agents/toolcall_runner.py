"""``ToolCallRunner``: ROLL's runner for function-calling environments (reference doc 004, "ToolCallRunner").

The environment, not the agent, executes OpenAI ``tool_calls``:

* ``env.reset(seed) -> (messages, info)``: the opening chat messages (list of dicts) and ``info["tools"]``, the
  OpenAI tool schemas (``[{"type": "function", "function": {"name", "description", "parameters"}}]``);
* ``env.step(action) -> (messages, reward, terminated, truncated, info)``: ``action`` is the assistant message
  dict (``role``, ``content``, ``tool_calls``) when the model called a tool, else its text; the returned messages
  (``role: "tool"`` results with their ``tool_call_id``, or a user nudge) are appended to the conversation.

Each step the runner sends ``tools=`` (and ``tool_choice``) to the proxy, which renders them for the model and
parses the Hermes-style ``<tool_call>`` JSON our small model writes back into OpenAI ``tool_calls``.

:class:`ToolActionEnv` turns any GEM-style text environment (a GEM game, or a gymnasium toy-text game through
:class:`~lightning_nb.agents.text_env.TextEnv`) into such an environment with one tool, ``act(action)``: an enum of
the environment's action words where it has them (TextEnv), else a free string passed to ``env.step``.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Mapping, Optional, Union

from lightning_nb.agents.agent_runner import EpisodeResult
from lightning_nb.agents.gem_runner import GEMRunner, check_reset, check_step, make_env
from lightning_nb.errors import ConfigError

__all__ = ["ToolCallRunner", "ToolActionEnv"]

_TOOL_CHOICES = ("auto", "required", "none")


class ToolActionEnv:
    """A function-calling view of a GEM-style text environment: one tool ``act`` whose call is one ``env.step``.

    Args:
        env: an object with ``reset(seed) -> (str, dict)`` and ``step(str) -> (str, reward, terminated, truncated,
            info)`` (a :class:`~lightning_nb.agents.text_env.TextEnv` or a ``gem.make`` environment).
        tool_name: the tool's name (default ``"act"``).
        no_call_reward: reward of a reply without a tool call, or with a call of another tool or with arguments
            that are not a JSON object holding ``action`` (default -0.1); the episode goes on.

    Several calls in one reply run in order, until one ends the episode; their rewards add up.
    """

    def __init__(self, env: Any, *, tool_name: str = "act", no_call_reward: float = -0.1) -> None:
        self.env, self.tool_name, self.no_call_reward = env, tool_name, float(no_call_reward)
        actions = getattr(env, "actions", None)
        action = ({"type": "string", "enum": list(actions)} if actions else {"type": "string"})
        action["description"] = "your move, as the game asks for it"
        self.tools = [{"type": "function", "function": {
            "name": tool_name, "description": "Make one move in the game and see what happens.",
            "parameters": {"type": "object", "properties": {"action": action}, "required": ["action"]}}}]

    def reset(self, seed: Optional[int] = None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        obs, info = check_reset(self.env.reset(seed=seed), self.env)
        hint = f"Call the tool `{self.tool_name}` with your move."
        return [{"role": "user", "content": f"{obs}\n{hint}"}], {**info, "tools": self.tools}

    def step(self, action: Union[str, Mapping[str, Any]]) -> tuple[list[dict[str, Any]], float, bool, bool, dict]:
        calls = action.get("tool_calls") if isinstance(action, Mapping) else None
        if not calls:
            return ([{"role": "user", "content": f"No tool call. Call `{self.tool_name}` with your move."}],
                    self.no_call_reward, False, False, {"tool_calls": 0})
        out, total, terminated, truncated, info = [], 0.0, False, False, {}
        for call in calls:
            text, reward, done = self._run(call)
            out.append({"role": "tool", "tool_call_id": call.get("id", ""), "content": text})
            total += reward
            if done is not None:
                terminated, truncated, info = done
                if terminated or truncated:
                    break
        return out, total, terminated, truncated, {**info, "tool_calls": len(calls)}

    def _run(self, call: Mapping[str, Any]) -> tuple[str, float, Optional[tuple[bool, bool, dict]]]:
        fn = call.get("function") or {}
        if fn.get("name") != self.tool_name:
            return f"Unknown tool {fn.get('name')!r}; the only tool is `{self.tool_name}`.", self.no_call_reward, None
        try:
            args = json.loads(fn.get("arguments") or "{}")
        except json.JSONDecodeError:
            args = None
        if not isinstance(args, dict) or not isinstance(args.get("action"), str):
            return ('Arguments must be a JSON object like {"action": "..."}.', self.no_call_reward, None)
        obs, reward, terminated, truncated, info = check_step(self.env.step(args["action"]), self.env)
        return obs, reward, (terminated, truncated, info)


class ToolCallRunner(GEMRunner):
    """Play a function-calling environment: the model calls tools, the environment runs them (module docstring).

    Args:
        env: a GEM or :data:`~lightning_nb.agents.text_env.TEXT_ENVS` id (played through :class:`ToolActionEnv`),
            or a factory ``env(**env_kwargs)`` of a function-calling environment.
        tool_choice: sent with every request: ``"auto"`` (default), ``"required"`` or ``"none"``.
        env_kwargs, max_steps, system_prompt, sampling, timeout_s: as :class:`GEMRunner`.

    Raises:
        ConfigError: a bad ``tool_choice``; per episode, a reset without ``info["tools"]`` or env output that is
            not shaped as above (the message names the item).
    """

    def __init__(self, env: Union[str, Callable[..., Any]], *, tool_choice: str = "auto", **kwargs: Any) -> None:
        kwargs.setdefault("system_prompt", None)
        super().__init__(env, **kwargs)
        if tool_choice not in _TOOL_CHOICES:
            raise ConfigError(f"ToolCallRunner tool_choice must be one of {_TOOL_CHOICES}, got {tool_choice!r}")
        self.tool_choice = tool_choice

    def new_env(self) -> Any:
        if callable(self.env):
            return self.env(**self.env_kwargs)
        return ToolActionEnv(make_env(self.env, self.env_kwargs))

    def run_job(self, seed: int) -> EpisodeResult:
        env = self.new_env()
        messages, tools = _tool_reset(env, seed)
        if self.system_prompt:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        exit_reason, terminated, tool_calls = "max_steps", False, 0
        for _ in range(self.max_steps):
            reply = self._llm_request(messages, tools=tools, tool_choice=self.tool_choice)
            message = reply.choices[0].message.model_dump(exclude_none=True)
            message = {k: message[k] for k in ("role", "content", "tool_calls") if k in message}
            messages.append(message)
            tool_calls += len(message.get("tool_calls") or [])
            action = message if message.get("tool_calls") else (message.get("content") or "")
            new, reward, terminated, truncated, _ = check_step(env.step(action), env, text=False)
            self._step_score(reward)
            messages.extend(_checked_messages(new, env))
            if terminated or truncated:
                exit_reason = "terminated" if terminated else "truncated"
                break
        return self._finished(exit_reason, terminated=int(terminated), tool_calls=tool_calls)


def _tool_reset(env: Any, seed: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    name = type(env).__name__
    out = env.reset(seed=seed)
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict)):
        raise ConfigError(f"{name}.reset(seed) must return (messages: list[dict], info: dict with 'tools') for "
                          f"ToolCallRunner, got {type(out).__name__}")
    messages, info = out
    tools = info.get("tools")
    if not (isinstance(tools, list) and tools and all(isinstance(t, dict) for t in tools)):
        raise ConfigError(f"{name}.reset(seed) info has no 'tools' list (got {tools!r}): put the OpenAI tool schemas "
                          f"in info['tools'], or use GEMRunner for an environment that takes text actions")
    return list(_checked_messages(messages, env)), tools


def _checked_messages(messages: Any, env: Any) -> list[dict[str, Any]]:
    if not (isinstance(messages, list) and all(isinstance(m, dict) and "role" in m for m in messages)):
        raise ConfigError(f"{type(env).__name__} must give chat messages as a list of dicts with a 'role' (ToolCallRunner"
                          f" appends them to the conversation), got {messages!r:.200}")
    return messages
