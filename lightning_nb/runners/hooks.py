"""Lifecycle hooks: user callbacks a runner calls around every attempt it runs.

Subclass :class:`Hook`, override the callbacks you need, and pass instances to
``start_runners(agent, store, n, hooks=[MyHook(), ...])`` (or ``Runner(..., hooks=[...])``).
Every runner of the group calls them, in list order, on the threads backend and on the Ray
backend (design: Agent Lightning's "Hooks", reference doc 000).

Order, for each attempt a runner runs (``rollout`` is the :class:`~lightning_nb.types.AttemptedRollout`)::

    store.dequeue_rollout -> the attempt is marked running
    on_rollout_start(agent, runner, rollout)           # runner thread, before the trace context
        tracer.trace_context(rollout_id, attempt_id):  # agent thread
            on_trace_start(agent, runner, tracer, rollout)
            agent(task, llm); its returned reward is emitted
            on_trace_end(agent, runner, tracer, rollout)   # right before the trace context exits
    spans flushed; store.update_attempt(status=...)    # the attempt is finalized
    on_rollout_end(agent, runner, rollout, status)     # runner thread, after the store has the outcome

* ``on_trace_start``/``on_trace_end`` run in the agent's thread inside the attempt's trace
  context: spans they open (``emit_reward``, ``tool_span``, the OpenTelemetry tracer) belong to
  the attempt. ``on_trace_end`` is called even when the agent raised or ``on_trace_start`` failed.
* ``on_rollout_end`` is called for every attempt whose ``on_rollout_start`` was called, whatever
  the outcome (also when a hook failed, on timeouts, aborts, and attempts ended elsewhere), except
  when ``Runner.step`` is interrupted by ``KeyboardInterrupt``. When the agent runs past its
  timeout, its thread is abandoned, so ``on_trace_end`` may come later than ``on_rollout_end``
  (status ``"timeout"``) or never.

Errors in a hook
----------------
A hook that raises an ``Exception`` never kills the runner: the remaining hooks of that callback are skipped, the
runner goes on with the next rollouts, and the error is recorded on the attempt:

* every hook error is stored as a span named :data:`HOOK_ERROR_SPAN` (status ``error``, attributes
  :data:`HOOK_ATTRIBUTE` = ``"MyHook.on_trace_end"``, ``exception.type``, ``exception.message``,
  ``exception.stacktrace``) on the attempt, and the first one in a runner group raises a
  ``RuntimeWarning`` (kind ``"hook error"``, see :class:`~lightning_nb.runners.failures.FailureNotices`);
* in ``on_rollout_start``, ``on_trace_start`` or ``on_trace_end`` (before the attempt is
  finalized) the attempt also ends ``failed``, its error starting ``hook MyHook.on_trace_start
  raised ValueError: ...`` followed by the traceback, and is retried per the rollout's
  ``retry_condition``/``max_attempts``. A failing ``on_rollout_start`` or ``on_trace_start``
  means the agent is not called;
* in ``on_rollout_end`` the attempt is already final in the store (the algorithm may have read
  it), so its status is NOT changed: a succeeded attempt stays succeeded, and the error is only
  the span and the warning. Look for it with ``store.query_spans(rollout_id)`` (name
  :data:`HOOK_ERROR_SPAN`).

Ray backend
-----------
Hooks are pickled (cloudpickle, like the agent) and each actor gets its own copy: they must be
picklable (no locks, open files or clients in their state; open those in a callback), and state a
hook keeps in Python attributes stays in the actor. Record what must come back through the store
(``runner.store`` is the actor's ``StoreClient``) or spans.
"""

from __future__ import annotations

import logging
import secrets
import time
import traceback
import warnings
from typing import TYPE_CHECKING, Any, Optional, Sequence

from lightning_nb import semconv
from lightning_nb.errors import ConfigError
from lightning_nb.types import AttemptedRollout, Span

if TYPE_CHECKING:
    from lightning_nb.runners.runner import Runner
    from lightning_nb.tracing.tracer import Tracer

__all__ = ["HOOK_ATTRIBUTE", "HOOK_ERROR_SPAN", "HOOK_METHODS", "Hook", "check_hooks"]

log = logging.getLogger(__name__)

#: Name of the span recording an exception raised by a hook (:data:`lightning_nb.semconv.HOOK_ERROR_SPAN`).
HOOK_ERROR_SPAN = semconv.HOOK_ERROR_SPAN
#: Attribute of a :data:`HOOK_ERROR_SPAN` naming the hook and callback, e.g. ``"MyHook.on_trace_end"``.
HOOK_ATTRIBUTE = semconv.HOOK
#: The four callbacks, in the order a runner calls them for one attempt.
HOOK_METHODS = ("on_rollout_start", "on_trace_start", "on_trace_end", "on_rollout_end")


class Hook:
    """Base class of lifecycle hooks; every callback does nothing. See the module docstring for the order.

    Arguments the callbacks get:

    * ``agent``: the agent function the runner calls, ``agent(task, llm) -> reward | None``.
    * ``runner``: the :class:`~lightning_nb.runners.runner.Runner` running the attempt
      (``runner.store``, ``runner.worker_id``; on Ray the actor's runner, whose store is a ``StoreClient``).
    * ``tracer``: the runner's :class:`~lightning_nb.tracing.tracer.Tracer`; the attempt's trace
      context is active while ``on_trace_start``/``on_trace_end`` run.
    * ``rollout``: the :class:`~lightning_nb.types.AttemptedRollout`: ``rollout.rollout.rollout_id``,
      ``rollout.rollout.input`` (the task), ``rollout.attempt.attempt_id``.
    * ``status``: the attempt's final status string as the runner recorded it: ``"succeeded"``,
      ``"failed"``, ``"timeout"``, or the terminal status found when it was ended elsewhere
      (``"unresponsive"``, a cancel, ...).

    The return values are ignored. Subclasses must be picklable for ``backend="ray"``.
    """

    def on_rollout_start(self, agent: Any, runner: "Runner", rollout: AttemptedRollout) -> None:
        """Called in the runner thread once the attempt is marked running, before the trace context opens."""

    def on_trace_start(self, agent: Any, runner: "Runner", tracer: "Tracer", rollout: AttemptedRollout) -> None:
        """Called in the agent's thread right after the trace context opened, before the agent is called."""

    def on_trace_end(self, agent: Any, runner: "Runner", tracer: "Tracer", rollout: AttemptedRollout) -> None:
        """Called in the agent's thread right before the trace context exits (after the returned reward is emitted)."""

    def on_rollout_end(self, agent: Any, runner: "Runner", rollout: AttemptedRollout, status: str) -> None:
        """Called in the runner thread after the attempt's final ``status`` is recorded in the store."""


def check_hooks(hooks: Optional[Sequence[Any]]) -> tuple[Any, ...]:
    """The hooks as a tuple; None gives ``()``.

    Raises:
        ConfigError: ``hooks`` is not a list/tuple, or an item is a class rather than an instance, or is
            neither a :class:`Hook` nor has the four callbacks (the message names ``hooks[i]`` and the fix).
    """
    if hooks is None:
        return ()
    if not isinstance(hooks, (list, tuple)):
        raise ConfigError(f"hooks must be a list of Hook instances, e.g. hooks=[MyHook()], got {type(hooks).__name__}")
    for i, hook in enumerate(hooks):
        if isinstance(hook, type):
            raise ConfigError(f"hooks[{i}] is the class {hook.__name__}, not an instance: "
                              f"pass hooks=[{hook.__name__}()]")
        missing = [m for m in HOOK_METHODS if not callable(getattr(hook, m, None))]
        if not isinstance(hook, Hook) and missing:
            raise ConfigError(
                f"hooks[{i}] is a {type(hook).__name__}, not a lightning_nb.Hook (it lacks {', '.join(missing)}): "
                f"subclass lightning_nb.Hook, override the callbacks you need ({', '.join(HOOK_METHODS)}) "
                f"and pass instances, hooks=[MyHook()]")
    return tuple(hooks)


def call_hooks(hooks: Sequence[Any], method: str, *args: Any) -> Optional[tuple[str, BaseException, str]]:
    """Call ``method`` on each hook in order; stop at the first that raises.

    Returns None when all returned, else ``(where, exception, traceback text)`` with ``where`` like
    ``"MyHook.on_trace_start"``.
    """
    for hook in hooks:
        try:
            getattr(hook, method)(*args)
        except Exception as exc:
            return f"{type(hook).__name__}.{method}", exc, traceback.format_exc()
    return None


def hook_error_text(where: str, exc: BaseException, tb: str) -> str:
    """The attempt error for a failing hook: ``hook X.m raised T: msg`` then the traceback."""
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"hook {where} raised {type(exc).__name__}: {first}\n{tb.rstrip()}"


def hook_error_span(rollout_id: str, attempt_id: str, where: str, exc: BaseException, tb: str) -> Span:
    """A :data:`HOOK_ERROR_SPAN` of the attempt recording the exception (zero duration, now)."""
    now = time.time()
    return Span(rollout_id=rollout_id, attempt_id=attempt_id, trace_id=secrets.token_hex(16),
                span_id=secrets.token_hex(8), name=HOOK_ERROR_SPAN, start_time=now, end_time=now, status="error",
                attributes={HOOK_ATTRIBUTE: where, semconv.EXCEPTION_TYPE: type(exc).__name__,
                            semconv.EXCEPTION_MESSAGE: str(exc), semconv.EXCEPTION_STACKTRACE: tb})


def warn_hook_error(worker_id: str, rollout_id: str, summary: str, *, final: bool) -> None:
    """The ``RuntimeWarning`` for the first hook error of a runner group (``final``: raised in ``on_rollout_end``)."""
    effect = ("the attempt keeps the status already recorded" if final
              else "the attempt ends failed and is retried per its retry policy")
    message = (f"lightning_nb {worker_id}: rollout {rollout_id}: {summary}; {effect}; the traceback is in the "
               f"{HOOK_ERROR_SPAN!r} span of the attempt (store.query_spans(rollout_id)); later hook errors of "
               f"this runner group are not warned about")
    try:
        warnings.warn(message, RuntimeWarning, stacklevel=1)
    except Exception:  # warnings turned into errors: never crash the runner over a notice
        log.warning("%s", message)
