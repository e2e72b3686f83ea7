"""Live notebook widgets for lightning-nb (ipywidgets 8, anywidget, plotly FigureWidget).

The core library never imports this package. Each panel polls its sources on a
daemon thread and stops when closed::

    from widgets import dashboard
    dash = dashboard(store, runners, algo)   # display it in a cell; dash.close() stops it

or one at a time: ``RewardCurve(store)``, ``SpanBrowser(store)``, ``RunnerPanel(runners)``,
``RunPanel(algo)``; and ``what_if_figure(table)`` draws a :func:`lightning_nb.replay.what_if` table.
"""

from widgets._live import LivePanel, close_all, live_panels
from widgets.board import Dashboard, dashboard
from widgets.reward import RewardCurve
from widgets.runners import RunnerPanel, restart_runners
from widgets.spans import SpanBrowser, SpanTable
from widgets.run import RunPanel
from widgets.what_if import what_if_figure

__all__ = ["Dashboard", "LivePanel", "RewardCurve", "RunnerPanel", "SpanBrowser", "SpanTable", "RunPanel",
           "close_all", "dashboard", "live_panels", "restart_runners", "what_if_figure"]
