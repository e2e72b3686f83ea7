"""TextArena's single-player games behind GEM's interface (``reset(seed) -> (text, info)``, ``step(text) -> ...``).

TextArena (the ``textarena`` package, 0.7.4) speaks another shape than GEM. A game is
``env = textarena.make(id)``; ``env.reset(num_players=1, seed=s)``; ``player_id, messages = env.get_observation()``;
``done, step_info = env.step(action)``; and only at the end ``rewards, game_info = env.close()``, where
``rewards`` is ``{player_id: reward}`` and ``game_info`` is ``{player_id: {"role", "invalid_move", "turn_count",
"reason"}}``. :class:`TextArenaEnv` maps that onto the GEM shape :class:`~lightning_nb.agents.gem_runner.GEMRunner`
plays (``GEMRunner("textarena:GuessTheNumber-v0-raw")``):

* **Observations.** The game's messages to player 0 since the previous call, one per line, without the
  ``PLAYER_ACTION`` echo of the agent's own move (TextArena sends every move back to its player; its
  ``LLMObservationWrapper`` shows it as a ``[Player] [42]`` line). The echo is dropped whatever its sender:
  most games send it from player 0, TowerOfHanoi from the game (-1), and Countdown, Cryptarithm and Slitherlink
  pass their arguments in another order, so the kind sits where the sender should (``(PLAYER_ACTION, 0,
  move)``); in a single-player game every ``PLAYER_ACTION`` message is the agent's own move. Game feedback such as GuessTheNumber's
  "The target number is higher." and TextArena's invalid-move notes stay. The messages are read from the
  innermost game, so a wrapped id (``"GuessTheNumber-v0"``, ``"...-train"``) reads the same text as its
  ``-raw`` id: TextArena's observation wrappers rebuild the whole history each turn, which the kit's
  conversation already holds. Its action wrappers still apply (``ActionFormattingWrapper`` puts a reply without
  brackets inside ``[...]``).
* **Reward.** 0.0 on every step but the last; the step that ends the game gives ``float(rewards[0])`` from
  ``env.close()``. The scale is the game's. GuessTheNumber: 1 for the right number; at the turn limit, or at a
  second invalid move in a row (the first only gets a note), ``1 - |last valid guess - target| / (max - min)``,
  so 0.0 .. 1.0 (0.0 with no valid guess yet); 0.7.4 checks the turn limit before counting the guess, so the game
  ends at valid guess ``max_turns`` + 1. TextArena's single-player default for a losing invalid move is
  -1.0; its two-player games use -1 / 0 / 1 (loss, draw, win), but they need two players and are refused here.
* **End.** ``terminated`` is TextArena's ``done`` (its turn limit is an outcome of the game, with a reward);
  ``truncated`` is always False (the runner's ``max_steps`` cuts long episodes). The last step's ``info``
  has ``reason`` and ``game_info`` (player 0's entry of ``close()``'s ``game_info``).

TextArena's ``State.__init__`` calls ``random.seed(seed)`` on Python's global generator at every ``reset``, and
GuessTheNumber then draws its number from it: GEMRunner resets under its process-wide lock. Games that draw
from ``random`` in ``step`` share that generator with every other thread of the process.

**Games it refuses, when built.** :func:`check_single_player` makes a game and starts one (seed 0) to learn whether
the agent can play it alone; it raises :class:`~lightning_nb.errors.EnvRefused` naming why not (``reason``):

* ``"players"``: the game needs other players. Most two-player games assert it at ``reset(num_players=1)``
  (quoted); QuantumTicTacToe and SpiteAndMalice start with two players whatever they are asked for, and the agent
  would play both sides, so a game whose state has more than one player after that reset is refused too (by its
  player count, :meth:`TextArenaEnv.reset`; no list of names).
* ``"download"``: the game's module calls ``nltk.download`` when made (Hangman, Wordle, WordSearch, WordLadder,
  WordChains, Codenames, DontSayIt, LetterAuction, SpellingBee); without the network it cannot start.
* ``"api_key"``: the game calls a hosted model through OpenRouter (Debate, GuessWho, TwentyQuestions,
  ScenarioPlanning) and needs ``OPENROUTER_API_KEY``.
* ``"python"``: the game's module does not compile on this Python (TextArena 0.7.4's Chess, Checkers, Klondike,
  ReverseTicTacToe, IteratedStagHunt and UltimateTexasHoldem use Python 3.12 f-strings).
* ``"package_files"``: files the game reads are missing from the textarena wheel (ScorableGames, UsedCar...).

``import textarena`` opens no connection, and GuessTheNumber needs no data.

Requires ``textarena`` (the ``envs`` extra: ``pip install 'lightning-nb[envs]'``).
"""

from __future__ import annotations

import difflib
import random
import sys
from typing import Any, Optional

from lightning_nb.errors import ConfigError, EnvRefused, LightningNbError, MissingDependencyError

__all__ = ["TextArenaEnv", "TEXTARENA_PREFIX", "check_single_player"]

#: the prefix of a TextArena id in ``GEMRunner(env=...)``: ``"textarena:GuessTheNumber-v0-raw"``
TEXTARENA_PREFIX = "textarena:"
_PLAYER = 0  # the agent: TextArenaEnv plays single-player games


def _textarena() -> Any:
    try:
        import textarena
    except ImportError as exc:
        raise MissingDependencyError("TextArenaEnv needs textarena: pip install 'lightning-nb[envs]'") from exc
    return textarena


class TextArenaEnv:
    """A TextArena single-player game with GEM's ``reset``/``step`` (see the module docstring).

    Args:
        env_id: a TextArena id, e.g. ``"GuessTheNumber-v0-raw"`` (without the ``"textarena:"`` prefix).
        make_kwargs: the game's constructor arguments, over the id's registered ones (``textarena.make(env_id,
            **make_kwargs)``), e.g. ``max_turns=3`` or ``min_number=1, max_number=5`` for GuessTheNumber.

    Raises:
        ConfigError: ``env_id`` is not a str or not a TextArena id (the message names it and the closest ids),
            or the game refuses ``make_kwargs``.
        MissingDependencyError: textarena is not installed.

    Attributes:
        game: the TextArena game itself, under its wrappers (e.g. GuessTheNumber's ``game.game_number``).

    Holds one episode's state: make one per episode (GEMRunner does), not one shared by runner threads.
    """

    def __init__(self, env_id: str, **make_kwargs: Any) -> None:
        if not isinstance(env_id, str):
            raise ConfigError(f"TextArenaEnv env_id must be a TextArena id (str), got {type(env_id).__name__}")
        ta = _textarena()
        from textarena.envs.registration import ENV_REGISTRY

        if env_id not in ENV_REGISTRY:
            close = difflib.get_close_matches(env_id, list(ENV_REGISTRY), n=4)
            raise ConfigError(f"TextArenaEnv: {env_id!r} is not a TextArena id (closest: {close}; all: "
                              f"textarena.envs.registration.ENV_REGISTRY), e.g. 'GuessTheNumber-v0-raw'")
        try:
            self._env = ta.make(env_id, **make_kwargs)
        except TypeError as exc:  # the game's constructor refused a keyword
            raise ConfigError(f"TextArenaEnv({env_id!r}): the game refused make_kwargs {sorted(make_kwargs)}: "
                              f"{exc}") from exc
        except (SyntaxError, LookupError, ImportError, OSError, ValueError) as exc:
            raise _refusal(env_id, exc, "made") from exc
        self.env_id, self.make_kwargs = env_id, dict(make_kwargs)
        self.game = self._env
        while isinstance(self.game, ta.Wrapper):  # the messages come from the game itself
            self.game = self.game.env
        self._player_action = ta.ObservationType.PLAYER_ACTION
        self._done: Optional[bool] = None  # None: not reset yet

    def reset(self, seed: Optional[int] = None) -> tuple[str, dict[str, Any]]:
        """Start a game from ``seed`` (TextArena seeds Python's global ``random`` with it); returns
        ``(the game's opening messages, {"env_id": ...})``.

        Raises:
            EnvRefused: the game needs more than one player (``reason="players"``): it refused one (TextArena's own
                assertion, quoted), or it started with more than one all the same (QuantumTicTacToe,
                SpiteAndMalice: the agent would play every side).
        """
        try:
            self._env.reset(num_players=1, seed=seed)
        except (AssertionError, ValueError) as exc:
            if "player" not in str(exc).lower():
                raise
            raise EnvRefused(f"TextArenaEnv plays single-player games; {self.env_id!r} refused one player: "
                             f"{exc}", "players") from exc
        players = getattr(getattr(self.game, "state", None), "num_players", 1)
        if players != 1:
            raise EnvRefused(f"TextArenaEnv plays single-player games; {self.env_id!r} started with {players} "
                             f"players when asked for one (the agent would play every side)", "players")
        self._done = False
        return self._new_text(), {"env_id": self.env_id}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Play the reply ``action``; returns ``(new messages without the echo of the move, reward, terminated,
        False, info)``. ``reward`` is 0.0 until the step that ends the game, which gives player 0's reward from
        ``env.close()``.

        Raises:
            ConfigError: ``action`` is not a str, or the game was not reset or has ended.
            LightningNbError: the game ended without a reward for player 0 (a game bug; the message quotes it).
        """
        if self._done is None:
            raise ConfigError("TextArenaEnv.step before reset(seed): start each episode with env.reset(seed)")
        if self._done:
            raise ConfigError(f"TextArenaEnv.step after {self.env_id!r} ended: reset(seed) starts a new game")
        if not isinstance(action, str):
            raise ConfigError(f"TextArenaEnv.step takes the reply text (str), got {type(action).__name__}")
        done, step_info = self._env.step(action)
        text, info = self._new_text(), dict(step_info or {})
        self._done = bool(done)
        if not done:
            return text, 0.0, False, False, info
        rewards, game_info = self._env.close()
        if not rewards or _PLAYER not in rewards:
            raise LightningNbError(f"TextArena game {self.env_id!r} ended without a reward for player 0: close() "
                                   f"returned rewards {rewards!r}, game_info {game_info!r}")
        mine = dict((game_info or {}).get(_PLAYER, {}))
        info.update(reason=mine.get("reason"), game_info=mine)
        return text, float(rewards[_PLAYER]), True, False, info

    def _new_text(self) -> str:
        """Player 0's messages since the last call (TextArena hands each out once), less the echo of its moves."""
        _, messages = self.game.get_observation()
        return "\n".join(str(text) for sender, text, kind in messages
                         if self._player_action not in (kind, sender))  # an echo, whatever its sender


def _refusal(env_id: str, exc: BaseException, when: str) -> EnvRefused:
    """The :class:`EnvRefused` for ``exc``, raised while ``env_id`` was ``when`` (made, reset): its reason from the
    exception's kind (see the module docstring)."""
    text = f"{type(exc).__name__}: {exc}".strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    if isinstance(exc, SyntaxError):
        python = ".".join(map(str, sys.version_info[:2]))
        return EnvRefused(f"TextArena game {env_id!r} cannot be {when} here: its module does not compile on Python "
                          f"{python} ({first}; textarena 0.7.4 writes some games with Python 3.12 f-strings)",
                          "python")
    if isinstance(exc, LookupError):
        resource = next((w for w in ("words", "stopwords", "wordnet", "averaged_perceptron_tagger_eng")
                         if w in str(exc)), "a corpus")
        return EnvRefused(f"TextArena game {env_id!r} cannot be {when} here: it downloads NLTK data ({resource}) "
                          f"when built, and the download failed (no network?); run nltk.download({resource!r}) "
                          "where the network is, or pick a game that needs no data", "download")
    if isinstance(exc, ValueError) and "api key" in str(exc).lower():
        return EnvRefused(f"TextArena game {env_id!r} cannot be {when} here: it calls a hosted model and needs an "
                          f"API key ({first})", "api_key")
    if isinstance(exc, (ImportError, FileNotFoundError)):
        return EnvRefused(f"TextArena game {env_id!r} cannot be {when} here: files it needs are missing from the "
                          f"installed textarena package ({first})", "package_files")
    return EnvRefused(f"TextArena game {env_id!r} could not be {when}: {first}", "error")


def check_single_player(env_id: str, seed: int = 0, **make_kwargs: Any) -> TextArenaEnv:
    """Make TextArena's ``env_id`` and start one game from ``seed``, to learn whether the agent can play it alone;
    returns the :class:`TextArenaEnv`, reset (its first observation already read).

    Python's global ``random``, which TextArena re-seeds at every reset, is left as it was. A reset can take long
    for some games (Sudoku-v0-hard-raw: ~30 s at seed 0 on 2 cores; its puzzle is generated there).

    Raises:
        EnvRefused: the game needs other players, a download, an API key, another Python, or files its package
            lacks (``reason``; the module docstring lists them), or it failed to start (``"error"``, quoted).
        ConfigError: ``env_id`` is not a TextArena id, or the game refused ``make_kwargs``.
        MissingDependencyError: textarena is not installed.
    """
    env = TextArenaEnv(env_id, **make_kwargs)
    state = random.getstate()
    try:
        env.reset(seed=seed)
    except EnvRefused:
        raise
    except Exception as exc:  # noqa: BLE001 - a game's own failure at reset, classified and quoted
        raise _refusal(env_id, exc, "reset") from exc
    finally:
        random.setstate(state)
    return env
