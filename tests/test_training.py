"""The whole loop on the real model: runners → proxy → adapter → GRPO trainer."""

from __future__ import annotations


import pytest
import torch

from lightning_nb import (AlgorithmConfig, GRPOConfig, GRPOTrainer, InMemoryStore, LightningRL, LLMProxy,
                          TripletAdapter, start_runners)
from lightning_nb.tasks.calc import calc_agent, load_tasks
from lightning_nb.errors import ConfigError
from lightning_nb.trainers.grpo.trainer import pack_episode

pytestmark = pytest.mark.slow

SMALL = dict(tasks_per_step=2, group_size=2, max_tokens=24, temperature=1.0, max_sample_rounds=1)


@pytest.fixture
def loop(engine, pristine):
    store = InMemoryStore()
    proxy = LLMProxy(engine, store).start()
    store.add_resources({"main_llm": proxy.as_resource()})
    runners = start_runners(calc_agent, store, n=4)
    # a kept reference: test_save_then_load_continues_from_the_same_step checks it is rebuilt on load
    trainer = GRPOTrainer(engine, GRPOConfig(learning_rate=1e-5, micro_batch_size=4, track_reference_kl=True))
    algo = LightningRL(store, trainer, load_tasks("train"), load_tasks("val", limit=4), AlgorithmConfig(**SMALL))
    yield store, trainer, algo
    algo.stop()
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
    # engine log-probs (sampling time) and the trainer's recomputation agree token by token: same tokens,
    # same weights (the largest per-token absolute difference, so errors of opposite sign cannot cancel)
    assert metrics["logprob_diff_max"] < 1e-4
    assert metrics["step"] == 1 and metrics["episodes"] + metrics["episodes_dropped"] == len(ids)
    assert metrics["sequences_trained"] >= len(ids) and metrics["tokens_trained"] > 0
    moved = any(a != 0 for a in checker.last_advantages.values())
    assert moved == (not _same(before, _weights(checker.model)))
    batch = checker.last_batch_df()  # one row per packed sequence; the forwarded ones carry a ratio
    assert list(batch.columns[:3]) == ["rollout_id", "group_id", "advantage"]
    assert int(batch["mean_ratio"].notna().sum()) == metrics["sequences_trained"]


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


def test_save_then_load_continues_from_the_same_step(loop, tmp_path):
    store, trainer, algo = loop
    algo.step()
    path = algo.save(tmp_path / "ckpt.pt")
    saved_step, saved = algo.global_step, _weights(trainer.model)
    saved_rng = algo.state_dict()["rng"]
    algo.step()  # move on, then come back
    assert trainer.updates_applied == saved_step + 1
    fresh = GRPOTrainer(trainer.engine, trainer.config)  # its reference is the trained model: rebuilt on load
    algo2 = LightningRL(store, fresh, load_tasks("train"), config=algo.config)
    algo2.load(path)  # gets the saved sampler state
    assert fresh.step == saved_step and _same(saved, _weights(fresh.model))
    assert torch.equal(fresh.reference.model.embed_tokens.weight, trainer.reference.model.embed_tokens.weight)
    assert len(algo2.metrics_df()) == saved_step
    assert algo2.state_dict()["rng"] == saved_rng
    row = algo2.step()
    assert row["step"] == saved_step + 1 and fresh.step == saved_step + 1
    with pytest.raises(FileNotFoundError, match="algo.save"):
        algo2.load(tmp_path / "missing.pt")
    path.unlink()


def test_checkpoints_of_another_model_or_format_are_refused(engine, tmp_path):
    trainer = GRPOTrainer(engine, GRPOConfig(track_reference_kl=False))
    algo = LightningRL(InMemoryStore(), trainer, [{"id": "t"}])
    bad = tmp_path / "other.pt"
    state = {"format": "lightning_nb.grpo/2", "model_signature": {"lm_head.weight": [10, 3]}}
    torch.save(state, bad)
    with pytest.raises(ConfigError, match="another model"):
        algo.load(bad)
    torch.save({"format": "lightning_nb.grpo/1"}, bad)
    with pytest.raises(ConfigError, match="format"):
        algo.load(bad)
    torch.save({"model": object()}, bad)  # not loadable with weights_only=True
    with pytest.raises(ConfigError, match="weights_only"):
        algo.load(bad)
    assert trainer.updates_applied == 0


def test_config_errors_name_the_field(engine):
    with pytest.raises(ConfigError, match="learning_rate"):
        GRPOConfig(learning_rate=0)
    with pytest.raises(ConfigError, match="group_size"):
        AlgorithmConfig(group_size=1)
    with pytest.raises(ConfigError, match="no triplets"):
        GRPOTrainer(engine, GRPOConfig(track_reference_kl=False)).update([])


def test_dynamic_sampling_resamples_groups_without_signal(engine):
    """Groups the trainer cannot learn from trigger more sampling rounds (DAPO); a group with signal ends them."""
    import itertools

    from openai import OpenAI

    counter = itertools.count()

    def agent(task, llm):  # one short LLM call (so there are triplets); the rewards alone decide the rounds
        OpenAI(base_url=llm.endpoint, api_key="x", max_retries=0).chat.completions.create(
            model=llm.model, messages=[{"role": "user", "content": "Hi"}], **llm.sampling_parameters)
        return 0.0 if task["id"] == "flat" else float(next(counter) % 2)

    store = InMemoryStore()
    proxy = LLMProxy(engine, store).start()
    store.add_resources({"main_llm": proxy.as_resource()})
    runners = start_runners(agent, store, n=2)
    trainer = GRPOTrainer(engine, GRPOConfig(track_reference_kl=False))
    try:
        cfg = dict(tasks_per_step=1, group_size=4, max_sample_rounds=3, max_tokens=2)
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
        proxy.stop()
