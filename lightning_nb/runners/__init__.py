"""Runners: threads (or Ray actors) that take rollouts from the store and run the agent on them.

* :mod:`~lightning_nb.runners.start`: :func:`start_runners`, the entry point (threads or Ray).
* :mod:`~lightning_nb.runners.runner`: one :class:`Runner` thread and what it does with one attempt.
* :mod:`~lightning_nb.runners.group`: a :class:`RunnerGroup` of threads: replace, stop, abort.
* :mod:`~lightning_nb.runners.live`: the runners started per store, :func:`live_runner_group`.
* :mod:`~lightning_nb.runners.failures`: failure kinds, first-failure warnings, the unreachable-endpoint hint.
* :mod:`~lightning_nb.runners.gate`: is the store's LLM endpoint answering; hold off the queue when not.
* :mod:`~lightning_nb.runners.hooks`: :class:`Hook`, lifecycle callbacks runners call around each attempt.
* :mod:`~lightning_nb.runners.ray`: runners as Ray actors (Ray imported on use).
"""

from lightning_nb.runners.failures import NO_REWARD_ERROR, FailureNotices, unreachable_endpoint_hint
from lightning_nb.runners.group import RunnerGroup
from lightning_nb.runners.hooks import HOOK_ERROR_SPAN, Hook
from lightning_nb.runners.live import live_runner_group
from lightning_nb.runners.runner import Agent, Runner, attributed_llm
from lightning_nb.runners.start import start_runners

__all__ = ["Agent", "FailureNotices", "HOOK_ERROR_SPAN", "Hook", "NO_REWARD_ERROR", "Runner", "RunnerGroup",
           "attributed_llm", "live_runner_group", "start_runners", "unreachable_endpoint_hint"]
