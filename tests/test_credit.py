"""Per-turn credit: intermediate rewards (emit_intermediate_reward), their attribution to LLM calls, agent names
and selective optimisation (TripletAdapter(agent_match=...)), and GRPOConfig.credit ("episode", "reward_to_go").

Attribution runs through a real runner, the LLM proxy and the session's SmolLM2-135M; the credit tests train the
real model on hand-built triplets whose returns and advantages are worked out by hand below.
"""

from __future__ import annotations

import html
import re
import statistics

import pytest
import torch
from openai import OpenAI

from lightning_nb import GRPOConfig, GRPOTrainer, emit_intermediate_reward, semconv
from lightning_nb.adapter import TripletAdapter, attribute_intermediate_rewards, triplets_df
from lightning_nb.inspect.audit import batch_html
from lightning_nb.errors import ConfigError, InvalidRewardError, LightningNbError
from lightning_nb.semconv import LLM_SPAN as LLM_SPAN_NAME
from lightning_nb.runners.runner import Runner
from lightning_nb.tracing.tracer import Tracer
from lightning_nb.credit import group_advantages, reward_to_go
from lightning_nb.types import Span, Triplet

pytestmark = pytest.mark.slow


# ----- attribution through a real runner and proxy ------------------------------------------------------
def _two_agent_system(task, llm):
    """A solver and a critic sharing one rollout; intermediate rewards between their calls."""
    solver = OpenAI(base_url=llm.endpoint, api_key="x", max_retries=0, default_headers={"X-Agent-Name": "solver"})
    critic = OpenAI(base_url=llm.endpoint, api_key="x", max_retries=0)

    def ask(client, text, **kw):
        client.chat.completions.create(model=llm.model, messages=[{"role": "user", "content": text}],
                                       max_tokens=3, temperature=1.0, **kw)

    emit_intermediate_reward(0.25, name="plan")  # before any call: the first call's
    ask(solver, "Say hi.")  # call 0 (solver)
    emit_intermediate_reward(-1.0)  # tool_error after call 0
    emit_intermediate_reward(0.5, name="tool_ok", tool="calc")
    ask(critic, "Is hi right?", extra_headers={"x-agent-name": "critic"})  # call 1 (critic); header case differs
    emit_intermediate_reward(2.0, name="critic_bonus")  # after call 1
    ask(solver, "Say bye.")  # call 2 (solver); nothing after it
    return 1.0


def test_intermediate_rewards_go_to_the_call_that_ended_before_them(engine, proxied_store):
    store = proxied_store
    rollout = Runner(_two_agent_system, store, Tracer(store)).step({"q": 1})
    assert rollout.status == "succeeded"
    spans = store.query_spans(rollout.rollout_id, "latest")
    inter = [s for s in spans if s.name == "intermediate_reward"]
    assert [(s.attributes[semconv.REWARD], s.attributes[semconv.REWARD_NAME]) for s in inter] == [
        (0.25, "plan"), (-1.0, "tool_error"), (0.5, "tool_ok"), (2.0, "critic_bonus")]
    assert inter[2].attributes["tool"] == "calc"
    calls = [s for s in spans if s.name == LLM_SPAN_NAME]
    assert [s.attributes.get("gen_ai.agent.name") for s in calls] == ["solver", "critic", "solver"]
    assert store.final_rewards() == {rollout.rollout_id: 1.0}  # intermediate rewards leave the final one alone

    everyone = TripletAdapter().adapt(store, [rollout.rollout_id])
    assert [(t.turn, t.agent_name, t.reward) for t in everyone] == [(0, "solver", 1.0), (1, "critic", 1.0),
                                                                     (2, "solver", 1.0)]
    assert [t.step_reward for t in everyone] == [0.25 - 1.0 + 0.5, 2.0, 0.0]

    adapter = TripletAdapter(agent_match="^solver$")
    solver = adapter.adapt(store, [rollout.rollout_id])
    assert [(t.turn, t.agent_name, t.step_reward) for t in solver] == [(0, "solver", -0.25), (2, "solver", 0.0)]
    assert adapter.last_skipped["llm_spans_not_matched"] == 1
    assert adapter.last_skipped["intermediate_rewards_dropped"] == 1  # the critic's 2.0 is not moved to a solver call
    assert [t.prompt_ids for t in solver] == [everyone[0].prompt_ids, everyone[2].prompt_ids]
    df = triplets_df(solver)
    assert list(df.agent_name) == ["solver", "solver"] and list(df.step_reward) == [-0.25, 0.0]

    assert TripletAdapter(agent_match="crit").adapt(store, [rollout.rollout_id])[0].agent_name == "critic"  # search
    nobody = TripletAdapter(agent_match="^judge$")
    assert nobody.adapt(store, [rollout.rollout_id]) == []
    assert nobody.last_skipped["no_matching_llm_calls"] == 1 and nobody.last_skipped["llm_spans_not_matched"] == 3


def test_attribution_rule_on_exact_times_and_ties():
    def span(name, seq, start, end, **attributes):
        return Span(rollout_id="r", attempt_id="a", sequence_id=seq, trace_id="t", span_id=f"{name}{seq}",
                    name=name, start_time=start, end_time=end, attributes=attributes)

    llm, ir = LLM_SPAN_NAME, "intermediate_reward"
    spans = [
        span(ir, 1, 0.5, 0.5, **{semconv.REWARD: 1.0}),  # before any call ended -> the first call (by start time)
        span(llm, 3, 1.0, 2.0),  # ends at 2.0, stored before the tie reward (seq 4)
        span(ir, 4, 2.0, 2.0, **{semconv.REWARD: 2.0}),  # starts the instant call 3 ends: call 3 (stored first)
        span(llm, 5, 1.5, 3.0),  # overlapping call; ends later
        span(ir, 6, 2.5, 2.5, **{semconv.REWARD: 4.0}),  # call 5 has not ended yet -> call 3
        span(ir, 2, 3.0, 3.0, **{semconv.REWARD: 8.0}),  # same instant as call 5's end but stored before it -> call 3
        span(ir, 7, 3.5, 3.5, **{semconv.REWARD: 16.0}),  # after both -> call 5, the one that ended most recently
        span("reward", 8, 4.0, 4.0, **{semconv.REWARD: 0.0}),  # the final reward is not an intermediate one
    ]
    assert attribute_intermediate_rewards(spans) == {f"{llm}3": [1.0, 8.0, 2.0, 4.0], f"{llm}5": [16.0]}
    assert attribute_intermediate_rewards([s for s in spans if s.name != llm]) == {}


def test_emit_intermediate_reward_checks_its_value_and_needs_a_rollout():
    with pytest.raises(InvalidRewardError, match="intermediate reward must be a finite real number"):
        emit_intermediate_reward(float("nan"))
    with pytest.raises(LightningNbError, match="emit_intermediate_reward was called outside a rollout"):
        emit_intermediate_reward(1.0)


# ----- credit modes on hand-built triplets -----------------------------------------------------------------
def _episode(rid, group, final, steps, *, base=300, turn_step=1):
    """One episode whose turn k extends turn k-1 (prompt + 2 response tokens + 1 tool-result token)."""
    prompt, out = [1, base, base + 1], []
    for k, s in enumerate(steps):
        response = [base + 10 + 3 * k, base + 11 + 3 * k]
        out.append(Triplet(rollout_id=rid, attempt_id=f"at-{rid}", group_id=group, turn=k * turn_step,
                           prompt_ids=list(prompt), response_ids=response, reward=final, step_reward=s))
        prompt = prompt + response + [base + 50 + k]
    return out


def _update(engine, batch, **config):
    with torch.no_grad():
        engine.model.load_state_dict(engine.initial_state)
    trainer = GRPOTrainer(engine, GRPOConfig(track_reference_kl=False, **config))
    return trainer, trainer.update(batch)


def test_reward_to_go_returns_and_advantages_by_hand(engine, pristine):
    assert reward_to_go([0.5, 0.0, -0.25], 1.0, 0.5) == [0.6875, 0.375, 0.75]
    # group g: e1 has 3 turns (turn numbers 0, 2, 4: gaps as agent_match leaves), e2 has 2; "solo" has 1 episode
    e1 = _episode("e1", "g", 1.0, [0.5, 0.0, -0.25], turn_step=2)
    e2 = _episode("e2", "g", 0.0, [-0.5, 0.0], base=400)
    solo = _episode("solo", "alone", 1.0, [0.0, 0.0, 1.0], base=500)
    γ = 0.5
    G = {  # G_t = Σ_{k≥t} γ^(k−t) s_k + γ^(T−1−t) R, written out
        ("e1", 0): 0.5 + γ * 0.0 + γ ** 2 * -0.25 + γ ** 2 * 1.0,  # 0.6875
        ("e1", 2): 0.0 + γ * -0.25 + γ * 1.0,  # 0.375
        ("e1", 4): -0.25 + 1.0,  # 0.75
        ("e2", 0): -0.5 + γ * 0.0 + γ * 0.0,  # -0.5
        ("e2", 1): 0.0 + 0.0,
    }
    mean, std = statistics.mean(G.values()), statistics.stdev(G.values())  # over the group's 5 transitions
    want = {k: (g - mean) / (std + 1e-6) for k, g in G.items()}
    trainer, m = _update(engine, e1 + e2 + solo, credit="reward_to_go", gamma=γ)
    assert set(trainer.last_turn_advantages) == set(want)  # "alone" has one episode (3 transitions): dropped
    for k, a in want.items():
        assert trainer.last_turn_advantages[k] == pytest.approx(a, abs=1e-6), k
    assert m["groups_dropped"] == 1 and m["episodes"] == 2 and m["groups_with_signal"] == 1
    assert m["intermediate_rewards"] == 4 and m["transitions"] == 8 and m["sequences_trained"] == 2

    # one packed sequence per episode, each token carrying its own turn's advantage
    rows = {row["rollout_id"]: row for row in trainer.last_batch}
    for rid, ts in (("e1", e1), ("e2", e2)):
        row = rows[rid]
        assert row["input_ids"] == ts[-1].prompt_ids + ts[-1].response_ids
        expected = [0.0] * len(row["input_ids"])
        for t in ts:
            for j in range(len(t.prompt_ids), len(t.prompt_ids) + len(t.response_ids)):
                expected[j] = want[(rid, t.turn)]
        assert row["advantages"] == pytest.approx(expected, abs=1e-6)
        assert row["advantage"] == pytest.approx(statistics.mean(want[(rid, t.turn)] for t in ts), abs=1e-6)
    assert len({round(a, 6) for a, m_ in zip(rows["e1"]["advantages"], rows["e1"]["response_mask"]) if m_}) == 3
    assert trainer.last_advantages["e2"] < 0 < trainer.last_advantages["e1"]
    df = triplets_df(trainer.last_triplets, trainer.last_turn_advantages)
    assert df.set_index(["rollout_id", "turn"]).advantage[("e1", 2)] == pytest.approx(want[("e1", 2)], abs=1e-6)

    # the optimizer's-eye view colours each trained token by its own advantage
    page = batch_html(trainer.last_batch, engine.tokenizer)
    first = page.split('class="lnb-seq"')[1]
    shades = set(re.findall(r'class="lnb-tok lnb-resp[^"]*" style="background:([^;"]+)', first))
    assert len(shades) == 3
    assert "advantage +" in html.unescape(first)

    # Dr. GRPO: no division by the std
    trainer, _ = _update(engine, e1 + e2, credit="reward_to_go", gamma=γ, norm_adv_by_std=False)
    for k, g in G.items():
        assert trainer.last_turn_advantages[k] == pytest.approx(g - mean, abs=1e-6), k


def test_episode_credit_adds_intermediate_rewards_to_the_episode_reward(engine, pristine):
    # e1: R = 1 − 1 = 0 with intermediate rewards; e0: R = 0 without: the same advantage
    batch = (_episode("e1", "g", 1.0, [-0.75, -0.25]) + _episode("e0", "g", 0.0, [0.0, 0.0], base=400)
             + _episode("e2", "g", 1.0, [0.0, 0.0], base=500))
    trainer, m = _update(engine, batch)
    want, _ = group_advantages({"e1": 0.0, "e0": 0.0, "e2": 1.0}, {"e1": "g", "e0": "g", "e2": "g"})
    assert trainer.last_advantages == want and m["intermediate_rewards"] == 2
    for row in trainer.last_batch:  # every token of an episode gets the episode's advantage
        assert {a for a, m_ in zip(row["advantages"], row["response_mask"]) if m_} == {want[row["rollout_id"]]}


def test_episode_credit_without_intermediate_rewards_is_the_plain_update(engine, pristine):
    batch = (_episode("a", "g", 1.0, [0.0, 0.0]) + _episode("b", "g", 0.0, [0.0, 0.0], base=400)
             + _episode("c", "g", 0.0, [0.0, 0.0], base=500) + _episode("d", "h", 1.0, [0.0], base=600)
             + _episode("e", "h", 1.0, [0.0], base=700))
    trainer, m = _update(engine, batch)
    want, _ = group_advantages({"a": 1.0, "b": 0.0, "c": 0.0, "d": 1.0, "e": 1.0},
                               {"a": "g", "b": "g", "c": "g", "d": "h", "e": "h"})
    assert trainer.last_advantages == want  # bit for bit: the rule of before
    assert {row["rollout_id"]: row["advantage"] for row in trainer.last_batch} == want
    assert m["intermediate_rewards"] == 0 and m["groups_with_signal"] == 1
    assert m["sequences_trained"] == 3  # group h has advantage 0 on every token: skipped
    assert trainer.signal_groups(batch) == {"g"}


def test_an_episode_with_a_baseline_trains_on_reward_minus_baseline_even_alone_in_its_group(engine, pristine):
    """Issue 43: traffic seen once has no group to compare against; its Triplet.baseline gives the advantage."""
    def with_baseline(ts, b):
        return [t.model_copy(update={"baseline": b}) for t in ts]

    alone = with_baseline(_episode("up", "u", 1.0, [0.0, 0.25]), 0.5)  # R = 1.25, b = 0.5: +0.75
    down = with_baseline(_episode("down", "d", 0.0, [0.0], base=400), 0.5)  # 0 − 0.5: −0.5
    grpo = _episode("g1", "g", 1.0, [0.0], base=500) + _episode("g0", "g", 0.0, [0.0], base=600)
    trainer, m = _update(engine, alone + down + grpo)
    want, _ = group_advantages({"g1": 1.0, "g0": 0.0}, {"g1": "g", "g0": "g"})
    assert trainer.last_advantages == pytest.approx({"up": 0.75, "down": -0.5, **want}, abs=1e-6)
    assert m["groups_dropped"] == 0 and m["episodes"] == 4 and trainer.signal_groups(alone + down) == {"u", "d"}
    assert trainer.signal_groups(with_baseline(_episode("z", "z", 0.5, [0.0]), 0.5)) == set()  # reward = baseline
    trainer, _ = _update(engine, alone, credit="reward_to_go")  # each turn's return minus the baseline
    assert trainer.last_turn_advantages == pytest.approx({("up", 0): 0.75, ("up", 1): 0.75}, abs=1e-6)
    with pytest.raises(ValueError, match="baseline must be a finite number"):
        Triplet.model_validate({**alone[0].model_dump(), "baseline": float("nan")})


def test_single_turn_reward_to_go_with_gamma_1_trains_exactly_like_episode_credit(engine, pristine):
    batch = [t for i, r in enumerate([1.0, 0.0, 0.0, 1.0, 0.5]) for t in _episode(f"s{i}", "g", r, [0.0],
                                                                                      base=300 + 100 * i)]
    after = {}
    for credit in ("episode", "reward_to_go"):
        trainer, m = _update(engine, batch, credit=credit)
        after[credit] = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
        assert m["optimizer_steps"] == 1
    assert all(torch.equal(after["episode"][k], after["reward_to_go"][k]) for k in after["episode"])


# ----- config ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, field", [
    (dict(credit="per_token"), "credit"), (dict(gamma=0.0), "gamma"), (dict(gamma=1.5), "gamma"),
    (dict(gamma=float("nan")), "gamma"), (dict(credit="reward_to_go", kl_mode="reward"), "kl_mode"),
    (dict(gamma=0.9), "gamma"),  # credit="episode" has nothing to discount: not silently ignored
])
def test_invalid_credit_options_name_the_field_and_the_fix(kwargs, field):
    with pytest.raises(ConfigError, match=rf"GRPOConfig\.{field}=.* is invalid: it must be .*; "):
        GRPOConfig(**kwargs)
    assert GRPOConfig(credit="reward_to_go", gamma=0.9, kl_mode="loss").gamma == 0.9


def test_agent_match_must_be_a_regular_expression():
    with pytest.raises(ConfigError, match=r"TripletAdapter\(agent_match='\(solver'\) is not a valid regular"):
        TripletAdapter(agent_match="(solver")
