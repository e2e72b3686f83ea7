"""``start_runners``: the one entry point that starts runners, as threads or as Ray actors.

It dispatches on ``backend``: ``"threads"`` (:mod:`lightning_nb.runners.group`) or ``"ray"``
(:mod:`lightning_nb.runners.ray`, imported only then; it imports the thread runners, never this module).
"""

from __future__ import annotations

from typing import Any, Optional

from lightning_nb.errors import ConfigError
from lightning_nb.runners.gate import warn_if_llm_endpoint_dead
from lightning_nb.runners.group import RunnerGroup, start_thread_runners
from lightning_nb.runners.hooks import check_hooks
from lightning_nb.runners.runner import Agent
from lightning_nb.store.base import LightningStore
from lightning_nb.tracing.tracer import Tracer
from lightning_nb.types import MAIN_LLM

__all__ = ["start_runners"]


def start_runners(agent: Agent, store: LightningStore, n: int = 4, *, tracer: Optional[Tracer] = None,
                  default_timeout_s: Optional[float] = 300.0, llm_resource: str = MAIN_LLM,
                  backend: str = "threads", heartbeat_interval_s: float = 5.0, replace: bool = True,
                  hooks: Optional[list[Any]] = None, **backend_options: Any) -> RunnerGroup:
    """Start ``n`` runner threads and return at once. Stop them with ``group.stop()``.

    Use it as ``with start_runners(...) as group:`` around the algorithm side to get the
    abort semantics of :mod:`lightning_nb.runners.group`; ``heartbeat_interval_s`` (seconds) is the
    threads' heartbeat period.

    ``replace=True`` (the default): runner threads still running on this same ``store``
    object (typically the group of an earlier run of the same notebook cell, whose handle
    was overwritten) are stopped first, so no rollout is run by an outdated agent or
    reward function: they finish their current attempt (up to ``REPLACE_STOP_TIMEOUT_S``
    seconds, then they are aborted as by ``group.stop``), and an info line names them (printed under the cell
    in a notebook, logged at INFO; the new group's ``replaced``), a ``UserWarning`` instead when attempts in
    flight were ended. ``replace=False`` keeps them running beside the new group, both pulling from the
    same queue. Re-run the ``start_runners`` cell after redefining the agent or its reward
    function: running runners keep the function they were given. With ``backend="ray"``
    ``replace`` does not apply; stop the previous group yourself (``group.stop()``).

    ``backend="ray"`` starts ``n`` Ray actors instead (see :mod:`lightning_nb.runners.ray`:
    the store is served over HTTP; ``backend_options`` such as ``num_cpus``, ``address``,
    ``actor_options`` go to :func:`~lightning_nb.runners.ray.start_ray_runners`) and returns
    a ``RayRunnerGroup`` with the same ``stop()`` / ``status()``.

    ``hooks=[MyHook(), ...]``: :class:`~lightning_nb.runners.hooks.Hook` instances every runner calls,
    in list order, around each attempt (``on_rollout_start``, ``on_trace_start``, ``on_trace_end``,
    ``on_rollout_end``; order, arguments and what a raising hook does to the attempt are in
    :mod:`lightning_nb.runners.hooks`). The thread runners share the same instances (a hook's
    callbacks may run on several threads at once); with ``backend="ray"`` each actor gets a
    cloudpickled copy, so hooks must be picklable and should record through ``runner.store``.

    Before any runner starts, the endpoint of ``llm_resource`` in the store's latest
    resources is probed once (``GET {endpoint}/models``, at most 3 s). If it does not
    answer (a reopened ``SqliteStore`` after a kernel restart still names the dead proxy), the
    thread runners hold the whole queue, rollouts queued before the restart included, so none
    runs against it; a ``RuntimeWarning`` names the endpoint and says to ``store.add_resources``
    the running proxy, and the runners start once the latest resources name an endpoint that
    answers (new resources, or the old endpoint back; checked about once a second). An agent that
    may answer without the LLM declares ``calls_model = False`` (an attribute of the function or
    object) and is not held; Ray runners only warn. An agent object with a ``preflight()``
    method (e.g. :class:`~lightning_nb.agents.remote.RemoteRolloutAgent`, which asks its rollout server
    for ``GET /tools``) has it called once here too, before any runner starts; it warns the same way. Once an attempt fails
    because that endpoint refused the connection, the group's runners hold off the queue
    until the latest resources name an endpoint that answers, then requeue the rollouts
    that failed only for that reason (:mod:`lightning_nb.runners.gate`).

    Raises:
        ConfigError: ``n`` < 1, ``agent`` not callable, unknown ``backend``, options the backend lacks, or a
            ``hooks`` item that is not a Hook instance (or, with Ray, cannot be pickled).
        MissingDependencyError: ``backend="ray"`` without Ray installed.
    """
    hooks = list(check_hooks(hooks))
    preflight = getattr(agent, "preflight", None)
    if callable(preflight):  # an agent that depends on a service checks it once, before any rollout runs
        preflight()
    if backend == "ray":
        if tracer is not None:
            raise ConfigError("tracer cannot be passed with backend='ray': each Ray actor makes its own Tracer")
        from lightning_nb.runners.ray import start_ray_runners

        warn_if_llm_endpoint_dead(store, llm_resource)
        return start_ray_runners(agent, store, n, default_timeout_s=default_timeout_s,  # type: ignore[return-value]
                                 llm_resource=llm_resource, heartbeat_interval_s=heartbeat_interval_s,
                                 hooks=hooks, **backend_options)
    if backend != "threads":
        raise ConfigError(f"backend must be 'threads' (default) or 'ray', got {backend!r}")
    if backend_options:
        raise ConfigError(f"unknown option(s) for backend='threads': {sorted(backend_options)}; "
                          f"they apply to backend='ray' only")
    if n < 1:
        raise ConfigError(f"n must be >= 1 runner, got {n}")
    return start_thread_runners(agent, store, n, tracer=tracer, default_timeout_s=default_timeout_s,
                                llm_resource=llm_resource, heartbeat_interval_s=heartbeat_interval_s, replace=replace,
                                hooks=hooks)
