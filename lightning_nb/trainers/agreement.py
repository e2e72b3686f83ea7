"""Engine vs trainer log-probs on the trained tokens of one update: the agreement metrics of the update row.

A trained token carries two log-probabilities (nats): the engine's, of the distribution it was sampled from
(``PackedSequence.old_logprobs``), and π_start's, the trainer's at the start of the update
(``PackedSequence.trainer_logprobs``). For a token sampled by the weights the update starts from, the two are
one number computed twice: in float32 on CPU they agree to about 5e-5 nats (the float rounding of two
implementations; ``bench/logprob_agreement.py`` measures it per step of the demo), so a larger difference
there is a defect (a wrong token, context, temperature or weight version) and :data:`AGREEMENT_TOLERANCE` is the
line. A token of an episode sampled by older weights (one that ``max_staleness`` keeps) differs by how much the
policy moved since: that is off-policy drift, not disagreement, so it is reported on its own.

Pure Python, like :mod:`~lightning_nb.trainers.packing`: it reads the sequences after the update scored them.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from lightning_nb.trainers.packing import PackedSequence

__all__ = ["AGREEMENT_TOLERANCE", "agreement_metrics"]

#: nats: an on-policy trained token whose |π_start − engine| log-prob exceeds this is counted in
#: ``logprob_diff_outliers`` (float32 agreement is about 5e-5; bfloat16's is 0.1-0.3, where ``tis_cap`` applies)
AGREEMENT_TOLERANCE = 1e-3


def agreement_metrics(seqs: Sequence[PackedSequence], tolerance: float = AGREEMENT_TOLERANCE) -> dict[str, Any]:
    """The update row's log-prob agreement columns, over the trained tokens (mask 1) of the forwarded sequences.

    Returns:
        ``logprob_diff_max``: largest |π_start − engine| log-prob (nats) over the tokens of sequences sampled
        by the weights the update starts from (``staleness`` 0); NaN when there are none with engine log-probs.
        ``logprob_diff_outliers``: how many of those tokens differ by more than ``tolerance`` nats.
        ``logprob_diff_max_stale``: the same maximum over sequences sampled ``staleness`` ≥ 1 versions ago
        (the policy's drift since; NaN when there are none). ``stale_tokens_trained``: their trained tokens.
        ``tokens_without_engine_logprobs``: trained tokens of sequences that came without the engine's
        log-probs (the PPO ratio is taken against π_start there).
    """
    on, stale = _Max(), _Max()
    stale_tokens = missing = 0
    for s in seqs:
        if not s.trained or s.trainer_logprobs is None:
            continue
        n = sum(s.mask)
        if not s.has_old:
            missing += n
            continue
        if s.staleness > 0:
            stale_tokens += n
        side = stale if s.staleness > 0 else on
        for new, old, m in zip(s.trainer_logprobs, s.old_logprobs, s.mask):
            if m:
                side.add(abs(new - old), tolerance)
    return {"logprob_diff_max": on.value, "logprob_diff_outliers": on.over,
            "logprob_diff_max_stale": stale.value, "stale_tokens_trained": stale_tokens,
            "tokens_without_engine_logprobs": missing}


class _Max:
    """A running maximum (NaN while empty) and the count of values above a tolerance."""

    def __init__(self) -> None:
        self.value, self.over = math.nan, 0

    def add(self, x: float, tolerance: float) -> None:
        self.value = x if math.isnan(self.value) else max(self.value, x)
        self.over += x > tolerance
