"""``spans_df()``: fixed columns and dtypes, the ``attributes`` column, ``flatten``.

Every test runs on every backend (conftest.STORE_BACKENDS).
"""

from __future__ import annotations

import math
import time

import pandas as pd
import pytest

from lightning_nb import semconv
from lightning_nb.errors import ConfigError, NotFoundError
from lightning_nb.store.spanframe import FLATTEN_MAX_KEYS, SPAN_COLUMNS
from lightning_nb.types import Span

DATETIME = "datetime64[us]"
DTYPES = {
    "rollout_id": "category", "attempt_id": "category", "sequence_id": "int64", "name": "category",
    "prompt": "object", "completion": "object", "reward": "float64", "prompt_tokens": "float64",
    "completion_tokens": "float64", "finish_reason": "object", "model": "object", "agent_name": "object",
    "status": "category", "start_time": DATETIME, "end_time": DATETIME, "duration_s": "float64",
    "span_id": "object", "trace_id": "category", "parent_id": "category", "attributes": "object",
}
LLM_ATTRS = {
    "gen_ai.system": "lightning_nb", "gen_ai.request.model": "SmolLM2", "gen_ai.prompt": '[{"role": "user"}]',
    "gen_ai.completion": "4", "gen_ai.response.finish_reasons": ["stop"], "gen_ai.agent.name": "solver",
    "gen_ai.usage.input_tokens": 12, "gen_ai.usage.output_tokens": 3, semconv.PROMPT_TOKEN_IDS: [1, 2, 3],
    "gen_ai.prompt.0.content": "What is 2 + 2?",
}


def _add(store, rid, aid, name, attrs, span_id, parent_id=None, start=10.0):
    return store.add_span(Span(rollout_id=rid, attempt_id=aid, trace_id="t" * 32, span_id=span_id,
                               parent_id=parent_id, name=name, start_time=start, end_time=start + 1.5,
                               status="ok", attributes=attrs))


def _two_rollouts(store):
    """Rollout 1: an LLM call, a tool call and a reward. Rollout 2: a reward only (added first)."""
    first = store.dequeue_rollout("w") if store.enqueue_rollout("a") else None
    second = store.dequeue_rollout("w") if store.enqueue_rollout("b") else None
    r2, a2 = second.rollout.rollout_id, second.attempt.attempt_id
    _add(store, r2, a2, "reward", {semconv.REWARD: 0.0}, "r2")
    r1, a1 = first.rollout.rollout_id, first.attempt.attempt_id
    _add(store, r1, a1, "llm.chat.completions", dict(LLM_ATTRS), "l1", parent_id="agent")
    _add(store, r1, a1, "tool:calc", {semconv.TOOL_NAME: "calc", "tool.calls": 2}, "t1", start=12.0)
    _add(store, r1, a1, "reward", {semconv.REWARD: 1.0, "note": "ok"}, "r1")
    return r1, r2


def test_fixed_columns_dtypes_and_values(store):
    empty = store.spans_df()
    assert list(empty.columns) == SPAN_COLUMNS and len(empty) == 0
    assert {c: str(t) for c, t in empty.dtypes.items()} == DTYPES
    r1, r2 = _two_rollouts(store)
    df = store.spans_df()
    assert list(df.columns) == SPAN_COLUMNS and {c: str(t) for c, t in df.dtypes.items()} == DTYPES
    # rollout enqueue order, then sequence id (not the order spans arrived in)
    assert df["rollout_id"].astype(str).tolist() == [r1, r1, r1, r2]
    assert df["name"].astype(str).tolist() == ["llm.chat.completions", "tool:calc", "reward", "reward"]
    llm = df.iloc[0]
    assert (llm["prompt"], llm["completion"], llm["finish_reason"]) == ('[{"role": "user"}]', "4", "stop")
    assert (llm["model"], llm["agent_name"], llm["prompt_tokens"], llm["completion_tokens"]) == ("SmolLM2", "solver",
                                                                                                  12.0, 3.0)
    assert (llm["sequence_id"], llm["duration_s"], llm["parent_id"], llm["status"]) == (1, 1.5, "agent", "ok")
    assert llm["start_time"] == pd.Timestamp(10.0, unit="s")
    assert df["reward"].tolist()[2:] == [1.0, 0.0]
    # one missing-value marker: NaN (pd.isna finds it) in every column that has a gap
    tool = df.iloc[1]
    for col in ("prompt", "completion", "reward", "prompt_tokens", "finish_reason", "model", "parent_id"):
        assert pd.isna(tool[col]) and (col == "parent_id" or isinstance(tool[col], float)), col
    # one rollout; an unknown one
    one = store.spans_df(r2)
    assert list(one.columns) == SPAN_COLUMNS and one["span_id"].tolist() == ["r2"]
    assert {c: str(t) for c, t in one.dtypes.items()} == DTYPES
    with pytest.raises(NotFoundError):
        store.spans_df("ro-missing")


def test_attributes_column_is_a_full_copy(store):
    r1, _ = _two_rollouts(store)
    df = store.spans_df(r1)
    attrs = df.loc[0, "attributes"]
    assert attrs == LLM_ATTRS and df.loc[2, "attributes"] == {semconv.REWARD: 1.0, "note": "ok"}
    attrs[semconv.PROMPT_TOKEN_IDS].append(99)
    attrs["gen_ai.completion"] = "changed"
    attrs["new"] = 1
    assert store.query_spans(r1)[0].attributes == LLM_ATTRS
    assert store.spans_df(r1).loc[0, "attributes"] == LLM_ATTRS


def test_flatten_a_list_of_keys_true_and_refusals(store):
    r1, _ = _two_rollouts(store)
    df = store.spans_df(flatten=["tool.calls", "note", semconv.PROMPT_TOKEN_IDS, "absent"])
    assert list(df.columns) == SPAN_COLUMNS[:-1] + ["tool.calls", "note", semconv.PROMPT_TOKEN_IDS, "absent",
                                                    "attributes"]
    assert df["tool.calls"].dtype == "float64" and df["tool.calls"].tolist()[1] == 2.0  # NaN elsewhere: floats
    assert df["note"].tolist()[2] == "ok" and pd.isna(df["note"]).sum() == 3
    assert df["note"].equals(df["attributes"].str.get("note"))  # the same, without flatten
    assert df.loc[0, semconv.PROMPT_TOKEN_IDS] == [1, 2, 3] and df["absent"].isna().all()
    full = store.spans_df(flatten=True)  # every key, first seen first, but not those named like a column
    assert list(full.columns) == SPAN_COLUMNS[:-1] + [*LLM_ATTRS, semconv.TOOL_NAME, "tool.calls", semconv.REWARD,
                                                      "note", "attributes"]
    assert full["gen_ai.prompt.0.content"].tolist()[0] == "What is 2 + 2?"
    assert list(store.spans_df(flatten=False).columns) == SPAN_COLUMNS
    with pytest.raises(ConfigError, match="'reward' is already a column"):
        store.spans_df(flatten=["reward"])
    for bad in ("note", 3, [""], [None]):
        with pytest.raises(ConfigError, match="flatten"):
            store.spans_df(flatten=bad)


def test_flatten_true_refuses_more_keys_than_the_cap(store):
    item = store.dequeue_rollout("w") if store.enqueue_rollout("x") else None
    rid, aid = item.rollout.rollout_id, item.attempt.attempt_id
    per = 100
    for i in range(FLATTEN_MAX_KEYS // per + 1):  # 1,100 distinct keys
        _add(store, rid, aid, "llm", {f"gen_ai.prompt.{i * per + j}.content": "x" for j in range(per)}, f"s{i}")
    with pytest.raises(ConfigError, match=r"flatten=True\) would make more than 1,000 attribute columns.*flatten=\["):
        store.spans_df(flatten=True)
    assert store.spans_df(flatten=["gen_ai.prompt.5.content"])["gen_ai.prompt.5.content"].notna().sum() == 1


def test_fresh_keys_per_span_keep_the_frame_narrow(store):
    """2,000 spans x 25 keys that never repeat: once 50,000 columns; now the fixed ones, built quickly.

    (2,000 spans, not more: SqliteStore's FULL durability syncs each add_span, and filling is not the point.)
    """
    n_rollouts, per_rollout, keys = 100, 20, 25
    for r in range(n_rollouts):
        item = store.dequeue_rollout("w") if store.enqueue_rollout(r) else None
        rid, aid = item.rollout.rollout_id, item.attempt.attempt_id
        for k in range(per_rollout):
            i = r * per_rollout + k
            _add(store, rid, aid, "llm", {f"gen_ai.prompt.{i * keys + j}.content": f"text {i} {j} " * 10
                                          for j in range(keys)}, f"s{i}")
    t0 = time.perf_counter()
    df = store.spans_df()
    seconds = time.perf_counter() - t0
    assert df.shape == (n_rollouts * per_rollout, len(SPAN_COLUMNS))
    assert sum(len(a) for a in df["attributes"]) == n_rollouts * per_rollout * keys
    assert seconds < 5.0, f"spans_df() over 2,000 spans took {seconds:.1f} s"
    assert math.isnan(df["reward"].iloc[0])


def test_a_renamed_attribute_key_still_reads_for_one_release_with_a_deprecation_warning(store):
    """Code written against the keys before lightning_nb.semconv (prompt_token_ids, reward...) reads the values
    through Span.attributes and as a spans_df column, warned, on every backend; the new keys read unwarned."""
    import warnings

    item = store.start_rollout("t")
    rid, aid = item.rollout.rollout_id, item.attempt.attempt_id
    store.add_span(Span(rollout_id=rid, attempt_id=aid, trace_id="t" * 32, span_id="a" * 16, name=semconv.LLM_SPAN,
                        start_time=1.0, end_time=2.0, attributes={semconv.PROMPT_TOKEN_IDS: [1, 2]}))
    (span,) = store.query_spans(rid)
    new = "'lightning_nb.prompt.token_ids'"
    with pytest.warns(DeprecationWarning, match=f"'prompt_token_ids' is renamed {new}"):
        assert span.attributes["prompt_token_ids"] == [1, 2]
    with pytest.warns(DeprecationWarning, match=f"'prompt_token_ids' is renamed {new}"):
        assert span.attributes.get("prompt_token_ids") == [1, 2]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning for anything else
        assert span.attributes[semconv.PROMPT_TOKEN_IDS] == [1, 2] and span.attributes.get("logprobs") is None
        assert span.attributes.get("nope", 0) == 0 and "prompt_token_ids" not in span.attributes
        with pytest.raises(KeyError):
            span.attributes["completion_token_ids"]  # renamed, but this span has neither key
        assert "prompt_token_ids" not in span.model_dump_json()
        plain = store.spans_df(rid, flatten=[semconv.PROMPT_TOKEN_IDS])
    with pytest.warns(DeprecationWarning, match=f"flatten=\\['prompt_token_ids'\\].* renamed {new}"):
        df = store.spans_df(rid, flatten=["prompt_token_ids"])
    assert df["prompt_token_ids"].tolist() == plain[semconv.PROMPT_TOKEN_IDS].tolist() == [[1, 2]]
