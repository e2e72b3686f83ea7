"""LoRA adapters on a bfloat16 base: float32 adapters (peft's default) against bfloat16 adapters with float32 masters.

Three settings of the same LoRA (rank 32, alpha 32, every linear layer but the head) on SmolLM2-135M in bfloat16:

* ``fp32-adapters``: peft's ``autocast_adapter_dtype=True`` (its default): the adapters are float32, so each adapted
  layer casts its bfloat16 input to float32 and runs ``B A x`` in float32; the trainer's AdamW is
  :class:`~lightning_nb.trainers.optim.MasterWeightAdamW` (``make_optimizer(dtype="bfloat16")``, a redundant float32
  copy of float32 tensors);
* ``bf16-adapters+master``: ``autocast_adapter_dtype=False``: the adapters take the base's bfloat16 and compute in it;
  ``MasterWeightAdamW`` keeps their float32 masters and writes them back rounded;
* ``bf16-adapters-plain``: bfloat16 adapters under a plain ``torch.optim.AdamW`` (no masters): what small steps
  lose without them.

For each, one AdamW step (and then ``--steps`` in all) at each ``--lr`` on a fixed batch (the summed log-prob of 8
random 128-token sequences, so every gradient is non-zero), and prints the fraction of adapter elements whose value
the model computes with changed (``lora_A`` and ``lora_B`` apart), and of the masters where there are some. Then the
seconds of one forward + backward + step (median of ``--repeats``) on ``--device``.

    .venv/bin/python bench/lora_dtype.py                         # CPU: the survival numbers; CPU speed is not a GPU's
    .venv/bin/python bench/lora_dtype.py --device cuda           # on a GPU: the speed that matters

CPU timings say nothing about a GPU, where the float32 adapter path misses the bfloat16 tensor cores and adds a
float32 copy of every adapted layer's input: measure speed with ``--device cuda``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def build(setting: str, device: str, rank: int) -> tuple:
    """The bf16 default model with LoRA in ``setting``, and the trainer's optimizer for it (lr set later)."""
    from peft import LoraConfig, get_peft_model

    from lightning_nb.models.default import load_default_model
    from lightning_nb.trainers.optim import make_optimizer

    model, _ = load_default_model(device=device, dtype="bfloat16")
    config = LoraConfig(r=rank, lora_alpha=float(rank), lora_dropout=0.0, target_modules="all-linear", bias="none",
                        task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, config, autocast_adapter_dtype=(setting == "fp32-adapters"))
    params = [p for p in model.parameters() if p.requires_grad]
    if setting == "bf16-adapters-plain":
        optimizer = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0)
    else:
        optimizer = make_optimizer(params, dtype="bfloat16", lr=1e-3, weight_decay=0.0)
    return model, peft_model, optimizer


def loss_of(model, ids_B_T: torch.Tensor) -> torch.Tensor:
    """Minus the mean log-prob of the batch's next tokens (float32 log-softmax)."""
    logits = model(input_ids=ids_B_T).logits[:, :-1].float()
    return -torch.log_softmax(logits, -1).gather(-1, ids_B_T[:, 1:, None]).mean()


def changed(named: dict, before: dict) -> dict:
    """Fraction of elements that differ from ``before``, for ``lora_A`` and ``lora_B`` apart."""
    out = {}
    for part in ("lora_A", "lora_B"):
        keys = [k for k in named if f".{part}." in k]
        diff = sum(int((named[k] != before[k]).sum()) for k in keys)
        out[part] = diff / sum(named[k].numel() for k in keys)
    return out


def survival(setting: str, lr: float, steps: int, args: argparse.Namespace, ids_B_T: torch.Tensor) -> None:
    model, _, optimizer = build(setting, args.device, args.rank)
    for group in optimizer.param_groups:
        group["lr"] = lr
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    dtype = {str(p.dtype) for p in model.parameters() if p.requires_grad}
    start = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    masters = getattr(optimizer, "master_params", None)
    start_m = {n: m.detach().clone() for n, m in zip(names, masters)} if masters else None
    for step in range(1, steps + 1):
        optimizer.zero_grad()
        loss_of(model, ids_B_T).backward()
        optimizer.step()
        if step in (1, steps):
            now = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
            m = changed(now, start)
            line = (f"{setting:22s} lr {lr:g} step {step:3d}  adapters {'/'.join(sorted(dtype))}: "
                    f"changed A {m['lora_A']:.4f} B {m['lora_B']:.4f}")
            if start_m is not None:
                mm = changed(dict(zip(names, masters)), start_m)
                line += f"  | masters changed A {mm['lora_A']:.4f} B {mm['lora_B']:.4f}"
            print(line, flush=True)


def speed(setting: str, args: argparse.Namespace, ids_B_T: torch.Tensor) -> float:
    model, _, optimizer = build(setting, args.device, args.rank)
    times = []
    for i in range(args.repeats + 1):
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        optimizer.zero_grad()
        loss_of(model, ids_B_T).backward()
        optimizer.step()
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        if i:  # the first is warm-up
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--lr", type=float, nargs="+", default=[2e-5, 1e-6])
    parser.add_argument("--steps", type=int, default=10, help="steps of the survival run (step 1 printed too)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5, help="timed forward+backward+step per setting")
    parser.add_argument("--no-speed", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    ids_B_T = torch.randint(0, 49152, (args.batch, args.seq), device=args.device)
    settings = ("fp32-adapters", "bf16-adapters+master", "bf16-adapters-plain")
    print(f"device {args.device}, torch {torch.__version__}, rank {args.rank}, batch {args.batch} x {args.seq}")
    for lr in args.lr:
        for setting in settings:
            torch.manual_seed(1)  # the same adapter initialisation in every setting
            survival(setting, lr, args.steps, args, ids_B_T)
    if not args.no_speed:
        for setting in settings[:2]:
            torch.manual_seed(1)
            print(f"{setting:22s} forward+backward+step: {speed(setting, args, ids_B_T) * 1e3:.0f} ms "
                  f"(median of {args.repeats}; {args.device})", flush=True)


if __name__ == "__main__":
    main()
