"""A Ray runner group's watch over its actors: a dead actor's attempt ends at once, and the actor is restarted.

Each runner actor of :func:`~lightning_nb.runners.ray.start_ray_runners` runs one long ``watch()`` call that
returns only when its runner thread stops. When the actor dies (its process killed, its node lost), Ray fails
that call within about a second, and :class:`ActorWatch`, a daemon thread of the group:

* ends the actor's in-flight attempt ``unresponsive`` (the store's worker record names it), so its rollout is
  requeued for a live runner per its ``retry_condition``/``max_attempts`` at once, instead of staying
  ``running`` until the rollout's ``timeout_seconds`` (the store's watchdog would end it only after
  ``unresponsive_seconds``, which is unset by default);
* follows Ray's restart of the actor (``max_restarts``): once the restarted actor answers, it starts its
  runner again (same worker id) and watches it again; once the actor has no restart left it warns (``RuntimeWarning``) that
  the group runs one short, and the group's ``status()`` shows it ``dead``.
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from typing import Any, Optional

from lightning_nb.store.base import LightningStore
from lightning_nb.types import ATTEMPT_TERMINAL

__all__ = ["ActorWatch"]

log = logging.getLogger(__name__)


class ActorWatch:
    """Watches a Ray runner group's actors from a daemon thread (see the module docstring).

    Args:
        ray: the ``ray`` module.
        actors: the actor handles (each has a ``watch()`` method that returns when its runner stops).
        worker_ids: the runners' worker ids, one per actor.
        store: the store the group works on (the in-process one, or the client), where attempts are ended.
        max_restarts: restarts Ray makes of each actor (the actors' ``max_restarts`` option).
        poll_s: seconds between checks of :meth:`stop` while every actor is alive.

    Attributes:
        restarts: worker id -> how many times its actor died and was restarted.
        dead: worker ids of actors that died with no restart left.
    """

    def __init__(self, ray: Any, actors: list[Any], worker_ids: list[str], store: LightningStore, *,
                 max_restarts: int, poll_s: float = 1.0) -> None:
        self._ray, self._actors, self._worker_ids, self._store = ray, actors, worker_ids, store
        self.max_restarts, self.poll_s = max_restarts, poll_s
        self.restarts = dict.fromkeys(worker_ids, 0)
        self.dead: set[str] = set()
        self._down: set[int] = set()  # actors that died and are not back yet
        # a pending call -> (actor index, "watch" or "probe"); a probe is a status() call that answers once the
        # actor is back (Ray queues calls to an actor it restarts) and fails with ActorDiedError once it never will
        self._refs: dict[Any, tuple[int, str]] = {actor.watch.remote(): (i, "watch") for i, actor in enumerate(actors)}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="lightning-nb-ray-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop watching (before the group kills its actors on purpose); returns within ``poll_s`` seconds."""
        self._stop.set()
        self._thread.join(self.poll_s + 5.0)

    def _loop(self) -> None:
        ray = self._ray
        while not self._stop.is_set() and self._refs:
            ready, _ = ray.wait(list(self._refs), num_returns=1, timeout=self.poll_s)
            for ref in ready:
                i, kind = self._refs.pop(ref)
                try:
                    ray.get(ref)
                except Exception as exc:  # the actor died (or is not back yet)
                    if self._stop.is_set():
                        return
                    self._on_failure(i, kind, exc)
                    continue
                if kind == "probe":  # back after a restart: watch it again
                    self._back(i)

    def _on_failure(self, i: int, kind: str, exc: BaseException) -> None:
        """A call to actor ``i`` failed: end its attempt at once, then probe until it is back or dead for good."""
        wid = self._worker_ids[i]
        reason = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"[:300]
        if i not in self._down:
            self._down.add(i)
            self._end_attempt(wid, f"Ray runner actor {wid} died ({reason}); its attempt ended at once")
        if kind == "probe" and isinstance(exc, self._ray.exceptions.ActorDiedError):
            self._dead(wid, reason)
            return
        if kind == "probe":
            time.sleep(0.5)  # not back yet
        self._refs[self._actors[i].status.remote()] = (i, "probe")

    def _back(self, i: int) -> None:
        wid = self._worker_ids[i]
        if i in self._down:
            self._down.discard(i)
            self.restarts[wid] += 1
            log.warning("Ray runner actor %s died and Ray restarted it (restart %d of max_restarts=%d)", wid,
                        self.restarts[wid], self.max_restarts)
            self._actors[i].start.remote()  # Ray ran __init__ again: start its runner (same worker id)
        self._refs[self._actors[i].watch.remote()] = (i, "watch")

    def _dead(self, wid: str, reason: str) -> None:
        self.dead.add(wid)
        alive = len(self._actors) - len(self.dead)
        warnings.warn(f"Ray runner actor {wid} died ({reason[:200]}) with no restart left (max_restarts="
                      f"{self.max_restarts}): the group runs one short, {alive} of {len(self._actors)} runners. "
                      "Start the runners again (start_runners) or pass a larger max_restarts", RuntimeWarning,
                      stacklevel=1)

    def _end_attempt(self, worker_id: str, error: str) -> None:
        """End the attempt the store's worker record says ``worker_id`` was running, ``unresponsive``."""
        try:
            worker: Optional[Any] = next((w for w in self._store.query_workers() if w.worker_id == worker_id), None)
            if worker is None or not worker.current_attempt_id or not worker.current_rollout_id:
                return
            rid, aid = worker.current_rollout_id, worker.current_attempt_id
            attempt = next((a for a in self._store.query_attempts(rid) if a.attempt_id == aid), None)
            if attempt is None or attempt.status in ATTEMPT_TERMINAL:
                return
            self._store.update_attempt(rid, aid, status="unresponsive", error=error)
        except Exception as exc:  # the watchdog (unresponsive_seconds) or the rollout's timeout is the backstop
            log.warning("could not end the attempt of dead Ray runner actor %s: %s", worker_id, exc)
