"""StoreClient's keep-alive connections (lightning_nb/store/client.py, urllib3's pool): shared by threads, replaced
when the server closed one while idle, and no call goes out after close()."""

from __future__ import annotations

import threading

import pytest

from lightning_nb.store import InMemoryStore, StoreClient, StoreServer
from lightning_nb.errors import ConfigError
from lightning_nb.store.client import StoreConnectionError


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
