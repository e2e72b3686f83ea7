"""The whole loop on the real model: runners → proxy → adapter → GRPO trainer."""

from __future__ import annotations

import time

import pytest
import torch

from lightning_nb import (AlgorithmConfig, GRPOConfig, GRPOTrainer, InMemoryStore, LightningRL, LLMProxy,
                          TripletAdapter, start_runners)
from lightning_nb.calc import calc_agent, load_tasks
from lightning_nb.errors import ConfigError
from lightning_nb.trainer import pack_episode

pytestmark = pytest.mark.slow

SMALL = dict(tasks_per_step=2, group_size=2, max_tokens=24, temperature=1.0, max_sample_rounds=1)


@pytest.fixture
def loop(engine):
    store = InMemoryStore()
    proxy = LLMProxy(engine, store).start()
    store.add_resources({"main_llm": proxy.as_resource()})
    runners = start_runners(calc_agent, store, n=4)
    trainer = GRPOTrainer(engine, GRPOConfig(learning_rate=1e-5, micro_batch_size=4))
    algo = LightningRL(store, trainer, load_tasks("train"), load_tasks("val", limit=4), AlgorithmConfig(**SMALL))
    yield store, trainer, algo
    trainer.stop()
    runners.stop()
    proxy.stop()


def _weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same(a, b):
    return all(torch.equal(a[k], b[k]) for k in a)


def test_triplets_carry_engine_token_ids_and_logprobs_match_trainer(loop, engine):
    store, trainer, algo = loop
    seen = []
    original = engine._run_batch
    engine._run_batch = lambda *a, **k: seen.extend(out := original(*a, **k)) or out
    try:
        triplets, ids = algo.collect()
    finally:
        engine._run_batch = original
    assert triplets, TripletAdapter().skipped
    produced = {(tuple(g.prompt_ids), tuple(g.completion_ids)) for g in seen}
    for t in triplets:
        assert t.prompt_ids and t.response_ids and len(t.logprobs) == len(t.response_ids)
        assert (tuple(t.prompt_ids), tuple(t.response_ids)) in produced
    n_llm_spans = sum(1 for s in store.query_spans() if s.name == "llm.chat.completions")
    assert len(triplets) == n_llm_spans
    # forward every sequence, even those whose group had equal rewards (advantage 0)
    checker = GRPOTrainer(engine, GRPOConfig(skip_zero_advantage=False, track_reference_kl=False))
    before = _weights(checker.model)
    metrics = checker.update(triplets)
    # engine log-probs (sampling time) and the trainer's recomputation agree: same tokens, same weights
    assert abs(metrics["ppo_kl"]) < 1e-3
    assert metrics["step"] == 1 and metrics["episodes"] == len(ids)
    assert metrics["sequences_trained"] >= len(ids) and metrics["tokens_trained"] > 0
    moved = any(a != 0 for a in checker.last_advantages.values())
    assert moved == (not _same(before, _weights(checker.model)))
    assert list(checker.last_batch_df().columns[:4]) == ["rollout_id", "group_id", "turn", "reward"]


def test_packing_merges_turns_that_extend_the_prompt():
    from lightning_nb.types import Triplet

    t0 = Triplet(rollout_id="r", attempt_id="a", group_id="g", turn=0, prompt_ids=[1, 2], response_ids=[3, 4],
                 logprobs=[-0.1, -0.2], reward=1.0)
    t1 = Triplet(rollout_id="r", attempt_id="a", group_id="g", turn=1, prompt_ids=[1, 2, 3, 4, 5], response_ids=[6],
                 logprobs=[-0.3], reward=1.0)
    (seq,) = pack_episode([t1, t0], advantage=0.5)
    assert seq.input_ids == [1, 2, 3, 4, 5, 6] and seq.mask == [0, 0, 1, 1, 0, 1]
    assert seq.old_logprobs == [0.0, 0.0, -0.1, -0.2, 0.0, -0.3]
    t2 = t1.model_copy(update={"prompt_ids": [9, 9, 9, 9, 9]})
    assert len(pack_episode([t0, t2], advantage=0.5)) == 2


def test_pause_freezes_weights_and_resume_continues(loop):
    store, trainer, algo = loop
    trainer.start(algo, steps=50)
    deadline = time.monotonic() + 300
    while trainer.step < 1:
        assert time.monotonic() < deadline and trainer.state != "failed", trainer.error
        time.sleep(0.5)
    trainer.pause()
    assert trainer.state == "paused"
    step, frozen = trainer.step, _weights(trainer.model)
    time.sleep(20)  # long enough for the loop to collect another batch and reach update()
    assert trainer.step == step and _same(frozen, _weights(trainer.model))
    assert trainer.engine.chat("What is 3 + 4?", max_tokens=8)  # the policy answers while paused
    trainer.resume()
    while trainer.step < step + 1:
        assert time.monotonic() < deadline and trainer.state != "failed", trainer.error
        time.sleep(0.5)
    trainer.stop()
    assert trainer.state == "stopped"
    assert len(trainer.metrics_df()) == trainer.step


def test_save_then_load_continues_from_the_same_step(loop, tmp_path):
    store, trainer, algo = loop
    algo.step()
    path = trainer.save(tmp_path / "ckpt.pt")
    saved_step, saved = trainer.step, _weights(trainer.model)
    algo.step()  # move on, then come back
    assert trainer.step == saved_step + 1
    fresh = GRPOTrainer(trainer.engine, trainer.config)
    fresh.load(path)
    assert fresh.step == saved_step and _same(saved, _weights(fresh.model))
    assert len(fresh.metrics_df()) == saved_step
    algo.trainer = fresh
    row = algo.step()
    assert row["step"] == saved_step + 1 and fresh.step == saved_step + 1
    with pytest.raises(FileNotFoundError, match="trainer.save"):
        fresh.load(tmp_path / "missing.pt")


def test_config_errors_name_the_field(engine):
    with pytest.raises(ConfigError, match="learning_rate"):
        GRPOConfig(learning_rate=0)
    with pytest.raises(ConfigError, match="group_size"):
        AlgorithmConfig(group_size=1)
    with pytest.raises(ConfigError, match="no triplets"):
        GRPOTrainer(engine, GRPOConfig(track_reference_kl=False)).update([])


def test_dynamic_sampling_resamples_groups_without_signal(engine):
    """All-equal groups trigger more sampling rounds (DAPO); a group with signal ends the step's collection."""
    import itertools

    counter = itertools.count()

    def agent(task, llm):  # no LLM call: the rewards alone decide the rounds
        return 0.0 if task["id"] == "flat" else float(next(counter) % 2)

    store = InMemoryStore()
    store.add_resources({"main_llm": {"endpoint": "http://127.0.0.1:9/v1", "model": "none"}})
    runners = start_runners(agent, store, n=2)
    trainer = GRPOTrainer(engine, GRPOConfig(track_reference_kl=False))
    try:
        cfg = dict(tasks_per_step=1, group_size=4, max_sample_rounds=3)
        flat = LightningRL(store, trainer, [{"id": "flat"}], config=AlgorithmConfig(**cfg))
        _, ids = flat.collect()
        assert len(ids) == 12 and flat.last_sample_rounds == 3 and flat.last_groups_with_signal == 0
        mixed = LightningRL(store, trainer, [{"id": "mixed"}], config=AlgorithmConfig(**cfg))
        _, ids = mixed.collect()
        assert len(ids) == 4 and mixed.last_sample_rounds == 1 and mixed.last_groups_with_signal == 1
        off = LightningRL(store, trainer, [{"id": "flat"}], config=AlgorithmConfig(**cfg, dynamic_sampling=False))
        _, ids = off.collect()
        assert len(ids) == 4 and off.last_sample_rounds == 1
    finally:
        runners.stop()
