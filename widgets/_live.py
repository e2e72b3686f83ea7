"""Base of the live panels: an ``ipywidgets.VBox`` refreshed by a background polling thread.

The thread calls :meth:`LivePanel.refresh` every ``interval_s`` seconds (the
throttle: a panel never sends more than one update per interval, and only
when something changed). Cells are never blocked: the poller runs beside the
kernel's main thread and ipywidgets sends its updates from there. Closing the
panel (``panel.close()``, or closing a dashboard that holds it) stops the
thread and closes the widgets it owns; :func:`close_all` closes every live panel.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Any, Optional

import ipywidgets as ipw

from lightning_nb.inspect import esc

__all__ = ["LivePanel", "close_all", "live_panels"]

log = logging.getLogger(__name__)
_LIVE: "weakref.WeakSet[LivePanel]" = weakref.WeakSet()


class LivePanel(ipw.VBox):
    """A VBox whose content a daemon thread refreshes every ``interval_s`` seconds.

    Subclasses implement :meth:`_refresh` (read the store/trainer, update child
    widgets only when values changed). ``refresh()`` may also be called directly
    (tests, or to update at once after a button click).

    Args:
        children: the panel's widgets (a status line is appended).
        interval_s: seconds between refreshes (>= 0.05).
        autostart: start polling at once.
    """

    def __init__(self, children: list, *, interval_s: float = 1.0, autostart: bool = True, **kwargs: Any) -> None:
        if interval_s < 0.05:
            raise ValueError(f"interval_s must be >= 0.05 seconds, got {interval_s}")
        self.status_line = ipw.HTML(layout=ipw.Layout(margin="2px 0 0 0"))
        self.status_line.add_class("lnb-status")
        super().__init__(children=[*children, self.status_line], **kwargs)
        self.add_class("lnb-panel")
        self.interval_s = float(interval_s)
        self.refresh_count = 0
        self.last_error: Optional[BaseException] = None
        self._lnb_lock = threading.RLock()
        self._lnb_stop = threading.Event()
        self._lnb_thread: Optional[threading.Thread] = None
        self._lnb_closed = False
        self._lnb_message = ""
        _LIVE.add(self)
        if autostart:
            self.start()

    # ----- polling ----------------------------------------------------------------------
    def refresh(self) -> None:
        """Read the sources once and update the widgets (thread-safe)."""
        with self._lnb_lock:
            if self._lnb_closed:
                return
            try:
                self._refresh()
                self.last_error = None
            except Exception as exc:  # shown in the panel; polling goes on
                self.last_error = exc
                log.exception("%s: refresh failed", type(self).__name__)
            self.refresh_count += 1
            self._show_status()

    def _refresh(self) -> None:
        raise NotImplementedError

    def start(self) -> "LivePanel":
        """Start the polling thread (no-op if it runs or the panel is closed)."""
        if self._lnb_closed or (self._lnb_thread is not None and self._lnb_thread.is_alive()):
            return self
        self._lnb_stop.clear()
        self._lnb_thread = threading.Thread(target=self._poll, name=f"lightning_nb-{type(self).__name__}", daemon=True)
        self._lnb_thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop polling; waits up to ``timeout`` seconds for a refresh in progress to end."""
        self._lnb_stop.set()
        thread = self._lnb_thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    @property
    def polling(self) -> bool:
        """True while the polling thread runs."""
        return self._lnb_thread is not None and self._lnb_thread.is_alive()

    def _poll(self) -> None:
        while not self._lnb_stop.is_set():
            self.refresh()
            self._lnb_stop.wait(self.interval_s)

    # ----- status line and closing ------------------------------------------------------
    def notify(self, message: str) -> None:
        """Show ``message`` (plain text) in the status line until the next one."""
        self._lnb_message = message
        self._show_status()

    def _show_status(self) -> None:
        parts = [f"updated {time.strftime('%H:%M:%S')} · every {self.interval_s:g} s"]
        if self._lnb_message:
            parts.append(esc(self._lnb_message))
        if self.last_error is not None:
            parts.append(f'<span style="color:#cf222e">refresh failed: {esc(repr(self.last_error))}</span>')
        text = f'<span style="font-size:11px;color:#57606a">{" · ".join(parts)}</span>'
        if self.status_line.value != text:
            self.status_line.value = text

    def close(self) -> None:
        """Stop polling and close this panel and the widgets inside it."""
        with self._lnb_lock:
            self._lnb_closed = True
        self.stop()
        for child in _descendants(self):
            child.close()
        super().close()


def _descendants(widget: ipw.Widget) -> list[ipw.Widget]:
    out: list[ipw.Widget] = []
    for child in getattr(widget, "children", ()):
        out.append(child)
        out.extend(_descendants(child))
    return out


def live_panels() -> list[LivePanel]:
    """The live panels not yet garbage-collected (open or closed)."""
    return list(_LIVE)


def close_all() -> int:
    """Close every open live panel (e.g. before re-running a dashboard cell). Returns how many."""
    panels = [p for p in _LIVE if not p._lnb_closed]
    for p in panels:
        p.close()
    return len(panels)
