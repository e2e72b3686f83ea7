"""LoRA (GRPOConfig.lora_rank) on the real SmolLM2-135M through peft: only the adapters train, the engine
serves them in place, the reference is the base with the adapters disabled, checkpoints hold the adapters,
and both exports (merged weights, adapter) load back in transformers / peft with the trained logits.

LoRA changes the module tree of the model it is injected into, so these tests build their own engines
instead of using the session engine of conftest (which other tests train as a plain model).
"""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_nb import GRPOConfig, GRPOTrainer, InMemoryStore, LightningRL
from lightning_nb.engines.transformers import TransformersEngine, load_default_model
from lightning_nb.errors import ConfigError
from lightning_nb.trainers.grpo.trainer import response_logprobs
from lightning_nb.types import Triplet
from lightning_nb.models.lora import adapter_state_dict, base_state_dict, merged_state_dict

pytestmark = pytest.mark.slow

LORA = dict(lora_rank=8, lora_alpha=16.0)


@pytest.mark.parametrize("fields, name", [
    (dict(lora_rank=-1), "lora_rank"), (dict(lora_rank=8, lora_alpha=0.0), "lora_alpha"),
    (dict(lora_rank=8, lora_target_modules=[]), "lora_target_modules"),
    (dict(lora_rank=8, lora_target_modules="q_proj"), "lora_target_modules"),
])
def test_invalid_lora_fields_name_the_field(fields, name):
    with pytest.raises(ConfigError, match=f"GRPOConfig.{name}="):
        GRPOConfig(**fields)


@pytest.fixture(scope="module")
def lora_engine():
    eng = TransformersEngine.from_default(max_batch_size=4)
    eng.base_state = {k: v.detach().clone() for k, v in eng.model.state_dict().items()}
    yield eng
    eng.stop()



def _seq_logprob(model, t: Triplet) -> float:
    ids = torch.tensor([t.prompt_ids + t.response_ids])
    P = len(t.prompt_ids)
    mask = torch.tensor([[0.0] * (P - 1) + [1.0] * len(t.response_ids)])
    with torch.no_grad():
        return float(response_logprobs(model, ids, torch.ones_like(ids), mask, torch.tensor([1.0])).sum())


def test_lora_trains_only_the_adapters_and_the_engine_serves_them(lora_engine, one_group):
    eng = lora_engine
    batch = one_group(eng)
    before = [_seq_logprob(eng.model, t) for t in batch]
    trainer = GRPOTrainer(eng, GRPOConfig(learning_rate=5e-4, track_reference_kl=True, kl_every=1, **LORA))
    assert trainer.reference is None  # no second copy: the base with adapters disabled is the reference
    trainable = [n for n, p in eng.model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # B starts at 0: the adapted model is exactly the base model
    assert [_seq_logprob(eng.model, t) for t in batch] == before

    first = trainer.update(batch)
    assert first["kl"] == 0.0 and first["optimizer_steps"] == 1  # the first forward is the base itself
    second = trainer.update(batch)
    assert second["kl"] > 0.0  # measured against the adapters-disabled base, which stayed put
    base_now = base_state_dict(eng.model)
    assert all(torch.equal(v, eng.base_state[k.replace(".base_layer.", ".")]) for k, v in base_now.items())
    assert any(bool(v.abs().sum()) for k, v in adapter_state_dict(eng.model).items() if ".lora_B." in k)

    after = [_seq_logprob(eng.model, t) for t in batch]
    # the rewarded completion (advantage +1.5) became likelier, the others (-0.5 each) less likely
    assert after[0] > before[0]
    assert sum(after[1:]) < sum(before[1:])
    # the engine samples from the adapted model: its log-probs are the trained model's, not the base's
    g = eng.generate(batch[0].prompt_ids, temperature=1.0, max_tokens=8)
    served = Triplet(rollout_id="x", attempt_id="x", group_id="x", turn=0, prompt_ids=g.prompt_ids,
                     response_ids=g.completion_ids, reward=0.0)
    assert sum(g.logprobs) == pytest.approx(_seq_logprob(eng.model, served), abs=1e-3)
    with trainer.peft_model.disable_adapter():
        base_lp = _seq_logprob(eng.model, served)
    assert abs(sum(g.logprobs) - base_lp) > 1e-2

    # a second trainer on the same engine (a re-run notebook cell) continues with the same adapters
    again = GRPOTrainer(eng, GRPOConfig(learning_rate=5e-4, **LORA))
    assert again.peft_model is trainer.peft_model
    with pytest.raises(ConfigError, match="already has LoRA adapters"):
        GRPOTrainer(eng, GRPOConfig(lora_rank=16))
    with pytest.raises(ConfigError, match="lora_rank=0"):
        GRPOTrainer(eng, GRPOConfig())


def test_merged_weights_match_peft_merge_and_both_exports_load_back(lora_engine, one_group, tmp_path):
    eng = lora_engine
    trainer = GRPOTrainer(eng, GRPOConfig(learning_rate=5e-4, track_reference_kl=False, **LORA))
    if not any(bool(v.abs().sum()) for k, v in adapter_state_dict(eng.model).items() if ".lora_B." in k):
        trainer.update(one_group(eng))  # when run alone: train the adapters first
    ours = merged_state_dict(eng.model)
    theirs = copy.deepcopy(trainer.peft_model).merge_and_unload().state_dict()
    assert set(ours) == set(theirs) == set(eng.base_state)
    assert max(float((ours[k] - theirs[k]).abs().max()) for k in ours) < 1e-6
    assert any(not torch.equal(ours[k], eng.base_state[k]) for k in ours)

    ids = torch.tensor([one_group(eng, n=1, seed=3)[0].prompt_ids])
    with torch.no_grad():
        trained = eng.model(input_ids=ids).logits
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    merged_dir = trainer.save_pretrained(tmp_path / "merged")
    assert (merged_dir / "model.safetensors").exists() and (merged_dir / "tokenizer.json").exists()
    loaded = AutoModelForCausalLM.from_pretrained(merged_dir)
    adapter_dir = trainer.save_pretrained(tmp_path / "adapter", merged=False)
    assert (adapter_dir / "adapter_config.json").exists()
    base, _ = load_default_model()
    with torch.no_grad():
        base_logits = base(input_ids=ids).logits
        merged_logits = loaded(input_ids=ids).logits
        adapted_logits = PeftModel.from_pretrained(base, adapter_dir).eval()(input_ids=ids).logits
    assert float((merged_logits - trained).abs().max()) < 1e-3
    assert float((adapted_logits - trained).abs().max()) < 1e-3
    assert float((base_logits - trained).abs().max()) > 1e-2  # the exports carry the training, not the base


def test_lora_checkpoint_holds_the_adapters_and_resumes_exactly(lora_engine, one_group, engine, tmp_path):
    eng = lora_engine
    trainer = GRPOTrainer(eng, GRPOConfig(learning_rate=5e-4, track_reference_kl=False, **LORA))
    algo = LightningRL(InMemoryStore(), trainer, [{"id": "t"}])
    algo.record(trainer.update(one_group(eng, n=2, seed=1)))  # two episodes, rewarded and not: a real update
    trainer.config.learning_rate = 2e-4  # an edit made while paused travels with the checkpoint
    path = algo.save(tmp_path / "lora.pt")
    assert path.stat().st_size < 100e6  # adapters + their AdamW state, not the 1.6 GB of a full checkpoint

    fresh = TransformersEngine.from_default(max_batch_size=4)
    try:
        resumed = GRPOTrainer(fresh, GRPOConfig(learning_rate=5e-4, track_reference_kl=False, **LORA))
        resumed_algo = LightningRL(InMemoryStore(), resumed, [{"id": "t"}])
        resumed_algo.load(path)
        assert resumed.config.learning_rate == 2e-4  # the run continues with the config it was saved with
        assert resumed.updates_applied == trainer.updates_applied
        assert [(m["step"], m["loss"]) for m in resumed_algo.metrics] == [(m["step"], m["loss"]) for m in algo.metrics]
        assert all(torch.equal(v, adapter_state_dict(eng.model)[k]) for k, v in adapter_state_dict(fresh.model).items())
        batch = one_group(eng, n=2, seed=2)
        assert resumed.update(batch)["loss"] == pytest.approx(trainer.update(batch)["loss"], abs=1e-6)
        assert all(torch.equal(v, adapter_state_dict(eng.model)[k]) for k, v in adapter_state_dict(fresh.model).items())
        # keep_config=True keeps this trainer's values; the next update applies them and records the change
        kept = GRPOTrainer(fresh, GRPOConfig(learning_rate=5e-4, track_reference_kl=False, **LORA))
        kept_algo = LightningRL(InMemoryStore(), kept, [{"id": "t"}])
        kept_algo.load(path, keep_config=True)
        assert kept.config.learning_rate == 5e-4
        row = kept_algo.record(kept.update(batch))
        assert row["lr"] == 5e-4 and "learning_rate 0.0002 → 0.0005" in row["config_changes"]
        assert kept_algo.config_changes[-1] == {"step": kept.step, "config": "trainer", "field": "learning_rate",
                                                "old": 2e-4, "new": 5e-4}
    finally:
        fresh.stop()

    with pytest.raises(ConfigError, match="lora_rank=8"):  # a LoRA checkpoint into a full fine-tuning trainer
        full = GRPOTrainer(engine, GRPOConfig(track_reference_kl=False))
        LightningRL(InMemoryStore(), full, [{"id": "t"}]).load(path)


def test_lora_in_bfloat16_with_gradient_checkpointing_trains_bfloat16_adapters_with_float32_masters(one_group):
    """The GPU recipe on the CPU: bf16 base (frozen), bf16 adapters computed in bf16 whose float32 masters the
    trainer's MasterWeightAdamW keeps (models/lora.py says why not peft's float32 adapters), gradient checkpointing
    through the frozen layers (non-reentrant, so no input needs requires_grad)."""
    eng = TransformersEngine.from_default(max_batch_size=4, dtype="bfloat16")
    try:
        base = {k: v.detach().clone() for k, v in eng.model.state_dict().items()}
        trainer = GRPOTrainer(eng, GRPOConfig(dtype="bfloat16", gradient_checkpointing=True, learning_rate=5e-4,
                                              track_reference_kl=True, kl_every=1, **LORA))
        assert {p.dtype for p in trainer._trainable} == {torch.bfloat16}
        assert {m.dtype for m in trainer.optimizer.master_params} == {torch.float32}
        batch = one_group(eng)
        before = _seq_logprob(eng.model, batch[0])
        m = trainer.update(batch)
        assert m["optimizer_steps"] == 1 and m["grad_norm"] > 0 and m["kl"] == 0.0
        assert _seq_logprob(eng.model, batch[0]) > before  # the rewarded completion became likelier
        assert all(torch.equal(v, base[k.replace(".base_layer.", ".")]) for k, v in base_state_dict(eng.model).items())
        # the model computes with its masters rounded to bfloat16
        assert all(torch.equal(p, m.to(torch.bfloat16)) for p, m in zip(trainer._trainable,
                                                                        trainer.optimizer.master_params))
    finally:
        eng.stop()


def _nll(model, ids_B_T):
    logits = model(input_ids=ids_B_T).logits[:, :-1].float()
    return -torch.log_softmax(logits, -1).gather(-1, ids_B_T[:, 1:, None]).mean()


def _lora_a_changed(params, names, before):
    """Fraction of the lora_A elements that differ from ``before``."""
    pairs = [(p, before[n]) for p, n in zip(params, names) if ".lora_A." in n]
    return sum(int((p != b).sum()) for p, b in pairs) / sum(p.numel() for p, _ in pairs)


def test_small_lr_steps_on_bfloat16_adapters_survive_in_float32_masters():
    """A step of lr 2e-5 or 1e-6 moves lora_A (|A| up to ~0.04) by ~lr: under half a bfloat16 step for most
    elements, so a plain AdamW on bf16 adapters rounds it away; the float32 masters keep it (bench/lora_dtype.py
    measures it over 10 steps)."""
    from lightning_nb.models.lora import add_lora
    from lightning_nb.trainers.optim import MasterWeightAdamW, make_optimizer

    ids_B_T = torch.randint(0, 49152, (1, 24), generator=torch.Generator().manual_seed(0))
    model, _ = load_default_model(dtype="bfloat16")
    add_lora(model, 8, 16.0)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = [p for p in model.parameters() if p.requires_grad]
    assert {p.dtype for p in params} == {torch.bfloat16}  # the base's dtype, not peft's float32
    start = {n: p.detach().clone() for n, p in zip(names, params)}
    for lr, plain_at_most in ((2e-5, 0.3), (1e-6, 0.02)):
        for kind in ("masters", "plain"):
            with torch.no_grad():
                for n, p in zip(names, params):
                    p.copy_(start[n])  # the same initial adapters for every run
            opt = (make_optimizer(params, dtype="bfloat16", lr=lr, weight_decay=0.0) if kind == "masters"
                   else torch.optim.AdamW(params, lr=lr, weight_decay=0.0))
            for step in range(2):  # step 1 moves B away from 0; from step 2 on A has a gradient
                opt.zero_grad()
                _nll(model, ids_B_T).backward()
                opt.step()
                if step == 0:  # B starts at 0, where bfloat16 holds a step of any size
                    assert all(bool((p != start[n]).all()) for n, p in zip(names, params) if ".lora_B." in n)
            if kind == "masters":
                assert isinstance(opt, MasterWeightAdamW)
                assert _lora_a_changed(opt.master_params, names, start) > 0.99, lr  # every A moved, in float32
                assert all(torch.equal(p, m.to(torch.bfloat16)) for p, m in zip(params, opt.master_params))
            else:  # lost, but for elements under about lr * 2^8 in size
                assert _lora_a_changed(params, names, start) < plain_at_most, lr


def test_float32_adapters_stay_available_and_bad_adapter_dtype_is_refused():
    from lightning_nb.models.lora import add_lora

    model, _ = load_default_model(dtype="bfloat16")
    with pytest.raises(ConfigError, match="adapter_dtype='bfloat16' must be None"):
        add_lora(model, 8, 16.0, adapter_dtype="bfloat16")
    add_lora(model, 8, 16.0, adapter_dtype="float32")  # peft's autocast_adapter_dtype
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}
    assert {p.dtype for p in model.parameters() if not p.requires_grad} == {torch.bfloat16}


def test_the_trainer_config_keeps_peft_float32_adapters_when_asked():
    """GRPOConfig.lora_adapter_dtype='float32' reaches add_lora (nothing the user sets is ignored)."""
    eng = TransformersEngine.from_default(max_batch_size=4, dtype="bfloat16")
    try:
        trainer = GRPOTrainer(eng, GRPOConfig(dtype="bfloat16", lora_adapter_dtype="float32", **LORA))
        assert {p.dtype for p in trainer._trainable} == {torch.float32}
        assert {p.dtype for p in eng.model.parameters() if not p.requires_grad} == {torch.bfloat16}
    finally:
        eng.stop()
