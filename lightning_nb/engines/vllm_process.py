"""The vLLM server process a :class:`~lightning_nb.engines.vllm.VLLMEngine` owns: start, stop, and no orphans.

* :func:`spawn` starts the server as the leader of its own process group, with ``PR_SET_PDEATHSIG``
  (SIGTERM when the owning process dies, even by SIGKILL), forked from one long-lived thread;
* :class:`ServerState` stops the whole group (:meth:`ServerState.stop_process`) and removes the
  temporary workdir; it holds no reference to the engine, so the engine's finalizer can use it;
* :func:`make_workdir` / :func:`sweep_stale_workdirs`: temporary workdirs, marked with their owner's PID and
  start time, and removed once that owner is gone;
* :func:`log_tail` and :func:`layers_not_reloaded` read the server's log.

Linux only (``prctl`` and ``/proc``).
"""

from __future__ import annotations

import ctypes
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable, Optional, Union

from lightning_nb.errors import LightningNbError

__all__ = ["ServerState", "spawn", "pdeathsig_preexec", "group_members", "make_workdir", "sweep_stale_workdirs",
           "owner_token", "free_port", "log_tail", "layers_not_reloaded", "WORKDIR_PREFIX", "OWNER_FILE"]

#: temporary workdirs are ``$TMPDIR/lightning_nb-vllm-*``
WORKDIR_PREFIX = "lightning_nb-vllm-"
#: the file in a temporary workdir holding its owner's :func:`owner_token`
OWNER_FILE = "owner"
_PR_SET_PDEATHSIG = 1
_LOG_TAIL_LINES = 30


class ServerState:
    """What :meth:`~lightning_nb.engines.vllm.VLLMEngine.close` and its finalizer need: the server process, its
    port and the temporary workdir; holds no reference to the engine."""

    def __init__(self, tmp_workdir: Optional[Path]) -> None:
        self.proc: Optional[subprocess.Popen] = None
        self.port = 0
        self.tmp_workdir = tmp_workdir  # removed on shutdown when we created it
        self.closed = False
        self._lock = threading.Lock()

    def stop_process(self, grace_s: float = 10.0) -> None:
        """SIGTERM the server's process group, wait up to ``grace_s`` for all of it, then SIGKILL."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        pgid = proc.pid  # start_new_session: the server leads its own group
        _killpg(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            proc.poll()
            if proc.returncode is not None and not group_members(pgid):
                return
            time.sleep(0.1)
        _killpg(pgid, signal.SIGKILL)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic() + 5
        while group_members(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)

    def shutdown(self, keep_log: bool = False) -> None:
        """Stop the server process (:meth:`stop_process`) and remove the temporary workdir, all but its
        ``server.log`` with ``keep_log`` (start-up failed). Idempotent."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            self.stop_process()
            if self.tmp_workdir is not None:
                if keep_log:  # start-up failed: the error message points at server.log
                    for child in self.tmp_workdir.iterdir():
                        if child.name not in ("server.log", OWNER_FILE):  # swept once the owner is gone
                            shutil.rmtree(child, ignore_errors=True) if child.is_dir() else child.unlink(missing_ok=True)
                else:
                    shutil.rmtree(self.tmp_workdir, ignore_errors=True)


# ----- process helpers --------------------------------------------------------------------

def make_workdir(workdir: Union[os.PathLike, str, None]) -> tuple[Path, bool]:
    """``(folder, temporary)``: ``workdir`` (created if missing), or with None a new temporary folder marked
    with this process's :func:`owner_token` (stale ones of dead owners are swept first)."""
    if workdir is None:
        sweep_stale_workdirs()
        folder = Path(tempfile.mkdtemp(prefix=WORKDIR_PREFIX))
        (folder / OWNER_FILE).write_text(owner_token(os.getpid()) or "")
        return folder, True
    folder = Path(workdir)
    folder.mkdir(parents=True, exist_ok=True)
    return folder, False


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(path: Path, lines: int = _LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def owner_token(pid: int) -> Optional[str]:
    """``"PID STARTTIME"`` of a live process (start time in clock ticks since boot, so a reused PID differs)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()
    return f"{pid} {fields[19]}" if len(fields) > 19 else None


def sweep_stale_workdirs() -> list[Path]:
    """Remove temporary workdirs whose owning process is gone; returns the removed folders.

    An owner killed with SIGKILL (a kernel restart) cannot clean up: its server still
    dies (PDEATHSIG), but its exported weights (about 0.5 GB each for 135M parameters)
    stay in the temp folder until the next :class:`VLLMEngine` sweeps them.
    """
    removed = []
    for folder in Path(tempfile.gettempdir()).glob(WORKDIR_PREFIX + "*"):
        try:
            token = (folder / OWNER_FILE).read_text().strip()
        except OSError:
            continue  # being created, or not ours
        pid = token.split()[0] if token else ""
        if pid.isdigit() and owner_token(int(pid)) == token:
            continue  # owner alive
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed


def layers_not_reloaded(log_path: Path, offset: int) -> list[str]:
    """Layer classes that vLLM logged as ``<Layer>: Failed to load weights`` after byte ``offset`` of the log.

    ``RotaryEmbedding`` is left out: it has no weights (only a cos/sin cache it keeps).
    """
    try:
        with open(log_path, "rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
    except OSError:
        return []
    names = re.findall(r"\b(\w+): Failed to load weights", text)
    return sorted(set(names) - {"RotaryEmbedding"})


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def group_members(pgid: int) -> list[int]:
    """PIDs of live (not zombie) processes in process group ``pgid`` (reads /proc)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()  # after "pid (comm) "
        if len(fields) > 2 and fields[0] != "Z" and int(fields[2]) == pgid:
            pids.append(int(entry))
    return pids


def pdeathsig_preexec() -> Callable[[], None]:
    """A ``preexec_fn`` that asks the kernel for SIGTERM when the forking thread's process dies.

    ``prctl`` is resolved here, in the parent, so the child only makes the call.
    PR_SET_PDEATHSIG fires when the *thread* that forked exits, so :func:`spawn` forks
    from one daemon thread that lives as long as a server it started does.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    prctl = libc.prctl
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the owner died before prctl took effect
            os._exit(1)

    return preexec


_spawn_queue: "queue.Queue[tuple[Callable[[], Any], Future]]" = queue.Queue()
_spawn_thread: Optional[threading.Thread] = None
_spawn_lock = threading.Lock()  # held to start the spawner, to queue work for it, and by it to decide to end
_spawned: list[subprocess.Popen] = []  # servers the spawner started that may still run (their PDEATHSIG thread)
_SPAWNER_IDLE_CHECK_S = 1.0


def _spawner_loop() -> None:
    """Start the processes queued by :func:`spawn`; end once every one of them has exited and none is queued
    (checked every ``_SPAWNER_IDLE_CHECK_S`` seconds), so no thread outlives the last closed VLLMEngine."""
    global _spawn_thread
    while True:
        try:
            fn, fut = _spawn_queue.get(timeout=_SPAWNER_IDLE_CHECK_S)
        except queue.Empty:
            with _spawn_lock:
                _spawned[:] = [p for p in _spawned if p.poll() is None]
                if not _spawned and _spawn_queue.empty():
                    _spawn_thread = None
                    return
            continue
        try:
            proc = fn()
            _spawned.append(proc)
            fut.set_result(proc)
        except BaseException as exc:  # handed to the caller
            fut.set_exception(exc)


def spawn(cmd: list[str], *, env: dict[str, str], cwd: str, log_file: Any) -> subprocess.Popen:
    """Start ``cmd`` as a new session (own process group) with PDEATHSIG, from the spawner thread."""
    global _spawn_thread
    if not sys.platform.startswith("linux"):
        raise LightningNbError("VLLMEngine needs Linux (it relies on prctl(PR_SET_PDEATHSIG) and /proc)")
    preexec = pdeathsig_preexec()

    def popen() -> subprocess.Popen:
        return subprocess.Popen(cmd, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=log_file,
                                stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=preexec)

    fut: Future = Future()
    with _spawn_lock:  # queued under the lock: the spawner cannot decide to end between the check and the put
        if _spawn_thread is None or not _spawn_thread.is_alive():
            _spawn_thread = threading.Thread(target=_spawner_loop, name="lightning_nb-vllm-spawner", daemon=True)
            _spawn_thread.start()
        _spawn_queue.put((popen, fut))
    return fut.result()
