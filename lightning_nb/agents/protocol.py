"""The remote rollout protocol (reference doc 002, "Remote Rollout Server"): its messages as pydantic models.

Two services talk:

* the **trainer side** (:class:`~lightning_nb.agents.remote.RemoteRolloutAgent`, run by the kit's runners)
  discovers the tools once (``GET /tools`` -> :class:`ToolsResponse`), then for each rollout POSTs
  ``/rollout`` (:class:`RolloutRequest`) to the **rollout server** and waits for its
  :class:`RolloutResponse`;
* the **rollout server** (:mod:`lightning_nb.agents.rollout_server` is the reference one) runs the agent
  loop: it calls back ``POST {server_url}/v1/chat/completions`` (the kit's LLM proxy, attributed to the
  rollout's attempt) with the conversation, the ``tools`` and a ``response_mask`` covering the tokens it
  added since the previous call (:class:`MaskTracker`), runs the tool calls the reply makes, and repeats.

The field names are doc 002's. Where this module departs from it or adds to it, the field's docstring
says so: :attr:`SamplingParams.model` (the model the callback asks the proxy for) and
:attr:`RolloutResponse.reward` (doc 002 computes rewards on the trainer side; a server may send one).

Every model refuses unknown fields (a field nobody reads would be ignored without a word), except
:class:`Message`, which keeps OpenAI's optional keys (``name`` and the like) and :class:`RolloutMetrics`,
which keeps a server's own counters: both are passed on, never dropped.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from lightning_nb.errors import LightningNbError

__all__ = ["Message", "ToolCall", "ToolDefinition", "ToolsResponse", "SamplingParams", "RolloutRequest",
           "RolloutResponse", "RolloutMetrics", "RolloutStatus", "FinishReason", "FINISH_REASONS", "MaskTracker",
           "RolloutServerError", "parse_rollout_response", "parse_tools_response"]

#: doc 002's ``finish_reason`` values: ``stop`` (a reply without tool calls), ``max_turns``, ``max_tokens``
#: (``max_tokens_total`` reached) and ``error`` (the rollout failed; ``error_message`` says why).
FINISH_REASONS = ("stop", "max_turns", "max_tokens", "error")
FinishReason = Literal["stop", "max_turns", "max_tokens", "error"]


class RolloutServerError(LightningNbError, RuntimeError):
    """A rollout server failed a rollout or answered outside the protocol; ``field`` names the offending field
    (``"status"``, ``"finish_reason"``, ``"final_messages.2.role"``, ``"body"``...), None when no field is at fault
    (a timeout, a refused connection)."""

    def __init__(self, message: str, field: Optional[str] = None) -> None:
        super().__init__(message)
        self.field = field


class ToolCall(BaseModel):
    """One OpenAI tool call of an assistant message: ``id``, ``type`` ``"function"``, ``function`` ``{name, arguments}``
    (``arguments`` a JSON object as text, as OpenAI sends it, or already an object)."""

    model_config = ConfigDict(extra="forbid")
    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: dict[str, Any]

    @field_validator("function")
    @classmethod
    def _named(cls, v: dict[str, Any]) -> dict[str, Any]:
        if not isinstance(v.get("name"), str) or not v["name"]:
            raise ValueError("function must have a non-empty 'name' (and 'arguments')")
        return v


class Message(BaseModel):
    """One chat message in OpenAI's shape. Other OpenAI keys (``name``, ``refusal``...) are kept as they are."""

    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[dict[str, Any]], None] = None
    tool_calls: Optional[list[ToolCall]] = None
    tool_call_id: Optional[str] = Field(None, max_length=256)


class ToolDefinition(BaseModel):
    """An OpenAI function tool: ``{"type": "function", "function": {"name", "description", "parameters"}}``."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["function"] = "function"
    function: dict[str, Any]

    @field_validator("function")
    @classmethod
    def _schema(cls, v: dict[str, Any]) -> dict[str, Any]:
        if not isinstance(v.get("name"), str) or not v["name"]:
            raise ValueError("function must have a non-empty 'name'")
        if "parameters" in v and not isinstance(v["parameters"], dict):
            raise ValueError("function.parameters must be a JSON schema object")
        return v


class ToolsResponse(BaseModel):
    """``GET /tools``: the tools the rollout server's agent calls. The trainer side fetches them once per agent
    object and process, and sends them in every :class:`RolloutRequest` (doc 002: "cached for
    ``apply_chat_template``")."""

    model_config = ConfigDict(extra="forbid")
    tools: list[ToolDefinition]


class SamplingParams(BaseModel):
    """How the rollout server asks the trainer's ``/v1/chat/completions`` to sample (OpenAI request names).

    On a rollout's URL the kit's proxy applies the rollout's own sampling parameters over these
    (README, "How it fits together"), so both agree when the trainer side builds them from the
    runner's ``llm.sampling_parameters``.

    Attributes:
        model: the served model name the callback puts in ``model`` (the proxy routes by it). Not in doc
            002, whose trainer serves one model; required here because the kit's proxy may serve several.
        temperature: 0.0-5.0. top_p: (0, 1]. max_tokens: per LLM call, 1-4096 tokens.
        stop: stop sequences. seed: sampling seed.
        logprobs: whether the callback asks for OpenAI log-probs in the reply (the proxy records them anyway).
    """

    model_config = ConfigDict(extra="forbid")
    model: str = Field(min_length=1)
    temperature: float = Field(1.0, ge=0.0, le=5.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_tokens: int = Field(512, ge=1, le=4096)
    stop: Optional[list[str]] = None
    seed: Optional[int] = None
    logprobs: bool = False


class RolloutRequest(BaseModel):
    """``POST /rollout``: one rollout for the rollout server to run.

    Attributes:
        rollout_id: the store's rollout id (echoed back in the response).
        messages: the conversation to start from (at least one message).
        server_url: the trainer's base URL for this rollout's attempt; the rollout server calls
            ``{server_url}/v1/chat/completions``. With the kit's proxy it is
            ``{proxy}/rollout/{rollout_id}/attempt/{attempt_id}``, so every call is recorded on the attempt.
        sampling_params: :class:`SamplingParams`.
        tools: the tools ``GET /tools`` listed (sent back so the server need not look them up per rollout).
        callback_api_key: the bearer token the callback must send (``Authorization: Bearer ...``); the proxy
            requires it when bound off loopback. None: no header.
        max_turns: advisory cap on LLM calls (1-100). max_tokens_total: advisory cap on the conversation's
            tokens, prompt and completions (doc 002: the rollout server has the final say on termination).
        metadata: free hints for the server (doc 002: ``max_assistant_turns``...); the reference server
            reads none of them and says so in its response's ``metrics`` (``metadata_ignored``).
    """

    model_config = ConfigDict(extra="forbid")
    rollout_id: str = Field(min_length=1, max_length=256)
    messages: list[Message] = Field(min_length=1)
    server_url: str
    sampling_params: SamplingParams
    tools: list[ToolDefinition] = Field(default_factory=list)
    callback_api_key: Optional[str] = None
    max_turns: int = Field(10, ge=1, le=100)
    max_tokens_total: int = Field(8192, ge=1, le=1_000_000)
    metadata: dict[str, Any] = Field(default_factory=dict)

    @field_validator("server_url")
    @classmethod
    def _http(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError(f"server_url must be an http(s) URL, got {v!r}")
        return v.rstrip("/")


class RolloutStatus(str, Enum):
    """The outcome of a rollout: ``COMPLETED`` or ``ERROR`` (then ``error_message`` says why)."""

    COMPLETED = "COMPLETED"
    ERROR = "ERROR"


class RolloutMetrics(BaseModel):
    """What the rollout server measured. ``num_llm_calls`` is doc 002's ``num_turns``. Latencies in
    milliseconds, tokens counted with the served model's tokenizer. A server's own extra counters are kept."""

    model_config = ConfigDict(extra="allow")
    num_llm_calls: int = Field(0, ge=0)
    num_tool_calls: int = Field(0, ge=0)
    total_latency_ms: float = Field(0.0, ge=0.0)
    llm_latency_ms: float = Field(0.0, ge=0.0)
    tool_latency_ms: float = Field(0.0, ge=0.0)
    prompt_tokens: int = Field(0, ge=0)
    response_tokens: int = Field(0, ge=0)
    max_context_tokens: int = Field(0, ge=0)


class RolloutResponse(BaseModel):
    """The rollout server's answer to ``POST /rollout``.

    Attributes:
        rollout_id: the request's, echoed.
        status: :class:`RolloutStatus`.
        final_messages: the whole conversation at the end (the request's messages, the replies, the tool
            results): required, non-empty, with ``COMPLETED``; ``[]`` in doc 002's error format.
        finish_reason: one of :data:`FINISH_REASONS`; required with ``COMPLETED``.
        error_message: why, with ``ERROR`` or ``finish_reason="error"``.
        metrics: :class:`RolloutMetrics`.
        reward: a reward the server computed itself (not in doc 002, where the trainer computes rewards);
            what the trainer side does with it is :class:`~lightning_nb.agents.remote.RemoteRolloutAgent`'s
            "Rewards".
    """

    model_config = ConfigDict(extra="forbid")
    rollout_id: str
    status: RolloutStatus
    final_messages: list[Message] = Field(default_factory=list)
    finish_reason: Optional[FinishReason] = None
    error_message: Optional[str] = None
    metrics: Optional[RolloutMetrics] = None
    reward: Optional[float] = None

    @classmethod
    def error(cls, rollout_id: str, message: str, metrics: Optional[RolloutMetrics] = None) -> "RolloutResponse":
        """Doc 002's error format: ``{rollout_id, status: "ERROR", error_message, final_messages: []}``."""
        return cls(rollout_id=rollout_id, status=RolloutStatus.ERROR, error_message=message, final_messages=[],
                   finish_reason="error", metrics=metrics)


class MaskTracker:
    """Doc 002's ``response_mask`` arithmetic for one rollout (its ``RolloutSession.last_prompt_length``).

    Before each LLM call, :meth:`mask_for` takes the length of the prompt the engine will see (tokens) and
    gives the call's ``response_mask``: None on the first call, else one 0 per token added since the
    previous call's prompt and completion (the tool results and chat markup, which are not the model's
    and must not be trained), or None when nothing was added. After the reply, :meth:`after_reply` takes
    the prompt and completion lengths. Doc 002's worked example: prompt 5 -> None; reply 5 tokens;
    prompt 13 -> ``[0, 0, 0]``; reply 3 tokens -> the next mask counts from 16.
    """

    def __init__(self) -> None:
        self.last_length = 0  # previous prompt + completion tokens; 0 before the first call

    def mask_for(self, prompt_length: int) -> Optional[list[int]]:
        """The ``response_mask`` of a call whose prompt has ``prompt_length`` tokens."""
        new = prompt_length - self.last_length
        return [0] * new if self.last_length and new > 0 else None

    def after_reply(self, prompt_length: int, completion_length: int) -> None:
        """Record the call's prompt and completion lengths (tokens)."""
        self.last_length = prompt_length + completion_length


def _field_error(exc: ValidationError, what: str) -> RolloutServerError:
    """The first error of a validation failure as a :class:`RolloutServerError` naming the field."""
    first = exc.errors()[0]
    field = ".".join(str(p) for p in first["loc"]) or "body"
    if first["type"] == "missing":
        detail = "is missing"
    elif first["type"] == "extra_forbidden":
        detail = "is not a field of the protocol (reference doc 002); remove it"
    else:
        detail = f"is invalid: {first['msg']} (got {str(first.get('input'))[:200]!r})"
    return RolloutServerError(f"{what}: field '{field}' {detail}", field)


def parse_rollout_response(body: Any, url: str) -> RolloutResponse:
    """A rollout server's ``/rollout`` answer (parsed JSON) as a :class:`RolloutResponse`.

    Raises:
        RolloutServerError: not a JSON object (field ``"body"``), a missing or invalid field, an unknown
            field, or a ``finish_reason`` outside :data:`FINISH_REASONS`; the message names the field and ``url``.
    """
    if not isinstance(body, dict):
        raise RolloutServerError(f"the rollout server at {url} answered /rollout with a body that is "
                                 f"{type(body).__name__} JSON, not an object (reference doc 002's RolloutResponse)",
                                 "body")
    try:
        return RolloutResponse.model_validate(body)
    except ValidationError as exc:
        raise _field_error(exc, f"the rollout server at {url} answered /rollout outside the protocol") from None


def parse_tools_response(body: Any, url: str) -> list[dict[str, Any]]:
    """A rollout server's ``GET /tools`` answer (parsed JSON) as OpenAI tool dicts.

    Raises:
        RolloutServerError: not ``{"tools": [...]}`` of OpenAI function tools; the message names the field.
    """
    if not isinstance(body, dict):
        raise RolloutServerError(f"the rollout server at {url} answered /tools with a body that is "
                                 f"{type(body).__name__} JSON, not an object {{'tools': [...]}}", "body")
    try:
        return [t.model_dump() for t in ToolsResponse.model_validate(body).tools]
    except ValidationError as exc:
        raise _field_error(exc, f"the rollout server at {url} answered /tools outside the protocol") from None
