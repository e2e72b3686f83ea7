"""Task sets by name: ``load_task("calc")``, ``load_task("reasoning_gym:basic_arithmetic?max_terms=3")``,
``load_task("textarena:GuessTheNumber-v0-raw")``, ``load_task("gem:game:Mastermind-v0-easy")``.

A name is ``FAMILY[:TARGET][?KEY=VALUE&KEY=VALUE]``. The family says where the tasks come from and which agent
plays them (:data:`task_families` lists them; :func:`register_task_family` adds one); the target picks a dataset
or game of that family; the options go to it (values are read as Python literals where they parse: ``3``,
``0.5``, ``True``, ``"abc"``; ``true``/``false`` too). :func:`load_task` returns a :class:`TaskSet`: the training
and held-out tasks, drawn from disjoint seed ranges, the agent, and what to slice the held-out reward by.

Write a family of your own in a notebook cell::

    from lightning_nb.tasks import TaskFamily, TaskSet, register_task_family

    def make_tasks(seeds):                      # one task dict per seed, each with its "id"
        return [{"id": f"add-{s}", "seed": s, "question": f"{s} + {s}?", "answer": 2 * s} for s in seeds]

    register_task_family(TaskFamily(
        "add", lambda target, options: TaskSet("add", my_agent, make_tasks, source="my notebook"),
        usage="add", summary="adding a number to itself"))
    task = load_task("add")
    task.train_tasks(8), task.heldout_tasks(4)  # seeds 0..7, and 10,000,000..10,000,003
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import importlib.metadata
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

from lightning_nb.errors import ConfigError
from lightning_nb.slices import Slicer

__all__ = ["TaskSet", "TaskFamily", "load_task", "register_task_family", "task_families", "parse_task_name",
           "check_split", "package_version", "DEFAULT_TRAIN_SEEDS", "DEFAULT_HELDOUT_SEEDS"]

#: the seeds of a :class:`TaskSet`'s training tasks unless it says otherwise
DEFAULT_TRAIN_SEEDS = range(0, 10_000)
#: the seeds of its held-out tasks: far from the training ones, so that a longer training split never reaches them
DEFAULT_HELDOUT_SEEDS = range(10_000_000, 10_001_000)


def check_split(train_seeds: range, heldout_seeds: range, name: str = "task") -> None:
    """Refuse a split whose training and held-out seeds overlap (or that is not two non-empty ranges of step 1).

    Raises:
        ConfigError: naming both ranges and the seeds they share, with the fix.
    """
    for label, seeds in (("train_seeds", train_seeds), ("heldout_seeds", heldout_seeds)):
        if not isinstance(seeds, range) or seeds.step != 1 or len(seeds) == 0 or seeds.start < 0:
            raise ConfigError(f"{name}: {label} must be a non-empty range of seeds >= 0 with step 1, e.g. "
                              f"range(0, 1000), got {seeds!r}")
    low, high = max(train_seeds.start, heldout_seeds.start), min(train_seeds.stop, heldout_seeds.stop)
    if low < high:
        shared = f"seed {low}" if high - low == 1 else f"seeds {low}..{high - 1}"
        raise ConfigError(f"{name}: train_seeds {train_seeds} and heldout_seeds {heldout_seeds} overlap ({shared}): "
                          "a held-out task must never be a training task; give them disjoint ranges, e.g. "
                          f"train_seeds=range(0, {heldout_seeds.start}) or heldout_seeds=range({train_seeds.stop}, "
                          f"{train_seeds.stop + len(heldout_seeds)})")


@dataclass
class TaskSet:
    """A named set of tasks: the training and held-out tasks, the agent that plays them, how to slice them.

    Every task is made from one seed: ``make_tasks(seeds)`` returns one task dict per seed of ``seeds`` (a
    ``range``), in order, each with an ``"id"`` (LightningRL groups rollouts by it). Training tasks come from
    ``train_seeds``, held-out ones from ``heldout_seeds``; the two ranges never overlap (checked here).

    Attributes:
        name: the name it was loaded by (``"reasoning_gym:basic_arithmetic"``).
        agent: what runners call, ``agent(task, llm)`` (a function, or a
            :class:`~lightning_nb.agents.AgentRunner` such as GEMRunner).
        make_tasks: ``make_tasks(seeds: range) -> list[dict]``, deterministic in the seeds.
        train_seeds, heldout_seeds: disjoint ``range`` s of seeds >= 0 (defaults :data:`DEFAULT_TRAIN_SEEDS`,
            :data:`DEFAULT_HELDOUT_SEEDS`).
        slice_by: the task field (or function ``task -> label``) the held-out reward is broken down by, or None.
        source: where the tasks come from, with the package's version (``"reasoning-gym 0.1.23"``).
        reward: ``reward(reply_text, task) -> float``, what the agent scores its final reply with, for single-turn
            task sets (calc, reasoning_gym): the same function, to check an answer or re-score stored episodes
            without a model. None where the environment gives the reward (games).

    Raises:
        ConfigError: the seed ranges overlap or are not ranges (:func:`check_split`), or ``make_tasks`` is not
            callable.
    """

    name: str
    agent: Any
    make_tasks: Callable[[range], list[dict[str, Any]]]
    train_seeds: range = DEFAULT_TRAIN_SEEDS
    heldout_seeds: range = DEFAULT_HELDOUT_SEEDS
    slice_by: Optional[Slicer] = None
    source: str = ""
    reward: Optional[Callable[[str, dict[str, Any]], float]] = None
    #: whether the tasks are drawn by seed (:func:`load_task` may move the ranges); calc's are fixed files
    seeded = True

    def __post_init__(self) -> None:
        if not callable(self.make_tasks):
            raise ConfigError(f"TaskSet {self.name!r}: make_tasks must be a function seeds -> list of task dicts, "
                              f"got {type(self.make_tasks).__name__}")
        check_split(self.train_seeds, self.heldout_seeds, f"TaskSet {self.name!r}")

    def train_tasks(self, n: Optional[int] = None) -> list[dict[str, Any]]:
        """The tasks of the first ``n`` training seeds (None: all of ``train_seeds``).

        Raises:
            ConfigError: ``n`` < 1 or more than the range holds.
        """
        return self._tasks(self.train_seeds, n, "train")

    def heldout_tasks(self, n: Optional[int] = None) -> list[dict[str, Any]]:
        """The tasks of the first ``n`` held-out seeds (None: all of ``heldout_seeds``).

        Raises:
            ConfigError: ``n`` < 1 or more than the range holds.
        """
        return self._tasks(self.heldout_seeds, n, "held-out")

    def seeds(self, split: str, n: Optional[int] = None) -> range:
        """The seeds of the first ``n`` tasks of ``split`` (``"train"`` or ``"held-out"``; None: all).

        Raises:
            ConfigError: an unknown ``split``, or ``n`` < 1 or more than the range holds.
        """
        if split not in ("train", "held-out"):
            raise ConfigError(f"TaskSet.seeds: split must be 'train' or 'held-out', got {split!r}")
        seeds = self.train_seeds if split == "train" else self.heldout_seeds
        if n is None:
            return seeds
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= len(seeds):
            raise ConfigError(f"{self.name}: asked for {n!r} {split} tasks; its {split} seeds {seeds} hold 1.."
                              f"{len(seeds)}")
        return seeds[:n]

    def describe(self, n_train: Optional[int] = None, n_heldout: Optional[int] = None) -> dict[str, Any]:
        """What a run's ``summary.json`` says of the tasks: name, source, slice_by and the seed ranges of the first
        ``n_train`` training and ``n_heldout`` held-out tasks (None: the whole split), as ``"range(a, b)"``."""
        by = self.slice_by if self.slice_by is None or isinstance(self.slice_by, str) else \
            getattr(self.slice_by, "__name__", repr(self.slice_by))
        return {"name": self.name, "source": self.source, "slice_by": by,
                "train_seeds": str(self.seeds("train", n_train)),
                "heldout_seeds": str(self.seeds("held-out", n_heldout))}

    def _tasks(self, seeds: range, n: Optional[int], split: str) -> list[dict[str, Any]]:
        chosen = self.seeds(split, n)
        tasks = list(self.make_tasks(chosen))
        if len(tasks) != len(chosen):
            raise ConfigError(f"TaskSet {self.name!r}: make_tasks({chosen}) returned {len(tasks)} tasks; it must "
                              f"return one per seed ({len(chosen)})")
        return tasks


@dataclass(frozen=True)
class TaskFamily:
    """A kind of task set, loaded by name: ``build(target, options) -> TaskSet``.

    Attributes:
        name: the family's part of a task name (``"reasoning_gym"``), before the first ``:``.
        build: ``build(target: str, options: dict) -> TaskSet``; ``target`` is the name's part after the ``:``
            (``""`` when there is none), ``options`` its ``?key=value`` pairs, parsed. It raises ConfigError
            for a target or option it does not know, naming what it knows.
        usage: the name's form, for the error that lists the families (``"reasoning_gym:<dataset>[?options]"``).
        summary: one line on what the tasks are and how they are scored.
        targets: a function listing the family's targets (datasets, games), or None when it has none.
    """

    name: str
    build: Callable[[str, dict[str, Any]], TaskSet]
    usage: str
    summary: str
    targets: Optional[Callable[[], Sequence[str]]] = field(default=None, compare=False)


_FAMILIES: dict[str, TaskFamily] = {}


def register_task_family(family: TaskFamily, *, replace: bool = False) -> TaskFamily:
    """Make ``family`` loadable by name (:func:`load_task`); returns it.

    Raises:
        ConfigError: ``family`` is not a TaskFamily, its name is not a plain word, or the name is taken and
            ``replace`` is False.
    """
    if not isinstance(family, TaskFamily):
        raise ConfigError(f"register_task_family takes a TaskFamily, got {type(family).__name__}")
    if not family.name or not family.name.replace("_", "").isalnum():
        raise ConfigError(f"a task family's name must be letters, digits and '_' (it is what comes before ':' in "
                          f"a task name), got {family.name!r}")
    if family.name in _FAMILIES and not replace:
        raise ConfigError(f"task family {family.name!r} is already registered; pass replace=True to replace it")
    _FAMILIES[family.name] = family
    return family


def task_families() -> dict[str, TaskFamily]:
    """The registered families by name (a copy): ``calc``, ``reasoning_gym``, ``textarena``, ``gem``, then yours."""
    return dict(_FAMILIES)


def parse_task_name(name: str) -> tuple[str, str, dict[str, Any]]:
    """``"family:target?k=v&k2=v2"`` -> ``(family, target, {k: v, k2: v2})``; values are Python literals where
    they parse (``"3"`` -> 3, ``"[1, 2]"`` -> [1, 2]), ``true``/``false`` are bools, anything else stays a str.

    Raises:
        ConfigError: ``name`` is not a non-empty str, an option is not ``key=value``, or a key comes twice.
    """
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"a task name is a non-empty str such as 'calc' or 'reasoning_gym:basic_arithmetic', "
                          f"got {name!r}")
    head, _, query = name.strip().partition("?")
    family, _, target = head.partition(":")
    options: dict[str, Any] = {}
    for part in filter(None, query.split("&")):
        key, sep, raw = part.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"task {name!r}: option {part!r} is not key=value (e.g. ?max_terms=3&min_terms=2)")
        if key.strip() in options:
            raise ConfigError(f"task {name!r}: option {key.strip()!r} is given twice")
        options[key.strip()] = _literal(raw.strip())
    return family.strip(), target.strip(), options


def _literal(text: str) -> Any:
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def load_task(name: str = "calc", *, train_seeds: Optional[range] = None,
              heldout_seeds: Optional[range] = None) -> TaskSet:
    """The :class:`TaskSet` called ``name`` (``FAMILY[:TARGET][?options]``, see the module docstring).

    ``train_seeds`` / ``heldout_seeds`` replace the family's seed ranges (checked disjoint); calc's tasks are the
    committed files, so it takes neither.

    Raises:
        ConfigError: no family of that name (the message lists the families and their forms), a target or an
            option the family does not know (the family's message lists what it has), or overlapping seeds.
        EnvRefused: a game the agent cannot play alone or here (``reason`` says why; a ConfigError too).
        MissingDependencyError: the family's package is not installed (the message names the extra).
    """
    from lightning_nb import tasks as _families  # noqa: F401 - registers the built-in families

    family_name, target, options = parse_task_name(name)
    family = _FAMILIES.get(family_name)
    if family is None:
        close = difflib.get_close_matches(family_name, list(_FAMILIES), n=2)
        hint = f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""
        listed = "; ".join(f"{f.usage}: {f.summary}" for f in _FAMILIES.values())
        raise ConfigError(f"task {name!r}: no task family {family_name!r}{hint}. The families: {listed}")
    task = family.build(target, options)
    if not isinstance(task, TaskSet):
        raise ConfigError(f"task family {family.name!r} built a {type(task).__name__}, not a TaskSet")
    if train_seeds is not None or heldout_seeds is not None:
        if not task.seeded:
            raise ConfigError(f"task {name!r}: its tasks are fixed files ({task.source}), not drawn by seed; it "
                              "takes no train_seeds or heldout_seeds")
        task = dataclasses.replace(task, train_seeds=task.train_seeds if train_seeds is None else train_seeds,
                                   heldout_seeds=task.heldout_seeds if heldout_seeds is None else heldout_seeds)
    return task


def unknown_target(family: str, target: str, known: Iterable[str], what: str, how_to_list: str) -> ConfigError:
    """The error for a target its family does not have: the closest names, then all of them (or how to list them)."""
    known = sorted(known)
    close = difflib.get_close_matches(target, known, n=4, cutoff=0.5)
    listed = f"the {len(known)} {what}s: {', '.join(known)}" if len(known) <= 120 else \
        f"{len(known)} {what}s in all, listed by {how_to_list}"
    return ConfigError(f"task '{family}:{target}': {family} has no {what} {target!r}"
                       + (f" (closest: {', '.join(close)})" if close else "") + f"; {listed}")


def package_version(distribution: str) -> str:
    """``"<distribution> <installed version>"`` (``"reasoning-gym 0.1.23"``), from the package's metadata (some
    packages' ``__version__`` is stale: reasoning_gym 0.1.23 says 0.1.19); ``"<distribution> (not installed)"``."""
    try:
        return f"{distribution} {importlib.metadata.version(distribution)}"
    except importlib.metadata.PackageNotFoundError:
        return f"{distribution} (not installed)"


def options_for(family: str, options: Mapping[str, Any], reserved: Sequence[str]) -> tuple[dict, dict]:
    """Split ``options`` into the kit's ``reserved`` keys and the rest (what goes to the dataset or game)."""
    ours = {k: v for k, v in options.items() if k in reserved}
    return ours, {k: v for k, v in options.items() if k not in reserved}
