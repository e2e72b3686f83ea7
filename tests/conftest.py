"""Shared fixtures. The real SmolLM2-135M model is loaded once per session (about 30 s)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from lightning_nb.store import InMemoryStore  # noqa: E402

STORE_BACKENDS = {"memory": InMemoryStore}


@pytest.fixture(params=sorted(STORE_BACKENDS))
def store(request):
    """Every store backend; the contract tests run against each."""
    return STORE_BACKENDS[request.param]()


@pytest.fixture(scope="session")
def engine():
    from lightning_nb.engine import TransformersEngine

    eng = TransformersEngine.from_default(max_batch_size=8)
    yield eng
    eng.stop()


@pytest.fixture
def weights_snapshot():
    """Return a function that copies a model's parameters (to compare before/after)."""

    def snap(model):
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    return snap
