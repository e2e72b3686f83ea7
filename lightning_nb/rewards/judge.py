"""An LLM judge usable inside an agent: :class:`Judge` and :func:`judge_reward`.

The judge asks any OpenAI-compatible endpoint (the openai SDK) to grade one response against a rubric, with the
few-shot prompt of :mod:`lightning_nb.rewards.prompts`, and parses the last ``SCORE: <number>`` line of its reply.
Called inside an attempt (an agent run by a runner), it records one :data:`~lightning_nb.semconv.JUDGE_SPAN` span
on that attempt with the prompt, the verdict, the model, the parsed score as :data:`~lightning_nb.semconv.REWARD`
and the component name as :data:`~lightning_nb.semconv.REWARD_NAME`, so ``store.spans_df()`` shows the call and
``store.rewards_df()`` lists the score as a reward component beside the agent's ``"final"`` reward.

The judge never calls an attempt's URL: given the agent's ``llm`` resource it calls the same server's plain URL
(``{proxy}/v1``), where :class:`~lightning_nb.proxy.LLMProxy` serves the call without recording an LLM span, so
no trainer ever trains on the judge's tokens (the judge span is not an LLM span either: the adapter ignores it).

A judge that gives no score (a verdict without a usable ``SCORE``, a score outside the scale, a failed judge
call) is recorded, not fatal, by default (``on_error="record"``): the judge span keeps the verdict and the error
(status ``error``), :meth:`Judge.score` returns None, and the agent's own reward stays its final reward;
``store.rewards_df()`` shows the failure in its ``judge_error`` column and the runner group's ``status()`` counts
it (``judge_errors``). ``on_error="raise"`` raises :class:`JudgeError` (a ``ValueError``, naming the field, with
the verdict text) or the endpoint's error instead, so the attempt fails with it (its spans stay stored).
"""

from __future__ import annotations

import json
import math
import re
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

from lightning_nb import semconv
from lightning_nb.errors import ConfigError, LightningNbError
from lightning_nb.rewards.prompts import (DEFAULT_RUBRIC, JUDGE_EXAMPLES, JUDGE_SYSTEM_PROMPT, JUDGE_USER_TEMPLATE,
                                          fmt_score, judge_messages)
from lightning_nb.tracing.tracer import attempt_span
from lightning_nb.types import LLMResource

__all__ = ["Judge", "JudgeError", "JudgeVerdict", "judge_reward", "parse_score", "plain_endpoint", "task_text",
           "JUDGE_SOURCE", "ON_ERROR"]

#: :data:`~lightning_nb.semconv.REWARD_SOURCE` of a final reward a single judge gave.
JUDGE_SOURCE = "judge"
#: :class:`Judge`'s ``on_error`` choices: record a judge that gave no score and go on, or raise
ON_ERROR = ("record", "raise")
_SCORE = re.compile(r"SCORE\s*[:=]\s*\**\s*([-+]?\d+(?:\.\d+)?)", re.IGNORECASE)
_ATTRIBUTED = re.compile(r"^(?P<base>https?://.+?)/rollout/[^/]+/attempt/[^/]+(?P<v1>/v1)/?$")


class _Once:
    """The judge configurations whose first failure was warned about, so that every later failure of the same
    endpoint, model and scale stays quiet, however many :class:`Judge` objects ask (``judge_reward(llm=...)``
    builds one per call). Per process, thread-safe."""

    def __init__(self) -> None:
        self._seen: set[tuple[Any, ...]] = set()
        self._lock = threading.Lock()

    def first(self, key: tuple[Any, ...]) -> bool:
        """True the first time ``key`` is asked about."""
        with self._lock:
            new = key not in self._seen
            self._seen.add(key)
            return new


_WARNED = _Once()


class JudgeError(LightningNbError, ValueError):
    """A judge's reply gives no usable score; ``field`` names what is missing or wrong, ``verdict`` is the reply."""

    def __init__(self, message: str, *, field: str, verdict: str) -> None:
        super().__init__(message)
        self.field, self.verdict = field, verdict

    def __reduce__(self) -> Any:  # picklable (Ray runners send errors back)
        return (_rebuild_judge_error, (str(self), self.field, self.verdict))


def _rebuild_judge_error(message: str, field_: str, verdict: str) -> "JudgeError":
    return JudgeError(message, field=field_, verdict=verdict)


def check_scale(scale: Any, owner: str) -> tuple[float, float]:
    """``scale`` as ``(lo, hi)`` floats with lo < hi. Raises ConfigError naming ``owner``'s ``scale``."""
    try:
        lo, hi = (float(x) for x in scale)
    except (TypeError, ValueError):
        raise ConfigError(f"{owner}(scale={scale!r}) must be two numbers (lo, hi), e.g. (0, 1)") from None
    if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
        raise ConfigError(f"{owner}(scale={scale!r}) must be finite with lo < hi, e.g. (0, 1) or (0, 10)")
    return lo, hi


def _clip_text(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit - 1] + "…"


def parse_score(verdict: str, scale: tuple[float, float] = (0.0, 1.0), *, clamp: bool = False) -> float:
    """The score of a single judge's reply: the number on its last ``SCORE: <number>`` line (case-insensitive).

    ``clamp``: a number outside ``scale`` is moved to its nearer end instead of refused.

    Raises:
        JudgeError: no such line (``field="score"``), or (without ``clamp``) a number outside ``scale`` (a judge
            that writes 7 on a 0..1 scale did not follow the rubric). The message quotes the verdict.
    """
    found = _SCORE.findall(verdict or "")
    if not found:
        raise JudgeError(f"judge verdict has no 'SCORE: <number>' line (field 'score'); it wrote: "
                         f"{_clip_text(verdict)!r}. A small judge model often ignores the format: use a larger "
                         "judge, or give it more examples (Judge(examples=...))", field="score", verdict=verdict)
    score = float(found[-1])
    lo, hi = scale
    if clamp:
        return min(max(score, lo), hi)
    if not lo <= score <= hi:
        raise JudgeError(f"judge score {fmt_score(score)} (field 'score') is outside the scale "
                         f"[{fmt_score(lo)}, {fmt_score(hi)}]; it wrote: {_clip_text(verdict)!r}. Pass "
                         "Judge(clamp=True) to move such a score to the scale's nearer end, or give the judge a "
                         "rubric and examples on this scale", field="score", verdict=verdict)
    return score


def plain_endpoint(endpoint: str) -> str:
    """The server's plain base URL for an attempt's URL (``{proxy}/rollout/{r}/attempt/{a}/v1`` -> ``{proxy}/v1``);
    any other URL unchanged."""
    m = _ATTRIBUTED.match(endpoint.rstrip("/"))
    return f"{m.group('base')}{m.group('v1')}" if m else endpoint.rstrip("/")


def resolve_endpoint(endpoint: Union[str, LLMResource, None], model: Optional[str], api_key: Optional[str],
                     owner: str) -> tuple[str, str, str]:
    """``(base_url, model, api_key)`` of a judge: an LLMResource's server at its plain URL (and its model and key
    unless given), or a URL string with ``model``.

    Raises:
        ConfigError: no endpoint, a URL without ``model``, or an attempt's URL given as a string (the proxy would
            record the judge's calls as LLM spans of that attempt, and a trainer would train on them).
    """
    if isinstance(endpoint, LLMResource):
        return plain_endpoint(endpoint.endpoint), model or endpoint.model, api_key or endpoint.api_key
    if not isinstance(endpoint, str) or not endpoint:
        raise ConfigError(f"{owner}(endpoint=...) is required: pass the agent's llm resource (its server's plain URL "
                          "is used) or an OpenAI-compatible base URL such as proxy.endpoint() with model=...")
    if _ATTRIBUTED.match(endpoint.rstrip("/")):
        raise ConfigError(f"{owner}(endpoint={endpoint!r}) is an attempt's URL: the proxy would record the judge's "
                          f"calls as LLM spans of that attempt and train on them; pass {plain_endpoint(endpoint)!r} "
                          "(or the llm resource itself)")
    if not model:
        raise ConfigError(f"{owner}(model=...) is required with a URL endpoint: the model name the server serves")
    return endpoint.rstrip("/"), model, api_key or "not-needed"


def task_text(task: Any) -> str:
    """A task as the judge reads it: a str as is; a dict's ``question``, ``prompt`` or ``task`` field; else JSON."""
    if task is None:
        return "(not given)"
    if isinstance(task, str):
        return task
    if isinstance(task, dict):
        for key in ("question", "prompt", "task"):
            if isinstance(task.get(key), str):
                return task[key]
    return json.dumps(task, default=str)


@dataclass
class JudgeVerdict:
    """One judge call: ``score`` (in the judge's scale), the reply ``text``, the ``messages`` sent, the ``model``."""

    score: float
    text: str
    messages: list[dict[str, Any]] = field(default_factory=list)
    model: str = ""


def check_common(max_tokens: Any, temperature: Any, owner: str) -> None:
    """Raise ConfigError naming ``max_tokens`` (an int >= 1) or ``temperature`` (0..5) when out of range."""
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise ConfigError(f"{owner}(max_tokens={max_tokens!r}) must be an int >= 1 (tokens of the judge's reply)")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 <= temperature <= 5:
        raise ConfigError(f"{owner}(temperature={temperature!r}) must be a number in [0, 5] (0: greedy)")


def chat(base_url: str, api_key: str, model: str, messages: list[dict[str, Any]], *, max_tokens: int,
         temperature: float, timeout_s: float, stop: Optional[list[str]] = None) -> str:
    """One chat completion through the openai SDK; the reply's text."""
    import openai

    extra = {"stop": stop} if stop else {}
    with openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=timeout_s) as client:
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                               temperature=temperature, **extra)
    return reply.choices[0].message.content or ""


class Judge:
    """An LLM judge that grades one response against a rubric (inside an agent, or anywhere).

    LLM-as-a-judge, pointwise (Zheng et al. 2023, "Judging LLM-as-a-Judge with MT-Bench and Chatbot Arena"): a
    short verdict, then a score on the rubric's scale; :class:`~lightning_nb.rewards.GroupJudge` is the relative one.

    Args:
        endpoint: the agent's ``llm`` resource (the judge calls its server's plain URL, so the proxy records no LLM
            span: the judge's tokens are never trained on), or an OpenAI-compatible base URL (then ``model`` too).
        model: the judge model's name (default: the resource's model: the policy itself).
        rubric: what a good response is; ``{lo}``/``{hi}`` are filled with the scale.
        scale: ``(lo, hi)``, the range of the score; a score outside it is a :class:`JudgeError`.
        name: the reward component name of the judge's score (:data:`~lightning_nb.semconv.REWARD_NAME`, the
            ``component`` in ``store.rewards_df()``); default ``"judge"``.
        max_tokens, temperature: of the judge's reply (default 64 tokens, greedy).
        api_key: default the resource's (or ``"not-needed"``).
        timeout_s: seconds per judge call.
        system_prompt, user_template, examples: the prompt (:mod:`lightning_nb.rewards.prompts`).
        on_error: ``"record"`` (default): a judge that gives no score (:class:`JudgeError`, or the endpoint's
            ``openai.APIError``) is recorded on the judge span and :meth:`score` returns None; ``"raise"``: it
            raises (module docstring).
        clamp: a score outside ``scale`` is moved to the scale's nearer end (the span notes the score written)
            instead of refused as a :class:`JudgeError`.

    Raises:
        ConfigError: a missing or attempt endpoint, a bad scale, max_tokens or temperature, ``on_error`` not
            ``"record"``/``"raise"``, or a ``{field}`` in the rubric or system prompt other than
            ``{lo}``/``{hi}``/``{rubric}`` (naming the field).
    """

    def __init__(self, endpoint: Union[str, LLMResource, None] = None, model: Optional[str] = None, *,
                 rubric: str = DEFAULT_RUBRIC, scale: Sequence[float] = (0.0, 1.0), name: str = semconv.JUDGE_SPAN,
                 max_tokens: int = 64, temperature: float = 0.0, api_key: Optional[str] = None,
                 timeout_s: float = 300.0, system_prompt: str = JUDGE_SYSTEM_PROMPT,
                 user_template: str = JUDGE_USER_TEMPLATE,
                 examples: Sequence[tuple[str, str, str, bool]] = JUDGE_EXAMPLES, on_error: str = "record",
                 clamp: bool = False) -> None:
        if on_error not in ON_ERROR:
            raise ConfigError(f"Judge(on_error={on_error!r}) must be one of {ON_ERROR}: 'record' keeps the agent's "
                              "reward and records the failure, 'raise' fails the attempt")
        self.on_error, self.clamp = on_error, bool(clamp)
        self.base_url, self.model, self.api_key = resolve_endpoint(endpoint, model, api_key, "Judge")
        self.scale = check_scale(scale, "Judge")
        check_common(max_tokens, temperature, "Judge")
        self.rubric, self.name = rubric, str(name)
        self.max_tokens, self.temperature, self.timeout_s = max_tokens, float(temperature), float(timeout_s)
        self.system_prompt, self.user_template, self.examples = system_prompt, user_template, tuple(examples)
        self.messages("")  # a rubric or prompt with an unknown {field} fails here, not at the first call

    def __repr__(self) -> str:
        return (f"Judge({self.base_url!r}, model={self.model!r}, scale={self.scale}, name={self.name!r}, "
                f"on_error={self.on_error!r})")

    def messages(self, response: str, *, task: Any = None, rubric: Optional[str] = None) -> list[dict[str, Any]]:
        """The chat messages the judge is sent for ``response`` (``task``: text, or a task dict, see :func:`task_text`)."""
        return judge_messages(task_text(task), str(response), rubric=rubric or self.rubric, scale=self.scale,
                              system_prompt=self.system_prompt, user_template=self.user_template,
                              examples=self.examples)

    def verdict(self, response: str, *, task: Any = None, rubric: Optional[str] = None) -> JudgeVerdict:
        """Ask the judge and parse its score; records nothing.

        Raises:
            JudgeError: the reply has no usable score (:func:`parse_score`).
            openai.APIError: the endpoint failed or is unreachable.
        """
        messages = self.messages(response, task=task, rubric=rubric)
        text = chat(self.base_url, self.api_key, self.model, messages, max_tokens=self.max_tokens,
                    temperature=self.temperature, timeout_s=self.timeout_s)
        return JudgeVerdict(parse_score(text, self.scale, clamp=self.clamp), text, messages, self.model)

    def score(self, response: str, *, task: Any = None, rubric: Optional[str] = None) -> Optional[float]:
        """The judge's score of ``response`` (a float in ``scale``), or None when it gave none and ``on_error`` is
        ``"record"``.

        Inside an attempt (an agent run by a runner) it records a :data:`~lightning_nb.semconv.JUDGE_SPAN` span:
        prompt, verdict, model, component ``name`` and the score (as ``semconv.REWARD``; with ``clamp``, a note of the
        score written). A judge that gave no score leaves the span's status ``error`` with the error text (and
        no score); the first one of a judge configuration (endpoint, model, scale) warns once per process
        (``RuntimeWarning``, quoting the error whole), whatever the number of ``Judge`` objects made with it.
        Outside a rollout nothing is recorded.

        Raises:
            JudgeError: with ``on_error="raise"``: the reply has no usable score.
            openai.APIError: with ``on_error="raise"``: the endpoint failed or is unreachable.
        """
        messages = self.messages(response, task=task, rubric=rubric)
        with attempt_span(semconv.JUDGE_SPAN) as span:
            _record(span, {semconv.JUDGE_MODEL: self.model, semconv.JUDGE_PROMPT: json.dumps(messages),
                           semconv.REWARD_NAME: self.name})
            try:
                text = chat(self.base_url, self.api_key, self.model, messages, max_tokens=self.max_tokens,
                            temperature=self.temperature, timeout_s=self.timeout_s)
                _record(span, {semconv.JUDGE_VERDICT: text})
                value = parse_score(text, self.scale, clamp=self.clamp)
            except Exception as exc:
                if not self._recorded(exc, span):
                    raise
                return None
            written = parse_score(text, (-math.inf, math.inf))
            _record(span, {semconv.JUDGE_SCORE: value, semconv.REWARD: value})
            if written != value:
                _record(span, {semconv.REWARD_NOTE: f"clamped from {fmt_score(written)} to the scale {self.scale}"})
        return value

    def _recorded(self, exc: Exception, span: Any) -> bool:
        """Record a judge failure on ``span``; whether it is handled here (``on_error="record"`` and a judge's
        error, not a bug) rather than raised."""
        import openai
        from opentelemetry.trace import Status, StatusCode

        text = f"{type(exc).__name__}: {exc}"[:2000]
        if span is not None:
            span.set_attribute(semconv.ERROR, text)
            span.set_status(Status(StatusCode.ERROR, text[:200]))
        if self.on_error == "raise" or not isinstance(exc, (JudgeError, openai.APIError)):
            return False
        if _WARNED.first((self.base_url, self.model, self.scale)):
            warnings.warn(f"{self!r} gave no score ({text}); recorded, the agent's own reward stands. Later failures "
                          "of this endpoint, model and scale are not warned about: store.rewards_df().judge_error and "
                          "the runner group's status().judge_errors count every one; Judge(on_error='raise') fails "
                          "the attempt instead", RuntimeWarning, stacklevel=4)
        return True


def _record(span: Any, attributes: dict[str, Any]) -> None:
    if span is not None:
        span.set_attributes(attributes)


def judge_reward(response: str, rubric: Optional[str] = None, *, task: Any = None,
                 llm: Optional[LLMResource] = None, judge: Optional[Judge] = None,
                 on_error: str = "record", clamp: bool = False) -> Optional[float]:
    """Score ``response`` with an LLM judge inside an agent and record the judge span; returns the score.

    ``judge`` (a :class:`Judge`) or ``llm`` (the agent's resource: a default :class:`Judge` on its server's plain
    URL and model, with ``on_error`` and ``clamp``: :class:`Judge`'s) must be given. ``rubric`` replaces the judge's
    own for this call (None: the judge's, :data:`~lightning_nb.rewards.prompts.DEFAULT_RUBRIC` by default). The
    agent then returns its final reward: the judge's score, or a hand-written one (both appear in
    ``store.rewards_df()``: ``"final"`` and the judge's component, ``"judge"`` by default). A judge that gave no
    score returns None (``on_error="record"``): keep a hand-written reward to return then.

    Raises:
        ConfigError: neither ``judge`` nor ``llm`` given; ``on_error``/``clamp`` set beside a ``judge`` (set them
            on the Judge).
        JudgeError: with ``on_error="raise"``, the judge's reply has no usable score (the attempt fails with it
            unless the agent catches it).
    """
    if judge is None:
        if llm is None:
            raise ConfigError("judge_reward needs judge=Judge(...) or llm=<the agent's llm resource> (the judge then "
                              "calls the same server's plain URL with its model)")
        judge = Judge(llm, on_error=on_error, clamp=clamp)
    elif (on_error, clamp) != ("record", False):
        raise ConfigError("judge_reward(judge=..., on_error=/clamp=): set on_error and clamp on the Judge itself, "
                          "Judge(..., on_error=..., clamp=...); judge_reward's are for the judge it builds from llm=")
    return judge.score(response, task=task, rubric=rubric)
