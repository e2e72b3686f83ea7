"""StoreServer/StoreClient specifics: auth, malformed requests, body cap, bounded waits, concurrency, fuzz.

The contract itself runs through the client as the "http" backend (conftest.STORE_BACKENDS).
"""

from __future__ import annotations

import json
import socket
import threading
import time
import typing

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_nb.errors import ConfigError, NotFoundError
from lightning_nb.store import InMemoryStore, StoreClient, StoreServer
from lightning_nb.store.http.client import StoreConnectionError
from lightning_nb.store.http.server import DEFAULT_MAX_BODY_BYTES
from lightning_nb.types import ATTEMPT_TERMINAL, AttemptStatus, RolloutConfig, Span

TOKEN = "s3cret-token"


def _span_body(rid, aid, **attrs):
    return {"rollout_id": rid, "attempt_id": aid, "trace_id": "t" * 32, "span_id": "s" * 16, "name": "x",
            "start_time": 1.0, "end_time": 2.0, "attributes": attrs}


def _snapshot(store):
    """Everything the store holds, as comparable JSON text."""
    state = {
        "rollouts": [r.model_dump() for r in store.query_rollouts()],
        "attempts": [a.model_dump() for a in store.query_attempts()],
        "spans": [s.model_dump() for s in store.query_spans()],
        "latest": (lambda r: r and r.model_dump())(store.get_latest_resources()),
    }
    return json.dumps(state, allow_nan=True, default=str)


@pytest.fixture
def served():
    """(server, backing store, raw httpx client, a rollout id and its running attempt id)."""
    store = InMemoryStore()
    store.add_resources({"main_llm": {"endpoint": "http://127.0.0.1:9/v1", "model": "m"}}, resources_id="res-1")
    rid = store.enqueue_rollout("t").rollout_id
    aid = store.dequeue_rollout("w").attempt.attempt_id
    store.update_attempt(rid, aid, status="running")
    with StoreServer(store) as server, httpx.Client(base_url=server.url, timeout=10) as http:
        yield server, store, http, rid, aid


# ----- security ---------------------------------------------------------------------------
@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.0.2.10"])
def test_non_loopback_host_without_token_is_refused(host):
    with pytest.raises(ConfigError, match="token"):
        StoreServer(InMemoryStore(), host=host)


def test_token_required_on_every_request_when_bound_to_all_interfaces():
    store = InMemoryStore()
    with StoreServer(store, host="0.0.0.0", token=TOKEN) as server:
        base = f"http://127.0.0.1:{server.port}"  # bound to all interfaces, but only talk to loopback
        assert server.url == base
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
            for method, path in (("GET", "/health"), ("POST", "/rollouts"), ("GET", "/rollouts")):
                r = httpx.request(method, base + path, headers=headers, json={"input": 1})
                assert r.status_code == 401
                assert r.json()["error"]["field"] == "token"
        assert store.query_rollouts() == []
        ok = httpx.get(base + "/health", headers={"Authorization": f"Bearer {TOKEN}"})
        assert ok.status_code == 200 and ok.json()["status"] == "ok"
        with StoreClient(base, token="wrong") as bad, pytest.raises(ConfigError, match="bearer token"):
            bad.enqueue_rollout("x")
        with StoreClient(base, token=TOKEN) as client:
            rid = client.enqueue_rollout({"q": 1}).rollout_id
            assert client.dequeue_rollout("w").rollout.rollout_id == rid
        assert [r.rollout_id for r in store.query_rollouts()] == [rid]


def test_a_client_tells_its_token_so_another_client_can_connect_with_it():
    store = InMemoryStore()
    with StoreServer(store, host="0.0.0.0", token=TOKEN) as server:
        base = f"http://127.0.0.1:{server.port}"
        with StoreClient(base, token=TOKEN) as client:
            assert client.token == TOKEN
            with pytest.raises(AttributeError):
                client.token = "other"  # read-only
            with StoreClient(client.url, token=client.token) as twin:  # e.g. a Ray actor's client
                rid = twin.enqueue_rollout("x").rollout_id
            assert [r.rollout_id for r in client.query_rollouts()] == [rid]
        for no_token in (None, ""):
            with StoreClient(base, token=no_token) as anonymous:
                assert anonymous.token is None  # it sends no Authorization header...
                with pytest.raises(ConfigError, match="bearer token"):  # ...so this server refuses it
                    anonymous.query_rollouts()


def test_a_stopped_server_does_not_keep_its_store_alive():
    import gc
    import weakref

    store = InMemoryStore()
    with StoreServer(store) as server, StoreClient(server.url) as client:
        client.enqueue_rollout("x")  # every route has been resolved by FastAPI at least once (its caches)
        client.query_rollouts()
    gone = weakref.ref(store)
    del store, server, client
    gc.collect()
    assert gone() is None


def test_loopback_needs_no_token_and_health_reports_limits():
    with StoreServer(InMemoryStore()) as server:
        assert server.url.startswith("http://127.0.0.1:") and server.port > 0
        body = httpx.get(server.url + "/health").json()
        assert body["store"] == "InMemoryStore" and body["max_body_bytes"] == DEFAULT_MAX_BODY_BYTES


# ----- malformed requests -------------------------------------------------------------------
NAN_TIMEOUT = b'{"timeout": NaN}'
MALFORMED = [
    # (method, path, JSON body or raw bytes, status, field)
    ("POST", "/rollouts", {"mode": "train"}, 400, "input"),
    ("POST", "/rollouts", {"input": 1, "mode": "bogus"}, 400, "mode"),
    ("POST", "/rollouts", {"input": 1, "config": {"max_attempts": 0}}, 400, "config.max_attempts"),
    ("POST", "/rollouts", {"input": 1, "config": {"max_attempts": "many"}}, 400, "config.max_attempts"),
    ("POST", "/rollouts", {"input": 1, "metadata": [1, 2]}, 400, "metadata"),
    ("POST", "/rollouts", {"input": 1, "surprise": True}, 400, "surprise"),
    ("POST", "/rollouts", {"input": 1, "resources_id": "res-missing"}, 404, "resources_id"),
    ("POST", "/rollouts", [1, 2], 400, "body"),
    ("POST", "/rollouts", b'{"input": 1,', 400, "body"),
    ("POST", "/rollouts", b"", 400, "body"),
    ("POST", "/rollouts/dequeue", {"timeout": "soon"}, 400, "timeout"),
    ("POST", "/rollouts/dequeue", NAN_TIMEOUT, 400, "timeout"),
    ("POST", "/rollouts/wait", {}, 400, "rollout_ids"),
    ("POST", "/rollouts/wait", {"rollout_ids": ["ro-missing"], "timeout": 0}, 404, "rollout_id"),
    ("POST", "/rollouts/query", {"status": "running"}, 400, "status"),
    ("GET", "/rollouts/ro-missing", None, 404, "rollout_id"),
    ("POST", "/rollouts/ro-missing/cancel", None, 404, "rollout_id"),
    ("PATCH", "/rollouts/{rid}/attempts/{aid}", {"status": "done"}, 400, "status"),
    ("PATCH", "/rollouts/{rid}/attempts/{aid}", {"heartbeat": "yes please"}, 400, "heartbeat"),
    ("PATCH", "/rollouts/{rid}/attempts/{aid}", {"status": "preparing"}, 409, "status"),
    ("PATCH", "/rollouts/{rid}/attempts/at-missing", {"status": "failed"}, 404, "attempt_id"),
    ("PATCH", "/rollouts/ro-missing/attempts/{aid}", {"status": "failed"}, 404, "rollout_id"),
    ("GET", "/attempts?rollout_id=ro-missing", None, 404, "rollout_id"),
    ("POST", "/spans", {"rollout_id": "{rid}", "attempt_id": "{aid}", "name": "x"}, 400, "trace_id"),
    ("POST", "/spans", {**_span_body("{rid}", "{aid}"), "start_time": "yesterday"}, 400, "start_time"),
    ("POST", "/spans", _span_body("{rid}", "at-missing"), 404, "attempt_id"),
    ("GET", "/spans?attempt_id=at-1", None, 400, "attempt_id"),
    # the hot routes (plain Starlette routes, store/http/hot.py) answer as the FastAPI ones did
    ("POST", "/rollouts/dequeue", b"worker", 400, "body"),
    ("POST", "/rollouts/dequeue", b"", 400, "body"),
    ("PATCH", "/rollouts/{rid}/attempts/{aid}", [1], 400, "body"),
    ("PATCH", "/rollouts/{rid}/attempts/{aid}", {"status": "failed", "eror": "typo"}, 400, "eror"),
    ("POST", "/spans/batch", {"spans": []}, 400, "body"),
    ("POST", "/spans/batch", [{**_span_body("{rid}", "{aid}"), "start_time": "yesterday"}], 400, "0.start_time"),
    ("POST", "/spans/batch", [_span_body("{rid}", "{aid}"), _span_body("{rid}", "at-missing")], 404, "attempt_id"),
    ("POST", "/rollouts/wait", {"rollout_ids": "ro-1"}, 400, "rollout_ids"),
    ("POST", "/resources", {"resources": {"main_llm": 42}}, 400, "resources"),
    ("POST", "/resources", {"resources": {}}, 400, "resources"),
    ("POST", "/resources", {"resources": {"main_llm": {"endpoint": 5, "model": "m"}}}, 400, "endpoint"),
    ("GET", "/resources/res-missing", None, 404, "resources_id"),
    ("GET", "/no/such/endpoint", None, 404, "path"),
]


@pytest.mark.parametrize("method,path,body,status,field", MALFORMED)
def test_malformed_requests_name_the_field_and_change_nothing(served, method, path, body, status, field):
    server, store, http, rid, aid = served
    before = _snapshot(store)
    path = path.format(rid=rid, aid=aid)
    if isinstance(body, bytes):
        r = http.request(method, path, content=body, headers={"Content-Type": "application/json"})
    else:
        body = json.loads(json.dumps(body).replace("{rid}", rid).replace("{aid}", aid)) if body is not None else None
        r = http.request(method, path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["field"] == field and err["message"] and err["type"]
    if status == 404 and field != "path":
        assert "missing" in err["message"]  # the unknown id is named
    assert _snapshot(store) == before


HOT = [("POST", "/rollouts", {"input": 1}), ("POST", "/rollouts/dequeue", {"worker_id": "w"}),
       ("POST", "/rollouts/wait", {"rollout_ids": ["{rid}"], "timeout": 0}),
       ("PATCH", "/rollouts/{rid}/attempts/{aid}", {"status": "succeeded"}),
       ("POST", "/spans", _span_body("{rid}", "{aid}")), ("POST", "/spans/batch", [_span_body("{rid}", "{aid}")]),
       ("GET", "/spans?rollout_id={rid}", None), ("GET", "/resources/latest", None)]


def test_hot_routes_need_the_token_and_refuse_bodies_that_are_not_json():
    store = InMemoryStore()
    store.add_resources({"main_llm": {"endpoint": "http://127.0.0.1:9/v1", "model": "m"}})
    rid = store.enqueue_rollout("t").rollout_id
    aid = store.dequeue_rollout("w").attempt.attempt_id
    with StoreServer(store, host="0.0.0.0", token=TOKEN) as server, httpx.Client(timeout=10) as http:
        base = f"http://127.0.0.1:{server.port}"
        before = _snapshot(store)
        for method, path, body in HOT:
            url = base + path.format(rid=rid, aid=aid)
            body = None if body is None else json.loads(json.dumps(body).replace("{rid}", rid).replace("{aid}", aid))
            r = http.request(method, url, json=body)
            assert r.status_code == 401 and r.json()["error"]["field"] == "token", (path, r.text)
            if body is not None:  # JSON sent as another content type: refused, as FastAPI refused it
                r = http.request(method, url, content=json.dumps(body).encode(),
                                 headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "text/plain"})
                assert r.status_code == 400 and r.json()["error"]["field"] == "body", (path, r.text)
                assert "Content-Type" in r.json()["error"]["message"]
        assert _snapshot(store) == before
        r = http.delete(base + "/spans/batch", headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 405 and r.json()["error"]["type"] == "ConfigError"
        ok = http.get(base + f"/spans?rollout_id={rid}", headers={"Authorization": f"Bearer {TOKEN}"})
        assert ok.status_code == 200 and ok.json() == []


def test_hot_routes_read_what_only_the_standard_librarys_json_reader_reads(served):
    server, store, http, rid, aid = served
    # an escaped lone surrogate (the client sends one this way) is refused by pydantic's JSON parser: read again
    body = json.dumps([_span_body(rid, aid, text="\udc80 half a pair", x=float("nan"))]).encode()
    assert b"\\udc80" in body and b"NaN" in body
    r = http.post("/spans/batch", content=body, headers={"Content-Type": "application/json; charset=utf-8"})
    assert r.status_code == 200, r.text
    (span,) = store.query_spans(rid)
    assert span.attributes["text"] == "\udc80 half a pair" and span.attributes["x"] != span.attributes["x"]
    with StoreClient(server.url) as client:
        (back,) = client.query_spans(rid)
    assert back.attributes["text"] == "\udc80 half a pair"


def test_client_rebuilds_the_servers_exceptions(served):
    server, store, http, rid, aid = served
    with StoreClient(server.url) as client:
        with pytest.raises(NotFoundError, match="ro-missing") as info:
            client.get_rollout_by_id("ro-missing")
        assert str(info.value) == str(pytest.raises(NotFoundError, store.get_rollout_by_id, "ro-missing").value)
        with pytest.raises(ConfigError, match="input cannot be sent as JSON"):
            client.enqueue_rollout(object())
        with pytest.raises(NotFoundError, match="ro/with/slashes"):
            client.get_rollout_by_id("ro/with/slashes")
        # a user-chosen resources id may be anything, even "latest"
        client.add_resources({"main_llm": {"endpoint": "http://127.0.0.1:1/v1", "model": "m"}}, "a/b")
        client.add_resources({"main_llm": {"endpoint": "http://127.0.0.1:2/v1", "model": "m"}}, "latest")
        client.add_resources({"main_llm": {"endpoint": "http://127.0.0.1:3/v1", "model": "m"}}, "z")
        assert client.get_resources_by_id("a/b").resources["main_llm"].endpoint.endswith(":1/v1")
        assert client.get_resources_by_id("latest").resources["main_llm"].endpoint.endswith(":2/v1")
        assert client.get_latest_resources().resources_id == "z"
        span = client.add_span(Span.model_validate(_span_body(rid, aid, x=float("nan"), big=10**30, t=(1, 2))))
        assert json.dumps(span.attributes) == '{"x": NaN, "big": 1000000000000000000000000000000, "t": [1, 2]}'
    before = _snapshot(store)
    with StoreClient(server.url) as client:
        assert client.query_rollouts(status=[]) == []
        assert json.dumps([s.model_dump() for s in client.query_spans()], default=str) == json.dumps(
            [s.model_dump() for s in store.query_spans()], default=str)
    assert _snapshot(store) == before


def test_unreachable_server_raises_store_connection_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with StoreClient(f"http://127.0.0.1:{port}", timeout=2) as client:
        with pytest.raises(StoreConnectionError, match="did not answer"):
            client.get_latest_resources()
    with pytest.raises(ConfigError, match="url"):
        StoreClient("127.0.0.1:8000")


def test_body_over_the_cap_is_rejected_before_reaching_the_store(served):
    server, store, http, rid, aid = served
    before = _snapshot(store)
    huge = _span_body(rid, aid, blob="x" * (5 * 1024 * 1024))  # 5 MB > the 4 MiB default cap
    r = http.post("/spans", json=huge)
    assert r.status_code == 413 and r.json()["error"]["field"] == "body"
    chunked = http.post("/spans", content=iter([json.dumps(_span_body(rid, aid)).encode()]),
                        headers={"Content-Type": "application/json"})
    assert chunked.status_code == 411
    with StoreClient(server.url) as client, pytest.raises(ConfigError, match="max_body_bytes"):
        client.add_span(Span.model_validate(huge))
    assert _snapshot(store) == before
    assert http.post("/spans", json=_span_body(rid, aid, blob="x" * 1024)).status_code == 200


# ----- bounded waits --------------------------------------------------------------------------
def test_long_client_waits_loop_over_bounded_server_waits():
    store = InMemoryStore()
    with StoreServer(store, max_wait_s=0.3) as server, StoreClient(server.url) as client:
        t0 = time.monotonic()
        assert client.dequeue_rollout(timeout=0.8) is None
        assert 0.7 < time.monotonic() - t0 < 3
        threading.Timer(1.0, lambda: store.enqueue_rollout("late")).start()
        item = client.dequeue_rollout("w", timeout=10)  # needs several 0.3 s server waits
        assert item is not None and item.rollout.input == "late"
        rid, aid = item.rollout.rollout_id, item.attempt.attempt_id
        threading.Timer(1.0, lambda: store.update_attempt(rid, aid, status="succeeded")).start()
        assert [r.status for r in client.wait_for_rollouts([rid])] == ["succeeded"]  # timeout=None


def test_stop_returns_promptly_while_a_client_waits():
    store = InMemoryStore()
    server = StoreServer(store).start()
    client = StoreClient(server.url)
    outcome: list = []
    waiter = threading.Thread(target=lambda: outcome.append(_catch(client.dequeue_rollout, "w", 60)))
    waiter.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    server.stop()
    assert time.monotonic() - t0 < 5
    waiter.join(10)
    assert not waiter.is_alive() and isinstance(outcome[0], StoreConnectionError)
    client.close()


def test_dequeue_abandoned_by_a_disconnected_client_is_requeued():
    store = InMemoryStore()
    with StoreServer(store) as server:
        body = b'{"worker_id": "gone", "timeout": 10}'
        with socket.create_connection(("127.0.0.1", server.port)) as raw:
            raw.sendall(b"POST /rollouts/dequeue HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            time.sleep(0.3)  # the server is now waiting for a rollout on our behalf
        rid = store.enqueue_rollout("t", config=RolloutConfig(max_attempts=2)).rollout_id
        with StoreClient(server.url) as client:
            item = client.dequeue_rollout("w", timeout=5)
        # whichever way the race went (popped then failed by the server, or never popped), nothing is lost
        assert item is not None and item.rollout.rollout_id == rid
        earlier = store.query_attempts(rid)[:-1]
        assert all(a.status == "failed" and "disconnected" in a.error for a in earlier)


def _catch(fn, *args):
    try:
        return fn(*args)
    except Exception as exc:
        return exc


# ----- concurrency --------------------------------------------------------------------------
def test_eight_client_threads_dequeue_each_rollout_exactly_once():
    store = InMemoryStore()
    n = 200
    seen: list[str] = []
    lock = threading.Lock()
    producing = threading.Event()
    producing.set()

    def work(wid):
        with StoreClient(server.url) as client:
            while True:
                item = client.dequeue_rollout(f"w{wid}", timeout=0.5)
                if item is None:
                    if producing.is_set():
                        continue
                    return
                client.update_attempt(item.rollout.rollout_id, item.attempt.attempt_id, status="succeeded")
                with lock:
                    seen.append(item.rollout.rollout_id)

    with StoreServer(store) as server:
        threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        ids = []
        with StoreClient(server.url) as producer:
            for i in range(n):
                ids.append(producer.enqueue_rollout(i).rollout_id)
                if i % 50 == 0:
                    time.sleep(0.05)  # let workers block in server-side waits between bursts
        producing.clear()
        for t in threads:
            t.join(60)
    assert sorted(seen) == sorted(ids) and len(seen) == n
    assert all(len(store.query_attempts(rid)) == 1 for rid in ids)
    assert {r.status for r in store.query_rollouts()} == {"succeeded"}


# ----- fuzz -----------------------------------------------------------------------------------
_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
_enqueue = st.one_of(_json, st.fixed_dictionaries({"input": _json}, optional={
    "mode": st.sampled_from(["train", "val", "test", "bogus"]) | _json,
    "config": st.fixed_dictionaries({}, optional={"max_attempts": st.integers(-1, 3) | _json,
                                                  "timeout_seconds": st.floats() | _json}) | _json,
    "metadata": st.dictionaries(st.text(max_size=6), _json, max_size=3) | _json,
    "resources_id": st.sampled_from(["res-1", "res-nope"]) | _json,
}))
_update = st.fixed_dictionaries({}, optional={
    "status": st.sampled_from(list(typing.get_args(AttemptStatus)) + ["bogus"]) | _json,
    "worker_id": st.text(max_size=8) | _json,
    "error": st.text(max_size=20) | _json,
    "heartbeat": st.booleans() | _json,
})
_ops = st.lists(st.one_of(
    st.tuples(st.just("enqueue"), _enqueue),
    st.tuples(st.just("dequeue"), st.just(None)),
    st.tuples(st.just("update"), st.tuples(st.integers(0, 9), st.booleans(), _update)),
), max_size=8)


@pytest.fixture(scope="module")
def fuzz_server():
    store = InMemoryStore()
    store.add_resources({"main_llm": {"endpoint": "http://127.0.0.1:9/v1", "model": "m"}}, resources_id="res-1")
    with StoreServer(store) as server, httpx.Client(base_url=server.url, timeout=10) as http:
        yield store, http


def _check_invariants(store):
    for rollout in store.query_rollouts():
        attempts = store.query_attempts(rollout.rollout_id)
        assert rollout.num_attempts == len(attempts)
        assert [a.sequence_id for a in attempts] == list(range(1, len(attempts) + 1))
        assert all(a.status in ATTEMPT_TERMINAL for a in attempts[:-1])
        if rollout.status in ("preparing", "running"):
            assert attempts and attempts[-1].status == rollout.status
        if rollout.status in ("queuing", "requeuing") and attempts:
            assert attempts[-1].status in ATTEMPT_TERMINAL


@settings(max_examples=50, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=_ops)
def test_fuzzed_enqueue_and_update_never_500_and_keep_invariants(fuzz_server, ops):
    store, http = fuzz_server
    for kind, arg in ops:
        count = len(store.query_rollouts())
        if kind == "enqueue":
            r = http.post("/rollouts", content=json.dumps(arg).encode(), headers={"Content-Type": "application/json"})
            assert len(store.query_rollouts()) == count + (1 if r.is_success else 0)
        elif kind == "dequeue":
            r = http.post("/rollouts/dequeue", json={"worker_id": "fuzz"})
        else:
            index, real_attempt, body = arg
            attempts = store.query_attempts()
            if attempts and real_attempt:
                a = attempts[index % len(attempts)]
                path = f"/rollouts/{a.rollout_id}/attempts/{a.attempt_id}"
            else:
                path = f"/rollouts/ro-fuzz{index}/attempts/at-fuzz"
            before = _snapshot(store)
            r = http.patch(path, content=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
            if not r.is_success:
                assert _snapshot(store) == before
        assert r.status_code < 500, r.text
        if not r.is_success:
            assert 400 <= r.status_code < 500 and r.json()["error"]["message"]
    _check_invariants(store)
    with StoreClient(str(http.base_url)) as client:  # what the client reads back is exactly what is stored
        assert _snapshot(client) == _snapshot(store)
