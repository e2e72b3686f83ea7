"""``GRPOConfig``: the hyper-parameters of :class:`~lightning_nb.trainers.grpo.trainer.GRPOTrainer`'s update.

The fields are :class:`~lightning_nb.trainers.config.TrainerConfig`'s (shared with
:class:`~lightning_nb.trainers.verl.config.VerlConfig`, one name per concept); what is GRPOTrainer's own here
is two defaults: ``tis_cap`` follows the dtype (:data:`DTYPE_DEFAULT`), and ``micro_batch_tokens`` is ``'auto'`` on
every device (:data:`DEVICE_DEFAULT`, the CUDA-only default before issue 49, is still read from old configs).
The learning-rate schedule is :func:`lightning_nb.trainers.config.lr_factor`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

# the placeholders are shared with VerlConfig; re-exported here, where they were defined first
from lightning_nb.trainers.config import BF16_TIS_CAP, DEVICE_DEFAULT, DTYPE_DEFAULT, TrainerConfig

__all__ = ["GRPOConfig", "DEVICE_DEFAULT", "DTYPE_DEFAULT", "BF16_TIS_CAP"]


@dataclass
class GRPOConfig(TrainerConfig):
    """Hyper-parameters of the GRPO update. Validated on construction and again on ``algo.resume()``.

    :class:`~lightning_nb.trainers.config.TrainerConfig`'s fields, with one default resolved on construction:
    ``tis_cap`` (:data:`BF16_TIS_CAP` in bfloat16, else None). ``micro_batch_tokens`` is ``'auto'`` on every device
    (2,048 tokens on CPU). Fields may be edited while the trainer is paused; the edit takes effect at the next
    update and is recorded in the metrics (``config_changes``, and the algorithm's ``config_changes``).
    """

    tis_cap: Optional[float] = field(default=DTYPE_DEFAULT, metadata={  # type: ignore[assignment]
        "help": "Truncated importance sampling (Yao et al. 2025): weight each token's loss by "
                "min(π_trainer/π_engine, tis_cap), for engines whose log-probs differ from the trainer's "
                "(vLLM, bf16, stale weights); 2 is typical. None = off. Default: 2.0 when dtype='bfloat16' "
                "(engine and trainer log-probs differ by p99 0.15-0.21 nats there even with float32 LM heads), "
                "None otherwise; an explicit None is kept."})
    micro_batch_tokens: Optional[Union[int, str]] = field(default="auto", metadata={
        "help": "Token budget of one forward/backward (verl's use_dynamic_bsz with ppo_max_token_len_per_gpu). "
                "With prefix_tree: the nodes of one micro-batch's prefix tree (each shared token once, no "
                "padding); the mini-batch's sequences are sorted by their tokens, so those sharing a prefix "
                "are neighbours, and cut greedily (lightning_nb.trainers.prefix_tree.plan_tree_micro_batches). "
                "Without: padding counted (rows × the longest row); sorted by length and packed greedily "
                "(lightning_nb.trainers.microbatch.plan_micro_batches). A sequence longer than the budget gets a "
                "micro-batch of its own (never cut); micro_batch_size, when set, still caps the rows. None = fixed "
                "micro-batches of micro_batch_size rows in batch order (each a tree with prefix_tree). 'auto' = "
                "chosen at each update from free device memory on CUDA (auto_micro_batch_tokens: a per-token "
                "memory estimate from the model's hidden size, layers, vocabulary and dtype, 70% of what is free "
                "after 1 GiB of headroom), 2048 on CPU; the metrics report the budget used (micro_batch_tokens). "
                "Default 'auto' on every device (None on CPU before issue 49)."})
    def __post_init__(self) -> None:
        if self.micro_batch_tokens is DEVICE_DEFAULT:  # the placeholder of checkpoints' configs before issue 49
            self.micro_batch_tokens = "auto"
        super().__post_init__()
