"""The HTTP transport of :class:`~lightning_nb.store.http.client.StoreClient`: libcurl, through pycurl.

A small pool of libcurl easy handles, each keeping its connection to the server alive between
requests (libcurl checks an idle connection before it reuses it and opens a fresh one when the
server has closed it). A request takes an idle handle, or makes one when all are busy, and
puts it back when done, so the threads of a process share connections as they would through
urllib3's pool, at about a third of urllib3's client CPU per request (39–42 against 131 µs per
small request on the dev VM: libcurl parses and sends in C).

libcurl settings that differ from its defaults: no proxy from the environment (``http_proxy``
and friends; the server is named by its URL, as with urllib3's connection pool), no signals
(thread-safe timeouts), no ``Expect: 100-continue`` round trip before a large body, no redirects;
``https://`` servers' certificates are verified against certifi's bundle when it is installed,
else libcurl's own.
"""

from __future__ import annotations

import threading
import time
from typing import Optional

import pycurl

__all__ = ["CurlTransport", "TransportError"]

# libcurl errors where nothing was sent: the request may be tried again on a fresh connection
_CONNECT_ERRORS = frozenset({pycurl.E_COULDNT_RESOLVE_HOST, pycurl.E_COULDNT_CONNECT})


class TransportError(Exception):
    """The server could not be reached or the exchange broke off (libcurl's error code and message)."""


class CurlTransport:
    """Send HTTP requests to one server with pooled libcurl handles; thread-safe.

    Args:
        base_url: ``http(s)://host:port[/prefix]``; request targets are appended to it.
        headers: ``"Name: value"`` header lines sent with every request.
        connect_retries: further tries of a request whose connection could not be opened
            (nothing was sent), after ``backoff_s``, then twice that, and so on.
        backoff_s: seconds before the first retry.
        max_idle: handles kept for reuse at most (more threads than this open extra ones,
            closed after their request).
    """

    def __init__(self, base_url: str, headers: list[str], *, connect_retries: int = 2, backoff_s: float = 0.5,
                 max_idle: int = 32) -> None:
        self.base_url = base_url
        self._get_headers = [*headers, "Expect:"]
        self._body_headers = [*self._get_headers, "Content-Type: application/json"]
        self.connect_retries, self.backoff_s, self.max_idle = connect_retries, backoff_s, max_idle
        self._idle: list[pycurl.Curl] = []  # list.pop/append are atomic: no lock on the request path
        self._closed = False
        self._lock = threading.Lock()  # close() only
        self._cainfo: Optional[str] = None
        if base_url.startswith("https://"):
            try:
                import certifi

                self._cainfo = certifi.where()
            except ImportError:  # libcurl's own bundle
                pass

    def _handle(self) -> pycurl.Curl:
        try:
            return self._idle.pop()
        except IndexError:
            pass
        c = pycurl.Curl()
        c.setopt(pycurl.NOSIGNAL, 1)
        c.setopt(pycurl.PROXY, "")  # never a proxy from the environment
        c.setopt(pycurl.FOLLOWLOCATION, 0)
        c.setopt(pycurl.TCP_NODELAY, 1)
        c.setopt(pycurl.USERAGENT, "lightning-nb")  # not libcurl's (~200 bytes naming every library it links)
        if self._cainfo is not None:
            c.setopt(pycurl.CAINFO, self._cainfo)
        return c

    def request(self, method: str, target: str, body: Optional[bytes], timeout_s: float) -> tuple[int, bytes]:
        """Send one request and read the whole response.

        Args:
            method: ``GET``, ``POST``, ``PATCH``, ...
            target: the path and query, appended to ``base_url``.
            body: a JSON body (sent with ``Content-Type: application/json``), or None.
            timeout_s: seconds for the whole exchange (connect included).

        Returns:
            ``(HTTP status, response body)``.

        Raises:
            TransportError: closed, could not connect after the retries, timed out, or the
                connection broke (a request that may have been sent is not retried).
        """
        if self._closed:
            raise TransportError("the transport is closed")
        chunks: list[bytes] = []
        c = self._handle()
        try:
            c.setopt(pycurl.URL, self.base_url + target)
            if body is None:
                c.setopt(pycurl.HTTPGET, 1)
                c.setopt(pycurl.HTTPHEADER, self._get_headers)
            else:
                c.setopt(pycurl.POSTFIELDS, body)
                c.setopt(pycurl.HTTPHEADER, self._body_headers)
            c.setopt(pycurl.CUSTOMREQUEST, method)
            c.setopt(pycurl.TIMEOUT_MS, max(1, int(timeout_s * 1000)))
            c.setopt(pycurl.WRITEFUNCTION, chunks.append)
            for retry in range(self.connect_retries + 1):
                try:
                    c.perform()
                    break
                except pycurl.error as exc:
                    code = exc.args[0] if exc.args else None
                    if code in _CONNECT_ERRORS and retry < self.connect_retries and not self._closed:
                        time.sleep(self.backoff_s * 2 ** retry)
                        continue
                    raise TransportError(f"libcurl error {code}: {exc.args[1] if len(exc.args) > 1 else exc}") \
                        from None
            return c.getinfo(pycurl.RESPONSE_CODE), b"".join(chunks)
        finally:
            c.setopt(pycurl.WRITEFUNCTION, _discard)  # drop the reference to this call's chunks
            if self._closed or len(self._idle) >= self.max_idle:
                c.close()
            else:
                self._idle.append(c)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (every later request raises TransportError)."""
        return self._closed

    def close(self) -> None:
        """Close the idle handles and their connections; handles in use close when their request ends."""
        with self._lock:
            self._closed = True
            while self._idle:
                self._idle.pop().close()


def _discard(data: bytes) -> None:
    return None
