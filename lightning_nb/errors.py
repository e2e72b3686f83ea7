"""One exception hierarchy for lightning-nb.

Every error the library raises on purpose is a :class:`LightningNbError`. Each
subclass also inherits the builtin it replaces, so ``except ValueError`` in user
code keeps working. Messages say what went wrong, why, and how to fix it.
"""

from __future__ import annotations

__all__ = [
    "LightningNbError",
    "ConfigError",
    "NotFoundError",
    "InvalidRewardError",
    "InvalidStatusTransition",
    "AttemptEnded",
    "MovedAttributeError",
    "MissingDependencyError",
    "EnvRefused",
    "ENV_REFUSAL_REASONS",
    "AttemptTimeout",
    "SpanSchemaError",
    "WaitWarning",
]


class LightningNbError(Exception):
    """Base class of every error raised by lightning-nb."""


class ConfigError(LightningNbError, ValueError):
    """A configuration value or an argument is invalid; the message names the field."""


class NotFoundError(LightningNbError, KeyError):
    """An id (rollout, attempt, resources) is not in the store."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


class InvalidRewardError(LightningNbError, ValueError):
    """A reward is not a finite real number."""


class InvalidStatusTransition(LightningNbError, ValueError):
    """A rollout or attempt was asked to move to a status its state machine forbids."""


class AttemptEnded(InvalidStatusTransition):
    """A write (a span) for an attempt that already ended ``failed``, ``timeout`` or ``unresponsive``.

    Nothing is stored on an attempt after it ended that way: the late answer of an abandoned agent (a rollout
    server's ``/rollout`` answer after a timeout) would otherwise add tool, reward and agent spans to a record of
    something that did not happen as stored. A store server answers it with HTTP 409, as any
    :class:`InvalidStatusTransition`.
    """


class MovedAttributeError(LightningNbError, AttributeError):
    """A public name that moved or was renamed; the message names its replacement (kept for one release)."""


class MissingDependencyError(LightningNbError, ImportError):
    """An optional package is missing; the message names the extra to install."""


class EnvRefused(ConfigError):
    """An environment the kit cannot play, refused when it is built; ``reason`` says why, in one word.

    ``reason`` is one of :data:`ENV_REFUSAL_REASONS`: ``"players"`` (it needs other players than the agent: a
    two-player or team game), ``"download"`` (it downloads data when built, e.g. an NLTK word list, and could not),
    ``"api_key"`` (it calls a hosted model and needs that service's API key), ``"python"`` (its code does not
    compile on this Python), ``"package_files"`` (files its package should ship are missing) or ``"error"``
    (anything else; the message quotes it). The message says the same in words, with the fix where there is one.
    """

    def __init__(self, message: str, reason: str = "error") -> None:
        super().__init__(message, reason)
        self.message, self.reason = message, reason

    def __str__(self) -> str:
        return self.message


#: the values of :attr:`EnvRefused.reason`
ENV_REFUSAL_REASONS = ("players", "download", "api_key", "python", "package_files", "error")


class AttemptTimeout(LightningNbError, TimeoutError):
    """An agent ran past its rollout's ``timeout_seconds``."""


class SpanSchemaError(LightningNbError, ValueError):
    """A stored span lacks an attribute its reader needs (see :mod:`lightning_nb.semconv`); the message names the key."""


class WaitWarning(UserWarning):
    """An algorithm's ``wait()`` saw no progress for its ``stall_s`` seconds, or its ``timeout`` expired.

    The message says what the loop waits for, why it may not move and what to do; the loop goes on.
    Silence it with ``warnings.simplefilter("ignore", WaitWarning)``.
    """
