"""How :class:`~lightning_nb.store.http.server.StoreServer` answers: JSON responses (pydantic's serializer) and the
error bodies ``{"error": {"type", "message", "field"}}`` every route shares (FastAPI's and the hot Starlette routes')."""

from __future__ import annotations

import json
import logging
import re
from typing import Any, Mapping, Optional, Sequence

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticSerializationError, to_json, to_jsonable_python

from lightning_nb.errors import InvalidStatusTransition, LightningNbError, NotFoundError

# used by the store server's routes (store/http/server.py and store/http/hot.py)
__all__ = ["StoreJSONResponse", "plain_json", "error_response", "validation_response", "exception_response"]

log = logging.getLogger("lightning_nb.store.http.server")
_ID_FIELD = re.compile(r"\b(rollout_id|attempt_id|resources_id|resources|worker_id|status|input|timeout)\b")


def _fallback(obj: Any) -> Any:
    try:
        return to_jsonable_python(obj)
    except Exception:  # an in-process caller stored something JSON cannot carry
        return repr(obj)


class StoreJSONResponse(JSONResponse):
    """A JSON response rendered by pydantic's serializer (NaN and infinities as constants); plain ``json`` with
    ASCII escapes for what that cannot carry (a lone surrogate)."""

    def render(self, content: Any) -> bytes:
        try:  # pydantic's serializer (Rust): NaN and infinities as constants, so float attributes stay exact
            return to_json(content)
        except PydanticSerializationError:  # a lone surrogate, or something JSON cannot carry
            # ensure_ascii keeps lone surrogates representable; allow_nan keeps float attributes exact
            return json.dumps(content, allow_nan=True, default=_fallback, separators=(",", ":")).encode("ascii")


def plain_json(result: Any) -> Any:
    """A store call's result as JSON-ready values: pydantic models dumped (also inside a list)."""
    if isinstance(result, BaseModel):
        return result.model_dump()
    if isinstance(result, list):
        return [plain_json(x) for x in result]
    return result


def error_response(status: int, type_: str, message: str, field: Optional[str] = None) -> StoreJSONResponse:
    """The error body every route answers: ``{"error": {"type", "message", "field"}}`` with HTTP ``status``."""
    return StoreJSONResponse({"error": {"type": type_, "message": message, "field": field}}, status_code=status)


def _field_of(message: str) -> Optional[str]:
    match = _ID_FIELD.search(message)
    return match.group(1) if match else None


def validation_response(errors: Sequence[Mapping[str, Any]], strip_source: bool) -> StoreJSONResponse:
    """A 400 naming the first invalid field of pydantic's ``errors`` (``strip_source``: drop FastAPI's
    ``body``/``query``/``path`` prefix of the location)."""
    first = errors[0]
    if first.get("type") == "json_invalid":
        return error_response(400, "ValidationError", f"request body is not valid JSON: {first.get('msg')}", "body")
    parts = [str(p) for p in first.get("loc", ())]
    if strip_source and len(parts) > 1 and parts[0] in ("body", "query", "path"):
        parts = parts[1:]  # FastAPI prefixes where the value came from
    field = ".".join(parts) or "body"
    more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
    return error_response(400, "ValidationError", f"invalid field '{field}': {first.get('msg')}{more}", field)


def exception_response(exc: Exception) -> StoreJSONResponse:
    """The answer to a store call that raised ``exc``: 404 NotFoundError, 409 InvalidStatusTransition, 400 for a
    validation error or another LightningNbError (naming the field the message names), else a 500 (logged)."""
    if isinstance(exc, NotFoundError):
        return error_response(404, "NotFoundError", str(exc), _field_of(str(exc)))
    if isinstance(exc, InvalidStatusTransition):
        return error_response(409, type(exc).__name__, str(exc), "status")  # AttemptEnded too
    if isinstance(exc, ValidationError):  # raised by the store while building a model
        return validation_response(exc.errors(include_url=False), strip_source=False)
    if isinstance(exc, LightningNbError):
        return error_response(400, type(exc).__name__, str(exc), _field_of(str(exc)))
    log.exception("store server: unexpected error")
    return error_response(500, "InternalError", f"{type(exc).__name__}: {exc}")
