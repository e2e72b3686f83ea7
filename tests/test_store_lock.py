"""RunningThreadLock, the InMemoryStore's lock: a lock, reentrant, usable by threading.Condition, and under
contention only taken by a thread that runs (no hand-over to a parked thread that has not got the GIL back)."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from lightning_nb.store import InMemoryStore
from lightning_nb.store.memory.locks import PARK_S, RunningThreadLock


def _in_thread(fn, *args):
    """Run ``fn`` in a new thread; returns (thread, result list, error list)."""
    result, errors = [], []

    def target():
        try:
            result.append(fn(*args))
        except BaseException as exc:  # reported by the test
            errors.append(exc)

    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t, result, errors


def _wait_until(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def test_the_main_thread_uses_the_c_rlock_and_other_threads_the_parking_lock():
    lock = RunningThreadLock()
    assert lock.for_this_thread() is lock.rlock
    t, result, errors = _in_thread(lock.for_this_thread)
    t.join()
    assert not errors and result == [lock]
    store = InMemoryStore()
    try:
        assert store._lock is store._locks.rlock
    finally:
        store.close()


def test_mutual_exclusion_and_reentry_across_many_threads():
    lock, box, n, per = RunningThreadLock(), {"v": 0}, 12, 400
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads as often as possible, inside the locked sections too
    try:
        def work():
            for i in range(per):
                with lock.for_this_thread():
                    with lock.for_this_thread():  # reentrant
                        v = box["v"]
                        if i % 7 == 0:
                            time.sleep(0)  # give the GIL away while holding the lock
                        box["v"] = v + 1

        threads = [_in_thread(work) for _ in range(n)]
        work()  # the main thread too (the C RLock path, same ownership)
        for t, _, errors in threads:
            t.join()
            assert not errors
    finally:
        sys.setswitchinterval(old)
    assert box["v"] == (n + 1) * per  # a lost update would show here
    assert lock.acquire(False) and lock._is_owned()
    lock.release()
    with pytest.raises(RuntimeError):
        lock.release()  # not owned any more


def test_a_released_lock_is_not_handed_to_a_parked_thread_that_is_not_running():
    """The convoy this lock exists to prevent: with a plain RLock the parked thread, woken inside the kernel,
    owns the lock before it has the GIL, so the releasing thread's next acquire fails."""
    lock = RunningThreadLock()
    holding, parked_taken = threading.Event(), []

    def waiter():
        holding.wait()
        with lock:  # parks: the lock is held by the owner thread
            parked_taken.append(time.monotonic())

    def owner():
        with lock:
            holding.set()
            _wait_until(lambda: lock._parked)  # the waiter is parked
        # released: the waiter is woken, but it needs the GIL, which this thread keeps (long switch interval)
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 0.02:  # 20 ms of pure Python; a woken kernel waiter would take the lock
            pass
        again = lock.acquire(False)
        if again:
            lock.release()
        return again

    old = sys.getswitchinterval()
    sys.setswitchinterval(1.0)
    try:
        tw, _, werr = _in_thread(waiter)
        to, result, oerr = _in_thread(owner)
        to.join(10)
    finally:
        sys.setswitchinterval(old)
    tw.join(10)
    assert not werr and not oerr
    assert result == [True]  # the running thread took the free lock again at once
    assert parked_taken, "the parked thread never got the lock after the owner released it"


def test_a_condition_on_the_lock_waits_and_restores_the_recursion_count():
    lock = RunningThreadLock()
    cond = threading.Condition(lock)
    state = {"ready": False}

    def waiter():
        with lock:
            with lock:  # held twice while waiting
                assert cond.wait_for(lambda: state["ready"], timeout=10)
                assert lock._is_owned()
            assert lock._is_owned()  # one level left after the inner with
        return lock._is_owned()

    t, result, errors = _in_thread(waiter)
    _wait_until(lambda: lock.acquire(False) and (lock.release() or True))  # free: the waiter is in wait()
    time.sleep(0.05)
    with lock.for_this_thread():  # the main thread's C path notifies
        state["ready"] = True
        cond.notify_all()
    t.join(10)
    assert not errors and result == [False]


def test_a_thread_parked_behind_the_main_threads_c_release_is_not_stranded():
    """The main thread's release is the C RLock's and wakes no parked thread; the parked one retries within PARK_S."""
    lock = RunningThreadLock()
    with lock.for_this_thread():
        t, result, errors = _in_thread(lambda: lock.acquire() and (lock.release() or time.monotonic()))
        _wait_until(lambda: lock._parked)
        released = time.monotonic()
    t.join(10)
    assert not errors and result
    assert result[0] - released < 1.0  # (PARK_S is 2 ms; a stranded thread would never return)
    assert PARK_S < 0.1


def test_acquire_with_a_timeout_gives_up_and_the_lock_still_works():
    lock = RunningThreadLock()
    with lock.for_this_thread():
        t, result, errors = _in_thread(lambda: lock.acquire(True, 0.05))
        t.join(10)
        assert not errors and result == [False]
        t, result, errors = _in_thread(lambda: lock.acquire(False))
        t.join(10)
        assert result == [False]
    t, result, errors = _in_thread(lambda: lock.acquire(True, 5) and (lock.release() or True))
    t.join(10)
    assert not errors and result == [True]
    assert not lock._parked


def test_a_release_wakes_a_parked_thread_without_waiting_for_its_retry(monkeypatch):
    """A release in a non-main thread wakes one parked thread at once (PARK_S, the retry period, made 30 s)."""
    from lightning_nb.store.memory import locks

    monkeypatch.setattr(locks, "PARK_S", 30.0)
    lock, go = RunningThreadLock(), threading.Event()

    def owner():
        with lock:
            go.set()
            _wait_until(lambda: lock._parked)
        return time.monotonic()

    to, released, oerr = _in_thread(owner)
    go.wait(10)
    tw, taken, werr = _in_thread(lambda: lock.acquire() and (lock.release() or time.monotonic()))
    tw.join(10)
    to.join(10)
    assert not oerr and not werr and released and taken
    assert taken[0] - released[0] < 5.0  # woken by the release, not by its 30 s retry
