"""Trainers: what updates the policy weights from a batch of triplets (the contract in :mod:`.base`; GRPO on
transformers in :mod:`.grpo`, verl's actor in :mod:`.verl`; the shared packing, metrics and checkpoint helpers)."""
