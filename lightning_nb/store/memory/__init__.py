"""The in-memory store, the default backend: :class:`InMemoryStore` (``store.py``), its span table in columns
(``spantable.py``, ``spans.py``) and the lock its runner threads share (``locks.py``)."""

from lightning_nb.store.memory.store import InMemoryStore

__all__ = ["InMemoryStore"]
