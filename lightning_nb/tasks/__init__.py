"""Task sets with their agents and rewards, loaded by name: ``load_task("calc")`` (the default),
``load_task("reasoning_gym:<dataset>[?options]")``, ``load_task("textarena:<game>")``, ``load_task("gem:<env>")``.

:mod:`~lightning_nb.tasks.registry` holds the names (:func:`load_task`, :class:`TaskSet`, :class:`TaskFamily`,
:func:`register_task_family`); each family lives beside it: :mod:`~lightning_nb.tasks.calc`,
:mod:`~lightning_nb.tasks.reasoning_gym`, :mod:`~lightning_nb.tasks.games` (TextArena and GEM). The guide is
docs/tasks.md ("Tasks by name").
"""

from lightning_nb.tasks.calc.family import CALC_FAMILY, CalcTaskSet
from lightning_nb.tasks.games import GEM_FAMILY, TEXTARENA_FAMILY
from lightning_nb.tasks.reasoning_gym import REASONING_GYM_FAMILY
from lightning_nb.tasks.registry import (TaskFamily, TaskSet, check_split, load_task, parse_task_name,
                                         register_task_family, task_families)

for _family in (CALC_FAMILY, REASONING_GYM_FAMILY, TEXTARENA_FAMILY, GEM_FAMILY):
    if _family.name not in task_families():
        register_task_family(_family)

__all__ = ["CalcTaskSet", "TaskFamily", "TaskSet", "check_split", "load_task", "parse_task_name",
           "register_task_family", "task_families"]
