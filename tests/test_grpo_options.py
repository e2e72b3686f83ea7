"""The RL-step options of GRPOConfig on the real SmolLM2-135M: PPO epochs and mini-batches, the LR schedule,
KL as a reward penalty, clip-higher, overlong filtering and penalty, Dr. GRPO aggregation, TIS, turn forks,
and the optimizer's-eye view ``last_batch``.

Triplets are built by hand from real samples of the model. Every test that trains restores the session
engine's weights afterwards (``pristine``).
"""

from __future__ import annotations

import math

import pytest
import torch

from lightning_nb import GRPOConfig, GRPOTrainer, InMemoryStore, LightningRL, semconv
from lightning_nb.errors import ConfigError
from lightning_nb.trainers.config import lr_factor
from lightning_nb.credit import group_advantages, overlong_penalty
from lightning_nb.trainers.grpo.trainer import pack_episode, response_logprobs
from lightning_nb.types import Triplet

pytestmark = pytest.mark.slow

QUESTION = "What is 17 + 25? Answer with a number."
# float32 log-probs of one sequence, recomputed in a padded batch and alone, differ by kernel summation order:
# up to 1.8e-5 nats measured on an AVX-512 CPU (below 1e-5 on others). Log-probs read at the wrong time differ by
# far more: one optimizer step at the default learning rate (2e-5) moved these completions' by up to 1.9-2.9 nats.
LOGPROB_ATOL = 1e-4


def _weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same(a, b):
    return all(torch.equal(a[k], b[k]) for k in a)


def _triplet(gen, rollout_id, group, reward, *, shift=0.0, logprobs=True, turn=0, **kw) -> Triplet:
    """A triplet of a real generation; ``shift`` is subtracted from each engine log-prob (ratio r → r·e^shift)."""
    return Triplet(rollout_id=rollout_id, attempt_id=f"at-{rollout_id}", group_id=group, turn=turn,
                   prompt_ids=gen.prompt_ids, response_ids=gen.completion_ids,
                   logprobs=[lp - shift for lp in gen.logprobs] if logprobs else None,
                   reward=reward, temperature=gen.temperature, finish_reason=gen.finish_reason, **kw)


def _generations(engine, n, *, max_tokens=12, finish=None, question=QUESTION, seed=0):
    """``n`` distinct completions (with ``finish`` as finish_reason, if given), sampled at temperature 1."""
    prompt = engine.apply_chat_template([{"role": "user", "content": question}])
    torch.manual_seed(seed)
    seen, out = set(), []
    for _ in range(80):
        g = engine.generate(prompt, temperature=1.0, max_tokens=max_tokens)
        if tuple(g.completion_ids) not in seen and (finish is None or g.finish_reason == finish):
            seen.add(tuple(g.completion_ids))
            out.append(g)
        if len(out) == n:
            return out
    raise AssertionError(f"could not sample {n} distinct completions with finish_reason={finish}")


def _logprobs(model, gen):
    """Per-token log-probs of ``gen``'s completion under ``model`` (at its sampling temperature)."""
    ids_B_T = torch.tensor([gen.prompt_ids + gen.completion_ids])
    P = len(gen.prompt_ids)
    mask_B_L = torch.tensor([[0.0] * (P - 1) + [1.0] * len(gen.completion_ids)])
    with torch.no_grad():
        logp = response_logprobs(model, ids_B_T, torch.ones_like(ids_B_T), mask_B_L, torch.tensor([gen.temperature]))
    return logp[0, P - 1:]


def _update(engine, start, batch, **config):
    """A fresh trainer's first update on ``batch`` from the weights ``start``; returns (trainer, metrics)."""
    with torch.no_grad():
        engine.model.load_state_dict(start)
    trainer = GRPOTrainer(engine, GRPOConfig(**{"track_reference_kl": False, **config}))
    return trainer, trainer.update(batch)


# ----- config ---------------------------------------------------------------------------
@pytest.mark.parametrize("fields, name", [
    (dict(ppo_epochs=0), "ppo_epochs"), (dict(mini_batch_size=0), "mini_batch_size"),
    (dict(lr_scheduler="step"), "lr_scheduler"), (dict(warmup_steps=-1), "warmup_steps"),
    (dict(lr_scheduler="cosine"), "total_steps"), (dict(total_steps=3, warmup_steps=3), "total_steps"),
    (dict(kl_mode="advantage"), "kl_mode"), (dict(clip_ratio_low=1.0), "clip_ratio_low"),
    (dict(clip_ratio_high=0.0), "clip_ratio_high"), (dict(overlong_buffer_len=4), "max_response_len"),
    (dict(overlong_buffer_len=16, max_response_len=16), "overlong_buffer_len"),
    (dict(overlong_penalty_factor=-1.0), "overlong_penalty_factor"), (dict(tis_cap=0.5), "tis_cap"),
    (dict(fail_on_fork=True, pack_turns=False), "fail_on_fork"),
    (dict(loss_agg_mode="seq-mean-token-sum-norm"), "max_response_len"),
    (dict(micro_batch_size=0), "micro_batch_size"), (dict(micro_batch_tokens=0), "micro_batch_tokens"),
    (dict(micro_batch_tokens="max"), "micro_batch_tokens"),
    (dict(kl_every=0, track_reference_kl=True), "kl_every"), (dict(kl_every=2), "kl_every"),
])
def test_each_option_is_validated_with_the_field_its_range_and_a_fix(fields, name):
    with pytest.raises(ConfigError, match=rf"GRPOConfig\.{name}=.* must be .*; \w+"):
        GRPOConfig(**fields)


def test_lr_factor_and_overlong_penalty_follow_their_formulas():
    cos = GRPOConfig(lr_scheduler="cosine", warmup_steps=2, total_steps=6)
    want = [1 / 2, 2 / 2] + [(1 + math.cos(math.pi * k / 4)) / 2 for k in range(4)] + [0.0, 0.0]
    assert [lr_factor(s, cos) for s in range(8)] == pytest.approx(want, rel=1e-12, abs=1e-15)
    lin = GRPOConfig(lr_scheduler="linear", total_steps=4)
    assert [lr_factor(s, lin) for s in range(5)] == [1.0, 0.75, 0.5, 0.25, 0.0]
    assert [lr_factor(s, GRPOConfig(warmup_steps=4)) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    # DAPO eq. 13 with L_max = 20, L_cache = 5: no penalty up to 15 tokens, linear to -1 at 20, -1 beyond
    assert overlong_penalty(15, 20, 5) == 0.0
    assert overlong_penalty(18, 20, 5) == (15 - 18) / 5
    assert overlong_penalty(20, 20, 5) == -1.0 and overlong_penalty(23, 20, 5) == -1.0
    assert overlong_penalty(18, 20, 5, factor=0.5) == 0.5 * (15 - 18) / 5
    assert overlong_penalty(30, 20, 0) == 0.0  # no buffer: off


# ----- PPO epochs and mini-batches --------------------------------------------------------
def test_ppo_epochs_clip_against_the_policy_fixed_at_the_start_of_the_update(engine, pristine):
    good, bad = _generations(engine, 2)
    before = {"good": _logprobs(engine.model, good), "bad": _logprobs(engine.model, bad)}
    # no engine log-probs: pi_old must be the trainer's own before the first step, not re-read each epoch
    batch = [_triplet(good, "good", "g", 1.0, logprobs=False), _triplet(bad, "bad", "g", 0.0, logprobs=False)]
    start = _weights(engine.model)
    _, one = _update(engine, start, batch, learning_rate=1e-3)
    assert one["optimizer_steps"] == 1 and one["pg_clipfrac"] == 0.0 and one["ppo_kl"] == 0.0
    trainer, two = _update(engine, start, batch, learning_rate=1e-3, ppo_epochs=2)
    assert two["optimizer_steps"] == 2
    # the second epoch sees the ratio to the start-of-update policy, moved by the first step: the clip acts
    assert two["pg_clipfrac"] > 0.05, two
    assert abs(two["ppo_kl"]) > 1e-3, two
    # the optimizer's-eye view holds the log-probs from before any step
    for row in trainer.last_batch:
        P = len(row["input_ids"]) - len(before[row["rollout_id"]])
        got = torch.tensor(row["trainer_logprobs"][P:])
        assert float((got - before[row["rollout_id"]]).abs().max()) < LOGPROB_ATOL


def test_mini_batches_step_once_each_with_the_mini_batch_as_loss_denominator(engine, pristine):
    a, b, c, d = _generations(engine, 4)
    signal = [_triplet(a, "a", "signal", 1.0), _triplet(b, "b", "signal", 0.0)]
    flat = [_triplet(c, "c", "flat", 1.0), _triplet(d, "d", "flat", 1.0)]
    n_signal = len(a.completion_ids) + len(b.completion_ids)
    n_flat = len(c.completion_ids) + len(d.completion_ids)
    start = _weights(engine.model)
    # two mini-batches of 2: the signal group alone, then the flat group (nothing to forward: no step)
    _, mini = _update(engine, start, signal + flat, mini_batch_size=2, micro_batch_size=1)
    _, alone = _update(engine, start, signal, micro_batch_size=2)
    _, whole = _update(engine, start, signal + flat, micro_batch_size=1)
    assert mini["optimizer_steps"] == 1 and alone["optimizer_steps"] == 1 and whole["optimizer_steps"] == 1
    # accumulated over micro-batches of 1 and divided by the mini-batch's tokens: the signal group's own step
    assert mini["grad_norm"] == pytest.approx(alone["grad_norm"], rel=1e-5)
    assert mini["loss"] == pytest.approx(alone["loss"], rel=1e-5)
    # one step over the whole batch divides by all four sequences' tokens
    assert whole["grad_norm"] == pytest.approx(alone["grad_norm"] * n_signal / (n_signal + n_flat), rel=1e-5)
    _, four = _update(engine, start, signal + signal[::-1], mini_batch_size=2, micro_batch_size=2)
    assert four["optimizer_steps"] == 2


# ----- clip-higher --------------------------------------------------------------------------
def test_clip_higher_separates_the_upper_and_lower_clip(engine, pristine):
    good, bad = _generations(engine, 2)
    n_good, n_bad = len(good.completion_ids), len(bad.completion_ids)
    start = _weights(engine.model)

    def clipfrac(up, down, **clip):
        # engine log-probs shifted so that the ratio is `up` on the positive-advantage tokens, `down` on the others
        batch = [_triplet(good, "good", "g", 1.0, shift=math.log(up)),
                 _triplet(bad, "bad", "g", 0.0, shift=math.log(down))]
        return _update(engine, start, batch, **clip)[1]["pg_clipfrac"]

    share_good, share_bad = n_good / (n_good + n_bad), n_bad / (n_good + n_bad)
    assert clipfrac(1.25, 0.75) == pytest.approx(1.0, rel=1e-6)  # symmetric 0.2: both sides clipped
    # clip-higher: 1.25 stays under 1 + 0.28, so positive tokens keep their gradient; 0.75 < 1 - 0.2 is clipped
    assert clipfrac(1.25, 0.75, clip_ratio_high=0.28) == pytest.approx(share_bad, rel=1e-6)
    assert clipfrac(1.35, 0.75, clip_ratio_high=0.28) == pytest.approx(1.0, rel=1e-6)  # above 1 + 0.28: clipped
    assert clipfrac(1.35, 0.75, clip_ratio_low=0.3, clip_ratio_high=0.28) == pytest.approx(share_good, rel=1e-6)
    assert clipfrac(1.25, 0.75, clip_ratio_low=0.3, clip_ratio_high=0.28) == 0.0


# ----- DAPO overlong handling ---------------------------------------------------------------
def test_overlong_filter_drops_the_gradient_of_truncated_responses(engine, pristine):
    cut = _generations(engine, 2, max_tokens=6, finish="length")
    (done,) = _generations(engine, 1, max_tokens=40, finish="stop")
    truncated_only = [_triplet(cut[0], "c0", "g", 1.0), _triplet(cut[1], "c1", "g", 0.0)]
    start = _weights(engine.model)
    version = engine.weight_version
    trainer, m = _update(engine, start, truncated_only, overlong_filter=True)
    assert _same(start, _weights(engine.model)) and engine.weight_version == version
    assert m["optimizer_steps"] == 0 and m["sequences_trained"] == 0 and m["truncated_responses"] == 2
    assert all(sum(row["response_mask"]) == 0 and row["trainer_logprobs"] is None for row in trainer.last_batch)
    _, m = _update(engine, start, truncated_only)  # without the filter the same batch trains
    assert m["optimizer_steps"] == 1 and not _same(start, _weights(engine.model))
    # mixed with a finished response: the truncated one keeps its place in the group statistics
    trainer, m = _update(engine, start, [_triplet(cut[0], "c0", "g", 1.0), _triplet(done, "ok", "g", 0.0)],
                         overlong_filter=True)
    assert m["sequences_trained"] == 1 and m["tokens_trained"] == len(done.completion_ids)
    assert trainer.last_advantages["c0"] == pytest.approx(1 / math.sqrt(2), rel=1e-5)


def test_soft_overlong_penalty_shapes_the_reward_before_group_normalization(engine, pristine):
    short, long_ = _generations(engine, 2, max_tokens=40, finish="stop")
    if len(short.completion_ids) > len(long_.completion_ids):
        short, long_ = long_, short
    assert len(short.completion_ids) < len(long_.completion_ids)
    L, buffer = len(long_.completion_ids), len(long_.completion_ids) - len(short.completion_ids) + 1
    batch = [_triplet(short, "short", "g", 1.0), _triplet(long_, "long", "g", 1.0)]  # equal rewards: no signal
    start = _weights(engine.model)
    config = dict(max_response_len=L, overlong_buffer_len=buffer, overlong_penalty_factor=0.5, norm_adv_by_std=False)
    trainer, m = _update(engine, start, batch, **config)
    shaped = {"short": 1.0 + overlong_penalty(len(short.completion_ids), L, buffer, 0.5),
              "long": 1.0 + overlong_penalty(L, L, buffer, 0.5)}
    assert shaped["short"] - shaped["long"] == pytest.approx(0.5 * (buffer - 1) / buffer, rel=1e-12)
    want, _ = group_advantages(shaped, {"short": "g", "long": "g"}, norm_by_std=False)
    assert trainer.last_advantages == want and want["short"] > 0 > want["long"]
    assert m["reward_mean"] == 1.0 and m["groups_with_signal"] == 1
    assert trainer.signal_groups(batch) == {"g"}


# ----- LR schedule ------------------------------------------------------------------------
def test_lr_schedule_warms_up_then_follows_the_cosine_and_resumes_from_a_checkpoint(engine, pristine, tmp_path):
    good, bad = _generations(engine, 2)
    batch = [_triplet(good, "good", "g", 1.0), _triplet(bad, "bad", "g", 0.0)]
    config = dict(learning_rate=1e-5, lr_scheduler="cosine", warmup_steps=2, total_steps=5)
    trainer = GRPOTrainer(engine, GRPOConfig(track_reference_kl=False, **config))
    first, second = trainer.update(batch), trainer.update(batch)
    # saved after two updates, inside the run whose schedule is checked (one run, not a second to compare)
    path = LightningRL(InMemoryStore(), trainer, [{"id": "t"}]).save(tmp_path / "ckpt.pt")
    lrs = [first["lr"], second["lr"]] + [trainer.update(batch)["lr"] for _ in range(3)]
    want = [1e-5 * (s + 1) / 2 for s in range(2)] + [1e-5 * (1 + math.cos(math.pi * k / 3)) / 2 for k in range(3)]
    assert lrs == pytest.approx(want, rel=1e-12)
    end = _weights(engine.model)
    # a new trainer that loads the checkpoint continues the same schedule, to the same weights
    resumed = GRPOTrainer(engine, GRPOConfig(track_reference_kl=False, **config))
    LightningRL(InMemoryStore(), resumed, [{"id": "t"}]).load(path)
    path.unlink()
    assert resumed.updates_applied == 2
    assert [resumed.update(batch)["lr"] for _ in range(3)] == lrs[2:]
    assert _same(end, _weights(engine.model))
    # an edit of learning_rate while paused rescales the rest of the schedule: the factor of update 5 is 0
    resumed.config.total_steps = 7
    resumed.config.learning_rate = 4e-5
    assert resumed.update(batch)["lr"] == pytest.approx(4e-5 * (1 + math.cos(math.pi * 3 / 5)) / 2, rel=1e-12)


# ----- KL to the reference as a reward penalty ------------------------------------------------
def test_kl_reward_mode_subtracts_the_episode_kl_from_the_reward(engine, pristine):
    good, bad = _generations(engine, 2)
    batch = [_triplet(good, "good", "g", 1.0), _triplet(bad, "bad", "g", 0.0)]
    trainer = GRPOTrainer(engine, GRPOConfig(learning_rate=1e-4, kl_coef=0.5, kl_mode="reward", kl_penalty="kl",
                                             norm_adv_by_std=False))
    trainer.update(batch)  # the weights still equal the reference: KL 0 (to float32 noise), plain advantages
    assert trainer.last_advantages == pytest.approx({"good": 0.5, "bad": -0.5}, abs=LOGPROB_ATOL)
    kl = {name: float((_logprobs(trainer.model, g) - _logprobs(trainer.reference, g)).sum())
          for name, g in (("good", good), ("bad", bad))}
    assert abs(kl["good"] - kl["bad"]) > 0.05, kl  # the first step moved the policy away from the reference
    trainer.update(batch)
    # R_i = r_i - kl_coef * sum_t (log pi - log pi_ref); A_i = R_i - mean(R)
    shift = 0.5 * (kl["good"] - kl["bad"]) / 2
    assert trainer.last_advantages["good"] == pytest.approx(0.5 - shift, abs=1e-5)
    assert trainer.last_advantages["bad"] == pytest.approx(-0.5 + shift, abs=1e-5)


# ----- truncated importance sampling ---------------------------------------------------------------
def test_tis_weights_tokens_by_the_capped_trainer_to_engine_ratio(engine, pristine):
    good, bad = _generations(engine, 2)
    n_good, n_bad = len(good.completion_ids), len(bad.completion_ids)
    start = _weights(engine.model)

    def run(ratio, **config):  # the engine's log-probs are log(ratio) below the trainer's on every token
        return _update(engine, start, [_triplet(good, "good", "g", 1.0, shift=math.log(ratio)),
                                       _triplet(bad, "bad", "g", 0.0, shift=math.log(ratio))], **config)

    trainer, m = run(5.0, tis_cap=2.0)
    assert m["tis_weight_mean"] == pytest.approx(2.0, rel=1e-6)  # 5 capped at 2
    # PPO against the trainer's own start-of-update log-probs (ratio 1), each token weighted by 2
    a = 1 / math.sqrt(2)
    assert m["pg_loss"] == pytest.approx(-2.0 * a * (n_good - n_bad) / (n_good + n_bad), rel=1e-5, abs=1e-7)
    assert m["pg_clipfrac"] == 0.0
    row = trainer.last_batch[0]
    diffs = [t - e for t, e, k in zip(row["trainer_logprobs"], row["engine_logprobs"], row["response_mask"]) if k]
    assert max(abs(d - math.log(5.0)) for d in diffs) < 1e-4
    _, m = run(1.5, tis_cap=2.0)
    assert m["tis_weight_mean"] == pytest.approx(1.5, rel=1e-4)  # under the cap: the ratio itself
    _, m = run(5.0)
    # off: PPO against the engine's log-probs, ratio 5: the positive-advantage tokens are clipped
    assert math.isnan(m["tis_weight_mean"]) and m["pg_clipfrac"] == pytest.approx(n_good / (n_good + n_bad), rel=1e-6)


# ----- Dr. GRPO aggregation --------------------------------------------------------------------
def test_seq_mean_token_sum_norm_divides_by_the_constant_max_response_len(engine, pristine):
    good, bad = _generations(engine, 2)
    n_good, n_bad = len(good.completion_ids), len(bad.completion_ids)
    batch = [_triplet(good, "good", "g", 1.0, logprobs=False), _triplet(bad, "bad", "g", 0.0, logprobs=False)]
    start = _weights(engine.model)
    _, m = _update(engine, start, batch, loss_agg_mode="seq-mean-token-sum-norm", max_response_len=32,
                   norm_adv_by_std=False)
    # ratio 1 (no engine log-probs): L = (1/G) sum_i sum_t (-A_i) / L_max with A = +-0.5
    assert m["pg_loss"] == pytest.approx(-(0.5 * n_good - 0.5 * n_bad) / (2 * 32), rel=1e-5, abs=1e-8)


# ----- turn forks -------------------------------------------------------------------------------
def test_turn_forks_count_turns_that_do_not_extend_the_previous_tokens(engine, pristine):
    (first,) = _generations(engine, 1)
    follow = engine.apply_chat_template([{"role": "user", "content": QUESTION},
                                         {"role": "assistant", "content": first.text},
                                         {"role": "user", "content": "Are you sure?"}])
    torch.manual_seed(1)
    ids0 = first.prompt_ids + first.completion_ids
    extend = ids0 + follow[len(ids0):] if follow[:len(ids0)] == ids0 else ids0 + [engine.tokenizer.eos_token_id]
    second = engine.generate(extend, temperature=1.0, max_tokens=8)
    edited = list(second.prompt_ids + second.completion_ids)
    m_at = len(first.prompt_ids) + 2  # the agent rewrote one token of the history of turn 2
    edited[m_at] = (edited[m_at] + 1) % engine.tokenizer.vocab_size
    third = engine.generate(edited, temperature=1.0, max_tokens=8)

    def episode(rollout_id, reward, fork):
        gens = [first, second, third if fork else engine.generate(second.prompt_ids + second.completion_ids,
                                                                  temperature=1.0, max_tokens=8)]
        return [_triplet(g, rollout_id, "g", reward, turn=k) for k, g in enumerate(gens)]

    batch = episode("forked", 1.0, True) + episode("clean", 0.0, False)
    seqs = pack_episode(batch[:3], 0.0)
    assert len(seqs) == 2 and seqs[1].fork_at == m_at and seqs[1].turn == 2
    start = _weights(engine.model)
    trainer, m = _update(engine, start, batch)
    assert m["turn_forks"] == 1 and len(trainer.last_batch) == 3
    version = engine.weight_version
    with torch.no_grad():
        engine.model.load_state_dict(start)
    strict = GRPOTrainer(engine, GRPOConfig(track_reference_kl=False, fail_on_fork=True))
    with pytest.raises(ConfigError, match=rf"rollout 'forked': the prompt of turn 2 .* position {m_at}"):
        strict.update(batch)
    assert strict.step == 0 and engine.weight_version == version and _same(start, _weights(engine.model))


def test_a_turn_at_another_temperature_starts_its_own_sequence_without_a_fork():
    """A packed sequence is scored at one temperature, so a turn sampled at another one is not appended."""
    def turn(k, prompt, response, temperature):
        return Triplet(rollout_id="r", attempt_id="a", group_id="g", turn=k, prompt_ids=prompt, response_ids=response,
                       logprobs=[-0.5] * len(response), reward=1.0, temperature=temperature)

    first = turn(0, [1, 2, 3], [4, 5], 0.7)
    same = pack_episode([first, turn(1, [1, 2, 3, 4, 5, 9], [6], 0.7)], 1.0)
    assert len(same) == 1 and same[0].input_ids == [1, 2, 3, 4, 5, 9, 6] and same[0].mask == [0, 0, 0, 1, 1, 0, 1]
    split = pack_episode([first, turn(1, [1, 2, 3, 4, 5, 9], [6], 1.0)], 1.0)
    assert [s.input_ids for s in split] == [[1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 9, 6]]
    assert [s.temperature for s in split] == [0.7, 1.0] and split[1].fork_at is None


# ----- the optimizer's-eye view -------------------------------------------------------------------
def test_last_batch_holds_every_sequence_of_the_kept_episodes(engine, pristine):
    a, b, c, d = _generations(engine, 4)
    batch = [_triplet(a, "a", "signal", 1.0), _triplet(b, "b", "signal", 0.0),
             _triplet(c, "c", "flat", 1.0), _triplet(d, "d", "flat", 1.0)]
    start = _weights(engine.model)
    before = {k: _logprobs(engine.model, g) for k, g in zip("abcd", (a, b, c, d))}
    trainer, _ = _update(engine, start, batch)
    rows = {row["rollout_id"]: row for row in trainer.last_batch}
    assert list(rows) == ["a", "b", "c", "d"]
    keys = {"rollout_id", "group_id", "input_ids", "response_mask", "advantage", "advantages", "engine_logprobs",
            "trainer_logprobs", "weight_version", "staleness"}
    for name, gen in zip("abcd", (a, b, c, d)):
        row = rows[name]
        assert set(row) == keys and row["input_ids"] == gen.prompt_ids + gen.completion_ids
        P = len(gen.prompt_ids)
        assert row["response_mask"] == [0] * P + [1] * len(gen.completion_ids)
        assert row["engine_logprobs"] == [0.0] * P + gen.logprobs
        assert (row["weight_version"], row["staleness"]) == (None, 0)  # these triplets name no version
        if name in "cd":  # zero advantage: skipped, not forwarded
            assert row["advantage"] == 0.0 and row["trainer_logprobs"] is None
        else:
            assert len(row["trainer_logprobs"]) == len(row["input_ids"]) and row["trainer_logprobs"][:P] == [0.0] * P
            assert float((torch.tensor(row["trainer_logprobs"][P:]) - before[name]).abs().max()) < LOGPROB_ATOL
    assert rows["a"]["advantage"] > 0 > rows["b"]["advantage"]


# ----- the finish reason reaches the triplet ----------------------------------------------------------
def test_the_adapter_reads_the_finish_reason_of_each_llm_span():
    import time

    from lightning_nb.adapter import TripletAdapter
    from lightning_nb.semconv import LLM_SPAN as LLM_SPAN_NAME
    from lightning_nb.store import InMemoryStore
    from lightning_nb.types import Span

    store = InMemoryStore()
    run = store.start_rollout({"q": 1})
    rid, aid = run.rollout.rollout_id, run.attempt.attempt_id
    now = time.time()
    for k, reasons in enumerate((["length"], ["stop"], None)):
        attributes = {semconv.PROMPT_TOKEN_IDS: [1, 2], semconv.COMPLETION_TOKEN_IDS: [3, 4],
                      semconv.LOGPROBS: [-0.1, -0.2], semconv.APPLIED_TEMPERATURE: 1.0,
                      semconv.APPLIED_TOP_P: 1.0}  # the applied sampling, which LLMProxy writes on every span
        if reasons is not None:
            attributes["gen_ai.response.finish_reasons"] = reasons
        store.add_span(Span(rollout_id=rid, attempt_id=aid, trace_id="t", span_id=f"s{k}", name=LLM_SPAN_NAME,
                            start_time=now, end_time=now, attributes=attributes))
    store.add_span(Span(rollout_id=rid, attempt_id=aid, trace_id="t", span_id="r", name="reward", start_time=now,
                        end_time=now, attributes={semconv.REWARD: 1.0}))
    store.update_attempt(rid, aid, status="succeeded")
    triplets = TripletAdapter().adapt(store, [rid])
    assert [t.finish_reason for t in triplets] == ["length", "stop", None]


def test_tis_cap_defaults_on_in_bfloat16_and_an_explicit_value_is_kept():
    """bf16 engine and trainer log-probs differ even with float32 heads (issue 29): truncated IS is on there."""
    from lightning_nb.trainers.grpo.config import BF16_TIS_CAP

    assert GRPOConfig().tis_cap is None
    assert GRPOConfig(dtype="bfloat16").tis_cap == BF16_TIS_CAP == 2.0
    assert GRPOConfig(dtype="bfloat16", tis_cap=None).tis_cap is None  # the user's None is honoured
    assert GRPOConfig(dtype="float32", tis_cap=3.0).tis_cap == 3.0
    with pytest.raises(ConfigError, match="lora_adapter_dtype"):
        GRPOConfig(lora_adapter_dtype="bfloat16")
