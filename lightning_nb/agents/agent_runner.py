"""``AgentRunner``: ROLL's episode-loop abstraction (reference doc 004), as an agent our runners call.

ROLL (Alibaba's RL library) lets an agent author write one method, ``run_job(seed) -> EpisodeResult``:
given an environment seed, run a whole episode (``env.reset(seed)``, then LLM call → ``env.step(action)``
until done) and say how it went. The LLM is reached through an OpenAI-compatible URL that a proxy
intercepts, so the author never sees tokenizers, token IDs or trajectories.

Here an :class:`AgentRunner` is an *agent* in this kit's sense (despite the name it is not one of
our runner threads, README glossary): the runners call it as ``agent(task, llm) -> None`` like any
plain function agent. Per call it

1. reads the episode seed from ``task`` (``task["seed"]``, or ``task`` itself when it is an int);
2. calls :meth:`~AgentRunner.setup` once per object, before its first episode;
3. runs :meth:`~AgentRunner.run_job` with :meth:`~AgentRunner._llm_request` pointed at ``llm.endpoint`` (the
   proxy URL of the current attempt), so every LLM call is recorded on that attempt with its token IDs;
4. records ``EpisodeResult.score`` as the final reward (a ``reward`` span carrying ``episode.status``,
   ``episode.exit_reason`` and ``episode.metrics``). Each step score is recorded as an intermediate reward
   (:func:`~lightning_nb.tracing.tracer.emit_intermediate_reward`, component ``"step_score"``) at the moment
   :meth:`~AgentRunner._step_score` is called, right after the ``env.step`` that judged the LLM call before it:
   the adapter credits an intermediate reward to the LLM call that most recently ended.

Status mapping: ``"Finished"`` records the reward; ``"Failed"``, ``"Timeout"`` and ``"NoData"`` raise
:class:`EpisodeFailed` (the attempt fails with the status and ``agent_exit_reason``, and is retried per the
rollout's ``retry_condition``/``max_attempts``).

Concurrency: the runner threads share ONE agent object, so per-episode state (the env, the messages, the
LLM client) must live in ``run_job``'s locals, never on ``self``; :meth:`_llm_request` and
:meth:`_step_score` find the current episode through a context variable of the calling thread.

Grouping: :func:`seed_tasks` builds tasks ``{"id": "seed-3", "seed": 3}``; LightningRL enqueues each task
``group_size`` times under one group id, so every GRPO group is ``group_size`` episodes of one environment seed.
"""

from __future__ import annotations

import contextvars
import json
import math
import threading
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Optional

from lightning_nb.errors import ConfigError, LightningNbError
from lightning_nb.tracing.tracer import check_reward, emit_intermediate_reward, emit_reward
from lightning_nb.types import LLMResource

__all__ = ["AgentRunner", "EpisodeResult", "EpisodeFailed", "seed_tasks", "STATUSES", "STEP_SCORE_COMPONENT"]

#: ``EpisodeResult.status`` values (ROLL's): only ``"Finished"`` records a reward.
STATUSES = ("Finished", "Failed", "NoData", "Timeout")
#: the reward component (``rewards_df()``'s ``component``) of a step score
STEP_SCORE_COMPONENT = "step_score"
#: attributes of the final ``reward`` span an AgentRunner records
EPISODE_STATUS, EPISODE_EXIT_REASON, EPISODE_METRICS, EPISODE_SEED = (
    "episode.status", "episode.exit_reason", "episode.metrics", "episode.seed")


class EpisodeFailed(LightningNbError, RuntimeError):
    """``run_job`` returned a status other than ``"Finished"``; the attempt fails with it."""


@dataclass
class EpisodeResult:
    """How one episode went (ROLL's ``EpisodeResult``).

    Attributes:
        status: one of :data:`STATUSES`: ``"Finished"`` (score recorded as the final reward), ``"Failed"``,
            ``"NoData"``, ``"Timeout"`` (the attempt fails with :class:`EpisodeFailed`).
        score: the episode reward (finite float), recorded as the final reward when ``status == "Finished"``.
        step_scores: per-step rewards in step order, each recorded by :meth:`AgentRunner._step_score` as it
            happened; must equal the values passed to it (left empty it is filled with them).
        agent_exit_reason: why the episode ended, e.g. ``"terminated"``, ``"truncated"``, ``"max_steps"``.
        metrics: extra numbers (JSON-serialisable), stored on the reward span as ``episode.metrics``.

    Raises:
        ConfigError: unknown ``status``, or ``metrics`` not a dict.
        InvalidRewardError: ``score`` or a step score not a finite real number.
    """

    status: str
    score: float
    step_scores: list[float] = field(default_factory=list)
    agent_exit_reason: str = ""
    metrics: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ConfigError(f"EpisodeResult.status must be one of {STATUSES}, got {self.status!r}")
        self.score = check_reward(self.score, "EpisodeResult.score")
        self.step_scores = [check_reward(s, f"EpisodeResult.step_scores[{i}]") for i, s in
                            enumerate(self.step_scores or [])]
        if not isinstance(self.metrics, dict):
            raise ConfigError(f"EpisodeResult.metrics must be a dict, got {type(self.metrics).__name__}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Episode:
    """Per-call state of one episode (in a context variable: runner threads share the agent object)."""

    llm: LLMResource
    seed: int
    client: Any = None
    llm_calls: int = 0
    step_scores: list[float] = field(default_factory=list)


_CURRENT: contextvars.ContextVar[Optional[_Episode]] = contextvars.ContextVar("agent_runner_episode", default=None)


def seed_tasks(n: int, start: int = 0, **fields: Any) -> list[dict[str, Any]]:
    """``n`` tasks ``{"id": "seed-<s>", "seed": s, **fields}`` for seeds ``start .. start + n - 1``.

    Pass them to ``LightningRL(store, trainer, seed_tasks(16), ...)``: LightningRL enqueues a task
    ``group_size`` times under one group id (from its ``"id"``), so each GRPO group holds episodes of one
    environment seed. ``fields`` are copied into every task (e.g. ``env="game:GuessTheNumber-v0-easy"``).

    Raises:
        ConfigError: ``n`` < 1, ``start`` < 0, or ``fields`` names ``id``/``seed``.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"seed_tasks: n must be an int >= 1, got {n!r}")
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise ConfigError(f"seed_tasks: start must be an int >= 0 (environment seeds are non-negative), got {start!r}")
    clash = {"id", "seed"} & set(fields)
    if clash:
        raise ConfigError(f"seed_tasks: {sorted(clash)} are set per task; drop them from the extra fields")
    return [{"id": f"seed-{s}", "seed": s, **fields} for s in range(start, start + n)]


def seed_of(task: Any) -> int:
    """The episode seed of ``task``: ``task["seed"]`` of a mapping, or ``task`` itself when it is an int.

    Raises:
        ConfigError: no ``"seed"`` field, or a seed that is not an int >= 0; the message says how to build tasks.
    """
    fix = "build tasks with lightning_nb.agents.seed_tasks(n), or give each task {'seed': <int>}"
    if isinstance(task, Mapping):
        if "seed" not in task:
            raise ConfigError(f"task has no 'seed' field (fields: {sorted(map(str, task))}): an AgentRunner runs "
                              f"run_job(seed) with the task's environment seed; {fix}")
        seed = task["seed"]
    else:
        seed = task
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ConfigError(f"task 'seed' must be an int >= 0, got {seed!r} ({type(seed).__name__}); {fix}")
    return seed


class AgentRunner(ABC):
    """Base class of ROLL-style episode agents: implement :meth:`run_job`; runners call the object.

    ``sampling`` (dict): defaults for every chat completion, e.g. ``{"max_tokens": 64, "temperature": 1.0}``;
    ``llm.sampling_parameters`` (set per rollout by LightningRL) override them, and keyword arguments of
    :meth:`_llm_request` override both. ``timeout_s``: the OpenAI client's timeout per request (seconds).

    Lifecycle: :meth:`setup` runs once per object, before its first episode (under a lock: the first runner
    thread to arrive runs it, the others wait); :meth:`teardown` runs at :meth:`close` (or ``with runner:``),
    after which the next episode runs :meth:`setup` again. With ``backend="ray"`` each actor gets a pickled copy
    that runs its own :meth:`setup`.
    """

    def __init__(self, *, sampling: Optional[Mapping[str, Any]] = None, timeout_s: float = 600.0) -> None:
        if sampling is not None and not isinstance(sampling, Mapping):
            raise ConfigError(f"sampling must be a dict of chat-completion parameters, got {type(sampling).__name__}")
        if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
            raise ConfigError(f"timeout_s must be a number of seconds > 0, got {timeout_s!r}")
        self.sampling = dict(sampling or {})
        self.timeout_s = float(timeout_s)
        self._lock = threading.Lock()
        self._ready = False

    # ----- the author's part -----
    @abstractmethod
    def run_job(self, seed: int) -> EpisodeResult:
        """Run one whole episode for environment ``seed`` and return how it went.

        Call the LLM only through :meth:`_llm_request` and report each step's reward with
        :meth:`_step_score` right after the ``env.step`` that produced it. Keep per-episode state in locals.
        """

    def setup(self) -> None:
        """One-time initialisation before the first episode (default: nothing)."""

    def teardown(self) -> None:
        """Release what :meth:`setup` made (default: nothing); called by :meth:`close`."""

    # ----- helpers for run_job -----
    def _llm_request(self, messages: list[dict[str, Any]], **kwargs: Any) -> Any:
        """One chat completion on the current attempt's proxy; returns the OpenAI SDK's ``ChatCompletion``.

        Parameters: ``self.sampling``, then ``llm.sampling_parameters``, then ``kwargs`` (e.g. ``tools=``,
        ``tool_choice=``), later ones winning. ``model`` is ``llm.model``.

        Raises:
            LightningNbError: called outside :meth:`run_job` of an episode a runner started.
            openai.APIError: the proxy refused the request (its message names the field).
        """
        ep = _current("_llm_request")
        if ep.client is None:
            import openai

            ep.client = openai.OpenAI(base_url=ep.llm.endpoint, api_key=ep.llm.api_key, max_retries=0,
                                      timeout=self.timeout_s)
        params = {**self.sampling, **ep.llm.sampling_parameters, **kwargs}
        reply = ep.client.chat.completions.create(model=ep.llm.model, messages=messages, **params)
        ep.llm_calls += 1
        return reply

    def _step_score(self, value: float, **attributes: Any) -> float:
        """Record one step's reward now, as an intermediate reward on the LLM call that most recently ended.

        Call it right after the ``env.step`` that judged that call's output. Returns the value as float.

        Raises:
            InvalidRewardError: ``value`` is not a finite real number.
            LightningNbError: called outside :meth:`run_job`.
        """
        ep = _current("_step_score")
        score = emit_intermediate_reward(value, name=STEP_SCORE_COMPONENT, step=len(ep.step_scores), **attributes)
        ep.step_scores.append(score)
        return score

    def _finished(self, agent_exit_reason: str = "", **metrics: Any) -> EpisodeResult:
        """A ``"Finished"`` result whose score is the sum of the step scores reported so far (ROLL's
        ``score=sum(rewards)``), with those step scores and ``metrics``. Call it at the end of :meth:`run_job`."""
        scores = list(_current("_finished").step_scores)
        return EpisodeResult(status="Finished", score=sum(scores), step_scores=scores,
                             agent_exit_reason=agent_exit_reason, metrics=metrics)

    # ----- lifecycle -----
    def close(self) -> None:
        """Run :meth:`teardown` if :meth:`setup` ran; the next episode runs :meth:`setup` again."""
        with self._lock:
            if self._ready:
                self._ready = False
                self.teardown()

    def __enter__(self) -> "AgentRunner":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:  # Ray pickles the agent: a lock does not pickle, and setup reruns
        state = dict(self.__dict__)
        state.pop("_lock", None)
        state["_ready"] = False
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def _ensure_setup(self) -> None:
        if "_lock" not in self.__dict__:
            raise ConfigError(f"{type(self).__name__}.__init__ did not call super().__init__(): AgentRunner keeps its "
                              f"setup lock and sampling defaults there; add super().__init__() (no ROLL base_url/"
                              f"env_id: the runners pass the proxy URL per episode)")
        if self._ready:
            return
        with self._lock:
            if not self._ready:
                self.setup()
                self._ready = True

    # ----- the agent protocol -----
    def __call__(self, task: Any, llm: LLMResource) -> None:
        """Run one episode for ``task`` (see the module docstring) and record its reward; returns None.

        Raises:
            ConfigError: ``task`` has no valid seed; ``run_job`` returned no :class:`EpisodeResult`; its
                ``step_scores`` disagree with the ones reported through :meth:`_step_score`.
            EpisodeFailed: the status is not ``"Finished"``.
        """
        seed = seed_of(task)
        self._ensure_setup()
        ep = _Episode(llm=llm, seed=seed)
        token = _CURRENT.set(ep)
        try:
            result = self.run_job(seed)
        finally:
            _CURRENT.reset(token)
            if ep.client is not None:
                ep.client.close()
        result = self._checked(result, ep)
        if result.status != "Finished":
            raise EpisodeFailed(f"episode for seed {seed} ended {result.status!r}: "
                                f"{result.agent_exit_reason or 'no agent_exit_reason given'}")
        emit_reward(result.score, **{EPISODE_STATUS: result.status, EPISODE_EXIT_REASON: result.agent_exit_reason,
                                     EPISODE_SEED: seed, EPISODE_METRICS: json.dumps(result.metrics, default=str)})
        return None

    def _checked(self, result: Any, ep: _Episode) -> EpisodeResult:
        name = type(self).__name__
        if not isinstance(result, EpisodeResult):
            raise ConfigError(f"{name}.run_job must return an EpisodeResult(status, score, ...), got "
                              f"{type(result).__name__}")
        if not result.step_scores:
            result.step_scores = list(ep.step_scores)
        elif not _same_scores(result.step_scores, ep.step_scores):
            raise ConfigError(
                f"{name}.run_job returned step_scores {result.step_scores} but reported {ep.step_scores} with "
                f"self._step_score(...): call self._step_score(reward) right after each env.step (so the reward "
                f"is credited to the LLM call it judges), and return those values or leave step_scores empty")
        result.metrics.setdefault("llm_calls", ep.llm_calls)
        result.metrics.setdefault("steps", len(result.step_scores))
        return result


def _same_scores(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=0, abs_tol=1e-12) for x, y in zip(a, b))


def _current(helper: str) -> _Episode:
    ep = _CURRENT.get()
    if ep is None:
        raise LightningNbError(f"AgentRunner.{helper} was called outside an episode: call it inside run_job, which "
                               f"the runners call through agent(task, llm) (start_runners(my_runner, store))")
    return ep
