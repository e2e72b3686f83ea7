"""A group-relative LLM judge (RULER-style) for GRPO groups: :class:`GroupJudge`.

RULER (OpenPipe ART, "Relative Universal LLM-Elicited Rewards", 2025) shows one judge call every trajectory of a
group and asks for a score per trajectory relative to the others, with a rubric; GRPO only needs the ranking inside
a group, which a judge gives more reliably than absolute scores. Here the trajectories are read from the store:
each rollout's latest attempt's LLM spans (:data:`~lightning_nb.semconv.PROMPT` and
:data:`~lightning_nb.semconv.COMPLETION`) make its conversation; the messages every trajectory of the group shares
(the system prompt, examples, the task) are left out, and the task is shown once (:func:`task_text` of the rollout's
input). One judge call, one ``SCORE <n>: <number>`` line per trajectory (:func:`parse_group_scores`).

What is written, to each judged rollout's latest attempt (a late span on an ended attempt is stored, and counts for
the reward when that attempt is the latest of a finished rollout: :mod:`lightning_nb.store.base`):

* a :data:`~lightning_nb.semconv.JUDGE_SPAN` span with the prompt, the verdict, the model, the rollout ids of the
  group (:data:`~lightning_nb.semconv.JUDGE_GROUP`) and the trajectory's score (as ``reward``, component ``name``);
* with ``as_reward=True`` (default), then a final :data:`~lightning_nb.semconv.REWARD_SPAN` with the score and
  :data:`~lightning_nb.semconv.REWARD_SOURCE` ``"group_judge"``: the last reward span of the attempt, so it becomes the
  final reward (:func:`lightning_nb.store.rules.final_reward`); ``store.rewards_df()`` lists the agent's own, now
  superseded, reward as component ``"agent"``.

Only succeeded rollouts are judged: a failed one keeps 0 (the final-reward rule), a cancelled one none.
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
import warnings
from typing import Any, Optional, Sequence, Union

from lightning_nb import semconv
from lightning_nb.errors import ConfigError
from lightning_nb.rewards.judge import (JudgeError, _clip_text, chat, check_common, check_scale, resolve_endpoint,
                                        task_text)
from lightning_nb.rewards.prompts import DEFAULT_RUBRIC, GROUP_EXAMPLES, GROUP_SYSTEM_PROMPT, fmt_score, group_messages
from lightning_nb.store.base import LightningStore
from lightning_nb.types import GROUP_ID_KEY, MAIN_LLM, LLMResource, Span

__all__ = ["GroupJudge", "parse_group_scores", "trajectory_messages", "GROUP_JUDGE_SOURCE"]

log = logging.getLogger(__name__)

#: :data:`~lightning_nb.semconv.REWARD_SOURCE` (and default component name) of the group judge's reward.
GROUP_JUDGE_SOURCE = "group_judge"
_GROUP_SCORE = re.compile(r"SCORE\s*(\d+)\s*[:=]\s*\**\s*([-+]?\d+(?:\.\d+)?)", re.IGNORECASE)


def parse_group_scores(verdict: str, n: int, scale: tuple[float, float] = (0.0, 1.0)) -> list[float]:
    """One score per trajectory ``1..n`` from the ``SCORE <k>: <number>`` lines of a group judge's reply (the last
    line for a ``k`` counts).

    Raises:
        JudgeError: a trajectory without a score line (``field="score <k>"``, naming every one missing), a line
            for a trajectory that does not exist, or a score outside ``scale``; the message quotes the verdict.
    """
    found: dict[int, float] = {}
    for k, value in _GROUP_SCORE.findall(verdict or ""):
        found[int(k)] = float(value)
    said = f"it wrote: {_clip_text(verdict, 300)!r}"
    extra = sorted(k for k in found if not 1 <= k <= n)
    if extra:
        raise JudgeError(f"group judge scored trajectory {extra[0]} (field 'score {extra[0]}'), but the group has "
                         f"{n}; {said}", field=f"score {extra[0]}", verdict=verdict)
    missing = [k for k in range(1, n + 1) if k not in found]
    if missing:
        names = ", ".join(f"'score {k}'" for k in missing)
        raise JudgeError(f"group judge gave no 'SCORE <n>: <number>' line for trajectory "
                         f"{', '.join(map(str, missing))} of {n} (field {names}); {said}",
                         field=f"score {missing[0]}", verdict=verdict)
    lo, hi = scale
    for k in range(1, n + 1):
        if not lo <= found[k] <= hi:
            raise JudgeError(f"group judge score {fmt_score(found[k])} of trajectory {k} (field 'score {k}') is "
                             f"outside the scale [{fmt_score(lo)}, {fmt_score(hi)}]; {said}",
                             field=f"score {k}", verdict=verdict)
    return [found[k] for k in range(1, n + 1)]


def trajectory_messages(spans: Sequence[Span]) -> list[dict[str, Any]]:
    """The conversation of one attempt from its LLM spans, in turn order: each call's prompt messages
    (:data:`~lightning_nb.semconv.PROMPT`) and its completion as an assistant message, each call adding only
    the messages the conversation so far does not already start with (a multi-turn agent's calls extend each
    other; independent calls are appended whole)."""
    out: list[dict[str, Any]] = []
    for s in spans:
        if s.name != semconv.LLM_SPAN or semconv.COMPLETION not in s.attributes:
            continue
        try:
            prompt = json.loads(s.attributes.get(semconv.PROMPT) or "[]")
        except (TypeError, ValueError):
            prompt = []
        call = [_message(m) for m in prompt if isinstance(m, dict)]
        call.append({"role": "assistant", "content": str(s.attributes[semconv.COMPLETION])})
        shared = _common_prefix([out, call])
        out += call[shared:] if shared == len(out) else call
    return out


def _message(m: dict[str, Any]) -> dict[str, Any]:
    content = m.get("content")
    if isinstance(content, list):  # content parts: keep the text
        content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return {"role": str(m.get("role", "")), "content": "" if content is None else str(content)}


def _common_prefix(conversations: Sequence[Sequence[dict[str, Any]]]) -> int:
    if not conversations:
        return 0
    n = min(len(c) for c in conversations)
    for i in range(n):
        if any(c[i] != conversations[0][i] for c in conversations[1:]):
            return i
    return n


def _render(messages: Sequence[dict[str, Any]], max_chars: int) -> str:
    text = "\n".join(f"{m['role']}: {m['content']}" for m in messages) or "(no reply)"
    return text if len(text) <= max_chars else "…" + text[-(max_chars - 1):]  # the end holds the answer


class GroupJudge:
    """Score every trajectory of a GRPO group relative to the others in one judge call (RULER-style).

    Args:
        endpoint: an OpenAI-compatible base URL (then ``model`` too), an :class:`~lightning_nb.types.LLMResource`,
            or None (default): the store's latest resources' ``llm_resource`` (the proxy's plain URL and the
            policy's model: the local engine), resolved at each call.
        model: the judge model's name.
        rubric: what a better trajectory is; ``{lo}``/``{hi}`` are filled with the scale.
        scale: ``(lo, hi)`` of the scores; a score outside it is a :class:`JudgeError`.
        as_reward: write each score as the rollout's final reward (a reward span with source ``"group_judge"``
            after the agent's). False: only the judge spans (a component beside the agent's reward).
        name: the reward component name of the judge spans' scores (default ``"group_judge"``).
        max_tokens: of the reply; None: ``8 + 8 * n`` for ``n`` trajectories. The reply is stopped before a
            ``SCORE <n+1>:`` line (a small judge copying the examples goes on past the last trajectory).
        temperature, api_key, timeout_s: of the judge call (greedy, the resource's key, 300 s).
        max_chars: each trajectory is shown to the judge cut to its last ``max_chars`` characters.
        system_prompt, examples: the prompt (:mod:`lightning_nb.rewards.prompts`).
        group_key: the rollout metadata key naming the group (:meth:`judge_rollouts`).
        llm_resource: the resource name used when ``endpoint`` is None.

    Raises:
        ConfigError: a bad endpoint, scale, max_tokens, temperature or max_chars, or a ``{field}`` in the rubric or
            system prompt other than ``{lo}``/``{hi}``/``{rubric}`` (naming the field).
    """

    def __init__(self, endpoint: Union[str, LLMResource, None] = None, model: Optional[str] = None, *,
                 rubric: str = DEFAULT_RUBRIC, scale: Sequence[float] = (0.0, 1.0), as_reward: bool = True,
                 name: str = GROUP_JUDGE_SOURCE, max_tokens: Optional[int] = None, temperature: float = 0.0,
                 api_key: Optional[str] = None, timeout_s: float = 300.0, max_chars: int = 1200,
                 system_prompt: str = GROUP_SYSTEM_PROMPT,
                 examples: Sequence[tuple[str, Sequence[str], Sequence[bool]]] = GROUP_EXAMPLES,
                 group_key: str = GROUP_ID_KEY, llm_resource: str = MAIN_LLM) -> None:
        self._endpoint = None if endpoint is None else resolve_endpoint(endpoint, model, api_key, "GroupJudge")
        self.model, self.api_key = model, api_key
        self.scale = check_scale(scale, "GroupJudge")
        check_common(max_tokens, temperature, "GroupJudge")
        if isinstance(max_chars, bool) or not isinstance(max_chars, int) or max_chars < 20:
            raise ConfigError(f"GroupJudge(max_chars={max_chars!r}) must be an int >= 20 (characters per trajectory)")
        self.rubric, self.as_reward, self.name = rubric, bool(as_reward), str(name)
        self.max_tokens, self.temperature, self.timeout_s = max_tokens, float(temperature), float(timeout_s)
        self.max_chars, self.system_prompt, self.examples = max_chars, system_prompt, tuple(examples)
        self.group_key, self.llm_resource = group_key, llm_resource
        group_messages("", [""], rubric=rubric, scale=self.scale, system_prompt=system_prompt,
                       examples=self.examples)  # an unknown {field} in the rubric or prompt fails here

    def __repr__(self) -> str:
        where = self._endpoint[0] if self._endpoint else f"the store's {self.llm_resource!r}"
        return f"GroupJudge({where}, scale={self.scale}, as_reward={self.as_reward})"

    def endpoint(self, store: LightningStore) -> tuple[str, str, str]:
        """``(base_url, model, api_key)`` the judge calls (the store's latest ``llm_resource`` when none was given).

        Raises:
            ConfigError: no endpoint was given and the store's latest resources have no such LLM resource.
        """
        if self._endpoint is not None:
            return self._endpoint
        latest = store.get_latest_resources()
        resource = latest.resources.get(self.llm_resource) if latest is not None else None
        if not isinstance(resource, LLMResource):
            raise ConfigError(f"GroupJudge(endpoint=None) calls the store's latest {self.llm_resource!r} LLM resource, "
                              "and there is none; pass GroupJudge(endpoint=proxy.endpoint(), model=...)")
        return resolve_endpoint(resource, self.model, self.api_key, "GroupJudge")

    def messages(self, store: LightningStore, rollout_ids: Sequence[str]) -> list[dict[str, Any]]:
        """The chat messages of one judge call over ``rollout_ids`` (one task: the first rollout's input)."""
        rollouts = store.query_rollouts(rollout_ids=list(rollout_ids))
        by_id = {r.rollout_id: r for r in rollouts}
        missing = [rid for rid in rollout_ids if rid not in by_id]
        if missing:
            raise ConfigError(f"GroupJudge: rollout_ids {missing} are not in the store")
        convs = [trajectory_messages(store.query_spans(rid, "latest")) for rid in rollout_ids]
        shared = min(_common_prefix(convs), *(max(len(c) - 1, 0) for c in convs))  # each keeps its last message
        responses = [_render(c[shared:], self.max_chars) for c in convs]
        return group_messages(task_text(by_id[rollout_ids[0]].input), responses, rubric=self.rubric,
                              scale=self.scale, system_prompt=self.system_prompt, examples=self.examples)

    def score_group(self, store: LightningStore, rollout_ids: Sequence[str]) -> dict[str, float]:
        """Judge ``rollout_ids`` (one group, each its latest attempt) in one call; write the spans; ``{id: score}``.

        Raises:
            ConfigError: fewer than 2 rollouts, or an id not in the store.
            JudgeError: the reply does not give one score per trajectory in the scale (naming which); the judge
                spans are still written, with the verdict and the error and no score, and no reward span.
            openai.APIError: the judge endpoint failed or is unreachable (nothing written).
        """
        rollout_ids = list(rollout_ids)
        if len(rollout_ids) < 2 or len(set(rollout_ids)) != len(rollout_ids):
            raise ConfigError(f"GroupJudge.score_group needs 2 or more distinct rollout ids, got {rollout_ids}")
        base_url, model, api_key = self.endpoint(store)
        messages = self.messages(store, rollout_ids)
        start = time.time()
        text = chat(base_url, api_key, model, messages, temperature=self.temperature, timeout_s=self.timeout_s,
                    max_tokens=self.max_tokens or 8 + 8 * len(rollout_ids),
                    stop=[f"SCORE {len(rollout_ids) + 1}:"])  # no line for a trajectory that does not exist
        try:
            scores: Optional[list[float]] = parse_group_scores(text, len(rollout_ids), self.scale)
            error = None
        except JudgeError as exc:
            scores, error = None, exc
        common = {semconv.JUDGE_MODEL: model, semconv.JUDGE_PROMPT: json.dumps(messages),
                  semconv.JUDGE_VERDICT: text, semconv.JUDGE_GROUP: json.dumps(rollout_ids)}
        spans: list[Span] = []
        for i, rid in enumerate(rollout_ids):
            spans += self._spans(store, rid, common, None if scores is None else scores[i], error, start)
        store.add_spans(spans)  # one write for the group: all or nothing on the store backends here
        if error is not None:
            raise error
        return dict(zip(rollout_ids, scores or []))

    def _spans(self, store: LightningStore, rollout_id: str, common: dict[str, Any], score: Optional[float],
               error: Optional[JudgeError], start: float) -> list[Span]:
        """The judge span (and, with a score and ``as_reward``, the reward span after it) for one rollout."""
        attempt_spans = store.query_spans(rollout_id, "latest")
        attempt = store.query_attempts(rollout_id)[-1]
        root = next((s for s in attempt_spans if s.parent_id is None and s.name == semconv.AGENT_SPAN), None)
        trace_id = root.trace_id if root is not None else uuid.uuid4().hex
        parent = root.span_id if root is not None else None
        attrs = dict(common)
        if score is None:
            attrs[semconv.ERROR] = str(error)[:2000]
        else:
            attrs.update({semconv.JUDGE_SCORE: score, semconv.REWARD: score, semconv.REWARD_NAME: self.name})
        now = time.time()
        out = [Span(rollout_id=rollout_id, attempt_id=attempt.attempt_id, trace_id=trace_id,
                    span_id=uuid.uuid4().hex[:16], parent_id=parent, name=semconv.JUDGE_SPAN, start_time=start,
                    end_time=now, status="error" if score is None else "ok", attributes=attrs)]
        if score is not None and self.as_reward:
            out.append(Span(rollout_id=rollout_id, attempt_id=attempt.attempt_id, trace_id=trace_id,
                            span_id=uuid.uuid4().hex[:16], parent_id=parent, name=semconv.REWARD_SPAN,
                            start_time=now, end_time=now, status="ok",
                            attributes={semconv.REWARD: score, semconv.REWARD_SOURCE: GROUP_JUDGE_SOURCE}))
        return out

    def judge_rollouts(self, store: LightningStore, rollout_ids: Sequence[str]) -> dict[str, int]:
        """Judge every group among ``rollout_ids`` (grouped by ``metadata[group_key]``): one call per group.

        Only succeeded rollouts take part; a group with fewer than 2 of them is skipped. A group whose reply does
        not parse (:class:`JudgeError`) keeps the agent's rewards: a warning names the group and the error.
        :class:`~lightning_nb.algorithm.lightning_rl.LightningRL` (``group_judge=``) calls this after each sample
        round's rollouts finish and before the adapter reads their rewards.

        Returns:
            Counts for the step's metrics: ``judge_groups`` (judged), ``judge_groups_failed`` (unparsable reply,
            agent's rewards kept), ``judge_groups_skipped`` (fewer than 2 succeeded rollouts).

        Raises:
            ConfigError: no endpoint (see :meth:`endpoint`).
            openai.APIError: the judge endpoint failed or is unreachable.
        """
        groups: dict[str, list[str]] = {}
        for r in store.query_rollouts(rollout_ids=list(rollout_ids)):
            key = str(r.metadata.get(self.group_key, r.rollout_id))
            groups.setdefault(key, [])
            if r.status == "succeeded":
                groups[key].append(r.rollout_id)
        counts = {"judge_groups": 0, "judge_groups_failed": 0, "judge_groups_skipped": 0}
        for key, ids in groups.items():
            if len(ids) < 2:
                counts["judge_groups_skipped"] += 1
                continue
            try:
                self.score_group(store, ids)
                counts["judge_groups"] += 1
            except JudgeError as exc:
                counts["judge_groups_failed"] += 1
                warnings.warn(f"group judge: group {key!r} keeps the agent's rewards: {exc}", stacklevel=2)
        return counts
