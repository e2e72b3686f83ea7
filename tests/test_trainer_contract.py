"""The Trainer contract (lightning_nb.trainers.base.Trainer), one suite over both implementations, GRPOTrainer and
VerlTrainer: the same triplets in, the metrics keys out, the weights reach the engine (it generates differently),
state_dict round trip, save_pretrained loadable, and a trainer that only updates weights: no loop verbs, no run
record, no reference to an algorithm (those are the Algorithm contract's, tests/test_algorithm_contract.py).

Both run for real on the session's SmolLM2-135M on CPU (VerlTrainer: verl 0.9.0's actor in this process).
"""

from __future__ import annotations

import contextlib
import math
import shutil
import subprocess
import sys

import pytest
import torch

from lightning_nb.errors import ConfigError, MissingDependencyError
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


@contextlib.contextmanager
def _forwards(engine):
    """Count the forward calls of every decoder stack of the engine model's type while the block runs (the policy's,
    and a reference copy's): ``{"grad": ..., "no_grad": ...}``, by whether autograd recorded the call. A scoring pass
    (π_old, the reference) runs without gradient; a training forward with."""
    decoder_type = type(engine.model.get_decoder())
    calls = {"grad": 0, "no_grad": 0}

    def count(module, args, output):
        if isinstance(module, decoder_type):
            calls["grad" if torch.is_grad_enabled() else "no_grad"] += 1

    handle = torch.nn.modules.module.register_module_forward_hook(count)
    try:
        yield calls
    finally:
        handle.remove()


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
    assert m["step"] == trainer.updates_applied == 1
    with pytest.warns(DeprecationWarning, match="algo.last_update"):  # the attribute of earlier versions
        assert trainer.last_metrics is m.metrics
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
def test_with_kl_coef_0_no_reference_model_is_built_and_every_forward_trains(make_trainer, engine, one_group):
    """The defaults (kl_coef=0, track_reference_kl=False, issue 49): no frozen copy of the weights, and an update of one
    optimizer step runs only its training forwards: no reference pass, and no π_old pass (π_old is the training
    forward's own log-probs, detached)."""
    trainer = make_trainer(learning_rate=1e-4)
    assert trainer.reference is None  # no second copy of the weights in memory
    assert trainer.config.kl_coef == 0 and not trainer.config.track_reference_kl
    batch = one_group(engine)  # sampled outside the count: the engine's decoding runs forwards without gradient
    with _forwards(engine) as calls:
        m = trainer.update(batch)
    assert m["optimizer_steps"] == 1 and m["grad_norm"] > 0
    assert calls["no_grad"] == 0 and calls["grad"] >= 1, calls
    assert math.isnan(m["kl"])  # not measured: NaN, not a 0 that reads as "no drift"
    # π_old was still recorded, from the training forward: the engine's sampling log-probs within float noise
    assert m["logprob_diff_max"] < 1e-4
    assert all(any(lp != 0.0 for lp in row["trainer_logprobs"]) for row in trainer.last_batch)


@pytest.mark.slow
def test_track_reference_kl_measures_kl_on_every_kl_every_th_update(make_trainer, engine, one_group):
    trainer = make_trainer(learning_rate=1e-4, track_reference_kl=True, kl_every=2)
    assert trainer.reference is not None  # the frozen copy of the initial weights
    rows, scoring = [], []
    for seed in range(3):
        batch = one_group(engine, seed=seed)
        with _forwards(engine) as calls:
            rows.append(trainer.update(batch))
        scoring.append(calls["no_grad"])
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert math.isnan(rows[0]["kl"]) and math.isnan(rows[2]["kl"])  # steps 1 and 3: not measured, no reference pass
    assert rows[1]["kl"] > 0  # step 2: the policy moved away from the reference at step 1
    assert scoring[0] == scoring[2] == 0 < scoring[1], scoring
    trainer.config.track_reference_kl = False  # it decides whether a copy is kept: set at construction
    with pytest.raises(ConfigError, match="track_reference_kl was True when this trainer was built"):
        trainer.check_config()
    trainer.config.track_reference_kl = True


def test_a_checkpoint_that_tracked_kl_loads_into_a_trainer_without_a_reference(make_trainer, caplog):
    """A checkpoint of a trainer that kept a reference (the default before issue 49) loads into one built with the
    new defaults: the reference is not rebuilt, and a warning says kl is no longer measured. One trained with a KL
    loss needs the reference: refused, naming the fix."""
    tracking = make_trainer(track_reference_kl=True, kl_every=1)
    with tracking.frozen():
        state = tracking.state_dict()
    assert state["reference"] is not None and state["config"]["track_reference_kl"]
    del state["config"]["kl_every"]  # as saved before kl_every existed
    plain = make_trainer()
    with caplog.at_level("WARNING"):
        plain.load_state_dict(state, source="old.pt")
    assert plain.reference is None and not plain.config.track_reference_kl and plain.config.kl_every == 4
    assert "old.pt" in caplog.text and "GRPOConfig(track_reference_kl=True)" in caplog.text
    plain.check_config()  # the next update runs
    state["config"]["kl_coef"] = 0.1
    with pytest.raises(ConfigError, match=r"kl\.pt was trained with kl_coef=0\.1.*track_reference_kl=True"):
        plain.load_state_dict(state, source="kl.pt")
    plain.load_state_dict(state, source="kl.pt", keep_config=True)  # this trainer's kl_coef=0: loads
    assert plain.config.kl_coef == 0


@pytest.mark.slow
def test_state_dict_round_trip_continues_the_same_update(make_trainer, engine, one_group, tmp_path):
    first, second = one_group(engine, n=2), one_group(engine, n=2, seed=1)  # a rewarded and an unrewarded one
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
    assert trainer.updates_applied == 0
    with pytest.warns(DeprecationWarning, match=r"algo\.last_update"):  # the record of updates is the algorithm's
        assert trainer.last_metrics == {} and trainer.last_config_changes == []
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


class _Minimal(Trainer):
    """The contract's base alone (no engine): what earlier versions' names do on any trainer."""

    def __init__(self):
        super().__init__(engine=None, config=None)

    def update(self, triplets, *, on_progress=None):
        self.updates_applied += 1
        return {}

    signal_groups = check_config = state_dict = load_state_dict = save_pretrained = None


def test_the_run_verbs_of_earlier_versions_name_their_replacement_and_step_is_renamed():
    from lightning_nb.errors import MovedAttributeError

    trainer = _Minimal()
    for verb, replacement in (("start", "algo.start()"), ("pause", "algo.pause()"), ("resume", "algo.resume()"),
                              ("wait", "algo.wait()"), ("save", "algo.save(path)"), ("load", "algo.load(path)")):
        with pytest.raises(MovedAttributeError, match=f"_Minimal.{verb} moved to the algorithm: use "
                                                       f"{replacement.replace('(', '[(]').replace(')', '[)]')}"):
            getattr(trainer, verb)
    with pytest.raises(AttributeError):  # MovedAttributeError is one: hasattr() and getattr(..., default) hold
        trainer.start(None)
    assert not hasattr(trainer, "pause") and getattr(trainer, "metrics_df", None) is None
    with pytest.raises(AttributeError, match="'_Minimal' object has no attribute 'nope'") as info:
        trainer.nope
    assert not isinstance(info.value, MovedAttributeError)
    trainer.update([])
    assert trainer.updates_applied == 1
    with pytest.warns(DeprecationWarning, match="trainer.step is renamed trainer.updates_applied"):
        assert trainer.step == 1
    with pytest.warns(DeprecationWarning, match="renamed trainer.updates_applied"):
        trainer.step = 5
    assert trainer.updates_applied == 5
