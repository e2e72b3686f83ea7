"""Credit is the algorithm's step (issue 51): the advantages it attaches to triplets are the numbers the trainer
computed itself in earlier versions, to the bit, and the trainer trains on them as given.

``build_batch`` on triplets without advantages is the path of earlier versions (kept, deprecated, for one release);
on the same batches the algorithm's path (``lightning_nb.credit.assign`` with the stale episodes left out, then
``build_batch`` on the credited triplets) must give equal (==) per-episode, per-turn and per-token advantages, kept
and dropped groups, and packed sequences, for every credit option. One batch is also worked out by hand.
"""

from __future__ import annotations

import warnings

import pytest

from lightning_nb import AlgorithmConfig, GRPOConfig
from lightning_nb.credit import CreditRule, assign, groups_with_signal, with_advantages
from lightning_nb.errors import ConfigError
from lightning_nb.trainers.batch import build_batch, per_triplet_turn, staleness_of
from lightning_nb.types import Triplet

WEIGHT_VERSION = 6


def _episode(rid, group, final, steps, *, base=300, wv=None, fork_at=None, resp_len=2, baseline=None, finish=None):
    prompt, out = [1, base, base + 1], []
    for k, s in enumerate(steps):
        response = [base + 10 + 3 * k + j for j in range(resp_len)]
        p = [1, 999] + prompt[2:] if fork_at == k else list(prompt)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # Triplet.baseline, for the old path
            out.append(Triplet(rollout_id=rid, attempt_id=f"at-{rid}", group_id=group, turn=k, prompt_ids=p,
                               response_ids=response, reward=final, step_reward=s, weight_version=wv,
                               logprobs=[-0.5] * len(response), finish_reason=finish, baseline=baseline))
        prompt = prompt + response + [base + 50 + k]
    return out


def _batches():
    import random

    rng = random.Random(51)
    out = {"single_turn": [], "multi_turn": [], "overlong": []}
    for g in range(4):
        for i in range(4):
            out["single_turn"] += _episode(f"s{g}.{i}", f"g{g}", float(rng.choice([0, 1])) if g < 3 else 1.0, [0.0],
                                           base=300 + 10 * g)
    for g in range(3):
        for i in range(4):
            T = rng.randint(1, 4)
            out["multi_turn"] += _episode(f"m{g}.{i}", f"g{g}", round(rng.random(), 3),
                                          [round(rng.uniform(-1, 1), 2) for _ in range(T)], base=400 + 20 * i,
                                          resp_len=rng.randint(1, 6))
    out["stale_small_fork"] = (
        _episode("u0", "small", 1.0, [0.0]) + _episode("u1", "pair", 1.0, [0.0, 0.5])
        + _episode("u2", "pair", 0.0, [0.0], wv=0) + _episode("u3", "pair", 0.5, [0.2], wv=5)
        + [t for i in range(3) for t in _episode(f"f{i}", "fresh", float(i), [0.1 * i, 0.0], wv=5,
                                                 fork_at=1 if i == 1 else None)])
    out["baselines"] = (_episode("t0", "1:task:a", 1.0, [0.0]) + _episode("t1", "1:task:a", 0.0, [0.0])
                        + _episode("t2", "1:baseline:b", 1.0, [0.0], baseline=0.5)
                        + _episode("t3", "1:baseline:c", 0.25, [0.0, 0.0], baseline=0.5))
    for i, L in enumerate([3, 10, 14, 16, 20, 8]):
        out["overlong"] += _episode(f"o{i}", f"og{i % 2}", float(i % 3 == 0), [0.0] * (1 + i % 2), resp_len=L,
                                    finish="length" if L >= 16 else "stop")
    return out


CONFIGS = {
    "default": {}, "dr_grpo": dict(norm_adv_by_std=False), "rtg": dict(credit="reward_to_go"),
    "rtg_gamma": dict(credit="reward_to_go", gamma=0.7),
    "rtg_gamma_dr": dict(credit="reward_to_go", gamma=0.9, norm_adv_by_std=False), "min3": dict(min_group_size=3),
    "overlong": dict(max_response_len=16, overlong_buffer_len=8, overlong_penalty_factor=0.5),
    "overlong_rtg": dict(credit="reward_to_go", gamma=0.8, max_response_len=16, overlong_buffer_len=8),
    "stale0": dict(max_staleness=0), "nopack": dict(pack_turns=False),
}


def _view(batch, triplets):
    return {"advantages": batch.advantages, "turn_advantages": per_triplet_turn(triplets, batch.turn_advantages),
            "dropped": batch.dropped, "stale": batch.stale, "forks": batch.forks,
            "seqs": [(s.rollout_id, s.input_ids, s.mask, s.token_advantages, s.advantage, s.staleness)
                     for s in batch.seqs]}


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("name", ["single_turn", "multi_turn", "stale_small_fork", "baselines", "overlong"])
def test_the_algorithms_advantages_are_the_trainers_of_earlier_versions_to_the_bit(name, config):
    triplets = _batches()[name]
    cfg = GRPOConfig(micro_batch_tokens=None, **CONFIGS[config])
    with pytest.warns(DeprecationWarning, match="without advantages"):
        old = build_batch(cfg, triplets, WEIGHT_VERSION)
    stale = [r for r, age in staleness_of(triplets, WEIGHT_VERSION).items() if age > cfg.max_staleness]
    baselines = {t.rollout_id: t.baseline for t in triplets if t.baseline is not None}
    plain = [t.model_copy(update={"baseline": None}) for t in triplets]
    credit = assign(CreditRule.from_config(cfg), plain, exclude=stale, baselines=baselines)
    assert all(t.advantages is not None and len(t.advantages) == len(t.response_ids) for t in credit.triplets)
    new = build_batch(cfg, credit.triplets, WEIGHT_VERSION, left_out=credit.left_out)
    assert _view(new, triplets) == _view(old, triplets)  # ==: the same floats, not close ones
    assert groups_with_signal(credit.triplets) == {
        old.groups[r] for r, advs in old.turn_advantages.items() if any(a != 0.0 for a in advs.values())}


def test_worked_example_two_groups_a_baseline_and_an_undersized_group():
    triplets = (_episode("a", "g", 1.0, [0.0]) + _episode("b", "g", 0.0, [0.0]) + _episode("c", "g", 0.0, [0.0])
                + _episode("d", "g", 0.0, [0.0]) + _episode("lone", "h", 1.0, [0.0])
                + _episode("x", "b", 0.25, [0.5, 0.0]))
    credit = assign(CreditRule(), triplets, baselines={"x": 0.5})
    adv = {t.rollout_id: t.advantages for t in credit.triplets}
    # GRPO over g: mean 0.25, unbiased std 0.5 -> (1 - 0.25) / (0.5 + 1e-6); x: 0.25 + 0.5 - 0.5, on both turns
    assert adv["a"] == [pytest.approx(1.5, abs=1e-5)] * 2 and adv["b"] == [pytest.approx(-0.5, abs=1e-5)] * 2
    assert adv["x"] == [0.25] * 2 and [t.rollout_id for t in credit.triplets].count("x") == 2
    assert [t.rollout_id for t in credit.left_out] == ["lone"] and credit.dropped == {"h": 1}
    batch = build_batch(GRPOConfig(micro_batch_tokens=None), credit.triplets, 0, left_out=credit.left_out)
    assert batch.dropped == {"h": 1} and set(batch.advantages) == {"a", "b", "c", "d", "x"}


def test_the_trainer_trains_on_the_advantages_it_is_given_per_token():
    t = _episode("a", "g", 1.0, [0.0], resp_len=3)[0]
    u = _episode("b", "g", 0.0, [0.0], resp_len=3)[0]
    given = with_advantages([t, u], {"a": [0.5, -1.0, 2.0], ("b", 0): 0.25})
    batch = build_batch(GRPOConfig(micro_batch_tokens=None), given, 0)
    a, b = batch.seqs
    assert [x for x, m in zip(a.token_advantages, a.mask) if m] == [0.5, -1.0, 2.0]
    assert b.token_advantages[-3:] == [0.25] * 3 and batch.advantages == {"a": 0.5, "b": 0.25}


def test_bad_advantages_and_mixed_batches_are_refused_with_the_fix():
    t = _episode("a", "g", 1.0, [0.0])[0]
    with pytest.raises(ValueError, match="one per token"):
        t.model_validate({**t.model_dump(), "advantages": [1.0]})
    with pytest.raises(ValueError, match="finite"):
        t.model_validate({**t.model_dump(), "advantages": [1.0, float("nan")]})
    from lightning_nb.trainers.batch import check_batch

    given = with_advantages([t], {"a": 1.0})
    with pytest.raises(ConfigError, match="carry no advantages while others do"):
        check_batch(given + [_episode("b", "g", 0.0, [0.0])[0]])
    with pytest.raises(ConfigError, match="kl_mode='loss'"):
        build_batch(GRPOConfig(micro_batch_tokens=None, kl_coef=0.1, kl_mode="reward"), given, 0)


def test_credit_is_an_algorithm_option_and_the_trainer_fields_forward_with_a_warning():
    assert AlgorithmConfig(credit="reward_to_go", gamma=0.9).gamma == 0.9
    with pytest.raises(ConfigError, match="AlgorithmConfig.gamma"):
        AlgorithmConfig(gamma=0.9)
    with pytest.raises(ConfigError, match="AlgorithmConfig.min_group_size"):
        AlgorithmConfig(min_group_size=1)
    with pytest.raises(ConfigError, match="AlgorithmConfig.overlong_buffer_len"):
        AlgorithmConfig(overlong_buffer_len=48, max_tokens=48)

    from lightning_nb.algorithm.credit import CreditAssignment

    class Host(CreditAssignment):  # the credit step of an algorithm, without its loop
        def __init__(self, trainer_config, config):
            self.trainer = type("T", (), {"config": trainer_config})()
            self.config = config

        step = run = save = load = state_dict = load_state_dict = lambda self, *a, **k: None

    host = Host(GRPOConfig(micro_batch_tokens=None, credit="reward_to_go", gamma=0.8), AlgorithmConfig())
    with pytest.warns(DeprecationWarning, match="set AlgorithmConfig.credit"):
        rule = host.credit_rule()
    assert (rule.credit, rule.gamma) == ("reward_to_go", 0.8)
    host.config = AlgorithmConfig(credit="reward_to_go", gamma=0.5)  # the algorithm's own setting wins
    assert host.credit_rule().gamma == 0.5


def test_old_names_warn_and_name_their_new_home():
    with pytest.warns(DeprecationWarning, match="lightning_nb.credit.group_advantages"):
        from lightning_nb.trainers.credit import group_advantages
    from lightning_nb.credit import group_advantages as new

    assert group_advantages is new
    with pytest.warns(DeprecationWarning, match="Triplet.baseline is deprecated"):
        Triplet(rollout_id="a", attempt_id="at", group_id="g", turn=0, prompt_ids=[1], response_ids=[2], reward=1.0,
                baseline=0.5)
