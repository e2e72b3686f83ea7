"""InMemoryStore span columns, eviction and spill (bounded memory); views agree with the generic ones."""

from __future__ import annotations

import math
import sqlite3
import time
from pathlib import Path

import pandas as pd
import pytest

from lightning_nb import semconv
from lightning_nb.errors import ConfigError, LightningNbError
from lightning_nb.store import InMemoryStore
from lightning_nb.store.base import LightningStore
from lightning_nb.store.rules import final_reward
from lightning_nb.types import RolloutConfig, Span


def _reward_span(rollout_id, attempt_id, reward):
    return Span(rollout_id=rollout_id, attempt_id=attempt_id, trace_id="t", span_id="r", name="reward",
                start_time=1.0, end_time=2.0, attributes={semconv.REWARD: reward})


def _fill(store, n_rollouts=12, spans_per=5, finish=True, start=0):
    """Rollouts with LLM-like spans (varied attributes) and a final reward; spans interleaved across rollouts."""
    items = [store.dequeue_rollout("w") for _ in range(n_rollouts)
             if store.enqueue_rollout(start) is not None]
    for k in range(spans_per):
        for j, it in enumerate(reversed(items)):
            last = k == spans_per - 1
            attrs = ({semconv.REWARD: float(j % 3) / 2} if last else
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
    for flatten in (None, True):
        fast = store.spans_df(rollout_id, flatten=flatten)
        slow = LightningStore.spans_df(store, rollout_id, flatten=flatten)
        assert list(fast.columns) == list(slow.columns) and fast.dtypes.astype(str).equals(slow.dtypes.astype(str))
        pd.testing.assert_frame_equal(_plain(fast), _plain(slow), check_dtype=False)
    # the columnar fast path agrees with the generic one (which reads query_spans)
    ids = [r.rollout_id for r in store.query_rollouts()]
    assert store._latest_attempt_rewards(ids) == LightningStore._latest_attempt_rewards(store, ids)
    assert store.final_rewards() == {r.rollout_id: final_reward(r.status, LightningStore._latest_attempt_rewards(
        store, [r.rollout_id])[r.rollout_id]) for r in store.query_rollouts()}


def test_columnar_spans_df_matches_the_generic_view():
    store = InMemoryStore()
    ids = _fill(store)
    _same_views(store)
    _same_views(store, ids[3])
    df = store.spans_df()
    assert len(df) == 60 and df["name"].tolist()[:5] == ["llm"] * 4 + ["reward"]  # enqueue, attempt, seq order
    assert df.loc[0, "attributes"]["token_ids"] == [1, 2, 0] and df["reward"].notna().sum() == 12
    assert store.spans_df(flatten=["token_ids"]).loc[0, "token_ids"] == [1, 2, 0]
    assert store.spans_df(ids[0])["sequence_id"].tolist() == [1, 2, 3, 4, 5]


def test_eviction_keeps_memory_bounded_and_never_touches_running_rollouts():
    store = InMemoryStore(max_spans=40, min_span_age_s=0)  # finished spans may leave at once
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
    # the columns kept per span (well-known cells, list flags) were compacted with the rows
    fast, slow = store.spans_df(), LightningStore.spans_df(store)
    pd.testing.assert_frame_equal(_plain(fast), _plain(slow), check_dtype=False)


def test_spill_to_sqlite_loses_nothing(tmp_path):
    bounded = InMemoryStore(max_spans=25, spill_path=tmp_path / "spill.db", min_span_age_s=0)
    free = InMemoryStore()
    for store in (bounded, free):
        _fill(store, n_rollouts=12, spans_per=5)
        _fill(store, n_rollouts=3, spans_per=4, finish=False, start=1)
    assert len(bounded._table) < 25 and bounded._spill.count > 0 and bounded.evicted_spans == 0

    def dumps(store, rid=None):
        return [(s.name, s.sequence_id, s.span_id, s.attributes.get(semconv.REWARD), s.attributes.get("token_ids"))
                for s in store.query_spans(rid)]

    assert dumps(bounded) == dumps(free)
    for a, b in zip(bounded.query_rollouts(), free.query_rollouts()):
        assert dumps(bounded, a.rollout_id) == dumps(free, b.rollout_id)
        assert bounded.final_reward(a.rollout_id) == free.final_reward(b.rollout_id)
    _same_views(bounded)
    # the spill path (spans as objects) and the columnar fast path of a store that never spilled agree
    spilled, kept = (_plain(s.spans_df(flatten=True)).drop(columns=["rollout_id", "attempt_id"]) for s in (bounded, free))
    pd.testing.assert_frame_equal(spilled, kept)
    odd = [s for s in bounded.query_spans() if "odd" in s.attributes]
    assert len(odd) == 2 and all(math.isnan(s.attributes["odd"]) for s in odd)  # NaN survives the spill file
    assert {s.rollout_id for s in odd} & bounded._spilled_rollouts
    assert bounded.rollouts_df()["reward"].fillna(-1).tolist() == free.rollouts_df()["reward"].fillna(-1).tolist()


def test_bad_memory_options_name_the_field():
    with pytest.raises(ConfigError, match="max_spans"):
        InMemoryStore(max_spans=0)
    with pytest.raises(ConfigError, match="max_spans"):
        InMemoryStore(spill_path="x.db")
    for bad in (-1, "300", None, math.nan):
        with pytest.raises(ConfigError, match="min_span_age_s"):
            InMemoryStore(max_spans=10, min_span_age_s=bad)


def test_evicted_rollouts_keep_their_final_reward():
    bounded, free = InMemoryStore(max_spans=40, min_span_age_s=0), InMemoryStore()
    for store in (bounded, free):
        retried = store.enqueue_rollout("retried", config=RolloutConfig(max_attempts=2)).rollout_id
        first = store.dequeue_rollout("w").attempt.attempt_id
        store.add_span(_reward_span(retried, first, 0.9))  # the failed attempt's reward never counts
        store.update_attempt(retried, first, status="failed")
        second = store.dequeue_rollout("w").attempt.attempt_id
        store.add_span(_reward_span(retried, second, 0.25))
        store.update_attempt(retried, second, status="succeeded")
        _fill(store, n_rollouts=12, spans_per=5)
        _fill(store, n_rollouts=2, spans_per=30, finish=False, start=1)  # forces eviction of finished spans
    assert bounded.evicted_spans >= 60 and bounded.query_spans(bounded.query_rollouts()[0].rollout_id) == []

    def rewards(store):
        got = store.final_rewards()
        return [got[r.rollout_id] for r in store.query_rollouts()]

    assert rewards(bounded) == rewards(free) and rewards(bounded)[:4] == [0.25, 1.0, 0.5, 0.0]
    assert [bounded.final_reward(r.rollout_id) for r in bounded.query_rollouts()] == rewards(free)
    pd.testing.assert_series_equal(bounded.rollouts_df()["reward"], free.rollouts_df()["reward"])
    assert bounded.episodes_df()["reward"].tolist() == free.episodes_df()["reward"].tolist()
    # a late span of a finished, evicted rollout (an abandoned agent thread) lands after the kept rewards
    rid = bounded.query_rollouts()[1].rollout_id
    latest = bounded.query_attempts(rid)[-1].attempt_id
    bounded.add_span(_reward_span(rid, latest, 0.75))
    assert bounded._latest_attempt_rewards([rid])[rid][-1] == 0.75 and bounded.final_reward(rid) == 0.75


def test_spans_stay_in_memory_until_read_or_min_span_age_s():
    from lightning_nb.adapter import TripletAdapter

    store = InMemoryStore(max_spans=40, min_span_age_s=3600)
    done = _fill(store, n_rollouts=12, spans_per=5)  # 60 spans of finished rollouts nobody has read
    running = _fill(store, n_rollouts=1, spans_per=10, finish=False, start=1)
    assert store.evicted_spans == 0 and len(store._table) == 70  # over max_spans, but nothing may leave yet

    def in_memory():
        return set(store.spans_df()["rollout_id"].astype(str))  # spans_df does not count as a read

    TripletAdapter().adapt(store, done[:6])  # the adapter reads query_spans(rollout_id, "latest")
    assert in_memory() == set(done) | set(running)  # reading alone frees nothing ...
    it = store.query_attempts(running[0])[0]
    store.add_span(Span(rollout_id=running[0], attempt_id=it.attempt_id, trace_id="t", span_id="x", name="late",
                        start_time=1.0, end_time=2.0))
    assert store.evicted_spans == 30 and in_memory() == set(done[6:]) | set(running)  # ... the next add_span sheds
    store.query_spans(running[0])  # read before it finished: does not count
    store.update_attempt(running[0], it.attempt_id, status="succeeded")
    store.add_span(Span(rollout_id=running[0], attempt_id=it.attempt_id, trace_id="t", span_id="y", name="late",
                        start_time=1.0, end_time=2.0))
    assert store.evicted_spans == 30 and running[0] in in_memory()

    aged = InMemoryStore(max_spans=40, min_span_age_s=0.3)
    _fill(aged, n_rollouts=12, spans_per=5)
    busy = _fill(aged, n_rollouts=1, spans_per=5, finish=False, start=1)
    assert aged.evicted_spans == 0
    time.sleep(0.35)  # finished min_span_age_s ago: they may leave unread (failed and val rollouts are never read)
    it = aged.query_attempts(busy[0])[0]
    aged.add_span(Span(rollout_id=busy[0], attempt_id=it.attempt_id, trace_id="t", span_id="x", name="late",
                       start_time=1.0, end_time=2.0))
    assert aged.evicted_spans > 0 and len(aged._table) <= 32


def test_close_checkpoints_the_spill_file_and_leaves_no_wal(tmp_path):
    path = tmp_path / "spill.db"
    with InMemoryStore(max_spans=25, spill_path=path, min_span_age_s=0) as store:
        ids = _fill(store, n_rollouts=12, spans_per=5)
        _fill(store, n_rollouts=3, spans_per=4, finish=False, start=1)
        assert store._spill.count > 0 and Path(f"{path}-wal").exists()
        rewards = store.rollouts_df()["reward"].fillna(-1).tolist()
    assert not Path(f"{path}-wal").exists() and not Path(f"{path}-shm").exists()
    store.close()  # idempotent
    db = sqlite3.connect(str(path))
    try:
        assert db.execute("SELECT COUNT(*) FROM spans").fetchone()[0] == store._spill.count  # all in the file
    finally:
        db.close()
    assert not Path(f"{path}-wal").exists()
    # rollouts and final rewards stay readable; spilled spans do not, and no span can be added
    assert store.rollouts_df()["reward"].fillna(-1).tolist() == rewards and store.final_reward(ids[0]) == 1.0
    spilled = sorted(store._spilled_rollouts)[0]
    with pytest.raises(LightningNbError, match="closed"):
        store.query_spans(spilled)
    held = len(store._table)
    it = store.query_attempts(ids[0])[0]
    with pytest.raises(LightningNbError, match="closed"):
        store.add_span(Span(rollout_id=ids[0], attempt_id=it.attempt_id, trace_id="t", span_id="x", name="late",
                            start_time=1.0, end_time=2.0))
    assert len(store._table) == held
    InMemoryStore().close()  # nothing to close without spill_path
    with InMemoryStore(max_spans=25, spill_path=path, min_span_age_s=0) as again:  # the same path: a fresh file
        assert again.query_spans() == []
