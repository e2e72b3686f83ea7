"""The verl trainer: verl's actor does the update (verl is imported when one is built: ``pip install 'lightning-nb[verl]'``).

``VerlConfig`` and ``VerlTrainer`` are imported on first access (PEP 562), so importing a submodule such as
``lightning_nb.trainers.verl.config`` does not import the trainer (nor, through it, the in-place weights side).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_nb.trainers.verl.config import VerlConfig
    from lightning_nb.trainers.verl.trainer import VerlTrainer

__all__ = ["VerlConfig", "VerlTrainer"]


def __getattr__(name: str) -> Any:
    """Import ``VerlConfig`` or ``VerlTrainer`` from its module on first access, and keep it here."""
    if name == "VerlConfig":
        from lightning_nb.trainers.verl.config import VerlConfig as value
    elif name == "VerlTrainer":
        from lightning_nb.trainers.verl.trainer import VerlTrainer as value
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
