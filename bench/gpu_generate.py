"""Generation throughput of ``TransformersEngine`` vs transformers' own generation paths, on one GPU.

Output tokens/s of SmolLM2-135M-Instruct (the default model, ``TransformersEngine.from_default``) sampling
``--max-tokens`` (64) new tokens at temperature 1.0 (top_p 1, no top-k) for short chat prompts ("Count from 1
to 40." and three rewordings, cycled). Made for one short run on a lent GPU: every variant is guarded (a
failure prints one line and the run goes on), every result is printed as it exists and appended as one JSON
line to ``--out``, after ``--budget-s`` (150) seconds the variants left are skipped, and at ``--kill-after-s``
(budget + 90) a watchdog prints the summary and ends the process (exit status 3) whatever still runs (a
compilation cannot be interrupted). On a machine without CUDA it exits with a message, unless ``--device cpu``
(a smoke run)::

    python bench/gpu_generate.py --out gen.jsonl                     # CUDA, bf16, all variants
    python bench/gpu_generate.py --levels 1,8,64 --batch 64 --budget-s 300
    python bench/gpu_generate.py --variants static,cb,greedy         # a subset (names below)
    python bench/gpu_generate.py --device cpu --quick                # smoke: 32 tokens, levels 1,8, batch 8
    python bench/gpu_generate.py --device cpu --quick --threads 1    # the same on a CPU other jobs share

Variants, in the order they run (``--variants`` takes the short names in brackets):

* ``generate_static`` [static]: one ``model.generate`` call on a static left-padded batch of ``--batch`` (64)
  prompts (``do_sample``, temperature 1.0, ``top_k=0``, the engine's stop tokens as ``eos_token_id``), timed
  after one warm-up call: transformers' fastest plain path on one static batch, the limit the ratios use.
  Tokens: each row's new tokens up to and including its first stop token.
* ``engine`` [engine]: at each concurrency C of ``--levels`` (1,8,64), C threads call
  ``engine.generate(prompt_ids, max_tokens=..., temperature=1.0)`` back to back until R = max(2C, 8) requests
  (``--quick``: max(C, 4)) are done; tokens: the sum of ``len(completion_ids)``; wall time of the level. After
  a warm-up of 4 requests. ``occupancy``: mean prompts per ``engine._run_batch`` call (rows per batch).
* ``engine_cb`` [enginecb]: ``engine`` on a second ``TransformersEngine`` over the same model with
  ``batching="continuous"`` (transformers' continuous batching inside the engine; no occupancy: there is no
  static batch). ``engine_cb_cuda_graph`` [enginecbgraph]: the same with
  ``continuous_options={"use_cuda_graph": True}`` (CUDA only unless ``--all``).
* ``continuous_batching`` [cb]: ``model.generate_batch(inputs=..., generation_config=...)`` (transformers'
  continuous batching, paged attention; it switches the model's attention implementation and restores it) on
  the same ``--batch`` prompts, asking for log-probs (``ContinuousBatchingConfig(return_logprobs=True)``). Two
  calls on one persistent manager where ``generate_batch`` takes ``persistent_manager``: the first (setup,
  warm-up) is reported as ``first_s``, the second is timed. Reports finished requests and whether every
  output carried one log-prob per token.
* ``cb_greedy_match`` [greedy]: greedy (temperature 0), 4 prompts, 16 new tokens: whether continuous
  batching's tokens equal ``engine.generate(temperature=0)``'s, and the largest |log-prob difference| over
  the positions where both have the same token.
* ``continuous_batching_cuda_graph`` [cbgraph], ``continuous_batching_compiled`` [cbcompile]: the same as
  ``continuous_batching`` with ``use_cuda_graph=True``, resp. ``use_default_compile_configs=True`` (CUDA only
  unless ``--all``).
* ``generate_static_compiled`` [compiled]: ``generate_static`` with ``cache_implementation="static"``
  (transformers compiles the decode step); two warm-up calls (their seconds reported as ``warmup_s``), then one
  timed call (CUDA only unless ``--all``).

Ends with a table: variant, tokens/s, ratio to ``generate_static``. On a bfloat16 model the engine's float32
output head (``install_fp32_head``) is installed before anything runs, so every variant decodes the same
module. ``torch.cuda.synchronize()`` brackets every timed region on CUDA.
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import json
import os
import sys
import threading
import time
from typing import Any, Callable, Optional

PROMPTS = ["Count from 1 to 40.", "Count from 1 to 40, one number per line.", "Count from 40 down to 1.",
           "List the numbers from 1 to 40, separated by commas."]
VARIANTS = {"static": "generate_static", "engine": "engine", "enginecb": "engine_cb",
            "enginecbgraph": "engine_cb_cuda_graph", "cb": "continuous_batching",
            "greedy": "cb_greedy_match", "cbgraph": "continuous_batching_cuda_graph",
            "cbcompile": "continuous_batching_compiled", "compiled": "generate_static_compiled"}
CUDA_ONLY = {"cbgraph", "cbcompile", "compiled", "enginecbgraph"}


def one_line(exc: BaseException) -> str:
    """``Type: message`` on one line (at most 300 characters)."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}"


class Bench:
    """The run's settings, its time budget, its results so far and where they go (stdout and ``--out``)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.start = time.monotonic()
        self.results: list[dict[str, Any]] = []
        self.current: Optional[str] = None  # the variant running now
        self.lock = threading.Lock()

    def elapsed_s(self) -> float:
        return time.monotonic() - self.start

    def left_s(self) -> float:
        return self.args.budget_s - (time.monotonic() - self.start)

    def emit(self, record: dict[str, Any]) -> None:
        """Print ``record`` and append it as a JSON line to ``--out``, at once."""
        record = {"t_s": round(self.elapsed_s(), 1), **record}
        line = json.dumps(record, default=str)
        with self.lock:
            self.results.append(record)
            print("RESULT", line, flush=True)
            if self.args.out:
                try:
                    with open(self.args.out, "a") as f:
                        f.write(line + "\n")
                except OSError as exc:
                    print(f"cannot write {self.args.out}: {one_line(exc)}", flush=True)

    def start_watchdog(self) -> None:
        """A daemon thread that, ``--kill-after-s`` seconds into the run, records the variant still running,
        prints the summary and ends the process with status 3 (a compilation or a CUDA-graph capture cannot be
        interrupted from Python, and the budget is only checked between variants)."""
        def fire() -> None:
            time.sleep(max(0.0, self.args.kill_after_s))
            name = self.current or "run"
            print(f"WATCHDOG: {name} still running at {self.elapsed_s():.0f} s: ending the run", flush=True)
            self.emit({"variant": name, "error": f"still running at --kill-after-s {self.args.kill_after_s:.0f}"})
            summary(self)
            os._exit(3)

        threading.Thread(target=fire, name="watchdog", daemon=True).start()

    def guarded(self, name: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` unless the budget is spent; a failure is printed (one line), recorded and survived."""
        if self.left_s() <= 0:
            print(f"SKIP {name}: the budget of {self.args.budget_s:.0f} s is spent", flush=True)
            self.emit({"variant": name, "skipped": "budget"})
            return None
        print(f"--- {name} ({self.left_s():.0f} s of budget left)", flush=True)
        previous, self.current = self.current, name
        try:
            return fn(*args)
        except Exception as exc:  # noqa: BLE001 - a benchmark variant must not end the run
            print(f"FAIL {name}: {one_line(exc)}", flush=True)
            self.emit({"variant": name, "error": one_line(exc)})
            return None
        finally:
            self.current = previous


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def throughput(variant: str, tokens: int, seconds: float, **extra: Any) -> dict[str, Any]:
    return {"variant": variant, "tokens": tokens, "seconds": round(seconds, 4),
            "tokens_per_s": round(tokens / seconds, 1) if seconds > 0 else None, **extra}


# ----- the engine ---------------------------------------------------------------------------------------------
def count_rows(engine: Any) -> list[int]:
    """Wrap ``engine._run_batch`` (on the instance) to record the rows of each call; returns the record list."""
    rows: list[int] = []
    original = engine._run_batch

    def counted(prompts: list[list[int]], *a: Any, **k: Any) -> Any:
        rows.append(len(prompts))
        return original(prompts, *a, **k)

    engine._run_batch = counted
    return rows


def engine_level(engine: Any, prompts: list[list[int]], level: int, bench: Bench, rows: list[int],
                 variant: str = "engine") -> dict:
    """C threads, ``engine.generate`` back to back until R requests are done."""
    args = bench.args
    requests = max(level, 4) if args.quick else max(2 * level, 8)
    counter = itertools.count()
    tokens = [0] * level
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            while (k := next(counter)) < requests:
                g = engine.generate(prompts[k % len(prompts)], max_tokens=args.max_tokens, temperature=1.0, top_p=1.0)
                tokens[i] += len(g.completion_ids)
        except BaseException as exc:  # noqa: BLE001 - re-raised below, on the main thread
            errors.append(exc)

    del rows[:]
    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(level)]
    sync(args.device)
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    if errors:
        raise errors[0]
    occupancy = round(sum(rows) / len(rows), 2) if rows else None
    return throughput(variant, sum(tokens), seconds, concurrency=level, requests=requests,
                      batches=len(rows), occupancy=occupancy)


def run_engine(engine: Any, prompts: list[list[int]], bench: Bench, variant: str = "engine") -> None:
    rows = count_rows(engine) if variant == "engine" else []  # continuous batching: no static batches to count
    t0 = time.perf_counter()
    futures = [engine.submit(p, max_tokens=bench.args.max_tokens, temperature=1.0) for p in prompts[:4]]
    for f in futures:
        f.result()
    print(f"{variant} warm-up: 4 requests in {time.perf_counter() - t0:.2f} s", flush=True)
    for level in bench.args.levels:
        record = bench.guarded(f"{variant} C={level}", engine_level, engine, prompts, level, bench, rows, variant)
        if record:
            bench.emit(record)


def run_engine_cb(engine: Any, prompts: list[list[int]], bench: Bench, variant: str, options: dict) -> None:
    """``run_engine`` on a ``batching="continuous"`` engine over the same model (closed afterwards)."""
    from lightning_nb.engines.transformers import TransformersEngine

    cb = TransformersEngine(engine.model, engine.tokenizer, max_batch_size=engine.max_batch_size,
                            batching="continuous", continuous_options=options)
    try:
        run_engine(cb, prompts, bench, variant)
    finally:
        cb.close()


# ----- model.generate on a static batch -------------------------------------------------------------------------
def left_padded(engine: Any, prompts: list[list[int]]) -> tuple[Any, Any, int]:
    import torch

    from lightning_nb.models.device import model_device

    pad, width = engine.pad_token_id, max(len(p) for p in prompts)
    device = model_device(engine.model)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    return ids, mask, width


def generated_tokens(rows: list[list[int]], stops: list[int]) -> int:
    """New tokens of each row up to and including its first stop token, summed."""
    total = 0
    for row in rows:
        cut = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
        total += cut
    return total


def static_call(engine: Any, prompts: list[list[int]], device: str, max_tokens: int, **extra: Any) -> tuple:
    """One ``model.generate`` on the left-padded batch; returns ``(tokens, seconds)``."""
    import torch

    ids, mask, width = left_padded(engine, prompts)
    with engine.lock, torch.inference_mode():
        sync(device)
        t0 = time.perf_counter()
        out = engine.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens, do_sample=True,
                                    temperature=1.0, top_k=0, top_p=1.0, eos_token_id=engine.stop_token_ids,
                                    pad_token_id=engine.pad_token_id, **extra)
        sync(device)
        seconds = time.perf_counter() - t0
    sequences = out.sequences if hasattr(out, "sequences") else out
    return generated_tokens(sequences[:, width:].tolist(), engine.stop_token_ids), seconds


def run_static(engine: Any, prompts: list[list[int]], bench: Bench) -> dict:
    args = bench.args
    batch = [prompts[i % len(prompts)] for i in range(args.batch)]
    static_call(engine, batch, args.device, args.max_tokens)
    tokens, seconds = static_call(engine, batch, args.device, args.max_tokens)
    return throughput("generate_static", tokens, seconds, batch=args.batch)


def run_static_compiled(engine: Any, prompts: list[list[int]], bench: Bench) -> dict:
    args = bench.args
    batch = [prompts[i % len(prompts)] for i in range(args.batch)]
    warmup = []
    for _ in range(2):
        warmup.append(round(static_call(engine, batch, args.device, args.max_tokens,
                                        cache_implementation="static")[1], 2))
        print(f"generate_static_compiled warm-up call: {warmup[-1]} s", flush=True)
    tokens, seconds = static_call(engine, batch, args.device, args.max_tokens, cache_implementation="static")
    return throughput("generate_static_compiled", tokens, seconds, batch=args.batch, warmup_s=warmup)


# ----- transformers' continuous batching --------------------------------------------------------------------------
def accepts(fn: Callable[..., Any], name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params


def cb_config(options: dict[str, Any]) -> Any:
    """``ContinuousBatchingConfig(return_logprobs=True, **options)`` (without ``return_logprobs`` where this
    version lacks it; TypeError where it lacks one of ``options``); None where transformers has no such class."""
    try:
        from transformers import ContinuousBatchingConfig
    except ImportError:
        try:
            from transformers.generation.configuration_utils import ContinuousBatchingConfig
        except ImportError:
            return None
    known = inspect.signature(ContinuousBatchingConfig).parameters
    missing = sorted(k for k in options if k not in known)
    if missing:  # the variant would silently be plain continuous batching
        raise TypeError(f"ContinuousBatchingConfig has no {missing} in this transformers")
    if "return_logprobs" not in known:
        print("ContinuousBatchingConfig has no return_logprobs: asking for no log-probs", flush=True)
        return ContinuousBatchingConfig(**options)
    return ContinuousBatchingConfig(return_logprobs=True, **options)


def cb_generation_config(engine: Any, max_tokens: int, temperature: float) -> Any:
    from transformers import GenerationConfig

    sampling: dict[str, Any] = {"do_sample": False}
    if temperature > 0:
        sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
    return GenerationConfig(max_new_tokens=max_tokens, eos_token_id=list(engine.stop_token_ids),
                            pad_token_id=engine.pad_token_id, **sampling)


def attn_implementation(model: Any) -> Optional[str]:
    return getattr(getattr(model, "config", None), "_attn_implementation", None)


def restore_model(model: Any, original: Optional[str]) -> None:
    """Drop a persistent continuous-batching manager and put back the attention implementation."""
    destroy = getattr(model, "destroy_cached_continuous_batching_manager", None)
    if destroy is not None:
        try:
            destroy()
        except Exception as exc:  # noqa: BLE001
            print(f"destroy_cached_continuous_batching_manager: {one_line(exc)}", flush=True)
    if original is not None and attn_implementation(model) != original:
        print(f"attention implementation left at {attn_implementation(model)!r}: restoring {original!r}", flush=True)
        model.set_attn_implementation(original)


def cb_call(model: Any, inputs: list[list[int]], gen_config: Any, cb_cfg: Any, persistent: bool) -> dict:
    """One ``generate_batch`` with only public keywords (each passed where this version takes it)."""
    kwargs: dict[str, Any] = {"generation_config": gen_config}
    if cb_cfg is not None:
        if accepts(model.generate_batch, "continuous_batching_config"):
            kwargs["continuous_batching_config"] = cb_cfg
        else:  # older/newer signature: the manager also reads it from the generation config
            gen_config.continuous_batching_config = cb_cfg
    for name, value in (("progress_bar", False), ("persistent_manager", persistent)):
        if accepts(model.generate_batch, name):
            kwargs[name] = value
    return model.generate_batch(inputs=inputs, **kwargs)


def cb_outputs(engine: Any, inputs: list[list[int]], max_tokens: int, temperature: float, options: dict,
               device: str, calls: int = 2, persistent: Optional[bool] = None) -> tuple[list, list, dict]:
    """``calls`` generate_batch runs (on one persistent manager where possible, unless ``persistent`` is False);
    returns the last run's outputs in input order, the seconds of each run, and notes (attention implementation,
    CUDA graphs as resolved)."""
    model, original = engine.model, attn_implementation(engine.model)
    persistent = accepts(model.generate_batch, "persistent_manager") and persistent is not False
    notes: dict[str, Any] = {"persistent_manager": persistent, "attn_before": original}
    seconds, outputs = [], {}
    try:
        with engine.lock:  # not inference_mode: the manager's thread writes tensors made here (5.10.4)
            for _ in range(calls):
                gen_config = cb_generation_config(engine, max_tokens, temperature)
                sync(device)
                t0 = time.perf_counter()
                outputs = cb_call(model, inputs, gen_config, cb_config(options), persistent)
                sync(device)
                seconds.append(time.perf_counter() - t0)
            manager = getattr(model, "_cached_continuous_batching_manager", None)
            resolved = getattr(manager, "continuous_batching_config", None)
            notes["cuda_graph"] = getattr(resolved, "use_cuda_graph", None)
    finally:
        restore_model(model, original)
    notes["attn_after"] = attn_implementation(model)
    return list(outputs.values()), seconds, notes


def logprob_status(outputs: list[Any]) -> str:
    """"full" (one log-prob per generated token everywhere), "partial", or "none"."""
    lengths = [(len(getattr(o, "logprobs", None) or []), len(o.generated_tokens)) for o in outputs]
    if lengths and all(lp == n for lp, n in lengths):
        return "full"
    return "partial" if any(lp for lp, _ in lengths) else "none"


def run_cb(engine: Any, prompts: list[list[int]], bench: Bench, variant: str, options: dict) -> dict:
    args = bench.args
    batch = [prompts[i % len(prompts)] for i in range(args.batch)]
    outputs, seconds, notes = cb_outputs(engine, batch, args.max_tokens, 1.0, options, args.device)
    finished = sum(1 for o in outputs if o.is_finished())
    if finished < len(batch) and notes["persistent_manager"]:  # a reused manager may lose requests (ids)
        print(f"{variant}: {finished}/{len(batch)} finished on a persistent manager; again without", flush=True)
        outputs, seconds, notes = cb_outputs(engine, batch, args.max_tokens, 1.0, options, args.device,
                                             persistent=False)
        finished, notes["fallback"] = sum(1 for o in outputs if o.is_finished()), "persistent_manager=False"
    errors = sorted({str(o.error)[:120] for o in outputs if getattr(o, "error", None)})
    if not finished:
        raise RuntimeError(f"no request finished ({len(outputs)} outputs; errors {errors or 'none'})")
    tokens = sum(len(o.generated_tokens) for o in outputs)
    return throughput(variant, tokens, seconds[-1], batch=args.batch, finished=finished, requested=len(batch),
                      logprobs=logprob_status(outputs), first_s=round(seconds[0], 3), errors=errors,
                      options=options, **notes)


def run_greedy_match(engine: Any, prompts: list[list[int]], bench: Bench) -> dict:
    """Continuous batching vs ``engine.generate`` at temperature 0: 4 prompts, 16 new tokens."""
    inputs, max_tokens = prompts[:4], 16
    futures = [engine.submit(p, max_tokens=max_tokens, temperature=0.0) for p in inputs]
    ours = [f.result() for f in futures]
    theirs, _, _ = cb_outputs(engine, inputs, max_tokens, 0.0, {}, bench.args.device, calls=1)
    if len(theirs) != len(inputs):
        raise RuntimeError(f"continuous batching returned {len(theirs)} of {len(inputs)} outputs")
    same, diffs, first_mismatch = 0, [], []
    for g, o in zip(ours, theirs):
        a, b = list(g.completion_ids), list(o.generated_tokens)
        same += a == b
        prefix = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        first_mismatch.append(None if a == b else prefix)
        lp = list(getattr(o, "logprobs", None) or [])
        diffs += [abs(x - y) for x, y in zip(g.logprobs[:prefix], lp[:prefix])]
    max_diff = max(diffs) if diffs else None
    print(f"cb_greedy_match: {same}/{len(inputs)} prompts with equal tokens; first mismatch per prompt "
          f"{first_mismatch}; max |logprob diff| {max_diff} over {len(diffs)} tokens", flush=True)
    return {"variant": "cb_greedy_match", "equal": same, "prompts": len(inputs), "first_mismatch": first_mismatch,
            "max_abs_logprob_diff": max_diff, "compared_logprobs": len(diffs), "cb_logprobs": logprob_status(theirs)}


# ----- the run ------------------------------------------------------------------------------------------------------
def header(args: argparse.Namespace) -> None:
    import platform

    import torch
    import transformers

    if args.device.startswith("cuda"):
        name = torch.cuda.get_device_name(torch.device(args.device))
    else:
        name = f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    print(f"python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}, "
          f"device {args.device}: {name}, dtype {args.dtype}", flush=True)
    print(f"settings: max_tokens {args.max_tokens}, levels {args.levels}, batch {args.batch}, "
          f"budget {args.budget_s:.0f} s, variants {args.variants}", flush=True)


def load(args: argparse.Namespace) -> tuple[Any, list[list[int]]]:
    from lightning_nb.engines.transformers import TransformersEngine
    from lightning_nb.models.lm_head import install_fp32_head

    t0 = time.perf_counter()
    engine = TransformersEngine.from_default(device=args.device, dtype=args.dtype,
                                             max_batch_size=max(64, max(args.levels)))
    if args.dtype != "float32":
        install_fp32_head(engine.model)  # what the engine does at its first batch: every variant runs this module
    prompts = [engine.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    print(f"model loaded in {time.perf_counter() - t0:.1f} s; attention {attn_implementation(engine.model)!r}; "
          f"prompt lengths {[len(p) for p in prompts]}; stop ids {engine.stop_token_ids}", flush=True)
    return engine, prompts


def summary(bench: Bench) -> None:
    rows = [r for r in bench.results if r.get("tokens_per_s")]
    limit = next((r["tokens_per_s"] for r in rows if r["variant"] == "generate_static"), None)
    print("\n| variant | tokens/s | ratio to generate_static |\n|---|---|---|")
    for r in rows:
        name = r["variant"] + (f" C={r['concurrency']}" if "concurrency" in r else "")
        if r.get("occupancy") is not None:
            name += f" (occupancy {r['occupancy']})"
        ratio = f"{r['tokens_per_s'] / limit:.2f}" if limit else "n/a"
        print(f"| {name} | {r['tokens_per_s']:.1f} | {ratio} |")
    failed = [f"{r['variant']}: {r.get('error') or 'skipped (' + r['skipped'] + ')'}"
              for r in bench.results if r.get("error") or r.get("skipped")]
    for line in failed:
        print(f"not measured: {line}")
    for r in bench.results:
        if r["variant"] == "cb_greedy_match" and "equal" in r:
            print(f"cb_greedy_match: {r['equal']}/{r['prompts']} equal, first mismatch {r['first_mismatch']}, "
                  f"max |logprob diff| {r['max_abs_logprob_diff']} ({r['compared_logprobs']} tokens)")
    sys.stdout.flush()


def run(bench: Bench) -> None:
    args = bench.args
    engine, prompts = load(args)
    steps: dict[str, Callable[[], Any]] = {
        "static": lambda: run_static(engine, prompts, bench),
        "engine": lambda: run_engine(engine, prompts, bench),
        "enginecb": lambda: run_engine_cb(engine, prompts, bench, "engine_cb", {}),
        "enginecbgraph": lambda: run_engine_cb(engine, prompts, bench, "engine_cb_cuda_graph", {"use_cuda_graph": True}),
        "cb": lambda: run_cb(engine, prompts, bench, "continuous_batching", {}),
        "greedy": lambda: run_greedy_match(engine, prompts, bench),
        "cbgraph": lambda: run_cb(engine, prompts, bench, "continuous_batching_cuda_graph", {"use_cuda_graph": True}),
        "cbcompile": lambda: run_cb(engine, prompts, bench, "continuous_batching_compiled",
                                    {"use_default_compile_configs": True}),
        "compiled": lambda: run_static_compiled(engine, prompts, bench),
    }
    try:
        for key in VARIANTS:
            if key not in args.variants:
                continue
            if key in CUDA_ONLY and not args.device.startswith("cuda") and not args.all:
                print(f"SKIP {VARIANTS[key]}: CUDA only (--all runs it here)", flush=True)
                continue
            record = bench.guarded(VARIANTS[key], steps[key])
            if isinstance(record, dict):
                bench.emit(record)
    finally:
        engine.close()


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default=None, help="cuda (default where available) or cpu")
    p.add_argument("--dtype", default=None, help="bfloat16 on cuda, float32 on cpu by default")
    p.add_argument("--max-tokens", type=int, default=None, help="new tokens per request (64; --quick 32)")
    p.add_argument("--levels", default=None, help="engine concurrencies (1,8,64; --quick 1,8)")
    p.add_argument("--batch", type=int, default=None, help="prompts of the static and continuous batches (64; quick 8)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"a subset of {','.join(VARIANTS)}")
    p.add_argument("--budget-s", type=float, default=150.0, help="skip the variants left after this many seconds")
    p.add_argument("--kill-after-s", type=float, default=None,
                   help="end the run (summary, exit status 3) this many seconds in, whatever runs (budget + 90)")
    p.add_argument("--out", default=None, help="append each result as a JSON line to this file")
    p.add_argument("--quick", action="store_true", help="a small run (smoke test)")
    p.add_argument("--all", action="store_true", help="also run the CUDA-only variants on cpu")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (a shared CPU: 1 avoids OpenMP "
                   "oversubscription, up to 10x slower forwards)")
    args = p.parse_args(argv)
    args.max_tokens = args.max_tokens or (32 if args.quick else 64)
    args.levels = [int(x) for x in (args.levels or ("1,8" if args.quick else "1,8,64")).split(",")]
    args.batch = args.batch or (8 if args.quick else 64)
    args.kill_after_s = args.kill_after_s if args.kill_after_s is not None else args.budget_s + 90
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}; known: {list(VARIANTS)}")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    import torch

    args = parse_args(argv)
    if args.device is None:
        if not torch.cuda.is_available():
            print("no CUDA device here: this benchmark is for a GPU; --device cpu runs it as a smoke test")
            return 0
        args.device = "cuda"
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    if args.threads:
        torch.set_num_threads(args.threads)
    bench = Bench(args)
    bench.start_watchdog()
    try:
        header(args)
        run(bench)
    except Exception as exc:  # noqa: BLE001 - still print what was measured
        print(f"FAIL run: {one_line(exc)}", flush=True)
        bench.emit({"variant": "run", "error": one_line(exc)})
    summary(bench)
    print(f"total {time.monotonic() - bench.start:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    status = main()
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(status)  # not sys.exit: a continuous-batching thread left running (non-daemon) must not hold the exit
