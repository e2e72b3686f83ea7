"""APO's configuration and records: :class:`APOConfig`, :class:`Candidate` (one prompt tried) and
:class:`BestPrompt` (what :meth:`~lightning_nb.algorithm.apo.APO.best` returns)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from lightning_nb.algorithm.apo_prompts import CRITIC_PROMPT, CRITIC_VARIABLES, EDITOR_PROMPT, EDITOR_VARIABLES
from lightning_nb.errors import ConfigError
from lightning_nb.types import MAIN_LLM, LLMResource, PromptTemplate

__all__ = ["APOConfig", "BestPrompt", "Candidate", "proposer_endpoint"]


@dataclass
class APOConfig:
    """Sizes and prompts of APO. Validated on construction and by ``resume()``."""

    rounds: int = field(default=3, metadata={"help": "Rounds run() performs by default."})
    beam_width: int = field(default=2, metadata={"help": "Prompts kept after each round (the beam)."})
    branch_factor: int = field(default=2, metadata={"help": "New prompts the editor writes per beam prompt per round."})
    batch_size: int = field(default=8, metadata={"help": "Training tasks each round runs every prompt on."})
    max_failures: int = field(default=3, metadata={"help": "Failed episodes shown to the critic per prompt."})
    failure_below: float = field(default=1.0, metadata={"help": "An episode whose final reward is below this failed."})
    temperature: Optional[float] = field(default=None, metadata={
        "help": "The sampling temperature of APO's rollouts. None (default): the agent's own sampling (its LLM "
                "resource's sampling_parameters, else the agent's default), so APO's scores are the numbers the "
                "user's own rollouts get; a number in [0, 5] overrides it (0: greedy). APO.best() says which."})
    max_tokens: int = field(default=48, metadata={"help": "The agent's completion token limit per LLM call."})
    proposer_temperature: float = field(default=0.7, metadata={"help": "Critic and editor sampling temperature."})
    proposer_max_tokens: int = field(default=160, metadata={"help": "Critic and editor completion token limit."})
    critic_prompt: str = field(default=CRITIC_PROMPT, metadata={"help": "str.format template: {prompt}, {failures}."})
    editor_prompt: str = field(default=EDITOR_PROMPT, metadata={
        "help": "str.format template: {prompt}, {critique}, {failures}, {variables} (apo_prompts.variables_text)."})
    prompt_name: str = field(default="system_prompt", metadata={"help": "The PromptTemplate's name in the resources."})
    llm_name: str = field(default=MAIN_LLM, metadata={"help": "The LLMResource the proposer uses by default."})
    variables: Optional[list[str]] = field(default=None, metadata={
        "help": "The fields the agent fills in the prompt (calc: ['question']); a candidate using another is "
                "refused. None: the starting prompt's variables."})
    rollout_timeout_s: float = field(default=300.0, metadata={"help": "Per-attempt timeout of APO's rollouts (s)."})
    start_timeout_s: float = field(default=120.0, metadata={
        "help": "Fail when no rollout has left the queue after this many seconds (no runners)."})
    proposer_timeout_s: float = field(default=900.0, metadata={
        "help": "Timeout of one critic or editor call (s). SmolLM2-135M on a shared 2-core CPU took 330 s for the "
                "editor's 2 choices of 160 tokens."})
    publish: bool = field(default=True, metadata={
        "help": "When run() ends, publish the winner if it beats the starting prompt on val_tasks by more than "
                "publish_margin (APO.best); else the start stays. Needs val_tasks."})
    publish_margin: float = field(default=0.05, metadata={
        "help": "How much higher (mean final reward, absolute) the winner's held-out score must be than the "
                "starting prompt's, on the same val_tasks, to be published: more than this. 0.05 is 2 of 32 "
                "tasks with 0/1 rewards (1 of 32, 0.031, is within the noise). 0: any gain."})
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
            value = getattr(self, name)
            if value is None and name == "temperature":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 5:
                none_ok = "None (the agent's own sampling) or " if name == "temperature" else ""
                raise ConfigError(f"APOConfig.{name} must be {none_ok}a number in [0, 5], got {value!r}")
        if isinstance(self.publish_margin, bool) or not isinstance(self.publish_margin, (int, float)) \
                or not 0 <= self.publish_margin < math.inf:
            raise ConfigError(f"APOConfig.publish_margin must be a number >= 0 (mean reward the winner must gain over "
                              f"the start on val_tasks), got {self.publish_margin!r}")
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


@dataclass(frozen=True)
class BestPrompt:
    """What :meth:`APO.best <lightning_nb.algorithm.apo.APO.best>` returns: the starting prompt (``c0``) and the
    winner (the top of the beam, chosen on training tasks), each with its held-out score, and which of the two APO
    keeps.

    Both scores are mean final rewards on the same ``n`` tasks of ``val_tasks`` (those every measured prompt has a
    finished rollout on; NaN when none). The winner is kept (``keeps_winner``) only if it is not the start and its
    score exceeds the start's by more than ``margin`` (``APOConfig.publish_margin``); else the start stays.
    ``sampling`` says how the rollouts sampled (:meth:`APO.sampling <lightning_nb.algorithm.apo.APO.sampling>`);
    ``tied`` is ``(candidate id, held-out score)`` of each candidate that tied with the top of the beam on the
    training tasks, all measured on ``val_tasks`` before the winner was chosen (empty without a tie).
    ``template``, ``score`` and ``candidate_id`` are the kept prompt's; ``str(best)`` says the verdict in one line,
    :meth:`df` is the table.
    """

    start: PromptTemplate
    start_score: float
    winner_id: str
    winner: PromptTemplate
    winner_score: float
    n: int
    margin: float
    sampling: str = ""
    tied: tuple[tuple[str, float], ...] = ()

    @property
    def gain(self) -> float:
        """``winner_score - start_score`` (mean final reward on the same held-out tasks)."""
        return self.winner_score - self.start_score

    @property
    def keeps_winner(self) -> bool:
        """The winner is another prompt and beats the start by more than ``margin`` (False when a score is NaN)."""
        return self.winner_id != "c0" and self.gain > self.margin  # NaN compares False

    @property
    def candidate_id(self) -> str:
        return self.winner_id if self.keeps_winner else "c0"

    @property
    def template(self) -> PromptTemplate:
        return self.winner if self.keeps_winner else self.start

    @property
    def score(self) -> float:
        return self.winner_score if self.keeps_winner else self.start_score

    def __str__(self) -> str:
        scores = (f"held-out reward on {self.n} tasks: start c0 {self.start_score:.3f}, winner {self.winner_id} "
                  f"{self.winner_score:.3f}")
        if self.tied:
            scores += (" (tied on the training tasks: " + ", ".join(f"{c} {s:.3f}" for c, s in self.tied)
                       + " held-out; the best there is the winner)")
        if self.sampling:
            scores += f"; sampling: {self.sampling}"
        if self.winner_id == "c0":
            return f"{scores}: no candidate beat the start; the start stays"
        if self.keeps_winner:
            return f"{scores}: the winner gains {self.gain:+.3f} > margin {self.margin:g}; APO keeps the winner"
        return f"{scores}: gain {self.gain:+.3f}, not more than margin {self.margin:g}; the start stays"

    def df(self) -> Any:
        """Two rows, start then winner: candidate_id, held_out (score), n, kept (the prompt APO keeps), text."""
        import pandas as pd

        rows = [("start", "c0", self.start_score, self.start),
                ("winner", self.winner_id, self.winner_score, self.winner)]
        return pd.DataFrame([{"prompt": name, "candidate_id": cid, "held_out": score, "n": self.n,
                              "kept": cid == self.candidate_id, "text": template.template}
                             for name, cid, score, template in rows]).set_index("prompt")


def proposer_endpoint(given: Optional[LLMResource], default: Any, role: str, llm_name: str) -> LLMResource:
    """APO's critic or editor endpoint (``role``): ``given``, else ``default``, the target set's ``llm_name`` resource.

    Raises:
        ConfigError: it is not an LLMResource (or there is none), or it is an attempt's URL (its calls would be
            recorded as that attempt's trainable spans).
    """
    llm = given if given is not None else default
    if not isinstance(llm, LLMResource):
        raise ConfigError(f"APO's {role} must be an LLMResource (endpoint, model, api_key), got "
                          f"{type(given).__name__}" if given is not None else
                          f"APO's {role} defaults to the resources' {llm_name!r} LLMResource, and there is none; "
                          f"pass {role}=LLMResource(endpoint=..., model=...)")
    if "/rollout/" in llm.endpoint and "/attempt/" in llm.endpoint:
        raise ConfigError(f"APO's {role} endpoint {llm.endpoint} is an attempt's URL: its calls would be recorded "
                          "as that attempt's trainable spans; use the proxy's plain base URL (proxy.endpoint())")
    return llm
