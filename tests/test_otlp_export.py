"""OTLP export against a real OTLP/HTTP receiver on 127.0.0.1 that decodes the protobuf it gets."""

from __future__ import annotations

import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from lightning_nb import InMemoryStore, emit_reward, semconv, start_runners, tool_span
from lightning_nb.errors import ConfigError, MissingDependencyError, NotFoundError
from lightning_nb.tracing.export import OTLPExportError, redact_attributes, spans_to_otlp
from lightning_nb.tracing.tracer import Tracer
from lightning_nb.types import LLMResource, Span
from conftest import IDLE_LLM

trace_service_pb2 = pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2")


class _Receiver:
    """A minimal OTLP/HTTP trace receiver: POST /v1/traces with application/x-protobuf."""

    def __init__(self, status: int = 200) -> None:
        self.requests: list = []
        self.paths: list[str] = []
        self.headers: list[dict[str, str]] = []
        self.bodies: list[bytes] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server naming)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.paths.append(self.path)
                receiver.headers.append({k.lower(): v for k, v in self.headers.items()})
                receiver.bodies.append(body)
                if self.path != "/v1/traces" or self.headers["Content-Type"] != "application/x-protobuf":
                    self.send_response(404)
                    self.end_headers()
                    return
                request = trace_service_pb2.ExportTraceServiceRequest()
                request.ParseFromString(body)
                receiver.requests.append(request)
                reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(status)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "_Receiver":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def spans(self) -> list:
        return [(rs, span) for req in self.requests for rs in req.resource_spans
                for ss in rs.scope_spans for span in ss.spans]


def _value(any_value):
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in any_value.array_value.values]
    return getattr(any_value, kind)


@pytest.fixture
def traced_store():
    store = InMemoryStore()
    store.add_resources({"main_llm": LLMResource(endpoint=IDLE_LLM, model="m")})

    def agent(task, llm):
        with tool_span("calculator", "2 * 3") as span:
            span.set_attribute(semconv.TOOL_OUTPUT, "6")
        return 1.0

    ids = [store.enqueue_rollout(i).rollout_id for i in range(3)]
    with start_runners(agent, store, n=1):
        assert len(store.wait_for_rollouts(ids, timeout=30)) == 3
    return store, ids


def test_spans_arrive_with_their_ids_names_and_attributes(traced_store):
    store, ids = traced_store
    attempt = store.query_attempts(ids[0])[0]
    store.add_span(Span(rollout_id=ids[0], attempt_id=attempt.attempt_id, trace_id="not-hex", span_id="llm-1",
                        name="chat", start_time=1.5, end_time=2.25, status="error",
                        attributes={"gen_ai.system": "lightning_nb", semconv.PROMPT_TOKEN_IDS: [1, 2, 3],
                                    "meta": {"k": [1, "x"]}, "missing": None}))
    stored = {s.span_id: s for s in store.query_spans()}
    with _Receiver() as receiver:
        sent = spans_to_otlp(store, receiver.url, service_name="calc-test", batch_size=4)
    assert sent == len(stored) == 10
    assert receiver.paths == ["/v1/traces"] * 3  # 10 spans in batches of 4
    got = receiver.spans()
    assert len(got) == 10
    by_id = {span.span_id.hex(): (rs, span) for rs, span in got}
    for span_id, s in stored.items():
        if s.name == "chat":
            continue
        rs, span = by_id[span_id]
        attrs = {kv.key: _value(kv.value) for kv in span.attributes}
        assert span.name == s.name and span.trace_id.hex() == s.trace_id
        assert (span.parent_span_id.hex() or None) == s.parent_id
        assert span.start_time_unix_nano == int(s.start_time * 1e9)
        assert attrs["lightning_nb.rollout_id"] == s.rollout_id
        assert attrs["lightning_nb.attempt_id"] == s.attempt_id
        assert attrs["lightning_nb.sequence_id"] == s.sequence_id
        resource = {kv.key: _value(kv.value) for kv in rs.resource.attributes}
        assert resource["service.name"] == "calc-test"
        if s.name == "tool:calculator":
            assert attrs[semconv.TOOL_OUTPUT] == "6" and attrs["openinference.span.kind"] == "TOOL"
        if s.name == "reward":
            assert attrs[semconv.REWARD] == 1.0 and attrs["openinference.span.kind"] == "EVALUATOR"
    (chat,) = [span for _, span in got if span.name == "chat"]
    attrs = {kv.key: _value(kv.value) for kv in chat.attributes}
    assert attrs[semconv.PROMPT_TOKEN_IDS] == [1, 2, 3] and attrs["meta"] == '{"k": [1, "x"]}'
    assert "missing" not in attrs and attrs["openinference.span.kind"] == "LLM"
    assert len(chat.trace_id) == 16 and len(chat.span_id) == 8  # non-hex ids hashed to OTel sizes
    assert chat.status.code == 2 and chat.end_time_unix_nano == 2_250_000_000  # STATUS_CODE_ERROR


def test_one_rollout_only_and_full_traces_path(traced_store):
    store, ids = traced_store
    with _Receiver() as receiver:
        assert spans_to_otlp(store, receiver.url + "/v1/traces", ids[1]) == 3
    assert {s.name for _, s in receiver.spans()} == {"tool:calculator", "reward", "agent"}
    with pytest.raises(NotFoundError):
        spans_to_otlp(store, receiver.url, "ro-nope")


def test_refused_export_raises_with_the_url(traced_store):
    store, _ = traced_store
    with _Receiver(status=400) as receiver:
        with pytest.raises(OTLPExportError, match="/v1/traces"):
            spans_to_otlp(store, receiver.url, timeout_s=2)


@pytest.mark.parametrize("kwargs, field", [({"endpoint": "127.0.0.1:4318"}, "endpoint"),
                                           ({"timeout_s": 0}, "timeout_s"), ({"batch_size": 0}, "batch_size")])
def test_bad_arguments_name_the_field(kwargs, field):
    args = {"endpoint": "http://127.0.0.1:4318", **kwargs}
    with pytest.raises(ConfigError, match=field):
        spans_to_otlp(InMemoryStore(), **args)


# ----- live export from the tracer --------------------------------------------------------------
def test_tracer_sends_spans_live_with_credentials_redacted():
    store = InMemoryStore()
    store.add_resources({"main_llm": LLMResource(endpoint=IDLE_LLM, model="m")})

    def agent(task, llm):
        with tool_span("calculator", "2 * 3") as span:
            span.set_attribute(semconv.TOOL_OUTPUT, "6")
            span.set_attribute("llm.api_key", "sk-live-SECRET")  # what a careless instrumentation might record
            span.set_attribute("http.request.header.authorization", "Bearer sk-live-SECRET")
            span.set_attribute("gen_ai.usage.input_tokens", 12)
        return 1.0

    with _Receiver() as receiver:
        tracer = Tracer(store, otlp_endpoint=receiver.url + "/v1/traces", service_name="live-test",
                        otlp_headers={"authorization": "Bearer collector-token"})
        assert "otlp_endpoint" in repr(tracer)
        ids = [store.enqueue_rollout(i).rollout_id for i in range(2)]
        with start_runners(agent, store, n=1, tracer=tracer):
            assert len(store.wait_for_rollouts(ids, timeout=30)) == 2
        assert tracer.force_flush(10_000)
        tracer.shutdown()
    assert set(receiver.paths) == {"/v1/traces"}
    assert all(h["authorization"] == "Bearer collector-token" for h in receiver.headers)
    assert not any(b"SECRET" in body or b"collector-token" in body for body in receiver.bodies)
    got = receiver.spans()
    stored = store.query_spans()
    assert len(got) == len(stored) == 6  # agent, tool, reward per rollout
    assert {span.span_id.hex() for _, span in got} == {s.span_id for s in stored}
    for rs, span in got:
        attrs = {kv.key: _value(kv.value) for kv in span.attributes}
        assert attrs["lightning_nb.rollout_id"] in ids
        assert {kv.key: _value(kv.value) for kv in rs.resource.attributes}["service.name"] == "live-test"
        if span.name == "tool:calculator":
            assert attrs[semconv.TOOL_OUTPUT] == "6" and attrs["openinference.span.kind"] == "TOOL"
            assert attrs["llm.api_key"] == attrs["http.request.header.authorization"] == "[redacted]"
            assert attrs["gen_ai.usage.input_tokens"] == 12
        if span.name == "reward":
            assert attrs[semconv.REWARD] == 1.0 and attrs["openinference.span.kind"] == "EVALUATOR"
    assert {span.name for _, span in got} == {"agent", "tool:calculator", "reward"}


def test_live_otlp_errors_name_the_field_and_the_extra(monkeypatch):
    with pytest.raises(ConfigError, match="endpoint"):
        Tracer(InMemoryStore(), otlp_endpoint="127.0.0.1:4318")
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.http.trace_exporter", None)
    with pytest.raises(MissingDependencyError, match=r"lightning-nb\[otlp\]"):
        Tracer(InMemoryStore(), otlp_endpoint="http://127.0.0.1:4318")
    assert repr(Tracer(InMemoryStore())).startswith("Tracer(")  # no endpoint: nothing to import


def test_redact_attributes_keeps_token_counts():
    attrs = {"api_key": "k", "OPENAI_API_KEY": "k", "x-api-key": "k", "llm.password": "p", "client_secret": "s",
             "http.request.header.authorization": "a", "access_token": "t", semconv.PROMPT_TOKEN_IDS: [1],
             "gen_ai.usage.output_tokens": 3, "tokenizer": "t", "keyword": "k", "secretary": "s"}
    out = redact_attributes(attrs)
    assert {k for k, v in out.items() if v == "[redacted]"} == {
        "api_key", "OPENAI_API_KEY", "x-api-key", "llm.password", "client_secret",
        "http.request.header.authorization", "access_token"}
    assert attrs["api_key"] == "k"  # a copy
