"""The log-prob agreement columns of an update (lightning_nb.trainers.agreement) on hand-made sequences: no model.

The engines' half (the demo's path on the real model, on TransformersEngine and on vLLM) is in
tests/test_engine_contract.py, ``test_engine_and_trainer_agree_on_the_demos_trained_tokens``.
"""

from __future__ import annotations

import math

from lightning_nb.trainers.agreement import AGREEMENT_TOLERANCE, agreement_metrics
from lightning_nb.trainers.batch import build_batch
from lightning_nb.trainers.config import TrainerConfig
from lightning_nb.trainers.packing import pack_episode
from lightning_nb.types import Triplet


def _triplet(rid, turn, prompt, response, logprobs, version, reward=1.0, group="g"):
    return Triplet(rollout_id=rid, attempt_id="a", group_id=group, turn=turn, prompt_ids=prompt,
                   response_ids=response, logprobs=logprobs, reward=reward, temperature=0.7, weight_version=version)


def _scored(seq, trainer_logprobs):
    seq.trained, seq.trainer_logprobs = True, trainer_logprobs
    return seq


def test_on_policy_stale_and_missing_tokens_are_counted_apart():
    (on,) = pack_episode([_triplet("on", 0, [5, 6], [7, 8], [-0.5, -1.0], 3)], 0.0)
    (stale,) = pack_episode([_triplet("stale", 0, [5, 6], [9, 10, 11], [-0.5, -1.0, -2.0], 2)], 0.0)
    (missing,) = pack_episode([_triplet("none", 0, [5, 6], [12], None, 3)], 0.0)
    stale.staleness = 1
    # on-policy: one token off by 2e-5 (float rounding), one by 0.01 (an outlier); stale: 0.3 nats of drift
    _scored(on, [0.0, 0.0, -0.5 + 2e-5, -1.01])
    _scored(stale, [0.0, 0.0, -0.8, -1.0, -2.0])
    _scored(missing, [0.0, 0.0, -4.0])
    m = agreement_metrics([on, stale, missing])
    assert m["logprob_diff_max"] == abs(-1.01 - -1.0) and m["logprob_diff_outliers"] == 1
    assert math.isclose(m["logprob_diff_max_stale"], 0.3) and m["stale_tokens_trained"] == 3
    assert m["tokens_without_engine_logprobs"] == 1  # its -4.0 is no disagreement: there is nothing to compare
    assert agreement_metrics([on], tolerance=0.1)["logprob_diff_outliers"] == 0


def test_nothing_forwarded_gives_nan_not_zero():
    (seq,) = pack_episode([_triplet("r", 0, [5], [7], [-0.5], 0)], 0.0)  # not trained: no trainer log-probs
    m = agreement_metrics([seq])
    assert math.isnan(m["logprob_diff_max"]) and math.isnan(m["logprob_diff_max_stale"])
    assert (m["logprob_diff_outliers"], m["stale_tokens_trained"], m["tokens_without_engine_logprobs"]) == (0, 0, 0)
    assert AGREEMENT_TOLERANCE == 1e-3  # tests/test_engine_contract.py's AGREEMENT holds the same line


def test_build_batch_sets_each_sequences_staleness_from_its_oldest_turn():
    """An episode whose second turn was sampled after a reload (v2) counts as sampled by its first turn's v1."""
    turns = [_triplet("r1", 0, [5, 6], [7, 2], [-0.1, -0.2], 1), _triplet("r1", 1, [5, 6, 7, 2, 3], [8, 2], [-0.3, -0.4], 2)]
    others = [_triplet(f"r{i}", 0, [5, 6], [7 + i, 2], [-0.1, -0.2], 3, reward=float(i % 2)) for i in range(2, 5)]
    batch = build_batch(TrainerConfig(max_staleness=2), turns + others, weight_version=3)
    by_rollout = {s.rollout_id: s for s in batch.seqs}
    assert by_rollout["r1"].weight_version == 1 and by_rollout["r1"].staleness == 2
    assert all(by_rollout[f"r{i}"].staleness == 0 for i in range(2, 5))
    row = by_rollout["r1"].as_row()
    assert (row["weight_version"], row["staleness"]) == (1, 2)


def test_a_row_without_engine_logprobs_has_none_there_not_zeros():
    """0.0 would read as the engine's log-prob (probability 1): the audit's diff column would then show the
    trainer's whole log-prob (3-6 nats for an unlikely sampled token) as a disagreement."""
    import pandas as pd

    from lightning_nb.inspect.audit import batch_df

    class Tok:
        def decode(self, ids):
            return " ".join(map(str, ids))

    (seq,) = pack_episode([_triplet("r", 0, [5, 6], [7], None, 0)], 0.0)
    row = _scored(seq, [0.0, 0.0, -4.0]).as_row()
    assert row["engine_logprobs"] is None and row["trainer_logprobs"] == [0.0, 0.0, -4.0]
    df = batch_df([row], Tok())
    assert pd.isna(df.loc[0, "max_abs_logprob_diff"]) and pd.isna(df.loc[0, "mean_ratio"])
