"""The Algorithm contract (lightning_nb.algorithm.base.Algorithm), one suite over its three implementations:
LightningRL (a step: GRPO rollouts and an update), TrafficLearner (a step: an update on labelled traffic) and APO (a
step: a round of prompt search, no trainer).

Every one owns its run: the notebook verbs, the step counter (``global_step``), one metrics row per step, and the
checkpoint; a trainer holds no reference to it. All run for real: SmolLM2-135M behind the LLM proxy, runner
threads, the in-memory store, at smoke size.
"""

from __future__ import annotations

import re
import time

import pytest
from openai import OpenAI

from lightning_nb import (APO, AlgorithmConfig, APOConfig, GRPOConfig, GRPOTrainer, InMemoryStore, LightningRL,
                          LLMProxy, TrafficConfig, TrafficLearner, start_runners)
from lightning_nb.algorithm import Algorithm
from lightning_nb.errors import LightningNbError
from lightning_nb.tasks.calc import calc_agent, load_tasks
from lightning_nb.tasks.calc.agent import calc_resources

pytestmark = pytest.mark.slow

KINDS = ("LightningRL", "TrafficLearner", "APO")


class Run:
    """One algorithm of a kind on a live proxy: ``make()`` builds another of the same kind on the same store (what a
    new process does before ``load``), ``feed()`` gives it the work for one step (traffic: a labelled request)."""

    def __init__(self, kind, engine, tmp_path):
        self.kind, self.engine, self.tmp_path = kind, engine, tmp_path
        self.store = InMemoryStore()
        self.proxy = LLMProxy(engine, self.store).start()
        self.runners = None
        if kind == "LightningRL":
            self.store.add_resources({"main_llm": self.proxy.as_resource()})
            self.runners = start_runners(calc_agent, self.store, n=2)
        elif kind == "APO":
            self.store.add_resources(calc_resources(self.proxy.as_resource()), resources_id="calc")
            self.runners = start_runners(calc_agent, self.store, n=4)
        self.client = OpenAI(base_url=self.proxy.traffic_endpoint(), api_key="x", max_retries=0)
        self.fed = 0

    def make(self):
        if self.kind == "APO":
            return APO(self.store, load_tasks("train")[:2], load_tasks("val")[:2], resources_id="calc", config=APOConfig(
                rounds=2, beam_width=1, branch_factor=1, batch_size=2, max_tokens=8, proposer_max_tokens=24,
                publish=False))
        trainer = GRPOTrainer(self.engine, GRPOConfig(track_reference_kl=False, micro_batch_size=8))
        if self.kind == "LightningRL":
            return LightningRL(self.store, trainer, load_tasks("train"), config=AlgorithmConfig(
                tasks_per_step=1, group_size=2, max_tokens=6, temperature=1.0, max_sample_rounds=1))
        return TrafficLearner(self.store, trainer, TrafficConfig(min_labelled=1, poll_s=0.1),
                              checkpoint_dir=self.tmp_path / "traffic")

    def feed(self):
        """Traffic: one request to the proxy's /traffic route, labelled with a reward its baseline is not (1, then 0:
        a new input's baseline is the mean of the rewards used so far)."""
        if self.kind != "TrafficLearner":
            return
        self.fed += 1
        rid = self.client.chat.completions.with_raw_response.create(
            model=self.proxy.served_models[0], messages=[{"role": "user", "content": f"What is {self.fed} + 1?"}],
            max_tokens=6, temperature=1.0).headers["X-Rollout-Id"]
        self.store.label(rid, 1.0 if self.fed % 2 else 0.0)

    def close(self):
        if self.runners is not None:
            self.runners.stop()
        self.proxy.stop()


@pytest.fixture(params=KINDS)
def run(request, pristine, tmp_path):
    r = Run(request.param, pristine, tmp_path)
    yield r
    r.close()


def test_every_algorithm_owns_its_run_and_a_trainer_knows_none(run):
    algo = run.make()
    assert isinstance(algo, Algorithm)
    assert (algo.state, algo.running, algo.paused_at, algo.error, algo.global_step) == ("idle", False, "", None, 0)
    assert algo.progress.phase == "idle" and str(algo.progress) == "idle"
    assert algo.metrics == [] and algo.metrics_df().empty and algo.config_changes == []
    if algo.trainer is not None:  # the trainer only updates weights: no loop, no rows, no back-reference
        assert not any(hasattr(algo.trainer, name) for name in ("algorithm", "start", "pause", "metrics", "save"))
        assert all(v is not algo for v in vars(algo.trainer).values())


# the first phase each kind's step shows on its bar (issue 53: APO's and TrafficLearner's step() had none)
FIRST_PHASE = {"LightningRL": "rollouts", "TrafficLearner": "waiting", "APO": "rollouts"}


def test_a_step_from_a_cell_records_one_row_numbered_by_the_algorithm(run, capsys):
    algo = run.make()
    run.feed()
    row = algo.step(progress=True)  # the bar a notebook kernel shows by default (a script: when asked)
    assert row is not None and row["step"] == 1 == algo.global_step
    frames = [f for f in re.split(r"[\r\n]+", capsys.readouterr().err) if re.match(r"step 1: \w", f)]  # named phases
    assert frames and frames[0].startswith(f"step 1: {FIRST_PHASE[run.kind]}"), frames
    if algo.trainer is not None:
        assert any(re.match(r"step 1: update.*\| \d+/\d+ micro-batches", f) for f in frames), frames
    assert algo.metrics == [row] and algo.metrics_df()["step"].tolist() == [1]
    if algo.trainer is not None:
        assert algo.trainer.updates_applied == 1  # its own count of updates applied


def test_start_pause_resume_wait_and_stop_drive_the_loop_at_step_boundaries(run):
    algo = run.make()
    run.feed()
    assert algo.start(steps=2) is algo and algo.running
    with pytest.raises(LightningNbError, match="already running"):
        algo.start(steps=1)
    assert algo.pause(timeout=600) and algo.state == "paused" and algo.paused_at, (algo.state, algo.paused_at)
    step, rows = algo.global_step, len(algo.metrics)
    time.sleep(1.0)  # parked: nothing moves
    assert (algo.global_step, len(algo.metrics), algo.state) == (step, rows, "paused")
    algo.resume()
    assert algo.state in ("running", "finished")
    assert algo.wait(until_step=1, timeout=600) and algo.global_step >= 1
    run.feed()
    assert algo.wait(timeout=600) is True and algo.state == "finished" and algo.error is None
    assert algo.global_step == 2 and [r["step"] for r in algo.metrics] == [1, 2]
    assert algo.progress.phase == "ended"
    assert algo.stop(timeout=60) and not algo.running


def test_save_and_load_carry_the_step_counter_and_the_rows_into_a_new_algorithm(run, tmp_path):
    algo = run.make()
    run.feed()
    algo.step()
    path = algo.save(tmp_path / ("run.json" if run.kind == "APO" else "run.pt"))
    again = run.make()
    again.load(path)
    assert again.global_step == 1 and again.metrics_df()["step"].tolist() == [1]
    assert again.metrics[0].keys() == algo.metrics[0].keys()
    if again.trainer is not None:
        assert again.trainer.updates_applied == 1 and again.trainer is not algo.trainer
    run.feed()
    row = again.step()  # the run goes on from where the checkpoint was
    assert row["step"] == 2 == again.global_step and len(again.metrics) == 2


class _Counter(Algorithm):
    """The smallest algorithm: a step records an empty row (no store, no trainer)."""

    def __init__(self, config):
        super().__init__(None, None, config)

    def step(self):
        self.at_boundary("before step")
        return self.record({})

    def run(self, steps=None):
        for _ in range(steps or 0):
            self.step()

    def state_dict(self):
        return self.run_record()

    def load_state_dict(self, state):
        self.load_run_record(state)

    def save(self, path):
        raise NotImplementedError

    def load(self, path, **options):
        raise NotImplementedError


def test_one_channel_the_update_and_one_rule_for_both_configs_edits():
    """What the trainer's update returns is what the algorithm records (no trainer attributes read), and the edits of
    either config are found by one rule (ConfigWatch) and logged the same way (issue 51, item 3)."""
    from dataclasses import dataclass

    from lightning_nb.trainers.base import Update
    from lightning_nb.trainers.edits import ConfigWatch

    @dataclass
    class Config:
        steps: int = 1

        def validate(self):
            assert self.steps >= 1

    algo = _Counter(Config())
    watch = ConfigWatch(algo.config)
    algo.config.steps = 3  # an edit made while paused
    trainer_edit = ConfigWatch(GRPOConfig())
    grpo = GRPOConfig(learning_rate=1e-5)
    update = Update({"loss": 0.5}, trainer_edit.take(grpo))
    assert update["loss"] == 0.5 and dict(update) == {"loss": 0.5}  # indexing reads the metrics row
    row = algo.record(dict(update.metrics), update, watch.take(algo.config))
    assert row == {"loss": 0.5, "step": 1} and algo.last_update is update
    assert algo.config_changes == [
        {"step": 1, "config": "trainer", "field": "learning_rate", "old": 2e-5, "new": 1e-5},
        {"step": 1, "config": "algorithm", "field": "steps", "old": 1, "new": 3}]
    assert [c.text for c in update.config_changes] == ["learning_rate 2e-05 → 1e-05"]
    assert watch.take(algo.config) == [] and not watch.edited(algo.config)  # applied: nothing left


def test_the_contract_is_declared_and_the_loop_is_a_component():
    """Everything the loop, the checkpoint and the widgets read is declared on Algorithm with a type, and the loop is
    a component (``algo.loop``), not a mixin that probes its host."""
    from lightning_nb.algorithm.control import LoopControl, LoopStopped, TrainerStopped

    hints = Algorithm.__annotations__  # (the TYPE_CHECKING names stay strings: mypy reads them)
    for name in ("store", "trainer", "config", "global_step", "metrics", "config_changes", "last_update",
                 "checkpoint_resources_id", "loop"):
        assert name in hints, name
    assert TrainerStopped is LoopStopped and LoopControl not in Algorithm.__mro__

    class Config:
        def validate(self):
            pass

    algo = _Counter(Config())
    assert isinstance(algo.loop, LoopControl) and algo.state == "idle" and algo.global_step == 0
    algo.start(steps=3)
    assert algo.wait(timeout=30) and algo.global_step == 3 and algo.state == "finished"
