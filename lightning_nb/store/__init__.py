"""Stores: the single source of truth for rollouts, attempts, spans and resources."""

from lightning_nb.store.base import LightningStore
from lightning_nb.store.client import StoreClient
from lightning_nb.store.memory import InMemoryStore
from lightning_nb.store.server import StoreServer
from lightning_nb.store.sqlite import SqliteStore

__all__ = ["LightningStore", "InMemoryStore", "StoreServer", "StoreClient", "SqliteStore"]
