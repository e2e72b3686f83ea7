"""VerlTrainer: VerlConfig mapped onto verl's Hydra config and checked by verl, verl's actor update behind
the GRPOTrainer surface, checkpoints in verl's layout, and the end-to-end run with pause / inspect /
resume and save / load in a new process.

verl runs for real (its Hydra config, ``validate_config``, ``compute_grpo_outcome_advantage``, its FSDP
engine and ``ppo_loss`` in this process, see ``lightning_nb.trainers.verl.bridge``), on the real SmolLM2-135M.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_nb import GRPOConfig, InMemoryStore, LightningRL
from lightning_nb.engines.transformers import TransformersEngine
from lightning_nb.errors import ConfigError
from lightning_nb.trainers.grpo.trainer import response_logprobs
from lightning_nb.types import Triplet
from lightning_nb.trainers.verl.trainer import MAPPED_KEYS, VerlConfig, VerlTrainer

WORKER = Path(__file__).with_name("_resume_run.py")


# ----- VerlConfig -> verl's Hydra config ------------------------------------------------
def test_fields_become_verls_keys_in_the_config_verl_composes_and_checks():
    config = VerlConfig(learning_rate=3e-5, weight_decay=0.01, max_grad_norm=0.5, clip_ratio=0.2, clip_ratio_high=0.28,
                        kl_coef=0.01, kl_penalty="mse", ppo_epochs=2, mini_batch_size=4,
                        loss_agg_mode="seq-mean-token-sum-norm", max_response_len=64, norm_adv_by_std=False,
                        lr_scheduler="cosine", warmup_steps=2, total_steps=10,
                        overrides=["actor_rollout_ref.actor.entropy_coeff=0.001"])
    cfg = config.verl_config()
    actor = cfg.actor_rollout_ref.actor
    assert (actor.optim.lr, actor.optim.weight_decay, actor.grad_clip) == (3e-5, 0.01, 0.5)
    assert (actor.clip_ratio, actor.clip_ratio_low, actor.clip_ratio_high) == (0.2, 0.2, 0.28)
    assert (actor.use_kl_loss, actor.kl_loss_coef, actor.kl_loss_type) == (True, 0.01, "mse")
    assert (actor.ppo_epochs, actor.ppo_mini_batch_size) == (2, 4)
    assert (actor.loss_agg_mode, actor.loss_scale_factor) == ("seq-mean-token-sum-norm", 64)
    assert (actor.optim.lr_scheduler_type, actor.optim.lr_warmup_steps, actor.optim.total_training_steps) == (
        "cosine", 2, 10)
    assert actor.entropy_coeff == 0.001  # the override reached verl's actor section
    assert cfg.algorithm.adv_estimator == "grpo" and cfg.algorithm.norm_adv_by_std_in_grpo is False
    assert cfg.algorithm.use_kl_in_reward is False
    assert "clip_ratio_high: 0.28" in config.to_yaml() and "adv_estimator: grpo" in config.to_yaml(None)
    # the defaults differ from verl's (lr 1e-6, no KL loss here) the way GRPOConfig's do
    plain = VerlConfig().verl_config().actor_rollout_ref.actor
    assert (plain.optim.lr, plain.use_kl_loss, plain.loss_scale_factor) == (2e-5, False, None)
    assert VerlConfig().tis_cap is None and cfg.algorithm.rollout_correction.rollout_is is None  # float32: off
    # bfloat16: verl's token-level truncated IS at 2.0 (GRPOConfig's default), an explicit None kept
    tis = VerlConfig(dtype="bfloat16").verl_config().algorithm.rollout_correction
    assert (tis.rollout_is, tis.rollout_is_threshold) == ("token", 2.0)
    assert VerlConfig(dtype="bfloat16", tis_cap=None).tis_cap is None
    assert VerlConfig(tis_cap=3.0).verl_config().algorithm.rollout_correction.rollout_is_threshold == 3.0


@pytest.mark.parametrize("fields, name", [
    (dict(credit="reward_to_go"), "credit"), (dict(kl_mode="reward", kl_coef=0.1), "kl_mode"),
    (dict(overlong_filter=True), "overlong_filter"),
    (dict(overlong_buffer_len=4, max_response_len=16), "overlong_buffer_len"),
    (dict(skip_zero_advantage=True), "skip_zero_advantage"),
])
def test_grpo_trainer_only_options_are_refused_naming_the_field(fields, name):
    with pytest.raises(ConfigError, match=f"VerlConfig.{name}=.*not supported by VerlTrainer"):
        VerlConfig(**fields)


def test_overrides_must_be_hydra_strings_and_may_not_set_what_a_field_sets():
    with pytest.raises(ConfigError, match="VerlConfig.clip_ratio"):
        VerlConfig(overrides=["actor_rollout_ref.actor.clip_ratio=0.3"])
    with pytest.raises(ConfigError, match="VerlConfig.learning_rate"):
        VerlConfig(overrides=["+actor_rollout_ref.actor.optim.lr=1e-3"])
    with pytest.raises(ConfigError, match="'key=value'"):
        VerlConfig(overrides=["actor_rollout_ref.actor.entropy_coeff"])
    with pytest.raises(ConfigError, match="list of 'key=value'"):
        VerlConfig(overrides="actor_rollout_ref.actor.entropy_coeff=0.1")
    assert set(MAPPED_KEYS.values()) >= {"learning_rate", "clip_ratio", "kl_coef", "ppo_epochs", "mini_batch_size"}


def test_hydra_and_verls_own_checks_refuse_bad_overrides_with_a_config_error():
    with pytest.raises(ConfigError, match="Hydra config refused.*no_such_key"):
        VerlConfig(overrides=["actor_rollout_ref.actor.no_such_key=1"]).verl_config()
    with pytest.raises(ConfigError, match="verl's checks refused"):  # verl's validate_config: sampling at temperature 0
        VerlConfig(overrides=["actor_rollout_ref.rollout.val_kwargs.do_sample=true",
                              "actor_rollout_ref.rollout.temperature=0"]).verl_config()


def test_the_one_gpu_lora_preset_is_verls_0_5b_lora_example():
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="device"):
            VerlConfig.one_gpu_lora()
    config = VerlConfig.one_gpu_lora(device="cpu", dtype="float32")
    assert (config.lora_rank, config.lora_alpha, config.lora_target_modules) == (32, 32.0, "all-linear")
    assert (config.learning_rate, config.kl_coef, config.kl_penalty, config.gradient_checkpointing) == (
        3e-5, 0.001, "low_var_kl", True)
    actor = config.verl_config().actor_rollout_ref.actor
    assert (actor.entropy_coeff, actor.kl_loss_coef, actor.use_kl_loss) == (0.001, 0.001, True)
    assert VerlConfig.one_gpu_lora(device="cpu", dtype="float32", learning_rate=1e-5).learning_rate == 1e-5


def test_without_verl_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "verl", None)  # what an environment without verl gives `import verl`
    with pytest.raises(ImportError, match=r"lightning-nb\[verl\]"):
        VerlConfig().verl_config()


def test_a_grpo_config_is_refused(engine):
    with pytest.raises(ConfigError, match="VerlTrainer takes a VerlConfig"):
        VerlTrainer(engine, GRPOConfig())


# ----- the update ------------------------------------------------------------------------
def _seq_logprob(model, t: Triplet) -> float:
    ids_B_T = torch.tensor([t.prompt_ids + t.response_ids])
    mask_B_L = torch.tensor([[0.0] * (len(t.prompt_ids) - 1) + [1.0] * len(t.response_ids)])
    with torch.no_grad():
        return float(response_logprobs(model, ids_B_T, torch.ones_like(ids_B_T), mask_B_L,
                                       torch.tensor([1.0])).sum())


@pytest.mark.slow
def test_an_update_is_verls_ppo_step_on_our_batch_and_the_engine_serves_it(engine, pristine, one_group):
    triplets = one_group(engine)
    before = [_seq_logprob(engine.model, t) for t in triplets]
    trainer = VerlTrainer(engine, VerlConfig(learning_rate=2e-5, mini_batch_size=3, ppo_epochs=2,
                                             track_reference_kl=True, kl_every=1))
    version = engine.weight_version
    m = trainer.update(triplets)
    # 4 rows in mini-batches of 3 and 1 (verl's make_iterator would refuse 4 % 3), two epochs
    assert m["trainer"] == "verl" and m["optimizer_steps"] == 4 and m["sequences_trained"] == 4
    assert m["episodes"] == 4 and m["groups_with_signal"] == 1 and m["reward_mean"] == 0.25
    assert m["kl"] == 0.0  # π_old and the reference are the same weights before the first step
    assert m["logprob_diff_max"] < 1e-4  # verl's recomputed log-probs = the engine's sampling log-probs
    assert math.isnan(m["tis_weight_mean"])  # float32: no rollout correction by default
    assert m["grad_norm"] > 0 and m["actor/pg_loss"] == m["pg_loss"] and 0 <= m["actor/pg_clipfrac"] <= 1
    assert engine.weight_version == version + 1
    after = [_seq_logprob(engine.model, t) for t in triplets]
    assert after[0] > before[0] and all(a < b for a, b in zip(after[1:], before[1:]))
    # the optimizer's-eye view: one row per DataProto row, token-aligned like GRPOTrainer's
    df = trainer.last_batch_df()
    assert len(df) == 4 and set(df["rollout_id"]) == {"r0", "r1", "r2", "r3"}
    row = trainer.last_batch[0]
    t0 = triplets[0]
    assert row["input_ids"] == t0.prompt_ids + t0.response_ids
    assert row["response_mask"] == [0] * len(t0.prompt_ids) + [1] * len(t0.response_ids)
    assert row["advantage"] == pytest.approx(1.5, abs=1e-4)  # (1 - 0.25) / std([1, 0, 0, 0]) = 0.75 / 0.5
    assert max(abs(a - b) for a, b in zip(row["engine_logprobs"], row["trainer_logprobs"])) < 1e-4
    assert trainer.last_advantages["r1"] == pytest.approx(-0.5, abs=1e-4)

    # an edit made between updates reaches verl's loss (its actor config is rebuilt) and is recorded
    trainer.config.clip_ratio = 0.1
    m2 = trainer.update(one_group(engine, seed=1))
    assert "clip_ratio" in m2["config_changes"]
    assert (trainer.actor.actor_config.clip_ratio_low, trainer.actor.actor_config.clip_ratio_high) == (0.1, 0.1)
    assert m2["kl"] > 0  # the policy has moved away from the reference
    # one verl refuses is an error naming it, before any weight moves
    weights = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
    trainer.config.overrides = ["actor_rollout_ref.actor.no_such_key=1"]
    batch = one_group(engine, seed=2)
    for _ in range(2):  # refused again: the edit was not taken as applied
        with pytest.raises(ConfigError, match="no_such_key"):
            trainer.update(batch)
    assert all(torch.equal(weights[k], v) for k, v in engine.model.state_dict().items()) and trainer.updates_applied == 2


@pytest.mark.slow
def test_one_step_takes_pi_old_from_its_own_forward_and_the_step_of_a_separate_pass(engine, pristine, one_group):
    """With one optimizer step, π_old is the update's training forward, detached (no compute_log_prob pass before it,
    issue 49): the same loss, gradient norm and new weights as verl's separate π_old pass
    (``compute_log_prob``, then ``update_policy``) from the same start, and π_old recorded as that pass scores it."""
    from lightning_nb.trainers.verl.bridge import grpo_advantages, triplets_to_dataproto

    triplets = one_group(engine)
    start = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
    scored = [_seq_logprob(engine.model, t) for t in triplets]
    trainer = VerlTrainer(engine, VerlConfig(learning_rate=1e-4))
    m = trainer.update(triplets)
    stepped = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
    assert [sum(row["trainer_logprobs"]) for row in trainer.last_batch] == pytest.approx(scored, abs=1e-4)

    with engine.lock, torch.no_grad():
        engine.model.load_state_dict(start)
    separate = VerlTrainer(engine, VerlConfig(learning_rate=1e-4))
    data = triplets_to_dataproto(triplets, pad_token_id=engine.pad_token_id, device=separate.actor.device)
    budget = separate.config.max_token_len(int(data.batch["attention_mask"].sum(-1).max()), engine.model)
    data = data.union(separate.actor.compute_log_prob(data, max_token_len=budget))  # verl's _compute_old_log_prob
    data.batch["advantages"] = grpo_advantages(data)
    verl = separate.actor.update_policy(data, max_token_len=budget)
    assert m["loss"] == pytest.approx(verl["loss"], abs=1e-7)
    assert m["pg_loss"] == pytest.approx(verl["actor/pg_loss"], abs=1e-7)
    assert m["grad_norm"] == pytest.approx(verl["grad_norm"], rel=1e-5) and m["grad_norm"] > 0
    for k, v in engine.model.state_dict().items():  # one AdamW step of ~1e-4 per weight; equal to 1e-8
        torch.testing.assert_close(stepped[k], v, rtol=0, atol=1e-8)
    assert any(not torch.equal(stepped[k], start[k]) for k in start)


@pytest.mark.slow
def test_tis_cap_weights_each_tokens_loss_by_verls_truncated_is_ratio(engine, pristine, one_group):
    """The engine's log-probs moved by -1 nat on even tokens (ratio e ≈ 2.72, capped to 2) and +0.5 on odd ones
    (ratio e^-0.5 ≈ 0.61): verl's weights are those, and its first-step policy loss (ratio π/π_old = 1) is
    -Σ A·w over the response tokens / their number (token-mean), not the uncorrected -Σ A / N."""
    triplets = one_group(engine)
    shifted = [t.model_copy(update={"logprobs": [lp - 1.0 if k % 2 == 0 else lp + 0.5 for k, lp in enumerate(t.logprobs)]})
               for t in triplets]
    trainer = VerlTrainer(engine, VerlConfig(learning_rate=1e-6, tis_cap=2.0))
    m = trainer.update(shifted)
    weights = [[2.0 if k % 2 == 0 else math.exp(-0.5) for k in range(len(t.response_ids))] for t in shifted]
    n = sum(len(w) for w in weights)
    assert m["tis_weight_mean"] == pytest.approx(sum(map(sum, weights)) / n, abs=1e-3)
    adv = [row["advantage"] for row in trainer.last_batch]
    expected = -sum(a * sum(w) for a, w in zip(adv, weights)) / n
    uncorrected = -sum(a * len(w) for a, w in zip(adv, weights)) / n
    assert m["pg_loss"] == pytest.approx(expected, abs=1e-4) and abs(expected - uncorrected) > 0.01
    assert 0.5 < m["logprob_diff_max"] < 1.01 and any(k.startswith("rollout_corr/") for k in m)


@pytest.mark.slow
def test_lora_trains_only_the_adapters_with_the_base_model_as_the_reference(one_group):
    engine = TransformersEngine.from_default(max_batch_size=4)
    try:
        base = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
        trainer = VerlTrainer(engine, VerlConfig(lora_rank=8, lora_alpha=16.0, learning_rate=2e-4, kl_coef=0.01))
        assert trainer.reference is None and trainer.reference_actor is None  # no copy: adapters disabled instead
        m1 = trainer.update(one_group(engine))
        assert m1["kl"] == 0.0 and "kl_loss" in m1  # verl's KL loss term ran
        m2 = trainer.update(one_group(engine, seed=1))
        assert m2["kl"] > 0
        state = engine.model.state_dict()
        lora = [k for k in state if "lora_" in k]
        assert lora and any(not torch.equal(state[k], torch.zeros_like(state[k])) for k in lora if "lora_B" in k)
        frozen = [k for k in state if "lora_" not in k]
        renamed = {k.replace("base_layer.", ""): k for k in frozen}
        assert all(torch.equal(base[k], state[renamed[k]]) for k in base)  # the base weights did not move
    finally:
        engine.stop()


# ----- checkpoints ------------------------------------------------------------------------
@pytest.mark.slow
def test_checkpoints_use_verls_layout_and_resume_modes(engine, pristine, tmp_path, one_group):
    trainer = VerlTrainer(engine, VerlConfig(learning_rate=2e-5, track_reference_kl=False))
    algo = LightningRL(InMemoryStore(), trainer, [{"id": "t"}])
    trainer.update(one_group(engine))
    trained = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
    folder = algo.save(tmp_path / "ckpt")
    assert folder == tmp_path / "ckpt" / "global_step_1" and (folder / "trainer.pt").is_file()
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "1"
    with pytest.raises(ConfigError, match="takes a folder"):
        algo.save(tmp_path / "x.pt")

    with engine.lock, torch.no_grad():
        engine.model.load_state_dict(engine.initial_state)
    fresh = VerlTrainer(engine, VerlConfig(learning_rate=2e-5, track_reference_kl=False))
    fresh_algo = LightningRL(InMemoryStore(), fresh, [{"id": "t"}])
    fresh_algo.load(tmp_path / "ckpt", resume_mode="disable")
    assert fresh.step == 0
    fresh_algo.load(tmp_path / "ckpt")  # auto: the latest step
    assert fresh.step == 1 and all(torch.equal(trained[k], v) for k, v in engine.model.state_dict().items())
    fresh_algo.load(folder, resume_mode="resume_path")
    assert fresh.step == 1
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        fresh_algo.load(tmp_path / "empty")
    with pytest.raises(ConfigError, match="resume_mode"):
        fresh_algo.load(tmp_path / "ckpt", resume_mode="latest")
    shutil.rmtree(tmp_path / "ckpt")  # 1.6 GB; pytest keeps the temp folders of its last runs


# ----- end to end -------------------------------------------------------------------------
def _run(tmp_path: Path, name: str, *args: str) -> dict:
    out = tmp_path / f"{name}.json"
    proc = subprocess.run([sys.executable, str(WORKER), str(out), *args], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_a_step_paused_in_the_background_equals_that_step_resumed_in_a_new_process(tmp_path):
    ckpt = tmp_path / "checkpoints"
    first = _run(tmp_path, "first", "--trainer", "verl", "--steps", "2", "--save-at", "1", "--checkpoint", str(ckpt),
                 "--background-pause")
    print(f"VerlTrainer end to end on CPU: {first['seconds']:.0f} s in all; step 2 in the background with a pause "
          f"{first['step_seconds'][0]:.0f} s; pause {first['pauses']}; rows {first['rows']}")
    assert [r["step"] for r in first["rows"]] == [1, 2] and {r["trainer"] for r in first["rows"]} == {"verl"}
    assert first["rows"][1]["grad_norm"], "step 2 had no policy gradient: comparing it would not test the update"
    (pause,) = first["pauses"]
    assert pause["parked"] and pause["step"] == 1 and pause["metrics_rows"] == 1 and pause["at"]
    assert pause["batch_rows"] > 0 and "advantage" in pause["batch_columns"] and pause["chat"]
    assert (ckpt / "global_step_1" / "trainer.pt").is_file()

    resumed = _run(tmp_path, "resumed", "--trainer", "verl", "--steps", "2", "--load", str(ckpt))
    print(f"resumed in a new process: {resumed['seconds']:.0f} s; rows {resumed['rows']}")
    # step 2 in the new process is step 2 of the first run, which a pause interrupted in the background, bit for
    # bit on CPU: the same tasks, the same completions (RNG states), the same verl update (weights + AdamW state)
    assert resumed["rows"] == first["rows"][1:]
    assert resumed["weights"] == first["weights"] and resumed["weight_version"] == first["weight_version"]
    shutil.rmtree(ckpt)  # 1.6 GB; pytest keeps the temp folders of its last runs
