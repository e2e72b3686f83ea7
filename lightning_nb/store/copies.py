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
* :func:`construct`: a model from trusted, complete field values, as ``model_construct`` makes it.

Each one is used only where an import-time check shows it gives exactly what pydantic does on the
installed version (same ``__dict__``, fields set, extra and private state); otherwise it is
pydantic's own call.
"""

from __future__ import annotations

import copy
from typing import Any, Optional

from pydantic import BaseModel

from lightning_nb.types import Attempt, AttemptedRollout, Rollout, RolloutConfig, Worker

__all__ = ["deep_copy", "put", "construct", "snapshot", "deepen"]

_ATOMIC = frozenset({str, int, float, bool, type(None)})
_new_object, _set = object.__new__, object.__setattr__


def _copy_model_fast(model: BaseModel) -> BaseModel:
    """``model.model_copy(deep=True)`` for a model without extra or private values (the store's own)."""
    return _deepen_fast(_snapshot_fast(model))


def _copy_model_pydantic(model: BaseModel) -> BaseModel:
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


def _snapshot_fast(model: BaseModel) -> BaseModel:
    """A copy of ``model`` with its own ``__dict__`` (nested values still shared); no extra or private values."""
    return _construct_fast(type(model), model.__dict__.copy(), set(model.__pydantic_fields_set__))


def _deepen_fast(model: BaseModel) -> BaseModel:
    """Replace the mutable field values of ``model`` (with its own ``__dict__``) by deep copies; returns it."""
    fields = model.__dict__
    for key, value in fields.items():
        if type(value) not in _ATOMIC:
            fields[key] = deep_copy(value)
    return model


def snapshot(model: BaseModel) -> BaseModel:
    """Under the store's lock: a copy of a stored record's own fields whose nested values (input, config,
    metadata, stats) are still shared; :func:`deepen` it after releasing the lock. Sound because a store
    never changes those nested values in place (it replaces them), so the copy stays consistent."""
    if _FAST_COPY and type(model) in _SNAPSHOT_TYPES and model.__pydantic_extra__ is None and \
            model.__pydantic_private__ is None:
        return _snapshot_fast(model)
    return deep_copy(model)


def deepen(model: BaseModel) -> BaseModel:
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


def _construct_fast(cls: type[BaseModel], fields: dict[str, Any], given: Optional[set[str]] = None) -> BaseModel:
    model = _new_object(cls)
    _set(model, "__dict__", fields)
    _set(model, "__pydantic_fields_set__", set(fields) if given is None else given)
    _set(model, "__pydantic_extra__", None)
    _set(model, "__pydantic_private__", None)
    return model


def _construct_pydantic(cls: type[BaseModel], fields: dict[str, Any], given: Optional[set[str]] = None) -> BaseModel:
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
        fields = dict(rollout=rollout, attempt=attempt)
        return _state(_construct_fast(AttemptedRollout, dict(fields))) == \
            _state(AttemptedRollout.model_construct(**fields))
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
