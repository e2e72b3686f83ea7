"""What an algorithm's ``wait()`` says while it waits: the default live line and the default stall advice.

:meth:`~lightning_nb.algorithm.control.BackgroundLoop.wait` shows the loop's phase (:attr:`progress`) and what
:meth:`~lightning_nb.algorithm.control.BackgroundLoop.waiting_for` adds; when nothing moved for its ``stall_s``
seconds, or its ``timeout`` expired, it warns with
:meth:`~lightning_nb.algorithm.control.BackgroundLoop.stall_advice` (why the loop may not move, and what to
do). Their defaults, for any loop whose phase counts rollouts of a store, are the functions here; an algorithm
overrides the hooks with its own (``TrafficLearner``: labelled and unlabelled traffic).
"""

from __future__ import annotations

from typing import Any

__all__ = ["store_queue", "rollouts_waiting_for", "default_stall_advice"]

_QUEUED = ("queuing", "requeuing")
_STARTED = ("preparing", "running")


def store_queue(store: Any) -> tuple[int, int]:
    """``(queued, started)``: the store's rollouts waiting for a runner, and those a runner took and has not finished."""
    active = store.query_rollouts(status=[*_QUEUED, *_STARTED])
    queued = sum(1 for r in active if r.status in _QUEUED)
    return queued, len(active) - queued


def rollouts_waiting_for(progress: Any, store: Any) -> str:
    """``"16 queued, 0 running in the store"`` while ``progress`` (a ``LoopProgress``) counts rollouts; else ``""``."""
    if progress.unit != "rollouts" or progress.phase == "paused" or store is None:
        return ""
    queued, running = store_queue(store)
    return f"{queued} queued, {running} running in the store"


def default_stall_advice(progress: Any, store: Any) -> str:
    """Why a loop at ``progress`` may not move, and what to do (``""``: nothing to say).

    A pause (call ``resume()``); rollouts queued and none started (no runner consumes the store:
    ``start_runners(agent, store)``, with the count of runners the store has not seen stop); rollouts running
    (a slow agent or engine: ``store.attempts_df()``); the weight update (micro-batches on a CPU).
    """
    if progress.phase == "paused":
        return f"The loop is paused {progress.boundary}: call resume() to go on."
    if progress.unit == "rollouts" and store is not None:
        queued, running = store_queue(store)
        if queued and not running:
            alive = sum(1 for w in store.query_workers() if w.status != "stopped")
            return (f"{queued} rollouts queued, none started: are runners running? start_runners(agent, store) runs "
                    f"them ({alive} runner(s) not stopped in store.workers_df()).")
        if running:
            return (f"{running} rollouts running: the agent or the engine is slow; store.attempts_df() shows their "
                    "attempts (the rollout's timeout ends one).")
    if progress.phase == "update":
        return ("The weight update runs: each micro-batch is a forward and backward pass, minutes on a CPU for long "
                "sequences (a smaller micro_batch_size or max_tokens is faster).")
    return ""
