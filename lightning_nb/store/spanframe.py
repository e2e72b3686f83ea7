"""The ``spans_df()`` frame: its fixed columns, the attribute policy, and the one builder every backend uses.

Attribute policy. Span attributes are open-ended: OpenTelemetry instrumentations
write indexed keys (``gen_ai.prompt.3.content``) and every framework adds its own, so
a frame with one column per distinct key grows as spans × distinct keys (5,000 spans
with fresh keys made a 5,000 × 140,016 frame). ``spans_df()`` therefore returns a
fixed set of columns (:data:`SPAN_COLUMNS`, useful ones first), whatever the
attributes are, and one ``attributes`` column holding each span's full attribute dict
(a copy: changing it never changes the store). Attribute keys become columns only on
request (``flatten=``, see :func:`check_flatten`).

Dtypes are the same on every backend and for an empty frame: ids that repeat
(``rollout_id``, ``attempt_id``, ``name``, ``status``, ``trace_id``, ``parent_id``)
are ``category``; ``span_id`` and the text columns are ``object``; ``sequence_id`` is
``int64``; times are ``datetime64[us]`` (UTC, timezone-naive); ``duration_s``, the token
counts and ``reward`` are ``float64``. Missing values are ``NaN`` in every column (a
non-number reward or token count counts as missing), so ``isna()`` finds them all.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Optional, Sequence, Union

import numpy as np
import pandas as pd

from lightning_nb.errors import ConfigError
from lightning_nb.semconv import (
    RENAMED_KEYS, AGENT_NAME, COMPLETION, PROMPT, REQUEST_MODEL, RESPONSE_FINISH_REASONS, RESPONSE_ID, REWARD, USAGE_INPUT_TOKENS,
    USAGE_OUTPUT_TOKENS,
)
from lightning_nb.types import Span

__all__ = ["SPAN_COLUMNS", "KNOWN_ATTRIBUTES", "NUMBER_COLUMNS", "CATEGORY_COLUMNS", "FLATTEN_MAX_KEYS", "Flatten",
           "check_flatten", "copy_attributes", "copy_lists", "holds_list", "known_cells", "known_columns", "spans_frame",
           "frame_from_spans"]

#: column -> the attribute it shows (:mod:`lightning_nb.semconv`, as the LLM proxy and the tracer write them).
KNOWN_ATTRIBUTES: dict[str, str] = {
    "prompt": PROMPT,  # the request's messages, JSON text
    "completion": COMPLETION,
    "reward": REWARD,
    "prompt_tokens": USAGE_INPUT_TOKENS,
    "completion_tokens": USAGE_OUTPUT_TOKENS,
    "finish_reason": RESPONSE_FINISH_REASONS,  # a list of one reason per span: shown as text
    "model": REQUEST_MODEL,
    "agent_name": AGENT_NAME,
}
#: the :data:`KNOWN_ATTRIBUTES` columns that are float64 (the others are object).
NUMBER_COLUMNS = ("reward", "prompt_tokens", "completion_tokens")
_NUMBER_TYPES = (int, float, bool)
_PROMPT, _COMPLETION, _REWARD, _PROMPT_TOKENS, _COMPLETION_TOKENS, _FINISH, _MODEL, _AGENT = KNOWN_ATTRIBUTES.values()
#: the id columns whose values repeat a lot: ``category`` in the frame (and dictionary-encoded in a SpanTable).
CATEGORY_COLUMNS = ("rollout_id", "attempt_id", "name", "status", "trace_id", "parent_id")

#: every ``spans_df()`` column in order (flattened attributes, if asked for, go before ``attributes``).
SPAN_COLUMNS: list[str] = [
    "rollout_id", "attempt_id", "sequence_id", "name", "prompt", "completion", "reward",
    "prompt_tokens", "completion_tokens", "finish_reason", "model", "agent_name", "status",
    "start_time", "end_time", "duration_s", "span_id", "trace_id", "parent_id", "attributes",
]

#: ``flatten=True`` refuses to make more attribute columns than this.
FLATTEN_MAX_KEYS = 1000

Flatten = Union[None, bool, Sequence[str]]


def check_flatten(flatten: Flatten) -> Union[None, bool, list[str]]:
    """Validate ``spans_df``'s ``flatten``: None/False (no attribute columns), True (every key) or a list of keys.

    Returns None, True or the keys as a list (duplicates dropped, order kept).

    Raises:
        ConfigError: any other value, a key that is not a non-empty string, or a key that
            names a fixed column (read that one from the column, or from ``attributes``).
    """
    if flatten is None or flatten is False:
        return None
    if flatten is True:
        return True
    if isinstance(flatten, (str, bytes)) or not isinstance(flatten, (list, tuple)):
        raise ConfigError(f"spans_df(flatten={flatten!r}): flatten must be None (the fixed columns and "
                          f"`attributes`), True (every attribute key as a column) or a list of attribute keys, "
                          f"e.g. flatten=[{RESPONSE_ID!r}]")
    keys = list(dict.fromkeys(flatten))
    for key in keys:
        if not isinstance(key, str) or not key:
            raise ConfigError(f"spans_df(flatten=...): every key must be a non-empty string, got {key!r}")
        if key in SPAN_COLUMNS:
            raise ConfigError(f"spans_df(flatten=[{key!r}]): {key!r} is already a column of spans_df; drop it from "
                              f"flatten and read the column (or df['attributes'].str.get({key!r}))")
    return keys


def copy_attributes(attributes: dict[str, Any]) -> dict[str, Any]:
    """A copy of span attributes that shares no list with ``attributes``.

    Attribute values are scalars or flat lists of scalars (OpenTelemetry), so copying
    the lists one level deep is a full copy, and much cheaper than ``copy.deepcopy``.
    """
    return copy_lists(dict(attributes), holds_list(attributes))


def copy_lists(attributes: dict[str, Any], has_list: bool) -> dict[str, Any]:
    """``attributes`` (a fresh dict, changed in place and returned) with its list values replaced by copies.

    ``has_list`` is :func:`holds_list` of it, known already (a scan of every value costs more than the dict copy).
    """
    if has_list:
        for k, v in attributes.items():
            if type(v) is list:
                attributes[k] = v[:]
    return attributes


def known_cells(attributes: dict[str, Any]) -> tuple[Any, ...]:
    """One span's cells of the :data:`KNOWN_ATTRIBUTES` columns, in that order: the one rule for those columns.

    reward and the token counts: the value when it is an int, float or bool, else NaN; the
    texts: the value, NaN when missing; finish_reason: a list's items joined by commas.
    """
    nan, get = math.nan, attributes.get
    reward, prompt_tokens, completion_tokens = get(_REWARD), get(_PROMPT_TOKENS), get(_COMPLETION_TOKENS)
    finish = get(_FINISH)
    return (nan if (v := get(_PROMPT)) is None else v,
            nan if (v := get(_COMPLETION)) is None else v,
            reward if type(reward) in _NUMBER_TYPES else nan,
            prompt_tokens if type(prompt_tokens) in _NUMBER_TYPES else nan,
            completion_tokens if type(completion_tokens) in _NUMBER_TYPES else nan,
            ",".join(map(str, finish)) if type(finish) is list else nan if finish is None else finish,
            nan if (v := get(_MODEL)) is None else v,
            nan if (v := get(_AGENT)) is None else v)


def known_columns(cells: Sequence[Sequence[Any]]) -> dict[str, Any]:
    """The :data:`KNOWN_ATTRIBUTES` columns from each column's cells (:func:`known_cells`): float64 or object arrays."""
    return {col: np.array(values, dtype=np.float64) if col in NUMBER_COLUMNS else _objects(values)
            for col, values in zip(KNOWN_ATTRIBUTES, cells)}


def spans_frame(ids: dict[str, Any], span_id: list, sequence_id: np.ndarray, start: np.ndarray, end: np.ndarray,
                attributes: list[dict[str, Any]], *, flatten: Flatten = None, copy: bool = True,
                known: Optional[dict[str, Any]] = None, lists_at: Optional[Sequence[int]] = None) -> pd.DataFrame:
    """The ``spans_df`` frame from columns already in span order.

    Args:
        ids: for each of ``rollout_id``, ``attempt_id``, ``name``, ``status``, ``trace_id``,
            ``parent_id``: a list of strings (None where missing) or a ``pd.Categorical``.
        span_id: the span ids.
        sequence_id, start, end: int64 / float64 (epoch seconds) arrays.
        attributes: each span's attribute dict.
        flatten: see :func:`check_flatten`; a key renamed since earlier versions
            (:data:`~lightning_nb.semconv.RENAMED_KEYS`) asked for by its old name gets its new key's values, with a
            ``DeprecationWarning``.
        copy: copy the dicts into the ``attributes`` column (False when the caller owns them).
        known: the :data:`KNOWN_ATTRIBUTES` columns when the caller keeps them
            (:func:`known_columns`); None: made from ``attributes``.
        lists_at: with ``copy``, the positions of the dicts holding a list (only their lists
            need copying); None: found here.

    Raises:
        ConfigError: a bad ``flatten``, or ``flatten=True`` over more than
            :data:`FLATTEN_MAX_KEYS` distinct keys.
    """
    keys = check_flatten(flatten)
    flat = _all_keys(attributes) if keys is True else keys or []  # refused over the cap before any other work
    start, end = np.asarray(start, dtype=np.float64), np.asarray(end, dtype=np.float64)
    cols: dict[str, Any] = {col: _category(ids[col]) for col in CATEGORY_COLUMNS}
    if known is None:
        known = known_columns(list(zip(*map(known_cells, attributes))) or [[]] * len(KNOWN_ATTRIBUTES))
    for col, values in known.items():
        cols[col] = values if col in NUMBER_COLUMNS else _object_column(values)
    if copy:
        attributes = list(map(dict, attributes))  # then the lists, in the few dicts that hold any
        for i in (_holding_lists(attributes) if lists_at is None else lists_at):
            attributes[i] = copy_attributes(attributes[i])
    cols.update({"sequence_id": np.asarray(sequence_id, dtype=np.int64), "start_time": _datetimes(start),
                 "end_time": _datetimes(end), "duration_s": end - start, "span_id": _object_column(_objects(span_id)),
                 "attributes": _object_column(_objects(attributes))})
    data = {col: cols[col] for col in SPAN_COLUMNS[:-1]}
    for key in flat:
        data[key] = _attribute_column(attributes, key if keys is True else _read_key(key, attributes))
    data["attributes"] = cols["attributes"]
    return pd.DataFrame(data, copy=False)


def frame_from_spans(spans: Sequence[Span], *, flatten: Flatten = None, copy: bool = True) -> pd.DataFrame:
    """:func:`spans_frame` for spans held as objects, in the order given."""
    ids = {col: [getattr(s, col) for s in spans] for col in CATEGORY_COLUMNS}
    n = len(spans)
    return spans_frame(ids, [s.span_id for s in spans], np.fromiter((s.sequence_id for s in spans), np.int64, n),
                       np.fromiter((s.start_time for s in spans), np.float64, n),
                       np.fromiter((s.end_time for s in spans), np.float64, n),
                       [s.attributes for s in spans], flatten=flatten, copy=copy)


# ----- helpers ----------------------------------------------------------------------------
_RENAMED = {old: new for renames in RENAMED_KEYS.values() for old, new in renames.items()}


def _read_key(key: str, attributes: list[dict[str, Any]]) -> str:
    """The key whose values fill ``flatten``'s column ``key``: ``key``, or for a key of earlier versions
    (:data:`~lightning_nb.semconv.RENAMED_KEYS`) that no span holds, its new key, with a DeprecationWarning
    (the column keeps the name asked for). Only looked at for keys asked for by name, so ``spans_df`` costs the
    same without them."""
    new = _RENAMED.get(key)
    if new is None or any(dict.__contains__(a, key) for a in attributes):
        return key
    warnings.warn(f"spans_df(flatten=[{key!r}]): span attribute {key!r} is renamed {new!r} "
                  f"(lightning_nb.semconv); the column {key!r} shows {new!r}'s values. Ask for {new!r}: the old name "
                  f"stops working in the next release", DeprecationWarning, stacklevel=4)
    return new


def _all_keys(attributes: list[dict[str, Any]]) -> list[str]:
    """Every attribute key, first seen first, except the fixed column names; ConfigError over the cap."""
    seen: dict[str, None] = {}
    for a in attributes:
        seen.update(dict.fromkeys(a))
        if len(seen) > FLATTEN_MAX_KEYS + len(SPAN_COLUMNS):
            break
    keys = [k for k in seen if k not in SPAN_COLUMNS]
    if len(keys) > FLATTEN_MAX_KEYS:
        raise ConfigError(
            f"spans_df(flatten=True) would make more than {FLATTEN_MAX_KEYS:,} attribute columns: these spans have "
            f"keys that differ from span to span (e.g. {keys[-1]!r}), and one column per key grows as spans x keys. "
            f"Pass flatten=[...] with the keys you need, or read each span's dict from the `attributes` column")
    return keys


def _category(values: Any) -> pd.Categorical:
    """Strings (None where missing) as a categorical with object categories in first-seen order."""
    if isinstance(values, pd.Categorical):
        return values
    codes, uniques = pd.factorize(_objects(values), use_na_sentinel=True)
    return pd.Categorical.from_codes(codes, categories=pd.Index(uniques, dtype=object))


def _datetimes(epoch_s: np.ndarray) -> np.ndarray:
    """Epoch seconds as ``datetime64[us]`` (one resolution whatever the values; pandas would pick one per array)."""
    return np.rint(epoch_s * 1e6).astype(np.int64).astype("datetime64[us]")


def _objects(values: Sequence[Any]) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out


def _object_column(values: np.ndarray) -> pd.Series:
    """An object column (pandas would make an all-string array its ``str`` dtype: a copy of every string)."""
    return pd.Series(values, dtype=object, copy=False)


def holds_list(attributes: dict[str, Any]) -> bool:
    """Whether an attribute value is a list (a C-speed scan: most spans, without token IDs, hold none)."""
    return list in map(type, attributes.values())


def _holding_lists(attributes: list[dict[str, Any]]) -> list[int]:
    return [i for i, a in enumerate(attributes) if list in map(type, a.values())]


def _numbers(values: list) -> np.ndarray:
    """float64; NaN where missing or not a number (bools count as 0/1)."""
    return np.fromiter((v if type(v) in _NUMBER_TYPES else math.nan for v in values), np.float64, len(values))


def _attribute_column(attributes: list[dict[str, Any]], key: str) -> Any:
    """One attribute as a column: float64/int64/bool when every value is that type, else object; NaN where missing."""
    missing = object()
    values = [a.get(key, missing) for a in attributes]
    present = [v for v in values if v is not missing and v is not None]
    kinds = {type(v) for v in present}
    full = len(present) == len(values)
    if present and kinds <= {int, float}:
        if kinds == {int} and full and all(-2**63 <= v < 2**63 for v in values):
            return np.array(values, dtype=np.int64)
        return _numbers(values)
    if present and kinds == {bool} and full:
        return np.array(values, dtype=bool)
    return _object_column(_objects([math.nan if v is missing or v is None else v for v in values]))
