"""``GRPOConfig``: the hyper-parameters of :class:`~lightning_nb.trainers.grpo.trainer.GRPOTrainer`'s update.

The fields are :class:`~lightning_nb.trainers.config.TrainerConfig`'s (shared with
:class:`~lightning_nb.trainers.verl.config.VerlConfig`, one name per concept); what is GRPOTrainer's own here
is two defaults that follow the config's device and dtype (:data:`DEVICE_DEFAULT`, :data:`DTYPE_DEFAULT`).
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

    :class:`~lightning_nb.trainers.config.TrainerConfig`'s fields, with two defaults resolved on construction:
    ``tis_cap`` (:data:`BF16_TIS_CAP` in bfloat16, else None) and ``micro_batch_tokens`` ('auto' on CUDA,
    None on CPU). Fields may be edited while the trainer is paused; the edit takes effect at the next
    update and is recorded in the metrics (``config_changes``, and the algorithm's ``config_changes``).
    """

    tis_cap: Optional[float] = field(default=DTYPE_DEFAULT, metadata={  # type: ignore[assignment]
        "help": "Truncated importance sampling (Yao et al. 2025): weight each token's loss by "
                "min(π_trainer/π_engine, tis_cap), for engines whose log-probs differ from the trainer's "
                "(vLLM, bf16, stale weights); 2 is typical. None = off. Default: 2.0 when dtype='bfloat16' "
                "(engine and trainer log-probs differ by p99 0.15-0.21 nats there even with float32 LM heads), "
                "None otherwise; an explicit None is kept."})
    micro_batch_tokens: Optional[Union[int, str]] = field(default=DEVICE_DEFAULT, metadata={
        "help": "Token budget of one forward/backward, padding counted (rows × the longest row): verl's "
                "use_dynamic_bsz with ppo_max_token_len_per_gpu. The sequences of a mini-batch are sorted by "
                "length and packed greedily (lightning_nb.trainers.microbatch.plan_micro_batches), so padding "
                "stays small; a sequence longer than the budget gets a micro-batch of its own (never cut); "
                "micro_batch_size, when set, still caps the rows. None = fixed micro-batches of micro_batch_size "
                "rows. 'auto' = chosen at each update from free device memory on CUDA (auto_micro_batch_tokens: "
                "a per-token memory estimate from the model's hidden size, layers, vocabulary and dtype, 70% of "
                "what is free after 1 GiB of headroom), 2048 on CPU; the metrics report the budget used "
                "(micro_batch_tokens). Default: 'auto' when device is CUDA, None on CPU (CPU updates stay as "
                "they were)."})

    def __post_init__(self) -> None:
        if self.micro_batch_tokens is DEVICE_DEFAULT:  # resolved once, from the device the config names
            cuda = isinstance(self.device, str) and self.device.startswith("cuda")
            self.micro_batch_tokens = "auto" if cuda else None
        super().__post_init__()
