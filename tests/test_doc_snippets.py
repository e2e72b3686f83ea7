"""The manual's APO, judge and traffic snippets (docs/prompts-judges-traffic.md, moved there from the README) run
as written, at small sizes (issue 43, item 6).

Each snippet is the first ```python block under its heading. It starts where the README's ten lines leave off (the
page says so): the names the ten-line block imports, and ``engine``, ``store`` (with ``main_llm`` published),
``proxy`` and ``trainer = GRPOTrainer(engine)``, built here for real on the session's SmolLM2-135M engine. Sizes
are made small by replacing text that must occur exactly once (as tests/test_packaging.py does for the ten lines),
so an edit of the page that changes them fails loudly here. Nothing else of a snippet is changed.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import pytest

from lightning_nb import GRPOTrainer, InMemoryStore, LLMProxy
from lightning_nb.semconv import JUDGE_SPAN

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "prompts-judges-traffic.md"


def snippet(heading: str) -> str:
    """The first ```python block of ``PAGE`` under ``## heading`` (before the next ``## `` heading)."""
    text = PAGE.read_text()
    m = re.search(rf"^## {re.escape(heading)}\n(?:(?!^## ).)*?^```python\n(.*?)^```", text, re.S | re.M)
    assert m, f"{PAGE.name}: no ```python block under '## {heading}'"
    return m.group(1)


def small(code: str, replacements: list[tuple[str, str]]) -> str:
    for old, new in replacements:
        assert code.count(old) == 1, f"{PAGE.name}: expected {old!r} exactly once in the snippet"
        code = code.replace(old, new)
    return code


def ten_lines_imports() -> str:
    """The import statements of the README's ten-line block (the names a reader of the page already has)."""
    readme = (ROOT / "README.md").read_text()
    m = re.search(r"^## Ten lines\n+```python\n(.*?)^```", readme, re.S | re.M)
    assert m, "README.md has no ```python block right under '## Ten lines'"
    tree = ast.parse(m.group(1))
    return "\n".join(ast.unparse(n) for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom)))


@pytest.fixture
def reader(pristine, tmp_path, monkeypatch):
    """The namespace a reader of the page has: the ten lines' imports, engine, store, proxy and trainer (the
    session engine, reset to its initial weights before and after); the snippet's files go to ``tmp_path``."""
    import torch

    monkeypatch.chdir(tmp_path)  # apo.save("apo.json")
    torch.manual_seed(0)  # the traffic snippet's requests are sampled one at a time from torch's global generator
    ns: dict[str, Any] = {"__name__": "doc_snippet"}
    exec(compile(ten_lines_imports(), "README.md:ten-lines", "exec"), ns)
    store = InMemoryStore()
    proxy = LLMProxy(pristine, store).start()
    store.add_resources({"main_llm": proxy.as_resource()})
    ns.update(engine=pristine, store=store, proxy=proxy, trainer=GRPOTrainer(pristine))
    yield ns
    for name in ("algo", "apo", "runners"):  # whatever the snippet got to start, even if it failed half-way
        if name in ns:
            ns[name].stop()
    proxy.stop()


def run(code: str, ns: dict[str, Any], name: str) -> None:
    exec(compile(code, f"{PAGE.name}:{name}", "exec"), ns)


def test_the_apo_snippet_runs_a_round_and_publishes_the_winner(reader):
    code = small(snippet("Prompt optimisation (APO)"), [
        ("n=8)", "n=2)"),
        ('load_tasks("train")[:16]', 'load_tasks("train")[:2]'),
        ('load_tasks("val")[:32]', 'load_tasks("val")[:2]'),
        ("APOConfig(rounds=2, beam_width=2)",
         "APOConfig(rounds=1, beam_width=1, branch_factor=1, batch_size=2, max_tokens=16, proposer_max_tokens=48)"),
    ])
    run(code, reader, "apo")
    apo, store = reader["apo"], reader["store"]
    assert apo.state == "finished" and apo.round == 1
    assert set(reader["apo"].beam_df()["round"]) >= {1}
    assert len(apo.calls_df()) >= 1  # the critic was asked (the editor too, unless the critic's call failed)
    best = reader["best"]
    assert 0.0 <= best.score <= 1.0 and best.template in [c.template for c in apo.candidates.values()]
    assert (Path.cwd() / "apo.json").is_file()
    assert store.get_resources_by_id("calc").resources["system_prompt"] == best.template  # published


def test_the_judge_snippet_agent_records_a_judge_span_beside_its_reward(reader):
    run(small(snippet("Judge rewards"), [("n=8)", "n=2)")]), reader, "judge")
    store = reader["store"]
    ids = [store.enqueue_rollout({"question": q}, metadata={"sampling_parameters": {"max_tokens": 24}}).rollout_id
           for q in ("Describe the sea in one sentence.", "What is the capital of France?")]
    done = store.wait_for_rollouts(ids, timeout=300)
    assert [r.status for r in done] == ["succeeded"] * 2, [a.error for rid in ids for a in store.query_attempts(rid)]
    for rid in ids:
        judged = [s for s in store.query_spans(rid, "latest") if s.name == JUDGE_SPAN]
        assert len(judged) == 1, store.spans_df(rid)[["name"]]
    rewards = store.rewards_df()
    final = rewards[rewards.component == "final"]
    assert sorted(final.rollout_id) == sorted(ids) and set(final.reward) <= {0.0, 1.0}  # the hand-written reward
    assert set(rewards[rewards.component == "judge"].rollout_id) == set(ids)  # a score, or its judge_error


def test_the_traffic_snippet_labels_requests_updates_and_undoes(reader):
    code = small(snippet("Learning from traffic"), [
        ("TrafficConfig(min_labelled=8)", "TrafficConfig(min_labelled=4, poll_s=0.2)"),
        ('load_tasks("val")[:8]', 'load_tasks("val")[:4]'),
        ("algo.wait(until_step=1)", "algo.wait(until_step=1, timeout=300)"),
    ])
    engine = reader["engine"]
    run(code, reader, "traffic")
    algo, store = reader["algo"], reader["store"]
    updates = algo.updates_df()
    assert len(updates) == 1 and updates["n"].iloc[0] == 4, updates  # one update on the 4 labelled requests
    assert set(updates["rollout_ids"].iloc[0]) == {r.rollout_id for r in store.query_rollouts()}
    assert bool(updates["undone"].iloc[0])  # undo() rolled it back ...
    assert engine.weight_version == updates["weight_version_before"].iloc[0]
    assert algo.state != "failed", algo.error  # ... and resume() went back to polling
