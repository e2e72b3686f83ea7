"""Triplets → verl's DataProto, GRPO advantages through verl, and verl's actor update in this process (no Ray).

The conversion tests use hand-made triplets; the actor tests use the real SmolLM2-135M and verl's own
engine and PPO loss (``lightning_nb.trainers.verl.bridge.VerlActor``), nothing of verl mocked.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from lightning_nb.credit import group_advantages
from lightning_nb.trainers.grpo.trainer import response_logprobs
from lightning_nb.types import Triplet
from lightning_nb.trainers.verl.bridge import VerlActor, grpo_advantages, ppo_config, triplets_to_dataproto

PAD = 0


def _t(rollout_id, turn, prompt, response, reward, group="g", logprobs=None, **kw) -> Triplet:
    return Triplet(rollout_id=rollout_id, attempt_id=f"at-{rollout_id}", group_id=group, turn=turn,
                   prompt_ids=prompt, response_ids=response, reward=reward,
                   logprobs=logprobs if logprobs is not None else [-0.1 * (i + 1) for i in range(len(response))],
                   **kw)


def _row(data, key, b):
    return data.batch[key][b].tolist()


# ----- layout ---------------------------------------------------------------------------
def test_single_turn_rows_are_left_padded_prompts_and_right_padded_responses():
    ts = [_t("a", 0, [11, 12, 13], [21, 22], 1.0, temperature=0.7),
          _t("b", 0, [11, 12], [31, 32, 33, 34], 0.0, temperature=0.0)]
    d = triplets_to_dataproto(ts, pad_token_id=PAD)
    B, P, R = 2, 3, 4
    shapes = {k: tuple(v.shape) for k, v in d.batch.items()}
    assert shapes == {"prompts": (B, P), "responses": (B, R), "input_ids": (B, P + R), "attention_mask": (B, P + R),
                      "position_ids": (B, P + R), "response_mask": (B, R), "token_level_scores": (B, R),
                      "rollout_log_probs": (B, R), "temperature": (B,)}
    for k in ("prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_mask"):
        assert d.batch[k].dtype == torch.int64, k
    for k in ("token_level_scores", "rollout_log_probs", "temperature"):
        assert d.batch[k].dtype == torch.float32, k
    assert _row(d, "prompts", 1) == [PAD, 11, 12]                       # left-padded
    assert _row(d, "responses", 0) == [21, 22, PAD, PAD]                # right-padded
    assert _row(d, "input_ids", 0) == [11, 12, 13, 21, 22, PAD, PAD]
    assert _row(d, "attention_mask", 1) == [0, 1, 1, 1, 1, 1, 1]
    assert _row(d, "response_mask", 0) == [1, 1, 0, 0]
    # verl's compute_position_id_with_mask: cumsum(attention_mask) - 1, clipped at 0
    assert _row(d, "position_ids", 0) == [0, 1, 2, 3, 4, 4, 4]
    assert _row(d, "position_ids", 1) == [0, 0, 1, 2, 3, 4, 5]
    assert _row(d, "token_level_scores", 0) == [0.0, 1.0, 0.0, 0.0]     # on the last response token
    assert _row(d, "rollout_log_probs", 0) == pytest.approx([-0.1, -0.2, 0.0, 0.0])
    assert _row(d, "temperature", 0) == pytest.approx(0.7) and _row(d, "temperature", 1) == 1.0  # greedy → 1
    assert list(d.non_tensor_batch["uid"]) == ["g", "g"]
    assert list(d.non_tensor_batch["rollout_id"]) == ["a", "b"] and list(d.non_tensor_batch["turn"]) == [0, 0]
    assert d.meta_info == {"pad_token_id": PAD}


def test_a_two_turn_episode_packs_into_one_row_with_tool_tokens_masked():
    turn0 = _t("ep", 0, [11, 12], [21, 22], 1.0, logprobs=[-1.0, -2.0])
    turn1 = _t("ep", 1, [11, 12, 21, 22, 41, 42, 43], [51], 1.0, logprobs=[-3.0], step_reward=0.25)
    d = triplets_to_dataproto([turn1, turn0], pad_token_id=PAD)  # order of the list does not matter: turn does
    assert len(d) == 1
    assert _row(d, "prompts", 0) == [11, 12]                             # the first turn's prompt only
    assert _row(d, "responses", 0) == [21, 22, 41, 42, 43, 51]           # reply, tool result, reply
    assert _row(d, "response_mask", 0) == [1, 1, 0, 0, 0, 1]
    assert _row(d, "rollout_log_probs", 0) == pytest.approx([-1.0, -2.0, 0.0, 0.0, 0.0, -3.0])
    # turn 1's step reward and the final reward both land on turn 1's last token
    assert _row(d, "token_level_scores", 0) == pytest.approx([0, 0, 0, 0, 0, 1.25])
    assert list(d.non_tensor_batch["turn"]) == [0]


def test_a_step_reward_lands_on_the_last_token_of_its_own_turn():
    turn0 = _t("ep", 0, [11], [21, 22], 0.0, step_reward=-0.5)
    turn1 = _t("ep", 1, [11, 21, 22, 41], [51, 52], 0.0)
    d = triplets_to_dataproto([turn0, turn1], pad_token_id=PAD)
    assert _row(d, "token_level_scores", 0) == pytest.approx([0, -0.5, 0, 0, 0])


def test_a_fork_starts_a_new_row_and_the_final_reward_goes_to_the_episodes_last_row():
    turn0 = _t("ep", 0, [11, 12], [21, 22], 1.0)
    turn1 = _t("ep", 1, [11, 12, 21, 99, 41], [51, 52], 1.0)  # the history was re-tokenized: 99 != 22
    d = triplets_to_dataproto([turn0, turn1], pad_token_id=PAD)
    assert len(d) == 2
    assert _row(d, "prompts", 1) == [11, 12, 21, 99, 41] and _row(d, "prompts", 0) == [PAD] * 3 + [11, 12]
    assert _row(d, "responses", 1) == [51, 52]
    assert list(d.non_tensor_batch["rollout_id"]) == ["ep", "ep"] and list(d.non_tensor_batch["turn"]) == [0, 1]
    assert sum(_row(d, "token_level_scores", 0)) == 0.0
    assert _row(d, "token_level_scores", 1) == [0.0, 1.0]
    # pack_turns=False: one row per turn even where the turns extend each other
    packed = [_t("p", 0, [11], [21], 0.0), _t("p", 1, [11, 21, 41], [51], 0.0)]
    assert len(triplets_to_dataproto(packed, pad_token_id=PAD)) == 1
    assert len(triplets_to_dataproto(packed, pad_token_id=PAD, pack_turns=False)) == 2


def test_fixed_widths_pad_to_max_lengths_and_refuse_longer_sequences():
    ts = [_t("a", 0, [11, 12], [21], 1.0)]
    d = triplets_to_dataproto(ts, pad_token_id=PAD, max_prompt_len=4, max_response_len=3)
    assert _row(d, "input_ids", 0) == [PAD, PAD, 11, 12, 21, PAD, PAD]
    with pytest.raises(ValueError, match="max_prompt_len=1"):
        triplets_to_dataproto(ts, pad_token_id=PAD, max_prompt_len=1)
    with pytest.raises(ValueError, match="max_response_len=0"):
        triplets_to_dataproto(ts, pad_token_id=PAD, max_response_len=0)


def test_bad_batches_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="no triplets"):
        triplets_to_dataproto([], pad_token_id=PAD)
    with pytest.raises(ValueError, match="empty response_ids"):
        triplets_to_dataproto([_t("a", 0, [1], [], 1.0)], pad_token_id=PAD)
    with pytest.raises(ValueError, match="one group"):
        triplets_to_dataproto([_t("a", 0, [1], [2], 1.0, group="x"), _t("a", 1, [1, 2, 3], [4], 1.0, group="y")],
                              pad_token_id=PAD)
    # turns at two temperatures are not packed into one row (verl divides a row's logits by one temperature)
    mixed = [_t("m", 0, [1], [2], 1.0, temperature=0.8), _t("m", 1, [1, 2, 3], [4], 1.0, temperature=1.0)]
    assert triplets_to_dataproto(mixed, pad_token_id=PAD).batch["temperature"].tolist() == pytest.approx([0.8, 1.0])
    with pytest.raises(ValueError, match="no entry for rollout 'b'"):
        triplets_to_dataproto([_t("a", 0, [1], [2], 1.0), _t("b", 0, [1], [3], 0.0)], pad_token_id=PAD,
                              advantages={"a": 1.0})


def test_rollout_log_probs_are_left_out_when_a_triplet_has_none():
    ts = [_t("a", 0, [1], [2], 1.0), Triplet(rollout_id="b", attempt_id="x", group_id="g", turn=0, prompt_ids=[1],
                                              response_ids=[3], reward=0.0)]
    assert "rollout_log_probs" not in triplets_to_dataproto(ts, pad_token_id=PAD).batch.keys()


def test_given_advantages_fill_the_response_tokens_per_episode_or_per_turn():
    turn0 = _t("ep", 0, [11], [21, 22], 1.0)
    turn1 = _t("ep", 1, [11, 21, 22, 41], [51], 1.0)
    d = triplets_to_dataproto([turn0, turn1], pad_token_id=PAD, advantages={"ep": 0.5})
    assert _row(d, "advantages", 0) == [0.5, 0.5, 0.0, 0.5]
    d = triplets_to_dataproto([turn0, turn1], pad_token_id=PAD, advantages={("ep", 0): 0.5, ("ep", 1): -1.0})
    assert _row(d, "advantages", 0) == [0.5, 0.5, 0.0, -1.0]


# ----- advantages through verl ----------------------------------------------------------
def _grouped_batch():
    """Two groups of four single- and two-turn episodes (one forked), with an intermediate reward."""
    ts = []
    for g, rewards in (("g1", [1.0, 0.0, 0.0, 0.5]), ("g2", [0.0, 1.0, 1.0, 0.0])):
        for i, r in enumerate(rewards):
            rid = f"{g}-{i}"
            ts.append(_t(rid, 0, [11, 12 + i], [21, 22 + i], r, group=g))
            if i == 1:  # packed second turn with a step reward
                ts.append(_t(rid, 1, [11, 12 + i, 21, 22 + i, 41], [51], r, group=g, step_reward=0.5))
            if i == 2:  # a fork
                ts.append(_t(rid, 1, [11, 77, 41], [51, 52], r, group=g))
    return ts


def test_uids_are_the_group_ids_and_grpo_advantages_equal_group_advantages_per_episode():
    ts = _grouped_batch()
    d = triplets_to_dataproto(ts, pad_token_id=PAD)
    rids = list(d.non_tensor_batch["rollout_id"])
    assert len(d) == 10 and rids.count("g1-2") == 2  # the fork is two rows
    assert [u for u, r in zip(d.non_tensor_batch["uid"], rids)] == [r.split("-")[0] for r in rids]
    rewards = {t.rollout_id: t.reward for t in ts}
    for t in ts:
        rewards[t.rollout_id] += t.step_reward  # GRPOTrainer's episode reward (credit="episode")
    groups = {t.rollout_id: t.group_id for t in ts}
    for norm in (True, False):
        expected, dropped = group_advantages(rewards, groups, norm_by_std=norm)
        adv_B_R = grpo_advantages(d, norm_adv_by_std=norm)
        assert adv_B_R.shape == d.batch["response_mask"].shape and not dropped
        mask = d.batch["response_mask"].bool()
        for b, rid in enumerate(rids):
            assert torch.allclose(adv_B_R[b][mask[b]], torch.tensor(expected[rid]), atol=1e-6), (rid, norm)
            assert (adv_B_R[b][~mask[b]] == 0).all()


def test_without_forks_grpo_advantages_equal_verls_call_on_the_batch_itself():
    from verl.trainer.ppo import core_algos

    ts = [t for t in _grouped_batch() if not (t.rollout_id.endswith("-2") and t.turn == 1)]
    d = triplets_to_dataproto(ts, pad_token_id=PAD)
    assert len(d) == 8
    direct, _ = core_algos.compute_grpo_outcome_advantage(
        token_level_rewards=d.batch["token_level_scores"], response_mask=d.batch["response_mask"],
        index=d.non_tensor_batch["uid"], norm_adv_by_std_in_grpo=True)
    assert torch.allclose(grpo_advantages(d), direct, atol=1e-6)


def test_a_group_below_min_group_size_is_refused():
    d = triplets_to_dataproto([_t("a", 0, [1], [2], 1.0, group="lone"), _t("b", 0, [1], [3], 0.0, group="g"),
                               _t("c", 0, [1], [4], 1.0, group="g")], pad_token_id=PAD)
    with pytest.raises(ValueError, match="group 'lone' has 1 episode"):
        grpo_advantages(d)
    assert float(grpo_advantages(d, min_group_size=1)[0, 0]) == pytest.approx(1.0)  # verl's rule: mean 0, std 1


# ----- verl's actor ---------------------------------------------------------------------
def test_verls_actor_runs_in_process_on_a_small_llama_and_scores_like_ours():
    """verl's engine and loss on a 2-layer Llama with random weights (no download): the fast tier's check."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=4)).eval()
    ts = [_t("a", 0, [5, 6, 7], [8, 9], 1.0, temperature=0.7),
          _t("a", 1, [5, 6, 7, 8, 9, 10], [12], 1.0, temperature=0.7),
          _t("b", 0, [5, 6], [8, 9, 4], 0.0), _t("c", 0, [5], [8], 0.0)]
    d = triplets_to_dataproto(ts, pad_token_id=PAD)
    actor = VerlActor(model, ppo_config(["actor_rollout_ref.actor.optim.lr=1e-2"]))
    old = actor.compute_log_prob(d).batch["old_log_probs"]
    for row in range(len(d)):  # the same log-probs as GRPOTrainer's response_logprobs (row temperature applied)
        ids = d.batch["input_ids"][row][d.batch["attention_mask"][row].bool()]
        P = int(d.batch["attention_mask"][row, : d.batch["prompts"].shape[1]].sum())
        m = d.batch["response_mask"][row][: len(ids) - P].float()
        with torch.no_grad():
            mask_B_L = torch.cat([torch.zeros(P - 1), m])[None]
            ours = response_logprobs(model, ids[None], torch.ones_like(ids)[None], mask_B_L,
                                     d.batch["temperature"][row: row + 1])[0, P - 1:]
        assert float((ours - old[row, : len(ids) - P] * m).abs().max()) < 1e-5
    before = {k: v.clone() for k, v in model.state_dict().items()}
    d = d.union(actor.compute_log_prob(d))
    d.batch["advantages"] = grpo_advantages(d)
    metrics = actor.update_policy(d)
    assert metrics["optimizer_steps"] == 1 and metrics["grad_norm"] > 0 and metrics["lr"] == pytest.approx(1e-2)
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not model.training  # left in the mode it was in
    with pytest.raises(ValueError, match="advantages"):
        actor.update_policy(triplets_to_dataproto(ts, pad_token_id=PAD))


def test_the_output_head_runs_from_the_first_response_position_with_verls_log_probs_and_step():
    """Patch 6: verl's forward takes logits from each micro-batch's first response position on (not over the
    prompts); the log-probs where verl reads them, the loss and the step equal verl's own full head's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=4)).eval()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    ts = [_t("a", 0, [5, 6, 7, 3, 3, 3, 3], [8, 9], 1.0, temperature=0.7),
          _t("a", 1, [5, 6, 7, 3, 3, 3, 3, 8, 9, 10], [12], 1.0, temperature=0.7),
          _t("b", 0, [5, 6, 3, 3, 3, 3], [8, 9, 4], 0.0), _t("c", 0, [5, 3, 3, 3, 3, 3], [8], 0.0)]
    rows = {}
    for full in (True, False):
        model.load_state_dict(start)
        heads = []
        hook = model.lm_head.register_forward_hook(lambda m, args, out: heads.append(args[0].shape[1]))
        actor = VerlActor(model, ppo_config(["actor_rollout_ref.actor.optim.lr=1e-2"]), response_logits_only=not full,
                          prefix_tree=False)  # patch 6 alone; patch 7: test_prefix_tree.py
        d = triplets_to_dataproto(ts, pad_token_id=PAD)
        d = d.union(actor.compute_log_prob(d))
        d.batch["advantages"] = grpo_advantages(d)
        metrics = actor.update_policy(d)
        hook.remove()
        rows[full] = (d.batch["old_log_probs"], metrics, {k: v.clone() for k, v in model.state_dict().items()}, heads)
    (old_full, m_full, w_full, heads_full), (old, m, w, heads) = rows[True], rows[False]
    response = d.batch["attention_mask"][:, d.batch["prompts"].shape[1]:].bool()  # every position after the prompt
    assert torch.equal(old_full * response, old) and float(old[response].abs().min()) > 0
    assert m["loss"] == pytest.approx(m_full["loss"], abs=1e-6) and m["grad_norm"] == pytest.approx(m_full["grad_norm"])
    for k in w:
        torch.testing.assert_close(w[k], w_full[k], rtol=0, atol=1e-7)
    assert any(not torch.equal(w[k], start[k]) for k in w)
    assert max(heads) < min(heads_full), (heads, heads_full)  # the prompts (6-7 tokens) got no logits


# ----- verl's actor on the real model ---------------------------------------------------
def _prompt(engine, question="What is 17 + 25? Answer with a number."):
    return engine.apply_chat_template([{"role": "user", "content": question}])


def _triplet(gen, rollout_id, reward, turn=0, group="q") -> Triplet:
    return Triplet(rollout_id=rollout_id, attempt_id=f"at-{rollout_id}", group_id=group, turn=turn,
                   prompt_ids=gen.prompt_ids, response_ids=gen.completion_ids, logprobs=gen.logprobs,
                   reward=reward, temperature=gen.temperature)


def _seq_logprob(model, gen) -> float:
    ids_B_T = torch.tensor([gen.prompt_ids + gen.completion_ids])
    mask_B_L = torch.tensor([[0.0] * (len(gen.prompt_ids) - 1) + [1.0] * len(gen.completion_ids)])
    with torch.no_grad():
        logp = response_logprobs(model, ids_B_T, torch.ones_like(ids_B_T), mask_B_L, torch.tensor([gen.temperature]))
    return float(logp.sum())


@pytest.mark.slow
def test_verls_old_log_probs_match_the_engines_and_ours_on_single_and_multi_turn_rows(engine, distinct_generations):
    prompt = _prompt(engine)
    a, b = distinct_generations(engine, prompt, 2, temperature=0.8)
    # a second turn that extends episode "a": its history, a tool result, the model's next reply
    tool = engine.tokenizer.encode("<|im_start|>user\nTool says: 42<|im_end|>\n<|im_start|>assistant\n")
    a2 = engine.generate(a.prompt_ids + a.completion_ids + tool, temperature=0.8, max_tokens=8)
    ts = [_triplet(a, "a", 1.0), _triplet(a2, "a", 1.0, turn=1), _triplet(b, "b", 0.0)]
    d = triplets_to_dataproto(ts, pad_token_id=engine.pad_token_id)
    assert len(d) == 2 and d.batch["response_mask"][0].tolist().count(0) >= len(tool)
    with engine.lock:
        actor = VerlActor(engine.model, ppo_config())
        old = actor.compute_log_prob(d).batch["old_log_probs"]
    mask = d.batch["response_mask"].bool()
    assert old.shape == mask.shape and old.dtype == torch.float32
    # against the engine's sampling log-probs (both turns of the packed row, at their own temperatures)
    assert float((old - d.batch["rollout_log_probs"])[mask].abs().max()) < 1e-4
    # against GRPOTrainer's response_logprobs of the same tokens
    for row in range(len(d)):
        ids = d.batch["input_ids"][row][d.batch["attention_mask"][row].bool()]
        P = int(d.batch["attention_mask"][row, : d.batch["prompts"].shape[1]].sum())
        m = d.batch["response_mask"][row][: len(ids) - P].float()
        mask_B_L = torch.cat([torch.zeros(P - 1), m])[None]
        ours = response_logprobs(engine.model, ids[None], torch.ones_like(ids)[None], mask_B_L,
                                 d.batch["temperature"][row: row + 1])[0, P - 1:]
        assert float((ours - old[row, : len(ids) - P] * m).abs().max()) < 1e-4


@pytest.mark.slow
def test_one_verl_actor_update_raises_the_rewarded_completion_and_lowers_the_others(
        engine, pristine, distinct_generations):
    prompt = _prompt(engine)
    gens = distinct_generations(engine, prompt, 4)
    d = triplets_to_dataproto([_triplet(g, f"r{i}", 1.0 if i == 0 else 0.0) for i, g in enumerate(gens)],
                              pad_token_id=engine.pad_token_id)
    before = [_seq_logprob(engine.model, g) for g in gens]
    weights = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
    with engine.lock:
        actor = VerlActor(engine.model, ppo_config(["actor_rollout_ref.actor.optim.lr=2e-5"]))
        t0 = time.perf_counter()
        d = d.union(actor.compute_log_prob(d))
        t1 = time.perf_counter()
        d.batch["advantages"] = grpo_advantages(d)
        metrics = actor.update_policy(d)
        t2 = time.perf_counter()
        engine.load_weights(engine.model)
    print(f"verl on CPU, 4 rows x {d.batch['input_ids'].shape[1]} tokens: compute_log_prob {t1 - t0:.2f} s, "
          f"update_policy {t2 - t1:.2f} s; metrics {metrics}")
    assert metrics["optimizer_steps"] == 1 and metrics["grad_norm"] > 0 and np.isfinite(metrics["loss"])
    assert metrics["actor/pg_clipfrac"] == 0.0  # π_old is the policy itself: ratio 1
    assert any(not torch.equal(weights[k], v) for k, v in engine.model.state_dict().items())
    after = [_seq_logprob(engine.model, g) for g in gens]
    assert after[0] > before[0] + 1e-3, (before, after)
    for i in (1, 2, 3):
        assert after[i] < before[i] - 1e-4, (i, before, after)


@pytest.mark.slow
def test_one_verl_update_takes_the_same_step_as_one_grpo_trainer_update(engine, pristine, distinct_generations):
    """Same batch, same optimizer settings, π_old = the engine's log-probs (verl's bypass mode): same weights."""
    from lightning_nb import GRPOConfig, GRPOTrainer

    gens = distinct_generations(engine, _prompt(engine), 4)
    ts = [_triplet(g, f"r{i}", [1.0, 0.0, 0.5, 0.0][i]) for i, g in enumerate(gens)]
    initial = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
    trainer = GRPOTrainer(engine, GRPOConfig(track_reference_kl=False))  # lr 2e-5, no weight decay, clip 1.0
    t0 = time.perf_counter()
    trainer.update(ts)
    t1 = time.perf_counter()
    grpo = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
    with engine.lock, torch.no_grad():
        engine.model.load_state_dict(initial)
    d = triplets_to_dataproto(ts, pad_token_id=engine.pad_token_id)
    d.batch["old_log_probs"] = d.batch["rollout_log_probs"]
    d.batch["advantages"] = grpo_advantages(d)
    with engine.lock:
        actor = VerlActor(engine.model, ppo_config(["actor_rollout_ref.actor.optim.lr=2e-5",
                                                    "actor_rollout_ref.actor.optim.weight_decay=0.0"]))
        t2 = time.perf_counter()
        actor.update_policy(d)
        t3 = time.perf_counter()
    verl = engine.model.state_dict()
    # AdamW's first step is about lr * sign(gradient), so elements with near-zero gradients may flip with float
    # noise: compare the whole steps, not single elements
    step_grpo = torch.cat([(grpo[k] - initial[k]).flatten() for k in initial])
    step_verl = torch.cat([(verl[k] - initial[k]).flatten() for k in initial])
    rel = float((step_verl - step_grpo).norm() / step_grpo.norm())
    flipped = float(((step_verl - step_grpo).abs() > 1e-5).float().mean())
    print(f"verl step vs GRPOTrainer step: relative L2 gap {rel:.2e}, elements off by > lr/2: {flipped:.2e}; "
          f"GRPOTrainer.update {t1 - t0:.2f} s, VerlActor.update_policy {t3 - t2:.2f} s")
    assert float(step_grpo.norm()) > 0 and rel < 0.01 and flipped < 1e-4


# ----- devices ---------------------------------------------------------------------------
def test_the_batch_is_built_on_the_given_device_and_advantages_stay_there():
    """The CPU check of a device mix (issue 29: on CUDA, verl returned its log-probs on the GPU while the batch
    stayed on the CPU). PyTorch's ``meta`` device stands in for a second device: any tensor made without the
    batch's device (a CPU ``torch.zeros`` meeting a meta tensor) raises, as CPU and CUDA tensors do."""
    ts = _grouped_batch()
    d = triplets_to_dataproto(ts, pad_token_id=PAD, device="meta")
    assert {str(v.device) for v in d.batch.values()} == {"meta"}
    assert set(d.batch.keys()) >= {"input_ids", "rollout_log_probs", "token_level_scores", "response_mask"}
    adv = grpo_advantages(d)
    assert adv.device.type == "meta" and adv.shape == d.batch["response_mask"].shape
    cpu = triplets_to_dataproto(ts, pad_token_id=PAD)
    assert {str(v.device) for v in cpu.batch.values()} == {"cpu"}  # None: the CPU, as before
    assert torch.equal(cpu.batch["input_ids"], triplets_to_dataproto(ts, pad_token_id=PAD, device="cpu").batch["input_ids"])


def test_verls_actor_names_its_device_and_moves_a_batch_given_elsewhere():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=4)).eval()
    actor = VerlActor(model, ppo_config())
    assert actor.device == torch.device("cpu")
    d = triplets_to_dataproto([_t("a", 0, [5, 6], [8, 9], 1.0), _t("b", 0, [5], [8], 0.0)], pad_token_id=PAD,
                              device=actor.device)
    out = actor.compute_log_prob(d).batch["old_log_probs"]
    assert out.device == actor.device and out.shape == d.batch["responses"].shape
    assert (out - d.batch["rollout_log_probs"]).shape == out.shape  # the comparison the trainer makes
