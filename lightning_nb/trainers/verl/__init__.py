"""The verl trainer: verl's actor does the update (verl is imported when one is built: ``pip install 'lightning-nb[verl]'``)."""

from lightning_nb.trainers.verl.config import VerlConfig
from lightning_nb.trainers.verl.trainer import VerlTrainer

__all__ = ["VerlConfig", "VerlTrainer"]
