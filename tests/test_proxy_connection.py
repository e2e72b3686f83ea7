"""A connection the engine's server drops without a reply (a stale keep-alive connection) costs no rollout.

The engine here is a plain HTTP peer on a socket that closes the first ``drop`` connections after reading the
request, as uvicorn does with a keep-alive connection idle past its timeout, then answers an OpenAI chat
completion. The proxy, LiteLLM and its aiohttp transport are the real ones.
"""

from __future__ import annotations

import json
import socket
import threading

import openai

from lightning_nb import semconv
from lightning_nb.engines import OpenAIEndpoint
from lightning_nb.proxy import LLMProxy
from lightning_nb.store import InMemoryStore

REPLY = json.dumps({"id": "c1", "object": "chat.completion", "created": 0, "model": "m",
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": "42"},
                                 "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}).encode()


class DroppingServer:
    """Accepts connections on 127.0.0.1; closes the first ``drop`` after reading a request, answers the rest."""

    def __init__(self, drop: int) -> None:
        self.drop, self.connections = drop, 0
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/v1"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                self.connections += 1
                _read_request(conn)  # all of it: closing with unread bytes would reset the connection
                if self.connections <= self.drop:
                    continue  # closed without a byte of reply
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                             b"Content-Length: %d\r\n\r\n" % len(REPLY) + REPLY)

    def close(self) -> None:
        self.sock.close()


def _read_request(conn: socket.socket) -> bytes:
    """One HTTP request from ``conn``: its headers, then ``Content-Length`` bytes of body."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    while len(body) < length:
        chunk = conn.recv(65536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


def _call(server: DroppingServer) -> tuple[object, list]:
    """One chat call through the proxy to ``server``: ``(reply or the openai error raised, the attempt's spans)``."""
    store = InMemoryStore()
    rollout = store.enqueue_rollout("t")
    aid = store.dequeue_rollout().attempt.attempt_id
    with LLMProxy(OpenAIEndpoint(server.url, "m", returns_token_ids=False), store) as proxy:
        client = openai.OpenAI(base_url=proxy.endpoint(rollout.rollout_id, aid), api_key="x", max_retries=0)
        try:
            reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "6 * 7?"}])
        except openai.APIStatusError as exc:
            reply = exc
    server.close()
    return reply, store.query_spans(rollout.rollout_id)


def test_a_connection_dropped_before_the_reply_is_sent_again_once():
    server = DroppingServer(drop=1)
    reply, spans = _call(server)
    assert not isinstance(reply, Exception), reply
    assert reply.choices[0].message.content == "42" and server.connections == 2
    (span,) = spans  # one call, one span: the dropped try left nothing behind
    assert semconv.ERROR not in span.attributes


def test_a_server_that_keeps_dropping_is_a_502_after_one_more_try():
    server = DroppingServer(drop=10)
    error, spans = _call(server)
    assert isinstance(error, openai.APIStatusError) and error.status_code == 502
    assert "Server disconnected" in str(error)
    assert server.connections == 2  # sent twice, not retried without end
    (span,) = spans
    assert "Server disconnected" in span.attributes[semconv.ERROR]
