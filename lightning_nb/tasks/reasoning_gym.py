"""The ``reasoning_gym:<dataset>[?options]`` task sets: reasoning-gym's procedural datasets, single turn.

Source: the ``reasoning-gym`` package (0.1.23 here: its distribution metadata; the module's ``__version__`` still
says 0.1.19), 104 datasets in ``reasoning_gym.factory.DATASETS``. The options are the dataset's config fields
(``reasoning_gym:basic_arithmetic?min_terms=2&max_terms=3``); a field the config does not have is refused,
listing those it has.

* **Tasks.** The tasks of seeds ``a..b-1`` are the items of ``reasoning_gym.create_dataset(name, seed=a,
  size=b-a, **options)``, made on demand: most datasets draw item ``i`` from ``random.Random(a + i)``, so item
  ``i`` is the task of seed ``a + i`` and disjoint seed ranges give disjoint draws. (A few datasets pick from a
  fixed bank with ``Random(a)``, e.g. gsm_symbolic, list_functions, acre: their held-out problems can repeat a bank
  entry that training saw.) A task is ``{"id": "<dataset>-<seed>", "seed", "question", "answer", "metadata"}``,
  plus ``"difficulty"`` (the slice label, below) and the item's own difficulty values as fields. Some datasets are
  slow to make (sokoban ~0.5 s an item, knight_swap ~1.2 s on 2 cores): the demo makes only the tasks it draws.
* **Agent.** :func:`reasoning_gym_agent`: one chat completion with reasoning-gym's own ``"direct"`` system prompt
  (``reasoning_gym.utils.SYSTEM_PROMPTS``: answer between ``<answer>`` tags, no reasoning), or the rollout's
  ``"system_prompt"`` :class:`~lightning_nb.types.PromptTemplate` (filled with ``question=``) when its resources
  set has one, as the calc agent reads it (so APO can tune it).
* **Reward.** :func:`reasoning_gym_reward`: the dataset's own ``score_answer(answer, entry)`` (0.0 .. 1.0; the
  default gives ``len(answer) / len(reply)`` when the reply contains the answer among other text) of the text
  between the last ``<answer>`` tags (``reasoning_gym.utils.extract_answer``) or, with no tags, the reply's last
  non-empty line.
* **Slices.** reasoning-gym lists a dataset's difficulty options in ``metadata["difficulty"]``; the first of them
  that the items carry as their own value (``basic_arithmetic``: ``num_terms``) is the ``"difficulty"`` label
  (``"num_terms=3"``), the default ``slice_by``. Datasets whose items carry none have no slices. ``--slice-by
  num_digits`` picks another.

Requires ``reasoning-gym`` (the ``envs`` extra: ``pip install 'lightning-nb[envs]'``).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any, Callable, Optional

from lightning_nb.errors import ConfigError, MissingDependencyError
from lightning_nb.tasks.registry import TaskFamily, TaskSet, package_version, unknown_target
from lightning_nb.types import LLMResource, PromptTemplate

__all__ = ["reasoning_gym_agent", "reasoning_gym_reward", "extract_reply_answer", "REASONING_GYM_FAMILY",
           "SYSTEM_PROMPT_RESOURCE"]

#: the resources name of a system prompt template that replaces reasoning-gym's (as the calc agent's)
SYSTEM_PROMPT_RESOURCE = "system_prompt"
_ANSWER_TAGS = re.compile(r"<answer>\s?(.*?)\s?</answer>", re.DOTALL)


def _reasoning_gym() -> Any:
    try:
        import reasoning_gym
        import reasoning_gym.factory  # noqa: F401
    except ImportError as exc:
        raise MissingDependencyError("reasoning_gym tasks need reasoning-gym: pip install 'lightning-nb[envs]'") from exc
    return reasoning_gym


def extract_reply_answer(text: str) -> str:
    """The answer in a reply: the text between its last ``<answer>`` and ``</answer>`` (stripped), else its last
    non-empty line (stripped), else ``""``."""
    tagged = _ANSWER_TAGS.findall(text or "")
    if tagged:
        return tagged[-1].strip()
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return lines[-1] if lines else ""


def reasoning_gym_reward(text: str, task: dict[str, Any], score: Callable[[Optional[str], dict], float]) -> float:
    """reasoning-gym's ``score(answer, entry)`` of the reply ``text`` (:func:`extract_reply_answer`) against the
    task's item (``question``, ``answer``, ``metadata``), as a float in 0.0 .. 1.0."""
    entry = {"question": task["question"], "answer": task["answer"], "metadata": task.get("metadata", {})}
    return float(score(extract_reply_answer(text), entry))


def reasoning_gym_agent(task: dict[str, Any], llm: LLMResource, *, score: Callable[[Optional[str], dict], float],
                        system_prompt: str, resources: Optional[dict[str, Any]] = None) -> float:
    """Answer ``task["question"]`` in one chat completion and return :func:`reasoning_gym_reward` of the reply.

    ``score``: the dataset's ``score_answer``; ``system_prompt``: the prompt unless ``resources`` holds a
    :class:`~lightning_nb.types.PromptTemplate` under :data:`SYSTEM_PROMPT_RESOURCE` (then its
    ``format(question=...)``). Sampling comes from ``llm.sampling_parameters`` (default ``max_tokens`` 48).

    Raises:
        ConfigError: that resource is not a PromptTemplate.
    """
    import openai

    template = (resources or {}).get(SYSTEM_PROMPT_RESOURCE)
    if template is not None and not isinstance(template, PromptTemplate):
        raise ConfigError(f"resources[{SYSTEM_PROMPT_RESOURCE!r}] is a {type(template).__name__}; the reasoning_gym "
                          "agent reads its system prompt from a PromptTemplate there")
    prompt = template.format(question=task["question"]) if template is not None else system_prompt
    messages: Any = [{"role": "system", "content": prompt}, {"role": "user", "content": task["question"]}]
    client = openai.OpenAI(base_url=llm.endpoint, api_key=llm.api_key, max_retries=0, timeout=600)
    try:
        reply = client.chat.completions.create(model=llm.model, messages=messages,
                                               **{"max_tokens": 48, **llm.sampling_parameters})
    finally:
        client.close()
    return reasoning_gym_reward(reply.choices[0].message.content or "", task, score)


def _difficulty_key(item: dict[str, Any]) -> Optional[str]:
    """The first difficulty option of the dataset that ``item`` carries as its own (scalar) value, or None."""
    metadata = item.get("metadata") or {}
    options = metadata.get("difficulty")
    for key in (options if isinstance(options, dict) else ()):
        if key != "difficulty" and isinstance(metadata.get(key), (int, float, str, bool)):
            return key
    return None


def _task(dataset: str, seed: int, item: dict[str, Any], slice_key: Optional[str]) -> dict[str, Any]:
    metadata = dict(item.get("metadata") or {})
    options = metadata.get("difficulty")
    own = {k: metadata[k] for k in (options if isinstance(options, dict) else ())
           if isinstance(metadata.get(k), (int, float, str, bool)) and k not in ("id", "seed", "question", "answer")}
    task = {"id": f"{dataset}-{seed}", "seed": seed, "question": item["question"], "answer": item["answer"],
            "metadata": metadata, **own}
    if slice_key is not None:
        task["difficulty"] = f"{slice_key}={metadata.get(slice_key)}"
    return task


def _make_tasks(dataset: str, config: dict[str, Any], slice_key: Optional[str], seeds: range) -> list[dict[str, Any]]:
    rg = _reasoning_gym()
    items = rg.create_dataset(dataset, seed=seeds.start, size=len(seeds), **config)
    return [_task(dataset, seed, items[i], slice_key) for i, seed in enumerate(seeds)]


def _build(target: str, options: dict[str, Any]) -> TaskSet:
    rg = _reasoning_gym()
    from reasoning_gym.factory import DATASETS
    from reasoning_gym.utils import SYSTEM_PROMPTS

    if target not in DATASETS:
        raise unknown_target("reasoning_gym", target, DATASETS, "dataset",
                             "sorted(reasoning_gym.factory.DATASETS)")
    config_cls = DATASETS[target][1]
    fields = sorted(f.name for f in dataclasses.fields(config_cls)) if dataclasses.is_dataclass(config_cls) else []
    unknown = sorted(set(options) - set(fields) | ({"seed", "size"} & set(options))) if fields else []
    if unknown:
        raise ConfigError(f"task 'reasoning_gym:{target}': {unknown} not among its options (seed and size are set "
                          f"per split); {config_cls.__name__} has {[f for f in fields if f not in ('seed', 'size')]}")
    try:
        probe = rg.create_dataset(target, seed=0, size=1, **options)
        first = probe[0]
    except (TypeError, ValueError, AssertionError) as exc:
        raise ConfigError(f"task 'reasoning_gym:{target}' with options {options}: reasoning-gym refused them: "
                          f"{type(exc).__name__}: {exc}") from exc
    slice_key = _difficulty_key(first)
    agent = functools.partial(reasoning_gym_agent, score=probe.score_answer, system_prompt=SYSTEM_PROMPTS["direct"])
    query = "&".join(f"{k}={v}" for k, v in options.items())
    return TaskSet(f"reasoning_gym:{target}" + (f"?{query}" if query else ""), agent,
                   functools.partial(_make_tasks, target, dict(options), slice_key),
                   slice_by="difficulty" if slice_key else None, source=package_version("reasoning-gym"),
                   reward=functools.partial(reasoning_gym_reward, score=probe.score_answer))


def _targets() -> list[str]:
    _reasoning_gym()
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


REASONING_GYM_FAMILY = TaskFamily(
    "reasoning_gym", _build, usage="reasoning_gym:<dataset>[?option=value&...]",
    summary="one of reasoning-gym's 104 procedural datasets, single turn, scored by its own score_answer",
    targets=_targets)
