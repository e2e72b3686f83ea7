"""Text observations and text actions for gymnasium's toy-text environments (FrozenLake, Taxi).

gymnasium's toy-text environments observe an integer state and take an integer action. An LLM needs text
both ways, the way GEM's game environments speak (``reset(seed) -> (text, info)``,
``step(text) -> (text, reward, terminated, truncated, info)``), so :class:`TextEnv` wraps one:

* ``FrozenLake-v1``: each ``reset(seed)`` draws a new ``size`` x ``size`` lake from the seed
  (``gymnasium.envs.toy_text.frozen_lake.generate_random_map(size, seed=seed)``; ``is_slippery=False`` by default,
  so a move always goes where it says). Reward 1.0 on reaching the goal, 0.0 otherwise; a hole or the goal ends
  the episode (``terminated``). Actions ``left``, ``down``, ``right``, ``up``.
* ``Taxi-v4``: ``reset(seed)`` draws the taxi, passenger and destination from the seed. Rewards are gymnasium's:
  -1 per move, +20 for delivering the passenger (which ends the episode), -10 for an illegal pickup/drop-off.
  Actions ``south``, ``north``, ``east``, ``west``, ``pickup``, ``dropoff``.

An action is read from the reply as the word inside ``\\boxed{...}`` when there is one, else the first action word
in the text (case-insensitive). A reply with no action word is not passed to the environment: it gets
``invalid_action_reward`` (default -0.1), the same observation with a reminder, ``info["invalid_action"] = True``,
and does not end the episode (the agent's step limit does). Each ``TextEnv`` holds one episode's state: make one
per episode (``GEMRunner`` does), not one shared by runner threads.

Requires ``gymnasium`` (the ``envs`` extra: ``pip install 'lightning-nb[envs]'``).
"""

from __future__ import annotations

import re
from typing import Any, Optional

from lightning_nb.errors import ConfigError, MissingDependencyError

__all__ = ["TextEnv", "TEXT_ENVS"]

#: the gymnasium ids TextEnv renders, with their action words (gymnasium's action order)
TEXT_ENVS = {
    "FrozenLake-v1": ("left", "down", "right", "up"),
    "Taxi-v4": ("south", "north", "east", "west", "pickup", "dropoff"),
}
_BOXED = re.compile(r"\\boxed\{\s*([A-Za-z]+)\s*\}")
_TAXI_STOPS = "RGYB"


def _gymnasium() -> Any:
    try:
        import gymnasium
    except ImportError as exc:
        raise MissingDependencyError("TextEnv needs gymnasium: pip install 'lightning-nb[envs]'") from exc
    return gymnasium


class TextEnv:
    """A gymnasium toy-text environment with text observations and actions (see the module docstring).

    Args:
        env_id: a key of :data:`TEXT_ENVS` (``"FrozenLake-v1"`` or ``"Taxi-v4"``).
        size: FrozenLake's lake side in cells (>= 2; default 4); refused for Taxi.
        is_slippery: FrozenLake's slippery ice (gymnasium's default is True; here False).
        invalid_action_reward: reward of a reply with no action word (finite float, <= 0 makes sense).

    Raises:
        ConfigError: an unknown ``env_id`` (the message lists the supported ones), a bad ``size``, or a
            FrozenLake-only option given for Taxi.
        MissingDependencyError: gymnasium is not installed.
    """

    def __init__(self, env_id: str = "FrozenLake-v1", *, size: Optional[int] = None, is_slippery: Optional[bool] = None,
                 invalid_action_reward: float = -0.1) -> None:
        if env_id not in TEXT_ENVS:
            raise ConfigError(f"TextEnv env_id must be one of {sorted(TEXT_ENVS)}, got {env_id!r}"
                              + ("; gymnasium >= 1.2 calls it 'Taxi-v4'" if env_id == "Taxi-v3" else ""))
        lake = env_id.startswith("FrozenLake")
        if not lake and (size is not None or is_slippery is not None):
            raise ConfigError(f"TextEnv: size and is_slippery apply to FrozenLake-v1 only, not {env_id!r}")
        size = 4 if size is None else size
        if isinstance(size, bool) or not isinstance(size, int) or size < 2:
            raise ConfigError(f"TextEnv size must be an int >= 2 (cells per side), got {size!r}")
        self.env_id, self.size, self.is_slippery = env_id, size, bool(is_slippery)
        self.invalid_action_reward = float(invalid_action_reward)
        self.actions = TEXT_ENVS[env_id]
        self._gym = _gymnasium()
        self._env: Any = None if lake else self._gym.make(env_id)
        self._state: Optional[int] = None

    # ----- the GEM-style interface -----
    def reset(self, seed: Optional[int] = None) -> tuple[str, dict[str, Any]]:
        """Start an episode from ``seed``; returns ``(instructions + state as text, info)``."""
        if self.env_id.startswith("FrozenLake"):
            from gymnasium.envs.toy_text.frozen_lake import generate_random_map

            desc = generate_random_map(size=self.size, seed=seed)
            self._env = self._gym.make(self.env_id, desc=desc, is_slippery=self.is_slippery)
        self._state, info = self._env.reset(seed=seed)
        return self._intro() + "\n\n" + self.render(), {"suffix": self._prompt(), **info}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Apply the action named in the reply ``action``; returns ``(text, reward, terminated, truncated, info)``.

        Raises:
            ConfigError: ``action`` is not a str, or the episode was not reset.
        """
        if self._state is None:
            raise ConfigError("TextEnv.step before reset(seed): start each episode with env.reset(seed)")
        if not isinstance(action, str):
            raise ConfigError(f"TextEnv.step takes the reply text (str), got {type(action).__name__}")
        index = self.parse_action(action)
        if index is None:
            return (f"No valid action found. {self._prompt()}\n\n{self.render()}", self.invalid_action_reward,
                    False, False, {"invalid_action": True, "suffix": self._prompt()})
        self._state, reward, terminated, truncated, info = self._env.step(index)
        text = f"You chose {self.actions[index]}. {self._outcome(float(reward), terminated)}\n\n{self.render()}"
        return text, float(reward), bool(terminated), bool(truncated), {"suffix": self._prompt(), **info}

    def parse_action(self, text: str) -> Optional[int]:
        """The action index named in ``text`` (``\\boxed{word}`` first, else the first action word), or None."""
        boxed = _BOXED.search(text)
        if boxed and boxed.group(1).lower() in self.actions:
            return self.actions.index(boxed.group(1).lower())
        found = re.search(r"\b(" + "|".join(self.actions) + r")\b", text, re.IGNORECASE)
        return self.actions.index(found.group(1).lower()) if found else None

    # ----- text -----
    def render(self) -> str:
        """The current state as text (a grid for FrozenLake; a map and a sentence for Taxi)."""
        if self.env_id.startswith("FrozenLake"):
            rows = [[c.decode() for c in row] for row in self._env.unwrapped.desc]
            r, c = divmod(int(self._state), self.size)
            rows[r][c] = "P"
            return "\n".join(" ".join(row) for row in rows)
        taxi_r, taxi_c, passenger, dest = self._env.unwrapped.decode(int(self._state))
        where = "in the taxi" if passenger == 4 else f"waiting at {_TAXI_STOPS[passenger]}"
        lines = [row.tobytes().decode() for row in self._env.unwrapped.desc]
        chars = list(lines[taxi_r + 1])
        chars[2 * taxi_c + 1] = "T"
        lines[taxi_r + 1] = "".join(chars)
        return ("\n".join(lines) + f"\nThe taxi T is at row {taxi_r}, column {taxi_c}. The passenger is {where}; "
                f"the destination is {_TAXI_STOPS[dest]}.")

    def _intro(self) -> str:
        if self.env_id.startswith("FrozenLake"):
            return (f"You are P on a frozen lake ({self.size}x{self.size} grid, row 0 at the top). F is safe ice, "
                    "H is a hole (falling in ends the game), G is the goal. Reach G.")
        return ("You drive the taxi T on a 5x5 map (row 0 at the top; '|' is a wall). Pick up the passenger at their "
                "stop (R, G, Y or B), drive to the destination and drop them off.")

    def _prompt(self) -> str:
        return f"Reply with one move: {', '.join(self.actions)}, e.g. \\boxed{{{self.actions[-1]}}}."

    def _outcome(self, reward: float, terminated: bool) -> str:
        if self.env_id.startswith("FrozenLake"):
            if terminated:
                return "You reached the goal!" if reward > 0 else "You fell into a hole. Game over."
            return "You moved."
        if terminated:
            return "You delivered the passenger!"
        return "That was not allowed (-10)." if reward <= -10 else "Done."
