"""The preflight: one collection round of a :class:`~lightning_nb.algorithm.lightning_rl.LightningRL` without an
update, reporting what would make training useless, each finding with its fix.

Users of every RL-for-agents kit report empty or misaligned training data that they discover only after
hours of compute (all-zero masks, all-equal groups, re-tokenized prompts). :func:`preflight` (also
``LightningRL.preflight()``) runs the algorithm's collection once and checks the round with the same
adapter and packing the update would use, plus :func:`~lightning_nb.inspect.audit.token_fidelity`.
It drives the algorithm (enqueue, wait), so it lives in the algorithm layer; the data-only views
(token fidelity, the batch view) stay in :mod:`lightning_nb.inspect.audit`.
"""

from __future__ import annotations

import random
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Optional

import pandas as pd

from lightning_nb.adapter import TripletAdapter
from lightning_nb.inspect import BOX_STYLE, esc
from lightning_nb.inspect.audit import FIDELITY_COLUMNS, token_fidelity
from lightning_nb.runners import NO_REWARD_ERROR
from lightning_nb.semconv import (COMPLETION_TOKEN_IDS, LLM_SPAN, PROMPT_TOKEN_IDS, RESPONSE_FINISH_REASONS,
                                  TOKEN_IDS_MISSING)
from lightning_nb.trainers.packing import pack_episode
from lightning_nb.types import SAMPLING_PARAMETERS_KEY, RolloutConfig, Triplet

if TYPE_CHECKING:
    from lightning_nb.algorithm.lightning_rl import LightningRL

__all__ = ["Finding", "PreflightReport", "preflight"]


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
        e = esc
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
        return (f'<div style="{BOX_STYLE}"><b>Preflight</b>: <span style="color:{color};font-weight:600" '
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
        algo: a :class:`~lightning_nb.algorithm.lightning_rl.LightningRL` whose runners consume its store.
        n_tasks: tasks (groups) to sample.
        strict: make fork and render mismatches blockers.
        start_timeout_s: if no rollout has started after this many seconds, report
            ``no_runners`` and cancel the round.
        truncation_blocker / truncation_warning: shares of truncated responses.
        progress: show a tqdm.auto bar of finished rollouts.

    Raises:
        LoopStopped: the loop was stopped while waiting (the rollouts are cancelled).
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
        metadata = {algo.adapter.group_key: f"preflight-{run}:{key}", SAMPLING_PARAMETERS_KEY: sampling,
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
        self.calls = [s for spans in self.spans.values() for s in spans if s.name == LLM_SPAN]
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
                         f"token IDs (span attribute {TOKEN_IDS_MISSING}); training on re-tokenized text "
                         "would train on tokens the model never sampled",
                         "serve the policy with TransformersEngine or VLLMEngine (or an OpenAIEndpoint whose server "
                         "honours return_token_ids), and keep judge/eval endpoints out of training rollouts")
        bypass = skipped.get("llm_spans_without_token_ids", 0)
        with_ids = sum(1 for s in self.calls if s.attributes.get(PROMPT_TOKEN_IDS)
                       and s.attributes.get(COMPLETION_TOKEN_IDS))
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
        signal = self.algo.signal_groups(triplets)
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
        finished = [s for s in self.calls if s.attributes.get(RESPONSE_FINISH_REASONS)]
        cut = sum(1 for s in finished if "length" in s.attributes[RESPONSE_FINISH_REASONS])
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


def _num(v: Any) -> str:
    return f"{v:.2f}" if isinstance(v, float) else str(v)
