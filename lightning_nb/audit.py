"""What the optimizer will see, checked before and after training: token fidelity, preflight, the batch view.

Users of every RL-for-agents kit report empty or misaligned training data that they
discover only after hours of compute (all-zero masks, all-equal groups, re-tokenized
prompts). This module shows it up front:

* :func:`token_fidelity`: per LLM call, does the served prompt equal the chat template's
  rendering of the recorded messages (``render``), and does each turn's prompt extend the
  previous turn's prompt + completion token for token, so that
  :func:`~lightning_nb.trainer.pack_episode` can merge the turns (``fork`` where it cannot)?
* :func:`preflight` (also ``LightningRL.preflight()``): one collection round without an
  update, reporting what would make training useless, each finding with its fix.
* :func:`batch_df` / :func:`batch_html`: the optimizer's-eye view of ``GRPOTrainer.last_batch``:
  one row per trained sequence, tokens shaded by the response mask and coloured by the
  advantage, with the engine's and the trainer's log-probs and the ratio per token.

No UI package is imported: the HTML views are plain strings (as in :mod:`lightning_nb._repr`).
"""

from __future__ import annotations

import html
import json
import math
import random
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Optional, Sequence

import pandas as pd

from lightning_nb.adapter import TripletAdapter
from lightning_nb.chat_format import render_tools
from lightning_nb.engine import prompt_token_ids
from lightning_nb.proxy import LLM_SPAN_NAME, TOKEN_IDS_MISSING
from lightning_nb.runner import NO_REWARD_ERROR
from lightning_nb.store.base import LightningStore
from lightning_nb.trainer import pack_episode
from lightning_nb.types import RolloutConfig, Span, Triplet

if TYPE_CHECKING:
    from lightning_nb.algorithm import LightningRL

__all__ = ["FIDELITY_COLUMNS", "BATCH_COLUMNS", "Finding", "PreflightReport", "token_fidelity", "preflight",
           "batch_df", "batch_html"]

FIDELITY_COLUMNS = ["rollout_id", "attempt_id", "turn", "kind", "cause", "position", "served_id", "expected_id",
                    "served", "expected"]
BATCH_COLUMNS = ["rollout_id", "group_id", "advantage", "tokens", "response_tokens", "mean_ratio",
                 "max_abs_logprob_diff", "response_text"]
_BOX = "font-family:var(--jp-ui-font-family,sans-serif);font-size:13px;line-height:1.4"


# ----- token fidelity ---------------------------------------------------------------------
def token_fidelity(store: LightningStore, rollout_ids: Sequence[str], tokenizer: Any, *,
                   tool_format: str = "hermes", context: int = 3) -> pd.DataFrame:
    """Token mismatches of the LLM calls of ``rollout_ids`` (latest attempts); one row per mismatch.

    Two checks per LLM call (span) that carries token IDs; ``turn`` is the call's index
    among the attempt's LLM spans, as in :class:`~lightning_nb.adapter.TripletAdapter`:

    * ``render``: the recorded messages (``gen_ai.prompt``), rendered as the proxy sent them
      (with ``tool_format="hermes"``, through :func:`~lightning_nb.chat_format.render_tools`
      with the span's ``gen_ai.request.tools`` and ``tool_choice``) and then through
      ``tokenizer``'s chat template (:func:`~lightning_nb.engine.prompt_token_ids`), must give
      the served ``prompt_token_ids``. ``expected`` is the re-rendering. A mismatch means
      the engine renders with another template or tokenizer than ``tokenizer``.
    * ``fork``: the prompt of a call must start with the previous call's prompt + completion
      tokens, else :func:`~lightning_nb.trainer.pack_episode` starts a new sequence there.
      ``expected`` is the previous call's prompt + completion. Causes: the agent edits or
      drops history, or the reply's text re-tokenizes differently from the sampled tokens
      (a sampled model may write a word in a non-canonical split: SmolLM2-135M at
      temperature 1.0 wrote ``E|CO`` where its tokenizer writes ``EC|O``).

    Only mismatches get a row, so an empty frame means every checked call matched; the
    number of calls checked is in ``df.attrs["calls_checked"]`` (and rollouts in
    ``df.attrs["rollouts_checked"]``), so an empty result is never mistaken for a check
    that did not run. Calls without token IDs are not checked (the preflight reports them).

    Columns: ``rollout_id``, ``attempt_id``, ``turn``, ``kind`` (``"render"`` or ``"fork"``),
    ``cause`` (``"template"`` for a render mismatch; for a fork ``"history_edited"`` when it lies
    in the previous prompt, ``"retokenized"`` when it lies in the previous completion: the
    reply's text, sent back, tokenizes differently from the sampled tokens), ``position``
    (index of the first differing token in the served prompt), ``served_id`` / ``expected_id``
    (the token IDs there; None past the end), ``served`` / ``expected`` (the decoded tokens
    around it, ``context`` either side, joined by ``|``, the differing one in ``«»``,
    newlines as ``\\n``).

    Args:
        store: where the spans are.
        rollout_ids: the rollouts to check.
        tokenizer: the policy's tokenizer (``engine.tokenizer``), with its chat template.
        tool_format: ``"hermes"`` (the proxy renders tools and tool turns as text, the
            default engines) or ``"native"`` (messages and tools go to the server as they
            are; rendered here with ``apply_chat_template(tools=...)``).
        context: tokens shown either side of the first difference.
    """
    rows: list[dict[str, Any]] = []
    checked = rollouts = 0
    for rid in rollout_ids:
        calls = [s for s in store.query_spans(rid, "latest") if s.name == LLM_SPAN_NAME]
        prev: Optional[list[int]] = None
        prev_prompt_len = 0
        rollouts += 1 if calls else 0
        for turn, span in enumerate(calls):
            a = span.attributes
            if not a.get("prompt_token_ids") or not a.get("completion_token_ids"):
                continue
            checked += 1
            served = list(a["prompt_token_ids"])
            where = {"rollout_id": rid, "attempt_id": span.attempt_id, "turn": turn}
            rendered = _rerender(span, tokenizer, tool_format)
            pos = _first_diff(served, rendered)
            if pos is not None:
                rows.append({**where, "kind": "render", "cause": "template",
                             **_describe(tokenizer, served, rendered, pos, context)})
            if prev is not None and served[: len(prev)] != prev:
                pos = _first_diff(served, prev)
                cause = "history_edited" if pos < prev_prompt_len else "retokenized"
                rows.append({**where, "kind": "fork", "cause": cause,
                             **_describe(tokenizer, served, prev, pos, context)})
            prev, prev_prompt_len = served + list(a["completion_token_ids"]), len(served)
    df = pd.DataFrame(rows, columns=FIDELITY_COLUMNS)
    df.attrs.update(calls_checked=checked, rollouts_checked=rollouts)
    return df


def _rerender(span: Span, tokenizer: Any, tool_format: str) -> list[int]:
    """The prompt token IDs the span's messages (and tools) render to, as the proxy and engine do it."""
    a = span.attributes
    messages = json.loads(a["gen_ai.prompt"]) if isinstance(a.get("gen_ai.prompt"), str) else a.get("gen_ai.prompt")
    tools = json.loads(a["gen_ai.request.tools"]) if a.get("gen_ai.request.tools") else None
    choice = json.loads(a["gen_ai.request.tool_choice"]) if a.get("gen_ai.request.tool_choice") else None
    if tool_format == "hermes":
        return prompt_token_ids(tokenizer, render_tools(messages or [], tools, choice or "auto"))
    kwargs = {"tools": tools} if tools else {}
    return list(tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                              return_dict=False, **kwargs))


def _first_diff(a: Sequence[int], b: Sequence[int]) -> Optional[int]:
    """Index of the first position where ``a`` and ``b`` differ (the shorter length if one prefixes the other)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _describe(tokenizer: Any, served: Sequence[int], expected: Sequence[int], pos: int, context: int) -> dict:
    return {"position": pos, "served_id": served[pos] if pos < len(served) else None,
            "expected_id": expected[pos] if pos < len(expected) else None,
            "served": _window(tokenizer, served, pos, context), "expected": _window(tokenizer, expected, pos, context)}


def _window(tokenizer: Any, ids: Sequence[int], pos: int, context: int) -> str:
    """The decoded tokens ``pos - context .. pos + context`` joined by ``|``, the one at ``pos`` in ``«»``."""
    lo, hi = max(0, pos - context), min(len(ids), pos + context + 1)
    parts = [_piece(tokenizer, ids[i]) if i != pos else f"«{_piece(tokenizer, ids[i])}»" for i in range(lo, hi)]
    if pos >= len(ids):
        parts.append("«<end>»")
    return ("…" if lo > 0 else "") + "|".join(parts) + ("…" if hi < len(ids) else "")


def _piece(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id]).replace("\n", "\\n")


# ----- preflight --------------------------------------------------------------------------
class Finding(NamedTuple):
    """One preflight finding: a short ``name``, what was seen (``message``) and what to do (``fix``)."""

    name: str
    message: str
    fix: str


@dataclass
class PreflightReport:
    """What :func:`preflight` found. ``ok`` is True when there is no blocker.

    Attributes:
        blockers: findings that make the update useless or make it raise, each a :class:`Finding`.
        warnings: findings that waste compute or weaken the signal.
        stats: counts of the round (rollouts, succeeded, failed, llm_calls, truncated,
            triplets, sequences, groups, groups_with_signal, rewards, forks, render_mismatches, seconds).
        fidelity: :func:`token_fidelity` of the round's rollouts.
        rollout_ids: the preflight rollouts (tagged ``metadata["preflight"] = True`` in the store).
    """

    blockers: list[Finding] = field(default_factory=list)
    warnings: list[Finding] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)
    fidelity: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=FIDELITY_COLUMNS))
    rollout_ids: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.blockers

    def names(self) -> list[str]:
        """Names of every finding, blockers first."""
        return [f.name for f in self.blockers + self.warnings]

    def to_frame(self) -> pd.DataFrame:
        """One row per finding: ``severity`` (blocker/warning), ``name``, ``message``, ``fix``."""
        rows = [{"severity": sev, **f._asdict()} for sev, fs in (("blocker", self.blockers), ("warning", self.warnings))
                for f in fs]
        return pd.DataFrame(rows, columns=["severity", "name", "message", "fix"])

    @property
    def df(self) -> pd.DataFrame:
        return self.to_frame()

    def __str__(self) -> str:
        head = "preflight: OK" if self.ok else f"preflight: {len(self.blockers)} blocker(s)"
        counts = ", ".join(f"{k} {_num(v)}" for k, v in self.stats.items() if k != "rewards")
        lines = [f"{head} ({counts})"]
        for sev, fs in (("BLOCKER", self.blockers), ("warning", self.warnings)):
            for f in fs:
                lines += [f"{sev} {f.name}: {f.message}", f"    fix: {f.fix}"]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        e = _esc
        color = "#1a7f37" if self.ok else "#cf222e"
        title = "OK: nothing blocks training" if self.ok else f"{len(self.blockers)} blocker(s): do not train yet"
        rows = "".join(
            f'<tr class="lnb-finding" data-severity="{sev}" data-name="{e(f.name)}">'
            f'<td style="color:{"#cf222e" if sev == "blocker" else "#9a6700"};font-weight:600">{sev}</td>'
            f"<td><code>{e(f.name)}</code></td><td>{e(f.message)}</td><td>{e(f.fix)}</td></tr>"
            for sev, fs in (("blocker", self.blockers), ("warning", self.warnings)) for f in fs)
        table = (f'<table class="lnb-preflight"><thead><tr><th>severity</th><th>finding</th><th>seen</th>'
                 f"<th>fix</th></tr></thead><tbody>{rows}</tbody></table>") if rows else ""
        counts = " · ".join(f"{e(k)} {e(_num(v))}" for k, v in self.stats.items() if k != "rewards")
        return (f'<div style="{_BOX}"><b>Preflight</b>: <span style="color:{color};font-weight:600" '
                f'data-ok="{str(self.ok).lower()}">{e(title)}</span><div style="color:#57606a">{counts}</div>'
                f"{table}</div>")


def preflight(algo: "LightningRL", n_tasks: Optional[int] = None, *, strict: bool = False,
              start_timeout_s: float = 60.0, truncation_blocker: float = 0.5, truncation_warning: float = 0.1,
              progress: bool = False) -> PreflightReport:
    """One collection round of ``algo`` without an update; reports what would make training useless.

    Enqueues ``n_tasks`` tasks (default ``algo.config.tasks_per_step``) ``group_size`` times
    each, with the training sampling (temperature, max_tokens) and ``mode="train"``, tagged
    ``metadata["preflight"] = True`` (group ids start with ``preflight``); waits for the
    runners; adapts the spans with a fresh :class:`~lightning_nb.adapter.TripletAdapter`
    (``algo.adapter``'s counts stay as they are). Tasks are drawn with their own RNG, so the
    algorithm's task sampler, the trainer's weights, step and optimizer and the engine's
    weight version are left exactly as they were.

    Blockers (the update would raise, or learn nothing): ``no_runners``, ``no_reward``
    (no rollout returned or emitted a reward), ``token_ids_missing`` (an engine without
    token IDs), ``missing_token_ids`` (calls that bypassed the proxy), ``no_triplets``
    (with the adapter's skip reasons), ``all_zero_masks`` (no token to train),
    ``top_p`` (sampled with top_p < 1), ``no_signal`` (every group's rewards are equal),
    ``truncated`` (at least ``truncation_blocker`` of the responses stopped at
    ``max_tokens``). The same findings for only part of the round are warnings, as are
    ``rollouts_failed``, ``truncated`` above ``truncation_warning``, and ``forks`` /
    ``render_mismatches`` from :func:`token_fidelity` (blockers with ``strict=True``: the
    update still trains on exactly the served tokens, but forked turns cost a full
    sequence each and a render mismatch means engine and tokenizer disagree).

    Args:
        algo: a :class:`~lightning_nb.algorithm.LightningRL` whose runners consume its store.
        n_tasks: tasks (groups) to sample.
        strict: make fork and render mismatches blockers.
        start_timeout_s: if no rollout has started after this many seconds, report
            ``no_runners`` and cancel the round.
        truncation_blocker / truncation_warning: shares of truncated responses.
        progress: show a tqdm.auto bar of finished rollouts.

    Raises:
        TrainerStopped: the trainer was stopped while waiting (the rollouts are cancelled).
    """
    t0 = time.perf_counter()
    report = PreflightReport()
    report.rollout_ids = ids = _enqueue(algo, n_tasks or algo.config.tasks_per_step)
    if not algo.wait_for(ids, "preflight" if progress else None, start_timeout_s):
        report.blockers.append(Finding(
            "no_runners", f"none of the {len(ids)} preflight rollouts was picked up within {start_timeout_s:g} s "
                          "(no runner consumes this store, or all were busy); they were cancelled",
            "start runners on this store before preflight(): runners = start_runners(agent, store, n=4), "
            "or pass a larger start_timeout_s when other rollouts are queued ahead"))
        report.stats = {"rollouts": len(ids), "seconds": time.perf_counter() - t0}
        return report
    _Checks(algo, ids, report, strict, truncation_blocker, truncation_warning).run()
    report.stats["seconds"] = time.perf_counter() - t0
    return report


def _enqueue(algo: "LightningRL", n_tasks: int) -> list[str]:
    """Enqueue ``n_tasks`` groups with the training sampling, tagged as preflight; the algorithm's RNG is not used."""
    cfg = algo.config
    rng = random.Random(f"preflight:{cfg.seed}")
    picks = rng.sample(range(len(algo.train_tasks)), min(n_tasks, len(algo.train_tasks)))
    sampling = {"temperature": cfg.temperature, "max_tokens": cfg.max_tokens}
    run = uuid.uuid4().hex[:6]
    ids = []
    for i in picks:
        task = algo.train_tasks[i]
        key = task.get(algo.id_key, i) if isinstance(task, dict) else i
        metadata = {algo.adapter.group_key: f"preflight-{run}:{key}", "sampling_parameters": sampling,
                    "preflight": True}
        config = RolloutConfig(max_attempts=cfg.max_attempts, timeout_seconds=cfg.rollout_timeout_s)
        ids += [algo.store.enqueue_rollout(task, mode="train", config=config, metadata=metadata).rollout_id
                for _ in range(cfg.group_size)]
    return ids


class _Checks:
    """The preflight checks of one round, appending to ``report`` (one method per family)."""

    def __init__(self, algo: "LightningRL", ids: list[str], report: PreflightReport, strict: bool,
                 truncation_blocker: float, truncation_warning: float) -> None:
        self.algo, self.ids, self.report, self.strict = algo, ids, report, strict
        self.limits = (truncation_blocker, truncation_warning)
        self.rollouts = algo.store.query_rollouts(rollout_ids=ids)
        self.spans = {rid: algo.store.query_spans(rid, "latest") for rid in ids}
        self.calls = [s for spans in self.spans.values() for s in spans if s.name == LLM_SPAN_NAME]
        self.stats = report.stats

    def finding(self, blocker: bool, name: str, message: str, fix: str) -> None:
        (self.report.blockers if blocker else self.report.warnings).append(Finding(name, message, fix))

    def run(self) -> None:
        s, n = self.stats, len(self.ids)
        s.update(rollouts=n, succeeded=sum(r.status == "succeeded" for r in self.rollouts),
                 failed=sum(r.status == "failed" for r in self.rollouts), llm_calls=len(self.calls))
        errors = self.attempt_errors()
        no_engine_ids = {s.rollout_id for s in self.calls if s.attributes.get(TOKEN_IDS_MISSING)}
        adapter = TripletAdapter(group_key=self.algo.adapter.group_key)
        triplets = adapter.adapt(self.algo.store, [r for r in self.ids if r not in no_engine_ids])
        skipped = {k: v for k, v in adapter.last_skipped.items() if v}
        s.update(triplets=len(triplets), episodes=len({t.rollout_id for t in triplets}))
        self.check_rewards(errors, skipped)
        self.check_token_ids(no_engine_ids, skipped)
        self.check_failures(errors)
        if not triplets:
            self.no_triplets(skipped, errors)
        else:
            self.check_sequences(triplets)
            self.check_signal(triplets)
        self.check_truncation()
        self.check_fidelity(triplets)

    def attempt_errors(self) -> dict[str, str]:
        """Rollout id -> the error of its latest attempt, for the failed rollouts."""
        out = {}
        for r in self.rollouts:
            if r.status == "failed":
                attempts = sorted(self.algo.store.query_attempts(r.rollout_id), key=lambda a: a.sequence_id)
                out[r.rollout_id] = (attempts[-1].error if attempts else None) or "(no error recorded)"
        return out

    def check_rewards(self, errors: dict[str, str], skipped: dict[str, int]) -> None:
        missing = sum(NO_REWARD_ERROR in e for e in errors.values()) + skipped.get("no_reward", 0)
        if missing:
            self.finding(missing == len(self.ids), "no_reward",
                         f"{missing} of {len(self.ids)} rollouts ended without a reward (the agent returned None "
                         "and emitted no reward span)",
                         "return a float reward from the agent (`return reward`), or call "
                         "lightning_nb.emit_reward(value) inside it before it returns")

    def check_token_ids(self, no_engine_ids: set[str], skipped: dict[str, int]) -> None:
        if no_engine_ids:
            self.finding(True, "token_ids_missing",
                         f"LLM calls of {len(no_engine_ids)} rollouts were served by an engine that returned no "
                         "token IDs (span attribute lightning_nb.token_ids_missing); training on re-tokenized text "
                         "would train on tokens the model never sampled",
                         "serve the policy with TransformersEngine or VLLMEngine (or an OpenAIEndpoint whose server "
                         "honours return_token_ids), and keep judge/eval endpoints out of training rollouts")
        bypass = skipped.get("llm_spans_without_token_ids", 0)
        with_ids = sum(1 for s in self.calls if s.attributes.get("prompt_token_ids")
                       and s.attributes.get("completion_token_ids"))
        if bypass or skipped.get("no_token_ids"):
            self.finding(with_ids == 0, "missing_token_ids",
                         f"{len(self.calls) - with_ids} of {len(self.calls)} LLM calls have no token IDs "
                         f"({skipped.get('no_token_ids', 0)} rollouts had none at all)",
                         "send every policy call to llm.endpoint with model=llm.model (the proxy at the rollout's "
                         "URL records token IDs); a call that errored or bypassed the proxy leaves none")

    def check_failures(self, errors: dict[str, str]) -> None:
        other = [e for e in errors.values() if NO_REWARD_ERROR not in e]
        if other:
            (top, k), = Counter(e.strip().splitlines()[-1][:300] for e in other).most_common(1)
            self.finding(False, "rollouts_failed",
                         f"{len(other)} of {len(self.ids)} rollouts failed: they give no triplets and count as "
                         f"reward 0 in the step's reward_mean; most common error ({k}x): {top}",
                         "read store.attempts_df() (error column) and fix the agent; for timeouts raise "
                         "AlgorithmConfig.rollout_timeout_s or lower max_tokens")

    def no_triplets(self, skipped: dict[str, int], errors: dict[str, str]) -> None:
        fixes = {
            "not_succeeded": "make the rollouts succeed: read store.attempts_df() (error column)",
            "no_reward": "return a float reward from the agent or call lightning_nb.emit_reward(value)",
            "no_llm_calls": "call the policy through the rollout's llm.endpoint with model=llm.model (an agent "
                            "that catches its own error and returns 0.0 makes no call)",
            "no_token_ids": "route policy calls through the proxy (llm.endpoint), which records token IDs",
            "no_matching_llm_calls": "send the trained agent's name in the X-Agent-Name header, or widen "
                                     "TripletAdapter(agent_match=...) (a regex searched in that name)",
        }
        reasons = {k: v for k, v in skipped.items() if k in fixes}
        self.finding(True, "no_triplets",
                     f"no rollout of {len(self.ids)} gave a triplet; adapter skips: {reasons or skipped}",
                     "; ".join(fixes[k] for k in reasons) or "see store.attempts_df() and store.spans_df()")

    def check_sequences(self, triplets: list[Triplet]) -> None:
        episodes: dict[str, list[Triplet]] = {}
        for t in triplets:
            episodes.setdefault(t.rollout_id, []).append(t)
        cfg = self.algo.trainer.config
        overlong = bool(getattr(cfg, "overlong_filter", False))  # masks responses cut at max_tokens
        seqs = [s for ts in episodes.values()
                for s in pack_episode(ts, 0.0, cfg.pack_turns, mask_truncated=overlong)]
        empty = sum(1 for s in seqs if sum(s.mask) == 0)
        self.stats.update(sequences=len(seqs), response_tokens=sum(sum(s.mask) for s in seqs))
        if empty:
            cause, fix = ("no completion tokens", "check that the engine returns completion token IDs")
            if overlong:
                cause = "GRPOConfig.overlong_filter masks every response cut at max_tokens"
                fix = (f"raise AlgorithmConfig.max_tokens (now {self.algo.config.max_tokens}) so responses end "
                       "by themselves, or set trainer.config.overlong_filter = False")
            self.finding(empty >= len(seqs), "all_zero_masks",
                         f"{empty} of {len(seqs)} sequences have an all-zero response mask ({cause}): the "
                         "optimizer sees no token to train", fix)
        nucleus = sorted({t.rollout_id for t in triplets if t.top_p < 1.0})
        if nucleus:
            self.finding(True, "top_p",
                         f"{len(nucleus)} rollouts were sampled with top_p < 1: the engine's log-probs are of the "
                         "untruncated distribution, so the PPO ratio would be wrong (update() refuses them)",
                         "do not pass top_p in the agent's training calls (the default is 1)")

    def check_signal(self, triplets: list[Triplet]) -> None:
        groups = {t.group_id for t in triplets}
        signal = self.algo.trainer.signal_groups(triplets)
        rewards = sorted({t.reward for t in triplets})
        self.stats.update(groups=len(groups), groups_with_signal=len(signal), rewards=rewards)
        if len(signal) < len(groups):
            t = self.algo.config.temperature
            self.finding(not signal, "no_signal",
                         f"{len(groups) - len(signal)} of {len(groups)} groups have equal rewards within the group "
                         f"(or too few episodes), so GRPO's advantage is 0 there; rewards seen: {rewards[:10]}",
                         "GRPO learns only from reward differences within a group: pick tasks the model solves "
                         "sometimes (10-90% of tries), give partial credit (a graded reward), or raise group_size "
                         f"or temperature (now {t:g}); dynamic_sampling only resamples more of the same tasks")

    def check_truncation(self) -> None:
        finished = [s for s in self.calls if s.attributes.get("gen_ai.response.finish_reasons")]
        cut = sum(1 for s in finished if "length" in s.attributes["gen_ai.response.finish_reasons"])
        share = cut / len(finished) if finished else 0.0
        self.stats.update(truncated=cut, truncated_share=share)
        blocker, warning = self.limits
        if finished and share >= min(blocker, warning):
            m = self.algo.config.max_tokens
            self.finding(share >= blocker, "truncated",
                         f"{cut} of {len(finished)} LLM responses ({share:.0%}) stopped at max_tokens={m} "
                         "(finish_reason 'length'): rewards score unfinished answers",
                         f"raise AlgorithmConfig.max_tokens (e.g. algo.config.max_tokens = {2 * m}) or ask the "
                         "agent for shorter answers")

    def check_fidelity(self, triplets: list[Triplet]) -> None:
        engine = self.algo.trainer.engine
        tokenizer = getattr(engine, "tokenizer", None)
        kept = sorted({t.rollout_id for t in triplets})
        if tokenizer is None or not kept:
            self.report.fidelity = pd.DataFrame(columns=FIDELITY_COLUMNS)
            return
        df = self.report.fidelity = token_fidelity(self.algo.store, kept, tokenizer,
                                                   tool_format=getattr(engine, "tool_format", "hermes"))
        forks, renders = df[df.kind == "fork"], df[df.kind == "render"]
        self.stats.update(forks=len(forks), render_mismatches=len(renders))
        if len(forks):
            first = forks.iloc[0]
            self.finding(self.strict, "forks",
                         f"{len(forks)} LLM calls in {forks.rollout_id.nunique()} rollouts do not extend the "
                         f"previous call's prompt + completion, so their turns train as separate sequences (first: "
                         f"rollout {first.rollout_id} turn {first.turn} at token {first.position}: served "
                         f"{first.served!r}, previous turn {first.expected!r})",
                         "history_edited (cause column of report.fidelity): send earlier messages back unchanged "
                         "and the assistant's reply verbatim; retokenized: the sampled tokens are a non-canonical "
                         "split of the reply's text, which sampling at lower temperature makes rarer (such turns "
                         "still train correctly, as separate sequences)")
        if len(renders):
            first = renders.iloc[0]
            self.finding(self.strict, "render_mismatches",
                         f"{len(renders)} LLM calls were served prompt tokens that differ from the tokenizer's "
                         f"chat template rendering of their messages (first: rollout {first.rollout_id} turn "
                         f"{first.turn} at token {first.position}: served {first.served!r}, re-rendered "
                         f"{first.expected!r})",
                         "serve the policy with the trainer's own tokenizer and chat template (the engine and the "
                         "trainer must share one); see report.fidelity")


# ----- the optimizer's-eye view -----------------------------------------------------------
def batch_df(last_batch: Sequence[dict[str, Any]], tokenizer: Any) -> pd.DataFrame:
    """One row per trained sequence of ``GRPOTrainer.last_batch``.

    Columns: ``rollout_id``, ``group_id``, ``advantage``, ``tokens`` (sequence length),
    ``response_tokens`` (mask 1: the trained tokens), ``mean_ratio`` (mean over the trained
    tokens of ``exp(trainer − engine log-prob)``, the PPO importance ratio at the update),
    ``max_abs_logprob_diff`` (largest per-token ``|trainer − engine|`` log-prob, nats), both
    NaN when the sequence was not forwarded (``trainer_logprobs`` None, e.g. a zero
    advantage skipped by ``skip_zero_advantage``), and ``response_text`` (the trained tokens
    decoded).

    Args:
        last_batch: dicts with ``rollout_id``, ``group_id``, ``input_ids``, ``response_mask``,
            ``advantage``, ``engine_logprobs`` and ``trainer_logprobs`` (per-token lists of one length).
        tokenizer: decodes the tokens.
    """
    rows = []
    for seq in last_batch:
        mask = seq["response_mask"]
        diffs = _logprob_diffs(seq)
        rows.append({
            "rollout_id": seq["rollout_id"], "group_id": seq["group_id"], "advantage": float(seq["advantage"]),
            "tokens": len(seq["input_ids"]), "response_tokens": int(sum(mask)),
            "mean_ratio": sum(math.exp(d) for d in diffs) / len(diffs) if diffs else math.nan,
            "max_abs_logprob_diff": max(abs(d) for d in diffs) if diffs else math.nan,
            "response_text": tokenizer.decode([t for t, m in zip(seq["input_ids"], mask) if m]),
        })
    return pd.DataFrame(rows, columns=BATCH_COLUMNS)


def _logprob_diffs(seq: dict[str, Any]) -> list[float]:
    """``trainer − engine`` log-prob of each trained token; empty when the sequence was not forwarded."""
    new = seq.get("trainer_logprobs")
    if new is None:
        return []
    return [n - o for n, o, m in zip(new, seq["engine_logprobs"], seq["response_mask"]) if m]


def batch_html(last_batch: Sequence[dict[str, Any]], tokenizer: Any, max_rows: int = 16,
               clip_ratio: float = 0.2) -> str:
    """The optimizer's-eye view of ``last_batch``: one block per sequence, one ``<span>`` per token.

    Trained tokens (response mask 1) have class ``lnb-tok lnb-resp`` and a background
    coloured by their own token's advantage (the row's per-token ``advantages``, which differ by
    turn with ``GRPOConfig.credit="reward_to_go"``; rows without it use the sequence's
    ``advantage``): green positive, red negative, stronger the larger ``|advantage|`` relative to
    the largest shown; grey when 0. Context tokens (mask 0:
    prompt, tool results) have class ``lnb-tok lnb-ctx`` and grey text. Hovering a token
    shows its id and, when trained, the engine ("old") and trainer ("new") log-probs and
    the ratio (``title``). Trained tokens whose ratio lies outside
    ``[1 - clip_ratio, 1 + clip_ratio]`` also get ``lnb-clipped`` (a red underline): PPO's
    clip acts on them. Only the first ``max_rows`` sequences are shown.
    """
    shown = list(last_batch)[:max_rows]
    scale = max((abs(float(a)) for s in shown for a in (s.get("advantages") or [s["advantage"]])), default=0.0) or 1.0
    blocks = [_sequence_html(seq, tokenizer, scale, clip_ratio) for seq in shown]
    more = (f'<div style="color:#57606a">… {len(last_batch) - len(shown)} more sequences (max_rows={max_rows})</div>'
            if len(last_batch) > len(shown) else "")
    legend = ('<div style="color:#57606a">grey text: context (mask 0, not trained); shaded: trained tokens, green '
              'for positive advantage, red for negative; hover a token for its log-probs and ratio</div>')
    return (f'<div class="lnb-batch" style="{_BOX}"><b>Last batch</b>: {len(last_batch)} sequences{legend}'
            f'{"".join(blocks)}{more}</div>')


def _sequence_html(seq: dict[str, Any], tokenizer: Any, scale: float, clip_ratio: float) -> str:
    e = _esc
    adv = float(seq["advantage"])
    bg = _advantage_colour(adv, scale)
    per_token = seq.get("advantages")
    new = seq.get("trainer_logprobs")
    pieces = tokenizer.batch_decode([[t] for t in seq["input_ids"]])
    spans = []
    for i, (tok, piece, m) in enumerate(zip(seq["input_ids"], pieces, seq["response_mask"])):
        if not m:
            spans.append(f'<span class="lnb-tok lnb-ctx" style="color:#8c959f" title="id {tok} · context, not '
                         f'trained">{e(piece)}</span>')
            continue
        old = seq["engine_logprobs"][i]
        tok_adv = float(per_token[i]) if per_token is not None else adv
        title = f"id {tok} · advantage {tok_adv:+.3f} · old (engine) log-p {old:.4f}"
        cls, extra = "lnb-tok lnb-resp", ""
        if new is not None:
            ratio = math.exp(new[i] - old)
            title += f" · new (trainer) log-p {new[i]:.4f} · ratio {ratio:.4f}"
            if abs(ratio - 1.0) > clip_ratio:
                cls, extra = cls + " lnb-clipped", ";text-decoration:underline wavy #cf222e"
        else:
            title += " · not forwarded"
        spans.append(f'<span class="{cls}" style="background:{_advantage_colour(tok_adv, scale)}{extra}" '
                     f'title="{e(title)}">{e(piece)}</span>')
    diffs = _logprob_diffs(seq)
    ratio_txt = f"{sum(math.exp(d) for d in diffs) / len(diffs):.4f}" if diffs else "–"
    head = (f"<code>{e(seq['rollout_id'])}</code> · group <code>{e(seq['group_id'])}</code> · advantage "
            f"<b>{adv:+.3f}</b> · {len(seq['input_ids'])} tokens, {int(sum(seq['response_mask']))} trained · "
            f"mean ratio {ratio_txt}")
    return (f'<div class="lnb-seq" data-rollout="{e(seq["rollout_id"])}" data-advantage="{adv}" '
            f'style="margin:6px 0;padding:4px 6px;border-left:3px solid {bg}">'
            f'<div>{head}</div><div style="white-space:pre-wrap;font-family:monospace;font-size:12px">'
            f'{"".join(spans)}</div></div>')


def _advantage_colour(adv: float, scale: float) -> str:
    """CSS background of an advantage: green positive, red negative (stronger toward ``scale``), grey 0."""
    alpha = 0.15 + 0.6 * min(abs(adv) / scale, 1.0)
    return (f"rgba(26,127,55,{alpha:.2f})" if adv > 0 else f"rgba(207,34,46,{alpha:.2f})" if adv < 0
            else "rgba(127,127,127,0.15)")


def _esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _num(v: Any) -> str:
    return f"{v:.2f}" if isinstance(v, float) else str(v)
