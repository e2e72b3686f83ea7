"""The multi-turn task sets: ``textarena:<game>[,<game>...][?options]`` and ``gem:<env>[,<env>...][?options]``.

Both are played by :class:`~lightning_nb.agents.GEMRunner` (one LLM call per move, the conversation growing by
appending; its default system prompt), one episode per task seed.

* **textarena** (source: the ``textarena`` package, 0.7.4 here): a single-player game of TextArena's registry,
  e.g. ``textarena:GuessTheNumber-v0-raw`` (:class:`~lightning_nb.agents.TextArenaEnv`: the reward is TextArena's
  own, from ``close()`` at the end of the game). Building the task set starts one game (seed 0,
  :func:`~lightning_nb.agents.textarena_env.check_single_player`), so a game the agent cannot play alone or here
  is refused at once, naming why (:class:`~lightning_nb.errors.EnvRefused`: other players, a download, an API
  key...).
* **gem** (source: the ``gem-llm`` package, ROLL's GEM, 0.1.0 here): a GEM id such as
  ``gem:game:GuessTheNumber-v0-easy``, or one of the kit's gymnasium text environments (``gem:FrozenLake-v1``);
  the reward is the environment's, summed over the episode. Built the same way: one reset, seed 0.

Options: ``max_steps`` (the most moves of an episode, default 8) is GEMRunner's; every other option goes to the
game's constructor (``textarena:GuessTheNumber-v0-raw?max_turns=5``, ``gem:FrozenLake-v1?size=3``). Several games
separated by commas (``textarena:TowerOfHanoi-v0-raw,TowerOfHanoi-v0-medium-raw``) are one task set whose seeds
take the games in turn; the held-out reward is then reported per game (``slice_by="env"``), the settings of a
game being its variants.

A task is ``{"id": "<game>/<seed>", "seed": <seed>, "env": <game>}``; the episode's seed is the task's.
"""

from __future__ import annotations

import functools
import random
from typing import Any, Mapping

from lightning_nb.agents import GEMRunner
from lightning_nb.agents.gem_runner import check_reset, make_env
from lightning_nb.agents.textarena_env import TEXTARENA_PREFIX, check_single_player
from lightning_nb.errors import ConfigError, EnvRefused, MissingDependencyError
from lightning_nb.tasks.registry import TaskFamily, TaskSet, options_for, package_version, unknown_target
from lightning_nb.types import LLMResource

__all__ = ["EnvChoice", "TEXTARENA_FAMILY", "GEM_FAMILY", "DEFAULT_MAX_STEPS"]

#: the most moves of an episode unless the task name's ``max_steps`` option says otherwise
DEFAULT_MAX_STEPS = 8


class EnvChoice:
    """The agent of a task set of several games: plays each task with the runner of its ``task["env"]``.

    Args:
        runners: ``{game: agent}``, each an agent runners call (here a GEMRunner).

    Raises:
        ConfigError (when called): a task whose ``"env"`` is not one of the games.
    """

    def __init__(self, runners: Mapping[str, Any]) -> None:
        self.runners = dict(runners)

    def __call__(self, task: Mapping[str, Any], llm: LLMResource) -> None:
        runner = self.runners.get(str(task.get("env"))) if isinstance(task, Mapping) else None
        if runner is None:
            raise ConfigError(f"task {task!r} has no 'env' among this task set's games {sorted(self.runners)}")
        return runner(task, llm)


def _seed_tasks(games: tuple[str, ...], seeds: range) -> list[dict[str, Any]]:
    """One task per seed; seed ``s`` plays ``games[s % len(games)]``."""
    return [{"id": f"{games[s % len(games)]}/{s}", "seed": s, "env": games[s % len(games)]} for s in seeds]


def _games(family: str, target: str) -> tuple[str, ...]:
    games = tuple(g.strip() for g in target.split(",") if g.strip())
    if not games:
        example = "GuessTheNumber-v0-raw" if family == "textarena" else "game:GuessTheNumber-v0-easy"
        raise ConfigError(f"task '{family}:' names no game: write {family}:<game>, e.g. {family}:{example}")
    if len(set(games)) != len(games):
        raise ConfigError(f"task '{family}:{target}' names a game twice")
    return games


def _task_set(family: str, target: str, options: dict[str, Any], games: tuple[str, ...], env_of: Any,
              source: str) -> TaskSet:
    ours, env_kwargs = options_for(family, options, ("max_steps",))
    max_steps = ours.get("max_steps", DEFAULT_MAX_STEPS)
    runners = {game: GEMRunner(env_of(game), env_kwargs=env_kwargs, max_steps=max_steps) for game in games}
    agent = runners[games[0]] if len(games) == 1 else EnvChoice(runners)
    query = "&".join(f"{k}={v}" for k, v in options.items())
    return TaskSet(f"{family}:{','.join(games)}" + (f"?{query}" if query else ""), agent,
                   functools.partial(_seed_tasks, games), slice_by="env" if len(games) > 1 else None, source=source)


def _build_textarena(target: str, options: dict[str, Any]) -> TaskSet:
    games = _games("textarena", target)
    _, env_kwargs = options_for("textarena", options, ("max_steps",))
    try:
        from textarena.envs.registration import ENV_REGISTRY
    except ImportError as exc:
        raise MissingDependencyError("textarena tasks need textarena: pip install 'lightning-nb[envs]'") from exc
    for game in games:
        if game not in ENV_REGISTRY:
            raise unknown_target("textarena", game, ENV_REGISTRY, "game",
                                 "textarena.envs.registration.ENV_REGISTRY")
        check_single_player(game, **env_kwargs)  # EnvRefused: other players, a download, an API key...
    return _task_set("textarena", target, options, games, lambda game: TEXTARENA_PREFIX + game,
                     package_version("textarena"))


def _build_gem(target: str, options: dict[str, Any]) -> TaskSet:
    games = _games("gem", target)
    _, env_kwargs = options_for("gem", options, ("max_steps",))
    for game in games:
        if game.startswith(TEXTARENA_PREFIX):
            raise ConfigError(f"task 'gem:{target}': write a TextArena game as textarena:{game[len(TEXTARENA_PREFIX):]}")
        _check_gem(game, env_kwargs)
    return _task_set("gem", target, options, games, lambda game: game, package_version("gem-llm"))


def _check_gem(game: str, env_kwargs: dict[str, Any]) -> None:
    """Make ``game`` and reset it once (seed 0), leaving Python's and NumPy's global generators as they were.

    Raises:
        ConfigError: an id GEM does not have (closest ones listed); EnvRefused: it needs a download.
    """
    try:
        env = make_env(game, env_kwargs)
    except ConfigError as exc:
        if "neither a GEM id" not in str(exc):
            raise
        from gem.envs.registration import ENV_REGISTRY

        raise unknown_target("gem", game, ENV_REGISTRY, "environment", "gem.print_envs()") from exc
    except LookupError as exc:  # an NLTK corpus it downloads when made
        raise EnvRefused(f"GEM environment {game!r} downloads data when made (NLTK), and the download failed: "
                         f"{str(exc).strip().splitlines()[0] if str(exc).strip() else exc!r}", "download") from exc
    import numpy as np

    state, np_state = random.getstate(), np.random.get_state()
    try:
        check_reset(env.reset(seed=0), env)
    except LookupError as exc:
        raise EnvRefused(f"GEM environment {game!r} downloads data at reset (NLTK), and the download failed",
                         "download") from exc
    finally:
        random.setstate(state)
        np.random.set_state(np_state)


def _textarena_targets() -> list[str]:
    from textarena.envs.registration import ENV_REGISTRY

    return sorted(ENV_REGISTRY)


def _gem_targets() -> list[str]:
    from gem.envs.registration import ENV_REGISTRY

    return sorted(ENV_REGISTRY)


TEXTARENA_FAMILY = TaskFamily(
    "textarena", _build_textarena, usage="textarena:<game>[,<game>...][?max_steps=N&option=value]",
    summary="a single-player TextArena game (e.g. GuessTheNumber-v0-raw), multi-turn through GEMRunner, "
            "TextArena's reward", targets=_textarena_targets)
GEM_FAMILY = TaskFamily(
    "gem", _build_gem, usage="gem:<env>[,<env>...][?max_steps=N&option=value]",
    summary="a GEM environment (e.g. game:GuessTheNumber-v0-easy) or FrozenLake-v1/Taxi-v4, multi-turn through "
            "GEMRunner, the environment's reward", targets=_gem_targets)
