"""Runner panel: one row per runner thread (state, current rollout, counts, heartbeat) and Start/Stop."""

from __future__ import annotations

import threading
from typing import Optional

import ipywidgets as ipw

from lightning_nb._repr import runner_group_html
from lightning_nb.runner import Runner, RunnerGroup
from widgets._live import LivePanel

__all__ = ["RunnerPanel", "restart_runners"]


def restart_runners(group: RunnerGroup) -> int:
    """Replace every stopped runner thread of ``group`` by a new one with the same agent, store and settings.

    A Python thread cannot be started twice, so each new :class:`Runner` takes the
    old one's place in ``group.runners`` and carries its counts on. Returns how many
    were started.
    """
    started = 0
    for i, old in enumerate(list(getattr(group, "runners", []))):
        if not isinstance(old, Runner) or old.alive:
            continue
        new = Runner(old.agent, old.store, old.tracer, default_timeout_s=old.default_timeout_s,
                     llm_resource=old.llm_resource, poll_interval_s=old.poll_interval_s)
        new.stats.succeeded, new.stats.failed, new.stats.timed_out = (
            old.stats.succeeded, old.stats.failed, old.stats.timed_out)
        group.runners[i] = new.start()
        started += 1
    return started


class RunnerPanel(LivePanel):
    """Live table of a :class:`~lightning_nb.runner.RunnerGroup` with Start and Stop buttons.

    Stop asks every runner to finish its current attempt (in a helper thread, so the
    kernel stays free); Start starts new threads in place of the stopped ones.

    Args:
        runners: the handle :func:`~lightning_nb.runner.start_runners` returned.
        interval_s: seconds between polls.
    """

    def __init__(self, runners: RunnerGroup, *, interval_s: float = 1.0, autostart: bool = True) -> None:
        self.runners = runners
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

    def stop_runners(self, wait: bool = False) -> None:
        """What the Stop button does: ``runners.stop()`` in a helper thread (joined when ``wait``)."""
        self.notify("stopping runners after their current attempts…")
        self._stopper = threading.Thread(target=self._stop_and_report, name="lightning_nb-runner-stop", daemon=True)
        self._stopper.start()
        self.refresh()
        if wait:
            self._stopper.join()

    def _stop_and_report(self) -> None:
        self.runners.stop()
        alive = sum(r.alive for r in getattr(self.runners, "runners", []))
        self.notify("runners stopped" if not alive else f"{alive} runners still finishing an attempt")
        self.refresh()

    def start_runners(self) -> int:
        """What the Start button does: restart the stopped runners. Returns how many started."""
        n = restart_runners(self.runners)
        self.notify(f"started {n} runner threads" if n else "all runners are already running")
        self.refresh()
        return n

    def _refresh(self) -> None:
        html = runner_group_html(self.runners)
        if self.table.value != html:
            self.table.value = html
        threads = getattr(self.runners, "runners", None)
        alive = [r.alive for r in threads] if threads is not None else [True]
        self.stop_button.disabled = not any(alive)
        self.start_button.disabled = all(alive) or threads is None  # restart is for thread runners
