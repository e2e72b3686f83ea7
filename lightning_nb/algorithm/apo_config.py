"""APO's configuration and records: :class:`APOConfig`, :class:`Candidate` (one prompt tried) and
:class:`BestPrompt` (what :meth:`~lightning_nb.algorithm.apo.APO.best` returns)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple, Optional, Sequence

from lightning_nb.algorithm.apo_prompts import CRITIC_PROMPT, CRITIC_VARIABLES, EDITOR_PROMPT, EDITOR_VARIABLES
from lightning_nb.errors import ConfigError
from lightning_nb.types import MAIN_LLM, PromptTemplate

__all__ = ["APOConfig", "BestPrompt", "Candidate"]


@dataclass
class APOConfig:
    """Sizes and prompts of APO. Validated on construction and by ``resume()``."""

    rounds: int = field(default=3, metadata={"help": "Rounds run() performs by default."})
    beam_width: int = field(default=2, metadata={"help": "Prompts kept after each round (the beam)."})
    branch_factor: int = field(default=2, metadata={"help": "New prompts the editor writes per beam prompt per round."})
    batch_size: int = field(default=8, metadata={"help": "Training tasks each round runs every prompt on."})
    max_failures: int = field(default=3, metadata={"help": "Failed episodes shown to the critic per prompt."})
    failure_below: float = field(default=1.0, metadata={"help": "An episode whose final reward is below this failed."})
    temperature: float = field(default=0.0, metadata={"help": "The agent's sampling temperature (0: greedy)."})
    max_tokens: int = field(default=48, metadata={"help": "The agent's completion token limit per LLM call."})
    proposer_temperature: float = field(default=0.7, metadata={"help": "Critic and editor sampling temperature."})
    proposer_max_tokens: int = field(default=160, metadata={"help": "Critic and editor completion token limit."})
    critic_prompt: str = field(default=CRITIC_PROMPT, metadata={"help": "str.format template: {prompt}, {failures}."})
    editor_prompt: str = field(default=EDITOR_PROMPT, metadata={
        "help": "str.format template: {prompt}, {critique}, {failures}."})
    prompt_name: str = field(default="system_prompt", metadata={"help": "The PromptTemplate's name in the resources."})
    llm_name: str = field(default=MAIN_LLM, metadata={"help": "The LLMResource the proposer uses by default."})
    variables: Optional[list[str]] = field(default=None, metadata={
        "help": "The fields the agent fills in the prompt (calc: ['question']); a candidate using another is "
                "refused. None: the starting prompt's variables."})
    rollout_timeout_s: float = field(default=300.0, metadata={"help": "Per-attempt timeout of APO's rollouts (s)."})
    start_timeout_s: float = field(default=120.0, metadata={
        "help": "Fail when no rollout has left the queue after this many seconds (no runners)."})
    proposer_timeout_s: float = field(default=300.0, metadata={"help": "Timeout of one critic or editor call (s)."})
    publish: bool = field(default=True, metadata={"help": "Publish the winner when run() ends."})
    seed: int = field(default=0, metadata={"help": "Seed of the task draws."})

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ConfigError naming the first invalid field, its value and the allowed range."""
        for name in ("rounds", "beam_width", "branch_factor", "batch_size", "max_failures", "max_tokens",
                     "proposer_max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"APOConfig.{name} must be an int >= 1, got {value!r}")
        for name in ("temperature", "proposer_temperature"):
            if not 0 <= getattr(self, name) <= 5:
                raise ConfigError(f"APOConfig.{name} must be in [0, 5], got {getattr(self, name)!r}")
        for name in ("rollout_timeout_s", "start_timeout_s", "proposer_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"APOConfig.{name} must be > 0 seconds, got {getattr(self, name)!r}")
        for name, allowed in (("critic_prompt", CRITIC_VARIABLES), ("editor_prompt", EDITOR_VARIABLES)):
            try:
                used = PromptTemplate(template=getattr(self, name)).variables
            except ConfigError as exc:
                raise ConfigError(f"APOConfig.{name}: {exc}") from None
            if not used <= allowed:
                raise ConfigError(f"APOConfig.{name} uses {sorted(used - allowed)}; it may use {sorted(allowed)}")
        if self.variables is not None and not all(isinstance(v, str) for v in self.variables):
            raise ConfigError(f"APOConfig.variables must be a list of field names or None, got {self.variables!r}")


@dataclass
class Candidate:
    """One prompt APO has tried: ``id`` (``c0`` is the starting prompt), its ``template``, the ``parent`` it was
    edited from and the ``critique`` that produced it (None for ``c0``), the ``round`` it was proposed in,
    ``resources_id`` of its resources set, and per task key its final ``rewards`` and ``rollouts`` (ids) on
    training tasks and its ``held_out`` rewards on val tasks."""

    id: str
    template: PromptTemplate
    parent: Optional[str] = None
    critique: Optional[str] = None
    round: int = 0
    resources_id: Optional[str] = None
    rewards: dict[str, float] = field(default_factory=dict)
    rollouts: dict[str, str] = field(default_factory=dict)
    held_out: dict[str, float] = field(default_factory=dict)

    def score(self, keys: Sequence[str]) -> tuple[float, int]:
        """``(mean reward, n)`` over the task keys of ``keys`` it has a reward for (NaN, 0 without any)."""
        got = [self.rewards[k] for k in keys if k in self.rewards]
        return (sum(got) / len(got) if got else math.nan), len(got)


class BestPrompt(NamedTuple):
    """:meth:`APO.best`: the winning template and its held-out score (mean final reward on ``val_tasks``)."""

    template: PromptTemplate
    score: float
