"""InMemoryStore span columns, eviction and spill (bounded memory); views agree with the generic ones."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from lightning_nb.errors import ConfigError
from lightning_nb.store import InMemoryStore
from lightning_nb.store.base import LightningStore
from lightning_nb.types import Span


def _fill(store, n_rollouts=12, spans_per=5, finish=True, start=0):
    """Rollouts with LLM-like spans (varied attributes) and a final reward; spans interleaved across rollouts."""
    items = [store.dequeue_rollout("w") for _ in range(n_rollouts)
             if store.enqueue_rollout(start) is not None]
    for k in range(spans_per):
        for j, it in enumerate(reversed(items)):
            last = k == spans_per - 1
            attrs = ({"reward": float(j % 3) / 2} if last else
                     {"gen_ai.usage.input_tokens": 10 + k, "token_ids": [1, 2, k], "ok": True, "text": f"t{k}"})
            if k == 1 and j == 0:
                attrs["odd"] = math.nan
            store.add_span(Span(rollout_id=it.rollout.rollout_id, attempt_id=it.attempt.attempt_id, trace_id=f"tr{j}",
                                span_id=f"s{j}-{k}", parent_id=None if k == 0 else f"s{j}-0",
                                name="reward" if last else "llm", start_time=100.0 + k, end_time=100.5 + k,
                                attributes=attrs))
    if finish:
        for it in items:
            store.update_attempt(it.rollout.rollout_id, it.attempt.attempt_id, status="succeeded")
    return [it.rollout.rollout_id for it in items]


def _plain(df: pd.DataFrame) -> pd.DataFrame:
    out = df.copy()
    for c in out.columns:
        if isinstance(out[c].dtype, pd.CategoricalDtype) or out[c].dtype == object or str(out[c].dtype) == "str":
            out[c] = out[c].astype(object).where(out[c].notna(), None)
    return out.reset_index(drop=True)


def _same_views(store: InMemoryStore, rollout_id=None):
    fast, slow = store.spans_df(rollout_id), LightningStore.spans_df(store, rollout_id)
    assert list(fast.columns) == list(slow.columns)
    pd.testing.assert_frame_equal(_plain(fast), _plain(slow), check_dtype=False)
    assert store._final_rewards() == LightningStore._final_rewards(store)


def test_columnar_spans_df_matches_the_generic_view():
    store = InMemoryStore()
    ids = _fill(store)
    _same_views(store)
    _same_views(store, ids[3])
    df = store.spans_df()
    assert len(df) == 60 and df["name"].tolist()[:5] == ["llm"] * 4 + ["reward"]  # enqueue, attempt, seq order
    assert df.loc[0, "token_ids"] == [1, 2, 0] and df["reward"].notna().sum() == 12
    assert store.spans_df(ids[0])["sequence_id"].tolist() == [1, 2, 3, 4, 5]


def test_eviction_keeps_memory_bounded_and_never_touches_running_rollouts():
    store = InMemoryStore(max_spans=40)
    done = _fill(store, n_rollouts=12, spans_per=5)  # 60 spans of finished rollouts
    running = _fill(store, n_rollouts=2, spans_per=30, finish=False)  # 60 spans still in flight
    assert len(store._table) <= 60 + 8  # finished spans went; running ones stay (soft limit)
    assert store.evicted_spans == 60 + 60 - len(store._table)
    assert all(len(store.query_spans(rid)) == 30 for rid in running)
    assert store.query_spans(done[0]) == []  # evicted: gone for good, and counted
    assert store.rollouts_df()["status"].tolist().count("succeeded") == 12  # rollouts and attempts stay
    # sequence ids keep counting after an eviction
    it = store.query_attempts(running[0])[0]
    s = store.add_span(Span(rollout_id=running[0], attempt_id=it.attempt_id, trace_id="t", span_id="x",
                            name="late", start_time=1.0, end_time=2.0))
    assert s.sequence_id == 31


def test_spill_to_sqlite_loses_nothing(tmp_path):
    bounded = InMemoryStore(max_spans=25, spill_path=tmp_path / "spill.db")
    free = InMemoryStore()
    for store in (bounded, free):
        _fill(store, n_rollouts=12, spans_per=5)
        _fill(store, n_rollouts=3, spans_per=4, finish=False, start=1)
    assert len(bounded._table) < 25 and bounded._spill.count > 0 and bounded.evicted_spans == 0

    def dumps(store, rid=None):
        return [(s.name, s.sequence_id, s.span_id, s.attributes.get("reward"), s.attributes.get("token_ids"))
                for s in store.query_spans(rid)]

    assert dumps(bounded) == dumps(free)
    for a, b in zip(bounded.query_rollouts(), free.query_rollouts()):
        assert dumps(bounded, a.rollout_id) == dumps(free, b.rollout_id)
        assert bounded.final_reward(a.rollout_id) == free.final_reward(b.rollout_id)
    _same_views(bounded)
    odd = [s for s in bounded.query_spans() if "odd" in s.attributes]
    assert len(odd) == 2 and all(math.isnan(s.attributes["odd"]) for s in odd)  # NaN survives the spill file
    assert {s.rollout_id for s in odd} & bounded._spilled_rollouts
    assert bounded.rollouts_df()["reward"].fillna(-1).tolist() == free.rollouts_df()["reward"].fillna(-1).tolist()


def test_bad_memory_options_name_the_field():
    with pytest.raises(ConfigError, match="max_spans"):
        InMemoryStore(max_spans=0)
    with pytest.raises(ConfigError, match="max_spans"):
        InMemoryStore(spill_path="x.db")
