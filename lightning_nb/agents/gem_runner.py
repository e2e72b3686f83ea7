"""``GEMRunner``: ROLL's runner for gym-style text environments (reference doc 004, "GEMRunner").

One episode: ``env.reset(seed)`` → [LLM call on the conversation so far → ``env.step(reply text)``] until the
environment says ``terminated`` or ``truncated``, or ``max_steps`` calls were made. The conversation grows by
appending (system, user observation, assistant reply, user observation, ...), so each call's prompt extends the
previous prompt and completion and the trainer packs the episode into one sequence (the observations in between
get response mask 0).

Environments (``env=``):

* a GEM id (the ``gem-llm`` package, the GEM environments ROLL uses), e.g. ``"game:GuessTheNumber-v0-easy"``,
  ``"game:Mastermind-v0-easy"``: made with ``gem.make(env, **env_kwargs)``. GEM's game environments seed
  Python's and NumPy's global random generators in ``reset``, so resets run under one process-wide lock.
  Wordle, Hangman and WordSearch download an NLTK word list on first use: they do not run offline.
* a gymnasium toy-text id through the kit's text wrapper, ``"FrozenLake-v1"`` or ``"Taxi-v4"``
  (:class:`~lightning_nb.agents.text_env.TextEnv`, with ``env_kwargs`` such as ``size=3``).
* a TextArena single-player game, ``"textarena:"`` + its id, e.g. ``"textarena:GuessTheNumber-v0-raw"``
  (:class:`~lightning_nb.agents.textarena_env.TextArenaEnv`: the reward from TextArena's ``close()`` on the last
  step, the echo of the agent's move dropped; ``env_kwargs`` go to ``textarena.make``). TextArena also seeds
  Python's global ``random`` at every reset.
* a callable ``env() -> object`` with GEM's ``reset(seed)`` / ``step(text)``.

A fresh environment is made for every episode (runner threads share the GEMRunner object).
The three packages are the ``envs`` extra: ``pip install 'lightning-nb[envs]'``.
"""

from __future__ import annotations

import math
import numbers
import threading
from typing import Any, Callable, Mapping, Optional, Union

from lightning_nb.agents.agent_runner import AgentRunner, EpisodeResult
from lightning_nb.agents.text_env import TEXT_ENVS, TextEnv
from lightning_nb.agents.textarena_env import TEXTARENA_PREFIX, TextArenaEnv
from lightning_nb.errors import ConfigError, MissingDependencyError

__all__ = ["GEMRunner", "make_env", "check_reset", "check_step"]

#: the system prompt of a GEMRunner episode unless ``system_prompt`` is given
DEFAULT_SYSTEM_PROMPT = ("You are playing a game. Read each observation and reply with your next move in the format "
                         "it asks for. Keep replies short.")
_RESET_LOCK = threading.Lock()  # GEM's and TextArena's resets seed the process-global random (GEM's numpy too)


def make_env(env: Union[str, Callable[[], Any]], env_kwargs: Optional[Mapping[str, Any]] = None) -> Any:
    """A fresh environment: ``TextEnv(env)`` for a :data:`~lightning_nb.agents.text_env.TEXT_ENVS` id,
    ``TextArenaEnv(id)`` for ``"textarena:<id>"``, ``gem.make(env)`` for other ids, ``env()`` for a callable
    (``env_kwargs`` go to the constructor).

    Raises:
        ConfigError: an id neither GEM, TextEnv nor TextArena knows (the message lists where to look).
        MissingDependencyError: gem-llm (or gymnasium, or textarena for a ``"textarena:"`` id) is not installed.
    """
    kwargs = dict(env_kwargs or {})
    if callable(env):
        return env(**kwargs)
    if env in TEXT_ENVS:
        return TextEnv(env, **kwargs)
    if env.startswith(TEXTARENA_PREFIX):
        return TextArenaEnv(env[len(TEXTARENA_PREFIX):], **kwargs)
    try:
        import gem
        from gem.envs.registration import ENV_REGISTRY
    except ImportError as exc:
        raise MissingDependencyError(f"env {env!r} needs gem-llm: pip install 'lightning-nb[envs]'") from exc
    if env not in ENV_REGISTRY:
        games = sorted(k for k in ENV_REGISTRY if k.startswith("game:"))[:6]
        raise ConfigError(f"GEMRunner env {env!r} is neither a GEM id (e.g. {games}; all: gem.print_envs()) nor a "
                          f"gymnasium text env {sorted(TEXT_ENVS)} nor a TextArena id with its prefix "
                          f"('{TEXTARENA_PREFIX}GuessTheNumber-v0-raw')")
    return gem.make(env, **kwargs)


def check_reset(out: Any, env: Any) -> tuple[str, dict[str, Any]]:
    """``env.reset(seed)``'s output as ``(observation: str, info: dict)``, or a ConfigError saying what came."""
    name = type(env).__name__
    if not (isinstance(out, tuple) and len(out) == 2):
        raise ConfigError(f"{name}.reset(seed) must return (observation: str, info: dict), got {_shape(out)}; "
                          f"wrap a gymnasium env whose observations are not text in lightning_nb.agents.TextEnv")
    obs, info = out
    if not isinstance(obs, str):
        raise ConfigError(f"{name}.reset(seed) returned a {type(obs).__name__} observation; GEMRunner needs text "
                          f"(str): wrap the env in lightning_nb.agents.TextEnv or one that renders its state")
    if not isinstance(info, dict):
        raise ConfigError(f"{name}.reset(seed) returned info of type {type(info).__name__}; it must be a dict")
    return obs, info


def check_step(out: Any, env: Any, *, text: bool = True) -> tuple[Any, float, bool, bool, dict[str, Any]]:
    """``env.step(action)``'s output as ``(observation, reward, terminated, truncated, info)``, checked.

    ``text``: the observation must be a str (else a list of chat messages, :class:`ToolCallRunner`'s envs).

    Raises:
        ConfigError: a tuple of another length, a non-text observation, a reward that is not a finite number,
            flags that are not bools, or info that is not a dict; the message names the item.
    """
    name = type(env).__name__
    if not (isinstance(out, tuple) and len(out) == 5):
        raise ConfigError(f"{name}.step(action) must return (observation, reward, terminated, truncated, info) "
                          f"(gymnasium >= 0.26 / GEM), got {_shape(out)}")
    obs, reward, terminated, truncated, info = out
    if text and not isinstance(obs, str):
        raise ConfigError(f"{name}.step returned a {type(obs).__name__} observation; GEMRunner needs text (str): "
                          f"wrap the env in lightning_nb.agents.TextEnv or one that renders its state")
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(float(reward)):
        raise ConfigError(f"{name}.step returned reward {reward!r}; it must be a finite real number")
    for label, flag in (("terminated", terminated), ("truncated", truncated)):
        if not isinstance(flag, (bool,)) and type(flag).__name__ != "bool_":  # numpy.bool_ too
            raise ConfigError(f"{name}.step returned {label}={flag!r}; it must be a bool")
    if not isinstance(info, dict):
        raise ConfigError(f"{name}.step returned info of type {type(info).__name__}; it must be a dict")
    return obs, float(reward), bool(terminated), bool(truncated), info


def _shape(out: Any) -> str:
    if isinstance(out, tuple):
        return f"a {len(out)}-tuple ({', '.join(type(x).__name__ for x in out)})"
    return f"a {type(out).__name__}"


class GEMRunner(AgentRunner):
    """Play a GEM, gymnasium or TextArena text environment, one LLM call per step (see the module docstring).

    Args:
        env: a GEM id, a :data:`~lightning_nb.agents.text_env.TEXT_ENVS` id, ``"textarena:"`` + a TextArena id, or
            a factory ``env(**env_kwargs)``.
        env_kwargs: keyword arguments for the environment's constructor.
        max_steps: most LLM calls (= env steps) per episode (>= 1); an episode cut there ends ``"max_steps"``.
        system_prompt: the first message of every episode (None: no system message).
        sampling, timeout_s: as :class:`~lightning_nb.agents.agent_runner.AgentRunner`
            (default sampling ``{"max_tokens": 64}``).

    The episode's score is the sum of its step rewards (ROLL's ``score=sum(rewards)``); each step reward is also
    an intermediate reward on the LLM call it judged. ``metrics``: ``terminated`` (1 when the environment ended
    the episode itself), ``llm_calls``, ``steps``. Note for training: with ``GRPOConfig(credit="episode")`` the
    trainer's return is R + Σ_t s_t = 2·score here; group normalisation (``norm_adv_by_std=True``, the default)
    cancels that factor in the advantages (up to the 1e-6 in the denominator), ``norm_adv_by_std=False`` does not.

    Raises:
        ConfigError: ``max_steps`` < 1, or (at the first episode) an unknown env id; per episode, env output
            that is not GEM-shaped (:func:`check_reset`, :func:`check_step`).
    """

    def __init__(self, env: Union[str, Callable[..., Any]], *, env_kwargs: Optional[Mapping[str, Any]] = None,
                 max_steps: int = 8, system_prompt: Optional[str] = DEFAULT_SYSTEM_PROMPT,
                 sampling: Optional[Mapping[str, Any]] = None, timeout_s: float = 600.0) -> None:
        super().__init__(sampling={"max_tokens": 64, **(sampling or {})}, timeout_s=timeout_s)
        if not (isinstance(env, str) or callable(env)):
            raise ConfigError(f"GEMRunner env must be an environment id (str) or a factory, got {type(env).__name__}")
        if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1:
            raise ConfigError(f"GEMRunner max_steps must be an int >= 1, got {max_steps!r}")
        self.env, self.env_kwargs, self.max_steps = env, dict(env_kwargs or {}), max_steps
        self.system_prompt = system_prompt

    def setup(self) -> None:
        """Check that the environment can be made (so a wrong id fails the first episode, with its name)."""
        make_env(self.env, self.env_kwargs)

    def new_env(self) -> Any:
        """A fresh environment for one episode."""
        return make_env(self.env, self.env_kwargs)

    def observation_text(self, observation: str, info: Mapping[str, Any]) -> str:
        """The user message for an observation: the text, then GEM's ``info["suffix"]`` prompt if any."""
        suffix = info.get("suffix")
        return f"{observation}\n{suffix}" if isinstance(suffix, str) and suffix else observation

    def run_job(self, seed: int) -> EpisodeResult:
        env = self.new_env()
        with _RESET_LOCK:
            obs, info = check_reset(env.reset(seed=seed), env)
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        messages.append({"role": "user", "content": self.observation_text(obs, info)})
        exit_reason, terminated = "max_steps", False
        for _ in range(self.max_steps):
            reply = self._llm_request(messages)
            text = reply.choices[0].message.content or ""
            messages.append({"role": "assistant", "content": text})
            obs, reward, terminated, truncated, info = check_step(env.step(text), env)
            self._step_score(reward)
            if terminated or truncated:
                exit_reason = "terminated" if terminated else "truncated"
                break
            messages.append({"role": "user", "content": self.observation_text(obs, info)})
        return self._finished(exit_reason, terminated=int(terminated))

