"""How :class:`~lightning_nb.store.server.StoreServer` answers: JSON responses (pydantic's serializer) and the error
bodies ``{"error": {"type", "message", "field"}}`` every route shares (FastAPI's and the hot Starlette routes')."""

from __future__ import annotations

import json
import logging
import re
from typing import Any, Optional

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticSerializationError, to_json, to_jsonable_python

from lightning_nb.errors import InvalidStatusTransition, LightningNbError, NotFoundError

__all__: list[str] = []  # internal to the store server

log = logging.getLogger("lightning_nb.store.server")
_ID_FIELD = re.compile(r"\b(rollout_id|attempt_id|resources_id|resources|worker_id|status|input|timeout)\b")


def _fallback(obj: Any) -> Any:
    try:
        return to_jsonable_python(obj)
    except Exception:  # an in-process caller stored something JSON cannot carry
        return repr(obj)


class _JSON(JSONResponse):
    def render(self, content: Any) -> bytes:
        try:  # pydantic's serializer (Rust): NaN and infinities as constants, so float attributes stay exact
            return to_json(content)
        except PydanticSerializationError:  # a lone surrogate, or something JSON cannot carry
            # ensure_ascii keeps lone surrogates representable; allow_nan keeps float attributes exact
            return json.dumps(content, allow_nan=True, default=_fallback, separators=(",", ":")).encode("ascii")


def _plain(result: Any) -> Any:
    if isinstance(result, BaseModel):
        return result.model_dump()
    if isinstance(result, list):
        return [_plain(x) for x in result]
    return result


def _error(status: int, type_: str, message: str, field: Optional[str] = None) -> _JSON:
    return _JSON({"error": {"type": type_, "message": message, "field": field}}, status_code=status)


def _field_of(message: str) -> Optional[str]:
    match = _ID_FIELD.search(message)
    return match.group(1) if match else None


def _validation_error(errors: list[dict], strip_source: bool) -> _JSON:
    first = errors[0]
    if first.get("type") == "json_invalid":
        return _error(400, "ValidationError", f"request body is not valid JSON: {first.get('msg')}", "body")
    parts = [str(p) for p in first.get("loc", ())]
    if strip_source and len(parts) > 1 and parts[0] in ("body", "query", "path"):
        parts = parts[1:]  # FastAPI prefixes where the value came from
    field = ".".join(parts) or "body"
    more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
    return _error(400, "ValidationError", f"invalid field '{field}': {first.get('msg')}{more}", field)


def _exception_response(exc: Exception) -> _JSON:
    if isinstance(exc, NotFoundError):
        return _error(404, "NotFoundError", str(exc), _field_of(str(exc)))
    if isinstance(exc, InvalidStatusTransition):
        return _error(409, "InvalidStatusTransition", str(exc), "status")
    if isinstance(exc, ValidationError):  # raised by the store while building a model
        return _validation_error(exc.errors(include_url=False), strip_source=False)
    if isinstance(exc, LightningNbError):
        return _error(400, type(exc).__name__, str(exc), _field_of(str(exc)))
    log.exception("store server: unexpected error")
    return _error(500, "InternalError", f"{type(exc).__name__}: {exc}")
