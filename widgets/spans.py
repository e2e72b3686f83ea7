"""Span browser: the latest spans as a clickable table, filters, and the span tree of one rollout.

The table is a small anywidget (no labextension build: anywidget ships a prebuilt
one). Clicking a row selects its rollout; the tree below shows that rollout's
spans per attempt (agent → LLM calls and tools → reward) with the prompt and
completion text and token counts. When the rollout was replayed or branched (or is a
replay or branch itself, :mod:`lightning_nb.replay`), a second tree shows its family:
the root rollout, its branches at each call with their rewards, and theirs.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import anywidget
import ipywidgets as ipw
import traitlets

from lightning_nb.inspect import span_tree_html
from lightning_nb.semconv import REWARD, USAGE_INPUT_TOKENS, USAGE_OUTPUT_TOKENS
from lightning_nb.store.base import LightningStore
from lightning_nb.replay.branching import branch_family
from lightning_nb.types import ROLLOUT_TERMINAL, Span
from widgets._live import LivePanel

__all__ = ["SpanBrowser", "SpanTable", "SPAN_COLUMNS", "branch_family", "branch_family_html"]

SPAN_COLUMNS = ["time", "rollout", "attempt", "#", "name", "ms", "prompt tok", "completion tok", "reward"]

_ESM = """
function render({ model, el }) {
  const wrap = document.createElement("div");
  wrap.className = "lnb-span-table-wrap";
  el.appendChild(wrap);
  function draw() {
    const cols = model.get("columns"), rows = model.get("rows"), keys = model.get("row_keys");
    const selected = model.get("selected");
    const top = wrap.scrollTop;
    const table = document.createElement("table");
    table.className = "lnb-span-table";
    const head = table.createTHead().insertRow();
    for (const c of cols) { const th = document.createElement("th"); th.textContent = c; head.appendChild(th); }
    const body = table.createTBody();
    rows.forEach((row, i) => {
      const tr = body.insertRow();
      tr.dataset.rollout = keys[i];
      if (keys[i] === selected) tr.classList.add("lnb-selected");
      for (const v of row) { const td = tr.insertCell(); td.textContent = (v === null ? "–" : String(v)); }
      tr.addEventListener("click", () => { model.set("selected", keys[i]); model.save_changes(); });
    });
    wrap.replaceChildren(table);
    wrap.scrollTop = top;
  }
  model.on("change:rows", draw);
  model.on("change:selected", draw);
  model.on("change:columns", draw);
  draw();
  return () => { model.off("change:rows", draw); model.off("change:selected", draw); model.off("change:columns", draw); };
}
export default { render };
"""

_CSS = """
.lnb-span-table-wrap { max-height: 300px; overflow: auto; border: 1px solid rgba(127,127,127,.35); }
.lnb-span-table { border-collapse: collapse; font-size: 12px; width: 100%; }
.lnb-span-table th { position: sticky; top: 0; background: var(--jp-layout-color2, #eee); text-align: left; padding: 2px 6px; }
.lnb-span-table td { padding: 1px 6px; border-top: 1px solid rgba(127,127,127,.2); white-space: nowrap; }
.lnb-span-table tbody tr { cursor: pointer; }
.lnb-span-table tbody tr:hover { background: rgba(9,105,218,.08); }
.lnb-span-table tr.lnb-selected { background: rgba(9,105,218,.18); }
"""


class SpanTable(anywidget.AnyWidget):
    """A table of rows; clicking a row sets :attr:`selected` to that row's key (its rollout id)."""

    _esm = _ESM
    _css = _CSS
    columns = traitlets.List(traitlets.Unicode()).tag(sync=True)
    rows = traitlets.List(traitlets.List()).tag(sync=True)
    row_keys = traitlets.List(traitlets.Unicode()).tag(sync=True)
    selected = traitlets.Unicode("").tag(sync=True)


class SpanBrowser(LivePanel):
    """Latest spans (newest first) with filters, and the span tree of the selected rollout.

    Args:
        store: the store to read.
        limit: most rows in the table.
        interval_s: seconds between polls. Spans of rollouts that are queued are
            not read; a rollout's spans are read again only while it runs and once
            when it ends, so a poll costs little once rollouts are done.
    """

    def __init__(self, store: LightningStore, *, limit: int = 50, interval_s: float = 1.0,
                 autostart: bool = True) -> None:
        self.store, self.limit = store, limit
        self._spans: dict[str, list[Span]] = {}
        self._final: set[str] = set()
        self.rollout_filter = ipw.Text(placeholder="rollout id contains…", description="rollout",
                                       continuous_update=False, layout=ipw.Layout(width="260px"))
        self.attempt_filter = ipw.Text(placeholder="attempt id contains…", description="attempt",
                                       continuous_update=False, layout=ipw.Layout(width="240px"))
        self.name_filter = ipw.Dropdown(options=["(all)"], value="(all)", description="name",
                                        layout=ipw.Layout(width="260px"))
        self.table = SpanTable(columns=SPAN_COLUMNS)
        self.tree_title = ipw.HTML("<b>span tree</b>: click a row (or filter to one rollout)")
        self.tree = ipw.HTML()
        self.tree.add_class("lnb-span-tree")
        self.branches = ipw.HTML()  # the selected rollout's replays and branches, as a tree with rewards
        self.branches.add_class("lnb-branch-tree")
        self._family_key: Any = None
        for w in (self.rollout_filter, self.attempt_filter, self.name_filter):
            w.observe(lambda _change: self.refresh(), names="value")
        self.table.observe(lambda _change: self.refresh(), names="selected")
        super().__init__([ipw.HBox([self.rollout_filter, self.attempt_filter, self.name_filter]), self.table,
                          self.tree_title, self.tree, self.branches], interval_s=interval_s, autostart=autostart)
        self.add_class("lnb-span-browser")

    # ----- reading ----------------------------------------------------------------------
    def _update_cache(self) -> None:
        for r in self.store.query_rollouts():
            rid = r.rollout_id
            if rid in self._final or (r.status in ("queuing", "requeuing") and rid not in self._spans):
                continue
            self._spans[rid] = self.store.query_spans(rid)
            if r.status in ROLLOUT_TERMINAL:
                self._final.add(rid)

    def spans(self) -> list[Span]:
        """Cached spans matching the filters, newest (by end time) first."""
        rf, af, nf = self.rollout_filter.value.strip(), self.attempt_filter.value.strip(), self.name_filter.value
        out = [s for rid, spans in self._spans.items() if rf in rid for s in spans
               if af in s.attempt_id and (nf == "(all)" or s.name == nf)]
        return sorted(out, key=lambda s: (s.end_time, s.sequence_id), reverse=True)

    @property
    def selected_rollout(self) -> Optional[str]:
        """The rollout whose tree is shown: the clicked row, else the only rollout the filter matches."""
        if self.table.selected:
            return self.table.selected
        rf = self.rollout_filter.value.strip()
        matches = [rid for rid in self._spans if rf and rf in rid]
        return matches[0] if len(matches) == 1 else None

    def _refresh(self) -> None:
        self._update_cache()
        names = sorted({s.name for spans in self._spans.values() for s in spans})
        options = ["(all)", *names]
        if list(self.name_filter.options) != options:
            value = self.name_filter.value
            self.name_filter.options = options
            self.name_filter.value = value if value in options else "(all)"
        shown = self.spans()[: self.limit]
        rows = [_row(s) for s in shown]
        keys = [s.rollout_id for s in shown]
        if rows != self.table.rows or keys != self.table.row_keys:
            with self.table.hold_sync():
                self.table.rows, self.table.row_keys = rows, keys
        rid = self.selected_rollout
        if rid is None:
            tree = ""
        else:
            if rid not in self._final:  # show the newest spans of a running rollout
                self._spans[rid] = self.store.query_spans(rid)
            tree = span_tree_html(self._spans.get(rid, []))
        title = (f"<b>span tree</b> of rollout <code>{rid}</code>" if rid
                 else "<b>span tree</b>: click a row (or filter to one rollout)")
        if self.tree.value != tree:
            self.tree.value = tree
        if self.tree_title.value != title:
            self.tree_title.value = title
        key = (rid, len(self._spans), len(self._final))  # read the family again only when something changed
        if key != self._family_key:
            self._family_key = key
            family = branch_family(self.store, rid) if rid else []
            html = branch_family_html(family, rid) if len(family) > 1 else ""
            if self.branches.value != html:
                self.branches.value = html


def branch_family_html(family: list[dict[str, Any]], selected: Optional[str] = None) -> str:
    """:func:`~lightning_nb.replay.branching.branch_family` as an indented tree: each branch under its parent with the call it branched at, its
    status and its reward; ``selected`` in bold."""
    import html

    lines = ["<b>replays and branches</b>"]
    for row in family:
        rid = html.escape(row["rollout_id"])
        name = f"<b>{rid}</b>" if row["rollout_id"] == selected else rid
        at = "" if row["depth"] == 0 else f"at call {row['branch_call']} → "
        reward = "–" if row["reward"] is None else f"{float(row['reward']):.3g}"
        lines.append(f'<div style="margin-left:{16 * row["depth"]}px">{"└ " if row["depth"] else ""}{at}'
                     f"<code>{name}</code> · {html.escape(row['status'])} · reward {reward}</div>")
    return '<div class="lnb-branches">' + "".join(lines) + "</div>"


def _row(s: Span) -> list[Any]:
    a = s.attributes
    reward = a.get(REWARD)
    return [time.strftime("%H:%M:%S", time.localtime(s.end_time)), s.rollout_id, s.attempt_id, s.sequence_id,
            s.name, round((s.end_time - s.start_time) * 1000), a.get(USAGE_INPUT_TOKENS),
            a.get(USAGE_OUTPUT_TOKENS), None if reward is None else round(float(reward), 3)]
