"""The request the LLM proxy takes: the OpenAI Chat Completions model, its checks, and the sampling applied.

Every check answers with a :class:`ProxyHTTPError` that the app turns into an OpenAI-shaped error
naming the field: a 400 for an unknown parameter (ignoring it would be silent), an invalid value,
or an optional parameter the serving engine does not honour. :func:`applied_sampling` says what
the engine is asked to sample with: on a rollout's URL, the rollout's sampling parameters over
the request's.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Sequence, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from lightning_nb.engines import Engine
from lightning_nb.types import ATTEMPT_TERMINAL

__all__ = ["ChatMessage", "ChatCompletionRequest", "ProxyHTTPError", "validate_request", "check_supported",
           "check_body_rollout_id", "check_attempt_open", "applied_sampling", "SAMPLING_PARAMS", "OPTIONAL_PARAMS"]

#: The sampling parameters the proxy applies from a rollout's ``sampling_parameters`` (OpenAI request names;
#: the span records them under :data:`~lightning_nb.semconv.APPLIED_SAMPLING`).
SAMPLING_PARAMS = ("temperature", "top_p", "max_tokens", "stop", "seed")
#: Request parameters an engine honours only when it names them in ``Engine.supported_params``.
OPTIONAL_PARAMS = ("stop", "seed", "n", "response_format", "frequency_penalty", "presence_penalty", "top_logprobs")


class ChatMessage(BaseModel):
    """One chat message. Unknown keys are accepted only when null (clients echo ``refusal: null`` and the like)."""

    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"] = Field(
        description="'developer' (OpenAI's newer name for system instructions) is rendered as 'system'.")
    content: Union[str, list[dict[str, Any]], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None
    tool_call_id: Optional[str] = None


class ChatCompletionRequest(BaseModel):
    """The OpenAI Chat Completions request the proxy takes; any other field is a 400 naming it.

    ``logprobs=true`` returns ``choices[i].logprobs`` in the OpenAI shape (``token``,
    ``bytes``, ``logprob``, ``top_logprobs``); without it the field is null, as OpenAI
    does. Token IDs are always in ``prompt_token_ids`` and ``choices[i].token_ids``.
    ``user``, ``metadata`` and ``store`` are recorded on the span (every call is stored).
    ``response_mask`` and ``rollout_id`` are reference doc 002's (a rollout server's callback), taken on an
    attempt's URL only.
    """

    model_config = ConfigDict(extra="forbid")
    model: str = Field(min_length=1)
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = Field(None, ge=1, le=4096)
    max_completion_tokens: Optional[int] = Field(None, ge=1, le=4096)
    temperature: Optional[float] = Field(None, ge=0.0, le=5.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    n: Optional[int] = Field(None, ge=1, le=16)
    stream: Optional[bool] = False
    stream_options: Optional[dict[str, Any]] = None
    stop: Union[str, list[str], None] = None
    seed: Optional[int] = None
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: Optional[bool] = None
    response_format: Optional[dict[str, Any]] = None
    frequency_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    presence_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    user: Optional[str] = None
    metadata: Optional[dict[str, Any]] = None
    store: Optional[bool] = None
    return_token_ids: Optional[bool] = None
    response_mask: Optional[list[Literal[0, 1]]] = Field(
        None, description="Reference doc 002's mask from a rollout server: one 0 per prompt token added since "
                          "the attempt's previous call (None on the first). Its length is checked against the "
                          "tokens served, and a 1 is refused: none of those tokens was sampled by the model.")
    rollout_id: Optional[str] = Field(
        None, max_length=256, description="Reference doc 002's callback names its rollout in the body; on an "
                                          "attempt's URL it must be that URL's rollout id (a 400 names both).")


class ProxyHTTPError(Exception):
    """A request the proxy answers with an error: ``status`` (HTTP), ``message``, and the offending ``param``."""

    def __init__(self, status: int, message: str, param: Optional[str] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def validate_request(body: Any) -> ChatCompletionRequest:
    """``body`` (parsed JSON) as a :class:`ChatCompletionRequest`.

    Raises:
        ProxyHTTPError: 400 naming the field: not a JSON object, an unknown parameter or message field
            (a non-null one), or an invalid value.
    """
    if not isinstance(body, dict):
        raise ProxyHTTPError(400, "request body must be a JSON object (an OpenAI chat completion request)")
    try:
        req = ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "body"
        if first["type"] == "extra_forbidden":
            raise ProxyHTTPError(400, f"unknown parameter '{field}': the proxy does not take it, and ignoring it "
                                      "would be silent; remove it (the README lists the supported parameters)", field)
        raise ProxyHTTPError(400, f"invalid field '{field}': {first['msg']}", field) from None
    for i, m in enumerate(req.messages):
        for key, value in (m.model_extra or {}).items():
            if value is not None:
                raise ProxyHTTPError(400, f"unknown message field 'messages.{i}.{key}'; remove it",
                                     f"messages.{i}.{key}")
    return req


def check_supported(req: ChatCompletionRequest, engine: Engine) -> None:
    """Check that ``engine`` honours every optional parameter ``req`` sets (:data:`OPTIONAL_PARAMS`).

    Raises:
        ProxyHTTPError: 400 naming the first parameter the engine does not support (and those it does),
            ``tool_choice`` set without ``tools``, ``response_mask`` with ``n`` > 1, or a content part other
            than text for an engine that reads text (``tool_format="hermes"``: every engine of this kit).
    """
    used = {
        "stop": bool(req.stop), "seed": req.seed is not None, "n": (req.n or 1) > 1,
        "response_format": bool(req.response_format) and req.response_format.get("type", "text") != "text",
        "frequency_penalty": bool(req.frequency_penalty), "presence_penalty": bool(req.presence_penalty),
        "top_logprobs": bool(req.top_logprobs),
    }
    for param in OPTIONAL_PARAMS:
        if used[param] and param not in engine.supported_params:
            raise ProxyHTTPError(400, f"invalid field '{param}': {type(engine).__name__} serving {req.model!r} does "
                                      f"not support it (it supports {sorted(engine.supported_params)}); remove it",
                                 param)
    if req.tool_choice is not None and not req.tools and req.tool_choice != "none":
        raise ProxyHTTPError(400, "invalid field 'tool_choice': it needs 'tools'", "tool_choice")
    if req.response_mask is not None and (req.n or 1) > 1:
        raise ProxyHTTPError(400, "invalid field 'response_mask': it describes one conversation, so it needs n=1",
                             "response_mask")
    if engine.tool_format == "hermes":  # the messages reach the model as text (chat_format.render_tools)
        _check_text_only(req)


def _check_text_only(req: ChatCompletionRequest) -> None:
    """Refuse content parts other than text: a text model would never see them, and dropping one is silent."""
    for i, m in enumerate(req.messages):
        if not isinstance(m.content, list):
            continue
        for j, part in enumerate(m.content):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind != "text":
                field = f"messages.{i}.content.{j}"
                raise ProxyHTTPError(400, f"invalid field '{field}': a content part of type {kind!r}; the served "
                                          f"model reads text only, so only 'text' parts are taken (send the "
                                          f"{kind} to a model that takes it, or describe it in text)", field)


def check_body_rollout_id(req: ChatCompletionRequest, rollout_id: Optional[str]) -> None:
    """Reference doc 002's callback names its rollout in the body: it must be the URL's (a 400 names both).

    Raises:
        ProxyHTTPError: 400 naming ``rollout_id``: another rollout's id, or a body ``rollout_id`` off an attempt's URL.
    """
    if req.rollout_id is None or req.rollout_id == rollout_id:
        return
    if rollout_id is None:
        raise ProxyHTTPError(400, f"rollout_id {req.rollout_id!r} in the body names a rollout server's rollout "
                                  "(reference doc 002), so the call needs that rollout's attempt URL, the server_url "
                                  "of its /rollout request ({proxy}/rollout/{rollout_id}/attempt/{attempt_id}); "
                                  "call that one, or drop rollout_id", "rollout_id")
    raise ProxyHTTPError(400, f"rollout_id {req.rollout_id!r} in the body is not the rollout of this URL, "
                              f"{rollout_id!r}: a callback must go to the server_url its own /rollout request gave",
                         "rollout_id")


def check_attempt_open(attempts: Sequence[Any], rollout_id: str, attempt_id: Optional[str]) -> None:
    """404 when ``attempt_id`` is not among the rollout's ``attempts``; 409 naming the attempt and its status when it
    already ended (succeeded, failed, timeout, unresponsive): nothing is served or recorded after an attempt is
    final, since a late call (a rollout server calling back after it answered ``/rollout``) would be trained on."""
    attempt = next((a for a in attempts if a.attempt_id == attempt_id), None)
    if attempt is None:
        raise ProxyHTTPError(404, f"attempt_id {attempt_id!r} is not an attempt of rollout {rollout_id!r}",
                             "attempt_id")
    if attempt.status in ATTEMPT_TERMINAL:
        raise ProxyHTTPError(409, f"attempt {attempt_id!r} of rollout {rollout_id!r} is already {attempt.status!r}: "
                                  "the proxy serves and records no call after an attempt ended (it would be trained "
                                  "on as part of it). A rollout server must make its calls before it answers "
                                  "/rollout; an agent, before it returns", "attempt_id")


def applied_sampling(req: ChatCompletionRequest, enforced: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The sampling actually applied: the rollout's parameters (``enforced``) over the request's.

    Framework clients never read ``llm.sampling_parameters``, so on a rollout's URL the
    proxy applies the rollout's ``temperature``, ``top_p``, ``seed`` and ``stop``
    (they replace the request's) and its ``max_tokens`` (a cap on the request's).

    Returns:
        ``(applied, not_applied)``. ``applied`` holds OpenAI request parameters (:data:`SAMPLING_PARAMS`):
        ``max_tokens`` (int tokens; 256 when neither sets it), ``temperature`` and ``top_p`` (floats, 1.0
        when neither sets them), and ``stop`` (list of str) and ``seed`` (int) only when set. ``not_applied``
        is the sorted keys of ``enforced`` the proxy does not apply.
    """
    requested_max = req.max_completion_tokens or req.max_tokens
    cap = enforced.get("max_tokens")
    applied: dict[str, Any] = {
        "max_tokens": min(int(requested_max or cap), int(cap)) if cap else (requested_max or 256),
        "temperature": float(enforced.get("temperature", 1.0 if req.temperature is None else req.temperature)),
        "top_p": float(enforced.get("top_p", 1.0 if req.top_p is None else req.top_p)),
    }
    stop = enforced.get("stop", req.stop)
    if stop:
        applied["stop"] = [stop] if isinstance(stop, str) else list(stop)
    seed = enforced.get("seed", req.seed)
    if seed is not None:
        applied["seed"] = int(seed)
    not_applied = sorted(set(enforced) - set(SAMPLING_PARAMS))
    return applied, not_applied
