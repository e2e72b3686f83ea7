"""Prototype rewards and replies on stored episodes: what-if rewards (:mod:`~lightning_nb.replay.rescoring`), exact
replay and branching a rollout at call k (:mod:`~lightning_nb.replay.branching`).

Imports nothing heavy: the names are loaded on first use.
"""

from __future__ import annotations

from typing import Any

__all__ = ["what_if", "what_if_groups", "what_if_slices", "rescore", "score",
           "replay", "branch", "branch_group", "branch_tree", "BranchConfig", "branch_points"]

_HOMES = {"what_if": "rescoring", "what_if_groups": "rescoring", "what_if_slices": "rescoring",
          "rescore": "rescoring", "score": "rescoring", "replay": "branching", "branch": "branching",
          "branch_group": "branching", "branch_tree": "branching", "BranchConfig": "branching",
          "branch_points": "branching"}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        import importlib

        return getattr(importlib.import_module(f"lightning_nb.replay.{_HOMES[name]}"), name)
    raise AttributeError(f"module 'lightning_nb.replay' has no attribute {name!r}")
