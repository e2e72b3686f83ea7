"""Micro-batches sized by tokens (issue 29, item 3): the planner ``plan_micro_batches`` as a pure function, the
memory estimate behind ``micro_batch_tokens="auto"``, and on the real SmolLM2-135M that a token budget gives the
same optimizer step as fixed rows (the loss is normalized over the whole mini-batch, so the split does not matter).
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from lightning_nb import GRPOConfig, GRPOTrainer
from lightning_nb.errors import ConfigError
from lightning_nb.trainers.microbatch import (CPU_AUTO_TOKENS, MicroBatcher, bytes_per_token, padded_tokens,
                                              plan_micro_batches)
from lightning_nb.types import Triplet


# ----- the planner --------------------------------------------------------------------------
def _random_lengths(seed: int, n: int = 40) -> list[int]:
    rng = random.Random(seed)
    # a mix that makes padding matter: short answers, long multi-turn sequences, in random order
    return [rng.choice([rng.randint(20, 60), rng.randint(200, 512)]) for _ in range(n)]


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("budget", [1, 100, 512, 1024, 4096])
def test_every_index_once_and_every_micro_batch_within_budget_unless_one_oversized_row(seed, budget):
    lengths = _random_lengths(seed)
    plan = plan_micro_batches(lengths, budget)
    assert sorted(i for mb in plan for i in mb) == list(range(len(lengths)))
    for mb in plan:
        cost = len(mb) * max(lengths[i] for i in mb)
        assert cost <= budget or (len(mb) == 1 and lengths[mb[0]] > budget), (mb, cost)
    # greedy: no two consecutive micro-batches could have been one (it would fit the budget)
    for a, b in zip(plan, plan[1:]):
        assert (len(a) + len(b)) * max(lengths[i] for i in a + b) > budget
    assert plan == plan_micro_batches(list(lengths), budget)  # deterministic


def test_rows_cap_and_the_fixed_rows_split():
    lengths = [5, 50, 7, 300, 12, 9, 40]
    assert plan_micro_batches(lengths, None, 3) == [[0, 1, 2], [3, 4, 5], [6]]  # batch order, as before
    assert plan_micro_batches(lengths) == [[0, 1, 2, 3], [4, 5, 6]]  # 4 rows without either setting
    capped = plan_micro_batches(lengths, 10_000, 2)
    assert [len(mb) for mb in capped] == [2, 2, 2, 1] and capped[0] == [3, 1]  # longest first, 2 rows at most
    assert plan_micro_batches(lengths, 100) == [[3], [1, 6], [4, 5, 2, 0]]  # 300 alone (never cut); 2x50; 4x12
    assert plan_micro_batches([], 100) == [] and plan_micro_batches([], None) == []
    with pytest.raises(ConfigError, match="max_tokens"):
        plan_micro_batches(lengths, 0)
    with pytest.raises(ConfigError, match="max_rows"):
        plan_micro_batches(lengths, None, 0)


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("rows", [2, 4, 8])
def test_padding_is_never_more_than_the_row_count_split(seed, rows):
    lengths = _random_lengths(seed)
    longest = max(lengths)
    by_rows = padded_tokens(lengths, plan_micro_batches(lengths, None, rows))  # the old split, batch order
    # the same rows per micro-batch, sorted: the least padding of any split into runs of `rows`
    sorted_rows = plan_micro_batches(lengths, 10 ** 9, rows)
    assert padded_tokens(lengths, sorted_rows) <= by_rows
    # a token budget that holds `rows` of the longest sequence: no more padding, and no more forwards
    by_tokens = plan_micro_batches(lengths, rows * longest)
    assert padded_tokens(lengths, by_tokens) <= by_rows
    assert len(by_tokens) <= len(plan_micro_batches(lengths, None, rows))


def test_on_mixed_lengths_sorting_removes_most_padding():
    lengths = [30, 500] * 16  # short and long alternate, as groups of a batch often do
    real = sum(lengths)
    by_rows = padded_tokens(lengths, plan_micro_batches(lengths, None, 4))
    by_tokens = padded_tokens(lengths, plan_micro_batches(lengths, 2000))
    assert (by_rows - real) / by_rows > 0.45  # every 4-row micro-batch pads two short rows to 500
    assert by_tokens == real  # sorted: long rows together, short rows together


def test_micro_batcher_counts_forwards_and_padding():
    mb = MicroBatcher(max_tokens=100)
    items = ["a", "b", "c", "d"]
    assert mb.split(items, [10, 60, 40, 20]) == [["b"], ["c", "d"], ["a"]]
    assert mb.count([10, 60, 40, 20]) == 3
    mb.record([40, 20])
    mb.record([60])
    assert (mb.forwards, mb.padded, mb.real) == (2, 140, 120)
    assert mb.padding_fraction == pytest.approx(20 / 140)
    assert MicroBatcher().padding_fraction == 0.0


def test_bytes_per_token_follows_its_formula():
    # SmolLM2-135M: h 576, MLP 1536, 30 layers, vocabulary 49,152, bf16 (2 bytes)
    layer = 2 * (10 * 576 + 4 * 1536)
    assert bytes_per_token(576, 1536, 30, 49152, 2) == 30 * layer + 49152 * (2 + 12)
    assert bytes_per_token(576, 1536, 30, 49152, 2, gradient_checkpointing=True) == (
        30 * 2 * 576 + layer + 49152 * 14)
    lora_extra = 4 * (3 * 576 + 1536)
    assert bytes_per_token(576, 1536, 30, 49152, 2, lora=True) == 30 * (layer + lora_extra) + 49152 * 14


# ----- the config -----------------------------------------------------------------------------
@pytest.mark.parametrize("value", [0, -5, "big", 1.5, True, [1024]])
def test_micro_batch_tokens_is_validated(value):
    with pytest.raises(ConfigError, match=r"GRPOConfig\.micro_batch_tokens=.* must be None, 'auto' or an int"):
        GRPOConfig(micro_batch_tokens=value)


def test_the_default_is_auto_on_every_device():
    cfg = GRPOConfig()
    # issue 49: 'auto' on CPU too (2,048 tokens), so a prefix tree can hold the batch's shared prompt once
    assert cfg.micro_batch_tokens == "auto" and cfg.micro_batch_size is None
    assert GRPOConfig(micro_batch_tokens="auto").micro_batch_tokens == "auto"
    assert GRPOConfig(micro_batch_tokens=None).micro_batch_tokens is None
    # resolved from the device at construction (not constructible here without CUDA: the device check)
    if torch.cuda.is_available():
        assert GRPOConfig(device="cuda").micro_batch_tokens == "auto"


def test_verl_configs_cuda_default_is_the_auto_token_budget(monkeypatch):
    """Issue 42: on CUDA verl's update gets a token budget from free memory unless a row count is set (the
    device check is the only part that needs a GPU; it is skipped here so the defaults resolve on CPU)."""
    import lightning_nb.trainers.config as shared
    from lightning_nb.trainers.verl.config import VerlConfig

    monkeypatch.setattr(shared, "check_device", lambda device, name: None)
    cuda = VerlConfig(device="cuda", dtype="bfloat16")
    assert (cuda.micro_batch_tokens, cuda.micro_batch_size, cuda.tis_cap) == ("auto", None, 2.0)
    rows = VerlConfig(device="cuda", micro_batch_size=8)  # the user's row count: no budget, nothing dropped
    assert (rows.micro_batch_tokens, rows.micro_batch_size) == (None, 8)
    preset = VerlConfig.one_gpu_lora()
    assert (preset.micro_batch_tokens, preset.micro_batch_size, preset.tis_cap) == ("auto", None, 2.0)
    cpu = VerlConfig()
    assert (cpu.micro_batch_tokens, cpu.micro_batch_size, cpu.tis_cap) == (None, 4, None)


def test_verl_config_maps_the_budget_to_verls_max_token_len(engine):
    from lightning_nb.trainers.verl.config import MAPPED_KEYS, VerlConfig

    assert VerlConfig().max_token_len(100) == 400  # micro_batch_size 4 x the longest row, as before
    assert VerlConfig(micro_batch_size=None, micro_batch_tokens=4096).max_token_len(100) == 4096
    auto = VerlConfig(micro_batch_size=None, micro_batch_tokens="auto")
    assert auto.max_token_len(100, engine.model) == CPU_AUTO_TOKENS  # the session engine is on CPU
    # a budget set resolves the row count's default to None (verl's dynamic micro-batches have no row cap) ...
    assert VerlConfig(micro_batch_tokens=4096).micro_batch_size is None
    with pytest.raises(ConfigError, match=r"VerlConfig\.micro_batch_size=4 .* set micro_batch_size=None"):
        VerlConfig(micro_batch_size=4, micro_batch_tokens=4096)  # ... and both set is refused, not dropped
    with pytest.raises(ConfigError, match=r"VerlConfig\.micro_batch_size=None"):
        VerlConfig(micro_batch_size=None)
    assert MAPPED_KEYS["actor_rollout_ref.actor.ppo_max_token_len_per_gpu"] == "micro_batch_tokens"
    with pytest.raises(ConfigError, match="VerlConfig.micro_batch_tokens"):
        VerlConfig(overrides=["actor_rollout_ref.actor.ppo_max_token_len_per_gpu=8192"])


# ----- on the real model ---------------------------------------------------------------------
QUESTIONS = ["What is 17 + 25? Answer with a number.",
             "Here is a longer question, so that the prompts differ in length: a farmer has 12 apples and "
             "buys 30 more, then gives 7 away. How many apples does the farmer have? Answer with a number."]


@pytest.fixture(scope="module")
def batch(engine):
    """Two groups of 3 real samples (prompts of two lengths); rewards 1, 0, 0.25 (no advantage is 0). The i-th
    sample's response is cut to its first 8 − 2i tokens (a sampled prefix, with its log-probs), so the 6 sequences
    differ in length."""
    from conftest import _distinct_generations

    out = []
    for q, question in enumerate(QUESTIONS):
        prompt = engine.apply_chat_template([{"role": "user", "content": question}])
        for i, g in enumerate(_distinct_generations(engine, prompt, 3, max_tokens=8, seed=q)):
            out.append(Triplet(rollout_id=f"q{q}-{i}", attempt_id=f"a{q}-{i}", group_id=f"g{q}", turn=0,
                               prompt_ids=g.prompt_ids, response_ids=g.completion_ids[:8 - 2 * i],
                               logprobs=g.logprobs[:8 - 2 * i],
                               reward=[1.0, 0.0, 0.25][i], temperature=1.0, weight_version=0))
    return out


def _step(engine, start, batch, **config):
    """A fresh trainer's first update from the weights ``start``: (metrics, the trainer)."""
    with torch.no_grad():
        engine.model.load_state_dict(start)
    engine.weight_version = 0  # the batch's version: never stale
    trainer = GRPOTrainer(engine, GRPOConfig(track_reference_kl=False, learning_rate=1e-4, **config))
    return trainer.update(batch), trainer


def _after(trainer):
    """``(parameters after the step, gradients it took)`` by name; AdamW's first step leaves exp_avg = (1 − β1) g."""
    beta1 = trainer.optimizer.param_groups[0]["betas"][0]
    named = dict(trainer.model.named_parameters())
    return ({k: p.detach().clone() for k, p in named.items()},
            {k: trainer.optimizer.state[p]["exp_avg"] / (1 - beta1) for k, p in named.items()})


@pytest.mark.slow
def test_a_token_budget_gives_the_same_step_as_fixed_rows(engine, pristine, batch):
    lengths = [len(t.prompt_ids) + len(t.response_ids) for t in batch]
    assert len(set(lengths)) > 2  # lengths differ, so sorting and padding matter
    start = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
    rows, rows_trainer = _step(engine, start, batch, micro_batch_size=1, micro_batch_tokens=None, prefix_tree=False)
    params_rows, grads_rows = _after(rows_trainer)
    budget = 2 * max(lengths)
    tokens, tokens_trainer = _step(engine, start, batch, micro_batch_tokens=budget, prefix_tree=False)
    params_tokens, grads_tokens = _after(tokens_trainer)
    assert rows["micro_batches"] == len(batch) and rows["padding_fraction"] == 0.0
    assert math.isnan(rows["micro_batch_tokens"])
    assert tokens["micro_batch_tokens"] == budget
    assert tokens["micro_batches"] == len(plan_micro_batches(lengths, budget)) < len(batch)
    one_micro_batch = 1 - sum(lengths) / (len(lengths) * max(lengths))  # all rows padded to the longest
    assert 0 < tokens["padding_fraction"] < one_micro_batch
    # the gradient of the step (after clipping) is the same sum, added in another order and forwarded padded or
    # not (other kernel shapes): 1.1e-6 of the largest gradient measured here. Normalizing per micro-batch
    # instead of per mini-batch would change it by a factor per micro-batch, far beyond 1e-5.
    g_max = max(float(g.abs().max()) for g in grads_rows.values())
    g_diff = max(float((grads_tokens[k] - grads_rows[k]).abs().max()) for k in grads_rows)
    assert g_diff < 1e-5 * g_max, (g_diff, g_max)
    # the parameters after the step: AdamW's first step moves a weight by lr * g / (|g| + eps), about the
    # learning rate (1e-4) wherever |g| >> eps (1e-8); where |g| is within a few orders of eps, float rounding of
    # g is amplified up to lr / eps times, so those weights are compared through the gradient above instead.
    # Where |g| > 1e-4 the steps differ by under 1e-6 of the step (2.9e-11 measured near w = 0), and the weights
    # after it round to the same float32 or its neighbour: 2 units in the last place of |w| (2.4e-7 at |w| = 1,
    # 1/400 of the step; 1.19e-7 measured).
    step = max(float((params_rows[k] - start[k]).abs().max()) for k in params_rows)
    assert step > 0.9e-4, step
    ulp = torch.finfo(torch.float32).eps
    well_posed = {k: grads_rows[k].abs() > 1e-4 for k in grads_rows}
    assert sum(int(m.sum()) for m in well_posed.values()) > 1e5
    for k, pr in params_rows.items():
        off = ((params_tokens[k] - pr).abs() > 2 * ulp * pr.abs() + 1e-6 * step) & well_posed[k]
        assert not off.any(), (k, float((params_tokens[k] - pr).abs()[off].max()))
    assert 2 * ulp * max(float(p.abs().max()) for p in params_rows.values()) < step / 10
    for key in ("loss", "pg_loss", "grad_norm"):
        assert tokens[key] == pytest.approx(rows[key], rel=1e-5, abs=1e-7), key
    assert tokens["tokens_trained"] == rows["tokens_trained"]


@pytest.mark.slow
def test_auto_on_cpu_uses_the_fixed_budget_and_every_forward_is_counted(engine, pristine, batch):
    start = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
    # two PPO epochs: pi_start is scored first (one forward), then each epoch forwards the batch: the 6
    # sequences (< 256 tokens each) fit 2,048 tokens, so each pass is one micro-batch
    epochs, _ = _step(engine, start, batch, micro_batch_tokens="auto", ppo_epochs=2)
    assert epochs["micro_batch_tokens"] == CPU_AUTO_TOKENS
    assert epochs["micro_batches"] == 3 and epochs["optimizer_steps"] == 2
    # a row cap on top of the budget: 4 rows at most per micro-batch
    capped, _ = _step(engine, start, batch, micro_batch_tokens="auto", micro_batch_size=4)
    assert capped["micro_batches"] == 2 and capped["micro_batch_tokens"] == CPU_AUTO_TOKENS


# ----- on a GPU (skipped without CUDA; `pytest -m gpu`) ------------------------------------------
@pytest.mark.gpu
def test_auto_on_cuda_sizes_the_budget_from_free_memory_and_trains():
    from lightning_nb.engines.transformers import TransformersEngine
    from lightning_nb.trainers.microbatch import AUTO_MAX_TOKENS, AUTO_MIN_TOKENS, auto_micro_batch_tokens

    engine = TransformersEngine.from_default(device="cuda", dtype="bfloat16", max_batch_size=8)
    try:
        cfg = GRPOConfig(device="cuda", dtype="bfloat16", track_reference_kl=False)
        assert cfg.micro_batch_tokens == "auto"  # the CUDA default
        trainer = GRPOTrainer(engine, cfg)
        budget = auto_micro_batch_tokens(engine.model)
        assert AUTO_MIN_TOKENS <= budget <= AUTO_MAX_TOKENS and budget % 64 == 0
        free, _ = torch.cuda.mem_get_info()
        # the estimate keeps the activations of the budget inside the free memory
        assert budget * bytes_per_token(576, 1536, 30, 49152, 2) < free
        # a batch far over the budget: 3 budgets' worth of 256-token sequences, so several micro-batches
        n = 3 * budget // 256 + 1
        gen = torch.Generator().manual_seed(0)
        batch = [Triplet(rollout_id=f"r{k}", attempt_id=f"a{k}", group_id=f"g{k // 8}", turn=0,
                         prompt_ids=torch.randint(3, 49152, (32,), generator=gen).tolist(),
                         response_ids=torch.randint(3, 49152, (224,), generator=gen).tolist(),
                         reward=float(k % 2)) for k in range(n)]
        torch.cuda.reset_peak_memory_stats()
        metrics = trainer.update(batch)
        assert metrics["micro_batch_tokens"] >= AUTO_MIN_TOKENS and metrics["optimizer_steps"] == 1
        assert metrics["micro_batches"] >= 3 and metrics["padding_fraction"] == 0.0
        assert torch.cuda.max_memory_allocated() < torch.cuda.get_device_properties(0).total_memory
    finally:
        engine.close()
