"""Stores: the single source of truth for rollouts, attempts, spans and resources.

One package per backend (``memory/``: :class:`InMemoryStore`; ``sqlite/``: :class:`SqliteStore`; ``http/``:
:class:`StoreServer` and :class:`StoreClient`), beside what they share: the contract (``base.py``), the status
machine and reward rule (``rules.py``), the DataFrames (``frames.py``, ``spanframe.py``), the OpenTelemetry
conversion (``otel.py``) and the fast copies of stored records (``copies.py``).
"""

from lightning_nb.store.base import LightningStore
from lightning_nb.store.http.client import StoreClient
from lightning_nb.store.http.server import StoreServer
from lightning_nb.store.memory.store import InMemoryStore
from lightning_nb.store.sqlite.store import SqliteStore

__all__ = ["LightningStore", "InMemoryStore", "StoreServer", "StoreClient", "SqliteStore"]
