"""Parquet exports of spans and triplets, on every store backend."""

from __future__ import annotations

import json
import math

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lightning_nb import semconv
from lightning_nb.errors import ConfigError, NotFoundError
from lightning_nb.tracing.export import SPAN_SCHEMA, TRIPLET_SCHEMA, spans_to_parquet, triplets_to_parquet
from lightning_nb.types import Span, Triplet

PROMPT_IDS = [1, 0, 2**40, 49151, 7]
COMPLETION_IDS = [3, 3, 2**31 + 5]


def _span(rollout_id, attempt_id, name, parent_id=None, **attrs):
    return Span(rollout_id=rollout_id, attempt_id=attempt_id, trace_id="t" * 32, span_id=name[:16].ljust(16, "0"),
                parent_id=parent_id, name=name, start_time=10.25, end_time=11.5, status="ok", attributes=attrs)


def _fill(store):
    """Two rollouts: an LLM call with token IDs plus a reward, and a plain tool span."""
    first = store.enqueue_rollout("a")
    second = store.enqueue_rollout("b")
    a1 = store.dequeue_rollout().attempt.attempt_id
    a2 = store.dequeue_rollout().attempt.attempt_id
    store.add_span(_span(first.rollout_id, a1, "llm.chat.completions", **{
        semconv.PROMPT_TOKEN_IDS: PROMPT_IDS, semconv.COMPLETION_TOKEN_IDS: COMPLETION_IDS,
        semconv.LOGPROBS: [-0.5, -1.25, 0.0],
        "gen_ai.usage.input_tokens": len(PROMPT_IDS), "gen_ai.usage.output_tokens": len(COMPLETION_IDS),
        "gen_ai.completion": "héllo\n"}))
    store.add_span(_span(first.rollout_id, a1, "reward", **{semconv.REWARD: 0.75}))
    store.add_span(_span(second.rollout_id, a2, "tool:calc", parent_id="p" * 16, **{semconv.TOOL_OUTPUT: "3"}))
    return first.rollout_id, second.rollout_id


def test_spans_round_trip_token_ids_exactly(store, tmp_path):
    rid1, rid2 = _fill(store)
    out = spans_to_parquet(store, tmp_path / "sub" / "spans.parquet")
    assert out == tmp_path / "sub" / "spans.parquet" and out.is_file()
    table = pq.read_table(out)
    assert table.schema.equals(SPAN_SCHEMA)
    rows = table.to_pylist()
    assert [r["name"] for r in rows] == ["llm.chat.completions", "reward", "tool:calc"]
    llm, reward, tool = rows
    assert llm["prompt_token_ids"] == PROMPT_IDS and llm["completion_token_ids"] == COMPLETION_IDS
    assert (llm["prompt_tokens"], llm["completion_tokens"], llm["reward"]) == (5, 3, None)
    assert json.loads(llm["attributes"]) == store.query_spans(rid1)[0].attributes
    assert reward["reward"] == 0.75 and reward["prompt_token_ids"] is None and reward["sequence_id"] == 2
    assert tool["rollout_id"] == rid2 and tool["parent_id"] == "p" * 16 and tool["duration_s"] == 1.25
    assert (tool["start_time"], tool["end_time"]) == (10.25, 11.5)
    # pandas reads it too, with the same columns as the store's spans_df summary
    df = pd.read_parquet(out)
    assert {"prompt_tokens", "completion_tokens", "reward", "duration_s"} <= set(df.columns)
    assert list(df.loc[0, "prompt_token_ids"]) == PROMPT_IDS
    # one rollout only
    only = pq.read_table(spans_to_parquet(store, tmp_path / "one.parquet", rollout_id=rid2)).to_pylist()
    assert [r["name"] for r in only] == ["tool:calc"]


def test_empty_and_unknown_rollout(store, tmp_path):
    table = pq.read_table(spans_to_parquet(store, tmp_path / "empty.parquet"))
    assert table.num_rows == 0 and table.schema.equals(SPAN_SCHEMA)
    with pytest.raises(NotFoundError, match="ro-missing"):
        spans_to_parquet(store, tmp_path / "x.parquet", rollout_id="ro-missing")


def test_triplets_round_trip_with_list_types(tmp_path):
    triplets = [
        Triplet(rollout_id="ro-1", attempt_id="at-1", group_id="g", turn=0, prompt_ids=PROMPT_IDS,
                response_ids=COMPLETION_IDS, logprobs=[-0.5, -1.25, -math.pi], reward=1.0, temperature=0.7,
                prompt_text="p", response_text="r"),
        Triplet(rollout_id="ro-2", attempt_id="at-2", group_id="g", turn=1, prompt_ids=[9], response_ids=[],
                reward=-0.5),
    ]
    out = triplets_to_parquet(triplets, tmp_path / "triplets.parquet")
    table = pq.read_table(out)
    assert table.schema.equals(TRIPLET_SCHEMA)
    assert table.schema.field("prompt_ids").type == pa.list_(pa.int64())
    assert table.schema.field("logprobs").type == pa.list_(pa.float64())
    assert [Triplet(**row) for row in table.to_pylist()] == triplets
    empty = pq.read_table(triplets_to_parquet([], tmp_path / "none.parquet"))
    assert empty.num_rows == 0 and empty.schema.equals(TRIPLET_SCHEMA)
    with pytest.raises(ConfigError, match=r"triplets\[0\]"):
        triplets_to_parquet([{"rollout_id": "ro-1"}], tmp_path / "bad.parquet")


def test_bad_paths_give_clear_errors(store, tmp_path):
    blocker = tmp_path / "blocker"
    blocker.write_text("not a folder")
    with pytest.raises(ConfigError, match="is a file, not a folder"):
        spans_to_parquet(store, blocker / "spans.parquet")
    with pytest.raises(ConfigError, match="is a file, not a folder"):
        triplets_to_parquet([], blocker / "deeper" / "t.parquet")
    with pytest.raises(ConfigError, match="is a folder"):
        spans_to_parquet(store, tmp_path)
    assert blocker.read_text() == "not a folder"
