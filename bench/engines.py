"""Engine throughput and LLM-proxy overhead: TransformersEngine, VLLMEngine and a standalone vLLM server.

Run from the repo root with the project's venv (``.venv-vllm`` must exist: ``make setup-vllm``)::

    .venv/bin/python bench/engines.py                      # full run
    .venv/bin/python bench/engines.py --quick              # fewer requests, N=50 latency pairs
    .venv/bin/python bench/engines.py --out runs/engines.json --engines standalone vllm

Engines run one at a time (each is started, warmed up, measured and closed before the next starts):

* ``standalone``: a vLLM server started by hand from ``.venv-vllm`` (``python -m
  vllm.entrypoints.openai.api_server``) with exactly the command-line flags and environment
  :class:`~lightning_nb.engines.vllm.VLLMEngine` uses (``--dtype float32 --enforce-eager
  --max-model-len 2048 --logprobs-mode processed_logprobs --generation-config vllm
  --disable-uvicorn-access-log``, ``VLLM_CPU_KVCACHE_SPACE=1``) on the same exported weights
  (``save_pretrained`` of :func:`~lightning_nb.engines.transformers.load_default_model`, ``eos_token_id`` set to
  ``<|im_end|>`` and ``<|im_start|>`` in ``generation_config.json`` as VLLMEngine writes it). Its
  process group is killed at the end. This is the peer the ratios are taken against.
* ``vllm``: ``VLLMEngine.from_default()``, requests sent to its ``base_url`` directly.
* ``transformers``: ``TransformersEngine.from_default(max_batch_size=64)``, requests sent to its
  ``base_url`` (the in-process OpenAI-compatible endpoint).
* ``canned``: no model; a local server that answers every chat request with one fixed vLLM-style
  reply (token IDs and log-probs included) at once, behind ``OpenAIEndpoint``. Proxy overhead only:
  with the engine's own time and noise gone, what is left is the proxy's cost.

1. Throughput. For each concurrency C in 1, 8, 32, 64: C asyncio workers (one ``httpx.AsyncClient``
   with C connections) send ``POST /v1/chat/completions`` back to back until R requests are done,
   R = max(ROUNDS * C, MIN_REQUESTS) (full: 3 rounds, at least 8; ``--quick``: 1 round, at least 3).
   Each request is one user message from a fixed set of counting prompts ("Count from 1 to 40." and
   variants, cycled), ``max_tokens=64``, ``temperature=1.0``. Output tokens/s = the sum of
   ``usage.completion_tokens`` (the stop token included where the model stopped; there is no
   ignore-eos, so completions can be shorter than 64) over the wall time of the level. Before the
   first level, a warm-up of 8 concurrent requests (not counted). Ratios printed: VLLMEngine /
   standalone at every C (target >= 0.9) and TransformersEngine / standalone (target >= 0.8 at C=32).
2. Proxy overhead (``vllm`` and ``transformers``). An ``LLMProxy(engine, InMemoryStore())`` on the
   engine; one rollout and attempt in the store; requests go to the attributed URL
   ``proxy.endpoint(rollout_id, attempt_id)`` so every call writes a span. N pairs (full 200,
   ``--quick`` 50) of one short completion ("Say hi.", ``max_tokens=1``, ``temperature=0``), sent one
   at a time from one keep-alive ``httpx.Client``: straight to ``engine.base_url`` and through the
   proxy, interleaved request by request (the order flips every pair) so that load changes hit both
   equally, after 10 warm-up pairs. The direct request carries what the proxy itself asks the engine
   for (``logprobs: true``, ``return_token_ids: true``), so both make the engine do the same work and
   the difference is the proxy: routing through LiteLLM, the extra HTTP hop, span writing. Printed:
   p50 and p99 of each and the added ms (proxy minus direct, target <= 2 ms at p50); the span count
   is checked.

The client runs in this process, like a notebook's runner threads; with ``transformers`` the engine
does too. Loads (``/proc/loadavg``) before and after are printed: the numbers move with whatever else
runs on the machine. ``--out PATH`` writes every number as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import httpx  # noqa: E402

from lightning_nb.engines.transformers import DEFAULT_MODEL_NAME, IM_END  # noqa: E402

PROMPTS = [
    "Count from 1 to 40.",
    "Count from 1 to 40, separated by commas.",
    "Please count from 1 to 40.",
    "Count from 1 to 40, one number per line.",
]
LEVELS = (1, 8, 32, 64)
MAX_TOKENS = 64
LATENCY_PROMPT = "Say hi."
ENGINES = ("standalone", "vllm", "transformers", "canned")
LABELS = {"standalone": "vLLM server (standalone)", "vllm": "VLLMEngine", "transformers": "TransformersEngine",
          "canned": "canned upstream (no model)"}


# ----- canned upstream: the proxy's own cost, without an engine's noise ---------------------

class CannedUpstream:
    """An OpenAI-compatible server that answers every chat request with one fixed vLLM-style reply at once.

    Served through :class:`~lightning_nb.engines.endpoint.OpenAIEndpoint` (``returns_token_ids=True``), so the
    proxy does all it does for a real engine (LiteLLM call, token IDs, span) while the upstream costs
    well under a millisecond: the added latency is the proxy's own.
    """

    model_name = "canned"

    def __init__(self) -> None:
        from starlette.applications import Starlette
        from starlette.responses import Response
        from starlette.routing import Route

        from lightning_nb._net import ThreadedServer

        reply = json.dumps({
            "id": "chatcmpl-canned", "object": "chat.completion", "created": 0, "model": self.model_name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi"}, "finish_reason": "length",
                         "token_ids": [19556], "logprobs": {"content": [
                             {"token": "Hi", "bytes": [72, 105], "logprob": -0.1, "top_logprobs": []}]}}],
            "usage": {"prompt_tokens": 9, "completion_tokens": 1, "total_tokens": 10},
            "prompt_token_ids": [1, 4093, 198, 19556, 2, 198, 1, 520, 9531]}).encode()

        async def chat(request: Any) -> Any:
            await request.body()
            return Response(reply, media_type="application/json")

        routes = [Route("/v1/chat/completions", chat, methods=["POST"])]
        self._server = ThreadedServer(Starlette(routes=routes), "127.0.0.1", 0, "canned upstream")
        self.base_url = f"http://127.0.0.1:{self._server.start()}/v1"

    def close(self) -> None:
        self._server.stop()


# ----- standalone vLLM server -------------------------------------------------------------

class StandaloneVLLM:
    """A vLLM server started by hand with VLLMEngine's flags; its process group is killed by :meth:`close`."""

    def __init__(self, python: Path, kv_cache_gb: int = 1, max_model_len: int = 2048, timeout: float = 300.0) -> None:
        from lightning_nb.engines.transformers import load_default_model

        self.workdir = Path(tempfile.mkdtemp(prefix="bench-engines-vllm-"))
        model_dir = self.workdir / "model"
        model, tok = load_default_model()
        model.save_pretrained(model_dir)
        tok.save_pretrained(model_dir)
        gen_path = model_dir / "generation_config.json"  # as VLLMEngine._export writes it
        gen = json.loads(gen_path.read_text()) if gen_path.exists() else {}
        stop_ids = [tok.convert_tokens_to_ids(IM_END), tok.convert_tokens_to_ids("<|im_start|>")]
        gen["eos_token_id"] = stop_ids
        gen["pad_token_id"] = stop_ids[0]
        gen_path.write_text(json.dumps(gen, indent=2))
        del model
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server",
                    "--model", str(model_dir), "--served-model-name", DEFAULT_MODEL_NAME,
                    "--host", "127.0.0.1", "--port", str(self.port),
                    "--dtype", "float32", "--enforce-eager", "--max-model-len", str(max_model_len),
                    "--logprobs-mode", "processed_logprobs", "--generation-config", "vllm",
                    "--disable-uvicorn-access-log"]
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
        env.update({"PYTHONUNBUFFERED": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
                    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                    "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gb), "VLLM_SERVER_DEV_MODE": "1"})
        self.log_path = self.workdir / "server.log"
        t0 = time.monotonic()
        with open(self.log_path, "ab") as log:
            self.proc: Optional[subprocess.Popen] = subprocess.Popen(
                self.cmd, env=env, cwd=str(self.workdir), stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self._wait_healthy(timeout)
        except BaseException:
            self.close()
            raise
        self.startup_s = time.monotonic() - t0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with httpx.Client(trust_env=False) as client:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"standalone vLLM exited with {self.proc.returncode}; see {self.log_path}:\n"
                                       + "\n".join(self.log_path.read_text(errors="replace").splitlines()[-30:]))
                try:
                    if client.get(f"http://127.0.0.1:{self.port}/health", timeout=2.0).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"standalone vLLM not healthy after {timeout:.0f} s; see {self.log_path}")
                time.sleep(0.5)

    def close(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            pgid = proc.pid  # start_new_session: the server leads its own group
            for sig, wait in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)):
                try:
                    os.killpg(pgid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=wait)
                except subprocess.TimeoutExpired:
                    continue
                time.sleep(0.5)  # let EngineCore (same group) go too
                try:
                    os.killpg(pgid, 0)
                except ProcessLookupError:
                    break
        shutil.rmtree(self.workdir, ignore_errors=True)


# ----- measurements -----------------------------------------------------------------------

def _chat_body(i: int) -> dict[str, Any]:
    return {"model": DEFAULT_MODEL_NAME, "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
            "max_tokens": MAX_TOKENS, "temperature": 1.0}


async def _run_level(base_url: str, concurrency: int, n_requests: int) -> dict[str, float]:
    """``n_requests`` chat completions by ``concurrency`` closed-loop workers; output tokens/s over the wall time."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    counter = itertools.count()
    tokens = [0]
    async with httpx.AsyncClient(base_url=base_url, timeout=900.0, limits=limits, trust_env=False) as client:
        async def worker() -> None:
            while (i := next(counter)) < n_requests:
                r = await client.post("/chat/completions", json=_chat_body(i))
                if r.status_code != 200:
                    raise RuntimeError(f"{base_url} answered {r.status_code}: {r.text[:300]}")
                tokens[0] += int(r.json()["usage"]["completion_tokens"])

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return {"requests": n_requests, "completion_tokens": tokens[0], "wall_s": wall, "tokens_per_s": tokens[0] / wall,
            "mean_tokens": tokens[0] / n_requests}


def throughput(base_url: str, levels: tuple[int, ...], rounds: int, min_requests: int) -> dict[int, dict[str, float]]:
    asyncio.run(_run_level(base_url, 8, 8))  # warm-up
    out = {}
    for c in levels:
        out[c] = asyncio.run(_run_level(base_url, c, max(rounds * c, min_requests)))
        print(f"    C={c:<3d} {out[c]['tokens_per_s']:7.1f} tok/s  ({out[c]['requests']} requests, "
              f"{out[c]['mean_tokens']:.1f} tokens each, {out[c]['wall_s']:.1f} s)", flush=True)
    return out


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    k = (len(s) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def proxy_overhead(engine: Any, n: int, warmup: int = 10) -> dict[str, float]:
    """Interleaved direct vs attributed-proxy latency of a 1-token completion; milliseconds."""
    from lightning_nb.proxy.proxy import LLMProxy
    from lightning_nb.store import InMemoryStore

    store = InMemoryStore()
    rid = store.enqueue_rollout("t").rollout_id
    aid = store.dequeue_rollout().attempt.attempt_id
    proxy = LLMProxy(engine, store).start()
    messages = [{"role": "user", "content": LATENCY_PROMPT}]
    direct_url = f"{engine.base_url}/chat/completions"
    proxy_url = f"{proxy.endpoint(rid, aid)}/chat/completions"
    base = {"model": engine.model_name, "messages": messages, "max_tokens": 1, "temperature": 0.0}
    bodies = {"direct": {**base, "logprobs": True, "return_token_ids": True}, "proxy": base}
    urls = {"direct": direct_url, "proxy": proxy_url}
    lat: dict[str, list[float]] = {"direct": [], "proxy": []}
    try:
        with httpx.Client(timeout=120.0, trust_env=False) as client:
            def call(which: str) -> float:
                t0 = time.perf_counter()
                r = client.post(urls[which], json=bodies[which])
                dt = (time.perf_counter() - t0) * 1000.0
                if r.status_code != 200:
                    raise RuntimeError(f"{which} {urls[which]} answered {r.status_code}: {r.text[:300]}")
                return dt

            for i in range(warmup + n):
                order = ("direct", "proxy") if i % 2 == 0 else ("proxy", "direct")
                for which in order:
                    dt = call(which)
                    if i >= warmup:
                        lat[which].append(dt)
    finally:
        proxy.stop()
    spans = len(store.query_spans(rid))
    if spans != warmup + n:
        raise RuntimeError(f"expected {warmup + n} spans on the rollout, found {spans}")
    out: dict[str, float] = {"n": n, "spans": spans}
    for which in ("direct", "proxy"):
        out[f"{which}_p50_ms"] = _pct(lat[which], 0.50)
        out[f"{which}_p99_ms"] = _pct(lat[which], 0.99)
    out["added_p50_ms"] = out["proxy_p50_ms"] - out["direct_p50_ms"]
    out["added_p99_ms"] = out["proxy_p99_ms"] - out["direct_p99_ms"]
    out["paired_diff_p50_ms"] = _pct([p - d for p, d in zip(lat["proxy"], lat["direct"])], 0.50)
    print(f"    proxy: direct p50 {out['direct_p50_ms']:.1f} ms p99 {out['direct_p99_ms']:.1f} ms; "
          f"proxy p50 {out['proxy_p50_ms']:.1f} ms p99 {out['proxy_p99_ms']:.1f} ms", flush=True)
    return out


# ----- driver -----------------------------------------------------------------------------

def _load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def run_engine(name: str, args: argparse.Namespace, levels: tuple[int, ...], rounds: int, min_req: int,
               n_latency: int) -> dict[str, Any]:
    print(f"== {LABELS[name]} (load {_load()})", flush=True)
    t0 = time.monotonic()
    if name == "standalone":
        from lightning_nb.engines.vllm import default_vllm_python

        engine: Any = StandaloneVLLM(default_vllm_python())
        print("    started by hand: " + " ".join(engine.cmd), flush=True)
    elif name == "vllm":
        from lightning_nb.engines.vllm import VLLMEngine

        engine = VLLMEngine.from_default()
    elif name == "canned":
        from lightning_nb.engines.endpoint import OpenAIEndpoint

        upstream = CannedUpstream()
        engine = OpenAIEndpoint(upstream.base_url, upstream.model_name, returns_token_ids=True)
        engine.close = upstream.close  # the endpoint itself owns nothing
    else:
        from lightning_nb.engines.transformers import TransformersEngine

        engine = TransformersEngine.from_default(max_batch_size=64)
    result: dict[str, Any] = {"startup_s": time.monotonic() - t0}
    try:
        if name != "canned":  # a fixed reply has no throughput to speak of
            result["throughput"] = throughput(engine.base_url, levels, rounds, min_req)
        if name != "standalone" and not args.no_proxy:
            result["proxy"] = proxy_overhead(engine, n_latency)
    finally:
        engine.close()
    return result


def report(results: dict[str, Any], levels: tuple[int, ...]) -> str:
    lines = []
    if any("throughput" in r for r in results.values()):
        lines = ["| output tokens/s | " + " | ".join(f"C={c}" for c in levels) + " |",
                 "|---|" + "---|" * len(levels)]
    for name in ENGINES:
        if "throughput" in results.get(name, {}):
            tp = results[name]["throughput"]
            lines.append(f"| {LABELS[name]} | " + " | ".join(f"{tp[c]['tokens_per_s']:.1f}" for c in levels) + " |")
    if "standalone" in results:
        peer = results["standalone"]["throughput"]
        for name, target in (("vllm", "≥ 0.9"), ("transformers", "≥ 0.8 at C=32")):
            if name in results:
                tp = results[name]["throughput"]
                lines.append(f"| {LABELS[name]} / standalone (target {target}) | "
                             + " | ".join(f"{tp[c]['tokens_per_s'] / peer[c]['tokens_per_s']:.2f}" for c in levels)
                             + " |")
    proxied = [n for n in ENGINES if "proxy" in results.get(n, {})]
    if proxied:
        lines += ["", "| 1-token completion, ms | direct p50 | proxy p50 | added p50 (target ≤ 2) "
                      "| direct p99 | proxy p99 | added p99 | N |", "|---|---|---|---|---|---|---|---|"]
        for name in proxied:
            p = results[name]["proxy"]
            lines.append(f"| {LABELS[name]} | {p['direct_p50_ms']:.1f} | {p['proxy_p50_ms']:.1f} | "
                         f"{p['added_p50_ms']:+.1f} | {p['direct_p99_ms']:.1f} | {p['proxy_p99_ms']:.1f} | "
                         f"{p['added_p99_ms']:+.1f} | {p['n']} |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 round per level (>= 3 requests), N=50 latency pairs")
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    parser.add_argument("--levels", type=int, nargs="+", default=list(LEVELS), help="concurrency levels")
    parser.add_argument("-n", "--latency-pairs", type=int, default=None, help="proxy-overhead pairs (200; quick 50)")
    parser.add_argument("--no-proxy", action="store_true", help="skip the proxy-overhead measurement")
    parser.add_argument("--out", default=None, help="write the results as JSON to this path")
    args = parser.parse_args(argv)
    levels = tuple(args.levels)
    rounds, min_req = (1, 3) if args.quick else (3, 8)
    n_latency = args.latency_pairs or (50 if args.quick else 200)
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    load_before = _load()
    print(f"bench/engines.py {'--quick ' if args.quick else ''}at {started}; {os.cpu_count()} cores; "
          f"load before {load_before}", flush=True)
    t0 = time.monotonic()
    results = {name: run_engine(name, args, levels, rounds, min_req, n_latency)
               for name in ENGINES if name in args.engines}
    load_after = _load()
    table = report(results, levels)
    print(f"\nload before {load_before}, after {load_after}; {time.monotonic() - t0:.0f} s in all\n")
    print(table)
    if args.out:
        doc = {"date": started, "cores": os.cpu_count(), "load_before": load_before, "load_after": load_after,
               "quick": args.quick, "levels": list(levels), "rounds": rounds, "min_requests": min_req,
               "max_tokens": MAX_TOKENS, "prompts": PROMPTS, "results": results, "table": table}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(doc, indent=2, default=str))
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
