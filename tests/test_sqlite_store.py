"""SqliteStore-specific behaviour: persistence, migrations, crash recovery (the contract suite runs via conftest)."""

from __future__ import annotations

import os
import queue
import random
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

import lightning_nb.store.sqlite.store as sqlite_mod
from lightning_nb import semconv
from lightning_nb.adapter import TripletAdapter
from lightning_nb.errors import ConfigError, InvalidStatusTransition, LightningNbError, NotFoundError
from lightning_nb.store import SqliteStore
from lightning_nb.types import LLMResource, RolloutConfig, Span

REPO = Path(__file__).resolve().parents[1]


def _span(rollout_id, attempt_id, name="x", **attrs):
    return Span(rollout_id=rollout_id, attempt_id=attempt_id, trace_id="t" * 32, span_id=uuid.uuid4().hex[:16],
                name=name, start_time=1.0, end_time=2.0, attributes=attrs)


def _dump(path) -> list[str]:
    """Every row of the database, read through a separate connection."""
    db = sqlite3.connect(str(path))
    try:
        return list(db.iterdump())
    finally:
        db.close()


def test_reopen_restores_everything_and_queue_order(tmp_path):
    path = tmp_path / "store.db"
    with SqliteStore(path) as s:
        res = s.add_resources({"main_llm": LLMResource(endpoint="http://127.0.0.1:9/v1", model="m")})
        ids = [s.enqueue_rollout({"i": i, "xs": [i, i + 1]}, mode="val", resources_id=res.resources_id,
                                 config=RolloutConfig(max_attempts=2, timeout_seconds=5.0),
                                 metadata={"group": i}).rollout_id for i in range(4)]
        item = s.dequeue_rollout("w0")
        rid, aid = item.rollout.rollout_id, item.attempt.attempt_id
        s.update_attempt(rid, aid, status="running", heartbeat=True)
        s.add_span(_span(rid, aid, "llm", prompt_ids=[1, 2, 3], logprobs=[-0.5, -0.25], text="hi", ok=True))
        s.add_span(_span(rid, aid, "reward", **{semconv.REWARD: 0.5}))
        s.update_attempt(rid, aid, status="failed", error="boom")  # requeued: goes to the back
        s.cancel_rollout(ids[2])
        before = (s.query_rollouts(), s.query_attempts(), s.query_spans(), s.get_latest_resources())
    with SqliteStore(path) as s:
        assert (s.query_rollouts(), s.query_attempts(), s.query_spans(), s.get_latest_resources()) == before
        assert s.get_rollout_by_id(ids[0]).input == {"i": 0, "xs": [0, 1]}
        llm = s.query_spans(rid, aid)[0]
        assert llm.attributes["prompt_ids"] == [1, 2, 3] and all(type(x) is int for x in llm.attributes["prompt_ids"])
        assert llm.attributes["logprobs"] == [-0.5, -0.25] and llm.attributes["ok"] is True
        # requeuing is not terminal: no final reward yet (rules.final_reward), though its reward span is kept
        assert s.final_reward(rid) is None and s.get_rollout_by_id(rid).status == "requeuing"
        assert [x.attributes[semconv.REWARD] for x in s.query_spans(rid, aid) if x.name == "reward"] == [0.5]
        assert [s.dequeue_rollout().rollout.rollout_id for _ in range(3)] == [ids[1], ids[3], ids[0]]
        assert s.dequeue_rollout() is None
        assert s.query_attempts(ids[0])[-1].sequence_id == 2


def test_reopen_marks_in_flight_attempts_unresponsive(tmp_path):
    path = tmp_path / "store.db"
    with SqliteStore(path) as s:
        once = s.enqueue_rollout("once").rollout_id
        twice = s.enqueue_rollout("twice", config=RolloutConfig(max_attempts=2)).rollout_id
        done = s.enqueue_rollout("done").rollout_id
        waiting = s.enqueue_rollout("waiting").rollout_id
        a1 = s.dequeue_rollout().attempt
        s.update_attempt(once, a1.attempt_id, status="running")
        s.dequeue_rollout()  # twice: left in "preparing"
        a3 = s.dequeue_rollout().attempt
        s.update_attempt(done, a3.attempt_id, status="succeeded")
    with SqliteStore(path) as s:
        assert [r.status for r in s.query_rollouts()] == ["failed", "requeuing", "succeeded", "queuing"]
        for rid in (once, twice):
            (attempt,) = s.query_attempts(rid)
            assert attempt.status == "unresponsive" and attempt.end_time is not None
            assert "reopened" in attempt.error
        assert [s.dequeue_rollout().rollout.rollout_id for _ in range(2)] == [waiting, twice]
        with pytest.raises(InvalidStatusTransition, match="unresponsive"):
            s.update_attempt(once, a1.attempt_id, status="succeeded")
    with SqliteStore(path) as s:  # the retry of `twice` is now in flight; `waiting` too
        assert s.get_rollout_by_id(twice).status == "failed"
        assert s.get_rollout_by_id(waiting).status == "failed"
        assert s.get_rollout_by_id(done).status == "succeeded"


def test_migrations_are_recorded_and_applied_once(tmp_path, monkeypatch):
    path = tmp_path / "store.db"

    def applied():
        db = sqlite3.connect(str(path))
        try:
            return db.execute("SELECT name, applied_at FROM _migrations ORDER BY rowid").fetchall()
        finally:
            db.close()

    names = [name for name, _ in sqlite_mod.MIGRATIONS]
    assert names[:2] == ["001_initial", "002_workers"]
    monkeypatch.setattr(sqlite_mod, "MIGRATIONS", sqlite_mod.MIGRATIONS[:1])  # a file made before 002 existed
    with SqliteStore(path) as s:
        s.enqueue_rollout("old")
    monkeypatch.undo()
    with SqliteStore(path) as s:  # upgraded in place: only the missing migrations run
        assert [r.input for r in s.query_rollouts()] == ["old"] and s.update_worker("w").worker_id == "w"
    first = applied()
    assert [name for name, _ in first] == names
    SqliteStore(path).close()
    assert applied() == first

    extra = ("900_extra", "CREATE TABLE extra (x INTEGER);\nCREATE INDEX extra_x ON extra(x);")
    monkeypatch.setattr(sqlite_mod, "MIGRATIONS", [*sqlite_mod.MIGRATIONS, extra])
    with SqliteStore(path) as s:
        s.enqueue_rollout("t")
    assert applied()[0] == first[0] and [n for n, _ in applied()] == [*names, "900_extra"]

    broken = ("901_broken", "CREATE TABLE half (x INTEGER);\nINSERT INTO no_such_table VALUES (1);")
    monkeypatch.setattr(sqlite_mod, "MIGRATIONS", [*sqlite_mod.MIGRATIONS, broken])
    with pytest.raises(sqlite3.OperationalError, match="no_such_table"):
        SqliteStore(path)
    assert [n for n, _ in applied()] == [*names, "900_extra"]
    assert "half" not in " ".join(_dump(path))  # the failed migration rolled back whole


def test_a_file_from_before_span_ids_were_indexed_keeps_its_spans_and_gets_the_span_id_rule(tmp_path, monkeypatch):
    path = tmp_path / "store.db"
    monkeypatch.setattr(sqlite_mod, "MIGRATIONS", sqlite_mod.MIGRATIONS[:2])  # a file made before 003_span_ids
    with SqliteStore(path) as s:
        rid = s.enqueue_rollout("old").rollout_id
        aid = s.dequeue_rollout("w").attempt.attempt_id
        s.update_attempt(rid, aid, status="succeeded")  # else reopening ends it unresponsive: it takes no new span
    monkeypatch.undo()
    old = _span(rid, aid, "llm")
    db = sqlite3.connect(str(path))  # a span as the older code wrote it (no span_id column)
    db.execute("INSERT INTO spans (attempt_id, sequence_id, rollout_id, name, data) VALUES (?, 1, ?, 'llm', ?)",
               (aid, rid, old.model_copy(update={"sequence_id": 1}).model_dump_json()))
    db.commit()
    db.close()
    with SqliteStore(path) as s:
        assert [sp.span_id for sp in s.query_spans(rid)] == [old.span_id]
        assert s.add_span(old).sequence_id == 1 and len(s.query_spans(rid)) == 1  # the same write: found by its id
        with pytest.raises(ConfigError, match="already stored"):
            s.add_span(old.model_copy(update={"name": "other"}))
        assert s.add_span(_span(rid, aid, "next")).sequence_id == 2


def test_a_file_with_the_old_without_rowid_span_table_keeps_its_spans_and_their_rules(tmp_path, monkeypatch):
    path = tmp_path / "store.db"
    monkeypatch.setattr(sqlite_mod, "MIGRATIONS", sqlite_mod.MIGRATIONS[:3])  # a file made before 004_spans_rowid
    with SqliteStore(path) as s:
        rid = s.enqueue_rollout("old").rollout_id
        aid = s.dequeue_rollout("w").attempt.attempt_id
        first = s.add_span(_span(rid, aid, "llm"))
        s.add_span(_span(rid, aid, "tool"))
        s.update_attempt(rid, aid, status="succeeded")  # else reopening ends it unresponsive: it takes no new span
    monkeypatch.undo()
    table_sql = lambda: sqlite3.connect(str(path)).execute(  # noqa: E731
        "SELECT sql FROM sqlite_master WHERE name = 'spans'").fetchone()[0]
    assert "WITHOUT ROWID" in table_sql()
    with SqliteStore(path) as s:
        assert [(sp.sequence_id, sp.name) for sp in s.query_spans(rid)] == [(1, "llm"), (2, "tool")]
        assert s.add_span(first).sequence_id == 1  # the same write, found by its span_id (index kept)
        with pytest.raises(ConfigError, match="sequence_id=2 is taken"):  # (attempt, sequence id) still unique
            s.add_span(_span(rid, aid, "x").model_copy(update={"sequence_id": 2}))
        assert s.add_spans([_span(rid, aid, "next")])[0].sequence_id == 3
        assert list(s.spans_df(rid)["name"]) == ["llm", "tool", "next"]
    assert "WITHOUT ROWID" not in table_sql()


def test_a_file_with_the_bare_span_keys_reads_under_the_naming_rule(tmp_path, monkeypatch):
    """A file written before the keys' naming rule (``005_semconv_keys``) holds bare keys ("reward", "temperature",
    "prompt_token_ids", "tool.output"...): reopened, its spans carry the semconv keys, so rewards, the frames and
    the adapter read it as they read a new file; a key of the agent's own span with an old name stays as it is."""
    path = tmp_path / "store.db"
    monkeypatch.setattr(sqlite_mod, "MIGRATIONS", sqlite_mod.MIGRATIONS[:4])  # a file made before 005_semconv_keys
    llm = {"gen_ai.request.model": "m", "gen_ai.prompt": "[]", "gen_ai.completion": "4", "prompt_token_ids": [1, 2],
           "completion_token_ids": [3, 4], "logprobs": [-0.5, -0.25], "temperature": 0.7, "top_p": 1.0,
           "max_tokens": 8, "stop": ["\n"], "weight_version": 2, "engine": "TransformersEngine", "choice_index": 0,
           "n": 1, "gen_ai.request.tools": '[{"type": "function"}]', "gen_ai.response.tool_calls": "[]"}
    with SqliteStore(path) as s:  # the spans as the old code wrote them: the same JSON, other keys
        rid = s.enqueue_rollout("old").rollout_id
        aid = s.dequeue_rollout("w").attempt.attempt_id
        s.add_span(_span(rid, aid, "llm.chat.completions", **llm))
        s.add_span(_span(rid, aid, "tool:calc", **{"tool.name": "calc", "tool.input": '{"e": "2+2"}',
                                                    "tool.output": "4"}))
        s.add_span(_span(rid, aid, "intermediate_reward", reward=0.25, **{"reward.name": "step"}))
        s.add_span(_span(rid, aid, "x", error="mine", n=3, reward=9.0))  # the agent's own span and keys
        s.add_span(_span(rid, aid, "reward", reward=1.0, **{"reward.source": "human", "reward.note": "ok"}))
        s.update_attempt(rid, aid, status="succeeded")
    monkeypatch.undo()
    with SqliteStore(path) as s:
        spans = {sp.name: sp.attributes for sp in s.query_spans(rid)}
        assert spans["llm.chat.completions"] == {
            semconv.REQUEST_MODEL: "m", semconv.PROMPT: "[]", semconv.COMPLETION: "4",
            semconv.PROMPT_TOKEN_IDS: [1, 2], semconv.COMPLETION_TOKEN_IDS: [3, 4], semconv.LOGPROBS: [-0.5, -0.25],
            semconv.APPLIED_TEMPERATURE: 0.7, semconv.APPLIED_TOP_P: 1.0, semconv.APPLIED_MAX_TOKENS: 8,
            semconv.APPLIED_STOP: ["\n"], semconv.WEIGHT_VERSION: 2, semconv.ENGINE: "TransformersEngine",
            semconv.CHOICE_INDEX: 0, semconv.CHOICES: 1, semconv.REQUEST_TOOLS: '[{"type": "function"}]',
            semconv.RESPONSE_TOOL_CALLS: "[]"}
        assert spans["tool:calc"] == {semconv.TOOL_NAME: "calc", semconv.TOOL_INPUT: '{"e": "2+2"}',
                                      semconv.TOOL_OUTPUT: "4"}  # JSON text stays text
        assert spans["intermediate_reward"] == {semconv.REWARD: 0.25, semconv.REWARD_NAME: "step"}
        assert spans["reward"] == {semconv.REWARD: 1.0, semconv.REWARD_SOURCE: "human", semconv.REWARD_NOTE: "ok"}
        assert spans["x"] == {"error": "mine", "n": 3, "reward": 9.0}
        assert s.final_rewards([rid]) == {rid: 1.0}
        assert s.spans_df(rid).set_index("name")["reward"].dropna().to_dict() == {"intermediate_reward": 0.25,
                                                                                   "reward": 1.0}
        (triplet,) = TripletAdapter().adapt(s, [rid])
        assert (triplet.prompt_ids, triplet.response_ids, triplet.temperature) == ([1, 2], [3, 4], 0.7)
        assert triplet.reward == 1.0 and triplet.weight_version == 2 and triplet.logprobs == [-0.5, -0.25]
    with SqliteStore(path) as s:  # recorded: a reopen renames nothing again
        assert {sp.name: sp.attributes for sp in s.query_spans(rid)} == spans


def test_bad_calls_raise_and_leave_the_database_unchanged(tmp_path):
    path = tmp_path / "store.db"
    with SqliteStore(path) as s:
        r = s.enqueue_rollout("t")
        a = s.dequeue_rollout().attempt
        s.add_span(_span(r.rollout_id, a.attempt_id))
        s.update_attempt(r.rollout_id, a.attempt_id, status="succeeded")
        before = _dump(path)
        with pytest.raises(NotFoundError, match="at-missing"):
            s.add_span(_span(r.rollout_id, "at-missing"))
        with pytest.raises(NotFoundError, match="ro-missing"):
            s.add_span(_span("ro-missing", a.attempt_id))
        with pytest.raises(InvalidStatusTransition):
            s.update_attempt(r.rollout_id, a.attempt_id, status="running", error="must not be kept")
        with pytest.raises(InvalidStatusTransition):
            s.cancel_rollout(r.rollout_id)
        with pytest.raises(NotFoundError):
            s.enqueue_rollout("t", resources_id="res-nope")
        with pytest.raises(ConfigError, match="JSON"):
            s.enqueue_rollout(object())
        with pytest.raises(ConfigError):
            s.add_resources({"main_llm": 42})
        assert _dump(path) == before
        assert s.query_attempts(r.rollout_id)[0].error is None


def test_close_is_idempotent_and_later_calls_raise(tmp_path):
    s = SqliteStore(tmp_path / "sub" / "store.db")  # parent folders are created
    s.enqueue_rollout("t")
    s.close()
    s.close()
    with pytest.raises(LightningNbError, match="closed"):
        s.query_rollouts()
    assert "store.db" in repr(s)


def test_synchronous_option_and_group_commit(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="synchronous"):
        SqliteStore(tmp_path / "bad.db", synchronous="OFF")
    with SqliteStore(tmp_path / "normal.db", synchronous="NORMAL") as s:
        assert s.synchronous == "NORMAL" and "NORMAL" in repr(s)
        s.enqueue_rollout("t")
    fsyncs = []
    real = sqlite_mod._fdatasync
    monkeypatch.setattr(sqlite_mod, "_fdatasync", lambda fd: (fsyncs.append(fd), real(fd)))  # counts real fsyncs
    path = tmp_path / "full.db"
    with SqliteStore(path) as s:
        assert s.synchronous == "FULL"
        items = [s.start_rollout(i) for i in range(4)]
        synced_after_return = []

        def write(item):
            for k in range(40):
                s.add_span(_span(item.rollout.rollout_id, item.attempt.attempt_id, k=k))
                synced_after_return.append(s._synced >= 1)

        threads = [threading.Thread(target=write, args=(item,)) for item in items]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert s._synced == s._commits and all(synced_after_return)
        commits = s._commits
    # every commit was covered by an fsync before its call returned; threads shared some of them
    assert 0 < len(fsyncs) <= commits
    with SqliteStore(path) as s:
        assert [len(s.query_spans(i.rollout.rollout_id)) for i in items] == [40] * 4


def test_enqueue_rollouts_is_one_durable_commit_all_or_none(tmp_path, monkeypatch):
    fsyncs = []
    real = sqlite_mod._fdatasync
    monkeypatch.setattr(sqlite_mod, "_fdatasync", lambda fd: (fsyncs.append(fd), real(fd)))
    path = tmp_path / "s.db"
    with SqliteStore(path) as s:
        res = s.add_resources({"main_llm": LLMResource(endpoint="http://127.0.0.1:9/v1", model="m")})
        s.enqueue_rollout("first")
        commits, synced = s._commits, len(fsyncs)
        out = s.enqueue_rollouts([{"q": i} for i in range(5)], mode="val", metadata={"group_id": "g"})
        assert s._commits == commits + 1 and len(fsyncs) == synced + 1  # one transaction, one fsync
        assert [r.input for r in out] == [{"q": i} for i in range(5)]
        assert {(r.mode, r.resources_id, r.metadata["group_id"], r.status) for r in out} == \
            {("val", res.resources_id, "g", "queuing")}
        # all or none: a bad input or an unknown resources set stores nothing, and says which
        with pytest.raises(ConfigError, match=r"inputs\[1\].*JSON"):
            s.enqueue_rollouts(["ok", object(), "ok too"])
        with pytest.raises(NotFoundError, match="nope"):
            s.enqueue_rollouts(["a", "b"], resources_id="nope")
        assert s.enqueue_rollouts([]) == []
        assert len(s.query_rollouts()) == 6
    with SqliteStore(path) as s:  # durable, and queued in order after the earlier one
        inputs = [s.dequeue_rollout().rollout.input for _ in range(6)]
        assert inputs == ["first"] + [{"q": i} for i in range(5)] and s.dequeue_rollout() is None


# ----- crash recovery in a real process killed with SIGKILL -----------------------------------

# A long-lived helper imports lightning_nb once (about a second) and forks one worker per trial, so
# 20 trials stay fast. Each worker is a separate process that opens the store itself, prints one
# line per acknowledged write and keeps writing until it is killed.
_ZYGOTE = r'''
import os, sys, time
from lightning_nb.store.sqlite.store import SqliteStore
from lightning_nb.types import RolloutConfig, Span

MAX_ATTEMPTS = [1, 2, 2, 1]

def emit(*parts):
    os.write(1, (" ".join(map(str, parts)) + "\n").encode())  # one write(): a whole line or nothing

def work(path, synchronous):
    emit("PID", os.getpid())
    store = SqliteStore(path, synchronous=synchronous)
    emit("RES", store.add_resources({"main_llm": {"endpoint": "http://127.0.0.1:9/v1", "model": "m"}}).resources_id)
    for i, n in enumerate(MAX_ATTEMPTS):
        emit("ENQ", store.enqueue_rollout({"i": i}, config=RolloutConfig(max_attempts=n)).rollout_id)
    inflight = []
    for i in range(3):
        item = store.dequeue_rollout("w")
        rid, aid = item.rollout.rollout_id, item.attempt.attempt_id
        emit("DEQ", rid, aid)
        if i < 2:  # the third one stays "preparing"
            store.update_attempt(rid, aid, status="running")
            emit("RUN", rid, aid)
        inflight.append((rid, aid))
    emit("READY")
    k, deadline = 0, time.monotonic() + 20
    while time.monotonic() < deadline:
        for rid, aid in inflight:
            span = Span(rollout_id=rid, attempt_id=aid, trace_id="t" * 32, span_id="%016x" % k, name="s%d" % k,
                        start_time=1.0, end_time=2.0, attributes={"k": k, "token_ids": [k, k + 1, k + 2]})
            emit("SPAN", rid, aid, store.add_span(span).sequence_id, k)
        emit("ENQ", store.enqueue_rollout({"i": 100 + k}).rollout_id)
        k += 1

while True:
    line = sys.stdin.readline().split()
    if not line:
        break
    path, synchronous = line
    pid = os.fork()
    if pid == 0:
        try:
            work(path, synchronous)
        except BaseException as exc:
            emit("ERR", repr(exc))
        finally:
            os._exit(3)
    emit("DONE", os.waitpid(pid, 0)[1])
'''


class _Lines:
    """Lines of a process's stdout, read by a thread so every wait has a timeout."""

    def __init__(self, stream) -> None:
        self._q: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, args=(stream,), daemon=True).start()

    def _pump(self, stream) -> None:
        for line in stream:
            self._q.put(line.rstrip("\n"))
        self._q.put(None)

    def next(self, timeout: float = 10.0) -> str:
        try:
            line = self._q.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no output from the helper process within {timeout}s") from None
        assert line is not None, "the helper process exited"
        assert not line.startswith("ERR"), line
        return line


@pytest.mark.parametrize("synchronous", ["FULL", "NORMAL"])  # NORMAL only gives up on OS crashes, not kill -9
def test_sigkill_keeps_every_acknowledged_write_and_recovers_in_flight_attempts(tmp_path, synchronous):
    script = tmp_path / "zygote.py"
    script.write_text(_ZYGOTE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    stderr = open(tmp_path / "zygote.err", "w")
    proc = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=stderr, text=True, env=env, cwd=tmp_path, start_new_session=True)
    lines = _Lines(proc.stdout)
    rng = random.Random(1234)
    t0 = time.monotonic()
    try:
        for trial in range(20):
            path = tmp_path / f"trial{trial}.db"
            proc.stdin.write(f"{path} {synchronous}\n")
            proc.stdin.flush()
            seen = [lines.next(timeout=30 if trial == 0 else 10)]
            pid = int(seen[0].split()[1])
            while seen[-1] != "READY":
                seen.append(lines.next())
            for _ in range(rng.randint(0, 40)):
                seen.append(lines.next())
            os.kill(pid, signal.SIGKILL)
            while not seen[-1].startswith("DONE"):
                seen.append(lines.next())  # what it acknowledged before it died
            status = int(seen.pop().split()[1])
            assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, f"trial {trial}: {status}"
            _check_recovered(path, seen)
        assert time.monotonic() - t0 < 60
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the helper and a worker a failed trial left running
        proc.wait(10)
        stderr.close()


def _check_recovered(path: Path, seen: list[str]) -> None:
    acked = [line.split() for line in seen]
    enq = [parts[1] for parts in acked if parts[0] == "ENQ"]
    deq = [(parts[1], parts[2]) for parts in acked if parts[0] == "DEQ"]
    spans: dict[str, list[tuple[int, int]]] = {}
    for parts in acked:
        if parts[0] == "SPAN":
            spans.setdefault(parts[2], []).append((int(parts[3]), int(parts[4])))
    with SqliteStore(path) as s:
        (res,) = [parts[1] for parts in acked if parts[0] == "RES"]
        assert s.get_latest_resources().resources_id == res
        stored = [r.rollout_id for r in s.query_rollouts()]
        # every acknowledged enqueue is there, in order; at most one unacknowledged one follows
        assert stored[: len(enq)] == enq and len(stored) - len(enq) in (0, 1)
        expected = ["failed", "requeuing", "requeuing", "queuing"]
        assert [s.get_rollout_by_id(rid).status for rid in enq[:4]] == expected
        assert {r.status for r in s.query_rollouts()[4:]} <= {"queuing"}
        for rid, aid in deq:
            (attempt,) = s.query_attempts(rid)
            assert attempt.attempt_id == aid and attempt.status == "unresponsive" and "reopened" in attempt.error
            got = s.query_spans(rid, aid)
            mine = spans.get(aid, [])
            assert [x.sequence_id for x in got] == list(range(1, len(got) + 1))
            assert len(got) - len(mine) in (0, 1)
            for span, (seq, k) in zip(got, mine):
                assert span.sequence_id == seq and span.attributes == {"k": k, "token_ids": [k, k + 1, k + 2]}
        # queue order survives: never-dequeued rollouts first, then the requeued ones
        order = []
        while (item := s.dequeue_rollout()) is not None:
            order.append(item.rollout.rollout_id)
        assert order == [enq[3], *stored[4:], enq[1], enq[2]]


# ----- one writer per file ---------------------------------------------------------------------
def _open_in_subprocess(path: Path) -> subprocess.CompletedProcess:
    """Open the store in a fresh Python process; print the statuses of its attempts."""
    code = ("import sys\nfrom lightning_nb.store import SqliteStore\n"
            "with SqliteStore(sys.argv[1]) as s:\n    print([a.status for a in s.query_attempts()])\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, env=env,
                          timeout=60)


def _running_store(path: Path) -> tuple[SqliteStore, str, str]:
    s = SqliteStore(path)
    item = s.dequeue_rollout("w0") if s.enqueue_rollout("t") else None
    s.update_attempt(item.rollout.rollout_id, item.attempt.attempt_id, status="running", heartbeat=True)
    return s, item.rollout.rollout_id, item.attempt.attempt_id


def test_a_second_store_on_the_same_file_is_refused_and_changes_nothing(tmp_path):
    path = tmp_path / "store.db"
    first, rid, aid = _running_store(path)
    before = _dump(path)
    (tmp_path / "alias.db").symlink_to(path)
    for name in (path, str(path), tmp_path / "alias.db"):  # another name of the same file is the same file
        with pytest.raises(ConfigError) as err:
            SqliteStore(name)
        message = str(err.value)
        assert str(name) in message and "this process" in message
        assert "store.close()" in message and "StoreServer" in message and "StoreClient" in message
    assert isinstance(err.value, ValueError)
    assert _dump(path) == before  # no recovery ran: the first store's attempt is still running
    assert first.query_attempts(rid)[0].status == "running"
    first.add_span(_span(rid, aid))  # the first store is unharmed
    first.close()
    with SqliteStore(path) as again:  # closed: the file opens, and recovery now runs
        assert again.query_attempts(rid)[0].status == "unresponsive"
    third = SqliteStore(path)  # a store dropped without close() releases the file when collected
    del third
    import gc

    gc.collect()
    SqliteStore(path).close()


def test_a_second_process_cannot_open_a_file_in_use(tmp_path):
    path = tmp_path / "store.db"
    first, rid, _ = _running_store(path)
    before = _dump(path)
    refused = _open_in_subprocess(path)
    assert refused.returncode != 0, refused.stdout
    assert "ConfigError" in refused.stderr and f"by process {os.getpid()}" in refused.stderr
    assert str(path) in refused.stderr and "store.close()" in refused.stderr
    assert _dump(path) == before and first.query_attempts(rid)[0].status == "running"
    first.close()
    opened = _open_in_subprocess(path)  # released on close: the other process opens it and recovers
    assert opened.returncode == 0, opened.stderr
    assert opened.stdout.strip() == "['unresponsive']"
    # a process killed with SIGKILL while holding the file releases it too: see
    # test_sigkill_keeps_every_acknowledged_write_and_recovers_in_flight_attempts, which reopens after each kill


# ----- workers after a restart -----------------------------------------------------------------
def test_reopen_marks_dead_workers_stopped_and_keeps_their_last_heartbeat(tmp_path):
    path = tmp_path / "store.db"
    with SqliteStore(path) as s:
        rid = s.enqueue_rollout("t").rollout_id
        aid = s.dequeue_rollout("w-dead").attempt.attempt_id
        s.update_attempt(rid, aid, status="running", heartbeat=True)
        s.update_worker("w-idle", status="idle")
        before = {w.worker_id: w for w in s.query_workers()}
    time.sleep(0.3)  # the "kernel restart"
    with SqliteStore(path) as s:
        after = {w.worker_id: w for w in s.query_workers()}
        dead = after["w-dead"]
        assert (dead.status, dead.current_rollout_id, dead.current_attempt_id) == ("stopped", None, None)
        assert dead.last_heartbeat_time == before["w-dead"].last_heartbeat_time  # not stamped by the recovery
        assert after["w-idle"] == before["w-idle"]  # no attempt of it was recovered: untouched
        ages = s.workers_df().set_index("worker_id")["heartbeat_age_s"]
        assert ages["w-dead"] >= 0.3 and ages["w-idle"] >= 0.3
        assert s.query_attempts(rid)[0].status == "unresponsive"


def test_reward_fast_path_agrees_with_the_generic_one(tmp_path):
    from lightning_nb.store.base import LightningStore

    with SqliteStore(tmp_path / "store.db") as s:
        retried = s.enqueue_rollout("r", config=RolloutConfig(max_attempts=2)).rollout_id
        a1 = s.dequeue_rollout().attempt.attempt_id
        s.add_span(_span(retried, a1, "reward", **{semconv.REWARD: 0.9}))  # an earlier attempt's reward never counts
        s.update_attempt(retried, a1, status="failed")
        a2 = s.dequeue_rollout().attempt.attempt_id
        for value in (0.2, None, 0.7):
            s.add_span(_span(retried, a2, "reward", **{semconv.REWARD: value}))
        s.add_span(_span(retried, a2, "llm"))
        s.update_attempt(retried, a2, status="succeeded")
        plain = s.start_rollout("no reward")
        s.update_attempt(plain.rollout.rollout_id, plain.attempt.attempt_id, status="succeeded")
        running = s.start_rollout("running").rollout.rollout_id
        s.enqueue_rollout("queued")
        ids = [r.rollout_id for r in s.query_rollouts()]
        assert s._latest_attempt_rewards(ids) == LightningStore._latest_attempt_rewards(s, ids)
        assert s._latest_attempt_rewards(ids)[retried] == [0.2, None, 0.7]
        assert s.final_rewards() == {ids[0]: 0.7, ids[1]: None, running: None, ids[3]: None}
        assert s._latest_attempt_rewards([]) == {}


def test_the_training_record_survives_reopening(tmp_path):
    with SqliteStore(tmp_path / "t.db") as store:
        rid = store.enqueue_rollout("t").rollout_id
        marks = store.mark_trained([rid], learner="traffic-a", update=2)
    with SqliteStore(tmp_path / "t.db") as store:
        assert store.query_trained() == marks and store.query_trained([rid])[0].update == 2
