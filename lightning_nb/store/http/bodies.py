"""The JSON request bodies of :class:`~lightning_nb.store.http.server.StoreServer`'s HTTP API (pydantic models).

Unknown fields are refused (``extra="forbid"``), so a misspelt argument is a 400 naming it, not a
silently ignored value. The store validates the values themselves (statuses, resources, configs).
"""

from __future__ import annotations

from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field

from lightning_nb.types import AttemptStatus, RolloutConfig, RolloutMode

__all__ = ["EnqueueRequest", "StartRequest", "DequeueRequest", "QueryRolloutsRequest", "WaitRequest",
           "UpdateRolloutRequest", "StartAttemptRequest", "UpdateAttemptRequest", "UpdateWorkerRequest",
           "AddResourcesRequest", "MarkTrainedRequest", "QueryTrainedRequest"]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class EnqueueRequest(_Body):
    input: Any
    mode: RolloutMode = "train"
    resources_id: Optional[str] = None
    config: Optional[RolloutConfig] = None
    metadata: Optional[dict[str, Any]] = None


class EnqueueManyRequest(_Body):
    inputs: list[Any]
    mode: RolloutMode = "train"
    resources_id: Optional[str] = None
    config: Optional[RolloutConfig] = None
    metadata: Optional[dict[str, Any]] = None


class StartRequest(EnqueueRequest):
    worker_id: Optional[str] = None


class DequeueRequest(_Body):
    worker_id: Optional[str] = None
    timeout: float = Field(0.0, allow_inf_nan=False, description="seconds; capped at the server's max_wait_s")


class QueryRolloutsRequest(_Body):
    status: Optional[list[str]] = None
    rollout_ids: Optional[list[str]] = None


class WaitRequest(_Body):
    rollout_ids: list[str]
    timeout: Optional[float] = Field(None, allow_inf_nan=False, description="None or above max_wait_s: max_wait_s")


class UpdateRolloutRequest(_Body):
    """``update_rollout`` arguments; null leaves a field as it is. The store validates them."""

    input: Any = None
    mode: Optional[str] = None
    resources_id: Optional[str] = None
    config: Optional[dict[str, Any]] = None
    metadata: Optional[Any] = None
    status: Optional[str] = None


class StartAttemptRequest(_Body):
    worker_id: Optional[str] = None


class UpdateAttemptRequest(_Body):
    status: Optional[AttemptStatus] = None
    worker_id: Optional[str] = None
    error: Optional[str] = None
    heartbeat: bool = False


class UpdateWorkerRequest(_Body):
    status: Optional[str] = None
    heartbeat_stats: Optional[dict[str, Any]] = None


class AddResourcesRequest(_Body):
    resources: Any = Field(description="name -> LLMResource | PromptTemplate (as JSON); the store validates it")
    resources_id: Optional[str] = None


class MarkTrainedRequest(_Body):
    rollout_ids: list[str]
    learner: Any = Field(description="the learner's name; the store validates it")
    update: Any = Field(description="the learner's 1-based update number; the store validates it")


class QueryTrainedRequest(_Body):
    rollout_ids: Optional[list[str]] = None
