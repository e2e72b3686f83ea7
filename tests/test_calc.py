"""The default task: dataset determinism, calculator, reward parsing."""

from __future__ import annotations

import json

import pytest

from lightning_nb.calc import calc_reward, calculator, load_tasks
from lightning_nb.calc.agent import parse_final_number
from lightning_nb.calc.dataset import DATASET_DIR, SPLITS, generate


@pytest.mark.parametrize("split", sorted(SPLITS))
def test_committed_dataset_is_what_the_generator_writes(split):
    n, seed = SPLITS[split]
    committed = [json.loads(line) for line in (DATASET_DIR / f"{split}.jsonl").read_text().splitlines()]
    assert committed == generate(n, seed=seed, split=split)
    for task in committed:
        assert calculator(task["expression"]) == str(task["answer"])


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
    with pytest.raises(FileNotFoundError, match="train' or 'val"):
        load_tasks("nope")
