"""The verl trainer: verl's actor does the update (verl is imported when one is built: ``pip install 'lightning-nb[verl]'``).

``VerlConfig`` and ``VerlTrainer`` are imported on first access (PEP 562, :func:`lightning_nb._lazy.lazy_names`),
so importing a submodule such as ``lightning_nb.trainers.verl.config`` does not import the trainer (nor, through
it, the in-place weights side).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_nb._lazy import lazy_names

if TYPE_CHECKING:
    from lightning_nb.trainers.verl.config import VerlConfig
    from lightning_nb.trainers.verl.trainer import VerlTrainer

__all__ = ["VerlConfig", "VerlTrainer"]
__getattr__, __dir__ = lazy_names(__name__, {"VerlConfig": "lightning_nb.trainers.verl.config",
                                             "VerlTrainer": "lightning_nb.trainers.verl.trainer"})
