"""The GRPO group of a task: its ``id`` field, or a hash of its content (never the Python object's id)."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass

import pytest

from lightning_nb import AlgorithmConfig, GRPOConfig, GRPOTrainer, LightningRL, start_runners
from lightning_nb.algorithm.lightning_rl import task_key


def test_equal_tasks_that_are_distinct_objects_share_a_key_whatever_their_field_order():
    a = {"question": "Tom has 2 apples and gets 3 more. How many now?", "answer": 5}
    b = {"answer": 5, "question": "Tom has 2 apples and gets 3 more. How many now?"}
    assert a is not b and task_key(a) == task_key(b)
    assert re.fullmatch(r"[0-9a-f]{12}", task_key(a))
    # the documented rule, so a key can be recomputed anywhere
    assert task_key(a) == hashlib.sha1(json.dumps(a, sort_keys=True).encode()).hexdigest()[:12]


def test_different_tasks_get_different_keys():
    tasks = [{"question": f"{i} + 1?", "answer": i + 1} for i in range(50)]
    tasks += [{"question": "0 + 1?", "answer": 2}, {"question": "0 + 1?"}]
    assert len({task_key(t) for t in tasks}) == len(tasks)


def test_the_id_field_names_the_group_when_present():
    assert task_key({"id": "t7", "question": "1 + 1?"}) == "t7"
    assert task_key({"id": 7, "question": "1 + 1?"}) == "7"
    assert task_key({"qid": "q1", "id": "t7"}, id_key="qid") == "q1"
    # without the id_key field: the content hash, the same for equal tasks
    assert task_key({"id": "t7"}, id_key="qid") == task_key({"id": "t7"}, id_key="qid") != "t7"


def test_tasks_that_are_not_dicts_get_content_keys():
    assert task_key("What is 2 + 2?") == task_key("".join(["What is 2 + 2?"]))
    assert task_key("What is 2 + 2?") != task_key("What is 2 + 3?")
    assert task_key(["a", 1]) == task_key(["a", 1]) != task_key(["a", 2])
    assert task_key(3) != task_key("3")

    @dataclass
    class Task:  # not JSON: hashed by its repr, which a dataclass builds from its fields
        question: str

    assert task_key(Task("1 + 1?")) == task_key(Task("1 + 1?")) != task_key(Task("1 + 2?"))
    assert re.fullmatch(r"[0-9a-f]{12}", task_key(Task("1 + 1?")))


def test_the_algorithm_names_groups_of_tasks_without_ids_by_their_content(engine, proxied_store):
    store = proxied_store
    runners = start_runners(lambda task, llm: 1.0, store, n=2)  # no LLM call: only the groups matter here
    task = {"question": "1 + 1?", "answer": 2}
    twin = dict(task)  # an equal task, another object: the same group
    other = {"question": "2 + 2?", "answer": 4}
    trainer = GRPOTrainer(engine, GRPOConfig(track_reference_kl=False))
    algo = LightningRL(store, trainer, [task, twin, other], config=AlgorithmConfig(
        tasks_per_step=2, group_size=2, dynamic_sampling=False))  # the twin is the task: 2 distinct tasks
    try:
        _, ids = algo.collect()
    finally:
        runners.stop()
    groups = {r.metadata["group_id"] for r in store.query_rollouts(rollout_ids=ids)}
    assert groups == {f"1.0:{task_key(task)}", f"1.0:{task_key(other)}"}, groups
    assert not {str(id(t)) for t in (task, twin, other)} & {g.split(":", 1)[1] for g in groups}


def test_a_custom_group_key_of_the_adapter_is_the_key_the_algorithm_writes(engine, proxied_store):
    """TripletAdapter(group_key=...) reads the group from that rollout metadata key, so LightningRL must write it
    there: otherwise every episode is a group of its own and GRPO drops them all."""
    from openai import OpenAI

    from lightning_nb import TripletAdapter
    from lightning_nb.errors import ConfigError
    from lightning_nb.rewards import GroupJudge

    def agent(task, llm):  # one short LLM call, so each episode has a triplet
        OpenAI(base_url=llm.endpoint, api_key="x", max_retries=0).chat.completions.create(
            model=llm.model, messages=[{"role": "user", "content": task["question"]}], **llm.sampling_parameters)
        return 1.0

    store = proxied_store
    runners = start_runners(agent, store, n=4)
    tasks = [{"id": "t1", "question": "1 + 1?"}, {"id": "t2", "question": "2 + 2?"}]
    trainer = GRPOTrainer(engine, GRPOConfig(track_reference_kl=False))
    algo = LightningRL(store, trainer, tasks, adapter=TripletAdapter(group_key="episode_group"),
                       config=AlgorithmConfig(tasks_per_step=2, group_size=2, max_tokens=2, dynamic_sampling=False))
    try:
        triplets, ids = algo.collect()
    finally:
        runners.stop()
    assert {r.metadata.get("episode_group") for r in store.query_rollouts(rollout_ids=ids)} == {"1.0:t1", "1.0:t2"}
    assert sorted(t.group_id for t in triplets) == ["1.0:t1", "1.0:t1", "1.0:t2", "1.0:t2"]
    assert len(trainer.signal_groups(triplets)) == 0  # equal rewards; but two groups of two, not four of one
    with pytest.raises(ConfigError, match="group_key"):  # a group judge reading another key is refused
        LightningRL(store, trainer, tasks, adapter=TripletAdapter(group_key="episode_group"),
                    group_judge=GroupJudge(endpoint="http://127.0.0.1:9/v1", model="m"))
