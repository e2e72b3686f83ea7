"""The span schema (lightning_nb.semconv): what the proxy writes is what semconv documents, the adapter refuses an
LLM span without its sampling temperature, and the proxy, tracing, adapter and calc agent write no key as a literal.

The proxy test runs the real proxy on the session's SmolLM2-135M; the adapter tests use a real InMemoryStore.
"""

from __future__ import annotations

import ast
import json
import time
from pathlib import Path

import openai
import pytest

from lightning_nb import semconv
from lightning_nb.adapter import TripletAdapter
from lightning_nb.engines.transformers import DEFAULT_MODEL_NAME as M
from lightning_nb.errors import SpanSchemaError
from lightning_nb.store import InMemoryStore
from lightning_nb.types import Span

ROOT = Path(__file__).resolve().parents[1] / "lightning_nb"
KEYS = {getattr(semconv, name) for name in semconv.__all__ if isinstance(getattr(semconv, name), str)}


# ----- the adapter refuses what it would otherwise guess -----------------------------------------------------
def _rollout_with_llm_span(attributes):
    """A succeeded rollout with one hand-built LLM span (``attributes`` plus token IDs) and a final reward 1.0."""
    store = InMemoryStore()
    run = store.start_rollout({"q": 1})
    rid, aid = run.rollout.rollout_id, run.attempt.attempt_id
    now = time.time()
    store.add_span(Span(rollout_id=rid, attempt_id=aid, trace_id="t", span_id="call", name=semconv.LLM_SPAN,
                        start_time=now, end_time=now, attributes={
                            semconv.PROMPT_TOKEN_IDS: [1, 2], semconv.COMPLETION_TOKEN_IDS: [3, 4], **attributes}))
    store.add_span(Span(rollout_id=rid, attempt_id=aid, trace_id="t", span_id="r", name=semconv.REWARD_SPAN,
                        start_time=now, end_time=now, attributes={semconv.REWARD: 1.0}))
    store.update_attempt(rid, aid, status="succeeded")
    return store, rid


@pytest.mark.parametrize("present, missing", [
    ({}, semconv.APPLIED_TEMPERATURE),
    ({semconv.APPLIED_TOP_P: 1.0}, semconv.APPLIED_TEMPERATURE),
    ({semconv.APPLIED_TEMPERATURE: 0.7}, semconv.APPLIED_TOP_P),
])
def test_the_adapter_refuses_an_llm_span_without_its_sampling_naming_the_key(present, missing):
    store, rid = _rollout_with_llm_span(present)
    with pytest.raises(SpanSchemaError) as info:
        TripletAdapter().adapt(store, [rid])
    message = str(info.value)
    assert f"no {missing!r} attribute" in message and rid in message and "span call" in message
    constant = {semconv.APPLIED_TEMPERATURE: "APPLIED_TEMPERATURE", semconv.APPLIED_TOP_P: "APPLIED_TOP_P"}[missing]
    assert f"semconv.{constant}" in message  # the fix names the constant to set
    assert isinstance(info.value, ValueError)  # except ValueError still catches it


def test_the_adapter_carries_the_applied_sampling_into_the_triplet():
    store, rid = _rollout_with_llm_span({semconv.APPLIED_TEMPERATURE: 0.7, semconv.APPLIED_TOP_P: 0.9})
    (triplet,) = TripletAdapter().adapt(store, [rid])
    assert (triplet.temperature, triplet.top_p) == (0.7, 0.9)


def test_an_llm_span_without_token_ids_is_counted_not_refused_for_its_sampling():
    """A failed call's span (the proxy records the error, no token IDs, no sampling) is skipped as before."""
    store = InMemoryStore()
    run = store.start_rollout({"q": 1})
    rid, aid = run.rollout.rollout_id, run.attempt.attempt_id
    for span_id, name, attributes in (("e", semconv.LLM_SPAN, {semconv.REQUEST_MODEL: M, semconv.ERROR: "boom"}),
                                      ("r", semconv.REWARD_SPAN, {semconv.REWARD: 0.0})):
        store.add_span(Span(rollout_id=rid, attempt_id=aid, trace_id="t", span_id=span_id, name=name,
                            start_time=1.0, end_time=2.0, attributes=attributes))
    store.update_attempt(rid, aid, status="succeeded")
    adapter = TripletAdapter()
    assert adapter.adapt(store, [rid]) == []
    assert adapter.last_skipped["no_token_ids"] == 1 and adapter.last_skipped["llm_spans_without_token_ids"] == 1


# ----- the proxy writes what semconv documents -------------------------------------------------------------
CALCULATOR = {"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic",
                                               "parameters": {"type": "object", "properties": {
                                                   "expression": {"type": "string"}}}}}


@pytest.mark.slow
def test_every_key_the_proxy_records_is_a_semconv_key_with_the_documented_type(proxied):
    store, proxy = proxied
    rollout = store.enqueue_rollout("t", metadata={"sampling_parameters": {"max_tokens": 6, "logit_bias": {}}})
    aid = store.dequeue_rollout().attempt.attempt_id
    client = openai.OpenAI(base_url=proxy.endpoint(rollout.rollout_id, aid), api_key="x", max_retries=0)
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    reply = client.chat.completions.create(
        model=M, messages=messages, max_tokens=12, temperature=0.8, top_p=1.0, n=2, seed=5, stop="\n\n",
        tools=[CALCULATOR], tool_choice="auto", user="u1", metadata={"run": "semconv"},
        extra_headers={semconv.AGENT_NAME_HEADER: "solver"})
    raw = reply.model_dump()
    spans = sorted(store.query_spans(rollout.rollout_id), key=lambda s: s.attributes[semconv.CHOICE_INDEX])
    assert [s.name for s in spans] == [semconv.LLM_SPAN] * 2
    for span, choice in zip(spans, raw["choices"]):
        a = span.attributes
        assert set(a) <= KEYS, set(a) - KEYS  # no key outside the schema
        # the request, as asked
        assert a[semconv.SYSTEM] == "lightning_nb" and a[semconv.REQUEST_MODEL] == M
        assert a[semconv.AGENT_NAME] == "solver" and a[semconv.REQUEST_USER] == "u1"
        assert (a[semconv.REQUEST_TEMPERATURE], a[semconv.REQUEST_TOP_P], a[semconv.REQUEST_MAX_TOKENS],
                a[semconv.REQUEST_SEED]) == (0.8, 1.0, 12, 5)
        assert a[semconv.REQUEST_STOP_SEQUENCES] == ["\n\n"]  # a str stop is recorded as a list
        assert json.loads(a[semconv.REQUEST_TOOLS]) == [CALCULATOR]
        assert json.loads(a[semconv.REQUEST_TOOL_CHOICE]) == "auto"
        assert json.loads(a[semconv.REQUEST_METADATA]) == {"run": "semconv"}
        assert json.loads(a[semconv.PROMPT]) == messages  # as sent, before the tools are rendered in
        # the sampling applied: the rollout's max_tokens caps the request's; unknown rollout keys are named
        assert a[semconv.APPLIED_TEMPERATURE] == 0.8 and isinstance(a[semconv.APPLIED_TEMPERATURE], float)
        assert a[semconv.APPLIED_TOP_P] == 1.0 and isinstance(a[semconv.APPLIED_TOP_P], float)
        assert a[semconv.APPLIED_MAX_TOKENS] == 6 and a[semconv.APPLIED_SEED] == 5
        assert a[semconv.APPLIED_STOP] == ["\n\n"] and a[semconv.SAMPLING_NOT_APPLIED] == ["logit_bias"]
        # the reply
        ids = a[semconv.COMPLETION_TOKEN_IDS]
        assert a[semconv.CHOICES] == 2 and a[semconv.CHOICE_INDEX] == choice["index"]
        assert a[semconv.RESPONSE_FINISH_REASONS] == [choice["finish_reason"]]
        assert isinstance(a[semconv.RESPONSE_ID], str)
        assert ids == choice["token_ids"] and a[semconv.PROMPT_TOKEN_IDS] == raw["prompt_token_ids"]
        assert (a[semconv.USAGE_INPUT_TOKENS], a[semconv.USAGE_OUTPUT_TOKENS]) == (
            len(a[semconv.PROMPT_TOKEN_IDS]), len(ids)) and 1 <= len(ids) <= 6
        assert len(a[semconv.LOGPROBS]) == len(ids) and all(lp <= 0.0 for lp in a[semconv.LOGPROBS])
        assert isinstance(a[semconv.COMPLETION], str) and a[semconv.WEIGHT_VERSION] == proxy.engine.weight_version
        assert a[semconv.ENGINE] == type(proxy.engine).__name__
        assert semconv.TOKEN_IDS_MISSING not in a and semconv.WEIGHTS_CHANGED_DURING_CALL not in a


def test_a_call_the_engine_fails_is_one_llm_span_with_the_error(unused_tcp_port_url):
    """An engine nobody serves: the client gets a 502 naming it, the attempt one span saying why."""
    from lightning_nb.engines import OpenAIEndpoint
    from lightning_nb.proxy import LLMProxy

    store = InMemoryStore()
    rollout = store.enqueue_rollout("t")
    aid = store.dequeue_rollout().attempt.attempt_id
    gone = OpenAIEndpoint(unused_tcp_port_url, "gone-model", returns_token_ids=True)
    with LLMProxy(gone, store) as proxy:
        client = openai.OpenAI(base_url=proxy.endpoint(rollout.rollout_id, aid), api_key="x", max_retries=0)
        with pytest.raises(openai.APIStatusError) as info:
            client.chat.completions.create(model="gone-model", messages=[{"role": "user", "content": "hi"}],
                                           extra_headers={semconv.AGENT_NAME_HEADER: "solver"})
    assert info.value.status_code == 502 and "OpenAIEndpoint at " + unused_tcp_port_url in str(info.value)
    (span,) = store.query_spans(rollout.rollout_id)
    assert span.name == semconv.LLM_SPAN and set(span.attributes) == {
        semconv.REQUEST_MODEL, semconv.ERROR, semconv.AGENT_NAME}
    assert span.attributes[semconv.AGENT_NAME] == "solver" and 0 < len(span.attributes[semconv.ERROR]) <= 2000


@pytest.fixture
def unused_tcp_port_url():
    """``http://127.0.0.1:<port>/v1`` of a port nothing listens on (bound, then closed)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"


# ----- no key written as a literal ---------------------------------------------------------------------------
# The keys no other vocabulary shares: dotted or prefixed ones, and the span names. Short keys such as
# "temperature", "stop", "n", "logprobs" or "prompt_token_ids" are also OpenAI request/response fields or
# Parquet column names, which these modules rightly spell out; a literal check cannot tell those apart.
DISTINCT = {k for k in KEYS if "." in k or ":" in k} | {semconv.LLM_SPAN, semconv.INTERMEDIATE_REWARD_SPAN,
                                                          semconv.CHOICE_INDEX}
FILES = [*sorted((ROOT / "proxy").glob("*.py")), *sorted((ROOT / "tracing").glob("*.py")), ROOT / "adapter.py",
         *sorted((ROOT / "tasks").rglob("*.py"))]


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_span_key_is_written_as_a_literal(path):
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)}
    found = [(node.lineno, node.value) for node in ast.walk(tree)
             if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
             and (node.value in DISTINCT or any(node.value.startswith(p) for p in (semconv.REQUEST_PREFIX,)))]
    assert not found, f"{path.name}: use the lightning_nb.semconv constants for {found}"


# ----- the naming rule (the module docstring of lightning_nb.semconv) ------------------------------------------
# The OpenTelemetry registries a key may come from (opentelemetry-semantic-conventions lists every name), and the
# one OpenInference key the OTLP export adds for Phoenix.
OTEL_NAMESPACES = ("gen_ai", "error", "exception", "service")
OPENINFERENCE = {semconv.SPAN_KIND}


def _otel_registry() -> set[str]:
    import importlib

    names = set()
    for namespace in OTEL_NAMESPACES:
        module = importlib.import_module(f"opentelemetry.semconv._incubating.attributes.{namespace}_attributes")
        names |= {v for k, v in vars(module).items() if k.isupper() and isinstance(v, str)}
    return names


def test_every_constant_is_a_span_name_an_attribute_key_or_the_header_and_prefix():
    """``ATTRIBUTE_KEYS`` is every string constant but the span names, the HTTP header and the request prefix, so the
    rule below reads every key."""
    constants = {name: getattr(semconv, name) for name in semconv.__all__ if isinstance(getattr(semconv, name), str)}
    others = set(semconv.SPAN_NAMES) | {semconv.AGENT_NAME_HEADER, semconv.REQUEST_PREFIX}
    assert set(semconv.ATTRIBUTE_KEYS) == {v for v in constants.values() if v not in others}
    assert len(set(semconv.ATTRIBUTE_KEYS)) == len(semconv.ATTRIBUTE_KEYS)  # no two constants share a key
    assert not set(semconv.SPAN_NAMES) & set(semconv.ATTRIBUTE_KEYS)
    assert set(semconv.SPAN_NAMES) <= set(constants.values())


@pytest.mark.parametrize("key", semconv.ATTRIBUTE_KEYS)
def test_every_attribute_key_follows_the_naming_rule(key):
    """OpenTelemetry's name where one exists (a name of its registry: ``gen_ai.*``, ``error.*``, ``exception.*``,
    ``service.*``), ``openinference.span.kind`` for the export, ``lightning_nb.*`` otherwise; lower case, dotted."""
    namespace = key.split(".", 1)[0]
    assert "." in key and key == key.lower() and " " not in key, key
    if namespace in OTEL_NAMESPACES:
        assert key in _otel_registry(), f"{key!r} is not an OpenTelemetry name: use lightning_nb.* for it"
    elif key not in OPENINFERENCE:
        assert namespace == "lightning_nb", f"{key!r}: a key is OpenTelemetry's, or under lightning_nb.*"


def test_no_key_is_also_the_namespace_of_another():
    """OpenTelemetry's rule: a name is an attribute or a namespace, never both (``a.b`` beside ``a.b.c``)."""
    keys = set(semconv.ATTRIBUTE_KEYS)
    assert not {(k, other) for k in keys for other in keys if other.startswith(k + ".")}


def test_the_renamed_keys_map_old_names_to_current_keys_of_the_spans_that_had_them():
    """``RENAMED_KEYS`` (read by SqliteStore's migration of an old file): each new name is a current key, no old name
    is one, and the spans are named by a span name (a tool span by its prefix)."""
    keys = set(semconv.ATTRIBUTE_KEYS)
    assert set(semconv.RENAMED_KEYS) <= set(semconv.SPAN_NAMES)
    for span_name, renamed in semconv.RENAMED_KEYS.items():
        assert set(renamed.values()) <= keys, (span_name, set(renamed.values()) - keys)
        assert not set(renamed) & keys, (span_name, set(renamed) & keys)
    assert semconv.RENAMED_KEYS[semconv.LLM_SPAN]["temperature"] == semconv.APPLIED_TEMPERATURE
    assert semconv.RENAMED_KEYS[semconv.REWARD_SPAN]["reward"] == semconv.REWARD


def test_every_semconv_key_is_documented():
    """Each constant of semconv.__all__ has a ``#:`` comment right above it (Sphinx's attribute docs)."""
    lines = (ROOT / "semconv.py").read_text().splitlines()
    undocumented = [name for name in semconv.__all__
                    if not any(lines[i - 1].startswith("#:") for i, line in enumerate(lines)
                               if line.startswith(f"{name} = ") and i > 0)]
    assert not undocumented, undocumented
