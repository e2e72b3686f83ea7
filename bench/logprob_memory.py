"""Memory of the trainer's token log-probs: the fused float32 head against the formula before issue 29.

Three ways to score ``B`` sequences of ``T`` tokens (response tokens after the first ``--prompt``):

* ``plain``: the model's own loss, ``model(input_ids, labels=input_ids).loss`` (a plain training loop);
* ``before``: ``response_logprobs`` as it was before issue 29 (``log_softmax`` of float32 copies of the
  logits from the model's ``forward``);
* ``now``: :func:`lightning_nb.trainers.grpo.logprobs.response_logprobs` (decoder + fused float32 head).

On CPU it totals the bytes autograd saves for backward (``saved_tensors_hooks``, parameters left out),
or with ``--peak METHOD`` the peak resident memory of one method's forward + backward (one per process);
on CUDA it measures the peak memory of forward + backward above the weights, for all three.

    .venv/bin/python bench/logprob_memory.py                                  # CPU, default model, 8 x 512
    .venv/bin/python bench/logprob_memory.py --batch 2 --gradient-checkpointing --peak now   # or before, plain
    python bench/logprob_memory.py --device cuda --shape 7b --batch 4 --tokens 1024 --lora-rank 32 \\
        --gradient-checkpointing                                               # the issue's 7B shape (one GPU)

``--shape 7b`` and ``1.5b`` are randomly initialised Qwen2.5-shaped models in bfloat16 (no download).
"""

from __future__ import annotations

import argparse
import time

import torch

SHAPES = {  # Qwen2.5-7B and -1.5B: hidden, intermediate, layers, heads, kv heads, vocab
    "7b": (3584, 18944, 28, 28, 4, 151936),
    "1.5b": (1536, 8960, 28, 12, 2, 151936),
}


def formula_before(model, ids_B_T, attn_B_T, mask_B_L, temp_B):
    """``response_logprobs`` before issue 29 (commit de7388f)."""
    L = mask_B_L.shape[1]
    cols = mask_B_L.any(dim=0).nonzero()
    first = int(cols[0]) if len(cols) else L - 1
    logits_B_K_V = model(input_ids=ids_B_T, attention_mask=attn_B_T, logits_to_keep=L + 1 - first).logits
    logits_B_K_V = logits_B_K_V[:, :-1].float() / temp_B[:, None, None]
    sel_B_K = mask_B_L[:, first:].bool()
    target_N = ids_B_T[:, 1:][:, first:][sel_B_K]
    logp_N = torch.log_softmax(logits_B_K_V[sel_B_K], dim=-1).gather(-1, target_N[:, None]).squeeze(-1)
    out_B_L = torch.zeros(mask_B_L.shape, dtype=logp_N.dtype, device=logp_N.device)
    out_B_L[:, first:][sel_B_K] = logp_N
    return out_B_L


def build(args):
    from lightning_nb.models.device import set_gradient_checkpointing

    if args.shape == "smol":
        from lightning_nb.models.default import load_default_model

        model, _ = load_default_model(device=args.device, dtype=args.dtype)
    else:
        from transformers import AutoModelForCausalLM, Qwen2Config

        h, inter, layers, heads, kv, vocab = SHAPES[args.shape]
        config = Qwen2Config(hidden_size=h, intermediate_size=inter, num_hidden_layers=layers,
                             num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                             tie_word_embeddings=False, max_position_embeddings=32768)
        with torch.device(args.device):
            model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, args.dtype))
    model.eval()
    if args.lora_rank:
        from lightning_nb.models.lora import add_lora

        add_lora(model, rank=args.lora_rank, alpha=float(args.lora_rank))
    if args.gradient_checkpointing:
        set_gradient_checkpointing(model)
    return model


def batch(args, vocab):
    B, T, P = args.batch, args.tokens, args.prompt
    g = torch.Generator(device=args.device).manual_seed(0)
    ids_B_T = torch.randint(3, vocab, (B, T), device=args.device, generator=g)
    mask_B_L = torch.zeros(B, T - 1, device=args.device)
    mask_B_L[:, P:] = 1
    return ids_B_T, torch.ones_like(ids_B_T), mask_B_L, torch.ones(B, device=args.device)


def saved_bytes(fn, model, inputs):
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = max(seen.get(ptr, 0), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(model, *inputs)
    return sum(seen.values()), max(seen.values())


def cuda_peak(step, model):
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    step().backward()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30, time.perf_counter() - t0


def main() -> None:
    from lightning_nb.trainers.grpo.logprobs import logprob_path, response_logprobs

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (CUDA default)")
    p.add_argument("--shape", default="smol", choices=["smol", *SHAPES])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--prompt", type=int, default=64, help="leading tokens of each row not scored")
    p.add_argument("--lora-rank", type=int, default=0)
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--peak", choices=["plain", "before", "now"],
                   help="CPU: forward + backward of this one method, and its peak resident memory")
    args = p.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    model = build(args)
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    inputs = batch(args, vocab)
    N = int(inputs[2].sum())
    print(f"{args.shape} ({sum(p.numel() for p in model.parameters()) / 1e9:.2f}B params, V {vocab}, H {hidden}), "
          f"{args.dtype} on {args.device}, {args.batch} x {args.tokens} tokens, {N} scored, "
          f"lora_rank {args.lora_rank}, checkpointing {args.gradient_checkpointing}; path: {logprob_path(model)}")
    print(f"one (N, V) float32 tensor: {N * vocab * 4 / 2**30:.3f} GiB; the fused head saves (N, H) hidden "
          f"states and (N,) log-sum-exps: {N * (hidden * model.dtype.itemsize + 4) / 2**30:.3f} GiB")
    steps = {
        "plain": lambda: model(input_ids=inputs[0], attention_mask=inputs[1], labels=inputs[0]).loss,
        "before": lambda: -formula_before(model, *inputs).sum(),
        "now": lambda: -response_logprobs(model, *inputs).sum(),
    }
    if args.device == "cpu":
        if args.peak:  # one method per process: the resident-set high-water mark cannot be reset
            import resource

            rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            t0 = time.perf_counter()
            steps[args.peak]().backward()
            rss = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 2**20  # KiB -> GiB
            print(f"{args.peak}: peak RSS {rss:.3f} GiB above the loaded model, forward + backward "
                  f"{time.perf_counter() - t0:.1f} s")
            return
        for name, fn in (("now", response_logprobs), ("before", formula_before)):
            total, biggest = saved_bytes(fn, model, inputs)
            print(f"saved for backward, {name}: {total / 2**30:.3f} GiB (largest tensor {biggest / 2**30:.3f} GiB)")
        return
    cuda_peak(steps["now"], model)  # warm-up: kernels and allocator
    for name, step in steps.items():
        gib, seconds = cuda_peak(step, model)
        print(f"{name:>6}: peak {gib:.3f} GiB above the weights, forward + backward {seconds:.3f} s")


if __name__ == "__main__":
    main()
