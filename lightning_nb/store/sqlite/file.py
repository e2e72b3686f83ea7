"""The SQLite file under :class:`~lightning_nb.store.sqlite.SqliteStore`: its schema, one-writer lock, JSON rows.

* :data:`MIGRATIONS`: the schema as a named list of SQL scripts, applied in order, each once
  (``SqliteStore`` records them in the file's ``_migrations`` table), the span attribute keys' renames
  (:func:`rename_keys_sql`) among them;
* :func:`lock_file`: the exclusive writer lock on ``<file>.lock`` that makes a second store on
  the same file fail fast with a ConfigError instead of corrupting it;
* :func:`to_json`: the ``data`` column of every row is a model's ``model_dump_json()``.
"""

from __future__ import annotations

import errno
import os
import sqlite3
from pathlib import Path
from typing import Any, Iterator

from pydantic_core import PydanticSerializationError

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]

from lightning_nb.errors import ConfigError
from lightning_nb.semconv import RENAMED_KEYS, TOOL_SPAN_PREFIX

__all__ = ["MIGRATIONS", "rename_keys_sql", "statements", "lock_file", "to_json"]


def rename_keys_sql(renamed: dict[str, dict[str, str]]) -> str:
    """SQL that renames span attribute keys in the ``spans`` table: ``renamed`` maps a span name (or
    :data:`~lightning_nb.semconv.TOOL_SPAN_PREFIX`, for every tool span) to ``{old key: new key}``.

    One ``UPDATE`` per span name, each a JSON merge patch of the span's ``attributes``: the old key set to null
    (removed) and the new one to the old one's value (a key the span does not hold patches nothing). A value that is
    JSON ``null`` is dropped rather than moved (span attributes are never null). The names and keys are the
    constants of :mod:`lightning_nb.semconv`, which hold no quote.
    """
    out = []
    for name, keys in renamed.items():
        patch = ", ".join(f"'{old}', NULL, '{new}', json_extract(data, '$.attributes.\"{old}\"')"
                          for old, new in keys.items())
        where = f"substr(name, 1, {len(name)}) = '{name}'" if name == TOOL_SPAN_PREFIX else f"name = '{name}'"
        out.append(f"UPDATE spans SET data = json_patch(data, json_object('attributes', json_object({patch}))) "
                   f"WHERE {where};")
    return "\n".join(out)


# Applied in order, each once and in its own transaction, recorded by name in ``_migrations``; never edit
# an applied one, append a new one. ``data`` holds ``model_dump_json()``; other columns index and order.
MIGRATIONS: list[tuple[str, str]] = [
    ("001_initial", """
        CREATE TABLE rollouts (
            seq INTEGER PRIMARY KEY AUTOINCREMENT,  -- enqueue order
            rollout_id TEXT NOT NULL UNIQUE, status TEXT NOT NULL,
            queue_pos INTEGER,                      -- NULL unless waiting in the queue
            data TEXT NOT NULL);
        CREATE INDEX rollouts_queue ON rollouts(queue_pos) WHERE queue_pos IS NOT NULL;
        CREATE TABLE attempts (
            attempt_id TEXT PRIMARY KEY, rollout_id TEXT NOT NULL REFERENCES rollouts(rollout_id),
            sequence_id INTEGER NOT NULL, status TEXT NOT NULL, data TEXT NOT NULL,
            UNIQUE (rollout_id, sequence_id));
        CREATE INDEX attempts_status ON attempts(status);
        CREATE TABLE spans (
            attempt_id TEXT NOT NULL REFERENCES attempts(attempt_id), sequence_id INTEGER NOT NULL,
            rollout_id TEXT NOT NULL, name TEXT NOT NULL, data TEXT NOT NULL,
            PRIMARY KEY (attempt_id, sequence_id)) WITHOUT ROWID;
        CREATE TABLE resources (
            seq INTEGER PRIMARY KEY AUTOINCREMENT,  -- the highest is the latest
            resources_id TEXT NOT NULL UNIQUE, data TEXT NOT NULL);
    """),
    ("002_workers", """
        CREATE TABLE workers (
            seq INTEGER PRIMARY KEY AUTOINCREMENT,  -- first seen order
            worker_id TEXT NOT NULL UNIQUE, data TEXT NOT NULL);
    """),
    ("003_span_ids", """
        ALTER TABLE spans ADD COLUMN span_id TEXT;
        UPDATE spans SET span_id = json_extract(data, '$.span_id');
        CREATE INDEX spans_span_id ON spans(attempt_id, span_id);
    """),
    # spans of a few kB (LLM prompts, completions, token IDs) are stored faster in a rowid table: SQLite
    # keeps WITHOUT ROWID tables for small rows (inserts of 3 kB spans took ~1.7x as long)
    ("004_spans_rowid", """
        CREATE TABLE spans_rowid (
            attempt_id TEXT NOT NULL REFERENCES attempts(attempt_id), sequence_id INTEGER NOT NULL,
            rollout_id TEXT NOT NULL, name TEXT NOT NULL, data TEXT NOT NULL, span_id TEXT,
            UNIQUE (attempt_id, sequence_id));
        INSERT INTO spans_rowid (attempt_id, sequence_id, rollout_id, name, data, span_id)
            SELECT attempt_id, sequence_id, rollout_id, name, data, span_id FROM spans ORDER BY attempt_id, sequence_id;
        DROP TABLE spans;
        ALTER TABLE spans_rowid RENAME TO spans;
        CREATE INDEX spans_span_id ON spans(attempt_id, span_id);
    """),
    # the span attribute keys under one naming rule (gen_ai.* where OpenTelemetry has one, lightning_nb.*
    # otherwise): a file written before it has bare keys ("reward", "temperature", "logprobs"...)
    ("005_semconv_keys", rename_keys_sql(RENAMED_KEYS)),
    # which update of which learner trained on each rollout (lightning_nb.store.trained); several per rollout allowed
    ("006_trained", """
        CREATE TABLE trained (
            seq INTEGER PRIMARY KEY AUTOINCREMENT,  -- mark order
            rollout_id TEXT NOT NULL REFERENCES rollouts(rollout_id), data TEXT NOT NULL);
        CREATE INDEX trained_rollout ON trained(rollout_id);
    """),
]


def statements(script: str) -> Iterator[str]:
    """Complete SQL statements of a migration script (``executescript`` would commit mid-migration)."""
    current = ""
    for line in script.splitlines(keepends=True):
        current += line
        if sqlite3.complete_statement(current):
            yield current
            current = ""
    if current.strip():
        yield current


def lock_file(path: Path) -> int:
    """Take the exclusive writer lock of the database ``path`` (on ``<path>.lock``); the open lock fd.

    Closing the fd (or the death of the process) releases it. The lock file sits next to the
    real file (symlinks resolved), so two names of one database share one lock.

    Raises:
        ConfigError: another store holds the lock (its process id is named when known).
    """
    real = Path(os.path.realpath(path))
    lock_path = real.with_name(real.name + ".lock")
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by exec'd children (PEP 446)
    try:
        _try_lock(fd)
    except OSError as exc:
        holder = _lock_holder(fd)
        os.close(fd)
        if not isinstance(exc, BlockingIOError) and exc.errno not in _LOCK_HELD_ERRNOS:
            raise
        if holder == str(os.getpid()):
            who = "by another SqliteStore object in this process"
        elif holder.isdigit():
            who = f"by process {holder}"
        else:
            who = "by another SqliteStore"
        raise ConfigError(
            f"{str(path)!r} is already open {who}; SqliteStore allows one writer per file (the lock is "
            f"{str(lock_path)!r}). Close the other store first (store.close(), or a `with SqliteStore(...)` "
            f"block), or use one store object per file and share it, or serve it with "
            f"StoreServer(store).start() and connect other processes with StoreClient(url)") from None
    try:  # who holds it, for the message above; best effort
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, str(os.getpid()).encode())
    except OSError:
        pass
    return fd


def _lock_holder(fd: int) -> str:
    """The process id written in a lock file by its holder ('' if unreadable)."""
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        return os.read(fd, 32).decode(errors="replace").strip()
    except OSError:
        return ""


_LOCK_HELD_ERRNOS = {errno.EACCES, errno.EAGAIN, getattr(errno, "EDEADLOCK", errno.EDEADLK)}


def _try_lock(fd: int) -> None:
    """Lock ``fd`` exclusively without waiting; OSError (BlockingIOError on POSIX) if it is held elsewhere."""
    if fcntl is not None:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    else:  # Windows: a byte-range lock on the first byte, released when the fd closes
        import msvcrt

        msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)


def to_json(model: Any, what: str) -> str:
    """``model.model_dump_json()``; ConfigError naming ``what`` when it holds something JSON cannot carry."""
    try:
        return model.model_dump_json()
    except PydanticSerializationError as exc:
        raise ConfigError(f"SqliteStore stores JSON: {what} must be JSON-serializable ({exc})") from None
