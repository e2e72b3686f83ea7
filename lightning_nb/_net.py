"""Network helpers shared by the servers (LLM proxy, store server)."""

from __future__ import annotations

import ipaddress
import logging
import threading
import time
from typing import Any

from lightning_nb.errors import LightningNbError

__all__ = ["is_loopback", "ThreadedServer"]

log = logging.getLogger(__name__)


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8, ::1): reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ThreadedServer:
    """uvicorn serving an ASGI ``app`` in a daemon thread (so a notebook cell returns at once).

    Args:
        app: the ASGI application.
        host / port: bind address; port 0 picks a free port (read it from :meth:`start`).
        name: thread name and what error messages call the server.
        **options: extra ``uvicorn.Config`` options.
    """

    def __init__(self, app: Any, host: str, port: int, name: str, **options: Any) -> None:
        import uvicorn

        config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off", **options)
        self.server = uvicorn.Server(config)
        self.name, self.host, self.port = name, host, port
        self.thread = threading.Thread(target=self.server.run, name=f"lightning_nb-{name}", daemon=True)

    def start(self, timeout: float = 30.0) -> int:
        """Start and wait until the socket is bound; returns the port.

        Raises:
            LightningNbError: the server did not start (e.g. the port is taken).
        """
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise LightningNbError(f"{self.name} failed to start on {self.host}:{self.port}")
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self.port

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the server to exit and wait up to ``timeout`` seconds for its thread (in-flight requests finish
        first); then its port is closed. ``timeout=0``, or a call from the server's own thread (a finalizer
        the garbage collector runs there), only asks."""
        self.server.should_exit = True
        if timeout and self.thread is not threading.current_thread() and self.thread.ident is not None:
            self.thread.join(timeout)
            if self.thread.is_alive():
                log.warning("%s on %s:%s did not stop within %.0f s (a request still running?)", self.name,
                            self.host, self.port, timeout)
