"""Prefix-tree updates (issue 49, item 1): every token that several sequences share after the same tokens is
forwarded once, and the update is the same as forwarding padded rows.

The planner and the tree are pure functions (checked against brute force); on the real SmolLM2-135M the log-probs,
the loss and every parameter's gradient of a GRPO update over packed multi-turn calc episodes (the demo's prompt,
real sampled replies, a tool result between the turns) agree with the padded path to 1e-5 in float32, with full
fine-tuning and LoRA, on the fused-head path and the model's own forward.
"""

from __future__ import annotations

import random

import pytest
import torch

from lightning_nb import GRPOConfig, GRPOTrainer
from lightning_nb.errors import ConfigError
from lightning_nb.trainers.grpo.logprobs import logprob_path, response_logprobs, shift_pad, tree_response_logprobs
from lightning_nb.trainers.microbatch import MicroBatcher
from lightning_nb.trainers.prefix_tree import (MAX_TREE_TOKENS, build_prefix_tree, plan_tree_micro_batches,
                                               tree_path, tree_token_budget, tree_tokens)
from lightning_nb.types import Triplet


# ----- the tree and the planner, pure ------------------------------------------------------------
def _random_sequences(seed: int, n: int = 24) -> list[list[int]]:
    """Sequences as a GRPO batch has them: a shared system prompt, a few groups' prompts, varied replies."""
    rng = random.Random(seed)
    system = [rng.randrange(50) for _ in range(rng.randint(0, 40))]
    prompts = [system + [rng.randrange(50) for _ in range(rng.randint(1, 20))] for _ in range(rng.randint(1, 5))]
    out = []
    for _ in range(n):
        seq = list(rng.choice(prompts)) + [rng.randrange(4) for _ in range(rng.randint(1, 30))]  # 4 tokens: replies
        out.append(seq)                                                                          # share prefixes too
    return out


def _distinct_prefixes(sequences) -> int:
    return len({tuple(s[: t + 1]) for s in sequences for t in range(len(s))})


@pytest.mark.parametrize("seed", range(10))
def test_the_tree_holds_each_distinct_prefix_once_and_its_mask_is_the_ancestor_relation(seed):
    seqs = _random_sequences(seed)
    tree = build_prefix_tree(seqs)
    assert tree.nodes == _distinct_prefixes(seqs) == tree_tokens(seqs)
    assert tree.sequence_tokens == sum(map(len, seqs)) and tree.shared_tokens == tree.sequence_tokens - tree.nodes
    for seq, path in zip(seqs, tree.paths):  # each sequence reads back from its path, at its positions
        assert [tree.ids[n] for n in path] == seq and [tree.depth[n] for n in path] == list(range(len(seq)))
        assert all(tree.parent[path[t]] == (path[t - 1] if t else -1) for t in range(len(seq)))
    mask = tree.attention_mask()
    ancestors = set()
    for path in tree.paths:
        ancestors |= {(path[q], path[k]) for q in range(len(path)) for k in range(q + 1)}
    assert {(int(q), int(k)) for q, k in mask.nonzero()} == ancestors


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("budget", [1, 30, 100, 400, None])
def test_tree_micro_batches_take_every_sequence_once_within_the_budget(seed, budget):
    seqs = _random_sequences(seed)
    plan = plan_tree_micro_batches(seqs, budget)
    assert sorted(i for mb in plan for i in mb) == list(range(len(seqs)))
    limit = MAX_TREE_TOKENS if budget is None else budget
    for mb in plan:
        nodes = tree_tokens([seqs[i] for i in mb])
        assert nodes <= limit or len(mb) == 1, (mb, nodes)
    for a, b in zip(plan, plan[1:]):  # greedy: the next micro-batch's first sequence did not fit
        assert tree_tokens([seqs[i] for i in a + b[:1]]) > limit
    assert plan == plan_tree_micro_batches([list(s) for s in seqs], budget)  # deterministic
    capped = plan_tree_micro_batches(seqs, budget, max_rows=3)
    assert max(len(mb) for mb in capped) <= 3


def test_sorting_puts_a_group_together_and_the_planner_refuses_bad_budgets():
    system, a, b = [7] * 50, [1, 2, 3], [4, 5, 6]
    seqs = [system + b + [9], system + a + [8], system + b + [8], system + a + [9]]  # groups interleaved
    assert plan_tree_micro_batches(seqs, 57) == [[1, 3], [2, 0]]  # each group's tree: 50 + 3 + 2 nodes
    assert plan_tree_micro_batches(seqs, 61) == [[1, 3, 2, 0]]  # the whole batch: 50 + 2 * (3 + 2) nodes
    with pytest.raises(ConfigError, match="max_tokens"):
        plan_tree_micro_batches(seqs, 0)
    with pytest.raises(ConfigError, match="max_rows"):
        plan_tree_micro_batches(seqs, 10, 0)


def test_micro_batcher_counts_tree_forwards_as_their_nodes():
    seqs = [[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 6]]
    mb = MicroBatcher(max_tokens=100, tree=True)
    assert mb.split_sequences(["a", "b", "c"], seqs) == [["a", "b", "c"]] and mb.count_sequences(seqs) == 1
    mb.record([4, 4, 3], nodes=build_prefix_tree(seqs).nodes)  # 1 2 3 4 / 5 / 6: 6 nodes
    assert (mb.padded, mb.real, mb.shared, mb.padding_fraction) == (6, 11, 5, 0.0)
    rows = MicroBatcher(max_tokens=None, max_rows=2, tree=True)  # fixed rows, each forwarded as a tree
    assert rows.split_sequences(["a", "b", "c"], seqs) == [["a", "b"], ["c"]]
    assert MicroBatcher(max_tokens=8).split_sequences(["a", "b", "c"], seqs) == [["a", "b"], ["c"]]  # padded rows


def test_prefix_tree_is_validated():
    assert GRPOConfig().prefix_tree is True and GRPOConfig().micro_batch_tokens == "auto"
    with pytest.raises(ConfigError, match=r"GRPOConfig\.prefix_tree=1 .* True or False"):
        GRPOConfig(prefix_tree=1)


# ----- on the real model -------------------------------------------------------------------------
QUESTIONS = ["Sam has 14 apples and buys 23 more. How many apples does Sam have now?",
             "A shop sells 6 boxes of 15 pencils and then 9 more pencils. How many pencils did it sell?"]


def _episodes(engine, per_group: int = 3, seed: int = 0) -> list[Triplet]:
    """Two groups of ``per_group`` real two-turn calc episodes: the demo's prompt (system prompt, two worked
    examples, the question), a sampled reply, the tool's ``RESULT`` in chat format, a second sampled reply. Turn
    2's prompt extends turn 1's prompt + reply token for token, so each episode packs into one sequence; the
    sequences share the system prompt (batch-wide) and their question (per group). Rewards differ in each group
    (no zero advantage), and the engine's log-probs are kept (the PPO ratio's π_old)."""
    from lightning_nb.tasks.calc.agent import build_messages

    torch.manual_seed(seed)
    tool = engine.tokenizer.encode("<|im_start|>user\nRESULT: 37<|im_end|>\n<|im_start|>assistant\n",
                                   add_special_tokens=False)
    out = []
    for g, question in enumerate(QUESTIONS):
        prompt = engine.apply_chat_template(build_messages(question))
        seen: set = set()
        while len([t for t in out if t.group_id == f"g{g}"]) < 2 * per_group:
            first = engine.generate(prompt, temperature=1.0, max_tokens=10)
            if tuple(first.completion_ids) in seen:
                continue
            seen.add(tuple(first.completion_ids))
            second = engine.generate(list(first.prompt_ids) + list(first.completion_ids) + tool, temperature=1.0,
                                     max_tokens=6)
            i = len(seen) - 1
            for turn, gen in enumerate((first, second)):
                out.append(Triplet(rollout_id=f"g{g}-{i}", attempt_id=f"a{g}-{i}", group_id=f"g{g}", turn=turn,
                                   prompt_ids=list(gen.prompt_ids), response_ids=list(gen.completion_ids),
                                   logprobs=list(gen.logprobs), reward=[1.0, 0.0, 0.25][i % 3], temperature=1.0,
                                   weight_version=engine.weight_version))
    return out


@pytest.fixture(scope="module")
def episodes(engine):
    return _episodes(engine)


def _sequences(episodes):
    from lightning_nb.trainers.packing import episodes_of, pack_episode

    packed = [s for ts in episodes_of(episodes).values() for s in pack_episode(ts, 0.0)]
    assert all(s.fork_at is None for s in packed) and len(packed) == len({t.rollout_id for t in episodes})
    return packed


@pytest.mark.slow
@pytest.mark.parametrize("path", ["fused", "forward"])
def test_tree_log_probs_and_gradients_equal_the_padded_rows(engine, episodes, path):
    """One function, both paths: the log-probs of every response token and the gradient of their sum."""
    seqs = _sequences(episodes)
    model = engine.model
    hook = model.lm_head.register_forward_hook(lambda *args: None) if path == "forward" else None
    try:
        assert logprob_path(model).split(":")[0] == path and tree_path(model) == "tree"
        T = max(len(s.input_ids) for s in seqs)
        ids = torch.tensor([s.input_ids + [2] * (T - len(s.input_ids)) for s in seqs])
        attn = torch.tensor([[1] * len(s.input_ids) + [0] * (T - len(s.input_ids)) for s in seqs])
        mask, temp = shift_pad([s.mask for s in seqs], T, "cpu"), torch.full((len(seqs),), 0.7)
        tree = build_prefix_tree([s.input_ids for s in seqs])
        assert tree.nodes < 0.5 * tree.sequence_tokens  # the shared prompt dominates, as in the demo

        def run(fn):
            model.zero_grad(set_to_none=True)
            logp = fn()
            (logp * mask).sum().backward()
            return logp.detach(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}

        with engine.lock:
            padded, g_padded = run(lambda: response_logprobs(model, ids, attn, mask, temp))
            shared, g_shared = run(lambda: tree_response_logprobs(model, tree, [s.input_ids for s in seqs],
                                                                  mask, temp))
            model.zero_grad(set_to_none=True)
    finally:
        if hook is not None:
            hook.remove()
    assert int(mask.sum()) > 50 and bool((padded[mask.bool()] <= 0).all())
    # float32 rounding of other kernel shapes (one row of N nodes against B padded rows): 1e-5 of the value
    assert float(((shared - padded).abs() / padded.abs().clamp(min=1.0)).max()) < 1e-5
    assert set(g_shared) == set(g_padded) and len(g_padded) == len(list(model.parameters()))
    g_max = max(float(g.abs().max()) for g in g_padded.values())
    g_diff = max(float((g_shared[k] - g_padded[k]).abs().max()) for k in g_padded)
    assert g_max > 1.0 and g_diff < 1e-5 * g_max, (g_diff, g_max)


@pytest.mark.slow
def test_in_float64_the_tree_and_the_rows_give_the_same_float32_log_probs(engine, episodes):
    """The float32 differences above are rounding: computed in float64, the two forwards agree to the last bit or two
    of the float32 result that both return."""
    import copy

    seqs = _sequences(episodes)
    with engine.lock:
        model = copy.deepcopy(engine.model).double()
    T = max(len(s.input_ids) for s in seqs)
    ids = torch.tensor([s.input_ids + [2] * (T - len(s.input_ids)) for s in seqs])
    attn = torch.tensor([[1] * len(s.input_ids) + [0] * (T - len(s.input_ids)) for s in seqs])
    mask, temp = shift_pad([s.mask for s in seqs], T, "cpu"), torch.full((len(seqs),), 0.7, dtype=torch.float64)
    with torch.no_grad():
        padded = response_logprobs(model, ids, attn, mask, temp)
        shared = tree_response_logprobs(model, build_prefix_tree([s.input_ids for s in seqs]),
                                        [s.input_ids for s in seqs], mask, temp)
    ulp = torch.finfo(torch.float32).eps
    assert float(((shared - padded).abs() / padded.abs().clamp(min=1e-3)).max()) <= 2 * ulp


def _update_grads(trainer, batch):
    """``(metrics, gradients)`` of ``trainer.update(batch)``: the gradients the optimizer stepped with (after
    clipping), read when it steps."""
    grads: dict = {}
    step = trainer.optimizer.step

    def recording_step(*args, **kwargs):
        grads.update({k: p.grad.detach().clone() for k, p in trainer.model.named_parameters() if p.grad is not None})
        return step(*args, **kwargs)

    trainer.optimizer.step = recording_step
    try:
        return trainer.update(batch), grads
    finally:
        trainer.optimizer.step = step


def _compare_updates(trainer, episodes):
    """The same update with padded rows, then with prefix trees, from the same weights; asserts they agree and
    returns the tree update's metrics."""
    before = {k: p.detach().clone() for k, p in trainer.model.named_parameters()}
    trainer.config.prefix_tree = False
    padded, g_padded = _update_grads(trainer, episodes)
    rows_padded = trainer.last_batch
    with torch.no_grad():  # a weight at 0 (the GGUF has them) moves by ~1e-29 even at this learning rate
        for k, p in trainer.model.named_parameters():
            p.copy_(before[k])
    trainer.config.prefix_tree = True
    shared, g_shared = _update_grads(trainer, episodes)
    assert padded["prefix_shared_tokens"] == 0 and padded["padding_fraction"] > 0
    assert shared["prefix_shared_tokens"] > 0 and shared["padding_fraction"] == 0
    assert shared["forwarded_tokens"] < 0.5 * padded["forwarded_tokens"]
    for key in ("loss", "pg_loss", "grad_norm", "kl"):
        same_nan = shared[key] != shared[key] and padded[key] != padded[key]
        assert same_nan or abs(shared[key] - padded[key]) < 1e-5 * max(1.0, abs(padded[key])), key
    for a, b in zip(trainer.last_batch, rows_padded):  # π_start, from each update's gradient forward
        assert a["input_ids"] == b["input_ids"]
        assert max(abs(x - y) / max(1.0, abs(y)) for x, y in zip(a["trainer_logprobs"], b["trainer_logprobs"])) < 1e-5
    assert set(g_shared) == set(g_padded) and g_padded
    g_max = max(float(g.abs().max()) for g in g_padded.values())
    g_diff = max(float((g_shared[k] - g_padded[k]).abs().max()) for k in g_padded)
    assert g_diff < 1e-5 * g_max, (g_diff, g_max)
    return shared


@pytest.mark.slow
def test_a_tree_update_equals_the_padded_update_full_fine_tuning(engine, pristine, episodes):
    engine.weight_version = 0
    trainer = GRPOTrainer(engine, GRPOConfig(learning_rate=1e-30, track_reference_kl=True, kl_coef=0.01))
    torch.manual_seed(2)
    with torch.no_grad():  # a reference apart from the policy, so the KL term of the loss has a gradient
        for p in trainer.reference.parameters():
            p.add_(torch.randn_like(p), alpha=1e-3)
    metrics = _compare_updates(trainer, episodes)  # the reference's forward (KL in the loss) is a tree too
    assert metrics["kl"] > 1e-4


@pytest.mark.slow
def test_a_tree_update_equals_the_padded_update_lora():
    from lightning_nb.engines.transformers import TransformersEngine

    engine = TransformersEngine.from_default(max_batch_size=4)  # LoRA changes the module tree: its own engine
    try:
        batch = _episodes(engine)
        trainer = GRPOTrainer(engine, GRPOConfig(learning_rate=1e-30, lora_rank=8, lora_alpha=16.0))
        torch.manual_seed(1)
        with torch.no_grad():  # peft starts B at 0, where A's gradient is 0: give both a value
            for name, p in trainer.model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0.0, 0.02)
        _compare_updates(trainer, batch)
    finally:
        engine.stop()


def test_tree_token_budget_gives_verl_one_micro_batch_where_the_tree_fits():
    seqs = [[7] * 100 + [1, i] for i in range(8)]  # 816 tokens, a tree of 100 + 1 + 8 = 109 nodes
    assert tree_token_budget(seqs, 200) == 816  # the tree fits: all rows in one micro-batch
    assert tree_token_budget(seqs, 60) == 408  # two trees' worth: verl splits the rows in two
    assert tree_token_budget(seqs, 1) == 102  # never below the longest row
    assert tree_token_budget([], 64) == 64


@pytest.mark.slow
def test_a_verl_update_over_trees_equals_its_update_over_rows(engine, pristine, episodes):
    """VerlTrainer (patch 7): verl's loss, gradient and π_old from tree forwards are those of verl's padded rows,
    and the shared prompts are forwarded once (under half the tokens)."""
    from lightning_nb.trainers.verl.trainer import VerlConfig, VerlTrainer

    engine.weight_version = 0
    start = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
    runs = {}
    for tree in (False, True):
        with engine.lock, torch.no_grad():
            engine.model.load_state_dict(start)
        trainer = VerlTrainer(engine, VerlConfig(learning_rate=1e-30, prefix_tree=tree))
        runs[tree] = _update_grads(trainer, episodes) + (trainer.last_batch,)
    (rows, g_rows, batch_rows), (tree, g_tree, batch_tree) = runs[False], runs[True]
    assert rows["prefix_shared_tokens"] == 0 and tree["prefix_shared_tokens"] > 0
    assert tree["forwarded_tokens"] < 0.5 * rows["forwarded_tokens"]
    for key in ("loss", "pg_loss", "grad_norm"):
        assert abs(tree[key] - rows[key]) < 1e-5 * max(1.0, abs(rows[key])), key
    for a, b in zip(batch_tree, batch_rows):  # π_old, from each update's own forward
        assert a["input_ids"] == b["input_ids"]
        assert max(abs(x - y) / max(1.0, abs(y)) for x, y in zip(a["trainer_logprobs"], b["trainer_logprobs"])) < 1e-5
    g_max = max(float(g.abs().max()) for g in g_rows.values())
    g_diff = max(float((g_tree[k] - g_rows[k]).abs().max()) for k in g_rows)
    assert g_max > 0 and g_diff < 1e-5 * g_max, (g_diff, g_max)
