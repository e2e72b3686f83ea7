"""Why an attempt failed, said once: the failure kinds, the first-failure warnings and the unreachable-endpoint hint.

A failed attempt keeps its full error on the attempt (``store.attempts_df()``); the first failure of
each kind in a runner group also raises a ``RuntimeWarning`` (:class:`FailureNotices`), and an agent
that could not connect to the store's LLM endpoint gets one line saying so and how to publish a
restarted proxy (:func:`unreachable_endpoint_hint`). See :mod:`lightning_nb.runners.runner` for when
an attempt fails.
"""

from __future__ import annotations

from lightning_nb.types import MAIN_LLM

import logging
import threading
import warnings
from typing import Iterator, Optional
from urllib.parse import urlsplit

__all__ = ["FailureNotices", "unreachable_endpoint_hint", "first_line", "NO_REWARD_ERROR", "UNREACHABLE",
           "NO_LLM_CALL", "NO_LLM_CALL_ERROR"]

log = logging.getLogger(__name__)
UNREACHABLE = "unreachable LLM endpoint"  # the failure kind of an attempt whose LLM endpoint refused the connect
#: The error of an attempt whose agent returned None and emitted no reward span.
NO_REWARD_ERROR = ("the agent returned None and emitted no reward span; return a float reward from the agent, "
                   "or call lightning_nb.emit_reward(value) inside it")
NO_LLM_CALL = "no LLM call"  # the failure kind of an attempt whose agent declares calls_model but never called it
NO_LLM_CALL_ERROR = ("the agent returned a reward without calling the model (no LLM call reached the attempt's "
                     "llm.endpoint), and it declares calls_model=True, so the attempt is refused: nothing in it can "
                     "be trained on. Call the model through llm.endpoint (a rollout server: its server_url) before "
                     "answering, or set calls_model=False on an agent that may legitimately answer without one")


class FailureNotices:
    """Warns (``RuntimeWarning``) on the first failed attempt of each kind; shared by the runners of one group.

    The kind is the exception type name for an agent that raised, or one of
    ``"unreachable LLM endpoint"``, ``"no reward"``, ``"lost span"``, ``"timeout"``,
    ``"ConfigError"`` (no LLM resource). Later failures of a kind already warned about
    are only recorded on their attempts (``store.attempts_df()``).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.kinds: set[str] = set()

    def first(self, kind: str) -> bool:
        """True exactly once per ``kind`` (thread-safe)."""
        with self._lock:
            if kind in self.kinds:
                return False
            self.kinds.add(kind)
            return True

    def notify(self, kind: str, worker_id: str, rollout_id: str, summary: str) -> None:
        if not self.first(kind):
            return
        message = (f"lightning_nb {worker_id}: rollout {rollout_id} failed: {summary} (see store.attempts_df() "
                   f"for the full traceback; later {kind!r} failures of this runner group are not warned about)")
        try:  # the message names the rollout, so Python's once-per-location filter never hides it
            warnings.warn(message, RuntimeWarning, stacklevel=1)
        except Exception:  # warnings turned into errors: never crash the runner over a notice
            log.warning("%s", message)


def _chain(exc: Optional[BaseException]) -> Iterator[BaseException]:
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def first_line(exc: BaseException) -> str:
    """The first line of ``str(exc)`` (empty when the exception has no text)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def _host_port(url: str) -> tuple[str, Optional[int]]:
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    return (parts.hostname or "").lower(), port or {"http": 80, "https": 443}.get(parts.scheme)


def unreachable_endpoint_hint(exc: BaseException, endpoint: str, llm_resource: str = MAIN_LLM) -> Optional[str]:
    """One line saying the LLM ``endpoint`` is unreachable, when ``exc`` came from failing to connect to it; else None.

    Looks down the exception chain (``__cause__`` / ``__context__``) for a failed connect:
    ``ConnectionRefusedError``, ``socket.gaierror``, or httpx/httpcore ``ConnectError`` /
    ``ConnectTimeout`` (what ``openai.APIConnectionError`` wraps). A failed connect to another
    host (a tool's web service, a remote store) gets no hint: the URL of the failed request,
    where the chain carries one, must have the endpoint's host and port. A read timeout is
    not a failed connect.
    """
    import socket

    chain = list(_chain(exc))
    names = [{c.__name__ for c in type(e).__mro__} for e in chain]
    connect = [e for e, n in zip(chain, names)
               if isinstance(e, (ConnectionRefusedError, socket.gaierror)) or n & {"ConnectError", "ConnectTimeout"}]
    if not connect:
        return None
    for e in chain:  # the request that failed, if the chain says (openai and httpx errors carry it)
        try:
            request = getattr(e, "request", None)
        except Exception:  # httpx raises when the request is not set
            request = None
        url = getattr(request, "url", None)
        if url is not None:
            if _host_port(str(url)) != _host_port(endpoint):
                return None
            break
    if any(isinstance(e, ConnectionRefusedError) or "connection refused" in str(e).lower() for e in connect):
        reason = "connection refused"
    elif any("ConnectTimeout" in n for n in names):
        reason = "no answer to the connect (timed out)"
    elif any(isinstance(e, socket.gaierror) for e in chain):
        reason = "host name not resolved"
    else:
        reason = f"{type(connect[-1]).__name__}: {first_line(connect[-1])}"
    return (f"the LLM endpoint {endpoint} in the store's resources is unreachable ({reason}); if the proxy was "
            f"restarted (e.g. after a kernel restart), publish it again with "
            f"store.add_resources({{'{llm_resource}': proxy.as_resource()}})")
