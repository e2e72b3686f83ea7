"""Run control panel: live step, tokens/s, loss, KL, reward; Pause / Resume / Save; chat while paused."""

from __future__ import annotations

import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable, Optional

import ipywidgets as ipw

from lightning_nb.inspect import esc, kv_table, run_summary
from widgets._live import LivePanel

__all__ = ["RunPanel"]


class RunPanel(LivePanel):
    """Live view of a run (an algorithm with a trainer: ``LightningRL``, ``TrafficLearner``) with control buttons.

    Pause calls ``algo.pause(wait=False)`` (the state reads ``pausing`` until the loop
    parks at its next step boundary: the rollouts it already enqueued finish and no update
    runs; then ``paused``), Resume ``algo.resume()`` (a config edited while paused is
    validated first; an invalid one is shown and the loop stays paused), Save
    ``algo.save(path)`` in a helper thread (``{step}`` in the path is replaced by
    the step; paused inside a step before its update, the checkpoint is of the step
    before, and paused ``before evaluate`` the save is refused and the reason shown,
    see :meth:`LightningRL.save <lightning_nb.algorithm.lightning_rl.LightningRL.save>`). The chat box asks the
    current policy (``algo.trainer.engine.chat``, greedy) and is enabled whenever the loop is not running
    (paused, idle, finished, stopped). While a loop runs, the row ``now`` under ``step`` (the steps done)
    says where it is, ``algo.progress``: ``step 2 · update 3/4 micro-batches``, ``step 2 · paused before update``.

    Args:
        algorithm: the run to watch and control (its ``trainer`` gives the engine the chat box asks).
        checkpoint_path: default path of Save.
        chat_system: optional system prompt of the chat box.
        chat_max_tokens: completion limit of a chat reply (tokens).
        interval_s: seconds between polls.
    """

    def __init__(self, algorithm: Any, *, checkpoint_path: str = "runs/checkpoints/step-{step}.pt",
                 chat_system: Optional[str] = None, chat_max_tokens: int = 64, interval_s: float = 1.0,
                 autostart: bool = True) -> None:
        self.algorithm, self.trainer = algorithm, algorithm.trainer
        self.chat_system, self.chat_max_tokens = chat_system, chat_max_tokens
        self.summary = ipw.HTML()
        self.summary.add_class("lnb-trainer-summary")
        self.pause_button = ipw.Button(description="Pause", icon="pause", button_style="warning")
        self.resume_button = ipw.Button(description="Resume", icon="play", button_style="success")
        self.save_button = ipw.Button(description="Save checkpoint", icon="save")
        self.save_path = ipw.Text(value=checkpoint_path, description="path", layout=ipw.Layout(width="340px"))
        self.chat_input = ipw.Text(placeholder="ask the current policy (enabled while paused)…",
                                   layout=ipw.Layout(width="420px"))
        self.chat_button = ipw.Button(description="Send", icon="comment")
        self.chat_log = ipw.HTML()
        for w, cls in ((self.pause_button, "lnb-pause"), (self.resume_button, "lnb-resume"),
                       (self.save_button, "lnb-save"), (self.chat_input, "lnb-chat-input"),
                       (self.chat_button, "lnb-chat-send"), (self.chat_log, "lnb-chat-log")):
            w.add_class(cls)
        self.pause_button.on_click(lambda _b: self.pause())
        self.resume_button.on_click(lambda _b: self.resume())
        self.save_button.on_click(lambda _b: self.save())
        self.chat_button.on_click(lambda _b: self.chat(self.chat_input.value))
        self.last_checkpoint: Optional[Path] = None
        self._worker: Optional[threading.Thread] = None
        self.rate_window_s = 10.0  # generated tokens/s is averaged over this many seconds
        self._gen_history: deque[tuple[float, int]] = deque()
        self.gen_tokens_per_s: Optional[float] = None
        super().__init__([self.summary, ipw.HBox([self.pause_button, self.resume_button]),
                          ipw.HBox([self.save_button, self.save_path]),
                          ipw.HBox([self.chat_input, self.chat_button]), self.chat_log],
                         interval_s=interval_s, autostart=autostart)
        self.add_class("lnb-trainer-panel")

    # ----- actions (what the buttons call) ------------------------------------------------
    def pause(self) -> None:
        """Pause at the next step boundary without blocking the kernel."""
        parked = self.algorithm.pause(wait=False)
        self.notify("paused" if parked else "pausing: the loop parks at its next step boundary "
                    "(the rollouts it enqueued finish first)")
        self.refresh()

    def resume(self) -> None:
        try:
            self.algorithm.resume()
        except ValueError as exc:  # ConfigError: an invalid edit made while paused
            self.notify(f"not resumed: {exc}")
        else:
            self.notify("resumed")
        self.refresh()

    def save(self, wait: bool = False) -> None:
        """Save a checkpoint in a helper thread (waits for an update in progress); joined when ``wait``."""
        path = Path(self.save_path.value.format(step=self.algorithm.global_step))
        self.save_button.disabled = True
        self.notify(f"saving {path}…")
        self._run(self._save, path, wait=wait)

    def _save(self, path: Path) -> None:
        try:
            self.last_checkpoint = self.algorithm.save(path)
            self.notify(f"saved {path} ({path.stat().st_size / 2**20:.0f} MiB, step {self.algorithm.global_step})")
        except Exception as exc:
            self.notify(f"save failed: {exc!r}")
        finally:
            self.save_button.disabled = False

    def chat(self, message: str, wait: bool = False) -> None:
        """Ask the current policy ``message`` in a helper thread; the reply appears under the box."""
        message = message.strip()
        if not message:
            return
        if self.algorithm.state in ("running", "pausing"):
            self.notify("pause training first: chat answers with the weights of a paused (or idle) trainer")
            return
        self.chat_button.disabled = True
        self.chat_log.value = (f'<div><b>you:</b> {esc(message)}</div>'
                               f'<div class="lnb-chat-pending"><i>the policy is answering…</i></div>')
        self._run(self._chat, message, wait=wait)

    def _chat(self, message: str) -> None:
        engine = self.trainer.engine
        try:
            t0 = time.perf_counter()
            reply = engine.chat(message, system=self.chat_system, max_tokens=self.chat_max_tokens)
            seconds = time.perf_counter() - t0
            self.chat_log.value = (
                f'<div><b>you:</b> {esc(message)}</div><div class="lnb-chat-reply"><b>policy</b> '
                f'(weights v{engine.weight_version}, {seconds:.1f} s): <span>{esc(reply)}</span></div>')
        except Exception as exc:
            self.chat_log.value = f'<div style="color:#cf222e">chat failed: {esc(repr(exc))}</div>'
        finally:
            self.refresh()

    def _run(self, fn: Callable, arg: object, wait: bool) -> None:
        self._worker = threading.Thread(target=fn, args=(arg,), name="lightning_nb-trainer-panel", daemon=True)
        self._worker.start()
        if wait:
            self._worker.join()

    # ----- polling --------------------------------------------------------------------------
    def _refresh(self) -> None:
        # only an in-process engine counts the tokens it generates; a served one (VLLMEngine) does not
        tokens = getattr(self.trainer.engine, "tokens_generated", None)
        rate: object = f"not counted by {type(self.trainer.engine).__name__}"
        if tokens is not None:
            now = time.monotonic()
            self._gen_history.append((now, tokens))
            while len(self._gen_history) > 2 and now - self._gen_history[0][0] > self.rate_window_s:
                self._gen_history.popleft()
            (t_old, n_old) = self._gen_history[0]
            if now > t_old:
                self.gen_tokens_per_s = (tokens - n_old) / (now - t_old)
            rate = self.gen_tokens_per_s
        items = run_summary(self.algorithm) + [("generated tokens/s (last 10 s)", rate)]
        if self.algorithm.running:
            at = next((i + 1 for i, (label, _) in enumerate(items) if label == "step"), len(items))
            items.insert(at, ("now", str(self.algorithm.progress)))
        html = kv_table(items)
        if self.algorithm.error is not None:
            html += f'<pre style="color:#cf222e">{esc(repr(self.algorithm.error))}</pre>'
        if self.summary.value != html:
            self.summary.value = html
        state = self.algorithm.state
        busy = self._worker is not None and self._worker.is_alive()
        self.pause_button.disabled = state != "running"
        self.resume_button.disabled = state not in ("paused", "pausing")
        self.chat_button.disabled = state in ("running", "pausing") or busy
        self.chat_input.disabled = state in ("running", "pausing")
