"""Data model shared by the store, runners, proxy, adapter and trainer.

Status machines
---------------
Rollout (a task)::

    queuing ──dequeue──▶ preparing ──runner starts agent──▶ running ──▶ succeeded
                                                              │
                                                              ├──▶ failed     (attempts exhausted)
                                                              └──▶ requeuing ──dequeue──▶ preparing ...
    any non-terminal status ──cancel──▶ cancelled

Attempt (one execution of a rollout)::

    preparing ──▶ running ──▶ succeeded | failed | timeout
        └──────────┴──▶ unresponsive   (set by the store's watchdog, or on reopen after a crash)

``succeeded``, ``failed``, ``timeout``, ``unresponsive`` are terminal for an attempt;
``succeeded``, ``failed`` and ``cancelled`` are terminal for a rollout. A rollout whose
attempt ends in a status listed in ``RolloutConfig.retry_condition`` (by default
``failed``, ``timeout`` and ``unresponsive``) goes back to ``requeuing`` while it has
attempts left (``RolloutConfig.max_attempts``), else to ``failed``.

The store's watchdog (``LightningStore.sweep_attempts``) ends an attempt still
``preparing`` or ``running`` in ``timeout`` once it is older than
``timeout_seconds`` (counted from the attempt's ``start_time``), and in
``unresponsive`` once no heartbeat arrived for ``unresponsive_seconds`` (counted
from ``last_heartbeat_time``, or ``start_time`` before the first heartbeat). A
durable store also marks attempts ``unresponsive`` when it is reopened (e.g. after
a crash) while they were still ``preparing`` or ``running``.

Times are float seconds since the epoch (``time.time()``).
"""

from __future__ import annotations

import math
import os
import random
import time
import warnings
from typing import Any, Callable, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from lightning_nb.semconv import RENAMED_KEYS

__all__ = [
    "SpanAttributes",
    "register_html_view",
    "html_view",
    "RolloutStatus",
    "AttemptStatus",
    "RolloutMode",
    "RolloutConfig",
    "Rollout",
    "Attempt",
    "AttemptedRollout",
    "Worker",
    "WorkerStatus",
    "Span",
    "LLMResource",
    "PromptTemplate",
    "ResourcesUpdate",
    "Triplet",
    "new_id",
    "ROLLOUT_TERMINAL",
    "ATTEMPT_TERMINAL",
    "GROUP_ID_KEY",
    "SAMPLING_PARAMETERS_KEY",
    "MAIN_LLM",
    "PARENT_ROLLOUT_KEY",
    "BRANCH_CALL_KEY",
    "REPLAY_KEY",
]

RolloutStatus = Literal["queuing", "preparing", "running", "requeuing", "succeeded", "failed", "cancelled"]
#: An attempt's status; ``timeout`` and ``unresponsive`` are the watchdog's verdicts (see :data:`ATTEMPT_TERMINAL`).
AttemptStatus = Literal["preparing", "running", "succeeded", "failed", "timeout", "unresponsive"]
#: What a rollout is for: ``train`` (trained on), ``val`` or ``test`` (held out, never trained on).
RolloutMode = Literal["train", "val", "test"]
#: Rollout metadata key marking traffic a user started (``LLMProxy``'s ``/traffic`` route: ``"proxy"``;
#: ``Runner.step``: ``"runner"``), which :class:`~lightning_nb.algorithm.traffic.TrafficLearner` may train on.
TRAFFIC_KEY = "traffic"
#: Rollout metadata key naming a rollout's GRPO group (``LightningRL`` writes it, ``TripletAdapter`` and
#: ``GroupJudge`` read it; each takes ``group_key=`` to use another key, and LightningRL writes its adapter's).
GROUP_ID_KEY = "group_id"
#: Rollout metadata key of the rollout's own sampling parameters (``{"temperature": ..., "max_tokens": ...}``),
#: which runners hand the agent in ``llm.sampling_parameters`` and the LLM proxy applies on the rollout's URL.
SAMPLING_PARAMETERS_KEY = "sampling_parameters"
#: Rollout metadata key of the rollout a replay or a branch copies (:func:`lightning_nb.replay.branch`).
PARENT_ROLLOUT_KEY = "parent_rollout_id"
#: Rollout metadata key of a branch's number of calls replayed from its parent (0: none, a fresh rollout).
BRANCH_CALL_KEY = "branch_call"
#: Rollout metadata key the LLM proxy reads to answer a rollout's first calls from another's record:
#: ``{"rollout_id": parent, "attempt_id": its attempt, "calls": k}`` (:mod:`lightning_nb.proxy.replay`).
REPLAY_KEY = "replay"
#: The name of the LLM resource agents are given (``store.add_resources({MAIN_LLM: proxy.as_resource()})``).
MAIN_LLM = "main_llm"
#: A worker's (runner's) status in :class:`Worker`; ``unresponsive``: its heartbeats stopped.
WorkerStatus = Literal["idle", "busy", "stopped", "unresponsive"]

#: The rollout statuses that never change again.
ROLLOUT_TERMINAL: frozenset[str] = frozenset({"succeeded", "failed", "cancelled"})
#: The attempt statuses that never change again.
ATTEMPT_TERMINAL: frozenset[str] = frozenset({"succeeded", "failed", "timeout", "unresponsive"})


# Ids come from a private generator seeded from os.urandom, not from uuid.uuid4(): os.urandom releases the
# GIL on every call, and a store that makes an attempt id under its lock then waits for the GIL back while
# its runner threads queue up on that lock (with 32 runner threads that cost InMemoryStore ~10% of its CPU).
# Private, so a notebook's random.seed() cannot make two runs repeat ids; reseeded in a forked child, so a
# child and its parent never share a sequence.
_ids = random.Random()
if hasattr(os, "register_at_fork"):  # POSIX; there is no fork elsewhere
    os.register_at_fork(after_in_child=_ids.seed)


def new_id(prefix: str) -> str:
    """A short unique id such as ``ro-1f3a9c2b7d4e``: ``prefix``, a dash, 48 random bits as 12 hex digits."""
    return f"{prefix}-{_ids.getrandbits(48):012x}"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


_RETRYABLE = ("failed", "timeout", "unresponsive")


class RolloutConfig(_Model):
    """Retry and timeout policy of one rollout (all times in seconds).

    Raises pydantic's ``ValidationError`` (a ValueError) naming the field for a bad value.
    """

    max_attempts: int = Field(1, ge=1, description="Attempts before the rollout is marked failed.")
    timeout_seconds: Optional[float] = Field(
        None, gt=0, description="Wall-clock limit of one attempt; None means no limit."
    )
    unresponsive_seconds: Optional[float] = Field(
        None, gt=0, description="An attempt with no heartbeat for this long is ended 'unresponsive'; None: never."
    )
    retry_condition: list[AttemptStatus] = Field(
        default_factory=lambda: list(_RETRYABLE),
        description="Terminal attempt statuses that requeue the rollout while attempts remain.",
    )

    @field_validator("retry_condition")
    @classmethod
    def _retryable(cls, v: list[str]) -> list[str]:
        bad = [s for s in v if s not in _RETRYABLE]
        if bad:
            raise ValueError(f"retry_condition may only list {list(_RETRYABLE)}, got {bad}")
        return list(dict.fromkeys(v))


class Rollout(_Model):
    """A unit of work (a task) and its lifecycle. ``input`` is whatever the agent takes."""

    rollout_id: str
    input: Any
    mode: RolloutMode = "train"
    status: RolloutStatus = "queuing"
    resources_id: Optional[str] = None
    config: RolloutConfig = Field(default_factory=RolloutConfig)
    metadata: dict[str, Any] = Field(default_factory=dict)
    enqueue_time: float = Field(default_factory=time.time)
    start_time: Optional[float] = None
    end_time: Optional[float] = None
    num_attempts: int = 0

    def _repr_html_(self) -> Optional[str]:
        return html_view(self)


class Attempt(_Model):
    """One execution of a rollout by a runner."""

    rollout_id: str
    attempt_id: str
    sequence_id: int = Field(description="1 for the first attempt of the rollout, 2 for the retry, ...")
    status: AttemptStatus = "preparing"
    worker_id: Optional[str] = None
    start_time: float = Field(default_factory=time.time)
    end_time: Optional[float] = None
    last_heartbeat_time: Optional[float] = None
    error: Optional[str] = Field(None, description="Traceback or message when the attempt did not succeed.")


class Worker(_Model):
    """A runner as the store sees it: what it is doing and when it was last heard from.

    Created by the store the first time a ``worker_id`` dequeues, starts a rollout,
    sends an attempt heartbeat or calls ``update_worker``; times are epoch seconds.
    """

    worker_id: str
    status: WorkerStatus = "idle"
    current_rollout_id: Optional[str] = None
    current_attempt_id: Optional[str] = None
    first_seen_time: float = Field(default_factory=time.time)
    last_heartbeat_time: Optional[float] = None
    last_dequeue_time: Optional[float] = None
    heartbeat_stats: dict[str, Any] = Field(default_factory=dict)


class AttemptedRollout(_Model):
    """What ``dequeue_rollout`` hands a runner: the rollout and its fresh attempt."""

    rollout: Rollout
    attempt: Attempt


#: every renamed attribute key: the old key -> the key that replaced it (:data:`lightning_nb.semconv.RENAMED_KEYS`
#: over all span names; no old key was renamed two ways)
_RENAMED = {old: new for renames in RENAMED_KEYS.values() for old, new in renames.items()}


class SpanAttributes(dict):
    """A span's attribute dict that still answers the keys of earlier versions, for one release.

    Reading a key renamed by :data:`lightning_nb.semconv.RENAMED_KEYS` (``attributes["prompt_token_ids"]``,
    ``attributes.get("prompt_token_ids")``) returns the value stored under its new key
    (``lightning_nb.prompt.token_ids``) with a ``DeprecationWarning`` naming it. Only a key that is missing is
    looked up there, so reading a present key costs what it costs a dict; ``in``, iteration, ``keys()`` and
    the JSON show the stored keys only.
    """

    __slots__ = ()

    def __missing__(self, key: str) -> Any:
        return self._renamed(key, KeyError(key))

    def get(self, key: str, default: Any = None) -> Any:  # type: ignore[override]
        if dict.__contains__(self, key):
            return dict.__getitem__(self, key)
        return self._renamed(key, default)

    def _renamed(self, key: str, missing: Any) -> Any:
        """The value of ``key``'s new key, with a DeprecationWarning; ``missing`` (raised if an exception) without."""
        new = _RENAMED.get(key)
        if new is None or not dict.__contains__(self, new):
            if isinstance(missing, KeyError):
                raise missing
            return missing
        warnings.warn(f"span attribute {key!r} is renamed {new!r} (lightning_nb.semconv); read the new key, the "
                      f"old one stops working in the next release", DeprecationWarning, stacklevel=3)
        return dict.__getitem__(self, new)


class Span(_Model):
    """One finished span (an LLM call, a tool call, a reward, the agent itself).

    ``attributes`` holds OpenTelemetry attribute values (str, bool, int, float or
    lists of them), as a :class:`SpanAttributes` dict on a validated span (a span built or read back by a
    store): an attribute key of earlier versions still reads, with a ``DeprecationWarning`` naming its new
    key. ``sequence_id`` is assigned by the store, increasing per attempt.
    """

    rollout_id: str
    attempt_id: str
    sequence_id: int = 0
    trace_id: str
    span_id: str
    parent_id: Optional[str] = None
    name: str
    start_time: float
    end_time: float
    status: Literal["ok", "error", "unset"] = "unset"
    attributes: dict[str, Any] = Field(default_factory=SpanAttributes)

    @field_validator("attributes")
    @classmethod
    def _aliased(cls, v: dict[str, Any]) -> dict[str, Any]:
        return v if type(v) is SpanAttributes else SpanAttributes(v)


class LLMResource(_Model):
    """An OpenAI-compatible endpoint agents call (usually the LLM proxy)."""

    kind: Literal["llm"] = "llm"
    endpoint: str = Field(description="Base URL ending in /v1, e.g. http://127.0.0.1:8000/v1")
    model: str
    sampling_parameters: dict[str, Any] = Field(default_factory=dict)
    api_key: str = "not-needed"


class PromptTemplate(_Model):
    """A prompt an algorithm may tune (APO), kept in a resources set and versioned with it.

    ``engine`` is the *template* engine (not an inference engine): ``"format"`` (the default, and what
    sets stored before this field existed load as) fills ``{name}`` fields with ``str.format`` (``{{`` and
    ``}}`` are literal braces); ``"jinja2"`` renders ``{{ name }}`` with jinja2's sandboxed environment
    and ``StrictUndefined`` (so a template an LLM wrote cannot reach Python internals, and an undefined
    name is an error, never an empty string).

    :attr:`variables` are the names the template uses. :meth:`format` fills them: a missing one is a
    ConfigError naming it; extra fields are allowed and unused (an agent passes every field it has, and
    each version of the template uses the ones it wants).

    Raises:
        ConfigError: on construction, ``template`` does not parse under ``engine`` (an unmatched brace, a
            positional ``{}``/``{0}`` field that keyword ``format()`` can never fill, a jinja2 syntax error),
            or another field is invalid. Assignment after construction raises pydantic's ValidationError
            (also a ValueError) for the same reasons.
    """

    kind: Literal["prompt_template"] = "prompt_template"
    template: str
    engine: Literal["format", "jinja2"] = Field("format", description=(
        "Template engine: 'format' (str.format fields, {name}) or 'jinja2' ({{ name }}, sandboxed, StrictUndefined)."))

    def __init__(self, /, **data: Any) -> None:
        from pydantic import ValidationError

        try:
            super().__init__(**data)
        except ValidationError as exc:
            where = "; ".join(f"PromptTemplate.{'.'.join(map(str, e['loc'])) or 'template'}: "
                              f"{e['msg'].removeprefix('Value error, ')}" for e in exc.errors())
            from lightning_nb.errors import ConfigError

            raise ConfigError(where) from None

    @model_validator(mode="after")
    def _parses(self) -> "PromptTemplate":
        _template_variables(self.template, self.engine)  # raises ValueError naming the problem
        return self

    @property
    def variables(self) -> frozenset[str]:
        """The names the template uses (``{question}`` or ``{{ question }}`` -> ``question``; for
        ``{user.name}`` or ``{rows[0]}`` the base name ``user``/``rows``; for jinja2 the undeclared names,
        so a loop variable or a ``{% set %}`` name is not one)."""
        return _template_variables(self.template, self.engine)

    def format(self, **fields: Any) -> str:
        """The template filled with ``fields`` (extra fields are ignored).

        Raises:
            ConfigError: a variable of the template is not in ``fields`` (the error names the missing
                ones, the given ones and the template), or filling failed (a format spec that does not
                fit the value, a jinja2 runtime error).
        """
        missing = sorted(self.variables - fields.keys())
        if missing and self.engine == "format":
            raise self._error(f"is missing variable(s) {missing}", fields)
        try:
            if self.engine == "format":
                return self.template.format(**fields)
            return _jinja_template(self.template).render(**fields)
        except Exception as exc:  # str.format's ValueError/KeyError/..., jinja2's UndefinedError/SecurityError
            what = f"is missing variable(s) {missing}" if missing else f"could not be filled ({type(exc).__name__}: {exc})"
            raise self._error(what, fields) from exc

    def _error(self, what: str, fields: dict[str, Any]) -> Exception:
        from lightning_nb.errors import ConfigError

        short = self.template if len(self.template) <= 160 else self.template[:157] + "..."
        return ConfigError(f"PromptTemplate ({self.engine}) {what}: it uses {sorted(self.variables)}, format() got "
                           f"{sorted(fields)}; template: {short!r}")


def _template_variables(template: str, engine: str) -> frozenset[str]:
    """The variables of ``template`` under ``engine`` (see :attr:`PromptTemplate.variables`); raises ValueError."""
    if engine == "jinja2":
        import jinja2
        from jinja2 import meta

        try:
            return frozenset(meta.find_undeclared_variables(_jinja_env().parse(template)))
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(f"not a jinja2 template: {exc.message} (line {exc.lineno})") from None
    return frozenset(_format_fields(template))


def _format_fields(template: str) -> set[str]:
    import re
    import string

    names: set[str] = set()
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ValueError(f"not a str.format template: {exc} (write {{{{ and }}}} for literal braces)") from None
    for _, field, spec, conversion in parsed:
        if field is None:
            continue
        base = re.split(r"[.\[]", field, maxsplit=1)[0]
        if base == "" or base.isdigit():
            raise ValueError(f"positional field {{{field}}}: format() fills named fields only, e.g. {{question}} "
                             "(write {{ and }} for literal braces)")
        if re.search(r"(^|[.\[])_", field):
            raise ValueError(f"field {{{field}}} reaches a private attribute or item (a name starting with '_'), "
                             "which a prompt must not show")
        if conversion not in (None, "r", "s", "a"):
            raise ValueError(f"field {{{field}!{conversion}}}: the conversion must be !r, !s or !a")
        names.add(base)
        if spec:
            names |= _format_fields(spec)
    return names


_JINJA: dict[str, Any] = {}


def _jinja_env() -> Any:
    """The one sandboxed jinja2 environment (StrictUndefined, no autoescape) that renders PromptTemplates."""
    env = _JINJA.get("env")
    if env is None:
        import jinja2
        from jinja2.sandbox import SandboxedEnvironment

        env = _JINJA["env"] = SandboxedEnvironment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                                                   autoescape=False)
    return env


def _jinja_template(template: str) -> Any:
    """``template`` compiled (cached: at most 256 distinct texts are kept)."""
    cache = _JINJA.setdefault("templates", {})
    compiled = cache.get(template)
    if compiled is None:
        if len(cache) >= 256:
            cache.clear()
        compiled = cache[template] = _jinja_env().from_string(template)
    return compiled


class ResourcesUpdate(_Model):
    """A named, versioned set of resources (``{"main_llm": LLMResource(...), ...}``).

    The store sets ``version`` and the times: ``version`` is 1 when ``resources_id`` is
    first added and goes up by one each time ``add_resources`` writes that id again;
    ``create_time`` is the first write, ``update_time`` the latest (epoch seconds).
    """

    resources_id: str
    resources: dict[str, LLMResource | PromptTemplate]
    version: int = Field(1, ge=1, description="1 on the first add of this id, +1 on each later add of the same id.")
    create_time: float = Field(default_factory=time.time)
    update_time: Optional[float] = Field(None, description="Last write (epoch seconds); create_time if never rewritten.")

    @model_validator(mode="after")
    def _update_time(self) -> "ResourcesUpdate":
        if self.update_time is None:  # sets written before versions existed (an older SqliteStore file)
            self.__dict__["update_time"] = self.create_time
        return self


class Triplet(_Model):
    """One transition for RL: the prompt the model saw, the tokens it produced, the reward.

    ``prompt_ids`` and ``response_ids`` are exactly the token IDs the engine used
    (never re-tokenized). ``logprobs`` (len == len(response_ids)) are the engine's
    log-probabilities of the response tokens under the sampling distribution.
    ``reward`` is the episode's final reward (LightningRL credit: every transition of the
    episode carries it). ``step_reward`` is the sum of the intermediate rewards attributed to
    this LLM call (:func:`lightning_nb.emit_intermediate_reward`, attributed by
    :class:`~lightning_nb.adapter.TripletAdapter`; 0.0 without any); the algorithm's credit
    (``AlgorithmConfig.credit``, :mod:`lightning_nb.credit`) combines the two into ``advantages``, one per
    response token, which the trainer trains on.
    """

    rollout_id: str
    attempt_id: str
    group_id: str = Field(description="Tasks sharing a group_id form one GRPO group.")
    turn: int = Field(description="0-based index of this LLM call within the attempt.")
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: Optional[list[float]] = None
    reward: float
    step_reward: float = Field(0.0, description=(
        "Sum of the intermediate rewards (Agent Lightning's Automatic Intermediate Rewarding) attributed to this "
        "call: those emitted after it ended and before the next call of the attempt ended; reward units."))
    advantages: Optional[list[float]] = Field(None, description=(
        "The advantage of each response token (len == len(response_ids)), set by the algorithm's credit step "
        "(lightning_nb.credit.assign, or an algorithm's own) before Trainer.update, which trains on them as given. "
        "None: not credited yet."))
    baseline: Optional[float] = Field(None, description=(
        "Deprecated (DeprecationWarning when set): the algorithm's baseline now travels to lightning_nb.credit.assign"
        "(baselines=...) and the advantages it gives (Triplet.advantages). Read for one release by Trainer.update "
        "on triplets without advantages: the episode's advantage is its reward minus it (REINFORCE with a baseline, "
        "Williams 1992)."))
    agent_name: Optional[str] = Field(None, description=(
        "The X-Agent-Name header of the request (span attribute gen_ai.agent.name); None if not sent."))
    temperature: float = 1.0
    top_p: float = Field(1.0, description="Nucleus sampling cut of the call; the GRPO trainer refuses < 1.")
    weight_version: Optional[int] = Field(None, description="Engine weight version that sampled the response.")
    finish_reason: Optional[str] = Field(None, description=(
        "Why the engine stopped: 'stop', 'length' (cut at max_tokens) or 'tool_calls'; None if unknown."))
    prompt_text: str = ""
    response_text: str = ""
    replayed: bool = Field(False, description=(
        "The call was answered from another rollout's record (the replayed part of a replay or a branch, span "
        "attribute lightning_nb.replay.source_span_id), not sampled: its response tokens are context (response "
        "mask 0), never trained again; the parent rollout's own triplet trains them."))

    @field_validator("reward", "step_reward")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError(f"reward and step_reward must be finite numbers, got {v!r}")
        return v

    @field_validator("baseline")
    @classmethod
    def _finite_baseline(cls, v: Optional[float]) -> Optional[float]:
        if v is not None:
            warnings.warn("Triplet.baseline is deprecated: pass the baselines to lightning_nb.credit.assign("
                          "rule, triplets, baselines={rollout_id: b}), which sets Triplet.advantages; the field goes "
                          "in the next release", DeprecationWarning, stacklevel=2)
            if not math.isfinite(v):
                raise ValueError(f"baseline must be a finite number or None, got {v!r}")
        return v

    @field_validator("advantages")
    @classmethod
    def _finite_advantages(cls, v: Optional[list[float]]) -> Optional[list[float]]:
        if v is not None and not all(math.isfinite(a) for a in v):
            raise ValueError("advantages must be finite numbers (one per response token); got a NaN or an infinity")
        return v

    @model_validator(mode="after")
    def _one_advantage_per_token(self) -> "Triplet":
        if self.advantages is not None and len(self.advantages) != len(self.response_ids):
            raise ValueError(f"Triplet.advantages has {len(self.advantages)} values for {len(self.response_ids)} "
                             "response tokens: give one per token of response_ids (or one float to "
                             "lightning_nb.credit.with_advantages, which repeats it)")
        return self


# ----- notebook display ------------------------------------------------------------------------
# The HTML views live in lightning_nb.inspect; lightning_nb/__init__.py registers them for the classes of
# every layer, and objects reach them through this registry, so no layer imports upward. A class the root
# does not import (a trainer, loaded on first use) is registered by its dotted name instead of the class.
_HTML_VIEWS: dict[type | str, Callable[[Any], str]] = {}


def register_html_view(cls: type | str, view: Callable[[Any], str]) -> None:
    """Show instances of ``cls`` (and its subclasses) in a notebook with ``view(obj) -> HTML text``.

    ``cls`` is the class, or its dotted name (``"lightning_nb.trainers.grpo.trainer.GRPOTrainer"``, the class's
    ``__module__`` and ``__qualname__``) to register a view without importing the class. Called by the package
    root (``lightning_nb/__init__.py``) with the views of :mod:`lightning_nb.inspect` for the kit's own classes;
    a later registration for the same class replaces the earlier one.
    """
    _HTML_VIEWS[cls] = view


def html_view(obj: Any) -> Optional[str]:
    """The HTML of ``obj`` from the view registered for its class (nearest in its MRO, by the class or by its
    dotted name), or None when there is none (Jupyter then shows ``repr(obj)``). This is what ``_repr_html_``
    returns."""
    for cls in type(obj).__mro__:
        view = _HTML_VIEWS.get(cls) or _HTML_VIEWS.get(f"{cls.__module__}.{cls.__qualname__}")
        if view is not None:
            return view(obj)
    return None
