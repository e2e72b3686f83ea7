"""HTML summaries for displaying the main objects in a notebook cell (``_repr_html_``).

Plain HTML strings built from the objects' public state; no UI package is
imported here (the live widgets live in the separate ``widgets`` package and
reuse :func:`span_tree_html`). Every function escapes the text it shows.
"""

from __future__ import annotations

import html
import json
import math
import time
from collections import Counter
from typing import TYPE_CHECKING, Any, Iterable, Optional, Sequence

from lightning_nb.semconv import (AGENT_SPAN, COMPLETION, ERROR, PROMPT, REWARD, TOOL_INPUT, TOOL_OUTPUT,
                                  USAGE_INPUT_TOKENS, USAGE_OUTPUT_TOKENS)
from lightning_nb.store.rules import reward_or_zero

if TYPE_CHECKING:
    from lightning_nb.store.base import LightningStore
    from lightning_nb.trainers.base import Trainer
    from lightning_nb.types import Rollout, Span

__all__ = ["store_html", "runner_group_html", "trainer_html", "trainer_summary", "rollout_html", "span_tree_html",
           "slice_report_html", "kv_table", "esc", "badge", "fmt", "STATE_COLORS", "BOX_STYLE"]

STATE_COLORS = {
    "running": "#1a7f37", "succeeded": "#1a7f37", "paused": "#9a6700", "preparing": "#9a6700",
    "queuing": "#57606a", "requeuing": "#9a6700", "idle": "#57606a", "finished": "#0969da",
    "stopping": "#9a6700", "pausing": "#9a6700", "stopped": "#57606a", "failed": "#cf222e", "cancelled": "#57606a",
    "timeout": "#cf222e", "unresponsive": "#cf222e",
}
#: The CSS of every view's outer box (the notebook's UI font).
BOX_STYLE = "font-family:var(--jp-ui-font-family,sans-serif);font-size:13px;line-height:1.4"


def esc(value: Any) -> str:
    """``value`` as escaped HTML text."""
    return html.escape(str(value), quote=True)


def badge(state: str, css_class: str = "lnb-state") -> str:
    """A colored pill naming ``state``; ``data-state`` carries the raw value (tests read it)."""
    color = STATE_COLORS.get(state, "#57606a")
    return (f'<span class="{css_class}" data-state="{esc(state)}" style="background:{color};color:#fff;'
            f'border-radius:8px;padding:0 7px;font-size:12px">{esc(state)}</span>')


def fmt(value: Any, digits: int = 3) -> str:
    """Numbers rounded for display; None/NaN as an en dash."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}" if abs(value) < 1e5 else f"{value:.3g}"
    return esc(value)


def kv_table(items: Iterable[tuple[str, Any]], css_class: str = "lnb-kv") -> str:
    """A two-column table of (label, value); values are formatted with :func:`fmt` unless already HTML."""
    rows = "".join(
        f'<tr><th style="text-align:left;padding:1px 10px 1px 0;font-weight:600">{esc(k)}</th>'
        f'<td style="text-align:left" data-key="{esc(k)}">{v.html if isinstance(v, _Html) else fmt(v)}</td></tr>'
        for k, v in items)
    return f'<table class="{css_class}" style="border-collapse:collapse">{rows}</table>'


class _Html(str):
    """Marks a string as ready HTML inside :func:`kv_table`."""

    @property
    def html(self) -> str:
        return str(self)


def store_html(store: "LightningStore", latest: int = 5) -> str:
    """Rollouts by status and mode, span count, mean final reward per mode (finished rollouts, failed = 0), latest rollouts."""
    rollouts = store.query_rollouts()
    rewards = store.final_rewards()
    by_status = Counter(r.status for r in rollouts)
    by_mode: dict[str, list[float]] = {}
    for r in rollouts:  # finished, not cancelled: a failed one or one without a reward counts 0 (rules.final_reward)
        if r.status in ("succeeded", "failed"):
            by_mode.setdefault(r.mode, []).append(reward_or_zero(rewards[r.rollout_id]))
    status = " ".join(f"{badge(s)} {n}" for s, n in sorted(by_status.items())) or "none yet"
    mean_reward = ", ".join(f"{m} {sum(v) / len(v):.3f} (n={len(v)})" for m, v in sorted(by_mode.items())) or "–"
    items = [("rollouts", len(rollouts)), ("by status", _Html(status)), ("spans", len(store.query_spans())),
             ("mean final reward", mean_reward)]
    rows = "".join(
        f"<tr><td><code>{esc(r.rollout_id)}</code></td><td>{esc(r.mode)}</td><td>{badge(r.status)}</td>"
        f"<td>{fmt(rewards.get(r.rollout_id))}</td><td>{esc(_short(r.input, 60))}</td></tr>"
        for r in rollouts[-latest:][::-1])
    table = (f'<table class="lnb-latest"><thead><tr><th>latest rollouts</th><th>mode</th><th>status</th>'
             f"<th>reward</th><th>input</th></tr></thead><tbody>{rows}</tbody></table>") if rows else ""
    return f'<div style="{BOX_STYLE}"><b>{esc(type(store).__name__)}</b>{kv_table(items)}{table}</div>'


def runner_group_html(group: Any) -> str:
    """Alive count and one row per runner (state, current rollout, counts, heartbeat age in seconds).

    Works for any group whose ``status()`` DataFrame has (some of) the columns of
    :meth:`RunnerGroup.status`; missing cells show as a dash.
    """
    df = group.status()
    alive = int(df["alive"].sum()) if "alive" in df and not df.empty else 0
    cols = [("worker_id", "runner"), ("state", "state"), ("current_rollout", "current rollout"),
            ("succeeded", "succeeded"), ("failed", "failed"), ("timed_out", "timed out"),
            ("heartbeat_age_s", "heartbeat age (s)")]
    body = []
    for row in df.to_dict("records"):
        cells = []
        for key, _ in cols:
            v = row.get(key)
            if key == "state":
                cells.append(badge(str(v)))
            elif key == "current_rollout":
                cells.append(f"<code>{esc(v if isinstance(v, str) and v else '–')}</code>")
            else:
                cells.append(fmt(v, 1))
        body.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    head = "".join(f"<th>{esc(label)}</th>" for _, label in cols)
    return (f'<div style="{BOX_STYLE}"><b>{esc(type(group).__name__)}</b>: {alive} of {len(df)} runners alive'
            f'<table class="lnb-runners"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table></div>')


def trainer_summary(trainer: "Trainer") -> list[tuple[str, Any]]:
    """(label, value) pairs of a trainer alone: updates applied and the weight version (the updates' rows are
    the algorithm's: :func:`run_summary`)."""
    return [("updates", trainer.updates_applied), ("weight version", trainer.engine.weight_version)]


def trainer_html(trainer: "Trainer") -> str:
    """Updates applied and the weight version."""
    return f'<div style="{BOX_STYLE}"><b>{esc(type(trainer).__name__)}</b>{kv_table(trainer_summary(trainer))}</div>'


def run_summary(algorithm: Any) -> list[tuple[str, Any]]:
    """(label, value) pairs of a run (an :class:`~lightning_nb.algorithm.base.Algorithm`): its state, step and
    last metrics row (units in the labels); the weight version when it has a trainer."""
    rows = algorithm.metrics
    last = rows[-1] if rows else {}
    val, kl = (next((m[k] for m in reversed(rows) if m.get(k) is not None and not _isnan(m.get(k))), None)
               for k in ("val_reward", "kl"))  # both measured on some steps only (val_every, kl_every)
    trainer = getattr(algorithm, "trainer", None)
    items: list[tuple[str, Any]] = [("state", _Html(badge(algorithm.state))), ("step", algorithm.global_step)]
    if trainer is not None:
        items.append(("weight version", trainer.engine.weight_version))
    return items + [
        ("reward (mean, last step)", last.get("reward_mean")), ("val reward (latest)", val),
        ("loss", last.get("loss")), ("KL to initial weights (latest)", kl),
        ("train tokens/s (last update)", last.get("tokens_per_s")), ("step time (s)", last.get("step_seconds")),
    ]


def run_html(algorithm: Any) -> str:
    """A run's state, step, last metrics and the error of a failed loop (:func:`run_summary`)."""
    error = algorithm.error
    error_html = f'<pre style="color:#cf222e">{esc(repr(error))}</pre>' if error is not None else ""
    return (f'<div style="{BOX_STYLE}"><b>{esc(type(algorithm).__name__)}</b>'
            f'{kv_table(run_summary(algorithm))}{error_html}</div>')


def rollout_html(rollout: "Rollout") -> str:
    """Id, mode, status, attempts, times and the (shortened) input and metadata of one rollout."""
    duration = (rollout.end_time - rollout.start_time) if rollout.end_time and rollout.start_time else None
    items = [("rollout", _Html(f"<code>{esc(rollout.rollout_id)}</code>")), ("mode", rollout.mode),
             ("status", _Html(badge(rollout.status))), ("attempts", f"{rollout.num_attempts} of "
                                                                     f"{rollout.config.max_attempts}"),
             ("enqueued", _clock(rollout.enqueue_time)), ("duration (s)", duration),
             ("input", _short(rollout.input, 300))]
    if rollout.metadata:
        items.append(("metadata", _short(rollout.metadata, 300)))
    return f'<div style="{BOX_STYLE}"><b>Rollout</b>{kv_table(items)}</div>'


def span_tree_html(spans: Sequence["Span"], max_text: int = 2000) -> str:
    """The spans of one rollout as a tree per attempt: agent → LLM calls, tools → reward.

    Children follow ``parent_id``; spans whose parent is not among ``spans`` (the LLM
    proxy's spans are recorded in the server's context) hang under the attempt's root
    ``agent`` span when there is one. LLM spans show the prompt messages and the
    completion text with their token counts; tool spans their input and output.
    Texts longer than ``max_text`` characters are cut.
    """
    if not spans:
        return '<div class="lnb-tree"><i>no spans</i></div>'
    by_attempt: dict[str, list["Span"]] = {}
    for s in spans:
        by_attempt.setdefault(s.attempt_id, []).append(s)
    parts = []
    for aid, group in by_attempt.items():
        ids = {s.span_id for s in group}
        children: dict[Optional[str], list["Span"]] = {}
        agent = next((s for s in group if s.name == AGENT_SPAN and s.parent_id not in ids), None)
        for s in group:
            parent = s.parent_id if s.parent_id in ids else None
            if parent is None and agent is not None and s is not agent:
                parent = agent.span_id
            children.setdefault(parent, []).append(s)
        for kids in children.values():
            kids.sort(key=lambda s: (s.start_time, s.sequence_id))

        def node(s: "Span", depth: int) -> str:
            kids = "".join(node(c, depth + 1) for c in children.get(s.span_id, []) if depth < 20)
            return (f'<details open class="lnb-span" data-name="{esc(s.name)}" style="margin-left:{12 if depth else 0}px">'
                    f"<summary>{_span_label(s)}</summary>{_span_body(s, max_text)}{kids}</details>")

        body = "".join(node(s, 0) for s in children.get(None, []))
        parts.append(f'<div class="lnb-attempt"><b>attempt <code>{esc(aid)}</code></b>{body}</div>')
    return f'<div class="lnb-tree" style="{BOX_STYLE}">{"".join(parts)}</div>'


def _span_label(s: "Span") -> str:
    a = s.attributes
    bits = [f"<b>{esc(s.name)}</b>", f"{(s.end_time - s.start_time) * 1000:.0f} ms"]
    if USAGE_INPUT_TOKENS in a:
        bits.append(f'<span class="lnb-tokens">{esc(a[USAGE_INPUT_TOKENS])} prompt + '
                    f'{esc(a.get(USAGE_OUTPUT_TOKENS))} completion tokens</span>')
    if REWARD in a:
        bits.append(f'reward <b class="lnb-reward">{fmt(a[REWARD])}</b>')
    if s.status == "error" or ERROR in a:
        bits.append('<span style="color:#cf222e">error</span>')
    return " · ".join(bits)


def _span_body(s: "Span", max_text: int) -> str:
    a = s.attributes
    pre = 'style="white-space:pre-wrap;margin:2px 0 4px 0;padding:3px 6px;background:rgba(127,127,127,.1)"'
    out = []
    if PROMPT in a:
        out.append(f'<div>prompt:</div><pre class="lnb-prompt" {pre}>{esc(_cut(_messages_text(a[PROMPT]), max_text))}</pre>')
    if COMPLETION in a:
        out.append(f'<div>completion:</div><pre class="lnb-completion" {pre}>{esc(_cut(str(a[COMPLETION]), max_text))}</pre>')
    for key in (TOOL_INPUT, TOOL_OUTPUT, ERROR):
        if key in a:
            out.append(f'<div>{esc(key)}: <code>{esc(_cut(str(a[key]), max_text))}</code></div>')
    return "".join(out)


def _messages_text(prompt: Any) -> str:
    """OpenAI messages (a JSON string or list) as ``role: content`` lines."""
    try:
        messages = json.loads(prompt) if isinstance(prompt, str) else prompt
        return "\n".join(f"{m.get('role')}: {m.get('content')}" for m in messages)
    except (ValueError, TypeError, AttributeError):
        return str(prompt)


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _short(value: Any, limit: int) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return _cut(text, limit)


def _clock(t: Optional[float]) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t)) if t else "–"


def _isnan(v: Any) -> bool:
    return isinstance(v, float) and math.isnan(v)


def slice_report_html(report: Any) -> str:
    """A :class:`~lightning_nb.algorithm.lightning_rl.SliceReport` as a small table: slice, n, solved, mean (and ``all``)."""
    cell = "padding:1px 8px;text-align:right"
    head = "".join(f'<th style="{cell}">{h}</th>' for h in ("slice", "n", "solved", "mean"))
    rows = [(label, n, solved, mean) for label, (mean, n, solved) in report.slices.items()]
    rows.append(("all", report.n, report.solved, report.mean))
    body = []
    for i, (label, n, solved, mean) in enumerate(rows):
        style = ' style="font-weight:600;border-top:1px solid #bbb"' if i == len(rows) - 1 else ""
        body.append(f'<tr{style} data-slice="{esc(label)}">'
                    f'<td style="padding:1px 8px;text-align:left">{esc(label)}</td>'
                    f'<td style="{cell}">{n}</td><td style="{cell}">{solved}</td>'
                    f'<td style="{cell}">{fmt(float(mean))}</td></tr>')
    return (f'<div class="lnb-slices" style="{BOX_STYLE}"><b>Reward by {esc(report.by)}</b>'
            f'<table style="border-collapse:collapse"><thead><tr>{head}</tr></thead>'
            f'<tbody>{"".join(body)}</tbody></table></div>')
