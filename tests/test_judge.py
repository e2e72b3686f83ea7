"""LLM-judge rewards (issue 31, item 3): a judge inside an agent, and a group-relative (RULER-style) judge.

The judge is the real SmolLM2-135M (the session engine) behind a real LLMProxy, over HTTP. Only the parse-error
tests point a judge at a tiny real HTTP server that answers every chat completion with one fixed reply: a 135M
judge's format errors are not reproducible on demand.
"""

from __future__ import annotations

import itertools
import json
import warnings
from collections import Counter

import pytest
from openai import OpenAI

from lightning_nb import (AlgorithmConfig, GRPOConfig, GRPOTrainer, InMemoryStore, LightningRL, LLMProxy,
                          TripletAdapter, semconv, start_runners, tool_span)
from lightning_nb.errors import ConfigError, LightningNbError
from lightning_nb.rewards import (GroupJudge, Judge, JudgeError, judge_reward, parse_group_scores, parse_score,
                                  trajectory_messages)
from lightning_nb.types import LLMResource
from conftest import IDLE_LLM, FixedChatServer

JUDGED_KEYS = [semconv.JUDGE_PROMPT, semconv.JUDGE_VERDICT, semconv.JUDGE_SCORE, semconv.JUDGE_MODEL,
               semconv.REWARD_NAME, semconv.ERROR]


@pytest.fixture
def fixed_reply():
    """``start(text) -> base_url``: a real OpenAI-compatible HTTP server on 127.0.0.1 whose every chat completion is
    ``text`` (``conftest.FixedChatServer``; the request bodies it got are in ``start.requests``)."""
    servers = []

    def start(text):
        server = FixedChatServer(lambda _last_message: text)
        servers.append(server)
        start.requests = server.requests
        return server.url

    yield start
    for server in servers:
        server.close()


def _say(llm, content, max_tokens=6):
    """One call of the policy through the attempt's URL (recorded: a trainable LLM span); its reply."""
    with OpenAI(base_url=llm.endpoint, api_key="x", max_retries=0) as client:
        reply = client.chat.completions.create(model=llm.model, messages=[{"role": "user", "content": content}],
                                               max_tokens=max_tokens, temperature=0.0)
    return reply.choices[0].message.content or ""


# ----- parsing and arguments (no model) ---------------------------------------------------------------------
def test_scores_are_parsed_from_the_last_score_line_and_bad_ones_name_the_field():
    assert parse_score("Right.\nSCORE: 0\nOn second thought:\nscore: 1") == 1.0
    assert parse_score("SCORE: 7.5", (0, 10)) == 7.5
    with pytest.raises(JudgeError, match="no 'SCORE: <number>' line .*field 'score'.*It is fine") as err:
        parse_score("It is fine.")
    assert err.value.field == "score" and err.value.verdict == "It is fine." and isinstance(err.value, ValueError)
    with pytest.raises(JudgeError, match=r"score 2 .*field 'score'.*outside the scale \[0, 1\]"):
        parse_score("SCORE: 2")
    assert parse_group_scores("SCORE 2: 0 - wrong\nSCORE 1: 1 - right", 2) == [1.0, 0.0]
    with pytest.raises(JudgeError, match=r"no 'SCORE <n>: <number>' line for trajectory 2, 3 of 3 .*'score 2'"):
        parse_group_scores("SCORE 1: 1", 3)
    with pytest.raises(JudgeError, match="scored trajectory 3 .*group has 2"):
        parse_group_scores("SCORE 1: 1\nSCORE 2: 0\nSCORE 3: 1", 2)
    with pytest.raises(JudgeError, match="score 5 of trajectory 1 .*outside the scale"):
        parse_group_scores("SCORE 1: 5\nSCORE 2: 0", 2)


def test_a_judge_never_calls_an_attempts_url_and_bad_arguments_name_the_field():
    llm = LLMResource(endpoint="http://127.0.0.1:9/rollout/ro-1/attempt/at-1/v1", model="m", api_key="k")
    judge = Judge(llm)  # the agent's resource: the same server's plain URL, so the proxy records no LLM span
    assert (judge.base_url, judge.model, judge.api_key) == ("http://127.0.0.1:9/v1", "m", "k")
    with pytest.raises(ConfigError, match="attempt's URL.*'http://127.0.0.1:9/v1'"):
        Judge(llm.endpoint, "m")
    with pytest.raises(ConfigError, match=r"model=\.\.\.\) is required"):
        Judge("http://127.0.0.1:9/v1")
    with pytest.raises(ConfigError, match=r"scale=\(1, 0\)"):
        Judge(llm, scale=(1, 0))
    with pytest.raises(ConfigError, match=r"\{colour\} is not a field"):
        GroupJudge(llm, rubric="{hi} if {colour}")
    with pytest.raises(ConfigError, match="max_tokens=0"):
        GroupJudge(llm, max_tokens=0)
    with pytest.raises(ConfigError, match="judge=Judge"):
        judge_reward("x")
    with pytest.raises(ConfigError, match="no.*'main_llm'|'main_llm' LLM resource"):
        GroupJudge().endpoint(InMemoryStore())


def test_trajectory_messages_join_the_calls_of_a_multi_turn_attempt():
    from lightning_nb.types import Span

    def call(prompt, completion):
        return Span(rollout_id="r", attempt_id="a", trace_id="t", span_id=completion, name=semconv.LLM_SPAN,
                    start_time=0, end_time=0, attributes={semconv.PROMPT: json.dumps(prompt),
                                                          semconv.COMPLETION: completion})

    q = {"role": "user", "content": "q"}
    spans = [call([q], "CALC: 1+1"), call([q, {"role": "assistant", "content": "CALC: 1+1"},
                                           {"role": "user", "content": "RESULT: 2"}], "ANSWER: 2")]
    assert [m["content"] for m in trajectory_messages(spans)] == ["q", "CALC: 1+1", "RESULT: 2", "ANSWER: 2"]


def test_rewards_df_has_one_final_row_per_rollout_the_reward_that_counts():
    """A retried attempt's reward, an earlier reward of the same attempt, and a failed rollout's reward are not
    "final": they are named by who gave them ("agent"), so ``component == "final"`` is what final_rewards counts."""
    from lightning_nb import emit_reward
    from lightning_nb.types import RolloutConfig

    store = InMemoryStore()
    store.add_resources({"main_llm": LLMResource(endpoint=IDLE_LLM, model="unused")})
    tries = itertools.count()

    def agent(task, llm):
        emit_reward(0.25)
        if task == "retried" and next(tries) == 0 or task == "failed":
            raise RuntimeError("crash after a reward")
        return 1.0  # the second reward span of the attempt: the one that counts

    with pytest.warns(RuntimeWarning), start_runners(agent, store, n=1):
        ids = {t: store.enqueue_rollout(t, config=RolloutConfig(max_attempts=2 if t == "retried" else 1)).rollout_id
               for t in ("plain", "retried", "failed")}
        assert len(store.wait_for_rollouts(list(ids.values()), timeout=60)) == 3
    df = store.rewards_df()
    final = df[df.component == "final"].set_index("rollout_id").reward.to_dict()
    assert final == {ids["plain"]: 1.0, ids["retried"]: 1.0}
    assert final == {k: v for k, v in store.final_rewards(list(ids.values())).items() if k != ids["failed"]}
    assert Counter(df[df.component == "agent"].rollout_id) == {ids["plain"]: 1, ids["retried"]: 2, ids["failed"]: 1}


# ----- unparsable verdicts (fixed-reply HTTP server) -------------------------------------------------------
def test_with_on_error_raise_an_unparsable_verdict_fails_the_attempt_naming_the_field_and_keeps_its_spans(
        fixed_reply):
    url = fixed_reply("The response looks fine to me.")
    store = InMemoryStore()
    store.add_resources({"main_llm": LLMResource(endpoint=url, model="fixed")})

    def agent(task, llm):
        with tool_span("lookup", task["q"]) as span:
            span.set_attribute(semconv.TOOL_OUTPUT, "42")
        return judge_reward("42", task=task["q"], judge=Judge(url, "fixed", on_error="raise"))

    with start_runners(agent, store, n=1):
        rid = store.enqueue_rollout({"q": "What is 6 * 7?"}).rollout_id
        assert store.wait_for_rollouts([rid], timeout=60)
    assert store.get_rollout_by_id(rid).status == "failed"
    error = store.query_attempts(rid)[-1].error
    assert "JudgeError" in error and "field 'score'" in error and "looks fine" in error
    df = store.spans_df(rid, flatten=JUDGED_KEYS)
    assert set(df.name) >= {semconv.AGENT_SPAN, "tool:lookup", semconv.JUDGE_SPAN}  # nothing of the attempt lost
    judged = df[df.name == semconv.JUDGE_SPAN].iloc[0]
    assert judged[semconv.JUDGE_VERDICT] == "The response looks fine to me." and "field 'score'" in judged[semconv.ERROR]
    assert "What is 6 * 7?" in judged[semconv.JUDGE_PROMPT] and judged.status == "error"
    df = store.rewards_df()  # no score, no reward: a failed rollout's reward is 0 by the final-reward rule
    assert list(df.component) == [semconv.JUDGE_SPAN] and df.reward.isna().all()
    assert "field 'score'" in df.judge_error.iloc[0]
    assert store.final_rewards([rid]) == {rid: 0.0}


def test_a_judge_failure_is_recorded_and_the_agents_own_reward_stands(fixed_reply):
    """Issue 43: 1-2 of 10 rollouts failed with 'judge score 2 ... outside the scale' and lost the agent's 1.0."""
    out_of_scale = fixed_reply("Correct answer.\nSCORE: 2")
    store = InMemoryStore()
    store.add_resources({"main_llm": LLMResource(endpoint=out_of_scale, model="fixed")})
    judge = Judge(out_of_scale, "fixed")  # on_error="record": the default

    def agent(task, llm):
        scores.append(judge_reward("42", task=task["q"], judge=judge))
        return 1.0  # the agent's own, hand-written reward

    scores = []
    with pytest.warns(RuntimeWarning, match="gave no score .*outside the scale .*recorded, the agent's own reward"):
        with start_runners(agent, store, n=2) as group:
            ids = [store.enqueue_rollout({"q": "What is 6 * 7?"}).rollout_id for _ in range(3)]
            assert len(store.wait_for_rollouts(ids, timeout=60)) == 3
            assert group.status().judge_errors.sum() == 3  # every failure counted, not only the first
    assert scores == [None] * 3
    assert [r.status for r in store.query_rollouts(rollout_ids=ids)] == ["succeeded"] * 3
    assert store.final_rewards(ids) == {rid: 1.0 for rid in ids}
    df = store.rewards_df()
    assert sorted(df.component) == ["final"] * 3 + [semconv.JUDGE_SPAN] * 3
    errors = df[df.component == semconv.JUDGE_SPAN]
    assert errors.reward.isna().all() and errors.judge_error.str.contains(r"outside the scale \[0, 1\]").all()
    assert errors.judge_error.str.contains("clamp=True").all()  # the fix is named
    assert df[df.component == "final"].judge_error.isna().all()
    spans = store.spans_df(flatten=JUDGED_KEYS)
    judged = spans[spans.name == semconv.JUDGE_SPAN]
    assert len(judged) == 3 and (judged.status == "error").all() and judged[semconv.JUDGE_VERDICT].notna().all()
    # asked for, the same verdict is clamped to the scale's end and noted
    clamping = Judge(out_of_scale, "fixed", clamp=True)
    assert clamping.score("42") == 1.0
    with start_runners(lambda task, llm: judge_reward("42", task=task, judge=clamping), store, n=1):
        rid = store.enqueue_rollout("What is 6 * 7?").rollout_id
        assert store.wait_for_rollouts([rid], timeout=60)
    [span] = [s for s in store.query_spans(rid) if s.name == semconv.JUDGE_SPAN]
    assert span.attributes[semconv.REWARD] == 1.0 and "clamped from 2" in span.attributes[semconv.REWARD_NOTE]
    with pytest.raises(ConfigError, match="on_error"):
        Judge(out_of_scale, "fixed", on_error="ignore")
    with pytest.raises(ConfigError, match="set on_error and clamp on the Judge"):
        judge_reward("42", judge=judge, on_error="raise")


def test_a_judge_failure_warns_once_per_configuration_however_many_judges_and_quotes_the_reason_whole(
        fixed_reply):
    """Issue 53: ``judge_reward(llm=...)`` builds a Judge per call, so "the first failure warns" gave a warning box
    per call, each with its reason cut mid-word at 300 characters."""
    verdict = "The summary is fine, I think. " * 4  # no SCORE line: a JudgeError that quotes this verdict
    url = fixed_reply(verdict)
    store = InMemoryStore()
    store.add_resources({"main_llm": LLMResource(endpoint=url, model="fixed")})

    def agent(task, llm):
        return judge_reward("The library closes.", task=task, llm=llm) or 0.5  # a new Judge per call

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with start_runners(agent, store, n=2) as group:
            ids = [store.enqueue_rollout(f"text {i}").rollout_id for i in range(6)]
            assert len(store.wait_for_rollouts(ids, timeout=60)) == 6
            assert group.status().judge_errors.sum() == 6  # every failure counted
    told = [str(w.message) for w in caught if "gave no score" in str(w.message)]
    assert len(told) == 1, told  # one warning for 6 failures of 6 Judge objects of one configuration
    [error] = store.rewards_df().query("component == 'judge'").judge_error.unique()
    assert error in told[0] and error.endswith("(Judge(examples=...))") and len(error) > 300  # whole
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert Judge(url, "fixed").score("x") is None  # the same configuration again: quiet
        assert Judge(url, "fixed", scale=(0, 10)).score("x") is None  # another scale: warned
        assert Judge(url, "other-model").score("x") is None  # another model: warned
    told = [str(w.message) for w in caught if "gave no score" in str(w.message)]
    assert len(told) == 2 and "scale=(0.0, 10.0)" in told[0] and "model='other-model'" in told[1], told


def test_a_group_reply_without_one_score_per_trajectory_keeps_the_agents_rewards(fixed_reply):
    url = fixed_reply("SCORE 1: 1 - right")
    store = InMemoryStore()
    store.add_resources({"main_llm": LLMResource(endpoint=url, model="fixed")})
    rewards = itertools.count()
    with start_runners(lambda task, llm: float(next(rewards) % 2), store, n=1):
        ids = [store.enqueue_rollout({"q": "x"}, metadata={"group_id": "g"}).rollout_id for _ in range(2)]
        assert len(store.wait_for_rollouts(ids, timeout=60)) == 2
    before = store.final_rewards(ids)
    with pytest.warns(UserWarning, match=r"group 'g' keeps the agent's rewards.*trajectory 2 of 2"):
        counts = GroupJudge(url, "fixed").judge_rollouts(store, ids)
    assert counts == {"judge_groups": 0, "judge_groups_failed": 1, "judge_groups_skipped": 0}
    assert store.final_rewards(ids) == before
    df = store.spans_df(flatten=JUDGED_KEYS)
    judged = df[df.name == semconv.JUDGE_SPAN]
    assert len(judged) == 2 and judged[semconv.ERROR].str.contains("'score 2'").all()
    rewards = store.rewards_df()  # the judge's failure is a row of its own: no reward, the error in judge_error
    assert set(rewards.component) == {"final", semconv.JUDGE_SPAN}
    failed = rewards[rewards.component == semconv.JUDGE_SPAN]
    assert len(failed) == 2 and failed.reward.isna().all() and failed.judge_error.str.contains("'score 2'").all()


# ----- the real model as the judge -------------------------------------------------------------------------
def test_a_judge_inside_an_agent_is_a_span_and_a_reward_component_never_a_triplet(proxied_store):
    store = proxied_store

    def agent(task, llm):
        _say(llm, "Say hi.")  # the agent's own (trainable) call
        judge_reward("ANSWER: 4", "{hi} if the answer to the question is right, {lo} if not.",
                     task="What is 2 + 2?", llm=llm)
        return 1.0  # the hand-written reward, beside the judge's score

    with start_runners(agent, store, n=1):
        rid = store.enqueue_rollout({"id": "t"}).rollout_id
        assert store.wait_for_rollouts([rid], timeout=300)
    attempt = store.query_attempts(rid)[-1]
    assert store.get_rollout_by_id(rid).status == "succeeded", attempt.error
    df = store.spans_df(rid, flatten=JUDGED_KEYS)
    assert list(df.name).count(semconv.LLM_SPAN) == 1  # the judge called the plain URL: no LLM span for it
    judged = df[df.name == semconv.JUDGE_SPAN].iloc[0]
    prompt = json.loads(judged[semconv.JUDGE_PROMPT])
    assert prompt[-1]["content"] == "Task: What is 2 + 2?\nResponse: ANSWER: 4" and "SCORE:" in prompt[0]["content"]
    assert judged[semconv.JUDGE_SCORE] == parse_score(judged[semconv.JUDGE_VERDICT])
    assert judged.reward == judged[semconv.JUDGE_SCORE]
    assert judged[semconv.JUDGE_MODEL] == store.get_latest_resources().resources["main_llm"].model
    rewards = store.rewards_df().pivot_table("reward", "rollout_id", "component")
    assert rewards.loc[rid].to_dict() == {"final": 1.0, semconv.JUDGE_SPAN: judged[semconv.JUDGE_SCORE]}
    triplets = TripletAdapter().adapt(store, [rid])
    assert len(triplets) == 1 and triplets[0].reward == 1.0 and "hi" in triplets[0].prompt_text


def test_the_group_judge_scores_a_group_in_one_call_as_its_final_rewards(proxied_store):
    store = proxied_store
    lengths = itertools.cycle([3, 12])  # greedy replies, cut at two lengths: two distinct trajectories

    def agent(task, llm):
        _say(llm, task["question"], max_tokens=next(lengths))
        return 0.5  # the agent's reward, replaced by the judge's

    with start_runners(agent, store, n=1):  # one runner: the same greedy replies each run
        ids = [store.enqueue_rollout({"question": "Name three colours."}, metadata={"group_id": "g"}).rollout_id
               for _ in range(2)]
        assert len(store.wait_for_rollouts(ids, timeout=300)) == 2
    judge = GroupJudge(rubric="{hi} if the response names three colours, {lo} if not.")
    scores = judge.score_group(store, ids)
    assert sorted(scores) == sorted(ids)
    assert store.final_rewards(ids) == scores  # the judge's scores are the final rewards now
    df = store.rewards_df()
    final = df[df.component == "final"].set_index("rollout_id").reward.to_dict()
    assert final == scores and sorted(df[df.component == "agent"].reward) == [0.5, 0.5]
    assert df[df.component == "group_judge"].set_index("rollout_id").reward.to_dict() == scores
    spans = store.spans_df(flatten=[semconv.JUDGE_GROUP, semconv.REWARD_SOURCE])
    judged = spans[spans.name == semconv.JUDGE_SPAN]
    assert len(judged) == 2 and all(json.loads(g) == ids for g in judged[semconv.JUDGE_GROUP])
    assert list(spans[spans.name == semconv.REWARD_SPAN][semconv.REWARD_SOURCE].fillna("")) == \
        ["", "group_judge", "", "group_judge"]
    assert [t.reward for t in TripletAdapter().adapt(store, ids)] == [scores[i] for i in ids]


def test_lightning_rl_with_a_group_judge_runs_a_step(engine, pristine):
    store = InMemoryStore()
    rewards = itertools.count()

    def agent(task, llm):
        _say(llm, "Say hi.", max_tokens=4)
        return float(next(rewards) % 2)

    with LLMProxy(engine, store) as proxy, start_runners(agent, store, n=2):
        store.add_resources({"main_llm": proxy.as_resource()})
        trainer = GRPOTrainer(engine, GRPOConfig(track_reference_kl=False))
        algo = LightningRL(store, trainer, [{"id": "hi", "question": "Say hi."}],
                           config=AlgorithmConfig(tasks_per_step=1, group_size=2, max_tokens=4, max_sample_rounds=1),
                           group_judge=GroupJudge())
        try:
            row = algo.step()
        finally:
            algo.stop()
    ids = [r.rollout_id for r in store.query_rollouts()]
    judged = row["judge_groups"] == 1
    assert row["judge_groups"] + row["judge_groups_failed"] == 1 and row["judge_groups_skipped"] == 0
    df = store.rewards_df()
    finals = store.final_rewards(ids)
    # judged: the judge's scores are the final rewards the step trained on; not parsed: the agent's rewards stay
    assert set(df.component) == ({"final", "agent", "group_judge"} if judged else {"final"})
    expected = df[df.component == ("group_judge" if judged else "final")].set_index("rollout_id").reward.to_dict()
    assert finals == expected and row["reward_mean"] == pytest.approx(sum(finals.values()) / 2)
    if not judged:
        assert sorted(finals.values()) == [0.0, 1.0]


def test_judge_errors_are_lightning_nb_errors():
    assert issubclass(JudgeError, LightningNbError) and issubclass(JudgeError, ValueError)
    import pickle

    err = pickle.loads(pickle.dumps(JudgeError("bad", field="score", verdict="v")))
    assert (str(err), err.field, err.verdict) == ("bad", "score", "v")
