"""The in-memory store's lock: a reentrant lock that, when contended, only a running thread takes.

Why not a plain ``threading.RLock``: CPython's lock hands a released lock to a blocked waiter inside the
kernel, before that waiter has the GIL back. With many runner threads busy in store calls (runners whose
agent is waiting on nothing, as in agent-lightning's store benchmark), the new owner then waits for the GIL
behind the other threads, and every thread that runs meanwhile blocks on the lock it holds: a lock convoy,
about two context switches and one GIL hand-over per store call (bench/README.md, "Where the 32-thread cost
goes"). :class:`RunningThreadLock` keeps ownership in a C ``RLock`` that it only ever *tries* to take; a
thread that finds it taken parks on a separate gate with the GIL released, and a release wakes one parked
thread, which tries again once it runs. A running thread that finds the lock free takes it at once, so the
lock is never owned by a thread that cannot run.

The main thread uses the C ``RLock`` itself (:meth:`RunningThreadLock.for_this_thread`): its ``with``
statement then runs no Python code between taking and releasing the lock, so a ``KeyboardInterrupt`` (a
notebook's interrupt button, delivered to the main thread only) cannot leave the lock taken.
"""

from __future__ import annotations

import _thread
import os
import threading
import time
from typing import Any, Union

__all__ = ["RunningThreadLock", "PARK_S"]

PARK_S = 0.002
"""A parked thread tries again at least this often (seconds): a release by the main thread (the C lock's,
which wakes no parked thread) or a wake-up given to a thread that then found the lock taken again costs a
parked thread at most this long."""

_main_ident = threading.main_thread().ident


def _after_fork_in_child() -> None:  # the forking thread is the child's main thread
    global _main_ident
    _main_ident = threading.main_thread().ident


os.register_at_fork(after_in_child=_after_fork_in_child)


class RunningThreadLock:
    """A reentrant lock for many threads busy under the GIL (see the module docstring).

    Use ``with lock.for_this_thread():`` (the C ``RLock`` in the main thread, this object elsewhere) and
    ``threading.Condition(lock)``; both acquisition paths share one owner and one recursion count.

    Attributes:
        rlock: the C ``threading.RLock`` that holds the ownership.
    """

    __slots__ = ("rlock", "_gate", "_parked")

    def __init__(self) -> None:
        self.rlock = threading.RLock()
        self._gate = _thread.allocate_lock()  # locked: no wake-up pending; released: one is
        self._gate.acquire()
        self._parked: list[None] = []  # one entry per parked thread (append/pop are atomic under the GIL)

    def for_this_thread(self) -> Union[RunningThreadLock, Any]:
        """The C ``RLock`` in the main thread, this lock in any other thread (one of them per ``with``)."""
        return self.rlock if _thread.get_ident() == _main_ident else self

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        """Take the lock (again, in the owning thread), as ``RLock.acquire``; True when taken."""
        if self.rlock.acquire(False):
            return True
        if not blocking:
            return False
        return self._park(None if timeout < 0 else time.monotonic() + timeout)

    def __enter__(self) -> bool:
        if self.rlock.acquire(False):
            return True
        return self._park(None)

    def _park(self, deadline: Any) -> bool:
        """Wait, GIL released, for a release to wake this thread; take the lock once running. False at ``deadline``."""
        parked, gate, take = self._parked, self._gate, self.rlock.acquire
        parked.append(None)  # before trying again: a release from now on sees a parked thread and wakes one
        taken = False
        try:
            while not (taken := take(False)):
                if deadline is None:
                    gate.acquire(True, PARK_S)
                    continue
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                gate.acquire(True, min(PARK_S, left))
            return True
        finally:
            parked.pop()
            if not taken and parked:  # leaving without the lock: a wake-up this thread took goes to the next
                self._wake()

    def release(self) -> None:
        """Release once, as ``RLock.release``; when the lock is free and a thread is parked, wake one."""
        self.rlock.release()
        if self._parked and not self.rlock._is_owned():  # type: ignore[attr-defined]  # CPython RLock method typeshed omits; (an inner release of a reentrant hold wakes nobody)
            self._wake()

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def _wake(self) -> None:
        if self._gate.locked():
            try:
                self._gate.release()
            except RuntimeError:  # another thread gave the wake-up in between
                pass

    # threading.Condition's lock protocol
    def _is_owned(self) -> bool:
        return self.rlock._is_owned()  # type: ignore[attr-defined]

    def _release_save(self) -> Any:
        state = self.rlock._release_save()  # type: ignore[attr-defined]
        if self._parked:
            self._wake()
        return state

    def _acquire_restore(self, state: Any) -> None:
        if _thread.get_ident() == _main_ident:
            self.rlock._acquire_restore(state)  # type: ignore[attr-defined]
            return
        self.__enter__()
        for _ in range(state[0] - 1):  # the recursion count Condition.wait released
            self.rlock.acquire()
