"""Scale runners out on Ray: ``start_runners(agent, store, n=K, backend="ray")``.

Each of the ``K`` runners is a Ray actor (its own process, possibly on another
machine) holding one :class:`~lightning_nb.runners.runner.Runner` whose store is a
:class:`~lightning_nb.store.http.client.StoreClient`. The actors talk to the store over
HTTP, so the store must be served by a :class:`~lightning_nb.store.http.server.StoreServer`:

* pass an in-process store (``InMemoryStore``, ``SqliteStore``, ...) and, on a
  one-machine Ray cluster, it is served for you on ``127.0.0.1`` (a free port,
  no token) for as long as the runners run; ``group.server`` is that server;
* or pass a ``StoreClient(url, token=...)`` for a server you run yourself; the
  actors connect to the same URL with the same token.

Ray is imported lazily. If Ray is not initialized, a local cluster is started
with ``ray.init(num_cpus=max(cpu_count, ceil(n * num_cpus)), include_dashboard=False,
object_store_memory=200 MiB)`` (logical CPUs: runners mostly wait on the LLM, so
over-committing the cores is deliberate). To use an existing cluster, call
``ray.init(address=...)`` yourself first, pass ``address=``, or set ``RAY_ADDRESS``.

Multi-node clusters
-------------------
Actors on other machines cannot reach ``127.0.0.1``, so bind the store server to
an address they can reach; off loopback the server requires a token::

    import ray, secrets
    from lightning_nb.store import InMemoryStore, StoreClient, StoreServer
    ray.init(address="ray://head-node:10001")          # or "auto" on a cluster node
    token = secrets.token_urlsafe()
    server = StoreServer(store, host="0.0.0.0", port=4747, token=token).start()
    client = StoreClient("http://<this-machine's-ip>:4747", token=token)
    group = start_runners(agent, client, n=16, backend="ray")

The LLM endpoint in the store's resources (e.g. ``proxy.as_resource()``) must be
reachable from the workers too: start ``LLMProxy`` on a routable host with
``api_key=``. Given a loopback store on a cluster with more than one live node,
:func:`start_ray_runners` raises :class:`~lightning_nb.errors.ConfigError` instead
of starting runners that cannot reach it. Use TLS (``https://`` behind a reverse
proxy) when the network between the machines is not trusted.

The agent and the ``hooks`` are sent to the actors with cloudpickle (each actor gets its own copy of
every hook: see :mod:`lightning_nb.runners.hooks`). Functions from installed
packages travel by reference (the package must be installed on every node);
functions defined in a notebook, a script or a local module travel by value.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional
from urllib.parse import urlsplit

import pandas as pd

from lightning_nb._net import is_loopback
from lightning_nb.errors import ConfigError, LightningNbError, MissingDependencyError
from lightning_nb.runners.group import GroupLifecycle, RunnerGroup
from lightning_nb.runners.hooks import check_hooks
from lightning_nb.runners.ray_watch import ActorWatch
from lightning_nb.runners.runner import Runner
from lightning_nb.store.base import LightningStore
from lightning_nb.store.http.client import StoreClient
from lightning_nb.store.http.server import StoreServer
from lightning_nb.tracing.tracer import Tracer
from lightning_nb.types import MAIN_LLM

__all__ = ["RayRunnerGroup", "start_ray_runners", "import_ray", "init_local_ray"]

log = logging.getLogger(__name__)
_LOCAL_OBJECT_STORE_BYTES = 200 * 1024 * 1024
_STATUS_COLUMNS = ["worker_id", "state", "alive", "current_rollout", "succeeded", "failed", "timed_out", "abandoned",
                   "judge_errors", "no_llm_call", "restarts", "heartbeat_age_s", "node_ip", "pid"]


def import_ray() -> Any:
    """Return the ``ray`` module.

    Raises:
        MissingDependencyError: Ray is not installed (names the ``ray`` extra).
    """
    try:
        import ray
    except ImportError as exc:
        raise MissingDependencyError(
            "backend='ray' needs Ray: pip install 'lightning-nb[ray]' (or pip install 'ray>=2.40'); "
            "or use the default backend='threads'"
        ) from exc
    return ray


class _RunnerActor:
    """Body of one Ray actor: one Runner thread against a StoreClient (wrapped by ``ray.remote``)."""

    def __init__(self, agent_bytes: bytes, url: str, token: Optional[str], worker_id: str,
                 runner_kwargs: dict[str, Any], hooks_bytes: Optional[bytes] = None) -> None:
        from ray import cloudpickle

        agent = cloudpickle.loads(agent_bytes)
        if hooks_bytes is not None:
            runner_kwargs = {**runner_kwargs, "hooks": cloudpickle.loads(hooks_bytes)}
        self.store = StoreClient(url, token=token)
        self.store.get_latest_resources()  # fail here, with the URL in the message, if the server is unreachable
        self.runner = Runner(agent, self.store, Tracer(self.store), **runner_kwargs)
        self.runner.worker_id = worker_id
        self.group = RunnerGroup([self.runner])  # the thread backend's stop/abort semantics, in this process
        self._started = threading.Event()  # a restarted actor (max_restarts) is started again by the group's watch

    def start(self) -> dict[str, Any]:
        if not self._started.is_set():
            self.runner.start()
            self._started.set()
        return self.status()

    def watch(self) -> str:
        """Block while the runner thread runs; returns its worker id once it stopped (fails if the actor dies)."""
        self._started.wait()
        self.runner.join()
        return self.runner.worker_id

    def status(self) -> dict[str, Any]:
        import ray

        s, current = self.runner.stats, getattr(self.runner, "current", None)
        return {"worker_id": self.runner.worker_id, "state": s.state, "alive": self.runner.alive,
                "current_rollout": s.current_rollout, "succeeded": s.succeeded, "failed": s.failed,
                "timed_out": s.timed_out, "abandoned": s.abandoned, "judge_errors": s.judge_errors,
                "no_llm_call": s.no_llm_call,
                "last_heartbeat": s.last_heartbeat,
                "current_attempt": list(current) if current else None,
                "node_ip": ray.util.get_node_ip_address(), "pid": os.getpid()}

    def stop(self, timeout: float, grace_s: float) -> dict[str, Any]:
        abandoned = self.group.stop(timeout, grace_s=grace_s)
        return {**self.status(), "abandoned_now": bool(abandoned)}

    def abort(self, reason: str, grace_s: float) -> dict[str, Any]:
        abandoned = self.group.abort(reason, grace_s=grace_s)
        return {**self.status(), "abandoned_now": bool(abandoned)}


class RayRunnerGroup(GroupLifecycle):
    """Handle on runner actors started by :func:`start_ray_runners`; same surface as ``RunnerGroup``.

    ``stop()``, ``abort()`` and the ``with`` block behave as for threads (see
    :mod:`lightning_nb.runners.group`), inside each actor; on top of that an actor that does not
    answer in time is killed (``ray.kill``) and its in-flight attempt is ended ``failed``
    from here. Stopped actors are killed too, freeing their Ray resources. While the group runs, an
    :class:`~lightning_nb.runners.ray_watch.ActorWatch` ends a dead actor's attempt at once (its rollout is
    retried on a live runner per its retry policy) and follows Ray's restart of the actor
    (``max_restarts``), or warns that the group runs one short.

    Attributes:
        actors: the Ray actor handles.
        worker_ids: the runners' worker ids, as recorded on their attempts.
        url: the store server URL the actors use.
        server: the StoreServer started for an in-process store, else None.
        watch: the :class:`~lightning_nb.runners.ray_watch.ActorWatch` over the actors once they started
            (its ``restarts`` and ``dead``), else None.
    """

    def __init__(self, ray: Any, actors: list[Any], worker_ids: list[str], store: LightningStore, url: str,
                 server: Optional[StoreServer]) -> None:
        self._ray, self.actors, self.worker_ids = ray, actors, worker_ids
        self.store, self.url, self.server = store, url, server
        self.watch: Optional[ActorWatch] = None
        self._final: Optional[list[dict[str, Any]]] = None

    def stop(self, timeout: float = 30.0, *, grace_s: float = 3.0) -> list[str]:
        """Stop all runners after their current attempts; abort the ones still running after ``timeout`` s.

        As ``RunnerGroup.stop`` in each actor; an actor that has not answered ``grace_s`` + 10 s
        after that is killed and its attempt ended ``failed``. Then every actor is killed and the
        store server started for an in-process store is stopped. Returns the worker ids
        abandoned or killed (empty when every runner stopped). Calling it again does nothing.
        """
        return self._end("stop", (timeout, grace_s), timeout + grace_s + 10.0, f"did not stop within {timeout} s")

    def abort(self, reason: str = "aborted by the caller", grace_s: float = 3.0) -> list[str]:
        """Abort now (failure or user interrupt): in-flight attempts end ``failed``; returns abandoned worker ids."""
        return self._end("abort", (reason, grace_s), grace_s + 10.0, reason)

    def _end(self, method: str, args: tuple, wait_s: float, reason: str) -> list[str]:
        if self._final is not None:
            return []
        if self.watch is not None:
            self.watch.stop()  # the actors are stopped and killed on purpose from here
        ray = self._ray
        last = {row["worker_id"]: row for row in self._rows(2.0)}  # in-flight attempts, should an actor hang
        refs = [getattr(a, method).remote(*args) for a in self.actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=wait_s)
        rows, gone = [], []
        for wid, ref in zip(self.worker_ids, refs):
            row: dict[str, Any] = {**last.get(wid, {"worker_id": wid}), "state": "killed", "alive": False}
            if ref in ready:
                try:
                    row = ray.get(ref)
                except Exception:  # the actor died meanwhile
                    row["state"] = "dead"
            if row.pop("abandoned_now", False) or row["state"] in ("killed", "dead"):
                gone.append(wid)
                self._fail_attempt(row, f"aborted: {reason}; Ray runner actor {wid} {row['state']}")
            row["state"] = "stopped" if row["state"] not in ("killed", "dead", "abandoned") else row["state"]
            row["alive"] = False
            rows.append(row)
        for a in self.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # already gone
                pass
        self._final = rows
        if self.server is not None:
            self.server.stop()
        return gone

    def _fail_attempt(self, row: dict[str, Any], error: str) -> None:
        current = row.get("current_attempt")
        if not current:
            return
        try:  # fails harmlessly if the runner or the watchdog got there first
            self.store.update_attempt(current[0], current[1], status="failed", error=error)
        except Exception as exc:
            log.warning("could not end attempt %s of %s (the watchdog will): %s", current[1], row["worker_id"], exc)

    def _rows(self, timeout: float) -> list[dict[str, Any]]:
        if self._final is not None:
            return self._final
        ray = self._ray
        refs = [a.status.remote() for a in self.actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        rows = []
        for wid, ref in zip(self.worker_ids, refs):
            row: dict[str, Any] = {"worker_id": wid, "state": "pending", "alive": False}
            if ref in ready:
                try:
                    row = ray.get(ref)
                except Exception:
                    row["state"] = "dead"
            rows.append(row)
        return rows

    def status(self, timeout: float = 5.0) -> pd.DataFrame:
        """One row per runner actor: state, current rollout, counts, heartbeat age (s), node and pid.

        ``state`` is the runner's (``idle``, ``running``, ``stopping``, ...), ``pending`` when
        the actor did not answer within ``timeout`` seconds (e.g. while Ray restarts it), ``dead`` when
        Ray lost it (with no restart left, the group runs one short), and
        ``stopped``/``abandoned``/``killed`` after :meth:`stop` or :meth:`abort`. ``restarts``: how
        many times the actor died and was restarted; ``no_llm_call``: succeeded attempts without an LLM call.
        """
        now = time.time()
        out = []
        for row in self._rows(timeout):
            row = dict(row)
            row["restarts"] = self.watch.restarts.get(row["worker_id"], 0) if self.watch is not None else 0
            beat = row.pop("last_heartbeat", None)
            row["heartbeat_age_s"] = round(now - beat, 1) if beat else math.nan
            out.append(row)
        return pd.DataFrame(out, columns=_STATUS_COLUMNS)

    def __len__(self) -> int:
        return len(self.actors)


def start_ray_runners(agent: Any, store: LightningStore, n: int = 2, *, default_timeout_s: Optional[float] = 300.0,
                      llm_resource: str = MAIN_LLM, heartbeat_interval_s: float = 5.0,
                      num_cpus: float = 1.0, address: Optional[str] = None,
                      actor_options: Optional[dict[str, Any]] = None,
                      start_timeout_s: float = 120.0, hooks: Optional[list[Any]] = None,
                      max_restarts: int = 1) -> RayRunnerGroup:
    """Start ``n`` runner actors on Ray against the store server; returns once they run.

    Usually called as ``start_runners(agent, store, n=n, backend="ray", ...)``.

    Args:
        agent: the agent function ``(task, llm) -> reward | None`` (sent with cloudpickle).
        store: a ``StoreClient`` (its URL and token are used), or an in-process store that is
            then served on 127.0.0.1 for the group's lifetime (one-machine clusters only).
        n: number of runner actors (one runner thread each).
        default_timeout_s: per-attempt limit in seconds when the rollout sets none.
        llm_resource: name of the LLMResource in the store's resources.
        heartbeat_interval_s: seconds between a runner's heartbeats (as for threads).
        num_cpus: Ray CPUs each actor reserves (logical; may be fractional).
        address: Ray cluster address for ``ray.init`` when Ray is not initialized yet.
        actor_options: extra ``ActorClass.options(...)`` keywords (``num_gpus``, ``resources``,
            ``runtime_env``, ``scheduling_strategy``, ...).
        start_timeout_s: seconds to wait for all actors to be placed and started.
        hooks: :class:`~lightning_nb.runners.hooks.Hook` instances, cloudpickled like the agent; each actor's
            runner calls its own copy.
        max_restarts: times Ray restarts each actor that dies (Ray's ``max_restarts``; 0: never). A dead actor's
            attempt is ended ``unresponsive`` at once either way
            (:class:`~lightning_nb.runners.ray_watch.ActorWatch`); with no restart left the group warns that it
            runs one short.

    Raises:
        MissingDependencyError: Ray is not installed.
        ConfigError: ``n`` < 1, ``num_cpus`` < 0, ``max_restarts`` not an int >= 0, ``agent`` not callable, a
            ``hooks`` item not a Hook or not picklable, or a loopback store on a multi-node cluster.
        LightningNbError: an actor failed to start (its error is included) or was not placed within
            ``start_timeout_s`` (e.g. the cluster lacks ``n * num_cpus`` CPUs); started actors are killed.
    """
    _check_arguments(agent, store, n, num_cpus, max_restarts)
    hooks = list(check_hooks(hooks))
    ray = import_ray()
    _ensure_ray(ray, address, math.ceil(n * num_cpus))
    agent_bytes = _dump_agent(agent)
    hooks_bytes = _dump_agent(hooks, "hooks", [type(h) for h in hooks]) if hooks else None

    server: Optional[StoreServer] = None
    if isinstance(store, StoreClient):
        url, token = store.url, store.token
    else:
        server = StoreServer(store, host="127.0.0.1", port=0).start()
        url, token = server.url, None
    try:
        _check_reachable(ray, url)
        remote_cls = ray.remote(_RunnerActor)
        options = {"num_cpus": num_cpus, "max_concurrency": 4, "max_restarts": max_restarts, **(actor_options or {})}
        stamp = f"{os.getpid()}-{int(time.time() * 1000) % 10**6}"
        worker_ids = [f"ray-runner-{stamp}-{i}" for i in range(n)]
        runner_kwargs = {"default_timeout_s": default_timeout_s, "llm_resource": llm_resource,
                         "heartbeat_interval_s": heartbeat_interval_s}
        actors = [remote_cls.options(**options).remote(agent_bytes, url, token, wid, runner_kwargs, hooks_bytes)
                  for wid in worker_ids]
    except BaseException:
        if server is not None:
            server.stop()
        raise
    group = RayRunnerGroup(ray, actors, worker_ids, store, url, server)
    refs = [a.start.remote() for a in actors]
    ready, pending = ray.wait(refs, num_returns=len(refs), timeout=start_timeout_s)
    try:
        if pending:
            raise LightningNbError(
                f"{len(pending)} of {n} Ray runner actors did not start within {start_timeout_s} s; the cluster has "
                f"{ray.cluster_resources().get('CPU', 0)} CPUs and each actor asks for num_cpus={num_cpus}: "
                f"lower num_cpus, n, or add nodes")
        for ref in ready:
            try:
                ray.get(ref)
            except Exception as exc:
                raise LightningNbError(f"a Ray runner actor failed to start: {exc}") from None
    except LightningNbError:
        group.abort("a Ray runner actor failed to start", grace_s=1.0)
        raise
    group.watch = ActorWatch(ray, actors, worker_ids, store, max_restarts=int(options["max_restarts"]))
    return group


# ----- helpers ----------------------------------------------------------------------------
def _check_arguments(agent: Any, store: Any, n: Any, num_cpus: Any, max_restarts: Any) -> None:
    """ConfigError naming the first of :func:`start_ray_runners`' arguments that is invalid."""
    if not callable(agent):
        raise ConfigError(f"agent must be callable (task, llm) -> reward, got {type(agent).__name__}")
    if not isinstance(n, int) or n < 1:
        raise ConfigError(f"n must be an int >= 1 runner actor, got {n!r}")
    if not (isinstance(num_cpus, (int, float)) and num_cpus >= 0):
        raise ConfigError(f"num_cpus must be a number >= 0 (CPUs per actor), got {num_cpus!r}")
    if isinstance(max_restarts, bool) or not (isinstance(max_restarts, int) and max_restarts >= 0):
        raise ConfigError(f"max_restarts must be an int >= 0 (restarts of each dead actor), got {max_restarts!r}")
    if not isinstance(store, LightningStore):
        raise ConfigError(f"store must be a LightningStore (InMemoryStore, SqliteStore, StoreClient), "
                          f"got {type(store).__name__}")


def _ensure_ray(ray: Any, address: Optional[str], cpus_needed: int) -> None:
    """Connect to ``address`` / ``RAY_ADDRESS``, or start a local cluster, unless Ray is initialized."""
    if ray.is_initialized():
        return
    if address or os.environ.get("RAY_ADDRESS"):
        ray.init(address=address, ignore_reinit_error=True)
        return
    init_local_ray(max(os.cpu_count() or 1, cpus_needed))


def init_local_ray(num_cpus: int, *, object_store_bytes: int = _LOCAL_OBJECT_STORE_BYTES, tries: int = 3) -> Any:
    """Start a one-machine Ray cluster (no dashboard) and return ``ray``; retried ``tries`` times.

    Ray gives its raylet a fixed 30 s to register at start; on a loaded machine that can
    run out, so a failed start is shut down and tried again.

    Args:
        num_cpus: logical CPUs the cluster offers.
        object_store_bytes: size of Ray's shared-memory object store in bytes (runners pass little data).
        tries: attempts before giving up.

    Raises:
        MissingDependencyError: Ray is not installed.
        LightningNbError: Ray did not start in ``tries`` attempts (the last error is included).
    """
    ray = import_ray()
    for attempt in range(1, tries + 1):
        try:
            ray.init(num_cpus=num_cpus, include_dashboard=False, object_store_memory=object_store_bytes,
                     ignore_reinit_error=True)
            return ray
        except Exception as exc:  # ray raises a bare Exception when the raylet is slow to register
            ray.shutdown()
            if attempt == tries:
                raise LightningNbError(f"a local Ray cluster did not start in {tries} tries (last error: "
                                       f"{type(exc).__name__}: {exc}); is the machine overloaded?") from exc
            log.warning("Ray did not start (%s); trying again", exc)
    return ray


def _check_reachable(ray: Any, url: str) -> None:
    """ConfigError when ``url`` is loopback but the cluster has more than one live node."""
    host = urlsplit(url).hostname or ""
    if not is_loopback(host):
        return
    nodes = [node for node in ray.nodes() if node.get("Alive")]
    if len(nodes) > 1:
        raise ConfigError(
            f"the Ray cluster has {len(nodes)} nodes but the store is served on {url} (loopback), which runners "
            f"on other nodes cannot reach; serve it with StoreServer(store, host='0.0.0.0', token=...) and pass "
            f"StoreClient('http://<reachable-ip>:<port>', token=...) as store"
        )


def _dump_agent(agent: Any, field: str = "agent", owners: Optional[list[Any]] = None) -> bytes:
    """cloudpickle ``agent`` (or the hooks list, ``field="hooks"``); the modules of ``owners`` (default: the agent)
    travel by value unless they come from an installed package."""
    from ray import cloudpickle

    names = {getattr(o, "__module__", None) or "" for o in (owners if owners is not None else [agent])}
    modules = [m for m in (sys.modules.get(name) for name in sorted(names)) if m is not None and _is_local_module(m)]
    for module in modules:
        cloudpickle.register_pickle_by_value(module)
    try:
        return cloudpickle.dumps(agent)
    except Exception as exc:
        raise ConfigError(f"{field} cannot be sent to Ray actors ({type(exc).__name__}: {exc}); define "
                          f"{'them' if field == 'hooks' else 'it'} at module level and keep unpicklable objects "
                          f"(locks, open clients) out of {'their state' if field == 'hooks' else 'its closure'}")
    finally:
        for module in modules:
            cloudpickle.unregister_pickle_by_value(module)


def _is_local_module(module: Any) -> bool:
    """True for user code outside installed packages (not ``__main__``, which cloudpickle sends by value)."""
    name = module.__name__
    if name == "__main__" or name.split(".")[0] == "lightning_nb":
        return False
    path = getattr(module, "__file__", None)
    if not path:
        return False
    parts = Path(path).resolve().parts
    return "site-packages" not in parts and "dist-packages" not in parts and not path.startswith(sys.base_prefix)
