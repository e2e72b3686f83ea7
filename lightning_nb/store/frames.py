"""The DataFrame views of a store (``rollouts_df``, ``episodes_df``, ``spans_df`` ...), shared by every backend.

:class:`FrameViews` is mixed into :class:`~lightning_nb.store.base.LightningStore`: each view is built
from the contract's query methods (``query_rollouts``, ``query_attempts``, ``query_spans`` ...), so a
backend gets them all by implementing the contract; a backend may build one faster (``spans_df``) as
long as it returns the same frame. Times are pandas datetimes in UTC, timezone-naive; missing values
are NaN (NaT for times).
"""

from __future__ import annotations

import json
import math
import time
from typing import TYPE_CHECKING, Any, Optional, Sequence, get_args

import pandas as pd

from lightning_nb.errors import ConfigError
from lightning_nb.semconv import COMPLETION, ERROR, JUDGE_SPAN, LLM_SPAN, REWARD, REWARD_NAME
from lightning_nb.slices import slice_labels
from lightning_nb.store.episode import Episode, build_episode
from lightning_nb.store.rules import counted_reward_spans, reward_component
from lightning_nb.store.spanframe import Flatten, check_flatten, frame_from_spans
from lightning_nb.types import (BRANCH_CALL_KEY, GROUP_ID_KEY, PARENT_ROLLOUT_KEY, ROLLOUT_TERMINAL, Attempt,
                                ResourcesUpdate, Rollout, RolloutMode, Span, Worker)

__all__ = ["FrameViews"]


class FrameViews:
    """The DataFrame views of :class:`~lightning_nb.store.base.LightningStore` (a mixin: it calls the store's
    query methods and ``final_rewards``, declared below for the type checker)."""

    if TYPE_CHECKING:  # LightningStore's contract
        def get_rollout_by_id(self, rollout_id: str) -> Rollout: ...

        def query_rollouts(self, *, status: Optional[Sequence[str]] = None,
                           rollout_ids: Optional[Sequence[str]] = None) -> list[Rollout]: ...

        def query_workers(self) -> list[Worker]: ...

        def query_attempts(self, rollout_id: Optional[str] = None) -> list[Attempt]: ...

        def query_spans(self, rollout_id: Optional[str] = None, attempt_id: Optional[str] = None) -> list[Span]: ...

        def query_resources(self) -> list[ResourcesUpdate]: ...

        def final_rewards(self, rollout_ids: Optional[Sequence[str]] = None) -> dict[str, Optional[float]]: ...

        def _latest_attempt_llm_calls(self, rollout_ids: Sequence[str]) -> dict[str, int]: ...

    def rollouts_df(self) -> pd.DataFrame:
        """One row per rollout, in enqueue order.

        Columns, most useful first: rollout_id, input (short text), status, reward (its
        final reward, :meth:`final_rewards`; NaN when None, so always for a rollout not
        yet finished), llm_calls (LLM calls of its latest attempt, :meth:`llm_call_counts`), no_llm_call
        (True for a ``succeeded`` rollout whose latest attempt never called the model: a reward
        with nothing to train on, e.g. a rollout server that answered without calling back),
        mode, num_attempts, duration_s (float seconds from start to end;
        NaN until it ended), resources_id (the set it is pinned to), enqueue_time,
        start_time, end_time (pandas datetimes in UTC, timezone-naive like
        :meth:`spans_df`; NaT when not reached yet).
        """
        rollouts = self.query_rollouts()
        rewards = self.final_rewards()  # after the rollouts: every finished one above has its reward
        calls = self._latest_attempt_llm_calls([r.rollout_id for r in rollouts])  # llm_call_counts, ids known
        rows = []
        for r in rollouts:
            row = r.model_dump(exclude={"config", "metadata", "input"})
            row["input"] = _short(r.input)
            reward = rewards.get(r.rollout_id) if r.status in ROLLOUT_TERMINAL else None
            row["reward"] = math.nan if reward is None else reward
            row["duration_s"] = _duration(r)
            row["llm_calls"] = calls[r.rollout_id]
            row["no_llm_call"] = r.status == "succeeded" and calls[r.rollout_id] == 0
            rows.append(row)
        df = pd.DataFrame(rows, columns=_ROLLOUT_COLUMNS)
        for col in ("enqueue_time", "start_time", "end_time"):
            df[col] = _epoch_to_datetime(df[col])
        for col, dtype in (("num_attempts", "int64"), ("llm_calls", "int64"), ("no_llm_call", "bool")):
            df[col] = df[col].astype(dtype)
        for col in ("reward", "duration_s"):
            df[col] = df[col].astype("float64")
        return df

    def attempts_df(self) -> pd.DataFrame:
        """One row per attempt, oldest rollout first, then by attempt.

        Columns: rollout_id, attempt_id, sequence_id (1 for the first attempt), status,
        worker_id, start_time, end_time, last_heartbeat_time (datetimes in UTC,
        timezone-naive; NaT when not reached), duration_s (float seconds from start to
        end; NaN while it runs) and error. Missing values are NaN (NaT for times), as in
        :meth:`spans_df`.
        """
        rows = []
        for a in self.query_attempts():
            row = a.model_dump()
            row["duration_s"] = math.nan if a.end_time is None else a.end_time - a.start_time
            rows.append(row)
        df = pd.DataFrame(rows, columns=_ATTEMPT_COLUMNS)
        for col in ("start_time", "end_time", "last_heartbeat_time"):
            df[col] = _epoch_to_datetime(df[col])
        df["sequence_id"] = df["sequence_id"].astype("int64")
        df["duration_s"] = df["duration_s"].astype("float64")
        for col in ("worker_id", "error"):
            df[col] = df[col].astype(object).where(df[col].notna(), math.nan)
        return df

    def resources_df(self) -> pd.DataFrame:
        """One row per resources set, least recently written first (the last row is the latest).

        Columns: resources_id, version, names (the resource names, comma-separated),
        llm (``model @ endpoint`` of each LLMResource, comma-separated), create_time and
        update_time (datetimes in UTC, timezone-naive), latest (bool) and rollouts (how many
        rollouts are pinned to the set).
        """
        updates = self.query_resources()
        pinned: dict[Optional[str], int] = {}
        for r in self.query_rollouts():
            pinned[r.resources_id] = pinned.get(r.resources_id, 0) + 1
        rows = [{
            "resources_id": u.resources_id, "version": u.version, "names": ", ".join(u.resources),
            "llm": ", ".join(f"{v.model} @ {v.endpoint}" for v in u.resources.values() if v.kind == "llm"),
            "create_time": u.create_time, "update_time": u.update_time, "latest": i == len(updates) - 1,
            "rollouts": pinned.get(u.resources_id, 0),
        } for i, u in enumerate(updates)]
        df = pd.DataFrame(rows, columns=["resources_id", "version", "names", "llm", "create_time", "update_time",
                                         "latest", "rollouts"])
        for col in ("create_time", "update_time"):
            df[col] = _epoch_to_datetime(df[col])
        for col, dtype in (("version", "int64"), ("latest", "bool"), ("rollouts", "int64")):
            df[col] = df[col].astype(dtype)
        return df

    def workers_df(self) -> pd.DataFrame:
        """One row per worker (:class:`~lightning_nb.types.Worker` fields), first seen first, plus ``heartbeat_age_s``.

        The ``*_time`` columns are datetimes in UTC, timezone-naive (NaT when missing).

        ``heartbeat_age_s`` is float seconds since the worker's last heartbeat (NaN if it
        never sent one). Only the worker itself stamps its heartbeat: the watchdog ending
        its attempt (status ``unresponsive``) or a ``SqliteStore`` reopened after its
        process died (status ``stopped``) leave it alone, so the age of a dead worker
        keeps growing.
        """
        now = time.time()
        rows = [{**w.model_dump(), "heartbeat_age_s": (now - w.last_heartbeat_time)
                 if w.last_heartbeat_time is not None else math.nan} for w in self.query_workers()]
        df = pd.DataFrame(rows, columns=[*Worker.model_fields, "heartbeat_age_s"])
        for col in ("first_seen_time", "last_heartbeat_time", "last_dequeue_time"):
            df[col] = _epoch_to_datetime(df[col])
        df["heartbeat_age_s"] = df["heartbeat_age_s"].astype("float64")
        return df

    def episode(self, rollout_id: str) -> Episode:
        """The rollout as a user reads it: its task, each LLM call's messages, reply, token IDs and
        finish_reason, the traced tool calls, the final reply, the final reward and its components, the attempt's
        status (:class:`~lightning_nb.store.episode.Episode`, from the spans of its latest attempt).

        Raises:
            NotFoundError: ``rollout_id`` is not in the store.
        """
        rollout = self.get_rollout_by_id(rollout_id)
        attempts = self.query_attempts(rollout_id)
        return build_episode(rollout, attempts[-1] if attempts else None,
                             self.query_spans(rollout_id, "latest") if attempts else [])

    def episodes(self, rollout_ids: Optional[Any] = None, *, mode: Optional[str] = None) -> list[Episode]:
        """:meth:`episode` of each of ``rollout_ids`` (None: every finished rollout, succeeded or failed, in
        enqueue order; ``mode``: only that mode's).

        Raises:
            ConfigError: ``mode`` is not a rollout mode. NotFoundError: an id is not in the store.
        """
        if mode is not None and mode not in _MODES:
            raise ConfigError(f"mode={mode!r} is not a rollout mode; use one of {list(_MODES)} or None (all)")
        if rollout_ids is None:
            rollout_ids = [r.rollout_id for r in self.query_rollouts(status=["succeeded", "failed"])
                           if mode is None or r.mode == mode]
        return [self.episode(rid) for rid in rollout_ids]

    def episodes_df(self, mode: Optional[str] = None, by: Any = None) -> pd.DataFrame:
        """One row per finished rollout (succeeded or failed): its input, completions and reward side by side.

        Args:
            mode: only rollouts of this mode (``'train'``, ``'val'`` or ``'test'``); None: every mode.
            by: a task field name (``"ops"``) or a function ``task -> label``: adds a ``slice``
                column after ``input``, the label of each rollout's input as
                :meth:`LightningRL.evaluate(by=...) <lightning_nb.algorithm.lightning_rl.LightningRL.evaluate>`
                names it (``"ops=2"``; ``str(label)`` for a function), e.g.
                ``df[(df["slice"] == "ops=2") & (df["reward"] < 1)]``.

        Returns:
            A DataFrame in enqueue order with columns rollout_id, mode, status, group_id
            (the rollout's ``metadata['group_id']``, missing if absent), input (short text),
            completions (the ``gen_ai.completion`` text of each LLM call of the latest
            attempt, in turn order, joined with ``"\n---\n"``; ``""`` without calls),
            llm_calls (how many LLM calls the latest attempt made), reward (the final
            reward, :meth:`final_rewards`: 0.0 for failed, NaN when None), attempts
            (``num_attempts``), duration_s (float seconds from start to end) and error
            (the latest attempt's error if the rollout failed, else missing). Cancelled and
            unfinished rollouts are left out. Spans no longer in the store (evicted by an
            ``InMemoryStore`` with ``max_spans``) count as no calls. Then parent_rollout_id and branch_call:
            the rollout a replay or branch copies and how many of its calls it replayed
            (:func:`lightning_nb.replay.branch`; missing for an ordinary rollout).
            :meth:`episode` gives one rollout's calls, tool calls and rewards in full.

        Reads every span once (:meth:`query_spans`), not one query per rollout.

        Raises:
            ConfigError: ``mode`` is not a rollout mode; ``by`` names a field that a rollout's
                input lacks, raised on one, or is neither a str nor callable (naming the
                rollout's position in the table, its id, and the input's keys or the exception).
        """
        if mode is not None and mode not in _MODES:
            raise ConfigError(f"mode={mode!r} is not a rollout mode; use one of {list(_MODES)} or None (all)")
        rollouts = [r for r in self.query_rollouts(status=["succeeded", "failed"]) if mode is None or r.mode == mode]
        rewards = self.final_rewards()  # after the rollouts, which are finished: each has its final reward
        latest: dict[str, Attempt] = {}
        for a in self.query_attempts():
            latest[a.rollout_id] = a  # oldest first: the last one seen is the latest
        wanted = {r.rollout_id for r in rollouts}
        completions: dict[str, list[str]] = {rid: [] for rid in wanted}
        for s in self.query_spans():  # in (rollout, attempt, sequence) order: turn order within an attempt
            if s.name == LLM_SPAN and s.rollout_id in wanted and s.attempt_id == getattr(
                    latest.get(s.rollout_id), "attempt_id", None):
                completions[s.rollout_id].append(str(s.attributes.get(COMPLETION, "")))
        rows = []
        for r in rollouts:
            reward = rewards.get(r.rollout_id)
            attempt = latest.get(r.rollout_id)
            rows.append({
                "rollout_id": r.rollout_id, "mode": r.mode, "status": r.status,
                GROUP_ID_KEY: r.metadata.get(GROUP_ID_KEY), "input": _short(r.input),
                "completions": "\n---\n".join(completions[r.rollout_id]),
                "llm_calls": len(completions[r.rollout_id]),
                "reward": math.nan if reward is None else reward, "attempts": r.num_attempts,
                "duration_s": _duration(r),
                "error": attempt.error if r.status == "failed" and attempt is not None else None,
                "parent_rollout_id": r.metadata.get(PARENT_ROLLOUT_KEY),
                "branch_call": r.metadata.get(BRANCH_CALL_KEY) if r.metadata.get(PARENT_ROLLOUT_KEY) else None,
            })
        df = pd.DataFrame(rows, columns=_EPISODE_COLUMNS)
        for col, dtype in (("llm_calls", "int64"), ("attempts", "int64"), ("reward", "float64"),
                           ("duration_s", "float64")):
            df[col] = df[col].astype(dtype)
        if by is not None:
            labels = slice_labels([r.input for r in rollouts], by, what="rollout",
                                  names=[r.rollout_id for r in rollouts])
            df.insert(df.columns.get_loc("input") + 1, "slice", pd.Series(labels, index=df.index, dtype="object"))
        return df

    def spans_df(self, rollout_id: Optional[str] = None, *, flatten: Flatten = None) -> pd.DataFrame:
        """One row per span (of every rollout, or of ``rollout_id``), in rollout enqueue order, attempt, sequence_id.

        The columns are fixed, whatever the attributes (:data:`~lightning_nb.store.spanframe.SPAN_COLUMNS`):
        rollout_id, attempt_id, sequence_id, name; prompt (``gen_ai.prompt``, the messages as
        JSON text), completion (``gen_ai.completion``), reward (``reward``), prompt_tokens and
        completion_tokens (``gen_ai.usage.input_tokens``/``output_tokens``), finish_reason
        (``gen_ai.response.finish_reasons``, joined by commas), model
        (``gen_ai.request.model``), agent_name (``gen_ai.agent.name``); status, start_time and
        end_time (datetimes, UTC, timezone-naive), duration_s (float seconds), span_id,
        trace_id, parent_id; and ``attributes``: each span's full attribute dict, a copy
        (changing it never changes the store). Missing values are NaN in every column.
        Dtypes are the same on every backend, also when there are no spans (see
        :mod:`lightning_nb.store.spanframe`). Memory grows with the spans' data, not with
        spans × distinct attribute keys.

        Args:
            rollout_id: only this rollout's spans; None: all.
            flatten: None (default): no attribute columns beyond the fixed ones. A list of
                attribute keys: those keys as columns too (named by the key; NaN where a
                span lacks it), placed before ``attributes``. True: every attribute key
                as a column, first seen first, except keys named like a fixed column;
                refused above :data:`~lightning_nb.store.spanframe.FLATTEN_MAX_KEYS`
                (1,000) distinct keys.

        Raises:
            ConfigError: a bad ``flatten`` (not None/bool/list of keys, or a key named like a
                fixed column), or ``flatten=True`` over more than 1,000 distinct keys.
            NotFoundError: ``rollout_id`` is not in the store.

        Implementations may build it faster; they must return the same frame. This one
        reads :meth:`query_spans`, whose spans the caller owns, so they are not copied again.
        """
        check_flatten(flatten)
        return frame_from_spans(self.query_spans(rollout_id), flatten=flatten, copy=False)

    def rewards_df(self) -> pd.DataFrame:
        """One row per reward span, the final reward and every named reward component.

        Columns: rollout_id, attempt_id, mode, ``component``, reward (float), time (datetime), ``judge_error``.
        ``component`` is :func:`~lightning_nb.store.rules.reward_component`'s:

        * ``"final"``: the reward span that counts, at most one per rollout
          (:func:`~lightning_nb.store.rules.counted_reward_spans`: the last one of the latest attempt of a rollout
          that did not fail and was not cancelled; :func:`~lightning_nb.store.rules.final_reward`);
        * a final reward span that does not count (a later one replaced it, e.g. a group judge's score replacing the
          agent's, or its attempt was retried, or its rollout failed): who gave it, ``"agent"``, ``"group_judge"``,
          ``"human"`` (:data:`~lightning_nb.semconv.REWARD_SOURCE`);
        * an intermediate reward (:func:`lightning_nb.emit_intermediate_reward`, a shaping term): its
          ``reward.name``, e.g. ``"calc_uses_all_numbers"``;
        * an LLM judge's score (:mod:`lightning_nb.rewards`): its ``reward.name``, ``"judge"`` by default. A judge
          that gave no score (an unusable verdict, a failed call: ``Judge(on_error="record")``) has a row too, under
          its component, with reward NaN and the error in ``judge_error`` (None on every other row).

        ``df[df.component == "final"]`` gives the rewards that count alone (a failed rollout's 0 has no row);
        ``df.pivot_table("reward", "rollout_id", "component", aggfunc="sum")`` one column per component, the
        hand-written and the judge's reward side by side.
        """
        rollouts = self.query_rollouts()
        modes = {r.rollout_id: r.mode for r in rollouts}
        status = {r.rollout_id: r.status for r in rollouts}
        latest: dict[str, str] = {}
        for a in self.query_attempts():
            latest[a.rollout_id] = a.attempt_id  # oldest first: the last one seen is the latest
        spans = self.query_spans()
        counted = counted_reward_spans(spans, latest, status)
        rows = []
        for s in spans:
            component, error = reward_component(s, (s.attempt_id, s.span_id) in counted), None
            if component is None and s.name == JUDGE_SPAN and ERROR in s.attributes:
                component, error = str(s.attributes.get(REWARD_NAME, JUDGE_SPAN)), str(s.attributes[ERROR])
            if component is not None:
                rows.append({"rollout_id": s.rollout_id, "attempt_id": s.attempt_id, "mode": modes.get(s.rollout_id),
                             "component": component, "reward": s.attributes.get(REWARD),
                             "time": pd.to_datetime(s.end_time, unit="s"), "judge_error": error})
        return pd.DataFrame(rows, columns=["rollout_id", "attempt_id", "mode", "component", "reward", "time",
                                           "judge_error"]).astype({"reward": "float64"})


def _duration(rollout: Rollout) -> float:
    """Float seconds from the rollout's start to its end; NaN until both are known."""
    if rollout.end_time is None or rollout.start_time is None:
        return math.nan
    return rollout.end_time - rollout.start_time


def _epoch_to_datetime(values: pd.Series) -> pd.Series:
    """Epoch seconds (None/NaN allowed) as datetime64 in UTC, timezone-naive (NaT where missing)."""
    return pd.to_datetime(values.astype("float64"), unit="s")


def _short(value: Any, limit: int = 120) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= limit else text[: limit - 1] + "…"


_ROLLOUT_COLUMNS = [  # what a reader looks for first: the task, how it ended, its reward
    "rollout_id", "input", "status", "reward", "llm_calls", "no_llm_call", "mode", "num_attempts", "duration_s",
    "resources_id",
    "enqueue_time", "start_time", "end_time",
]
_ATTEMPT_COLUMNS = [
    "rollout_id", "attempt_id", "sequence_id", "status", "worker_id", "start_time", "end_time",
    "last_heartbeat_time", "duration_s", "error",
]
_EPISODE_COLUMNS = [
    "rollout_id", "mode", "status", GROUP_ID_KEY, "input", "completions", "llm_calls", "reward", "attempts",
    "duration_s", "error", "parent_rollout_id", "branch_call",
]
_MODES = get_args(RolloutMode)
