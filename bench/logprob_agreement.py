"""Engine vs trainer log-probs, token by token: the worst tokens of every update of a demo run, and what they share.

Runs the demo itself (:func:`lightning_nb.cli.demo.run_demo`: the same settings as ``python -m lightning_nb demo``,
held-out evaluations before and after included) on ``--engine vllm`` or ``--engine transformers`` in float32, and
after every update reads the trainer's ``last_batch`` (per sequence: ``input_ids``, ``response_mask``,
``engine_logprobs``, ``trainer_logprobs``: π_start, the trainer's before the step) and ``last_triplets`` (one per
LLM call). Each trained token is traced back to its LLM call by packing the episode again
(:func:`~lightning_nb.trainers.packing.pack_episode` gives the same sequences, with ``token_turns``). Printed per
update:

* the ``--top`` worst tokens by |trainer − engine| log-prob (nats): the token's text, the call's turn (and how
  many calls the episode made), the token's position in the sequence and in its reply, the call's
  ``finish_reason``, the previous call's, the weight version it was sampled with (and the engine's now), both
  log-probs;
* what the tokens above ``--threshold`` (default 1e-3 nats) have in common: counts by finish_reason, by the
  previous call's finish_reason, by turn, by position in the reply (first, last, other), by token, and by
  staleness; with the number of calls (and of calls per finish_reason) in the batch to compare against.

Every token above the threshold, and the worst ``--top`` of each step, go to ``OUT/worst_tokens.jsonl``; each
step's triplets and batch rows to ``OUT/step_NNN.json`` (``--dump``), to score again offline.

Examples (from the repo root; vLLM needs ``.venv-vllm`` or ``LIGHTNING_NB_VLLM_PYTHON``)::

    python bench/logprob_agreement.py --engine vllm --steps 16 --seed 0 --out runs/lp/vllm16   # the demo, ~20 min
    python bench/logprob_agreement.py --engine transformers --steps 3 --val-size 8 --ood-size 0 --out runs/lp/tf3

Exit status 1 when any step's ``logprob_diff_max`` is above ``--fail-above`` (default: never).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def token_records(trainer: Any, step: int) -> list[dict[str, Any]]:
    """One record per trained token of the trainer's last update that has both log-probs: where it came from and
    ``diff`` = |trainer − engine| (nats).

    Raises:
        AssertionError: packing an episode's triplets again does not give the batch's sequences (the bench's
            tracing would then be wrong).
    """
    from lightning_nb.trainers.packing import episodes_of, pack_episode

    cfg, tok = trainer.config, trainer.engine.tokenizer
    episodes = episodes_of(trainer.last_triplets)
    rows_by_episode: dict[str, list[dict]] = {}
    for row in trainer.last_batch:
        rows_by_episode.setdefault(row["rollout_id"], []).append(row)
    now = trainer.engine.weight_version
    out = []
    for rid, rows in rows_by_episode.items():
        ordered = sorted(episodes[rid], key=lambda t: t.turn)
        seqs = pack_episode(ordered, 0.0, cfg.pack_turns, mask_truncated=cfg.overlong_filter)
        assert [s.input_ids for s in seqs] == [r["input_ids"] for r in rows], f"{rid}: packing differs"
        for si, (seq, row) in enumerate(zip(seqs, rows)):
            if row["trainer_logprobs"] is None or row["engine_logprobs"] is None:  # not forwarded, or no engine lps
                continue
            ends = {k: max(j for j, kk in enumerate(seq.token_turns) if kk == k) + 1 for k in set(seq.token_turns)}
            for j, m in enumerate(row["response_mask"]):
                if not m:
                    continue
                k = seq.token_turns[j]
                t = ordered[k]
                start = ends[k] - len(t.response_ids)
                eng, tr = row["engine_logprobs"][j], row["trainer_logprobs"][j]
                prev = ordered[k - 1] if k > 0 else None
                out.append({
                    "step": step, "rollout_id": rid, "sequence": si, "pos": j, "seq_len": len(row["input_ids"]),
                    "turn": t.turn, "calls": len(ordered), "reply_pos": j - start, "reply_len": len(t.response_ids),
                    "token_id": row["input_ids"][j], "token": tok.decode([row["input_ids"][j]]),
                    "before": tok.decode(row["input_ids"][max(0, j - 6): j]),
                    "finish_reason": t.finish_reason, "prev_finish_reason": prev.finish_reason if prev else None,
                    "prev_last_token": tok.decode([prev.response_ids[-1]]) if prev else None,
                    "weight_version": t.weight_version, "engine_version": now, "temperature": t.temperature,
                    # versions between the call's weights and the update's (the row's, else the engine's less the
                    # update's own bump)
                    "staleness": row.get("staleness", now - 1 - (t.weight_version or 0)),
                    "engine_lp": eng, "trainer_lp": tr, "diff": abs(tr - eng),
                    "forked": seq.fork_at is not None})
    return out


def _where(r: dict[str, Any]) -> str:
    """A token's place in its reply: ``first``, ``last``, ``only`` or ``middle``."""
    first, last = r["reply_pos"] == 0, r["reply_pos"] == r["reply_len"] - 1
    return "only" if first and last else "first" if first else "last" if last else "middle"


def common_ground(records: Sequence[dict[str, Any]], threshold: float) -> dict[str, Any]:
    """What the tokens above ``threshold`` share: counts by feature, beside the batch's calls by finish_reason."""
    bad = [r for r in records if r["diff"] > threshold]
    calls = {(r["rollout_id"], r["turn"]): r for r in records}
    bad_calls = {(r["rollout_id"], r["turn"]): r for r in bad}

    def count(rs: Any, key: Any) -> dict[str, int]:
        return dict(Counter(str(key(r)) for r in rs).most_common(8))

    return {"tokens": len(records), "tokens_above": len(bad), "calls": len(calls), "calls_above": len(bad_calls),
            "calls_by_finish": count(calls.values(), lambda r: r["finish_reason"]),
            "calls_above_by_finish": count(bad_calls.values(), lambda r: r["finish_reason"]),
            "calls_above_by_prev_finish": count(bad_calls.values(), lambda r: r["prev_finish_reason"]),
            "calls_above_by_turn": count(bad_calls.values(), lambda r: f"{r['turn']}/{r['calls']}"),
            "tokens_above_by_place": count(bad, _where),
            "tokens_above_by_token": count(bad, lambda r: repr(r["token"])),
            "tokens_above_by_staleness": count(bad, lambda r: r["staleness"]),
            "tokens_above_forked": sum(1 for r in bad if r["forked"])}


def _print_step(row: dict[str, Any], records: list[dict[str, Any]], top: int, threshold: float) -> None:
    worst = sorted(records, key=lambda r: -r["diff"])[:top]
    print(f"\n[lp] step {row['step']}: logprob_diff_max {row.get('logprob_diff_max', math.nan):.3g} nats over "
          f"{len(records)} trained tokens; worst {len(worst)}:", flush=True)
    for r in worst:
        tags = (f" stale {r['staleness']}" if r["staleness"] else "") + (" fork" if r["forked"] else "")
        print(f"  {r['diff']:8.4f}  engine {r['engine_lp']:8.4f} trainer {r['trainer_lp']:8.4f}  "
              f"{r['token']!r:>12} after {r['before']!r:<28} turn {r['turn']}/{r['calls']} pos {r['pos']}/"
              f"{r['seq_len']} reply {r['reply_pos']}/{r['reply_len']} {r['finish_reason']} "
              f"(prev {r['prev_finish_reason']}, {r['prev_last_token']!r}) v{r['weight_version']}{tags}", flush=True)
    print(f"[lp] above {threshold:g}: {json.dumps(common_ground(records, threshold))}", flush=True)


def _dump(trainer: Any, step: int, out: Path) -> None:
    """The step's triplets and batch rows as JSON (to score again offline)."""
    data = {"triplets": [t.model_dump() for t in trainer.last_triplets], "batch": trainer.last_batch,
            "engine_version": trainer.engine.weight_version}
    (out / f"step_{step:03d}.json").write_text(json.dumps(data))


def main(argv: Optional[Sequence[str]] = None) -> int:
    from lightning_nb.cli.demo import DemoSettings, run_demo

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", choices=("vllm", "transformers"), default="vllm")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("runs/logprob_agreement"))
    p.add_argument("--val-size", type=int, default=64, help="held-out tasks before/after (the demo's 64)")
    p.add_argument("--ood-size", type=int, default=None, help="val_ood tasks before/after (None: as --val-size)")
    p.add_argument("--runners", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--top", type=int, default=8, help="worst tokens printed per step")
    p.add_argument("--threshold", type=float, default=1e-3, help="nats: a token above it is counted as disagreeing")
    p.add_argument("--dump", action="store_true", help="write each step's triplets and batch to OUT/step_NNN.json")
    p.add_argument("--fail-above", type=float, default=None, help="exit 1 when a step's logprob_diff_max exceeds it")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    log = (args.out / "worst_tokens.jsonl").open("w")
    per_step: list[dict[str, Any]] = []

    def after_step(algo: Any, row: dict[str, Any]) -> None:
        trainer = algo.trainer
        records = token_records(trainer, row["step"])
        _print_step(row, records, args.top, args.threshold)
        worst = sorted(records, key=lambda r: -r["diff"])
        for r in [r for r in worst if r["diff"] > args.threshold] or worst[:args.top]:
            log.write(json.dumps(r) + "\n")
        log.flush()
        per_step.append({"step": row["step"], "logprob_diff_max": row.get("logprob_diff_max"),
                         **{k: v for k, v in row.items() if k.startswith("logprob_") or k in (
                             "truncated_responses", "turn_forks", "stale_episodes_dropped", "staleness_max",
                             "stale_tokens_trained", "tokens_without_engine_logprobs")},
                         "bench_max": worst[0]["diff"] if worst else math.nan,
                         **common_ground(records, args.threshold)})
        if args.dump:
            _dump(trainer, row["step"], args.out)

    settings = DemoSettings(steps=args.steps, out=args.out, seed=args.seed, engine=args.engine, dtype="float32",
                            val_size=args.val_size, ood_size=args.ood_size, runners=args.runners,
                            max_tokens=args.max_tokens)
    run_demo(settings, after_step=after_step)
    log.close()
    (args.out / "logprob_agreement.json").write_text(json.dumps(per_step, indent=1))
    print("\n[lp] step  logprob_diff_max  tokens>thr  calls>thr/calls  by finish_reason")
    for s in per_step:
        print(f"[lp] {s['step']:4d}  {s['logprob_diff_max']:16.3g}  {s['tokens_above']:10d}  "
              f"{s['calls_above']:6d}/{s['calls']:<6d}  {s['calls_above_by_finish']}")
    worst = max((s["logprob_diff_max"] for s in per_step), default=math.nan)
    return 1 if args.fail_above is not None and worst > args.fail_above else 0


if __name__ == "__main__":
    sys.exit(main())
