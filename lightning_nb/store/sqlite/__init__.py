"""The durable store on SQLite: :class:`SqliteStore` (``store.py``), the database file and its schema
(``file.py``) and its spans (``spans.py``)."""

from lightning_nb.store.sqlite.store import SqliteStore

__all__ = ["SqliteStore"]
