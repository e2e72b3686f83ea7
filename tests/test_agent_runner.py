"""ROLL's AgentRunner shape (reference doc 004): EpisodeResult, setup/teardown, GEMRunner on the real gem-llm and
gymnasium packages, ToolCallRunner, seed-grouped GRPO training, all through the real runners, LLMProxy and model."""

from __future__ import annotations

import json
import threading

import pytest

from lightning_nb import semconv
from lightning_nb import (AlgorithmConfig, GRPOConfig, GRPOTrainer, InMemoryStore, LightningRL, LLMProxy,
                          TripletAdapter, start_runners)
from lightning_nb.agents.agent_runner import (EPISODE_EXIT_REASON, EPISODE_METRICS, EPISODE_STATUS, AgentRunner,
                                              EpisodeResult, seed_of, seed_tasks)
from lightning_nb.agents.gem_runner import GEMRunner, check_reset, check_step
from lightning_nb.agents.text_env import TextEnv
from lightning_nb.agents.toolcall_runner import ToolActionEnv, ToolCallRunner
from lightning_nb.errors import ConfigError, InvalidRewardError, LightningNbError
from lightning_nb.trainers.packing import first_difference, pack_episode

gem = pytest.importorskip("gem", reason="the envs extra: pip install 'lightning-nb[envs]'")
pytest.importorskip("gymnasium", reason="the envs extra: pip install 'lightning-nb[envs]'")

LLM, STEP, FINAL = semconv.LLM_SPAN, semconv.INTERMEDIATE_REWARD_SPAN, semconv.REWARD_SPAN
TINY = {"max_tokens": 8, "temperature": 1.0}  # per-rollout sampling: short replies keep the CPU test fast


def _run(store, agent, tasks, n=2, sampling=TINY, timeout=300):
    group = start_runners(agent, store, n=n)
    try:
        ids = [r.rollout_id for r in store.enqueue_rollouts(tasks, metadata={"sampling_parameters": sampling})]
        rollouts = store.wait_for_rollouts(ids, timeout=timeout)
    finally:
        group.stop()
    return ids, rollouts


def _spans(store, rid):
    return [(s.name, dict(s.attributes)) for s in store.query_spans(rid, attempt_id="latest")]


# ----- no model -----
def test_episode_result_and_seed_errors_name_the_field():
    with pytest.raises(ConfigError, match="status"):
        EpisodeResult(status="Done", score=1.0)
    with pytest.raises(InvalidRewardError, match="score"):
        EpisodeResult(status="Finished", score=float("nan"))
    with pytest.raises(InvalidRewardError, match=r"step_scores\[1\]"):
        EpisodeResult(status="Finished", score=0.0, step_scores=[0.0, "x"])
    assert EpisodeResult("Finished", 1).to_dict() == {"status": "Finished", "score": 1.0, "step_scores": [],
                                                      "agent_exit_reason": "", "metrics": {}}
    assert seed_tasks(2, start=5, env="x") == [{"id": "seed-5", "seed": 5, "env": "x"},
                                               {"id": "seed-6", "seed": 6, "env": "x"}]
    assert seed_of({"seed": 3, "id": "a"}) == 3 and seed_of(7) == 7
    with pytest.raises(ConfigError, match=r"no 'seed' field.*seed_tasks"):
        seed_of({"question": "q"})
    with pytest.raises(ConfigError, match="'seed' must be an int"):
        seed_of({"seed": "3"})
    with pytest.raises(ConfigError, match="n must be"):
        seed_tasks(0)
    with pytest.raises(ConfigError, match="max_steps"):
        GEMRunner("FrozenLake-v1", max_steps=0)
    with pytest.raises(ConfigError, match="tool_choice"):
        ToolCallRunner("FrozenLake-v1", tool_choice="any")

    class NoInit(AgentRunner):
        def __init__(self):  # forgot super().__init__()
            pass

        def run_job(self, seed):
            return EpisodeResult("Finished", 0.0)

    with pytest.raises(ConfigError, match=r"super\(\).__init__\(\)"):
        NoInit()({"seed": 0}, None)
    with pytest.raises(LightningNbError, match="outside an episode"):
        GEMRunner("FrozenLake-v1")._llm_request([{"role": "user", "content": "hi"}])


def test_text_env_frozen_lake_and_taxi_speak_text_and_follow_the_seed():
    env = TextEnv("FrozenLake-v1", size=3)
    obs, info = env.reset(seed=4)
    assert "P" in obs and "G" in obs and "right" in info["suffix"]
    assert TextEnv("FrozenLake-v1", size=3).reset(seed=4)[0] == obs  # same seed, same lake
    lakes = {TextEnv("FrozenLake-v1", size=4).reset(seed=s)[0] for s in range(6)}
    assert len(lakes) > 1  # the seed draws the lake
    text, reward, terminated, truncated, info = env.step("hmm, let me think")
    assert (reward, terminated, truncated, info["invalid_action"]) == (-0.1, False, False, True)
    assert env.parse_action("I go \\boxed{Down} not up") == 1 and env.parse_action("go up") == 3
    text, reward, terminated, _, _ = env.step("right")
    assert text.startswith("You chose right.") and reward in (0.0, 1.0)
    taxi = TextEnv("Taxi-v4")
    obs, _ = taxi.reset(seed=0)
    assert "The taxi T is at row" in obs
    assert taxi.step("\\boxed{pickup}")[1] in (-1.0, -10.0)
    with pytest.raises(ConfigError, match="Taxi-v4"):
        TextEnv("Taxi-v3")
    with pytest.raises(ConfigError, match="FrozenLake-v1 only"):
        TextEnv("Taxi-v4", size=3)


def test_env_output_that_is_not_gem_shaped_is_refused_naming_the_item():
    env = TextEnv("FrozenLake-v1")
    with pytest.raises(ConfigError, match=r"reset\(seed\) must return \(observation: str, info: dict\).*3-tuple"):
        check_reset(("a", {}, 1), env)
    with pytest.raises(ConfigError, match="int observation.*TextEnv"):
        check_reset((3, {}), env)
    with pytest.raises(ConfigError, match=r"step\(action\) must return .*4-tuple"):
        check_step(("o", 0.0, False, {}), env)
    with pytest.raises(ConfigError, match="reward 'high'"):
        check_step(("o", "high", False, False, {}), env)
    with pytest.raises(ConfigError, match="terminated=1"):
        check_step(("o", 0.0, 1, False, {}), env)


def test_tool_action_env_executes_openai_tool_calls():
    from openai.types.chat import ChatCompletionMessage

    env = ToolActionEnv(TextEnv("FrozenLake-v1", size=3))
    messages, info = env.reset(seed=1)
    assert messages[0]["role"] == "user" and info["tools"][0]["function"]["name"] == "act"
    assert info["tools"][0]["function"]["parameters"]["properties"]["action"]["enum"] == ["left", "down", "right",
                                                                                          "up"]
    # a reply as the OpenAI SDK returns it from the proxy, dumped the way ToolCallRunner does
    reply = ChatCompletionMessage.model_validate({"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "act", "arguments": '{"action": "down"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "jump", "arguments": "{}"}}]})
    out, reward, terminated, truncated, info = env.step(reply.model_dump(exclude_none=True))
    assert [m["tool_call_id"] for m in out] == ["call_1", "call_2"] and out[0]["content"].startswith("You chose down")
    assert "Unknown tool 'jump'" in out[1]["content"] and info["tool_calls"] == 2
    assert reward == pytest.approx(-0.1 + (1.0 if terminated and "goal" in out[0]["content"] else 0.0))
    out, reward, terminated, _, _ = env.step("I would go down")
    assert out[0]["role"] == "user" and reward == -0.1 and not terminated


# ----- the real model through runners + proxy -----
class _Logged(GEMRunner):
    """GEMRunner on FrozenLake that logs its lifecycle (the log is per object: the order across threads)."""

    def __init__(self, **kw):
        super().__init__("FrozenLake-v1", env_kwargs={"size": 3}, max_steps=2, **kw)
        self.log, self.log_lock = [], threading.Lock()

    def setup(self):
        super().setup()
        self.log.append("setup")

    def teardown(self):
        self.log.append("teardown")

    def run_job(self, seed):
        with self.log_lock:
            self.log.append(f"run_job({seed})")
        return super().run_job(seed)


@pytest.mark.slow
def test_gem_runner_on_frozen_lake_setup_once_step_scores_on_their_calls_one_packed_sequence(proxied_store, engine):
    store = proxied_store
    agent = _Logged()
    ids, rollouts = _run(store, agent, seed_tasks(2))
    assert [r.status for r in rollouts] == ["succeeded"] * 2, store.attempts_df()["error"].tolist()
    assert agent.log[0] == "setup" and agent.log.count("setup") == 1
    assert sorted(agent.log[1:]) == ["run_job(0)", "run_job(1)"]
    agent.close()
    agent.close()  # once only
    assert agent.log[-1] == "teardown" and agent.log.count("teardown") == 1

    triplets = TripletAdapter().adapt(store, ids)
    for rid in ids:
        spans = _spans(store, rid)
        names = [n for n, _ in spans if n in (LLM, STEP, FINAL)]
        # each step score is recorded right after the env.step that follows its LLM call
        calls = names.count(LLM)
        assert calls >= 1 and names == [LLM, STEP] * calls + [FINAL]
        steps = [float(a[semconv.REWARD]) for n, a in spans if n == STEP]
        final = next(a for n, a in spans if n == FINAL)
        assert float(final[semconv.REWARD]) == pytest.approx(sum(steps))
        assert final[EPISODE_STATUS] == "Finished" and final[EPISODE_EXIT_REASON] in ("terminated", "max_steps")
        assert json.loads(final[EPISODE_METRICS])["llm_calls"] == len(steps)
        ts = sorted((t for t in triplets if t.rollout_id == rid), key=lambda t: t.turn)
        assert [t.step_reward for t in ts] == pytest.approx(steps)  # credited to the call each step judged
        assert all(t.reward == pytest.approx(sum(steps)) for t in ts)
        # text turns: each prompt extends the previous prompt + reply token for token, also where the model sampled
        # a split its tokenizer would not write or was cut mid-character (the proxy splices the sampled tokens
        # back, lightning_nb/proxy/splice.py), so the episode packs into one sequence
        for k in range(1, len(ts)):
            before = ts[k - 1].prompt_ids + ts[k - 1].response_ids
            assert ts[k].prompt_ids[:len(before)] == before, (rid, k, first_difference(before, ts[k].prompt_ids))
        ep = store.episode(rid)  # the episode as a user reads it: the same calls, the step scores as rewards
        assert [c.completion_ids for c in ep.calls] == [t.response_ids for t in ts]
        assert ep.reward == pytest.approx(sum(steps)) and ep.status == "succeeded" and ep.calls[-1].messages
        seqs = pack_episode(ts, advantage=1.0)
        assert len(seqs) == 1
        assert sum(map(sum, (s.mask for s in seqs))) == sum(len(t.response_ids) for t in ts)
        if len(ts) == 2:  # one sequence; the observation between the turns has mask 0
            gap = len(ts[1].prompt_ids) - len(ts[0].prompt_ids) - len(ts[0].response_ids)
            assert gap > 0 and seqs[0].mask.count(0) == len(ts[0].prompt_ids) + gap


@pytest.mark.slow
def test_gem_runner_on_a_gem_game_and_bad_envs_fail_the_attempt_naming_the_item(proxied_store):
    store = proxied_store
    agent = GEMRunner("game:GuessTheNumber-v0-easy", max_steps=2)
    ids, rollouts = _run(store, agent, seed_tasks(2, start=10), sampling={"max_tokens": 12, "temperature": 1.0})
    assert [r.status for r in rollouts] == ["succeeded"] * 2, store.attempts_df()["error"].tolist()
    for rid in ids:
        spans = _spans(store, rid)
        assert "You are playing Guess The Number" in json.dumps(spans, default=str)  # GEM's own instructions
        steps = [float(a[semconv.REWARD]) for n, a in spans if n == STEP]
        # GEM's GuessTheNumber rewards: -0.1 (no/invalid guess), 0 (a hint), 1 (found), or 1 - distance at the end
        assert steps and all(-0.1 <= s <= 1.0 for s in steps)
        assert float(next(a for n, a in spans if n == FINAL)[semconv.REWARD]) == pytest.approx(sum(steps))

    class Nonsense:
        def reset(self, seed=None):
            return 3, {}

        def step(self, action):
            return "o", 0.0, False, False, {}

    bad = GEMRunner(Nonsense, max_steps=1)
    ids, rollouts = _run(store, bad, [{"seed": 1}, {"question": "no seed"}], n=1)
    errors = {a.rollout_id: a.error for a in (store.query_attempts(rid)[-1] for rid in ids)}
    assert [r.status for r in rollouts] == ["failed"] * 2
    assert "Nonsense.reset(seed) returned a int observation" in errors[ids[0]]
    assert "no 'seed' field" in errors[ids[1]] and "seed_tasks" in errors[ids[1]]

    class Unreported(AgentRunner):  # step scores returned at the end would all land on the last LLM call
        def run_job(self, seed):
            return EpisodeResult("Finished", 1.0, step_scores=[0.5, 0.5])

    class TimesOut(AgentRunner):
        def run_job(self, seed):
            return EpisodeResult("Timeout", 0.0, agent_exit_reason="the env did not answer")

    for agent, expected in ((Unreported(), "reported [] with self._step_score"),
                            (TimesOut(), "ended 'Timeout': the env did not answer")):
        ids, rollouts = _run(store, agent, [{"seed": 0}], n=1)
        assert rollouts[0].status == "failed" and expected in store.query_attempts(ids[0])[-1].error


@pytest.mark.slow
def test_tool_call_runner_sends_tools_and_the_env_runs_the_calls(proxied_store):
    store = proxied_store
    agent = ToolCallRunner("FrozenLake-v1", env_kwargs={"size": 3}, max_steps=2)
    ids, rollouts = _run(store, agent, seed_tasks(2), sampling={"max_tokens": 40, "temperature": 1.0})
    assert [r.status for r in rollouts] == ["succeeded"] * 2, store.attempts_df()["error"].tolist()
    for rid in ids:
        spans = _spans(store, rid)
        calls = [a for n, a in spans if n == LLM]
        assert calls and all(json.loads(a[semconv.REQUEST_TOOLS])[0]["function"]["name"] == "act" for a in calls)
        steps = [float(a[semconv.REWARD]) for n, a in spans if n == STEP]
        final = next(a for n, a in spans if n == FINAL)
        assert len(steps) == len(calls) and float(final[semconv.REWARD]) == pytest.approx(sum(steps))
        metrics = json.loads(final[EPISODE_METRICS])
        print("ToolCallRunner episode", metrics, steps)
        # a step without a tool call scores -0.1; one with a call is the env's step: 0 or 1 (FrozenLake), or
        # -0.1 for a call it could not run (wrong tool, bad arguments)
        assert metrics["tool_calls"] > 0 or steps == [-0.1] * len(steps), (metrics, steps)


@pytest.mark.slow
def test_training_steps_on_frozen_lake_groups_are_episodes_of_one_seed(engine, pristine):
    store = InMemoryStore()
    proxy = LLMProxy(engine, store).start()
    store.add_resources({"main_llm": proxy.as_resource()})
    agent = GEMRunner("FrozenLake-v1", env_kwargs={"size": 3}, max_steps=2)
    runners = start_runners(agent, store, n=4)
    trainer = GRPOTrainer(engine, GRPOConfig(learning_rate=1e-5, micro_batch_size=4))
    cfg = AlgorithmConfig(tasks_per_step=2, group_size=2, max_tokens=8, temperature=1.0, max_sample_rounds=1)
    algo = LightningRL(store, trainer, seed_tasks(8), [], cfg)
    try:
        rows = [algo.step() for _ in range(2)]
    finally:
        algo.stop()
        runners.stop()
        proxy.stop()
    assert [r["step"] for r in rows] == [1, 2] and all(r["rollouts"] == 4 for r in rows)
    groups = {}
    for rollout in store.query_rollouts():
        groups.setdefault(rollout.metadata["group_id"], []).append(rollout.input["seed"])
    # a group is the group_size episodes of one seed (a step draws each task at most once)
    assert sum(map(len, groups.values())) == 8 and all(len(set(s)) == 1 and len(s) == 2 for s in groups.values())
    triplets = TripletAdapter().adapt(store, [r.rollout_id for r in store.query_rollouts()])
    assert {t.group_id for t in triplets} <= set(groups)
    batch = trainer.last_batch_df()
    print(batch[["rollout_id", "group_id", "advantage"]].to_string())
    for row in trainer.last_batch:
        assert len(row["input_ids"]) == len(row["response_mask"]) and 0 < sum(row["response_mask"]) < len(
            row["input_ids"])
    print([(t.rollout_id[-6:], t.turn, t.step_reward, t.reward) for t in triplets])
    # one packed sequence per episode: no turn forks (see the FrozenLake test above)
    assert rows[-1]["turn_forks"] == 0 and len(trainer.last_batch) == rows[-1]["episodes"]


def test_gem_episodes_of_one_seed_on_several_threads_lose_no_span(proxied_store):
    """gem-llm's Env.reset calls random.seed(seed); a GRPO group plays one seed on several runner threads at once.
    No model here: the agent plays GEM's GuessTheNumber with fixed guesses, a tool span per step. Span IDs come
    from the tracer's own generator, so every span of every episode is stored (issue 40's reproduction)."""
    from lightning_nb import emit_reward, tool_span

    barrier = threading.Barrier(4, timeout=60)

    def agent(task, llm):
        env = gem.make("game:GuessTheNumber-v0-easy")
        barrier.wait()
        total = 0.0
        for guess in (5, 3, 8, 1):
            env.reset(seed=task["seed"])  # re-seeds the global random while other threads draw span IDs
            with tool_span("env.step", str(guess)):
                _, reward, _, _, _ = env.step(f"\\boxed{{{guess}}}")
            total += reward
        emit_reward(total)
        return None

    ids = [r.rollout_id for r in proxied_store.enqueue_rollouts([{"seed": 3}] * 8)]
    with start_runners(agent, proxied_store, n=4):
        done = proxied_store.wait_for_rollouts(ids, timeout=120)
    assert [r.status for r in done] == ["succeeded"] * 8, [proxied_store.query_attempts(i)[0].error for i in ids]
    for rid in ids:
        names = [s.name for s in proxied_store.query_spans(rid)]
        assert names == ["tool:env.step"] * 4 + ["reward", "agent"]
