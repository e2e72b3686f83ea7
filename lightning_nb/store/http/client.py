"""A :class:`~lightning_nb.store.base.LightningStore` that talks to a :class:`StoreServer` over HTTP.

Every contract method is one JSON request, sent by libcurl (pycurl; a thread-safe pool of
keep-alive connections, :mod:`lightning_nb.store.http.curl`: about a third of urllib3's client CPU
per request); error responses come back
as the same exception classes the server's store raised, with its message, so
code written against :class:`~lightning_nb.store.memory.InMemoryStore` behaves the
same through the client. One client is thread-safe and may be shared by runners.

Security defaults: ``token`` is sent as ``Authorization: Bearer <token>`` only
when given; use ``https://`` URLs (TLS certificates are verified by libcurl) when the
server is not on this machine. Long waits (``dequeue_rollout(timeout=...)``,
``wait_for_rollouts(timeout=None)``) loop over bounded server-side waits, so no
single request lasts longer than about 25 s.

Values travel as JSON: tuples come back as lists, and a rollout ``input`` JSON
cannot represent raises :class:`~lightning_nb.errors.ConfigError`.
"""

from __future__ import annotations

import json
import time
from typing import Any, Iterable, Optional, Sequence
from urllib.parse import quote, urlencode

from pydantic import BaseModel
from pydantic_core import PydanticSerializationError, from_json, to_json, to_jsonable_python

from lightning_nb import errors
from lightning_nb._notebook import show_progress
from lightning_nb.errors import ConfigError, LightningNbError
from lightning_nb.store.base import LightningStore
from lightning_nb.store.http.curl import CurlTransport, TransportError
from lightning_nb.store.otel import otel_spans
from lightning_nb.store.rules import check_span_types
from lightning_nb.store.trained import TrainedMark, new_marks
from lightning_nb.types import (
    Attempt,
    AttemptedRollout,
    AttemptStatus,
    ResourcesUpdate,
    Rollout,
    RolloutConfig,
    RolloutMode,
    Span,
    Worker,
)

__all__ = ["StoreClient", "StoreConnectionError"]

_WAIT_CHUNK_S = 25.0  # below the server's default max_wait_s (30 s), so the server ends each wait
_BY_STATUS: dict[int, type[LightningNbError]] = {
    404: errors.NotFoundError,
    409: errors.InvalidStatusTransition,
}


class StoreConnectionError(LightningNbError, ConnectionError):
    """The store server could not be reached or answered something that is not the store API."""


class StoreClient(LightningStore):
    """Store contract over HTTP.

    Args:
        url: the server's base URL, e.g. ``server.url`` (``http://127.0.0.1:PORT``).
        token: bearer token, if the server requires one.
        timeout: seconds to wait for any one response (on top of the bounded
            server-side wait of ``dequeue``/``wait`` requests).
    """

    def __init__(self, url: str, token: Optional[str] = None, timeout: float = 30.0) -> None:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ConfigError(f"url must start with http:// or https://, got {url!r}")
        if timeout <= 0:
            raise ConfigError(f"timeout must be positive seconds, got {timeout!r}")
        self.url, self.timeout = url.rstrip("/"), float(timeout)
        self._token = token or None
        headers = ["Accept: application/json"]
        if self._token:
            headers.append(f"Authorization: Bearer {self._token}")
        # Connect failures are retried twice (nothing was sent yet); a request that was sent is never retried.
        self._transport = CurlTransport(self.url, headers, connect_retries=2, backoff_s=0.5)

    @property
    def token(self) -> Optional[str]:
        """The bearer token this client sends (``Authorization: Bearer <token>``), or None when it sends none.

        Read-only: e.g. to connect another client (a Ray actor's) to the same server.
        """
        return self._token

    # ----- plumbing -------------------------------------------------------------------
    def close(self) -> None:
        """Close the pooled connections; later calls raise StoreConnectionError."""
        self._transport.close()

    def __enter__(self) -> "StoreClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"StoreClient({self.url!r})"

    def _request(self, method: str, path: str, *, body: Any = None, params: Optional[dict] = None,
                 wait_s: float = 0.0) -> Any:
        if self._transport.closed:
            raise StoreConnectionError(f"{self!r} is closed; make a new StoreClient")
        content = None if body is None else body if isinstance(body, bytes) else _dumps(body)
        target = path + (f"?{urlencode(params, doseq=True)}" if params else "")
        try:  # connect errors are retried; the whole body is read before the connection goes back to the pool
            status, data = self._transport.request(method, target, content, self.timeout + wait_s)
        except TransportError as exc:
            raise StoreConnectionError(
                f"store server at {self.url} did not answer {method} {path}: {exc}; is the StoreServer running?"
            ) from exc
        try:
            payload = _loads(data)
        except ValueError:
            payload = None
        if 200 <= status < 300:
            if payload is None and data.strip() != b"null":
                raise StoreConnectionError(f"{self.url}{path} answered {status} without JSON; "
                                           f"is this a lightning-nb StoreServer?")
            return payload
        raise _error_from(status, payload, f"{method} {path}")

    @staticmethod
    def _path(*parts: str) -> str:
        return "/" + "/".join(quote(str(p), safe="") for p in parts)

    # ----- rollouts -------------------------------------------------------------------
    def enqueue_rollout(
        self,
        input: Any,
        *,
        mode: RolloutMode = "train",
        resources_id: Optional[str] = None,
        config: Optional[RolloutConfig] = None,
        metadata: Optional[dict[str, Any]] = None,
    ) -> Rollout:
        body = _rollout_body(input, mode, resources_id, config, metadata)
        return Rollout.model_validate(self._request("POST", "/rollouts", body=body))

    def enqueue_rollouts(self, inputs: Iterable[Any], *, mode: RolloutMode = "train",
                         resources_id: Optional[str] = None, config: Optional[RolloutConfig] = None,
                         metadata: Optional[dict[str, Any]] = None) -> list[Rollout]:
        """Enqueue many tasks with the same options in one request (``POST /rollouts/batch``), in order.

        The server calls its store's ``enqueue_rollouts`` (one transaction in a SqliteStore). An input that
        cannot be sent as JSON raises ConfigError naming ``inputs[i]`` before anything is sent.
        """
        items = [_jsonable(x, f"inputs[{i}]") for i, x in enumerate(inputs)]
        if not items:
            return []
        body = {"inputs": items, **_options_body(mode, resources_id, config, metadata)}
        return [Rollout.model_validate(r) for r in self._request("POST", "/rollouts/batch", body=body)]

    def start_rollout(
        self,
        input: Any,
        *,
        mode: RolloutMode = "train",
        resources_id: Optional[str] = None,
        config: Optional[RolloutConfig] = None,
        metadata: Optional[dict[str, Any]] = None,
        worker_id: Optional[str] = None,
    ) -> AttemptedRollout:
        body = {**_rollout_body(input, mode, resources_id, config, metadata), "worker_id": worker_id}
        return AttemptedRollout.model_validate(self._request("POST", "/rollouts/start", body=body))

    def dequeue_rollout(self, worker_id: Optional[str] = None, timeout: float = 0.0) -> Optional[AttemptedRollout]:
        deadline = time.monotonic() + max(timeout, 0.0)
        while True:
            chunk = min(max(deadline - time.monotonic(), 0.0), _WAIT_CHUNK_S)
            data = self._request("POST", "/rollouts/dequeue", body={"worker_id": worker_id, "timeout": chunk},
                                 wait_s=chunk)
            if data is not None:
                return AttemptedRollout.model_validate(data)
            if time.monotonic() >= deadline:
                return None

    def get_rollout_by_id(self, rollout_id: str) -> Rollout:
        return Rollout.model_validate(self._request("GET", self._path("rollouts", rollout_id)))

    def query_rollouts(
        self, *, status: Optional[Sequence[str]] = None, rollout_ids: Optional[Sequence[str]] = None
    ) -> list[Rollout]:
        body = {"status": None if status is None else list(status),
                "rollout_ids": None if rollout_ids is None else list(rollout_ids)}
        return [Rollout.model_validate(x) for x in self._request("POST", "/rollouts/query", body=body)]

    def wait_for_rollouts(self, rollout_ids: Sequence[str], timeout: Optional[float] = None,
                          progress: Optional[bool] = None) -> list[Rollout]:
        if show_progress(progress):
            return self._wait_with_progress(rollout_ids, timeout)
        ids = list(rollout_ids)
        deadline = None if timeout is None else time.monotonic() + max(timeout, 0.0)
        while True:
            left = _WAIT_CHUNK_S if deadline is None else max(deadline - time.monotonic(), 0.0)
            chunk = min(left, _WAIT_CHUNK_S)
            data = self._request("POST", "/rollouts/wait", body={"rollout_ids": ids, "timeout": chunk}, wait_s=chunk)
            done = [Rollout.model_validate(x) for x in data]
            if len(done) == len(ids) or (deadline is not None and time.monotonic() >= deadline):
                return done

    def cancel_rollout(self, rollout_id: str) -> Rollout:
        return Rollout.model_validate(self._request("POST", self._path("rollouts", rollout_id, "cancel")))

    def update_rollout(self, rollout_id: str, *, input: Any = None, mode: Optional[RolloutMode] = None,
                       resources_id: Optional[str] = None, config: Optional[RolloutConfig | dict] = None,
                       metadata: Optional[dict[str, Any]] = None, status: Optional[str] = None) -> Rollout:
        body = {"input": _jsonable(input, "input"), "mode": mode, "resources_id": resources_id,
                "config": _jsonable(config, "config"), "metadata": _jsonable(metadata, "metadata"), "status": status}
        return Rollout.model_validate(self._request("PATCH", self._path("rollouts", rollout_id), body=body))

    def start_attempt(self, rollout_id: str, worker_id: Optional[str] = None) -> AttemptedRollout:
        path = self._path("rollouts", rollout_id, "attempts")
        return AttemptedRollout.model_validate(self._request("POST", path, body={"worker_id": worker_id}))

    # ----- attempts -------------------------------------------------------------------
    def update_attempt(
        self,
        rollout_id: str,
        attempt_id: str,
        *,
        status: Optional[AttemptStatus] = None,
        worker_id: Optional[str] = None,
        error: Optional[str] = None,
        heartbeat: bool = False,
    ) -> Attempt:
        body = {"status": status, "worker_id": worker_id, "error": error, "heartbeat": heartbeat}
        path = self._path("rollouts", rollout_id, "attempts", attempt_id)
        return Attempt.model_validate(self._request("PATCH", path, body=body))

    def query_attempts(self, rollout_id: Optional[str] = None) -> list[Attempt]:
        params = None if rollout_id is None else {"rollout_id": rollout_id}
        return [Attempt.model_validate(x) for x in self._request("GET", "/attempts", params=params)]

    def sweep_attempts(self) -> list[Attempt]:
        return [Attempt.model_validate(x) for x in self._request("POST", "/attempts/sweep")]

    # ----- workers --------------------------------------------------------------------
    def update_worker(self, worker_id: str, *, status: Optional[str] = None,
                      heartbeat_stats: Optional[dict[str, Any]] = None) -> Worker:
        if not isinstance(worker_id, str) or not worker_id:
            raise ConfigError(f"worker_id must be a non-empty string, got {worker_id!r}")
        body = {"status": status, "heartbeat_stats": _jsonable(heartbeat_stats, "heartbeat_stats")}
        return Worker.model_validate(self._request("POST", self._path("workers", worker_id), body=body))

    def query_workers(self) -> list[Worker]:
        return [Worker.model_validate(x) for x in self._request("GET", "/workers")]

    # ----- spans ----------------------------------------------------------------------
    def add_span(self, span: Span) -> Span:
        if not isinstance(span, Span):
            raise ConfigError(f"span must be a lightning_nb.types.Span, got {type(span).__name__}")
        return Span.model_validate(self._request("POST", "/spans", body=_span_json([span], "span", one=True)))

    def add_spans(self, spans: Sequence[Span]) -> list[Span]:
        """As :meth:`LightningStore.add_spans`: one request (``POST /spans/batch``) for the batch."""
        spans = check_span_types(spans)
        if not spans:
            return []
        body = _span_json(spans, "spans[{i}]")
        return [Span.model_validate(x) for x in self._request("POST", "/spans/batch", body=body)]

    def add_otel_spans(self, rollout_id: str, attempt_id: str, spans: Sequence[Any]) -> list[int]:
        """As :meth:`LightningStore.add_otel_spans`: converted here, one request (``POST
        /spans/batch?reply=sequence_ids``) whose answer is the sequence ids alone, not the spans."""
        converted = otel_spans(rollout_id, attempt_id, spans)
        if not converted:
            return []
        return self._request("POST", "/spans/batch?reply=sequence_ids", body=_span_json(converted, "spans[{i}]"))

    def query_spans(self, rollout_id: Optional[str] = None, attempt_id: Optional[str] = None) -> list[Span]:
        params = {k: v for k, v in (("rollout_id", rollout_id), ("attempt_id", attempt_id)) if v is not None}
        return [Span.model_validate(x) for x in self._request("GET", "/spans", params=params)]

    # ----- resources ------------------------------------------------------------------
    def add_resources(self, resources: dict[str, Any], resources_id: Optional[str] = None) -> ResourcesUpdate:
        body = {"resources": _jsonable(resources, "resources"), "resources_id": resources_id}
        return ResourcesUpdate.model_validate(self._request("POST", "/resources", body=body))

    def get_latest_resources(self) -> Optional[ResourcesUpdate]:
        data = self._request("GET", "/resources/latest")
        return None if data is None else ResourcesUpdate.model_validate(data)

    def query_resources(self) -> list[ResourcesUpdate]:
        return [ResourcesUpdate.model_validate(x) for x in self._request("GET", "/resources")]

    def get_resources_by_id(self, resources_id: str) -> ResourcesUpdate:
        # a query parameter carries any id, including "latest" and ids with "/"
        return ResourcesUpdate.model_validate(self._request("GET", "/resources", params={"resources_id": resources_id}))

    # ----- the training record ----------------------------------------------------------
    def mark_trained(self, rollout_ids: Sequence[str], *, learner: str, update: int) -> list[TrainedMark]:
        """As :meth:`LightningStore.mark_trained`: one request (``POST /trained``), all or nothing on the server."""
        new_marks(list(rollout_ids), learner, update)  # a ConfigError here, before anything is sent
        body = {"rollout_ids": list(rollout_ids), "learner": learner, "update": update}
        return [TrainedMark.model_validate(x) for x in self._request("POST", "/trained", body=body)]

    def query_trained(self, rollout_ids: Optional[Sequence[str]] = None) -> list[TrainedMark]:
        body = {"rollout_ids": None if rollout_ids is None else list(rollout_ids)}
        return [TrainedMark.model_validate(x) for x in self._request("POST", "/trained/query", body=body)]


def _dumps(body: Any) -> bytes:
    """A request body as JSON bytes; NaN and infinities as the ``NaN``/``Infinity`` constants (both peers read them)."""
    try:
        return to_json(body)
    except PydanticSerializationError:  # e.g. a lone surrogate: the standard library escapes it
        return json.dumps(body, allow_nan=True, separators=(",", ":")).encode()


def _loads(data: bytes) -> Any:
    """A response body's JSON (ValueError if it is not JSON)."""
    try:
        return from_json(data)
    except ValueError:  # e.g. an escaped lone surrogate, which only the standard library accepts
        return json.loads(data)


def _span_json(spans: Sequence[Span], field: str, one: bool = False) -> bytes:
    """The spans as a JSON list (``one``: the first span alone) in one pass; ConfigError naming ``field`` (with
    the bad span's index) if one holds something JSON cannot carry."""
    body: Any = [span.model_dump() for span in spans]  # python mode: NaN stays a float, sent as NaN
    try:
        return to_json(body[0] if one else body)
    except PydanticSerializationError:
        body = [_jsonable(span, field.format(i=i)) for i, span in enumerate(spans)]
        return _dumps(body[0] if one else body)


def _rollout_body(input: Any, mode: str, resources_id: Optional[str], config: Optional[RolloutConfig],
                  metadata: Optional[dict[str, Any]]) -> dict[str, Any]:
    """JSON body of ``POST /rollouts`` and ``POST /rollouts/start`` (ConfigError if not JSON-able)."""
    return {"input": _jsonable(input, "input"), **_options_body(mode, resources_id, config, metadata)}


def _options_body(mode: str, resources_id: Optional[str], config: Optional[RolloutConfig],
                  metadata: Optional[dict[str, Any]]) -> dict[str, Any]:
    """The rollout options of an enqueue body (``POST /rollouts``, ``/rollouts/start``, ``/rollouts/batch``)."""
    return {"mode": mode, "resources_id": resources_id, "config": _jsonable(config, "config"),
            "metadata": _jsonable(metadata, "metadata")}


def _jsonable(value: Any, field: str) -> Any:
    """``value`` as plain JSON types (models dumped in Python mode so NaN floats survive)."""
    if isinstance(value, BaseModel):
        value = value.model_dump()
    try:
        return to_jsonable_python(value, serialize_unknown=False)
    except Exception as exc:
        raise ConfigError(f"{field} cannot be sent as JSON ({type(exc).__name__}: {exc}); "
                          f"pass JSON-compatible values (dict, list, str, number, bool, None)") from None


def _error_from(status: int, payload: Any, what: str) -> LightningNbError:
    """The exception the server's store raised, rebuilt from the JSON error body."""
    err = payload.get("error") if isinstance(payload, dict) else None
    if not isinstance(err, dict):
        return StoreConnectionError(f"{what} answered HTTP {status} without a store error body: {payload!r}")
    name, message = str(err.get("type")), str(err.get("message"))
    cls = getattr(errors, name, None)
    if not (isinstance(cls, type) and issubclass(cls, LightningNbError)):
        if status >= 500:
            cls = LightningNbError
            message = f"store server error on {what}: {message}"
        else:  # request validation and other client errors
            cls = _BY_STATUS.get(status, ConfigError)
    return cls(message)
