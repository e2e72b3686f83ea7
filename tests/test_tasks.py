"""Task sets by name (lightning_nb/tasks/): the registry's errors, disjoint seed splits, reasoning-gym's tasks and
scores, the game families, and ``demo --task`` with a reasoning-gym dataset (that one loads the model)."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from lightning_nb.errors import ConfigError, EnvRefused
from lightning_nb.slices import slice_labels
from lightning_nb.tasks import (CalcTaskSet, TaskFamily, TaskSet, load_task, parse_task_name, register_task_family,
                                task_families)
from lightning_nb.tasks.calc import calc_reward, load_tasks

reasoning_gym = pytest.importorskip("reasoning_gym", reason="the envs extra: pip install 'lightning-nb[envs]'")
ROOT = Path(__file__).resolve().parents[1]


# ----- names -----
def test_a_name_that_does_not_exist_is_an_error_listing_what_does():
    with pytest.raises(ConfigError) as exc:
        load_task("calx")
    message = str(exc.value)
    assert "no task family 'calx' (did you mean 'calc'?)" in message
    for usage in ("calc:", "reasoning_gym:<dataset>[?option=value&...]:", "textarena:<game>", "gem:<env>"):
        assert usage in message, usage
    with pytest.raises(ConfigError, match=r"reasoning_gym has no dataset 'basic_arithmetc' \(closest: basic_arithmetic"
                                          r".*the 104 datasets: ab, acre, .*zebra_puzzles"):
        load_task("reasoning_gym:basic_arithmetc")
    with pytest.raises(ConfigError, match=r"no game 'GuessTheNumbr-v0-raw' \(closest: GuessTheNumber-v0-raw"):
        load_task("textarena:GuessTheNumbr-v0-raw")
    with pytest.raises(ConfigError, match=r"gem has no environment 'game:GuessTheNumbr-v0-easy' \(closest: "
                                          r"game:GuessTheNumber-v0-easy"):
        load_task("gem:game:GuessTheNumbr-v0-easy")
    with pytest.raises(ConfigError, match=r"\['nope'\] not among its options.*'max_terms'"):
        load_task("reasoning_gym:basic_arithmetic?nope=3")
    with pytest.raises(ConfigError, match="reasoning-gym refused them: AssertionError: min_terms must be positive"):
        load_task("reasoning_gym:basic_arithmetic?min_terms=0")
    with pytest.raises(ConfigError, match="takes no dataset or options"):
        load_task("calc:val")
    with pytest.raises(ConfigError, match="names no game"):
        load_task("textarena:")


@pytest.mark.parametrize("command", ["demo", "eval"])
def test_the_command_line_refuses_an_unknown_task_before_anything_loads(capsys, command):
    from lightning_nb.cli import main

    with pytest.raises(SystemExit) as exc:
        main([command, "--task", "reasoning_gym:no_such_dataset"])
    assert exc.value.code == 2 and "--task reasoning_gym:no_such_dataset" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main([command, "--task", "reasoning_gym:basic_arithmetic", "--ood-size", "8"])
    assert exc.value.code == 2 and "--ood-size is the calc task's" in capsys.readouterr().err
    if command == "eval":  # the demo's calc-only flags are not eval's at all
        with pytest.raises(SystemExit) as exc:
            main([command, "--task", "reasoning_gym:basic_arithmetic", "--all-numbers-bonus", "0.2"])
        assert exc.value.code == 2 and "unrecognized arguments: --all-numbers-bonus" in capsys.readouterr().err


def test_names_parse_into_family_target_and_literal_options():
    assert parse_task_name("calc") == ("calc", "", {})
    assert parse_task_name("gem:game:Sudoku-v0-easy?max_steps=4") == ("gem", "game:Sudoku-v0-easy", {"max_steps": 4})
    assert parse_task_name("reasoning_gym:x?a=2&b=0.5&c=true&d=abc&e=[1, 2]") == \
        ("reasoning_gym", "x", {"a": 2, "b": 0.5, "c": True, "d": "abc", "e": [1, 2]})
    with pytest.raises(ConfigError, match="'a' is given twice"):
        parse_task_name("reasoning_gym:x?a=1&a=2")
    with pytest.raises(ConfigError, match="option 'a' is not key=value"):
        parse_task_name("reasoning_gym:x?a")


# ----- splits -----
def test_a_split_whose_seeds_overlap_is_refused_naming_both_ranges():
    with pytest.raises(ConfigError, match=r"train_seeds range\(0, 100\) and heldout_seeds range\(50, 150\) overlap "
                                          r"\(seeds 50..99\)"):
        load_task("reasoning_gym:chain_sum", train_seeds=range(0, 100), heldout_seeds=range(50, 150))
    with pytest.raises(ConfigError, match=r"overlap \(seed 9\)"):
        TaskSet("mine", print, lambda seeds: [], train_seeds=range(0, 10), heldout_seeds=range(9, 20))
    with pytest.raises(ConfigError, match="heldout_seeds must be a non-empty range"):
        TaskSet("mine", print, lambda seeds: [], heldout_seeds=range(5, 5))
    with pytest.raises(ConfigError, match="fixed files"):
        load_task("calc", train_seeds=range(0, 10))
    # ranges that touch do not overlap
    task = load_task("reasoning_gym:chain_sum", train_seeds=range(0, 100), heldout_seeds=range(100, 150))
    assert task.describe(4, 2)["train_seeds"] == "range(0, 4)" and task.describe()["heldout_seeds"] == "range(100, 150)"


def test_training_and_held_out_tasks_come_from_their_own_seeds():
    task = load_task("reasoning_gym:basic_arithmetic")
    train, heldout = task.train_tasks(20), task.heldout_tasks(20)
    assert [t["seed"] for t in train] == list(range(20))
    assert [t["seed"] for t in heldout] == list(range(10_000_000, 10_000_020))
    assert not {t["id"] for t in train} & {t["id"] for t in heldout}
    assert task.train_tasks(20) == train  # deterministic in the seeds
    # the task of seed s is reasoning-gym's item of seed s (its items i of seed a come from Random(a + i))
    for t in (train[7], heldout[3]):
        item = reasoning_gym.create_dataset("basic_arithmetic", seed=t["seed"], size=1)[0]
        assert (t["question"], t["answer"]) == (item["question"], item["answer"])
    with pytest.raises(ConfigError, match=r"asked for 2000 held-out tasks; its held-out seeds .* hold 1..1000"):
        task.heldout_tasks(2000)


# ----- reasoning-gym: tasks, reward, slices -----
def test_reasoning_gym_scores_a_right_and_a_wrong_answer_with_its_own_score_answer():
    task_set = load_task("reasoning_gym:basic_arithmetic")
    assert task_set.source.startswith("reasoning-gym 0.1.")
    task = task_set.heldout_tasks(1)[0]
    right, wrong = task["answer"], str(int(task["answer"]) + 1)
    assert task_set.reward(f"<answer>{right}</answer>", task) == 1.0
    assert task_set.reward(f"<answer>{wrong}</answer>", task) == 0.0
    assert task_set.reward(f"I think it is\n{right}", task) == 1.0  # no tags: the last line
    assert task_set.reward("", task) == 0.0
    # another dataset with a scorer of its own (letters counted in a word)
    counting = load_task("reasoning_gym:letter_counting")
    task = counting.train_tasks(1)[0]
    assert counting.reward(f"<answer>{task['answer']}</answer>", task) == 1.0
    assert counting.reward(f"<answer>{int(task['answer']) + 3}</answer>", task) == 0.0


def test_reasoning_gym_slices_by_its_difficulty_option():
    task_set = load_task("reasoning_gym:basic_arithmetic?min_terms=2&max_terms=3")
    assert task_set.slice_by == "difficulty"
    heldout = task_set.heldout_tasks(32)
    labels = slice_labels(heldout, task_set.slice_by)
    assert set(labels) == {"difficulty=num_terms=2", "difficulty=num_terms=3"}
    assert all(t["difficulty"] == f"num_terms={t['num_terms']}" for t in heldout)
    assert set(slice_labels(heldout, "num_digits")) <= {f"num_digits={d}" for d in range(1, 5)}
    # a dataset whose items carry no difficulty value of their own has no slices
    assert load_task("reasoning_gym:gsm_symbolic").slice_by is None


# ----- games -----
def test_game_families_build_seed_tasks_and_refuse_what_the_agent_cannot_play():
    pytest.importorskip("textarena")
    pytest.importorskip("gem")
    from lightning_nb.agents import GEMRunner
    from lightning_nb.tasks.games import EnvChoice

    one = load_task("textarena:GuessTheNumber-v0-raw?max_turns=3&max_steps=4")
    assert isinstance(one.agent, GEMRunner) and one.agent.max_steps == 4 and one.agent.env_kwargs == {"max_turns": 3}
    assert one.train_tasks(2) == [{"id": "GuessTheNumber-v0-raw/0", "seed": 0, "env": "GuessTheNumber-v0-raw"},
                                  {"id": "GuessTheNumber-v0-raw/1", "seed": 1, "env": "GuessTheNumber-v0-raw"}]
    assert one.slice_by is None and one.source.startswith("textarena 0.7")
    two = load_task("textarena:TowerOfHanoi-v0-raw,TowerOfHanoi-v0-medium-raw")
    assert isinstance(two.agent, EnvChoice) and two.slice_by == "env"
    assert slice_labels(two.heldout_tasks(4), "env") == ["env=TowerOfHanoi-v0-raw", "env=TowerOfHanoi-v0-medium-raw"] * 2
    for game in ("QuantumTicTacToe-v0-raw", "SpiteAndMalice-v0-raw", "TicTacToe-v0-raw"):
        with pytest.raises(EnvRefused, match="single-player games") as exc:
            load_task(f"textarena:{game}")
        assert exc.value.reason == "players"
    gem = load_task("gem:game:GuessTheNumber-v0-easy,FrozenLake-v1?max_steps=3")
    assert gem.slice_by == "env" and gem.source.startswith("gem-llm")
    assert [t["env"] for t in gem.train_tasks(2)] == ["game:GuessTheNumber-v0-easy", "FrozenLake-v1"]
    with pytest.raises(ConfigError, match="GEMRunner max_steps must be an int >= 1"):
        load_task("gem:FrozenLake-v1?max_steps=0")


# ----- your own family, and the demo's settings per task -----
def test_a_family_written_in_a_notebook_cell_loads_by_name():
    def make_tasks(seeds):
        return [{"id": f"double-{s}", "seed": s, "question": f"What is {s} + {s}?", "answer": 2 * s} for s in seeds]

    family = TaskFamily("double", lambda target, options: TaskSet("double", print, make_tasks, reward=calc_reward),
                        usage="double", summary="a number added to itself")
    register_task_family(family)
    try:
        task = load_task("double")
        assert [t["answer"] for t in task.train_tasks(3)] == [0, 2, 4]
        assert task.reward("ANSWER: 4", task.train_tasks(3)[2]) == 1.0
        with pytest.raises(ConfigError, match="already registered"):
            register_task_family(family)
    finally:
        from lightning_nb.tasks import registry

        registry._FAMILIES.pop("double")
    assert "double" not in task_families()


def test_calc_is_the_default_and_its_tasks_are_the_files():
    task = load_task()
    assert isinstance(task, CalcTaskSet) and task.slice_by == "ops"
    assert task.train_tasks() == load_tasks("train") and task.heldout_tasks(64) == load_tasks("val", limit=64)
    assert task.ood_tasks(4) == load_tasks("val_ood", limit=4)
    assert task.reward("ANSWER: 7", {"answer": 7}) == 1.0


def test_demo_settings_take_the_task_sets_defaults(tmp_path):
    from lightning_nb.cli.demo import DEMO_SLICE_WEIGHTS, DemoSettings, _task_settings

    s, task = _task_settings(DemoSettings(1, tmp_path))
    assert isinstance(task, CalcTaskSet) and (s.slice_by, s.slice_weights) == ("ops", DEMO_SLICE_WEIGHTS)
    s, task = _task_settings(DemoSettings(1, tmp_path, task="reasoning_gym:basic_arithmetic"))
    assert (s.slice_by, s.slice_weights, s.all_numbers_bonus, s.ood_size) == ("difficulty", None, 0.0, 0)
    with pytest.raises(ConfigError, match="all_numbers_bonus=0.5 is the calc task's"):
        _task_settings(DemoSettings(1, tmp_path, task=task, all_numbers_bonus=0.5))


def test_the_summarys_standard_errors_are_over_tasks_and_paired_for_the_gain():
    from lightning_nb.cli.demo import _held_out_spread

    spread = _held_out_spread([0.0, 1.0, 0.0, 1.0, None], [1.0, 1.0, 0.0, 1.0, 1.0])  # None: a cancelled rollout
    assert spread["val_reward_before_se"] == pytest.approx(math.sqrt(1 / 3) / 2)  # stdev of 0,1,0,1 / sqrt(4)
    assert spread["val_reward_after_se"] == pytest.approx(math.sqrt(0.2) / math.sqrt(5))  # 1,1,0,1,1
    assert spread["val_reward_gain_se"] == pytest.approx(0.5 / 2)  # gains 1,0,0,0: stdev 0.5, paired over 4
    assert _held_out_spread([1.0], [0.0]) == dict.fromkeys(spread)  # one task: no spread, None (not NaN) in JSON


# ----- the demo on a reasoning-gym dataset (loads the model) -----
@pytest.mark.slow
def test_demo_trains_a_reasoning_gym_task_and_writes_the_same_files(tmp_path):
    """One step of issue 52's single-turn third-party task (number_format: the untrained model's held-out reward
    is 0.141 ± 0.044, bench/README.md), then eval of its checkpoint."""
    out = tmp_path / "rg"
    cmd = [sys.executable, "-m", "lightning_nb", "demo", "--task", "reasoning_gym:number_format",
           "--steps", "1", "--val-size", "4", "--tasks-per-step", "2", "--group-size", "2", "--runners", "4",
           "--max-tokens", "24", "--sample-rounds", "1", "--engine", "transformers", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "before training, reward by difficulty:" in proc.stdout and "held-out reward: before" in proc.stdout
    df = pd.read_csv(out / "metrics.csv")
    assert list(df.columns[:6]) == ["step", "reward_mean", "val_reward", "loss", "kl", "step_seconds"]
    assert df["step"].tolist() == [1]
    assert [c for c in df.columns if c.startswith("val_reward/difficulty=num_candidates=")]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["task"] == {"name": "reasoning_gym:number_format",
                               "source": summary["task"]["source"], "slice_by": "difficulty",
                               "train_seeds": "range(0, 2)", "heldout_seeds": "range(10000000, 10000004)"}
    assert summary["task"]["source"].startswith("reasoning-gym ")
    assert summary["slice_weights"] is None and summary["all_numbers_bonus"] == 0.0 and summary["ood_size"] == 0
    assert 0.0 <= summary["val_reward_before"] <= 1.0 and df["val_reward"].iloc[0] == summary["val_reward_after"]
    assert all(summary[k] >= 0.0 for k in ("val_reward_before_se", "val_reward_after_se", "val_reward_gain_se"))
    assert (out / "reward_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # eval --task: the trained checkpoint on the same held-out seeds, by the same slices
    proc = subprocess.run([sys.executable, "-m", "lightning_nb", "eval", "--task", cmd[5], "--checkpoint",
                           str(out / "checkpoint.pt"), "--val-size", "4", "--runners", "4", "--max-tokens", "24",
                           "--engine", "transformers"], capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = re.search(r"held-out reward on 4 held-out tasks of reasoning_gym:number_format \(seeds "
                     r"range\(10000000, 10000004\)\) \(greedy, step 1\): ([01]\.\d{3})", proc.stdout)
    assert line and 0.0 <= float(line.group(1)) <= 1.0, proc.stdout[-2000:]
    assert "difficulty" in proc.stdout.split(line.group(0))[1] and "val_ood" not in proc.stdout, proc.stdout[-2000:]
