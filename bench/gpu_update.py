"""A trainer's update vs a plain PyTorch forward+backward+AdamW of the same model and batch (issues 29 and 42).

Targets: ``GRPOTrainer.update`` at least 0.8x the plain loop's tokens/s at its best micro-batch, and
``VerlTrainer.update`` (``--trainer verl``: verl's actor with its CUDA default, a token budget from free memory,
``use_dynamic_bsz``) at least 0.7x. Runs where a GPU is
available; on a machine without CUDA it exits with a message, unless ``--device cpu`` (a smoke run)::

    python bench/gpu_update.py                                  # CUDA, bf16, SmolLM2-135M, 64 x 512 tokens
    python bench/gpu_update.py --micro-batch-tokens 16384       # a fixed token budget instead of "auto"
    python bench/gpu_update.py --micro-batch-tokens none --micro-batch-size 4   # the old default: 4 rows
    python bench/gpu_update.py --qwen 1.5b --gradient-checkpointing             # a random Qwen2.5-1.5B shape
    python bench/gpu_update.py --trainer grpo,verl   # both trainers after one plain loop (one model load)
    python bench/gpu_update.py --device cpu --sequences 4 --tokens 48 --plain-micro-batches 2,4 --repeats 1

Workload, the same on both sides:

* model: the default model (SmolLM2-135M-Instruct, ``TransformersEngine.from_default``), or with ``--qwen``
  a randomly initialised ``Qwen2ForCausalLM`` of Qwen2.5's published shape (0.5b, 1.5b, 3b, 7b; no weights
  are downloaded; ``tiny``: Qwen2.5's vocabulary on a 2-layer, 64-wide body, for smoke runs); ``--dtype``
  (bfloat16 on CUDA by default, float32 on CPU); gradient checkpointing on both
  sides or neither (``--gradient-checkpointing``).
* batch: ``--sequences`` (64) sequences of ``--tokens`` (512) random token ids each (``--min-tokens`` below
  that draws lengths uniformly in [min, tokens], so padding matters), the first ``--prompt-tokens`` (64) the
  prompt and the rest the response; groups of 8 with rewards alternating 1 and 0 (every advantage ±1, so
  every sequence is forwarded). Triplets carry no engine log-probs (π_old is the trainer's own).
* the trainer: ``GRPOTrainer`` with ``kl_coef=0`` and ``track_reference_kl=False`` (no reference model, no
  KL forward), one optimizer step per update (``ppo_epochs=1``, ``mini_batch_size=None``), token-mean loss,
  gradient clipping at 1.0, its AdamW (with ``dtype="bfloat16"``: float32 master weights and moments,
  ``lightning_nb.trainers.optim.MasterWeightAdamW``), micro-batches by ``--micro-batch-tokens`` (``auto``:
  from free device memory) and ``--micro-batch-size``. Timed: ``trainer.update(triplets)``, all of it
  (batch building, the forward/backward passes, the step, the engine's weight version).
* ``--trainer verl``: ``VerlTrainer`` with ``VerlConfig`` of the same settings (``kl_coef=0``, one optimizer
  step, token-mean loss, clipping at 1.0, micro-batches by the same ``--micro-batch-tokens``: verl's
  ``ppo_max_token_len_per_gpu``; ``none`` gives verl ``--micro-batch-size`` rows × the longest row, 4 by
  default). Before issue 49 verl recomputed π_old in a forward of its own before every update (timed too);
  with one optimizer step π_old is now the update's own forward.
* the plain loop: the same model object before the trainer is built, no reference model and no KL (the same
  settings), ``torch.optim.AdamW`` on the model's parameters as they are (in bf16 that is cheaper than the
  trainer's float32 masters: stated, not hidden), per micro-batch ``model(input_ids).logits`` for every
  position, float32 cross-entropy over the response tokens (the loss of SFT; the trainer asks for logits
  from the first response token only), backward, then gradient clipping at 1.0 and one optimizer step per
  batch. Tried at each of ``--plain-micro-batches`` rows (8,16,32,64); the best is the reference.

Each side runs one warm-up pass, then ``--repeats`` (3) timed passes; the median is reported, with
``torch.cuda.synchronize()`` around each pass on CUDA. Prints tokens/s of both (tokens: all the batch's
tokens, prompt and response, without padding), the ratio, the trainer's ``micro_batches``,
``padding_fraction`` and ``micro_batch_tokens``, and on CUDA the peak memory of each side.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from typing import Any, Callable

import torch

# Qwen2.5 shapes (the models' config.json): hidden, intermediate, layers, heads, kv heads, vocabulary, tied.
QWEN25 = {
    "0.5b": (896, 4864, 24, 14, 2, 151936, True),
    "1.5b": (1536, 8960, 28, 12, 2, 151936, True),
    "3b": (2048, 11008, 36, 16, 2, 151936, True),
    "7b": (3584, 18944, 28, 28, 4, 152064, False),
    "tiny": (64, 128, 2, 4, 2, 151936, True),  # not a Qwen2.5 model: Qwen2.5's vocabulary on a toy body, for smoke runs
}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (a smoke run)")
    p.add_argument("--dtype", default=None, help="bfloat16 (CUDA default) or float32 (CPU default)")
    p.add_argument("--qwen", choices=sorted(QWEN25), default=None, help="a random Qwen2.5-shaped model")
    p.add_argument("--sequences", type=int, default=64)
    p.add_argument("--tokens", type=int, default=512, help="tokens per sequence (the longest)")
    p.add_argument("--min-tokens", type=int, default=None, help="shortest sequence (default: --tokens)")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--micro-batch-tokens", default="auto", help="auto, an int, or none (rows)")
    p.add_argument("--micro-batch-size", type=int, default=None, help="rows (a cap with a token budget)")
    p.add_argument("--plain-micro-batches", default="8,16,32,64")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--trainer", default="grpo", help="grpo, verl, or both in order: grpo,verl")
    return p.parse_args(argv)


def build_engine(args: argparse.Namespace) -> Any:
    """The engine whose model both sides train: the default model, or a random Qwen2.5-shaped one."""
    from lightning_nb.engines.transformers import TransformersEngine

    if args.qwen is None:
        return TransformersEngine.from_default(device=args.device, dtype=args.dtype)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    h, i, layers, heads, kv, vocab, tied = QWEN25[args.qwen]
    config = Qwen2Config(hidden_size=h, intermediate_size=i, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv, vocab_size=vocab, tie_word_embeddings=tied,
                         max_position_embeddings=32768)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, args.dtype))
    try:
        with torch.device(args.device):
            model = Qwen2ForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return TransformersEngine(model, None, model_name=f"random-qwen2.5-{args.qwen}", stop_token_ids=[0])


def build_batch(args: argparse.Namespace, vocab: int) -> list[Any]:
    """``--sequences`` triplets of random tokens; groups of 8, rewards 1, 0, 1, 0, ..."""
    from lightning_nb.types import Triplet

    gen = torch.Generator().manual_seed(0)
    shortest = args.min_tokens or args.tokens
    out = []
    for k in range(args.sequences):
        n = int(torch.randint(shortest, args.tokens + 1, (1,), generator=gen))
        ids = torch.randint(3, vocab, (n,), generator=gen).tolist()
        out.append(Triplet(rollout_id=f"r{k}", attempt_id=f"a{k}", group_id=f"g{k // 8}", turn=0,
                           prompt_ids=ids[:args.prompt_tokens], response_ids=ids[args.prompt_tokens:],
                           reward=float(k % 2)))
    return out


def timed(fn: Callable[[], Any], repeats: int, cuda: bool) -> tuple[float, Any]:
    """One warm-up call of ``fn``, then the median seconds of ``repeats`` calls (and the last result)."""
    fn()
    seconds, result = [], None
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        result = fn()
        if cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t0)
    return statistics.median(seconds), result


def plain_pass(model: Any, optimizer: Any, batch: list[Any], rows: int, pad: int) -> None:
    """Forward+backward of ``batch`` in micro-batches of ``rows`` (right-padded), then clip and one AdamW step."""
    device = next(model.parameters()).device
    n_tokens = sum(len(t.response_ids) for t in batch)
    for i in range(0, len(batch), rows):
        micro = batch[i: i + rows]
        T = max(len(t.prompt_ids) + len(t.response_ids) for t in micro)
        ids = [t.prompt_ids + t.response_ids for t in micro]
        ids_B_T = torch.tensor([s + [pad] * (T - len(s)) for s in ids], device=device)
        attn_B_T = torch.tensor([[1] * len(s) + [0] * (T - len(s)) for s in ids], device=device)
        labels_B_T = torch.tensor([[-100] * len(t.prompt_ids) + t.response_ids + [-100] * (T - len(s))
                                   for t, s in zip(micro, ids)], device=device)
        logits_B_T_V = model(input_ids=ids_B_T, attention_mask=attn_B_T).logits
        loss = torch.nn.functional.cross_entropy(logits_B_T_V[:, :-1].float().flatten(0, 1),
                                                 labels_B_T[:, 1:].flatten(), ignore_index=-100, reduction="sum")
        (loss / n_tokens).backward()
    torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def run_plain(args: argparse.Namespace, engine: Any, batch: list[Any], cuda: bool) -> dict[int, tuple[float, float]]:
    """rows -> (tokens/s, peak GiB) of the plain loop on ``engine.model``, for each of ``--plain-micro-batches``."""
    from lightning_nb.models.device import set_gradient_checkpointing

    model = engine.model.train()
    set_gradient_checkpointing(model, args.gradient_checkpointing)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    tokens = sum(len(t.prompt_ids) + len(t.response_ids) for t in batch)
    out = {}
    for rows in [int(r) for r in args.plain_micro_batches.split(",")]:
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        try:
            seconds, _ = timed(functools.partial(plain_pass, model, optimizer, batch, rows, engine.pad_token_id),
                               args.repeats, cuda)
        except torch.OutOfMemoryError:
            optimizer.zero_grad(set_to_none=True)
            print(f"plain loop, micro-batch {rows}: out of memory")
            continue
        peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
        out[rows] = (tokens / seconds, peak)
        print(f"plain loop, micro-batch {rows:3d}: {tokens / seconds:10.0f} tok/s  peak {peak:.1f} GiB")
    del optimizer
    set_gradient_checkpointing(model, False)
    if cuda:
        torch.cuda.empty_cache()
    return out


def run_trainer(args: argparse.Namespace, kind: str, engine: Any, batch: list[Any],
                cuda: bool) -> tuple[float, float, dict]:
    """(tokens/s, peak GiB, last metrics) of ``kind``'s update (``grpo``: GRPOTrainer, ``verl``: VerlTrainer) on
    ``batch``."""
    from lightning_nb import GRPOConfig, GRPOTrainer, VerlConfig, VerlTrainer

    budget = args.micro_batch_tokens
    budget = None if budget == "none" else (budget if budget == "auto" else int(budget))
    common = dict(device=args.device, dtype=args.dtype, kl_coef=0.0, track_reference_kl=False, learning_rate=1e-6,
                  gradient_checkpointing=args.gradient_checkpointing)
    if kind == "verl":
        rows = {"micro_batch_size": args.micro_batch_size or 4} if budget is None else {}
        trainer: Any = VerlTrainer(engine, VerlConfig(**common, micro_batch_tokens=budget, **rows))
    else:
        trainer = GRPOTrainer(engine, GRPOConfig(**common, micro_batch_tokens=budget,
                                                 micro_batch_size=args.micro_batch_size))
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    try:
        seconds, metrics = timed(lambda: trainer.update(batch), args.repeats, cuda)
    finally:
        del trainer
        if cuda:
            torch.cuda.empty_cache()
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
    tokens = sum(len(t.prompt_ids) + len(t.response_ids) for t in batch)
    return tokens / seconds, peak, metrics


def report_trainer(args: argparse.Namespace, kind: str, engine: Any, batch: list[Any], cuda: bool,
                   plain_best: tuple[int, float]) -> None:
    """Run and print one trainer's update against the plain loop's best (rows, tokens/s)."""
    name, target = ("VerlTrainer.update", 0.7) if kind == "verl" else ("GRPOTrainer.update", 0.8)
    try:
        ours, peak, m = run_trainer(args, kind, engine, batch, cuda)
    except Exception as exc:  # one trainer failing leaves the other's number
        print(f"{name}: failed: {type(exc).__name__}: {exc}", flush=True)
        return
    print(f"{name + ':':28s} {ours:10.0f} tok/s  peak {peak:.1f} GiB  micro_batch_tokens "
          f"{m.get('micro_batch_tokens', args.micro_batch_tokens)}, micro_batches {m.get('micro_batches', '?')}, "
          f"padding_fraction {m.get('padding_fraction', float('nan')):.3f}", flush=True)
    ratio = ours / plain_best[1]
    print(f"ratio {kind}: {ratio:.2f}x the plain loop at its best micro-batch ({plain_best[0]}); target >= "
          f"{target}x: {'met' if ratio >= target else 'NOT met'}", flush=True)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        print(f"bench/gpu_update.py needs a CUDA GPU: torch {torch.__version__} sees none. "
              "Run it on a GPU machine, or pass --device cpu for a smoke run.")
        return 2
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    torch.manual_seed(0)
    engine = build_engine(args)
    vocab = engine.model.get_input_embeddings().num_embeddings
    batch = build_batch(args, vocab)
    name = args.qwen and f"random Qwen2.5-{args.qwen}" or "SmolLM2-135M"
    print(f"{name}, {args.device} ({torch.cuda.get_device_name() if cuda else 'CPU'}), {args.dtype}, "
          f"gradient checkpointing {args.gradient_checkpointing}; {len(batch)} sequences of "
          f"{args.min_tokens or args.tokens}-{args.tokens} tokens ({args.prompt_tokens} prompt); "
          f"both sides: no reference model, no KL; median of {args.repeats} after a warm-up")
    plain = run_plain(args, engine, batch, cuda)
    if not plain:
        print("the plain loop ran out of memory at every micro-batch")
        return 1
    best_rows = max(plain, key=lambda r: plain[r][0])
    for kind in args.trainer.split(","):
        report_trainer(args, kind.strip(), engine, batch, cuda, (best_rows, plain[best_rows][0]))
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
