"""The runner threads started on each store, and the live runner group of a store.

``start_runners(replace=True)`` stops the threads still running on the same store before it starts
new ones; :func:`live_runner_group` is the group it started last there, which the dashboard's runner
panel follows. Both are tracked here with weak references only.
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, Optional

from lightning_nb.store.base import LightningStore

if TYPE_CHECKING:
    from lightning_nb.runners.group import RunnerGroup
    from lightning_nb.runners.runner import Runner

__all__ = ["LiveRunners", "LIVE", "live_runner_group"]


class LiveRunners:
    """The runner threads started on each store, for ``start_runners(replace=True)``.

    Held weakly both ways: the store by a weak reference (its entry goes when it is
    collected; a store that cannot be weakly referenced is not tracked) and the runners
    in a ``WeakSet`` (a running thread keeps its runner alive, a finished one is dropped).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_store: dict[int, tuple[weakref.ref, "weakref.WeakSet[Runner]"]] = {}
        self._groups: dict[int, weakref.ref] = {}  # id(store) -> the latest RunnerGroup start_runners registered
        # (key, ref) of collected stores, removed under the lock by the next call (see _drop)
        self._dead: list[tuple[int, weakref.ref]] = []

    def _entry(self, store: LightningStore) -> Optional[tuple[weakref.ref, "weakref.WeakSet[Runner]"]]:
        """The store's entry, made if missing (call with the lock held); None for a store without weakrefs."""
        self._purge()
        key = id(store)
        entry = self._by_store.get(key)
        if entry is None or entry[0]() is not store:
            try:
                ref = weakref.ref(store, lambda r, key=key: self._drop(key, r))
            except TypeError:
                return None
            entry = self._by_store[key] = (ref, weakref.WeakSet())
            self._groups.pop(key, None)
        return entry

    def add(self, runner: "Runner") -> None:
        with self._lock:
            entry = self._entry(runner.store)
            if entry is not None:
                entry[1].add(runner)

    def register_group(self, group: "RunnerGroup") -> None:
        """Make ``group`` the store's live group (what :func:`live_runner_group` returns)."""
        with self._lock:
            if self._entry(group.store) is not None:
                self._groups[id(group.store)] = weakref.ref(group)

    def group(self, store: LightningStore) -> Optional["RunnerGroup"]:
        with self._lock:
            self._purge()
            entry, ref = self._by_store.get(id(store)), self._groups.get(id(store))
            if entry is None or entry[0]() is not store or ref is None:
                return None
            return ref()

    def _drop(self, key: int, ref: weakref.ref) -> None:
        """The store's weakref callback. The garbage collector may run it inside this registry's own locked
        section, on the same thread (any allocation there can collect a store), so it takes no lock: taking it
        deadlocked ``start_runners``. It only records the store; the next call removes its entry."""
        self._dead.append((key, ref))  # atomic

    def _purge(self) -> None:
        """Remove the entries of collected stores (call with the lock held)."""
        while self._dead:
            key, ref = self._dead.pop()
            if key in self._by_store and self._by_store[key][0] is ref:
                del self._by_store[key]
                self._groups.pop(key, None)

    def running(self, store: LightningStore) -> list["Runner"]:
        """Runners on ``store`` whose thread runs and was not asked to stop, oldest first."""
        with self._lock:
            self._purge()
            entry = self._by_store.get(id(store))
            if entry is None or entry[0]() is not store:
                return []
            runners = list(entry[1])
        return sorted((r for r in runners if r.alive and not r.stop_requested), key=lambda r: r.seq)

    def __len__(self) -> int:
        with self._lock:
            self._purge()
            return len(self._by_store)


#: The registry :func:`~lightning_nb.runners.start_runners` and every :class:`Runner` use.
LIVE = LiveRunners()


def live_runner_group(store: LightningStore) -> Optional["RunnerGroup"]:
    """The runner group :func:`start_runners` (threads) started last on ``store``, or None.

    That is the group a re-run of the ``start_runners`` cell replaced the earlier one with;
    the dashboard's runner panel follows it. It is returned while it exists (its runner
    threads keep it alive, and so does any handle on it), even once stopped.
    """
    return LIVE.group(store)
