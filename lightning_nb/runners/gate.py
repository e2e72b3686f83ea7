"""Is the LLM endpoint in the store's resources answering? What runners do when it is not.

A store outlives the proxy it points to: a ``SqliteStore`` reopened after a kernel restart
still hands runners the dead proxy's URL as its latest ``main_llm`` resource, and every
rollout then fails with ``APIConnectionError``. Two things here keep that from eating the
queue:

* :func:`check_llm_endpoint` probes the endpoint of the latest LLM resource once
  (``GET {endpoint}/models``; any HTTP answer counts as alive, only a failed connect as
  dead). :func:`~lightning_nb.runners.start_runners` calls it before any runner starts;
  when it is dead, the group's gate starts closed (:meth:`EndpointGate.hold`), so no rollout,
  not even one queued before a kernel restart, runs against it, and a ``RuntimeWarning`` says
  so and how to publish the running proxy. An agent that declares ``calls_model = False``
  (it may answer without the LLM) is not held: it keeps working with whatever endpoint the
  resources name.
* :class:`EndpointGate`, shared by the runners of a group. It also closes once an attempt has
  failed *because* its LLM endpoint refused the connection (the runner's
  ``"unreachable LLM endpoint"`` failure kind: the endpoint died after the start): the
  group's runners stop taking rollouts from the queue instead of failing them one by one.
  While the gate is closed, about once a second
  one runner probes the endpoint of the store's latest resources; when it answers (the
  user called ``store.add_resources({...: proxy.as_resource()})`` for a running proxy, or
  the old one came back), the gate opens again after
  :func:`requeue_after_dead_endpoint` has put the rollouts that failed only for that
  reason back in the queue and re-pinned queued rollouts still pinned to resources with
  the dead endpoint to the latest resources (the dead endpoint cannot serve them).
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Optional

from lightning_nb.store.base import LightningStore
from lightning_nb.types import MAIN_LLM, ResourcesUpdate

__all__ = ["DeadEndpoint", "EndpointGate", "check_llm_endpoint", "llm_endpoint", "probe_endpoint",
           "requeue_after_dead_endpoint", "warn_if_llm_endpoint_dead", "hold_if_llm_endpoint_dead",
           "PROBE_TIMEOUT_S"]

log = logging.getLogger(__name__)
PROBE_TIMEOUT_S = 3.0  # seconds a probe waits for the connect and the answer
_QUEUED = ("queuing", "requeuing")


def probe_endpoint(endpoint: str, timeout_s: float = PROBE_TIMEOUT_S) -> Optional[str]:
    """Why ``endpoint`` does not answer (``"ConnectError: ..."``), or None when it answers or cannot be probed.

    Sends ``GET {endpoint}/models`` (the OpenAI list-models route). Any HTTP status, 401 and
    404 included, means a server is there. Only a failed connect or a timeout (``timeout_s``
    seconds) counts as dead; an endpoint that is not an ``http(s)://`` URL is not probed.
    """
    import httpx

    if not endpoint.startswith(("http://", "https://")):
        return None
    try:
        httpx.get(f"{endpoint.rstrip('/')}/models", timeout=timeout_s)
    except (httpx.ConnectError, httpx.ConnectTimeout, httpx.ReadTimeout) as exc:
        return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else 'no answer'}"
    except httpx.HTTPError:  # the server answered, if oddly: it is there
        return None
    return None


def llm_endpoint(resources: Optional[ResourcesUpdate], llm_resource: str) -> Optional[str]:
    """The endpoint URL of resource ``llm_resource`` in ``resources``, or None when there is none."""
    if resources is None:
        return None
    resource = resources.resources.get(llm_resource)
    endpoint = getattr(resource, "endpoint", None)
    return endpoint if isinstance(endpoint, str) else None


@dataclass(frozen=True)
class DeadEndpoint:
    """An LLM endpoint that did not answer: ``endpoint`` URL, the ``resources_id`` naming it, and ``reason``."""

    endpoint: str
    resources_id: str
    reason: str

    def message(self, llm_resource: str, held: bool = False,
                not_held: str = "the agent declares calls_model = False") -> str:
        """One line: what is wrong, what the runners do about it (``held``: they hold the queue; else why not,
        ``not_held``) and the fix."""
        fix = (f"if the proxy was restarted (e.g. after a kernel restart), publish it again with "
               f"store.add_resources({{'{llm_resource}': proxy.as_resource()}})")
        what = (f"the LLM endpoint {self.endpoint} of {llm_resource!r} in the store's latest resources "
                f"({self.resources_id}) does not answer ({self.reason})")
        if held:
            return (f"{what}, so the runners hold the whole queue (rollouts queued before a restart included) and "
                    f"run nothing against it; {fix}. They start once the latest resources name an endpoint that "
                    f"answers (checked about once a second). An agent that never calls the LLM runs anyway if it "
                    f"declares calls_model = False")
        return (f"{what}; {fix}. {not_held[:1].upper()}{not_held[1:]}, so the runners take rollouts anyway; once "
                f"a rollout fails on it, they stop taking rollouts, and they put the rollouts that failed only for "
                f"this back in the queue when it answers")


def check_llm_endpoint(store: LightningStore, llm_resource: str = MAIN_LLM,
                       timeout_s: float = PROBE_TIMEOUT_S) -> Optional[DeadEndpoint]:
    """Probe the endpoint of ``llm_resource`` in the store's latest resources; a :class:`DeadEndpoint` if it is dead.

    None when it answers, when there is no such resource or no resources at all, or when
    the store cannot be read (the runners report that themselves).
    """
    try:
        latest = store.get_latest_resources()
    except Exception as exc:  # a remote store down: the runners' own errors say so
        log.warning("could not read the latest resources to check the LLM endpoint: %s", exc)
        return None
    endpoint = llm_endpoint(latest, llm_resource)
    if endpoint is None or latest is None:
        return None
    reason = probe_endpoint(endpoint, timeout_s)
    return None if reason is None else DeadEndpoint(endpoint, latest.resources_id, reason)


def warn_if_llm_endpoint_dead(store: LightningStore, llm_resource: str, stacklevel: int = 3,
                              not_held: str = "Ray runners do not hold the queue at the start") -> None:
    """Probe the store's latest LLM endpoint once and warn (``RuntimeWarning``) if it does not answer.

    What :func:`~lightning_nb.runners.start_runners` does before starting Ray runners, which it does not hold
    (``not_held`` says why, in the warning); see :func:`check_llm_endpoint` and :func:`hold_if_llm_endpoint_dead`.
    ``stacklevel`` as for ``warnings.warn``, counted from here.
    """
    dead = check_llm_endpoint(store, llm_resource)
    if dead is not None:
        warnings.warn(f"start_runners: {dead.message(llm_resource, not_held=not_held)}", RuntimeWarning,
                      stacklevel=stacklevel)


def hold_if_llm_endpoint_dead(store: LightningStore, gate: EndpointGate, *, hold: bool = True,
                              stacklevel: int = 3) -> Optional[DeadEndpoint]:
    """Probe the store's latest LLM endpoint once; if it does not answer, close ``gate`` (:meth:`EndpointGate.hold`)
    unless ``hold`` is False (an agent that declares ``calls_model = False``) and warn (``RuntimeWarning``) with
    what the runners do and the fix. Returns the dead endpoint, or None.

    What :func:`~lightning_nb.runners.start_runners` does before starting thread runners, so that no rollout runs
    against an endpoint known to be dead. ``stacklevel`` as for ``warnings.warn``, counted from here.
    """
    dead = check_llm_endpoint(store, gate.llm_resource)
    if dead is None:
        return None
    if hold:
        gate.hold(dead)
    warnings.warn(f"start_runners: {dead.message(gate.llm_resource, held=hold)}", RuntimeWarning,
                  stacklevel=stacklevel)
    return dead


def requeue_after_dead_endpoint(store: LightningStore, dead_endpoint: str, failed_rollout_ids: set[str],
                                llm_resource: str = MAIN_LLM) -> tuple[int, int]:
    """Put rollouts hurt by ``dead_endpoint`` back to work on the store's latest resources.

    * each rollout in ``failed_rollout_ids`` (their attempt failed because ``dead_endpoint``
      refused the connection) that ended ``failed`` is queued again for one more attempt
      (``update_rollout(status="queuing")``), pinned to the latest resources;
    * each rollout still waiting in the queue whose pinned resources name ``dead_endpoint``
      for ``llm_resource`` is re-pinned to the latest resources.

    Returns ``(requeued, repinned)``. Call it once the latest resources' endpoint answers
    (it may be ``dead_endpoint`` itself, back up: then nothing needs re-pinning). Does nothing
    when no resources exist. A rollout changed meanwhile (cancelled, taken) is left as it is.
    """
    latest = store.get_latest_resources()
    if latest is None:
        return 0, 0
    requeued = repinned = 0
    for rid in sorted(failed_rollout_ids):
        try:
            if store.get_rollout_by_id(rid).status == "failed":
                store.update_rollout(rid, status="queuing", resources_id=latest.resources_id)
                requeued += 1
        except Exception as exc:
            log.warning("could not requeue rollout %s after the LLM endpoint came back: %s", rid, exc)
    if llm_endpoint(latest, llm_resource) == dead_endpoint:
        return requeued, 0
    endpoints: dict[str, Optional[str]] = {}
    for rollout in store.query_rollouts(status=list(_QUEUED)):
        rid_res = rollout.resources_id
        if rid_res is None or rid_res == latest.resources_id:
            continue
        if rid_res not in endpoints:
            try:
                endpoints[rid_res] = llm_endpoint(store.get_resources_by_id(rid_res), llm_resource)
            except Exception:
                endpoints[rid_res] = None
        if endpoints[rid_res] != dead_endpoint:
            continue
        try:
            store.update_rollout(rollout.rollout_id, resources_id=latest.resources_id)
            repinned += 1
        except Exception as exc:  # dequeued meanwhile
            log.warning("could not re-pin rollout %s to the latest resources: %s", rollout.rollout_id, exc)
    return requeued, repinned


class EndpointGate:
    """Holds a runner group off the queue while its LLM endpoint refuses connections (see the module docstring).

    Args:
        store: the runners' store.
        llm_resource: the name of the LLM resource in the resources set.
        check_interval_s: seconds between probes while closed.
    """

    def __init__(self, store: LightningStore, llm_resource: str = MAIN_LLM, *, check_interval_s: float = 1.0) -> None:
        self.store, self.llm_resource, self.check_interval_s = store, llm_resource, check_interval_s
        self._lock = threading.Lock()
        self._dead: Optional[str] = None  # the endpoint that refused; None while open
        self._failed: set[str] = set()
        self._next_check = 0.0
        self.reopened: list[tuple[str, int, int]] = []  # (endpoint that answers, requeued, repinned) per reopening

    @property
    def closed(self) -> bool:
        """True while the runners hold off the queue."""
        return self._dead is not None

    def hold(self, dead: DeadEndpoint) -> None:
        """Close the gate before any rollout ran: :func:`check_llm_endpoint` found ``dead`` (what
        :func:`~lightning_nb.runners.start_runners` does). :meth:`ready` opens it as after a failure; no rollout
        failed, so it only re-pins the queued rollouts pinned to resources naming the dead endpoint."""
        with self._lock:
            self._dead = dead.endpoint
            self._next_check = time.monotonic() + self.check_interval_s

    def close(self, endpoint: str, rollout_id: str) -> None:
        """Record that ``rollout_id`` failed because ``endpoint`` refused the connection; close the gate."""
        with self._lock:
            if self._dead is None:
                log.warning("LLM endpoint %s refused a connection: runners hold off the queue until the store's "
                            "resources name an endpoint that answers", endpoint)
                self._next_check = time.monotonic() + self.check_interval_s
            self._dead = endpoint
            self._failed.add(rollout_id)

    def ready(self) -> bool:
        """True when runners may take rollouts; while closed, probes the latest endpoint about once a second.

        The one runner whose call finds it answering requeues the rollouts (see
        :func:`requeue_after_dead_endpoint`), warns once with the counts, and opens the gate.
        """
        if self._dead is None:
            return True
        if time.monotonic() < self._next_check or not self._lock.acquire(blocking=False):
            return False
        try:
            if self._dead is None:
                return True
            self._next_check = time.monotonic() + self.check_interval_s
            latest = llm_endpoint(self.store.get_latest_resources(), self.llm_resource)
            if latest is None or probe_endpoint(latest) is not None:
                return False
            requeued, repinned = requeue_after_dead_endpoint(self.store, self._dead, self._failed, self.llm_resource)
            self.reopened.append((latest, requeued, repinned))
            _warn(f"lightning_nb runners: the LLM endpoint {latest} answers; taking rollouts again "
                  f"(requeued {requeued} rollout(s) that failed on {self._dead}, re-pinned {repinned} queued one(s) "
                  f"to the latest resources)")
            self._dead, self._failed = None, set()
            return True
        except Exception as exc:  # a store hiccup: stay closed, try again later
            log.warning("endpoint gate: %s", exc)
            return False
        finally:
            self._lock.release()


def _warn(message: str) -> None:
    try:
        warnings.warn(message, RuntimeWarning, stacklevel=2)
    except Exception:  # warnings turned into errors: never crash a runner over a notice
        log.warning("%s", message)
