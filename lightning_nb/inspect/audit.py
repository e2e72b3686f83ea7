"""What the optimizer will see, checked before and after training: token fidelity and the batch view.

Users of every RL-for-agents kit report empty or misaligned training data that they
discover only after hours of compute (all-zero masks, all-equal groups, re-tokenized
prompts). This module shows it from the data alone (a store, a batch, a tokenizer):

* :func:`token_fidelity`: per LLM call, does the served prompt equal the chat template's
  rendering of the recorded messages (``render``), and does each turn's prompt extend the
  previous turn's prompt + completion token for token, so that
  :func:`~lightning_nb.trainers.packing.pack_episode` can merge the turns (``fork`` where it cannot)?
* :func:`batch_df` / :func:`batch_html`: the optimizer's-eye view of ``Update.batch`` (``algo.last_update.batch``):
  one row per trained sequence, tokens shaded by the response mask and coloured by the
  advantage, with the engine's and the trainer's log-probs and the ratio per token.

The preflight (one collection round without an update, built on :func:`token_fidelity`) drives the
algorithm, so it lives above, in :mod:`lightning_nb.algorithm.preflight`. No UI package is imported:
the HTML views are plain strings (as in :mod:`lightning_nb.inspect.html`).
"""

from __future__ import annotations

import json
import math
from typing import Any, Optional, Sequence

import pandas as pd

from lightning_nb.engines.chat_format import prompt_token_ids, render_tools, sampled_turn_key
from lightning_nb.inspect.html import BOX_STYLE, esc
from lightning_nb.proxy.splice import ServedCall, splice_previous_reply
from lightning_nb.semconv import (COMPLETION, COMPLETION_TOKEN_IDS, LLM_SPAN, PROMPT, PROMPT_SPLICED, PROMPT_TOKEN_IDS,
                                  REQUEST_TOOL_CHOICE, REQUEST_TOOLS, RESPONSE_FINISH_REASONS, RESPONSE_TOOL_CALLS)
from lightning_nb.store.base import LightningStore
from lightning_nb.types import GROUP_ID_KEY, Span

__all__ = ["FIDELITY_COLUMNS", "BATCH_COLUMNS", "token_fidelity", "batch_df", "batch_html"]

FIDELITY_COLUMNS = ["rollout_id", "attempt_id", "turn", "kind", "cause", "position", "served_id", "expected_id",
                    "served", "expected"]
BATCH_COLUMNS = ["rollout_id", GROUP_ID_KEY, "advantage", "tokens", "response_tokens", "mean_ratio",
                 "max_abs_logprob_diff", "response_text"]


# ----- token fidelity ---------------------------------------------------------------------
def token_fidelity(store: LightningStore, rollout_ids: Sequence[str], tokenizer: Any, *,
                   tool_format: str = "hermes", context: int = 3) -> pd.DataFrame:
    """Token mismatches of the LLM calls of ``rollout_ids`` (latest attempts); one row per mismatch.

    Two checks per LLM call (span) that carries token IDs; ``turn`` is the call's index
    among the attempt's LLM spans, as in :class:`~lightning_nb.adapter.TripletAdapter`:

    * ``render``: the recorded messages (``gen_ai.prompt``), rendered as the proxy sent them
      (with ``tool_format="hermes"``, through :func:`~lightning_nb.engines.chat_format.render_tools`
      with the span's :data:`~lightning_nb.semconv.REQUEST_TOOLS` and :data:`~lightning_nb.semconv.REQUEST_TOOL_CHOICE`)
      and then through
      ``tokenizer``'s chat template (:func:`~lightning_nb.engines.chat_format.prompt_token_ids`), must give
      the served ``prompt_token_ids``. ``expected`` is the re-rendering. A mismatch means
      the engine renders with another template or tokenizer than ``tokenizer``. Earlier
      tool-calling replies render as the proxy rendered them (as sampled, from the attempt's
      earlier spans), and a span the proxy marked ``lightning_nb.prompt.spliced`` is expected
      with the previous reply's sampled tokens in place (:mod:`lightning_nb.proxy.splice`).
    * ``fork``: the prompt of a call must start with the previous call's prompt + completion
      tokens, else :func:`~lightning_nb.trainers.packing.pack_episode` starts a new sequence there.
      ``expected`` is the previous call's prompt + completion. Causes: the agent edits or
      drops history, or the reply's text re-tokenizes differently from the sampled tokens
      where the proxy could not splice them back (an engine without token-level ``submit``,
      or a request with penalties or a response format)
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
        calls = [s for s in store.query_spans(rid, "latest") if s.name == LLM_SPAN]
        prev: Optional[list[int]] = None
        prev_prompt_len = 0
        sampled: dict[str, str] = {}  # the attempt's tool-calling replies, as the proxy renders them back
        prev_call: Optional[ServedCall] = None
        rollouts += 1 if calls else 0
        for turn, span in enumerate(calls):
            a = span.attributes
            if a.get(RESPONSE_TOOL_CALLS) and isinstance(a.get(COMPLETION), str):  # (never in its own prompt)
                sampled[sampled_turn_key(json.loads(a[RESPONSE_TOOL_CALLS]))] = a[COMPLETION]
            if not a.get(PROMPT_TOKEN_IDS) or not a.get(COMPLETION_TOKEN_IDS):
                continue
            checked += 1
            served = list(a[PROMPT_TOKEN_IDS])
            where = {"rollout_id": rid, "attempt_id": span.attempt_id, "turn": turn}
            canonical = rendered = _rerender(span, tokenizer, tool_format, sampled)
            if a.get(PROMPT_SPLICED) and prev_call is not None:  # the proxy gave back the sampled replies' tokens
                # the token that closes the turn: the reply's own stop token, or (a reply cut at max_tokens) EOS
                stop_ids = {*([] if prev_call.cut else prev_call.completion_ids[-1:]),
                            getattr(tokenizer, "eos_token_id", None)}
                rendered = splice_previous_reply(canonical, prev_call, tokenizer, list(stop_ids)) or canonical
            pos = _first_diff(served, rendered)
            if pos is not None:
                rows.append({**where, "kind": "render", "cause": "template",
                             **_describe(tokenizer, served, rendered, pos, context)})
            if prev is not None and served[: len(prev)] != prev:
                pos = _first_diff(served, prev)
                cause = "history_edited" if pos < prev_prompt_len else "retokenized"
                rows.append({**where, "kind": "fork", "cause": cause,
                             **_describe(tokenizer, served, prev, pos, context)})
            prev, prev_prompt_len = served + list(a[COMPLETION_TOKEN_IDS]), len(served)
            prev_call = ServedCall(tuple(served), tuple(a[COMPLETION_TOKEN_IDS]), str(a.get(COMPLETION) or ""),
                                   tuple(canonical), cut="length" in (a.get(RESPONSE_FINISH_REASONS) or []))
    df = pd.DataFrame(rows, columns=FIDELITY_COLUMNS)
    df.attrs.update(calls_checked=checked, rollouts_checked=rollouts)
    return df


def _rerender(span: Span, tokenizer: Any, tool_format: str, sampled: dict[str, str]) -> list[int]:
    """The prompt token IDs the span's messages (and tools) render to, as the proxy and engine do it
    (``sampled``: the attempt's tool-calling replies so far, which the proxy renders back as sampled)."""
    a = span.attributes
    messages = json.loads(a[PROMPT]) if isinstance(a.get(PROMPT), str) else a.get(PROMPT)
    tools = json.loads(a[REQUEST_TOOLS]) if a.get(REQUEST_TOOLS) else None
    choice = json.loads(a[REQUEST_TOOL_CHOICE]) if a.get(REQUEST_TOOL_CHOICE) else None
    if tool_format == "hermes":
        return prompt_token_ids(tokenizer, render_tools(messages or [], tools, choice or "auto", sampled))
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


# ----- the optimizer's-eye view -----------------------------------------------------------
def batch_df(last_batch: Sequence[dict[str, Any]], tokenizer: Any) -> pd.DataFrame:
    """One row per trained sequence of ``Update.batch`` (``algo.last_update.batch``).

    Columns: ``rollout_id``, ``group_id``, ``advantage``, ``tokens`` (sequence length),
    ``response_tokens`` (mask 1: the trained tokens), ``mean_ratio`` (mean over the trained
    tokens of ``exp(trainer − engine log-prob)``, the PPO importance ratio at the update),
    ``max_abs_logprob_diff`` (largest per-token ``|trainer − engine|`` log-prob, nats), both
    NaN when the sequence was not forwarded (``trainer_logprobs`` None, e.g. a zero
    advantage skipped by ``skip_zero_advantage``) or came without the engine's log-probs
    (``engine_logprobs`` None), and ``response_text`` (the trained tokens decoded).

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
            "rollout_id": seq["rollout_id"], GROUP_ID_KEY: seq[GROUP_ID_KEY], "advantage": float(seq["advantage"]),
            "tokens": len(seq["input_ids"]), "response_tokens": int(sum(mask)),
            "mean_ratio": sum(math.exp(d) for d in diffs) / len(diffs) if diffs else math.nan,
            "max_abs_logprob_diff": max(abs(d) for d in diffs) if diffs else math.nan,
            "response_text": tokenizer.decode([t for t, m in zip(seq["input_ids"], mask) if m]),
        })
    return pd.DataFrame(rows, columns=BATCH_COLUMNS)


def _logprob_diffs(seq: dict[str, Any]) -> list[float]:
    """``trainer − engine`` log-prob of each trained token; empty when the sequence was not forwarded or came
    without the engine's log-probs (``engine_logprobs`` None)."""
    new, old = seq.get("trainer_logprobs"), seq.get("engine_logprobs")
    if new is None or old is None:
        return []
    return [n - o for n, o, m in zip(new, old, seq["response_mask"]) if m]


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
    return (f'<div class="lnb-batch" style="{BOX_STYLE}"><b>Last batch</b>: {len(last_batch)} sequences{legend}'
            f'{"".join(blocks)}{more}</div>')


def _sequence_html(seq: dict[str, Any], tokenizer: Any, scale: float, clip_ratio: float) -> str:
    e = esc
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
        old = seq["engine_logprobs"][i] if seq.get("engine_logprobs") is not None else None
        tok_adv = float(per_token[i]) if per_token is not None else adv
        title = f"id {tok} · advantage {tok_adv:+.3f} · " + (f"old (engine) log-p {old:.4f}" if old is not None
                                                             else "no engine log-p (ratio against the trainer's)")
        cls, extra = "lnb-tok lnb-resp", ""
        if new is not None and old is not None:
            ratio = math.exp(new[i] - old)
            title += f" · new (trainer) log-p {new[i]:.4f} · ratio {ratio:.4f}"
            if abs(ratio - 1.0) > clip_ratio:
                cls, extra = cls + " lnb-clipped", ";text-decoration:underline wavy #cf222e"
        elif new is None:
            title += " · not forwarded"
        spans.append(f'<span class="{cls}" style="background:{_advantage_colour(tok_adv, scale)}{extra}" '
                     f'title="{e(title)}">{e(piece)}</span>')
    diffs = _logprob_diffs(seq)
    ratio_txt = f"{sum(math.exp(d) for d in diffs) / len(diffs):.4f}" if diffs else "–"
    head = (f"<code>{e(seq['rollout_id'])}</code> · group <code>{e(seq[GROUP_ID_KEY])}</code> · advantage "
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
