"""The "write your own" pages run as written (docs/write-an-algorithm.md, write-an-engine.md,
write-a-store-backend.md).

* The Best-of-N algorithm is defined by the page's first ```python block and run by its second, on the real
  SmolLM2-135M behind the LLM proxy with calc_agent runners: its first step from a cell, then start/wait/save/stop
  (at smaller sizes, by replacing text that must occur exactly once, as tests/test_doc_snippets.py does).
* The engine page's class serves a real chat completion through the proxy, whose span carries token IDs.
* The store page's table names exactly the abstract methods of ``LightningStore``, and its ``STORE_BACKENDS``
  snippet matches the factories of tests/conftest.py.
"""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from lightning_nb import InMemoryStore, LLMProxy

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def blocks(page: str) -> list[str]:
    """The ```python blocks of ``docs/<page>``, in order."""
    return re.findall(r"^```python\n(.*?)^```", (DOCS / page).read_text(), re.S | re.M)


def namespace(monkeypatch, **names: Any) -> dict[str, Any]:
    """A fresh module's namespace to run a page's blocks in (a ``@dataclass`` needs its module in sys.modules)."""
    module = types.ModuleType("doc_page")
    monkeypatch.setitem(sys.modules, "doc_page", module)
    module.__dict__.update(names)
    return module.__dict__


def small(code: str, replacements: list[tuple[str, str]], page: str) -> str:
    for old, new in replacements:
        assert code.count(old) == 1, f"{page}: expected {old!r} exactly once in the snippet"
        code = code.replace(old, new)
    return code


@pytest.mark.slow
def test_the_best_of_n_page_runs_a_step_then_start_wait_stop(pristine, tmp_path, monkeypatch):
    page = "write-an-algorithm.md"
    define, run = blocks(page)[:2]
    assert len(define.strip().splitlines()) <= 70, "the Best-of-N block is meant to read in one screen"
    monkeypatch.chdir(tmp_path)  # algo.save("best_of_n.json")
    store = InMemoryStore()
    proxy = LLMProxy(pristine, store).start()
    store.add_resources({"main_llm": proxy.as_resource()})
    ns = namespace(monkeypatch, engine=pristine, store=store, proxy=proxy)
    try:
        exec(compile(define, f"{page}:define", "exec"), ns)
        exec(compile(small(run, [("n=4)", "n=2)"), ("BestOfNConfig(n=4, steps=3)",
                                                      "BestOfNConfig(n=2, steps=3, max_tokens=16)")], page),
                     f"{page}:run", "exec"), ns)
    finally:
        for name in ("algo", "runners"):
            if name in ns:
                ns[name].stop()
        proxy.stop()
    algo = ns["algo"]
    assert algo.state in ("stopped", "finished"), (algo.state, algo.error)
    assert algo.global_step == 3 and [row["step"] for row in algo.metrics] == [1, 2, 3]
    assert all(row["scored"] == 2 for row in algo.metrics), algo.metrics
    assert len(algo.kept) == 3 and all(k["rollout_id"] for k in algo.kept)

    again = ns["BestOfN"](store, [{"id": "x", "question": "1 + 1", "answer": 2}])
    again.load(tmp_path / "best_of_n.json")
    assert again.global_step == 3 and again.kept == algo.kept and again.rng.random() == algo.rng.random()


@pytest.mark.slow
def test_the_engine_page_serves_a_completion_with_token_ids(pristine, monkeypatch):
    import openai

    page = "write-an-engine.md"
    define, use = blocks(page)[:2]
    ns = namespace(monkeypatch, engine=pristine)
    exec(compile(define, f"{page}:define", "exec"), ns)
    # the page's `with` block, with one request in place of the "..." comment line
    request = ("    reply = openai.OpenAI(base_url=proxy.traffic_endpoint(), api_key='x', max_retries=0)"
               ".chat.completions.create(model=mine.model_name, messages=[{'role': 'user', 'content': '2 + 2?'}], "
               "max_tokens=4)\n")
    use = re.sub(r"^    # \.\.\..*\n", request, use, flags=re.M)
    assert "reply =" in use, f"{page}: the usage block lost its '# ...' line"
    ns["openai"] = openai
    exec(compile(use, f"{page}:use", "exec"), ns)
    mine, store = ns["mine"], ns["store"]
    assert ns["reply"].choices[0].message.content is not None
    from lightning_nb.semconv import COMPLETION_TOKEN_IDS

    llm = [s for s in store.query_spans() if s.attributes.get(COMPLETION_TOKEN_IDS)]
    assert llm, "the proxy recorded no span with completion token IDs"
    assert not mine.closed
    mine.close()
    assert mine.closed
    with pytest.raises(Exception, match="does not own"):
        mine.load_weights(None)


def test_the_store_page_lists_the_contracts_abstract_methods():
    from lightning_nb.store.base import LightningStore

    text = (DOCS / "write-a-store-backend.md").read_text()
    table = re.search(r"^\| group \| methods \|\n\|[-|]+\|\n((?:\|.*\|\n)+)", text, re.M)
    assert table, "write-a-store-backend.md: no '| group | methods |' table"
    listed = re.findall(r"`(\w+)`", table.group(1))
    assert sorted(listed) == sorted(LightningStore.__abstractmethods__), (
        "the page's table and LightningStore's abstract methods differ: "
        f"{sorted(set(listed) ^ set(LightningStore.__abstractmethods__))}")
    assert f"the {len(LightningStore.__abstractmethods__)} abstract methods" in text

    conftest = (ROOT / "tests" / "conftest.py").read_text()
    snippet = blocks("write-a-store-backend.md")[0]
    for name in re.findall(r'"(\w+)": (_\w+_store)', conftest):
        assert f'"{name[0]}": {name[1]}' in snippet, f"the page's STORE_BACKENDS lacks {name}"
