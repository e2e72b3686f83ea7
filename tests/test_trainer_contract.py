"""The Trainer contract (lightning_nb.trainers.base.Trainer), one suite over both implementations, GRPOTrainer and
VerlTrainer: the same triplets in, the metrics keys out, the weights reach the engine (it generates differently),
state_dict round trip, save_pretrained loadable, and a trainer that only updates weights: no loop verbs, no run
record, no reference to an algorithm (those are the Algorithm contract's, tests/test_algorithm_contract.py).

Both run for real on the session's SmolLM2-135M on CPU (VerlTrainer: verl 0.9.0's actor in this process).
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch

from lightning_nb.errors import MissingDependencyError
from lightning_nb.trainers.base import Trainer
from lightning_nb.trainers.config import TrainerConfig
from lightning_nb.trainers.grpo import GRPOConfig, GRPOTrainer
from lightning_nb.trainers.verl import VerlConfig, VerlTrainer

TRAINERS = {"grpo": (GRPOTrainer, GRPOConfig), "verl": (VerlTrainer, VerlConfig)}


@pytest.fixture(params=sorted(TRAINERS))
def make_trainer(request, engine, pristine):
    """``make_trainer(**config_fields)``: a trainer of the parametrized kind on the session engine (pristine weights)."""
    cls, config_cls = TRAINERS[request.param]

    def make(**fields):
        return cls(engine, config_cls(**fields))

    return make


def _greedy(engine):
    """The engine's greedy answer to one question: ``(completion token ids, their log-probs)``."""
    prompt = engine.apply_chat_template([{"role": "user", "content": "What is 17 + 25? Answer with a number."}])
    g = engine.generate(prompt, temperature=0.0, max_tokens=8)
    return list(g.completion_ids), list(g.logprobs)


def _weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_two_implementations_side_by_side():
    for cls, _ in TRAINERS.values():
        assert issubclass(cls, Trainer)
    assert not issubclass(VerlTrainer, GRPOTrainer) and not issubclass(GRPOTrainer, VerlTrainer)
    # one name per concept: the same fields, from the shared base (siblings, as the trainers are)
    assert issubclass(VerlConfig, TrainerConfig) and issubclass(GRPOConfig, TrainerConfig)
    assert not issubclass(VerlConfig, GRPOConfig) and not issubclass(GRPOConfig, VerlConfig)


@pytest.mark.slow
def test_same_triplets_in_metrics_out_and_the_engine_serves_the_new_weights(make_trainer, engine, one_group):
    triplets = one_group(engine)
    trainer = make_trainer(learning_rate=1e-4, track_reference_kl=False)
    ids_before, logprobs_before = _greedy(engine)
    version = engine.weight_version
    progress = []
    m = trainer.update(triplets, on_progress=lambda done, total, unit: progress.append((done, total, unit)))
    missing = [k for k in Trainer.METRIC_KEYS if k not in m]
    assert not missing, missing
    assert m["step"] == trainer.step == 1 and trainer.last_metrics is m
    assert (m["episodes"], m["groups"], m["groups_with_signal"], m["transitions"]) == (4, 1, 1, 4)
    assert m["reward_mean"] == 0.25 and m["sequences_trained"] == 4 and m["optimizer_steps"] >= 1
    assert m["grad_norm"] > 0 and m["tokens_trained"] == sum(len(t.response_ids) for t in triplets)
    assert progress and progress[-1][0] == progress[-1][1] > 0  # the update reported its work to the end
    # what the algorithm and the widgets read after an update
    assert trainer.last_triplets == triplets
    assert trainer.last_advantages["r0"] == pytest.approx(1.5, abs=1e-4)  # (1 - 0.25) / std([1, 0, 0, 0])
    assert trainer.last_advantages["r1"] == pytest.approx(-0.5, abs=1e-4)
    assert trainer.last_turn_advantages[("r0", 0)] == trainer.last_advantages["r0"]
    assert len(trainer.last_batch) == 4 and {"input_ids", "response_mask", "advantage"} <= set(trainer.last_batch[0])
    assert len(trainer.last_batch_df()) == 4
    assert trainer.signal_groups(triplets) == {"g"}
    # the weights reached the engine: a new version, and it generates differently
    assert engine.weight_version == version + 1
    ids_after, logprobs_after = _greedy(engine)
    assert ids_after != ids_before or max(abs(a - b) for a, b in zip(logprobs_after, logprobs_before)) > 1e-3


@pytest.mark.slow
def test_state_dict_round_trip_continues_the_same_update(make_trainer, engine, one_group, tmp_path):
    first, second = one_group(engine), one_group(engine, seed=1)
    trainer = make_trainer(learning_rate=2e-5, track_reference_kl=False)
    trainer.update(first)
    trainer.config.learning_rate = 1e-5  # an edit made while paused travels with the state
    path = tmp_path / "state.pt"
    with trainer.frozen():
        torch.save(trainer.state_dict(), path)  # tensors, numbers, strings, lists and dicts only
    straight = trainer.update(second)
    trained = _weights(engine.model)

    with engine.lock, torch.no_grad():
        engine.model.load_state_dict(engine.initial_state)
    fresh = make_trainer(learning_rate=2e-5, track_reference_kl=False)
    fresh.load_state_dict(torch.load(path, weights_only=True), source=path)
    path.unlink()
    assert fresh.step == 1 and fresh.config.learning_rate == 1e-5
    resumed = fresh.update(second)
    assert (resumed["step"], resumed["lr"]) == (straight["step"], straight["lr"])
    assert resumed["loss"] == pytest.approx(straight["loss"], abs=1e-6)
    assert all(torch.equal(trained[k], v) for k, v in engine.model.state_dict().items())


@pytest.mark.slow
def test_save_pretrained_writes_a_folder_transformers_loads(make_trainer, engine, one_group, tmp_path):
    from transformers import AutoModelForCausalLM

    trainer = make_trainer(learning_rate=1e-4, track_reference_kl=False)
    trainer.update(one_group(engine))
    folder = trainer.save_pretrained(tmp_path / "export")
    loaded = AutoModelForCausalLM.from_pretrained(folder)
    mine = engine.model.state_dict()
    assert all(torch.equal(v, mine[k]) for k, v in loaded.state_dict().items() if k in mine)
    assert (engine.initial_state["lm_head.weight"] != loaded.state_dict()["lm_head.weight"]).any()
    shutil.rmtree(folder)


def test_a_trainer_only_updates_weights(make_trainer):
    """The run (loop verbs, step rows, checkpoint) is the algorithm's: a trainer has none of it and no back-reference."""
    trainer = make_trainer(track_reference_kl=False)
    for name in ("start", "pause", "resume", "stop", "wait", "progress", "state", "running", "save", "load",
                 "metrics", "metrics_df", "add_metrics", "config_changes", "algorithm", "attach"):
        assert not hasattr(trainer, name), name
    assert trainer.step == 0 and trainer.last_metrics == {} and trainer.last_config_changes == []
    trainer.config.learning_rate = -1.0  # check_config (what the algorithm's resume() calls) refuses a bad edit
    with pytest.raises(ValueError, match="learning_rate"):
        trainer.check_config()
    trainer.config.learning_rate = 2e-5


def test_a_verl_trainer_without_verl_names_the_extra(engine, monkeypatch):
    monkeypatch.setitem(sys.modules, "verl", None)  # what an environment without verl gives `import verl`
    with pytest.raises(MissingDependencyError, match=r"pip install 'lightning-nb\[verl\]'"):
        VerlTrainer(engine, VerlConfig())


def test_the_trainer_packages_import_without_verl():
    code = ("import sys; sys.modules['verl'] = None\n"
            "import lightning_nb\n"
            "from lightning_nb.trainers.grpo import GRPOConfig, GRPOTrainer\n"
            "from lightning_nb.trainers.verl import VerlConfig, VerlTrainer\n"
            "VerlConfig(learning_rate=1e-5)\n"
            "assert not any(m == 'verl' or m.startswith('verl.') for m in sys.modules if sys.modules[m] is not None)\n"
            "print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
