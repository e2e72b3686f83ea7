"""Device and precision: GRPOConfig(device, dtype, gradient_checkpointing), TransformersEngine.from_pretrained.

CPU tests run everywhere on the real SmolLM2-135M, saved once with ``save_pretrained`` to a
local directory (``local_dir``) so each test can load its own copy and never touches the
session engine's weights or dtype. GPU tests (``@pytest.mark.gpu``) are skipped where torch
sees no CUDA device (tests/conftest.py says why); on a GPU they print tokens/s, peak memory
and step time.
"""

from __future__ import annotations

import copy
import time

import pytest
import torch

from lightning_nb import (AlgorithmConfig, GRPOConfig, GRPOTrainer, InMemoryStore, LightningRL,
                          TransformersEngine)
from lightning_nb.models.device import model_device, model_dtype, set_gradient_checkpointing
from lightning_nb.errors import ConfigError
from lightning_nb.trainers.optim import MasterWeightAdamW
from lightning_nb.trainers.grpo.trainer import response_logprobs
from lightning_nb.types import Triplet

pytestmark = pytest.mark.slow

QUESTION = "What is 17 + 25? Answer with a number."


@pytest.fixture(scope="module")
def local_dir(engine, tmp_path_factory):
    """The default model's initial weights and tokenizer as a Hugging Face directory (safetensors)."""
    path = tmp_path_factory.mktemp("smollm2-hf")
    model = copy.deepcopy(engine.model)
    model.load_state_dict(engine.initial_state)
    model.save_pretrained(path)
    engine.tokenizer.save_pretrained(path)
    del model
    return path


@pytest.fixture
def own_engine(local_dir):
    """A float32 CPU engine on its own copy of the model (from ``local_dir``)."""
    eng = TransformersEngine.from_pretrained(local_dir, max_batch_size=8)
    yield eng
    eng.close()


def _prompt(engine):
    return engine.apply_chat_template([{"role": "user", "content": QUESTION}])


@pytest.fixture
def samples(distinct_generations):
    """``samples(engine, n, max_tokens=12)``: ``n`` distinct sampled completions (temperature 1) of the same prompt,
    each request seeded (0, 1, ...)."""
    return lambda engine, n, max_tokens=12: distinct_generations(engine, _prompt(engine), n, max_tokens=max_tokens,
                                                                 seed_each_call=True)


def _batch(gens):
    """One group: the first half rewarded 1, the rest 0."""
    return [Triplet(rollout_id=f"r{i}", attempt_id=f"a{i}", group_id="g", turn=0, prompt_ids=g.prompt_ids,
                    response_ids=g.completion_ids, logprobs=g.logprobs, reward=float(i < len(gens) // 2),
                    temperature=g.temperature, weight_version=g.weight_version) for i, g in enumerate(gens)]


# ----- configuration errors -------------------------------------------------------------
def test_a_bad_device_or_dtype_is_a_config_error_naming_the_field(local_dir):
    with pytest.raises(ConfigError, match=r"GRPOConfig\.device='gpu'.*'cpu'.*'cuda'"):
        GRPOConfig(device="gpu")
    with pytest.raises(ConfigError, match=r"GRPOConfig\.dtype='float16'.*loss scaling.*'bfloat16'"):
        GRPOConfig(dtype="float16")
    with pytest.raises(ConfigError, match=r"GRPOConfig\.dtype='fp64'.*'float32'.*'bfloat16'"):
        GRPOConfig(dtype="fp64")
    with pytest.raises(ValueError):  # ConfigError is a ValueError
        GRPOConfig(device="cuda:x")
    with pytest.raises(ConfigError, match=r"^dtype='int8'"):
        TransformersEngine.from_pretrained(local_dir, dtype="int8")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"GRPOConfig\.device='cuda'.*torch\.cuda\.is_available\(\) is False"):
            GRPOConfig(device="cuda")
        with pytest.raises(ConfigError, match=r"^device='cuda:0'.*is_available\(\) is False"):
            TransformersEngine.from_pretrained(local_dir, device="cuda:0")


def test_device_dtype_and_checkpointing_are_set_at_construction_not_edited_later(own_engine, samples):
    trainer = GRPOTrainer(own_engine, GRPOConfig(track_reference_kl=False))
    algo = LightningRL(InMemoryStore(), trainer, [{"id": "t"}], config=AlgorithmConfig(tasks_per_step=1, group_size=2))
    batch = _batch(samples(own_engine, 2, max_tokens=4))
    trainer.config.dtype = "bfloat16"
    with pytest.raises(ConfigError, match=r"GRPOConfig\.dtype was 'float32'.*set at construction"):
        algo.resume()
    with pytest.raises(ConfigError, match=r"GRPOConfig\.dtype"):
        trainer.update(batch)
    trainer.config.dtype = "float32"
    trainer.config.gradient_checkpointing = True
    with pytest.raises(ConfigError, match=r"GRPOConfig\.gradient_checkpointing"):
        trainer.update(batch)
    assert trainer.updates_applied == 0 and model_dtype(own_engine.model) == torch.float32


# ----- any local Hugging Face directory -------------------------------------------------
def test_from_pretrained_of_a_local_dir_serves_what_the_default_engine_serves(engine, pristine, local_dir):
    eng = TransformersEngine.from_pretrained(local_dir, max_batch_size=8)
    try:
        assert eng.model_name == local_dir.name and eng.model_source == str(local_dir)
        assert eng.stop_token_ids == engine.stop_token_ids == [2, 1]
        prompt = engine.apply_chat_template([{"role": "user", "content": QUESTION}])
        assert eng.apply_chat_template([{"role": "user", "content": QUESTION}]) == prompt
        want = engine.generate(prompt, temperature=0.0, max_tokens=24)
        got = eng.generate(prompt, temperature=0.0, max_tokens=24)
        assert got.completion_ids == want.completion_ids and got.text == want.text
        assert got.finish_reason == want.finish_reason
        assert max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs)) < 1e-4
    finally:
        eng.close()
    with pytest.raises(OSError):  # not a directory: taken as a hub id, which this absolute path cannot be
        TransformersEngine.from_pretrained(str(local_dir) + "-missing")


# ----- bfloat16 ---------------------------------------------------------------------------
def test_plain_adamw_on_bfloat16_weights_rounds_the_step_away_and_master_weights_keep_it(engine):
    """Why bfloat16 training keeps float32 master weights: measured on a real weight matrix."""
    weight = engine.initial_state["model.layers.0.mlp.down_proj.weight"]
    grad = torch.randn(weight.shape, generator=torch.Generator().manual_seed(0))
    moved = {}
    for name, make in (("plain", torch.optim.AdamW), ("master", MasterWeightAdamW)):
        p = torch.nn.Parameter(weight.to(torch.bfloat16).clone())
        opt = make([p], lr=2e-5, weight_decay=0.0)
        for _ in range(10):
            p.grad = grad.to(torch.bfloat16)
            opt.step()
        start = weight.to(torch.bfloat16)
        moved[name] = float((p.detach() != start).float().mean())
        if name == "master":
            master = opt.master_params[0].detach()
            # ten AdamW steps of ~lr each, all kept in float32; the model holds them rounded
            step = (master - weight).abs()
            assert float(step.median()) == pytest.approx(10 * 2e-5, rel=0.05)
            assert torch.equal(p.detach(), master.detach().to(torch.bfloat16))
    print(f"\nweights changed by 10 AdamW steps (lr 2e-5) in bfloat16: plain {moved['plain']:.1%}, "
          f"with float32 masters {moved['master']:.1%}")
    assert moved["plain"] < 0.05 < moved["master"]


def test_bfloat16_update_on_cpu_serves_float32_logprobs_that_agree_with_the_trainer(own_engine, samples):
    trainer = GRPOTrainer(own_engine, GRPOConfig(dtype="bfloat16", micro_batch_size=4, track_reference_kl=True))
    assert model_dtype(own_engine.model) == torch.bfloat16 and model_dtype(trainer.reference) == torch.bfloat16
    assert isinstance(trainer.optimizer, MasterWeightAdamW)
    assert own_engine.model.model.rotary_emb.inv_freq.dtype == torch.float32  # computed, not saved: not rounded
    gens = samples(own_engine, 4)  # sampled by the engine on the now-bfloat16 model
    lps = [lp for g in gens for lp in g.logprobs]
    # log-probs computed in bfloat16 would all be bfloat16 values; float32 ones mostly are not
    off_grid = sum(torch.tensor(lp).to(torch.bfloat16).float().item() != lp for lp in lps)
    assert off_grid > len(lps) // 2, (off_grid, len(lps))
    # the trainer's own scoring (response_logprobs, full forward in bfloat16) against the engine's cached decode
    diffs = []
    for g in gens:
        ids_B_T = torch.tensor([g.prompt_ids + g.completion_ids])
        P = len(g.prompt_ids)
        mask_B_L = torch.tensor([[0.0] * (P - 1) + [1.0] * len(g.completion_ids)])
        with torch.no_grad():
            lp = response_logprobs(trainer.model, ids_B_T, torch.ones_like(ids_B_T), mask_B_L, torch.tensor([1.0]))
        diffs.append((lp[0, P - 1:] - torch.tensor(g.logprobs)).abs())
    diff_N = torch.cat(diffs)
    masters = [m.detach().clone() for m in trainer.optimizer.master_params]
    m = trainer.update(_batch(gens))
    print(f"\nbf16 CPU: engine vs trainer log-probs over {len(diff_N)} tokens: mean {float(diff_N.mean()):.4f}, "
          f"max {float(diff_N.max()):.4f} nats; update logprob_diff_max {m['logprob_diff_max']:.4f}, "
          f"loss {m['loss']:.4f}, grad_norm {m['grad_norm']:.3f}, {m['update_seconds']:.2f} s, "
          f"{m['tokens_per_s']:.0f} tokens/s")
    # Tolerance. bfloat16 keeps 8 significant bits: a logit near 20 is held to about 20 * 2**-9 = 0.04, and
    # the engine's cached incremental decode (left-padded batch) rounds differently from the trainer's full
    # forward over 30 layers. Measured here on 725 sampled tokens: mean 0.039, p99 0.18, max 0.22 nats
    # (float32: < 1e-5). Bounds at about 2x that: mean < 0.1 and max < 0.5 nats. A real mismatch (another
    # model, a temperature not applied, tokens shifted by one) costs > 1 nat on average.
    assert 0 < float(diff_N.mean()) < 0.1 and float(diff_N.max()) < 0.5
    assert 0 < m["logprob_diff_max"] < 0.5
    assert m["sequences_trained"] == 4 and m["grad_norm"] > 0 and m["loss"] == m["loss"]
    moved = [float((a.detach() - b).abs().max()) for a, b in zip(trainer.optimizer.master_params, masters)]
    assert max(moved) > 0  # the float32 masters took the step
    assert own_engine.weight_version == 1
    assert own_engine.generate(_prompt(own_engine), temperature=0.0, max_tokens=4).weight_version == 1


def test_bfloat16_checkpoint_round_trip_keeps_the_float32_masters(own_engine, tmp_path, samples):
    trainer = GRPOTrainer(own_engine, GRPOConfig(dtype="bfloat16", track_reference_kl=False))
    trainer.update(_batch(samples(own_engine, 2, max_tokens=6)))
    algo = LightningRL(InMemoryStore(), trainer, [{"id": "t"}])
    masters = [m.detach().clone() for m in trainer.optimizer.master_params]
    path = algo.save(tmp_path / "bf16.pt")
    with torch.no_grad():
        for m in trainer.optimizer.master_params:
            m.zero_()
    algo.load(path)
    assert all(torch.equal(a, b) for a, b in zip(trainer.optimizer.master_params, masters))
    assert all(torch.equal(p.detach(), m.to(torch.bfloat16))
               for p, m in zip(trainer.optimizer.model_params, masters))


# ----- gradient checkpointing -------------------------------------------------------------
def test_gradient_checkpointing_gives_the_same_step_and_recomputes_each_layer(own_engine, samples):
    gens = samples(own_engine, 4)
    start = {k: v.detach().clone() for k, v in own_engine.model.state_dict().items()}
    attn_calls = []
    hook = own_engine.model.model.layers[3].self_attn.register_forward_pre_hook(lambda *a: attn_calls.append(1))
    results = {}
    try:
        for gc in (False, True):
            with torch.no_grad():
                own_engine.model.load_state_dict(start)
            trainer = GRPOTrainer(own_engine, GRPOConfig(gradient_checkpointing=gc, micro_batch_size=4))
            attn_calls.clear()
            # the reloaded weights are the ones that sampled: on-policy for both updates, though the first
            # update moved engine.weight_version on
            batch = [t.model_copy(update={"weight_version": own_engine.weight_version}) for t in _batch(gens)]
            results[gc] = trainer.update(batch)
            results[gc]["attn_calls"] = len(attn_calls)
    finally:
        hook.remove()
    # one micro-batch: the policy forward (no reference model with kl_coef=0); checkpointing adds the recompute
    assert results[False]["attn_calls"] == 1 and results[True]["attn_calls"] == 2
    for key in ("loss", "pg_loss", "logprob_diff_max"):
        assert results[True][key] == pytest.approx(results[False][key], rel=1e-6, abs=1e-7), key
    assert results[True]["grad_norm"] == pytest.approx(results[False]["grad_norm"], rel=1e-5)
    # generation is untouched: no checkpoint (and the KV cache is kept) when autograd is off
    with torch.no_grad():
        own_engine.model.load_state_dict(start)
    greedy = own_engine.generate(_prompt(own_engine), temperature=0.0, max_tokens=16)
    assert set_gradient_checkpointing(own_engine.model, False) == 30
    assert own_engine.generate(_prompt(own_engine), temperature=0.0, max_tokens=16).completion_ids == \
        greedy.completion_ids


# ----- on a GPU ---------------------------------------------------------------------------
def _cuda_peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30


def _default_model_or_skip():
    from lightning_nb.models.default import default_gguf_path
    from lightning_nb.errors import MissingDependencyError

    try:
        default_gguf_path()
    except MissingDependencyError as exc:
        pytest.skip(f"the default model's weights are not on this machine: {exc}")


@pytest.mark.gpu
def test_grpo_update_on_cuda_bfloat16_through_the_transformers_engine(tmp_path):
    pytest.importorskip("verl", reason="GRPOTrainer.update imports verl.trainer.ppo.core_algos (group_advantages, "
                                       "update); this environment has no verl")
    _default_model_or_skip()
    engine = TransformersEngine.from_default(max_batch_size=16)
    try:
        trainer = GRPOTrainer(engine, GRPOConfig(device="cuda", dtype="bfloat16", gradient_checkpointing=True,
                                                 micro_batch_size=8))
        assert model_device(engine.model).type == "cuda" and model_dtype(engine.model) == torch.bfloat16
        torch.manual_seed(0)
        torch.cuda.reset_peak_memory_stats()
        rows = []
        for _ in range(3):  # sample with the current weights, then train on it: on-policy steps
            t0 = time.perf_counter()
            gens = [f.result() for f in [engine.submit(_prompt(engine), temperature=1.0, max_tokens=64)
                                         for _ in range(16)]]
            gen_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            m = trainer.update(_batch(gens))
            torch.cuda.synchronize()
            rows.append((sum(len(g.completion_ids) for g in gens) / gen_s, time.perf_counter() - t0, m))
        for gen_tps, step_s, m in rows:
            print(f"\ncuda bf16 SmolLM2-135M, {torch.cuda.get_device_name()}: generate 16 x <=64 tokens at "
                  f"{gen_tps:.0f} tokens/s; update step {step_s:.3f} s, {m['tokens_per_s']:.0f} tokens/s, "
                  f"logprob_diff_max {m['logprob_diff_max']:.4f}")
        print(f"peak CUDA memory allocated: {_cuda_peak_gib():.2f} GiB")
        assert all(m["sequences_trained"] > 0 and m["grad_norm"] > 0 for *_, m in rows)
        assert all(0 < m["logprob_diff_max"] < 0.5 for *_, m in rows)  # bfloat16 noise: see the CPU bf16 test
        # a checkpoint saved on cuda loads on the CPU
        path = LightningRL(InMemoryStore(), trainer, [{"id": "t"}]).save(tmp_path / "cuda.pt")
        cpu_engine = TransformersEngine.from_default()
        try:
            cpu_trainer = GRPOTrainer(cpu_engine, GRPOConfig(dtype="bfloat16"))
            LightningRL(InMemoryStore(), cpu_trainer, [{"id": "t"}]).load(path)
            assert cpu_trainer.updates_applied == trainer.updates_applied == 3
            for (name, a), b in zip(engine.model.state_dict().items(), cpu_engine.model.state_dict().values()):
                assert b.device.type == "cpu" and torch.equal(a.cpu(), b), name
        finally:
            cpu_engine.close()
    finally:
        engine.close()


@pytest.mark.gpu
def test_the_engine_serves_on_cuda_in_bfloat16_over_http():
    import httpx

    _default_model_or_skip()
    engine = TransformersEngine.from_default(device="cuda", dtype="bfloat16", max_batch_size=16)
    try:
        assert model_device(engine.model).type == "cuda"
        prompt = _prompt(engine)
        direct = engine.generate(prompt, temperature=0.0, max_tokens=32)
        body = {"model": engine.model_name, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 32,
                "temperature": 0.0, "logprobs": True, "return_token_ids": True}
        r = httpx.post(f"{engine.base_url}/chat/completions", json=body, timeout=120).json()
        assert r["prompt_token_ids"] == prompt and r["choices"][0]["token_ids"] == direct.completion_ids
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        gens = [f.result() for f in [engine.submit(prompt, temperature=1.0, max_tokens=64) for _ in range(16)]]
        seconds = time.perf_counter() - t0
        print(f"\ncuda bf16 engine: {sum(len(g.completion_ids) for g in gens) / seconds:.0f} tokens/s at 16 "
              f"concurrent requests, peak memory {_cuda_peak_gib():.2f} GiB")
        assert all(all(lp <= 0 for lp in g.logprobs) for g in gens)
        seeded = [engine.generate(prompt, temperature=1.0, max_tokens=16, seed=7).completion_ids for _ in range(2)]
        assert seeded[0] == seeded[1]  # the CUDA generator is forked and seeded per request
    finally:
        engine.close()


@pytest.mark.gpu
@pytest.mark.parametrize("trainer_kind", ["grpo", "verl"])
def test_lora_update_on_cuda_bfloat16(trainer_kind, tmp_path):
    """LoRA r=32 in bf16 on CUDA: GRPOTrainer, and VerlTrainer (verl's actor update in this process, without Ray, on
    our DataProto) with the one-GPU preset."""
    pytest.importorskip("verl", reason="both trainers import verl (GRPOTrainer its core_algos; pip install "
                                       "'lightning-nb[verl]' or '[gpu]'); this environment has no verl")
    _default_model_or_skip()
    from lightning_nb.trainers.verl.trainer import VerlConfig, VerlTrainer
    from lightning_nb.models.lora import base_state_dict

    engine = TransformersEngine.from_default(max_batch_size=16)
    try:
        if trainer_kind == "verl":
            trainer = VerlTrainer(engine, VerlConfig.one_gpu_lora(learning_rate=2e-4, micro_batch_size=8))
        else:
            trainer = GRPOTrainer(engine, GRPOConfig(device="cuda", dtype="bfloat16", gradient_checkpointing=True,
                                                     micro_batch_size=8, lora_rank=32, lora_alpha=32.0,
                                                     learning_rate=2e-4, track_reference_kl=True, kl_every=1))
        base = {k: v.detach().clone() for k, v in base_state_dict(engine.model).items()}
        torch.manual_seed(0)
        torch.cuda.reset_peak_memory_stats()
        for step in range(3):
            gens = [f.result() for f in [engine.submit(_prompt(engine), temperature=1.0, max_tokens=64)
                                         for _ in range(16)]]
            t0 = time.perf_counter()
            m = trainer.update(_batch(gens))
            torch.cuda.synchronize()
            print(f"\n{type(trainer).__name__} cuda bf16 LoRA r=32 SmolLM2-135M step {step}: update "
                  f"{time.perf_counter() - t0:.3f} s, {m['tokens_per_s']:.0f} tokens/s, kl {m['kl']:.5f}, "
                  f"logprob_diff_max {m['logprob_diff_max']:.4f}, pg_clipfrac {m['pg_clipfrac']:.3f}")
        print(f"peak CUDA memory allocated: {_cuda_peak_gib():.2f} GiB")
        assert m["grad_norm"] > 0 and m["kl"] > 0
        assert trainer_kind == "grpo" or "kl_loss" in m  # the preset's KL loss ran in verl's ppo_loss
        assert all(torch.equal(v, base[k]) for k, v in base_state_dict(engine.model).items())
        from transformers import AutoModelForCausalLM

        merged = AutoModelForCausalLM.from_pretrained(trainer.save_pretrained(tmp_path / "merged"))
        assert merged.config.vocab_size == engine.model.config.vocab_size
    finally:
        engine.close()


@pytest.mark.gpu
def test_bfloat16_engine_and_trainer_logprobs_agree_on_cuda():
    """Issue 29 item 5: the engine samples and scores with float32 logits of its bfloat16 hidden states (the
    fp32 head), the trainer scores the same tokens with its fused float32 head. Before that change CUDA bf16
    gave logprob_diff_max 1.89 nats at step 1 (FACTS.md); the issue's target is p99 < 0.1."""
    from lightning_nb.models.lm_head import has_fp32_head
    from lightning_nb.trainers.grpo.logprobs import logprob_path

    _default_model_or_skip()
    engine = TransformersEngine.from_default(device="cuda", dtype="bfloat16", max_batch_size=16, batch_wait_s=0.5)
    try:
        questions = ["What is 17 + 25? Answer with a number.", "Name a colour of the sky.",
                     "Write one word that rhymes with cat.", "What is 6 times 7?"] * 4
        prompts = [engine.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
        torch.manual_seed(0)
        gens = [f.result() for f in [engine.submit(p, temperature=1.0, max_tokens=64) for p in prompts]]
        assert has_fp32_head(engine.model) and logprob_path(engine.model) == "fused"
        diffs = []
        for g in gens:  # one sequence at a time, as the CPU test in this module
            ids_B_T = torch.tensor([g.prompt_ids + g.completion_ids], device="cuda")
            P = len(g.prompt_ids)
            mask_B_L = torch.tensor([[0.0] * (P - 1) + [1.0] * len(g.completion_ids)], device="cuda")
            with torch.no_grad():
                lp = response_logprobs(engine.model, ids_B_T, torch.ones_like(ids_B_T), mask_B_L,
                                       torch.ones(1, device="cuda"))
            diffs.append((lp[0, P - 1:].cpu() - torch.tensor(g.logprobs)).abs())
        diff_N = torch.cat(diffs)
        p99, mx = float(diff_N.quantile(0.99)), float(diff_N.max())
        print(f"\ncuda bf16 {torch.cuda.get_device_name()}: engine vs trainer over {len(diff_N)} sampled tokens: "
              f"mean {float(diff_N.mean()):.4f}, p99 {p99:.4f} (issue 29 target < 0.1), max {mx:.4f} nats")
        # The same test on CPU (bf16, 16 x 64 tokens, 602 scored): mean 0.033, p99 0.208, max 0.286 nats. The
        # float32 head removes the head's rounding (mean 0.024, p99 0.094 nats between a bfloat16 and a float32
        # head on the same hidden states); the rest is the bfloat16 decoder: its trainer-side log-probs differ
        # from the float32 model's by p99 0.17, max 0.44 nats, and the engine's cached decode rounds otherwise.
        # So p99 < 0.1 is not expected here (GRPOConfig.tis_cap covers it); these bounds catch a regression (CUDA
        # bf16 before issue 29: logprob_diff_max 1.89 nats) and a real mismatch (a wrong token, position or
        # temperature costs > 1 nat on average).
        assert len(diff_N) >= 128 and 0 < float(diff_N.mean()) < 0.1 and 0 < p99 < 0.3 and mx < 1.0
    finally:
        engine.close()


@pytest.mark.gpu
def test_fused_logprobs_peak_memory_on_cuda_against_a_plain_loop():
    """Issue 29 item 4 at the default model's shape (8 x 512 tokens, bf16): peak CUDA memory of forward +
    backward through response_logprobs, the formula before issue 29, and a plain loop (the model's own
    ``labels=`` loss). bench/logprob_memory.py --shape 7b does the same at the issue's 7B shape."""
    from lightning_nb.models.default import load_default_model

    _default_model_or_skip()
    model, _ = load_default_model(device="cuda", dtype="bfloat16")
    B, T, P = 8, 512, 64
    g = torch.Generator(device="cuda").manual_seed(0)
    ids_B_T = torch.randint(3, model.config.vocab_size, (B, T), device="cuda", generator=g)
    attn_B_T = torch.ones_like(ids_B_T)
    mask_B_L = torch.zeros(B, T - 1, device="cuda")
    mask_B_L[:, P:] = 1
    temp_B = torch.ones(B, device="cuda")
    N, V = int(mask_B_L.sum()), model.config.vocab_size

    def peak(step):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step().backward()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**30

    def old_formula():
        logits = model(input_ids=ids_B_T, attention_mask=attn_B_T, logits_to_keep=T - P).logits[:, :-1].float()
        sel = mask_B_L[:, P:].bool()
        return -torch.log_softmax(logits[sel], -1).gather(-1, ids_B_T[:, P + 1:][sel][:, None]).sum()

    plain = peak(lambda: model(input_ids=ids_B_T, attention_mask=attn_B_T, labels=ids_B_T).loss)
    before = peak(old_formula)
    now = peak(lambda: -response_logprobs(model, ids_B_T, attn_B_T, mask_B_L, temp_B).sum())
    print(f"\ncuda bf16 SmolLM2-135M, {B} x {T} tokens ({N} scored, V {V}): peak above the weights: plain loop "
          f"{plain:.3f} GiB, formula before issue 29 {before:.3f} GiB, response_logprobs now {now:.3f} GiB; "
          f"one (N, V) float32 tensor is {N * V * 4 / 2**30:.3f} GiB")
    assert now < before - N * V * 4 / 2**30  # at least one full-vocabulary float32 copy fewer
    assert now < plain + 0.3  # issue 29's bound against a plain loop


@pytest.mark.gpu
def test_the_fused_head_on_cuda_bfloat16_matches_float64_and_takes_the_float32_accumulating_matmul():
    """The CUDA path of lightning_nb.models.lm_head: bfloat16 operands multiplied by ``torch.mm(...,
    out_dtype=torch.float32)`` (or upcast where this torch lacks it), against float64 on the same values."""
    from lightning_nb.models import lm_head

    g = torch.Generator(device="cuda").manual_seed(0)
    h_N_H = (torch.randn(512, 896, device="cuda", generator=g) * 2).to(torch.bfloat16).requires_grad_(True)
    w_V_H = (torch.randn(20000, 896, device="cuda", generator=g) / 30).to(torch.bfloat16).requires_grad_(True)
    target_N = torch.randint(0, 20000, (512,), device="cuda", generator=g)
    temp_N = torch.full((512,), 0.8, device="cuda")
    got_N = lm_head.token_logprobs(h_N_H, w_V_H, target_N, temp_N)
    got_N.sum().backward()
    h64, w64 = h_N_H.detach().double().requires_grad_(True), w_V_H.detach().double().requires_grad_(True)
    want_N = torch.log_softmax(h64 @ w64.T / 0.8, -1).gather(1, target_N[:, None]).squeeze(1)
    want_N.sum().backward()
    print(f"\ntorch.mm(out_dtype=float32) on CUDA: {lm_head._OUT_DTYPE_MM.get('cuda')}; max |logp - float64| "
          f"{float((got_N.double() - want_N).abs().max()):.2e} nats")
    assert got_N.dtype == torch.float32 and float((got_N.double() - want_N).abs().max()) < 1e-3
    for got, want in ((h_N_H.grad, h64.grad), (w_V_H.grad, w64.grad)):  # bfloat16 gradients: 8 bits
        assert got.dtype == torch.bfloat16
        assert float((got.double() - want).abs().max()) < 0.02 * float(want.abs().max())
