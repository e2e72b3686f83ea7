"""Deprecated: moved to :mod:`lightning_nb.credit.returns` (credit is the algorithm's step, issue 51).

Importing a name from here still works for one release, with a DeprecationWarning naming its new home.
"""

from __future__ import annotations

import warnings
from typing import Any

_MOVED = ("overlong_penalty", "group_advantages", "reward_to_go", "transition_advantages")


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        warnings.warn(f"lightning_nb.trainers.credit.{name} moved to lightning_nb.credit.{name} (credit is the "
                      "algorithm's step); the old path goes in the next release", DeprecationWarning, stacklevel=2)
        from lightning_nb.credit import returns

        return getattr(returns, name)
    raise AttributeError(f"module 'lightning_nb.trainers.credit' has no attribute {name!r}")
