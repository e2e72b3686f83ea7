"""StoreClient's keep-alive connections (lightning_nb/store/http/client.py over lightning_nb/store/http/curl.py, libcurl
handles in a pool): shared by threads, replaced when the server closed one while idle, connect errors retried, no
environment proxy, and no call goes out after close()."""

from __future__ import annotations

import threading

import pytest

from lightning_nb.store import InMemoryStore, StoreClient, StoreServer
from lightning_nb.errors import ConfigError
from lightning_nb.store.http.client import StoreConnectionError


def test_a_connection_the_server_closed_while_idle_is_replaced_before_the_next_call():
    first = StoreServer(InMemoryStore()).start()
    port = first.port
    client = StoreClient(first.url)
    assert client.enqueue_rollout("a").status == "queuing"  # opens this thread's connection
    first.stop()  # closes it from the server's side
    second = StoreServer(InMemoryStore(), port=port).start()  # a new server on the same address
    try:
        assert client.enqueue_rollout("b").input == "b"  # not a StoreConnectionError: a fresh connection
        assert [r.input for r in second.store.query_rollouts()] == ["b"]
    finally:
        client.close()
        second.stop()


def test_threads_share_one_client_and_close_refuses_later_calls():
    with StoreServer(InMemoryStore()) as server:
        client = StoreClient(server.url)
        errors = []

        def use(k):
            try:
                for i in range(20):
                    client.enqueue_rollout(f"{k}-{i}")
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=use, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == [] and len(server.store.query_rollouts()) == 80
        client.close()
        with pytest.raises(StoreConnectionError, match="closed"):
            client.enqueue_rollout("late")
        assert len(server.store.query_rollouts()) == 80  # nothing was sent


def test_enqueue_rollouts_is_one_request_and_an_input_json_cannot_carry_sends_nothing():
    class Counting(InMemoryStore):
        batches = 0

        def enqueue_rollouts(self, inputs, **kwargs):
            type(self).batches += 1
            return super().enqueue_rollouts(inputs, **kwargs)

    inner = Counting()
    with StoreServer(inner, port=0) as server, StoreClient(server.url) as client:
        out = client.enqueue_rollouts(["a", {"b": [1, 2]}, 3], metadata={"group_id": "g"})
        assert Counting.batches == 1 and [r.input for r in out] == ["a", {"b": [1, 2]}, 3]
        assert [r.rollout_id for r in inner.query_rollouts()] == [r.rollout_id for r in out]
        with pytest.raises(ConfigError, match=r"inputs\[1\]"):
            client.enqueue_rollouts(["ok", object()])
        assert Counting.batches == 1 and len(inner.query_rollouts()) == 3


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_refused_connection_is_tried_again_and_then_named_with_the_url():
    port = _free_port()
    client = StoreClient(f"http://127.0.0.1:{port}")
    started = []

    def start_late():  # the server comes up between the first try and the retry (0.5 s later)
        import time

        time.sleep(0.2)
        started.append(StoreServer(InMemoryStore(), port=port).start())

    late = threading.Thread(target=start_late)
    late.start()
    try:
        assert client.enqueue_rollout("a").input == "a"
        late.join()
        assert [r.input for r in started[0].store.query_rollouts()] == ["a"]
    finally:
        late.join()
        for server in started:
            server.stop()
    with pytest.raises(StoreConnectionError, match=rf"127\.0\.0\.1:{port} did not answer POST /rollouts: .*"
                                                   r"is the StoreServer running\?"):
        client.enqueue_rollout("b")  # nothing listens any more: three tries, then the error
    client.close()


def test_no_proxy_from_the_environment_is_used(monkeypatch):
    with StoreServer(InMemoryStore()) as server:
        for name in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
            monkeypatch.setenv(name, "http://127.0.0.1:9")  # nothing listens there
        for name in ("no_proxy", "NO_PROXY"):
            monkeypatch.delenv(name, raising=False)
        with StoreClient(server.url) as client:
            assert client.enqueue_rollout("a").input == "a"


def _finished_otel_spans(names):
    from opentelemetry.sdk.trace import TracerProvider

    tracer = TracerProvider().get_tracer("test")
    spans = []
    for name in names:
        span = tracer.start_span(name, attributes={"step": len(spans), "ids": (1, 2)})
        span.end()
        spans.append(span)
    return spans


def test_add_otel_spans_is_one_request_answered_with_sequence_ids_only():
    class Counting(InMemoryStore):
        calls = []

        def add_spans(self, spans):
            type(self).calls.append(len(spans))
            return super().add_spans(spans)

    with StoreServer(Counting()) as server, StoreClient(server.url) as client:
        item = client.start_rollout("task", worker_id="w")
        rid, aid = item.rollout.rollout_id, item.attempt.attempt_id
        spans = _finished_otel_spans(["a", "b", "c"])
        sent, request = [], client._request

        def recorded(method, path, **kwargs):
            sent.append((method, path, request(method, path, **kwargs)))
            return sent[-1][2]

        client._request = recorded
        assert client.add_otel_spans(rid, aid, spans) == [1, 2, 3]
        assert sent == [("POST", "/spans/batch?reply=sequence_ids", [1, 2, 3])]  # the answer: ids, no spans
        assert Counting.calls == [3]  # one request, one add_spans
        stored = client.query_spans(rid, aid)
        assert [(s.name, s.sequence_id, s.attributes) for s in stored] == [
            ("a", 1, {"step": 0, "ids": [1, 2]}), ("b", 2, {"step": 1, "ids": [1, 2]}),
            ("c", 3, {"step": 2, "ids": [1, 2]})]
        # a repeat of a stored span answers the stored one's sequence id; a new one the next
        assert client.add_otel_spans(rid, aid, [spans[1], *_finished_otel_spans(["d"])]) == [2, 4]
        assert client.add_otel_spans(rid, aid, []) == []
        with pytest.raises(ConfigError, match=r"spans\[0\]"):
            client.add_otel_spans(rid, aid, ["not a span"])
        with pytest.raises(ConfigError, match="attempt_id"):
            client.add_otel_spans(rid, 7, spans)


def test_the_span_batch_route_names_a_wrong_reply_value():
    import json
    import urllib.request

    with StoreServer(InMemoryStore()) as server:
        request = urllib.request.Request(server.url + "/spans/batch?reply=ids", data=b"[]", method="POST",
                                         headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(request, timeout=10)
        assert info.value.code == 400
        error = json.loads(info.value.read())["error"]
        assert error["field"] == "reply" and "sequence_ids" in error["message"]
