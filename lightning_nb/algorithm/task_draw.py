"""Which training tasks a step enqueues: :class:`TaskDraw`, LightningRL's sampler of distinct tasks per sample round,
uniform or weighted by slice (``AlgorithmConfig.slice_weights``)."""

from __future__ import annotations

import random
from typing import Any, Optional, Sequence

from lightning_nb.algorithm.rl_config import task_key
from lightning_nb.errors import ConfigError
from lightning_nb.slices import Slicer, slice_labels, slicer_name

__all__ = ["TaskDraw"]


class TaskDraw:
    """The training tasks' keys (:func:`~lightning_nb.algorithm.rl_config.task_key`: each task's GRPO group name)
    and slice weights, computed once, and the draw of one sample round's tasks.

    Args:
        tasks: the training tasks.
        id_key: the task field that names a task (:func:`task_key`).
        slice_by: a task field or a function task -> label; needed by ``slice_weights``.
    """

    def __init__(self, tasks: Sequence[Any], id_key: str, slice_by: Optional[Slicer]) -> None:
        self.tasks, self.id_key, self.slice_by = tasks, id_key, slice_by
        self._labels: Optional[list[str]] = None
        self._keys: Optional[list[str]] = None
        self._weights: tuple[Any, Optional[list[float]]] = (None, None)

    def keys(self) -> list[str]:
        """Each training task's :func:`task_key`, computed once."""
        if self._keys is None:
            self._keys = [task_key(t, self.id_key) for t in self.tasks]
        return self._keys

    def weights(self, slice_weights: Optional[dict[str, float]]) -> Optional[list[float]]:
        """Each training task's sampling weight under ``slice_weights`` (``{label: weight}``; a label not listed
        weighs 1; None: uniform, returns None).

        Raises:
            ConfigError: ``slice_weights`` without ``slice_by``, a label no training task has, or every weight 0.
        """
        if slice_weights is None:
            return None
        key = tuple(sorted(slice_weights.items()))
        if self._weights[0] == key:
            return self._weights[1]
        if self.slice_by is None:
            raise ConfigError("AlgorithmConfig.slice_weights weighs tasks by slice label, so it needs "
                              "LightningRL(..., slice_by='ops') (a task field or a function task -> label); "
                              "or set slice_weights=None")
        if self._labels is None:
            self._labels = slice_labels(self.tasks, self.slice_by, what="train task")
        present = sorted(set(self._labels))
        unknown = [label for label in slice_weights if label not in present]
        if unknown:
            raise ConfigError(f"AlgorithmConfig.slice_weights: {unknown[0]!r} is not a slice of the training tasks "
                              f"(by={slicer_name(self.slice_by)}); their slices are {present}")
        weights = [float(slice_weights.get(label, 1.0)) for label in self._labels]
        if not any(weights):
            raise ConfigError("AlgorithmConfig.slice_weights weighs every training task 0; give some slice a weight > 0")
        self._weights = (key, weights)
        return weights

    def draw(self, n: int, taken: set[str], slice_weights: Optional[dict[str, float]],
             rng: random.Random) -> list[int]:
        """Indices of ``n`` distinct training tasks for one sample round (no task key twice), uniformly or by
        ``slice_weights``, drawn with ``rng``: first tasks whose key is not in ``taken`` (the step's earlier rounds;
        this updates it), then, once every task ran in this step, tasks of earlier rounds again (each a new group
        of this round). Fewer only where the weights leave too few tasks."""
        keys = self.keys()
        seen: set[str] = set()
        distinct = [i for i, k in enumerate(keys) if not (k in seen or seen.add(k))]  # type: ignore[func-returns-value]
        weights = self.weights(slice_weights)
        picked = _draw_from([i for i in distinct if keys[i] not in taken], n, weights, rng)
        if len(picked) < n:  # every task already ran in this step (a dynamic-sampling round): draw them again
            chosen = set(picked)
            picked += _draw_from([i for i in distinct if i not in chosen], n - len(picked), weights, rng)
        taken.update(keys[i] for i in picked)
        return picked


def _draw_from(pool: list[int], n: int, weights: Optional[list[float]], rng: random.Random) -> list[int]:
    """Up to ``n`` of ``pool`` (task indices) without replacement, uniformly (``weights`` None) or by ``weights``."""
    if weights is None:
        return rng.sample(pool, min(n, len(pool)))
    picked: list[int] = []
    while pool and len(picked) < n and any(weights[i] for i in pool):
        picked.append(pool.pop(rng.choices(range(len(pool)), [weights[i] for i in pool])[0]))
    return picked
