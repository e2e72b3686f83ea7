"""Deprecated: moved to :mod:`lightning_nb.credit.normalize` (credit is the algorithm's step, issue 51).

Importing ``group_relative_advantages`` from here still works for one release, with a DeprecationWarning.
"""

from __future__ import annotations

import warnings
from typing import Any


def __getattr__(name: str) -> Any:
    if name == "group_relative_advantages":
        warnings.warn("lightning_nb.trainers.advantages.group_relative_advantages moved to "
                      "lightning_nb.credit.group_relative_advantages; the old path goes in the next release",
                      DeprecationWarning, stacklevel=2)
        from lightning_nb.credit.normalize import group_relative_advantages

        return group_relative_advantages
    raise AttributeError(f"module 'lightning_nb.trainers.advantages' has no attribute {name!r}")
