"""Trainers: what updates the policy weights from a batch of triplets.

The contract is :mod:`.base`; its two implementations, side by side, are GRPO on transformers (:mod:`.grpo`)
and verl's actor (:mod:`.verl`). What both share sits here and imports neither: the config fields
(:mod:`.config`), the batch (:mod:`.batch`, with :mod:`.credit` and :mod:`.advantages`), the in-place weights
side (:mod:`.inplace`, :mod:`.optim`), packing, micro-batches, metrics and checkpoints.
"""
