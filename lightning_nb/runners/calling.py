"""How a runner calls an agent: the agent's signature, its LLM resource attributed to the attempt, and what an
agent may declare (a ``resources`` keyword, ``calls_model``). :mod:`lightning_nb.runners.runner` runs it."""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

from lightning_nb.types import SAMPLING_PARAMETERS_KEY, LLMResource

__all__ = ["Agent", "attributed_llm", "accepts_resources", "declares_model_calls"]

#: an agent: ``agent(task, llm) -> reward | None`` (optionally ``agent(task, llm, *, resources)``)
Agent = Callable[[Any, LLMResource], Any]


def attributed_llm(resource: LLMResource, rollout_id: str, attempt_id: str,
                   overrides: Optional[dict] = None) -> LLMResource:
    """The resource with its endpoint pointed at ``/rollout/{id}/attempt/{id}/v1`` on the same proxy.

    Endpoints not ending in ``/v1`` (a third-party server) are left unchanged.
    ``overrides`` (e.g. ``{"temperature": 0.0}`` for validation) update the sampling parameters.
    """
    base = resource.endpoint.rstrip("/")
    endpoint = base
    if base.endswith("/v1") and "/rollout/" not in base:
        endpoint = f"{base[:-3]}/rollout/{rollout_id}/attempt/{attempt_id}/v1"
    sampling = {**resource.sampling_parameters, **(overrides or {})}
    return resource.model_copy(update={"endpoint": endpoint, SAMPLING_PARAMETERS_KEY: sampling})


def accepts_resources(agent: Any) -> bool:
    """Whether ``agent`` takes a ``resources`` keyword (``agent(task, llm, *, resources)``)."""
    try:
        params = inspect.signature(agent).parameters
    except (TypeError, ValueError):  # a builtin or C callable: the plain two-argument call
        return False
    param = params.get("resources")
    return param is not None and param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY)


def declares_model_calls(agent: Any) -> Optional[bool]:
    """What ``agent`` declares about its LLM calls: its ``calls_model`` attribute, True, False or None (undeclared).

    True: every rollout calls the model; a runner then refuses (ends ``failed``) an attempt that returned a
    reward without any LLM call (see :mod:`lightning_nb.runners.runner`, "Agents that never call the model").
    False: it may answer without the LLM; :func:`~lightning_nb.runners.start_runners` then does not hold the
    queue when the LLM endpoint is dead. None (no attribute, or not a bool): such attempts succeed and are only
    counted and flagged, and a dead endpoint holds the queue.
    """
    value = getattr(agent, "calls_model", None)
    return value if isinstance(value, bool) else None
