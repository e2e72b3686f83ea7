"""The default task: dataset determinism, calculator, reward parsing."""

from __future__ import annotations

import json
import re

import pytest

from lightning_nb.tasks.calc import calc_reward, calculator, load_tasks
from lightning_nb.tasks.calc.agent import parse_final_number
from lightning_nb.tasks.calc.dataset import DATASET_DIR, SPLITS, count_ops, generate, generate_ood


@pytest.mark.parametrize("split", sorted(SPLITS))
def test_committed_dataset_is_what_the_generator_writes(split):
    n, seed, make = SPLITS[split]
    assert make is (generate_ood if split == "val_ood" else generate)
    committed = [json.loads(line) for line in (DATASET_DIR / f"{split}.jsonl").read_text().splitlines()]
    assert committed == make(n, seed=seed, split=split)
    for task in committed:
        assert calculator(task["expression"]) == str(task["answer"])
        assert task["answer"] > 0 and task["ops"] == count_ops(task["expression"])


def _shape(task):
    """A task's wording with its numbers, name and item blanked, and its operators."""
    words = re.sub(r"\d+", "N", task["question"]).split()
    return " ".join(w for w in words if w[0].islower() or w == "N"), tuple(re.findall(r"[-+*]", task["expression"]))


def test_val_ood_uses_wordings_names_and_numbers_the_training_generator_never_makes():
    train, ood = load_tasks("train"), load_tasks("val_ood")
    assert len(ood) == 200 and {t["ops"] for t in ood} == {1, 2}
    train_shapes = {_shape(t)[0] for t in train}
    assert not any(_shape(t)[0] in train_shapes for t in ood)  # no training wording, with any numbers
    train_words = {w.strip(".,?") for t in train for w in t["question"].split()}
    ood_proper = {w.strip(".,?") for t in ood for w in t["question"].split() if w[0].isupper()} - {"A", "There",
                                                                                                    "How", "What"}
    assert not ood_proper & train_words  # names of its own
    highest = {}  # (operators, position in the expression) -> the highest number training put there
    for t in train:
        for i, x in enumerate(re.findall(r"\d+", t["expression"])):
            key = (_shape(t)[1], i)
            highest[key] = max(highest.get(key, 0), int(x))
    assert ("-", "+") not in {ops for ops, _ in highest}  # the two-step order is new as well
    for t in ood:  # at every position, above anything training draws for that operator pattern
        for i, x in enumerate(re.findall(r"\d+", t["expression"])):
            assert int(x) > highest.get((_shape(t)[1], i), 0), t


def test_train_and_val_questions_do_not_overlap():
    train = {t["question"] for t in load_tasks("train")}
    val = [t["question"] for t in load_tasks("val")]
    assert sum(q in train for q in val) / len(val) < 0.1


def test_calculator_is_safe_and_exact():
    assert calculator("12 + 30") == "42"
    assert calculator("7 * (3 - 1)") == "14"
    assert calculator("7 / 2") == "3.5"
    assert calculator("1 / 0").startswith("error")
    assert calculator("__import__('os')").startswith("error")


@pytest.mark.parametrize("text, value", [
    ("ANSWER: 42", 42.0), ("CALC: 1 + 2 = 3\nANSWER: 3", 3.0), ("so it is 1,204 apples", 1204.0),
    ("no number", None), ("ANSWER: -5", -5.0),
])
def test_parse_final_number(text, value):
    assert parse_final_number(text) == value


def test_calc_reward():
    task = {"answer": 42}
    assert calc_reward("ANSWER: 42", task) == 1.0
    assert calc_reward("ANSWER: 41", task) == 0.0
    assert calc_reward("", task) == 0.0


def test_load_tasks_unknown_split_says_how_to_fix():
    with pytest.raises(FileNotFoundError, match="must be one of 'train', 'val', 'val_ood'"):
        load_tasks("nope")
