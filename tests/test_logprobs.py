"""Token log-probs without the memory, and engine/trainer agreement in bfloat16 (issue 29, items 4 and 5).

* ``lightning_nb.models.lm_head``: the fused float32 head (:func:`token_logprobs`) and the chunked
  upcast of a model's own logits (:func:`logits_token_logprobs`), checked by gradcheck in float64;
* ``response_logprobs`` on the real SmolLM2-135M: both of its paths give today's values and
  gradients in float32; LoRA adapters stay active (and ``disable_adapter`` gives the base model);
* what autograd saves for backward, totalled with ``torch.autograd.graph.saved_tensors_hooks``:
  no ``(N, V)`` float32 tensor is kept, where today's formula keeps one (:func:`_formula_before`);
* the engine serves float32 logits from a bfloat16 model, and its log-probs of sampled tokens
  agree with the trainer's.
"""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_nb.models.device import place_model
from lightning_nb.models.lm_head import (fp32_logits, has_fp32_head, install_fp32_head, logits_token_logprobs,
                                         token_logprobs)
from lightning_nb.trainers.grpo.logprobs import logprob_path, response_logprobs

V_SMOL = 49152


def _formula_before(model, ids_B_T, attn_B_T, mask_B_L, temp_B):
    """``response_logprobs`` as it was before issue 29 (commit de7388f): the model's forward, then
    ``log_softmax`` of float32 copies of the logits. The reference for values, gradients and memory."""
    L = mask_B_L.shape[1]
    cols = mask_B_L.any(dim=0).nonzero()
    first = int(cols[0]) if len(cols) else L - 1
    logits_B_K_V = model(input_ids=ids_B_T, attention_mask=attn_B_T, logits_to_keep=L + 1 - first).logits
    logits_B_K_V = logits_B_K_V[:, :-1].float() / temp_B[:, None, None]
    sel_B_K = mask_B_L[:, first:].bool()
    target_N = ids_B_T[:, 1:][:, first:][sel_B_K]
    logp_N = torch.log_softmax(logits_B_K_V[sel_B_K], dim=-1).gather(-1, target_N[:, None]).squeeze(-1)
    out_B_L = torch.zeros(mask_B_L.shape, dtype=logp_N.dtype)
    out_B_L[:, first:][sel_B_K] = logp_N
    return out_B_L


def _batch(B=2, T=40, first=12, seed=0):
    """Random tokens, right-padded: row 1 ends 8 tokens early; positions ``first``.. of each row scored."""
    g = torch.Generator().manual_seed(seed)
    ids_B_T = torch.randint(3, V_SMOL, (B, T), generator=g)
    attn_B_T = torch.ones(B, T, dtype=torch.long)
    mask_B_L = torch.zeros(B, T - 1)
    mask_B_L[:, first:] = 1
    if B > 1:
        attn_B_T[1, T - 8:] = 0
        ids_B_T[1, T - 8:] = 2
        mask_B_L[1, T - 9:] = 0
    temp_B = torch.tensor([1.0, 0.7, 1.3, 0.9][:B])
    return ids_B_T, attn_B_T, mask_B_L, temp_B


@pytest.fixture(scope="module")
def smol():
    """A float32 copy of the default model (trainable: gradients are taken) and its tokenizer."""
    from lightning_nb.models.default import load_default_model

    model, tokenizer = load_default_model()
    return model.eval(), tokenizer


# ----- the fused head alone ----------------------------------------------------------------------------
def test_fused_head_and_chunked_logits_pass_gradcheck_in_float64():
    g = torch.Generator().manual_seed(0)
    h_N_H = torch.randn(6, 5, dtype=torch.float64, generator=g, requires_grad=True)
    w_V_H = torch.randn(13, 5, dtype=torch.float64, generator=g, requires_grad=True)
    target_N = torch.tensor([0, 3, 4, 7, 12, 8])  # in the first, a middle, and the last (partial) vocabulary chunk
    temp_N = torch.tensor([1.0, 0.5, 2.0, 0.7, 1.0, 1.3], dtype=torch.float64)
    want_N = torch.log_softmax(h_N_H @ w_V_H.T / temp_N[:, None], -1).gather(1, target_N[:, None]).squeeze(1)
    got_N = token_logprobs(h_N_H, w_V_H, target_N, temp_N, vocab_chunk=4)
    assert torch.allclose(got_N, want_N, atol=1e-12, rtol=0)
    assert torch.autograd.gradcheck(lambda h, w: token_logprobs(h, w, target_N, temp_N, vocab_chunk=4),
                                    (h_N_H, w_V_H))
    z_N_V = torch.randn(6, 13, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(lambda z: logits_token_logprobs(z, target_N, temp_N, row_chunk=4), (z_N_V,))
    x_B_S_H = torch.randn(2, 3, 5, dtype=torch.float64, generator=g, requires_grad=True)
    bias_V = torch.randn(13, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w, b: fp32_logits(x, w, b), (x_B_S_H, w_V_H, bias_V))
    with pytest.raises(ValueError, match=r"want \(N, H\), \(V, H\)"):
        token_logprobs(h_N_H, w_V_H.T, target_N, temp_N)


def test_bfloat16_inputs_give_float32_logprobs_of_the_unrounded_logits():
    g = torch.Generator().manual_seed(1)
    h_N_H = (torch.randn(16, 64, generator=g) * 4).to(torch.bfloat16)
    w_V_H = torch.randn(300, 64, generator=g).to(torch.bfloat16)
    target_N = torch.randint(0, 300, (16,), generator=g)
    exact_N_V = h_N_H.double() @ w_V_H.double().T  # bfloat16 values are exact in float64
    want_N = torch.log_softmax(exact_N_V, -1).gather(1, target_N[:, None]).squeeze(1)
    got_N = token_logprobs(h_N_H, w_V_H, target_N, torch.ones(16), vocab_chunk=128)
    assert got_N.dtype == torch.float32 and float((got_N.double() - want_N).abs().max()) < 1e-4
    rounded_N = torch.log_softmax((h_N_H @ w_V_H.T).double(), -1).gather(1, target_N[:, None]).squeeze(1)
    assert float((rounded_N - want_N).abs().max()) > 1e-2  # what a bfloat16 head loses, and this one keeps


# ----- response_logprobs on the real model ----------------------------------------------------------
def _values_and_grads(fn, model, batch, names):
    model.zero_grad(set_to_none=True)
    logp_B_L = fn(model, *batch)
    (logp_B_L * torch.linspace(-1, 1, logp_B_L.shape[1])).sum().backward()
    params = dict(model.named_parameters())
    return logp_B_L.detach(), {n: params[n].grad.detach().clone() for n in names}


def test_both_paths_give_todays_values_and_gradients_on_the_default_model_in_float32(smol):
    model = smol[0]
    batch = _batch()
    names = ["model.embed_tokens.weight", "model.norm.weight", "model.layers.29.mlp.down_proj.weight",
             "model.layers.0.self_attn.q_proj.weight"]  # embed_tokens is also the (tied) LM head
    assert logprob_path(model) == "fused"
    want, want_grads = _values_and_grads(_formula_before, model, batch, names)
    results = {"fused": _values_and_grads(response_logprobs, model, batch, names)}
    hook = model.lm_head.register_forward_hook(lambda *args: None)  # a no-op hook: the model's forward must run
    try:
        assert logprob_path(model) == "forward: the output layer has forward hooks"
        results["forward"] = _values_and_grads(response_logprobs, model, batch, names)
    finally:
        hook.remove()
    mask_B_L = batch[2].bool()
    assert float(want[mask_B_L].max()) < -1 and torch.all(want[~mask_B_L] == 0)
    for path, (got, grads) in results.items():
        # float32 sums over 49,152 logits in another order: measured max |diff| 1.3e-5 on log-probs of -5..-25
        assert torch.allclose(got, want, atol=1e-5, rtol=2e-6), (path, float((got - want).abs().max()))
        assert torch.all(got[~mask_B_L] == 0), path
        for n in names:
            scale = float(want_grads[n].abs().max())
            assert scale > 0 and float((grads[n] - want_grads[n]).abs().max()) < 1e-4 * scale, (path, n)


def test_lora_adapters_stay_active_on_the_fused_path_and_disable_adapter_gives_the_base(smol):
    from lightning_nb.models.lora import add_lora

    base = smol[0]
    batch = _batch(seed=1)
    with torch.no_grad():
        want_base = response_logprobs(base, *batch)
    model = copy.deepcopy(base)
    peft_model = add_lora(model, rank=4, alpha=8)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02, generator=torch.Generator().manual_seed(len(name)))
        assert logprob_path(model) == logprob_path(peft_model) == "fused"
        adapted = response_logprobs(model, *batch)
        assert torch.equal(response_logprobs(peft_model, *batch), adapted)
        want_adapted = _formula_before(model, *batch)
        with peft_model.disable_adapter():
            disabled = response_logprobs(model, *batch)
    assert torch.allclose(adapted, want_adapted, atol=1e-5, rtol=2e-6)
    assert float((adapted - want_base).abs().max()) > 0.05  # the adapters count
    assert torch.allclose(disabled, want_base, atol=1e-5, rtol=2e-6)


def test_a_lora_wrapped_head_takes_the_models_forward(smol):
    from lightning_nb.models.lora import add_lora

    batch = _batch(seed=2)
    with torch.no_grad():
        want = response_logprobs(smol[0], *batch)
    model = copy.deepcopy(smol[0])
    add_lora(model, rank=4, alpha=8, target_modules=["q_proj", "lm_head"])
    assert logprob_path(model) == "forward: the output layer is a Linear, not a bias-free torch.nn.Linear"
    with torch.no_grad():  # lora_B starts at zero: the same function as the base model
        assert torch.allclose(response_logprobs(model, *batch), want, atol=1e-5, rtol=2e-6)


# ----- memory: what autograd saves ---------------------------------------------------------------
def saved_for_backward(fn, model, batch):
    """``(total bytes, largest tensor's bytes, its shape and dtype)`` of the distinct tensors autograd saves while
    ``fn(model, *batch)`` runs, the model's parameters left out (they are alive anyway)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, tuple[int, tuple, torch.dtype]] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = max(seen.get(ptr, (0, (), None)), (t.untyped_storage().nbytes(), tuple(t.shape), t.dtype),
                            key=lambda x: x[0])
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(model, *batch)
    biggest = max(seen.values(), key=lambda x: x[0])
    return sum(b for b, *_ in seen.values()), biggest


def test_no_full_vocabulary_float32_tensor_is_saved_for_backward(smol):
    model = smol[0]
    batch = _batch(B=2, T=96, first=16)
    N = int(batch[2].sum())
    nv_bytes = N * V_SMOL * 4  # one (N, V) float32 tensor
    total_new, (big_new, shape_new, _) = saved_for_backward(response_logprobs, model, batch)
    total_old, (big_old, shape_old, dtype_old) = saved_for_backward(_formula_before, model, batch)
    print(f"\nsaved for backward, default model, {N} scored tokens of 2 x 96: before {total_old / 2**20:.1f} MiB "
          f"(largest {shape_old} {dtype_old}, {big_old / 2**20:.1f} MiB), now {total_new / 2**20:.1f} MiB "
          f"(largest {shape_new}, {big_new / 2**20:.2f} MiB); one (N, V) float32 tensor is {nv_bytes / 2**20:.1f} MiB")
    assert big_old >= nv_bytes and dtype_old == torch.float32  # the formula before keeps its log-softmax
    assert big_new < nv_bytes / 20  # now the largest saved tensor is an activation, not vocabulary-wide
    assert total_old - total_new > nv_bytes * 0.9


# ----- the engine: float32 logits of a bfloat16 model --------------------------------------------
def test_the_fp32_head_returns_unrounded_float32_logits_and_keeps_the_state_dict(smol):
    model = place_model(copy.deepcopy(smol[0]), "cpu", "bfloat16")
    keys = list(model.state_dict())
    x_B_S_H = torch.randn(2, 3, 576).to(torch.bfloat16)
    with torch.no_grad():
        rounded = model.lm_head(x_B_S_H)
    assert rounded.dtype == torch.bfloat16 and not has_fp32_head(model)
    assert install_fp32_head(model) and install_fp32_head(model) and has_fp32_head(model)
    with torch.no_grad():
        got = model.lm_head(x_B_S_H)
        want = x_B_S_H.float() @ model.lm_head.weight.float().T
    assert got.dtype == torch.float32 and torch.allclose(got, want, atol=1e-4, rtol=1e-6)
    x_req = x_B_S_H.clone().requires_grad_(True)  # under autograd: float32 too, and gradients in the inputs' dtype
    out = model.lm_head(x_req)
    out.sum().backward()
    assert out.dtype == torch.float32 and torch.allclose(out.detach(), got, atol=1e-4, rtol=1e-6)
    assert x_req.grad.dtype == torch.bfloat16 and model.lm_head.weight.grad.dtype == torch.bfloat16
    assert float((rounded.float() - want).abs().max()) > 0.01  # the bfloat16 head's rounding, gone
    assert list(model.state_dict()) == keys and logprob_path(model) == "fused"
    twin = copy.deepcopy(model)  # the reference copy a trainer makes: its head is its own
    assert has_fp32_head(twin) and twin.lm_head.forward.__self__ is twin.lm_head
    assert torch.equal(fp32_logits(x_B_S_H.float(), smol[0].lm_head.weight), smol[0].lm_head(x_B_S_H.float()))


QUESTIONS = ["What is 17 + 25? Answer with a number.", "Name a colour of the sky.",
             "Write one word that rhymes with cat.", "What is 6 times 7?"]


def engine_vs_trainer_logprob_diffs(engine, max_tokens=32):
    """|engine − trainer| log-probs (nats) of the tokens ``engine`` samples at temperature 1 for the 4
    :data:`QUESTIONS` (seeded, one batch), the trainer side being ``response_logprobs`` of the same
    sequences, right-padded in one batch."""
    prompts = [engine.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    torch.manual_seed(0)
    gens = [f.result() for f in [engine.submit(p, temperature=1.0, max_tokens=max_tokens) for p in prompts]]
    T = max(len(g.prompt_ids) + len(g.completion_ids) for g in gens)
    ids_B_T = torch.full((len(gens), T), engine.pad_token_id)
    attn_B_T = torch.zeros(len(gens), T, dtype=torch.long)
    mask_B_L, engine_B_L = torch.zeros(len(gens), T - 1), torch.zeros(len(gens), T - 1)
    for b, g in enumerate(gens):
        seq, P = g.prompt_ids + g.completion_ids, len(g.prompt_ids)
        ids_B_T[b, :len(seq)], attn_B_T[b, :len(seq)] = torch.tensor(seq), 1
        mask_B_L[b, P - 1:len(seq) - 1] = 1
        engine_B_L[b, P - 1:len(seq) - 1] = torch.tensor(g.logprobs)
    device = engine.model.lm_head.weight.device
    with torch.no_grad():
        trainer_B_L = response_logprobs(engine.model, ids_B_T.to(device), attn_B_T.to(device), mask_B_L.to(device),
                                        torch.ones(len(gens), device=device)).cpu()
    return (trainer_B_L - engine_B_L).abs()[mask_B_L.bool()]


def test_bfloat16_engine_and_trainer_logprobs_agree_on_cpu(smol):
    from lightning_nb.engines.transformers import TransformersEngine

    model = place_model(copy.deepcopy(smol[0]), "cpu", "bfloat16").eval()
    engine = TransformersEngine(model, smol[1], max_batch_size=4, batch_wait_s=0.5)
    try:
        diff_N = engine_vs_trainer_logprob_diffs(engine)
    finally:
        engine.close()
    assert has_fp32_head(model)  # installed by the engine for a bfloat16 model
    p99, mx = float(diff_N.quantile(0.99)), float(diff_N.max())
    print(f"\nbf16 CPU, engine vs trainer over {len(diff_N)} tokens: mean {float(diff_N.mean()):.4f}, "
          f"p99 {p99:.4f}, max {mx:.4f} nats")
    # Measured here (this seeded sample: 4 prompts x 32 tokens): with both heads in bfloat16 (the code before
    # issue 29) 99 tokens, mean 0.037, p99 0.204, max 0.218 nats: this test fails on it; with the float32 head
    # on both sides 75 tokens, mean 0.031, p99 0.105, max 0.122. The bounds sit between the two for this
    # sample only: on 16 prompts x 64 tokens the float32 heads still give p99 0.21, max 0.29 (tests/
    # test_device.py's CUDA test, run on CPU). The head's own share, on the same bfloat16 hidden states, is
    # mean 0.024, p99 0.094, max 0.145 nats; the rest is the bfloat16 decoder (the engine's cached,
    # left-padded decode and the trainer's full forward round differently over 30 layers), which the
    # float32 head cannot remove. A wrong token or temperature costs > 1 nat. The bfloat16 kernels differ by CPU:
    # on this project's AMD EPYC VMs (2026-11-27) the same seeded sample gives 106 tokens, mean 0.032, p99 0.174,
    # max 0.318 nats with the float32 heads, so the bounds are p99 < 0.2 (still refusing the bfloat16-head
    # code's 0.204 above) and max < 0.4. On an Intel Xeon VM (2026-11-29) the same sample with the float32 heads
    # gives 82 tokens, mean 0.035, p99 0.280, max 0.515 nats, at 4f2283f too and with 1 or 2 threads: past what the
    # bfloat16-head code gave on the AMD VMs, so absolute bounds cannot tell the two heads apart across CPUs. The
    # float32 head is checked by has_fp32_head above; the bounds here refuse what a wrong token, temperature or
    # position costs (> 1 nat on a token, a mean of several tenths).
    assert len(diff_N) >= 64 and 0 < p99 < 0.4 and mx < 0.8 and float(diff_N.mean()) < 0.05
