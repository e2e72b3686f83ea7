"""``dashboard(store, runners, algo)``: every live panel in one output."""

from __future__ import annotations

from typing import Any, Optional

import ipywidgets as ipw

from lightning_nb.runners import RunnerGroup, live_runner_group
from lightning_nb.store import LightningStore
from widgets._live import LivePanel
from widgets.reward import RewardCurve
from widgets.runners import RunnerPanel
from widgets.spans import SpanBrowser
from widgets.run import RunPanel

__all__ = ["Dashboard", "dashboard"]


class Dashboard(ipw.VBox):
    """The panels of :func:`dashboard`; :meth:`close` stops all their polling threads."""

    def __init__(self, panels: dict[str, LivePanel]) -> None:
        self.panels = panels
        title = ipw.HTML("<h3 style='margin:4px 0'>lightning-nb live dashboard</h3>")
        top = [p for k, p in panels.items() if k in ("run", "runners")]
        for p in top:
            p.layout = ipw.Layout(width=f"{100 // len(top)}%", padding="0 8px 0 0")
        rows: list[Any] = [title]
        if top:
            rows.append(ipw.HBox(top))
        rows += [p for k, p in panels.items() if k not in ("run", "runners")]
        super().__init__(children=rows)
        self.add_class("lnb-dashboard")

    def refresh(self) -> None:
        """Refresh every panel now (they also refresh on their own)."""
        for p in self.panels.values():
            p.refresh()

    def close(self) -> None:
        """Stop every panel's polling thread and close all widgets."""
        for p in self.panels.values():
            p.close()
        for child in self.children:
            child.close()
        super().close()


def dashboard(store: LightningStore, runners: Optional[RunnerGroup] = None, algorithm: Any = None,
              *, interval_s: float = 1.0, batch_size: int = 8, span_rows: int = 50,
              chat_system: Optional[str] = None, slice_by: Any = None) -> Dashboard:
    """The run's and the runners' panels side by side (when given), the reward curve and the span browser.

    ``algorithm``: the run to watch and control (``LightningRL``, ``TrafficLearner``: :class:`RunPanel`).

    Without ``runners`` the runner panel shows the store's live runner group, if any
    (:func:`~lightning_nb.runners.live_runner_group`); either way it follows a re-run of ``start_runners``.

    Each panel is also usable alone: :class:`RunPanel`, :class:`RunnerPanel`,
    :class:`RewardCurve`, :class:`SpanBrowser`. Every panel polls on its own daemon
    thread every ``interval_s`` seconds; ``dash.close()`` stops them all. ``slice_by`` (a task field such as
    ``"ops"``, or a function ``task -> label``) adds one validation line per slice to the reward curve.
    """
    panels: dict[str, LivePanel] = {}
    if algorithm is not None:
        panels["run"] = RunPanel(algorithm, interval_s=interval_s, chat_system=chat_system)
    runners = runners if runners is not None else live_runner_group(store)
    if runners is not None:
        panels["runners"] = RunnerPanel(runners, interval_s=interval_s)
    panels["reward"] = RewardCurve(store, batch_size=batch_size, interval_s=interval_s, slice_by=slice_by,
                                   trainer=None if algorithm is None else algorithm.trainer)
    panels["spans"] = SpanBrowser(store, limit=span_rows, interval_s=interval_s)
    return Dashboard(panels)
