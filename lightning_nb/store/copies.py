"""Copies of stored records, and the store's own writes to them, without pydantic's per-call overhead.

Every rollout, attempt, worker and resources object a store hands out is a deep copy, and the
store changes its own records as runners report (a status, a time, a worker's current attempt):
several times per rollout. pydantic's ``model_copy`` (three ``copy.copy`` calls and a private-field
pass) and its validated assignment (``validate_assignment=True`` on every model here) cost a few
µs each, which added up to a fifth of ``InMemoryStore``'s work per rollout on agent-lightning's
benchmark workload (issue 32). These helpers do the same with plain dict operations:

* :func:`deep_copy`: a deep copy of stored data (JSON-like dicts and lists copied by hand, a
  model field by field);
* :func:`put`: a store-side write of a value the store itself made and already knows to be valid
  (a status the status machine allowed, a time, an id): the field and ``model_fields_set`` as
  validated assignment leaves them. Values that come from a caller still go through validated
  assignment;
* :func:`construct`: a model from trusted, complete field values, as ``model_construct`` makes it;
* :data:`span_construct` and :func:`span_with_sequence_id`: the same for :class:`~lightning_nb.types.Span`, which
  the tracer and the stores build once per span written and read.

Each one is used only where an import-time check shows it gives exactly what pydantic does on the
installed version (same ``__dict__``, fields set, extra and private state); otherwise it is
pydantic's own call.
"""

from __future__ import annotations

import copy
from typing import Any, Optional, TypeVar

from pydantic import BaseModel

from lightning_nb.types import Attempt, AttemptedRollout, Rollout, RolloutConfig, Span, Worker

#: a pydantic model type: the copies and constructions here return the type they are given
M = TypeVar("M", bound=BaseModel)

__all__ = ["deep_copy", "put", "construct", "snapshot", "deepen", "span_construct", "span_with_sequence_id"]

_ATOMIC = frozenset({str, int, float, bool, type(None)})
_new_object, _set = object.__new__, object.__setattr__


def _copy_model_fast(model: M) -> M:
    """``model.model_copy(deep=True)`` for a model without extra or private values (the store's own)."""
    return _deepen_fast(_snapshot_fast(model))


def _copy_model_pydantic(model: M) -> M:
    return _deepen_fast(model.model_copy())  # shallow: its own __dict__, whose mutable values are replaced


def deep_copy(value: Any) -> Any:
    """A deep copy of stored data, a few times faster than ``copy.deepcopy`` / ``model_copy(deep=True)``.

    Plain dicts and lists (JSON-like data: inputs, metadata, stats) are copied by hand, a
    pydantic model field by field (its mutable fields copied the same way), anything else
    with ``copy.deepcopy``; immutable scalars are shared.
    """
    kind = type(value)
    if kind in _ATOMIC:
        return value
    if kind is dict:
        return {k: v if type(v) in _ATOMIC else deep_copy(v) for k, v in value.items()}
    if kind is list:
        return [v if type(v) in _ATOMIC else deep_copy(v) for v in value]
    if isinstance(value, BaseModel):
        if _FAST_COPY and value.__pydantic_extra__ is None and value.__pydantic_private__ is None:
            return _copy_model_fast(value)
        return _copy_model_pydantic(value)
    return copy.deepcopy(value)


def _snapshot_fast(model: M) -> M:
    """A copy of ``model`` with its own ``__dict__`` (nested values still shared); no extra or private values."""
    return _construct_fast(type(model), model.__dict__.copy(), set(model.__pydantic_fields_set__))


def _deepen_fast(model: M) -> M:
    """Replace the mutable field values of ``model`` (with its own ``__dict__``) by deep copies; returns it."""
    fields = model.__dict__
    for key, value in fields.items():
        if type(value) not in _ATOMIC:
            fields[key] = deep_copy(value)
    return model


def snapshot(model: M) -> M:
    """Under the store's lock: a copy of a stored record's own fields whose nested values (input, config,
    metadata, stats) are still shared; :func:`deepen` it after releasing the lock. Sound because a store
    never changes those nested values in place (it replaces them), so the copy stays consistent."""
    if _FAST_COPY and type(model) in _SNAPSHOT_TYPES and model.__pydantic_extra__ is None and \
            model.__pydantic_private__ is None:
        return _snapshot_fast(model)
    return deep_copy(model)


def deepen(model: M) -> M:
    """A :func:`snapshot` made a full deep copy (its nested values copied), outside the lock; returns it."""
    if type(model) in _SNAPSHOT_TYPES and _FAST_COPY:
        return _deepen_fast(model)
    return model


_SNAPSHOT_TYPES = frozenset({Rollout, Attempt})


def _put_fast(model: BaseModel, name: str, value: Any) -> None:
    model.__dict__[name] = value
    model.__pydantic_fields_set__.add(name)


def _put_pydantic(model: BaseModel, name: str, value: Any) -> None:
    setattr(model, name, value)


def _construct_fast(cls: type[M], fields: dict[str, Any], given: Optional[set[str]] = None) -> M:
    model = _new_object(cls)
    _set(model, "__dict__", fields)
    _set(model, "__pydantic_fields_set__", set(fields) if given is None else given)
    _set(model, "__pydantic_extra__", None)
    _set(model, "__pydantic_private__", None)
    return model


def _construct_pydantic(cls: type[M], fields: dict[str, Any], given: Optional[set[str]] = None) -> M:
    return cls.model_construct(_fields_set=None if given is None else set(given), **fields)


def _state(model: BaseModel) -> tuple[Any, ...]:
    return (type(model), list(model.__dict__.items()), model.__pydantic_fields_set__, model.__pydantic_extra__,
            model.__pydantic_private__)


def _fast_paths_match() -> bool:
    """Whether the fast copy, write and construct give exactly what pydantic does here (checked at import)."""
    try:
        rollout = Rollout(rollout_id="ro-1", input={"q": [1, {"a": 2}]}, metadata={"m": [1]},
                          config=RolloutConfig(max_attempts=2))
        attempt = Attempt(rollout_id="ro-1", attempt_id="at-1", sequence_id=1, worker_id="w")
        worker = Worker(worker_id="w", heartbeat_stats={"n": [1]})
        for model in (rollout, attempt, worker):
            fast, slow = _copy_model_fast(model), model.model_copy(deep=True)
            if _state(fast) != _state(slow) or fast != slow or fast.model_dump_json() != slow.model_dump_json():
                return False
            if fast.__dict__ is model.__dict__ or fast.__pydantic_fields_set__ is model.__pydantic_fields_set__:
                return False
        if rollout.metadata is _copy_model_fast(rollout).metadata or \
                rollout.config is _copy_model_fast(rollout).config:
            return False
        a, b = attempt.model_copy(deep=True), attempt.model_copy(deep=True)
        for name, value in (("status", "running"), ("end_time", 2.5), ("last_heartbeat_time", 3.0)):
            _put_fast(a, name, value)
            setattr(b, name, value)
        if _state(a) != _state(b):
            return False
        return _state(_construct_fast(AttemptedRollout, {"rollout": rollout, "attempt": attempt})) == \
            _state(AttemptedRollout.model_construct(rollout=rollout, attempt=attempt))
    except Exception:
        return False


_FAST_COPY = True  # while checking: nested models take the fast copy too
_FAST_COPY = _fast_paths_match()
#: put(model, name, value): a store-side write of a value known to be valid (no validation), as
#: validated assignment leaves the model.
put = _put_fast if _FAST_COPY else _put_pydantic
#: construct(cls, fields, given=None): a model from complete, trusted field values, as
#: ``cls.model_construct(_fields_set=given, **fields)`` makes it (``given`` None: every field counts as set).
construct = _construct_fast if _FAST_COPY else _construct_pydantic


# ----- Span -----------------------------------------------------------------------------------------------
_SPAN_FIELDS = tuple(Span.model_fields)


def _span_new(rollout_id: str, attempt_id: str, sequence_id: int, trace_id: str, span_id: str,
              parent_id: Optional[str], name: str, start_time: float, end_time: float, status: str,
              attributes: dict[str, Any]) -> Span:
    """What ``Span.model_construct`` makes from all eleven fields, in a third of its time (no per-field loop).

    Use :data:`span_construct`, which is this only where the import-time check passed.
    """
    span = _new_object(Span)
    _set(span, "__dict__", {"rollout_id": rollout_id, "attempt_id": attempt_id, "sequence_id": sequence_id,
                            "trace_id": trace_id, "span_id": span_id, "parent_id": parent_id, "name": name,
                            "start_time": start_time, "end_time": end_time, "status": status,
                            "attributes": attributes})
    _set(span, "__pydantic_fields_set__", set(_SPAN_FIELDS))
    _set(span, "__pydantic_extra__", None)
    _set(span, "__pydantic_private__", None)
    return span


def _span_new_matches_model_construct() -> bool:
    """Whether :func:`_span_new` builds exactly what this pydantic's ``model_construct`` does (checked at import)."""
    fields: dict[str, Any] = dict(rollout_id="r", attempt_id="a", sequence_id=1, trace_id="t", span_id="s",
                                  parent_id=None, name="n", start_time=1.0, end_time=2.0, status="ok",
                                  attributes={"k": [1]})
    try:
        fast, slow = _span_new(**fields), Span.model_construct(**fields)
        return (list(fast.__dict__.items()) == list(slow.__dict__.items()) and Span.__pydantic_post_init__ is None
                and all(getattr(fast, a) == getattr(slow, a) for a in ("__pydantic_fields_set__",
                                                                       "__pydantic_extra__", "__pydantic_private__"))
                and fast == slow and fast.model_dump_json() == slow.model_dump_json())
    except Exception:
        return False


def _span_model_construct(rollout_id: str, attempt_id: str, sequence_id: int, trace_id: str, span_id: str,
                          parent_id: Optional[str], name: str, start_time: float, end_time: float, status: str,
                          attributes: dict[str, Any]) -> Span:
    return Span.model_construct(rollout_id=rollout_id, attempt_id=attempt_id, sequence_id=sequence_id,
                                trace_id=trace_id, span_id=span_id, parent_id=parent_id, name=name,
                                start_time=start_time, end_time=end_time,
                                status=status,  # type: ignore[arg-type]  # a valid status: trusted values only
                                attributes=attributes)


# span_construct(rollout_id, attempt_id, sequence_id, trace_id, span_id, parent_id, name, start_time, end_time,
# status, attributes) -> Span: a Span from trusted, already valid values, without validation, exactly as
# Span.model_construct makes it. The tracer and the stores build one per span written and read, so it skips
# pydantic's per-field loop where an import-time check shows the result is identical, and is model_construct
# itself otherwise (a pydantic whose internals differ).
span_construct = _span_new if _span_new_matches_model_construct() else _span_model_construct


def _span_with_sequence_id_fast(span: Span, sequence_id: int) -> Span:
    fields = span.__dict__.copy()
    fields["sequence_id"] = sequence_id
    new = _new_object(Span)
    _set(new, "__dict__", fields)
    _set(new, "__pydantic_fields_set__", span.__pydantic_fields_set__ | _SEQUENCE_ID)
    _set(new, "__pydantic_extra__", None)
    _set(new, "__pydantic_private__", None)
    return new


def _span_with_sequence_id_pydantic(span: Span, sequence_id: int) -> Span:
    return span.model_copy(update={"sequence_id": sequence_id})


def span_with_sequence_id(span: Span, sequence_id: int) -> Span:
    """A new Span equal to ``span.model_copy(update={"sequence_id": sequence_id})`` (sharing ``span``'s
    attributes dict, as that does) without pydantic's copy machinery (a dict copy and four slot writes, about
    half the time of the former keyword-argument rebuild), where an import-time check shows it is the same."""
    if _SPAN_COPY_OK and span.__pydantic_extra__ is None and span.__pydantic_private__ is None:
        return _span_with_sequence_id_fast(span, sequence_id)
    return _span_with_sequence_id_pydantic(span, sequence_id)


_SEQUENCE_ID = frozenset({"sequence_id"})


def _span_copy_matches_model_copy() -> bool:
    """Whether :func:`_span_with_sequence_id_fast` makes exactly what ``model_copy(update=...)`` does (at import)."""
    try:
        span = Span(rollout_id="r", attempt_id="a", trace_id="t", span_id="s", name="n", start_time=1.0,
                    end_time=2.0, attributes={"k": [1]})
        fast, slow = _span_with_sequence_id_fast(span, 3), span.model_copy(update={"sequence_id": 3})
        return (list(fast.__dict__.items()) == list(slow.__dict__.items()) and fast.attributes is span.attributes
                and all(getattr(fast, a) == getattr(slow, a) for a in ("__pydantic_fields_set__",
                                                                       "__pydantic_extra__", "__pydantic_private__"))
                and fast == slow and fast.model_dump_json() == slow.model_dump_json())
    except Exception:
        return False


_SPAN_COPY_OK = _span_copy_matches_model_copy()
