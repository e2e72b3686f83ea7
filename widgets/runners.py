"""Runner panel: one row per runner thread (state, current rollout, counts, heartbeat) and Start/Stop."""

from __future__ import annotations

import threading
import warnings
from typing import Any, Optional

import ipywidgets as ipw

from lightning_nb.inspect import runner_group_html
from lightning_nb.runners import RunnerGroup, live_runner_group
from widgets._live import LivePanel

__all__ = ["RunnerPanel", "restart_runners"]


def restart_runners(group: RunnerGroup) -> Optional[RunnerGroup]:
    """Start ``group``'s agent and settings again as a new group; None when all its runners are running.

    Goes through :meth:`~lightning_nb.runners.RunnerGroup.restart`, so the replace rule
    of ``start_runners`` applies (running threads on the store are stopped first, and said so: the new group's
    ``replaced``) and the new group becomes the store's live runner group.
    """
    if not isinstance(group, RunnerGroup) or all(r.alive for r in group.runners):
        return None
    return group.restart()


class RunnerPanel(LivePanel):
    """Live table of the store's runner group with Start and Stop buttons.

    The panel follows the store's live runner group
    (:func:`~lightning_nb.runners.live_runner_group`): after the ``start_runners`` cell is
    re-run, it shows the new group, not the stopped one it was given. Stop asks every
    runner to finish its current attempt (in a helper thread, so the kernel stays free);
    Start restarts the group through ``start_runners``' replace rule
    (:meth:`~lightning_nb.runners.RunnerGroup.restart`) and shows its warning in the panel.

    Args:
        runners: the handle :func:`~lightning_nb.runners.start_runners` returned (a Ray
            group is shown as given; Start is for thread runners).
        interval_s: seconds between polls.
    """

    def __init__(self, runners: Any, *, interval_s: float = 1.0, autostart: bool = True) -> None:
        self._given = runners
        self.table = ipw.HTML()
        self.start_button = ipw.Button(description="Start runners", icon="play", button_style="success")
        self.stop_button = ipw.Button(description="Stop runners", icon="stop", button_style="warning")
        self.start_button.add_class("lnb-runners-start")
        self.stop_button.add_class("lnb-runners-stop")
        self.start_button.on_click(lambda _b: self.start_runners())
        self.stop_button.on_click(lambda _b: self.stop_runners())
        self._stopper: Optional[threading.Thread] = None
        super().__init__([ipw.HBox([self.start_button, self.stop_button]), self.table],
                         interval_s=interval_s, autostart=autostart)
        self.add_class("lnb-runner-panel")

    @property
    def runners(self) -> Any:
        """The group shown: the store's live runner group when it is a newer one than the group given, else that."""
        given = self._given
        if isinstance(given, RunnerGroup):
            live = live_runner_group(given.store)
            if live is not None and live is not given and live.started_at >= given.started_at:
                self._given = given = live
        return given

    def stop_runners(self, wait: bool = False) -> None:
        """What the Stop button does: ``runners.stop()`` in a helper thread (joined when ``wait``)."""
        self.notify("stopping runners after their current attempts…")
        self._stopper = threading.Thread(target=self._stop_and_report, args=(self.runners,),
                                         name="lightning_nb-runner-stop", daemon=True)
        self._stopper.start()
        self.refresh()
        if wait:
            self._stopper.join()

    def _stop_and_report(self, group: Any) -> None:
        group.stop()
        alive = sum(r.alive for r in getattr(group, "runners", []))
        self.notify("runners stopped" if not alive else f"{alive} runners still finishing an attempt")
        self.refresh()

    def start_runners(self) -> int:
        """What the Start button does: :func:`restart_runners` on the group shown. Returns how many started.

        What the replace rule did (running threads stopped: the new group's ``replaced``) and any warning are
        shown in the panel.
        """
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            group = restart_runners(self.runners)
        n = 0 if group is None else len(group.runners)
        notes = [str(w.message) for w in caught]
        replaced = getattr(group, "replaced", "")
        if replaced and replaced not in notes:  # an info line, not a warning: the panel shows it all the same
            notes.append(replaced)
        self.notify("; ".join([f"started {n} runner threads"] + notes) if n else "all runners are already running")
        for w in caught:  # still a warning for logs and tests, as start_runners gives it
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        self.refresh()
        return n

    def _refresh(self) -> None:
        group = self.runners
        html = runner_group_html(group)
        if self.table.value != html:
            self.table.value = html
        threads = getattr(group, "runners", None)
        alive = [r.alive for r in threads] if threads is not None else [True]
        self.stop_button.disabled = not any(alive)
        self.start_button.disabled = all(alive) or not isinstance(group, RunnerGroup)  # restart: thread runners
