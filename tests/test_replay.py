"""Exact replay and branching a rollout at call k (issue 50, items 3-4).

Real runners and a real LLM proxy on the session's SmolLM2-135M engine: the calc agent (text tool protocol), an
agent with a non-deterministic tool, and a two-call agent for the branch group's training step. The LangGraph
agent's replay is in tests/test_framework_agents.py (beside its other checks).
"""

from __future__ import annotations

import itertools
import random

import pytest
from openai import OpenAI

from lightning_nb import GRPOConfig, GRPOTrainer, TripletAdapter, start_runners
from lightning_nb.errors import ConfigError
from lightning_nb.replay import branch, branch_group, branch_tree, replay
from lightning_nb.tasks.calc import calc_agent, load_tasks

SAMPLING = {"temperature": 0.7, "max_tokens": 32}  # the demo's


def _run(store, tasks, sampling=SAMPLING):
    ids = [store.enqueue_rollout(t, metadata={"sampling_parameters": sampling}).rollout_id for t in tasks]
    assert len(store.wait_for_rollouts(ids, timeout=180)) == len(ids)
    return ids


def _two_calls(store, rids):
    """The first of ``rids`` whose episode made at least two LLM calls (the calc agent's CALC, then ANSWER)."""
    return next((r for r in rids if len(store.episode(r).calls) >= 2), None)


@pytest.mark.slow
def test_a_calc_episode_replays_to_the_same_calls_tokens_and_reward_and_its_parent_is_untouched(proxied_store):
    store = proxied_store
    with start_runners(calc_agent, store, n=4):
        rids = _run(store, load_tasks("train")[:8])
        parent = _two_calls(store, rids) or rids[0]
        before = [s.model_dump() for s in store.query_spans(parent)]
        ep = replay(parent, store=store)
    orig = store.episode(parent)
    assert ep.status == "succeeded" and ep.divergence is None
    assert ep.parent_rollout_id == parent and ep.branch_call == len(orig.calls) and ep.rollout_id != parent
    assert len(ep.calls) == len(orig.calls) and all(c.replayed for c in ep.calls)
    for new, old in zip(ep.calls, orig.calls):
        assert (new.messages, new.reply, new.prompt_ids, new.completion_ids, new.logprobs, new.finish_reason) == (
            old.messages, old.reply, old.prompt_ids, old.completion_ids, old.logprobs, old.finish_reason)
    assert ep.reward == orig.reward and ep.task == orig.task
    assert [s.model_dump() for s in store.query_spans(parent)] == before  # nothing of the parent changed
    # a replayed call is never trained again: its triplets carry replayed=True and pack under response mask 0
    from lightning_nb.trainers.packing import pack_episode

    triplets = TripletAdapter().adapt(store, [ep.rollout_id])
    assert triplets and all(t.replayed for t in triplets)
    assert all(not any(s.mask) for s in pack_episode(triplets, 1.0))
    row = store.episodes_df().set_index("rollout_id").loc[ep.rollout_id]
    assert row["parent_rollout_id"] == parent and row["branch_call"] == len(orig.calls)


def noisy_tool_agent(task, llm):
    """Two calls with a tool result between them that changes from run to run (a clock, a random draw)."""
    client = OpenAI(base_url=llm.endpoint, api_key="x", max_retries=0)
    messages = [{"role": "user", "content": "Pick a number."}]
    first = client.chat.completions.create(model=llm.model, messages=messages, max_tokens=4, temperature=0.0)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": f"RESULT: {random.random():.6f}"}]
    client.chat.completions.create(model=llm.model, messages=messages, max_tokens=4, temperature=0.0)
    return 1.0


@pytest.mark.slow
def test_an_agent_with_a_non_deterministic_tool_reports_where_its_replay_diverged(proxied_store):
    store = proxied_store
    with start_runners(noisy_tool_agent, store, n=1):
        (parent,) = _run(store, [{"id": "noisy"}], sampling={})
        ep = replay(parent, store=store)
    assert ep.status == "failed" and ep.reward == 0.0
    d = ep.divergence
    assert d["call"] == 2 and d["field"] == "messages" and d["recorded"] != d["requested"]
    assert d["recorded"][-1]["content"].startswith("RESULT: ") and d["requested"][-1]["content"].startswith("RESULT: ")
    # call 1 was answered from the record; call 2 was refused with a 409 naming the call and the field
    assert ep.calls[0].replayed and ep.calls[0].completion_ids == store.episode(parent).calls[0].completion_ids
    assert ep.calls[1].error and "diverged at call 2: messages" in ep.calls[1].error
    assert "409" in ep.error or "diverged at call 2" in ep.error


def two_call_agent_factory():
    """Two LLM calls ("Name a fruit.", then "And a colour?"); rewards 1, 0, 1, 0 ... by run: a branch group always
    has reward spread, so one update trains on it."""
    counter = itertools.count()

    def agent(task, llm):
        client = OpenAI(base_url=llm.endpoint, api_key="x", max_retries=0)
        messages = [{"role": "user", "content": "Name a fruit."}]
        first = client.chat.completions.create(model=llm.model, messages=messages, **llm.sampling_parameters)
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "And a colour?"}]
        client.chat.completions.create(model=llm.model, messages=messages, **llm.sampling_parameters)
        return float(next(counter) % 2 == 0)

    return agent


@pytest.mark.slow
def test_branching_at_call_k_replays_k_calls_then_samples_and_a_branch_group_trains(proxied_store, pristine):
    store = proxied_store
    sampling = {"temperature": 1.0, "max_tokens": 8}
    with start_runners(two_call_agent_factory(), store, n=4):
        (parent,) = _run(store, [{"id": "fruit"}], sampling=sampling)
        orig = store.episode(parent)
        spans_before = len(store.query_spans(parent))
        whole = branch(parent, at_call=2, n=1, store=store)[0]
        fresh = branch(parent, at_call=0, n=1, store=store)[0]
        kids = branch(parent, at_call=1, n=4, sampling={"temperature": 1.2}, store=store)
        with pytest.raises(ConfigError, match=r"at_call=3.*0\.\.2"):
            branch(parent, at_call=3, store=store)
        with pytest.raises(ConfigError, match="'top_k'"):
            branch(parent, at_call=1, sampling={"top_k": 5}, store=store)
    assert len(store.query_spans(parent)) == spans_before
    # at_call = every call: the parent again, every call from the record
    assert [c.completion_ids for c in whole.calls] == [c.completion_ids for c in orig.calls]
    assert all(c.replayed for c in whole.calls) and whole.reward is not None
    # at_call=0: a fresh rollout of the task, linked to the parent, nothing replayed
    assert fresh.parent_rollout_id == parent and fresh.branch_call == 0 and not any(c.replayed for c in fresh.calls)
    # at_call=1: call 1 from the record, call 2 sampled anew at the branch's temperature, one group
    for kid in kids:
        assert kid.calls[0].replayed and kid.calls[0].completion_ids == orig.calls[0].completion_ids
        assert not kid.calls[1].replayed and kid.group_id == branch_group(parent, 1)
        assert kid.divergence is None and kid.status == "succeeded"
    spans = [s for s in store.query_spans(kids[0].rollout_id) if s.name == "llm.chat.completions"]
    assert spans[1].attributes["lightning_nb.sampling.temperature"] == 1.2
    assert spans[0].attributes["lightning_nb.sampling.temperature"] == 1.0  # as the parent sampled it
    tree = branch_tree(store, parent)
    assert tree["rollout_id"].iloc[0] == parent and len(tree) == 7 and set(tree["depth"]) == {0, 1}
    assert sorted(tree["branch_call"].iloc[1:]) == [0, 1, 1, 1, 1, 2]
    # the SpanBrowser shows the family of the selected branch as a tree with rewards, the parent at its root
    from widgets import SpanBrowser
    from widgets.spans import branch_family

    family = branch_family(store, kids[0].rollout_id)
    assert family[0]["rollout_id"] == parent and len(family) == 7
    assert {r["rollout_id"]: r["reward"] for r in family}[kids[0].rollout_id] == kids[0].reward
    browser = SpanBrowser(store, autostart=False)
    browser.table.selected = kids[0].rollout_id  # what a click on its row does
    view = browser.branches.value
    browser.close()
    assert "replays and branches" in view and view.index(parent) < view.index(kids[0].rollout_id)
    assert view.count("at call 1 →") == 4 and view.count("at call 0 →") == 1 and f"<b>{kids[0].rollout_id}</b>" in view

    # one update on the branch group: only the calls sampled after the branch point are trained
    triplets = TripletAdapter().adapt(store, [k.rollout_id for k in kids])
    assert {t.group_id for t in triplets} == {branch_group(parent, 1)}
    assert sorted({k.reward for k in kids}) == [0.0, 1.0]
    trainer = GRPOTrainer(pristine, GRPOConfig(learning_rate=1e-6))
    m = trainer.update(triplets)
    sampled = sum(len(t.response_ids) for t in triplets if not t.replayed)
    assert m["tokens_trained"] == sampled and sampled < sum(len(t.response_ids) for t in triplets)
    assert m["groups_with_signal"] == 1

    # a branch on a resources set of its own: pinned to it, and the set everything else runs with stays the latest
    latest = store.get_latest_resources()
    with start_runners(two_call_agent_factory(), store, n=1):
        (other,) = branch(parent, at_call=1, n=1, resources=dict(latest.resources), store=store)
    pinned = store.get_rollout_by_id(other.rollout_id).resources_id
    assert pinned != latest.resources_id and store.get_latest_resources().resources_id == latest.resources_id
    assert other.status == "succeeded" and other.calls[0].replayed and not other.calls[1].replayed


@pytest.mark.slow
def test_one_lightning_rl_step_trains_on_branch_groups_of_its_episodes(proxied_store, pristine):
    from lightning_nb import AlgorithmConfig, LightningRL
    from lightning_nb.replay import BranchConfig

    store = proxied_store
    with pytest.raises(ConfigError, match="BranchConfig.n must be an int >= 2"):
        BranchConfig(n=1)
    with start_runners(two_call_agent_factory(), store, n=4):
        algo = LightningRL(store, GRPOTrainer(pristine, GRPOConfig(learning_rate=1e-6)), [{"id": "fruit"}], [],
                           AlgorithmConfig(tasks_per_step=1, group_size=2, dynamic_sampling=False, max_tokens=8),
                           branch=BranchConfig(parents=1, n=4, at="any"))
        row = algo.step(progress=False)
    assert (row["branch_groups"], row["branch_rollouts"], row["rollouts"]) == (1, 4, 2)
    assert row["branch_groups_with_signal"] == 1 and 0.0 < row["branch_reward_mean"] < 1.0
    batch = algo.trainer.last_triplets
    branch_ts = [t for t in batch if t.group_id.startswith("branch:")]
    assert len({t.rollout_id for t in branch_ts}) == 4 and {t.turn for t in branch_ts if t.replayed} == {0}
    parent = store.get_rollout_by_id(branch_ts[0].rollout_id).metadata["parent_rollout_id"]
    assert parent in {t.rollout_id for t in batch if not t.group_id.startswith("branch:")}
    # the replayed first calls are context: trained tokens are the sampled calls' only, of both kinds of group
    assert row["tokens_trained"] == sum(len(t.response_ids) for t in batch if not t.replayed)


def test_a_branch_of_an_older_episode_is_not_stale_for_its_replayed_calls():
    """A branch of yesterday's episode replays calls the old weights sampled; only its sampled calls are trained, so
    only their weight version decides whether the episode is too stale (max_staleness) and what its staleness is."""
    from lightning_nb.trainers.batch import build_batch
    from lightning_nb.trainers.config import TrainerConfig
    from lightning_nb.types import Triplet

    def turn(rid, k, version, replayed, reward):
        return Triplet(rollout_id=rid, attempt_id="a-" + rid, group_id="g", turn=k,
                       prompt_ids=[1, 2] if k == 0 else [1, 2, 3, 4], response_ids=[3] if k == 0 else [5],
                       logprobs=[-1.0], reward=reward, weight_version=version, replayed=replayed)

    branches = [turn("b1", 0, 0, True, 1.0), turn("b1", 1, 5, False, 1.0),
                turn("b2", 0, 0, True, 0.0), turn("b2", 1, 5, False, 0.0)]
    batch = build_batch(TrainerConfig(max_staleness=1), branches, weight_version=5)
    assert batch.stale == [] and sorted(s.rollout_id for s in batch.seqs) == ["b1", "b2"]
    assert all(s.staleness == 0 and s.weight_version == 5 for s in batch.seqs)
    assert all(s.mask == [0, 0, 0, 0, 1] for s in batch.seqs)  # the replayed reply (token 3) is context
    sampled_then = [turn("c1", 0, 0, False, 1.0), turn("c2", 0, 0, False, 0.0)]  # sampled by the old weights
    assert sorted(build_batch(TrainerConfig(max_staleness=1), sampled_then, weight_version=5).stale) == ["c1", "c2"]
