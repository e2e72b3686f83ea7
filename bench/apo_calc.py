"""APO on the calc task: held-out reward of the starting prompt vs the best prompt APO found, per proposer.

Run from the repo root with the project's venv::

    .venv/bin/python bench/apo_calc.py                       # the workload below, both proposers
    .venv/bin/python bench/apo_calc.py --proposers same --rounds 1 --out runs/apo.json

Workload: the agent is ``calc_agent`` on SmolLM2-135M-Instruct (``TransformersEngine.from_default(max_batch_size=8)``,
CPU) behind an ``LLMProxy``, 8 runner threads, its system prompt read from the resources
(``calc_resources``: the shipped ``SYSTEM_PROMPT`` to start). APO: 2 rounds, beam 2, 3 new prompts per beam
prompt per round (``branch_factor``), each round on the same 16 training tasks (``load_tasks("train")[:16]``, so
a prompt runs once per task), greedy agent (temperature 0), 48 tokens per agent call, critic and editor at
temperature 0.7 with 160 tokens. Held out: the first 32 val tasks (``load_tasks("val")[:32]``), greedy; the
winner is chosen on the training tasks only. The proposer (critic and editor) is

* ``same``: the agent's own engine, through the proxy's plain base URL (``proxy.endpoint()``: served, not traced);
* ``second``: a second ``TransformersEngine`` behind its own ``LLMProxy`` and store, standing in for "a stronger
  OpenAI-compatible endpoint a user points APO at". It is the **same 135M model**: this shows the wiring
  (any ``LLMResource(endpoint, model, api_key)`` works), not what a stronger model would find.

Each proposer gets its own store, proxy and runners on the shared agent engine, starting from the same prompt;
the starting prompt's held-out reward is measured once, by the first.
Prints a markdown table (and writes JSON with ``--out``): held-out reward of the start and of the best prompt,
the best prompt's text, candidates proposed / valid, minutes.

Measured here (2026-11-26, 2 cores shared with three other benchmarks, load average 7-12; the default workload
above ran at ~25 s per rollout and was stopped, so this is a smaller one:
``--rounds 1 --train 4 --val 12 --branch 2 --max-tokens 32``):

| proposer | start prompt, held-out (12 val) | best prompt, held-out | winner | minutes |
|---|---|---|---|---|
| same (135M, agent's engine) | 0.500 | 0.500 | the start prompt (c1, c2: 0.25 on the 4 train tasks) | 14.9 |
| second (135M, own engine and proxy) | 0.500 (the same measure) | 0.500 | the start prompt (c1, c2 tied at 0.50) | 3.9 |

The 135M editor does not write prompts: its replies were critiques or answers ("1. The original prompt was too
wordy ...", "The correct output for the input 41 is 141."), taken whole as candidates because they had no
``<prompt>`` tags. It did not improve the prompt. That a nonsense system prompt tied the start on 4 tasks says the
agent's two worked examples, not its system prompt, carry the calc protocol for this model.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any, Optional

from lightning_nb import InMemoryStore, LLMProxy, TransformersEngine, start_runners
from lightning_nb.algorithm.apo import APO, APOConfig
from lightning_nb.tasks.calc import calc_agent, load_tasks
from lightning_nb.tasks.calc.agent import calc_resources


def run_variant(name: str, engine: TransformersEngine, proposer_engine: Any, args: argparse.Namespace,
                start_score: Optional[float] = None) -> dict:
    """One APO run with its own store, proxy and runners; returns the table row. ``start_score``: the starting
    prompt's held-out reward measured by an earlier variant (same prompt, tasks, engine and greedy decoding),
    or None to measure it here."""
    t0 = time.perf_counter()
    store = InMemoryStore()
    proxy = LLMProxy(engine, store).start()
    store.add_resources(calc_resources(proxy.as_resource()), resources_id="calc")
    runners = start_runners(calc_agent, store, n=8)
    side = None
    critic = None
    if proposer_engine is not None:  # a separate OpenAI-compatible endpoint
        side = LLMProxy(proposer_engine, InMemoryStore()).start()
        critic = side.as_resource()
    try:
        config = APOConfig(rounds=args.rounds, beam_width=args.beam, branch_factor=args.branch,
                           batch_size=args.train, max_tokens=args.max_tokens, seed=args.seed,
                           temperature=0.0)  # greedy, as this bench's recorded numbers (the default samples as the agent)
        apo = APO(store, load_tasks("train")[:args.train], load_tasks("val")[:args.val], config=config,
                  critic=critic, editor=critic)
        if start_score is None:
            start_score = apo.evaluate("c0")
            print(f"  [{name}] start prompt held-out {start_score:.3f} ({time.perf_counter() - t0:.0f} s)", flush=True)
        apo.start()
        while not apo.wait(timeout=30):
            print(f"  [{name}] {time.perf_counter() - t0:.0f} s {apo.progress}", flush=True)
        best = apo.best()  # the start and the winner on the same val tasks; published only if the winner beat it
        print(f"  [{name}] {best}", flush=True)
        calls = apo.calls_df()
        editor = calls[calls["role"] == "editor"]
        proposed = int(editor["replies"].map(len).sum()) if len(editor) else 0
        valid = len(apo.candidates) - 1
        print(apo.beam_df()[["round", "candidate_id", "rank", "score", "n", "kept", "parent", "text"]].to_string())
        for _, row in calls.iterrows():
            print(f"  {row['role']} of {row['parent']} (round {row['round']}, {row['seconds']:.1f} s): "
                  f"{[r[:160] for r in row['replies']]} errors={row['errors']}")
        return {"proposer": name, "start": start_score, "best": best.winner_score, "best_id": best.winner_id,
                "best_prompt": best.winner.template, "kept": best.candidate_id, "proposed": proposed, "valid": valid,
                "published_version": store.get_latest_resources().version,
                "minutes": (time.perf_counter() - t0) / 60}
    finally:
        runners.stop()
        proxy.stop()
        if side is not None:
            side.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--proposers", default="same,second", help="comma list of: same, second")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--beam", type=int, default=2)
    parser.add_argument("--branch", type=int, default=3)
    parser.add_argument("--train", type=int, default=16)
    parser.add_argument("--val", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    engine = TransformersEngine.from_default(max_batch_size=8)
    rows = []
    for name in args.proposers.split(","):
        second = TransformersEngine.from_default(max_batch_size=8) if name == "second" else None
        rows.append(run_variant(name, engine, second, args, rows[0]["start"] if rows else None))
        if second is not None:
            second.close()
    print("\n| proposer | start prompt, held-out | best prompt, held-out | best (id) | editor replies / valid "
          "new prompts | kept | published version | minutes |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['proposer']} | {r['start']:.3f} | {r['best']:.3f} | {r['best_id']}: {r['best_prompt']!r} | "
              f"{r['proposed']} / {r['valid']} | {r['kept']} | {r['published_version']} | {r['minutes']:.1f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    engine.close()


if __name__ == "__main__":
    main()
