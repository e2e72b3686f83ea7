"""Stores: the single source of truth for rollouts, attempts, spans and resources."""

from lightning_nb.store.base import LightningStore
from lightning_nb.store.memory import InMemoryStore

__all__ = ["LightningStore", "InMemoryStore"]
