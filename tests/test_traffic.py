"""Learning from traffic: ``store.label`` on every backend, the proxy's opt-in ``/traffic`` route, and a
TrafficLearner session on the real model, proxy and GRPO trainer (update, audit, undo)."""

from __future__ import annotations

import re

import httpx
import pytest
from openai import OpenAI

from lightning_nb import semconv
from lightning_nb.algorithm.traffic import TrafficConfig, TrafficLearner, is_traffic
from lightning_nb.errors import ConfigError, InvalidRewardError, NotFoundError, WaitWarning
from lightning_nb.runners import Runner
from lightning_nb.store.memory.store import InMemoryStore
from lightning_nb.tracing import Tracer
from lightning_nb.types import LLMResource
from conftest import IDLE_LLM

LLM = LLMResource(endpoint=IDLE_LLM, model="m")


def _stored(store):
    return len(store.query_rollouts()), len(store.query_spans()), store.final_rewards()


def test_label_gives_an_unlabelled_rollout_its_final_reward_and_refuses_bad_input_on_every_backend(store):
    store.add_resources({"main_llm": LLM})
    runner = Runner(lambda task, llm: None, store, Tracer(store))
    traffic = runner.step({"q": 1}, reward_required=False).rollout_id
    with pytest.warns(RuntimeWarning, match="ZeroDivisionError"):
        failed = Runner(lambda task, llm: 1 / 0, store, Tracer(store)).step({"q": 2}).rollout_id
    queued = store.enqueue_rollout({"q": 3}).rollout_id
    assert store.final_reward(traffic) is None
    before = _stored(store)
    with pytest.raises(NotFoundError, match="rollout_id 'nope'"):
        store.label("nope", 1.0)
    for bad in (float("nan"), float("inf"), "1.0", True, None):
        with pytest.raises(InvalidRewardError, match="reward must be a finite real number"):
            store.label(traffic, bad)
    with pytest.raises(ConfigError, match=r"status is 'failed'.*0\.0 by rule"):
        store.label(failed, 1.0)
    with pytest.raises(ConfigError, match=r"status is 'queuing'.*wait_for_rollouts"):
        store.label(queued, 1.0)
    with pytest.raises(ConfigError, match="source must be a non-empty str"):
        store.label(traffic, 1.0, source="")
    assert _stored(store) == before  # nothing written, nothing lost

    span = store.label(traffic, 0.75, note="good answer")
    assert span.name == semconv.REWARD_SPAN and span.sequence_id > 0
    assert span.attributes[semconv.REWARD_SOURCE] == "human" and span.attributes[semconv.REWARD_NOTE] == "good answer"
    assert store.final_reward(traffic) == 0.75
    store.label(traffic, 0.0, source="judge")  # a later label replaces the earlier one
    assert store.final_reward(traffic) == 0.0
    labels = [s for s in store.query_spans(traffic, "latest") if s.name == semconv.REWARD_SPAN]
    assert [s.attributes[semconv.REWARD_SOURCE] for s in labels] == ["human", "judge"]
    assert store.final_reward(failed) == 0.0 and store.query_rollouts(rollout_ids=[queued])[0].status == "queuing"


def test_the_traffic_route_records_one_rollout_per_request_and_the_plain_url_records_none(proxied):
    store, proxy = proxied
    client = OpenAI(base_url=proxy.traffic_endpoint(), api_key="x", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model=proxy.served_models[0], messages=[{"role": "user", "content": "Say hi."}], max_tokens=4, temperature=0.7)
    rid = raw.headers["X-Rollout-Id"]
    reply = raw.parse().choices[0].message.content
    rollout = store.get_rollout_by_id(rid)
    assert rollout.status == "succeeded" and rollout.metadata == {"traffic": "proxy"} and is_traffic(rollout)
    assert rollout.input == [{"role": "user", "content": "Say hi."}]
    (call,) = [s for s in store.query_spans(rid) if s.name == semconv.LLM_SPAN]
    assert call.attributes[semconv.COMPLETION] == reply and call.attributes[semconv.COMPLETION_TOKEN_IDS]
    assert store.final_reward(rid) is None  # unlabelled until store.label

    OpenAI(base_url=proxy.endpoint(), api_key="x", max_retries=0).chat.completions.create(
        model=proxy.served_models[0], messages=[{"role": "user", "content": "Say hi."}], max_tokens=2)
    bad = httpx.post(f"{proxy.traffic_endpoint()}/chat/completions", json={
        "model": proxy.served_models[0], "messages": [{"role": "user", "content": "hi"}], "n": 2})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "n"
    assert [r.rollout_id for r in store.query_rollouts()] == [rid]  # neither the plain URL nor a 400 stored one


def test_a_traffic_session_updates_on_exactly_the_labelled_rollouts_and_undo_restores_the_weights(
        pristine, tmp_path):
    from lightning_nb.proxy.proxy import LLMProxy
    from lightning_nb.trainers.grpo import GRPOConfig, GRPOTrainer

    engine = pristine
    store = InMemoryStore()
    with LLMProxy(engine, store) as proxy:
        store.add_resources({"main_llm": proxy.as_resource(temperature=1.0, max_tokens=6)})

        def agent(task, llm):  # a user's agent: answers, gives no reward (nobody knows it yet)
            OpenAI(base_url=llm.endpoint, api_key="x", max_retries=0).chat.completions.create(
                model=llm.model, messages=[{"role": "user", "content": task["q"]}], **llm.sampling_parameters)

        runner = Runner(agent, store, Tracer(store))
        same = [runner.step({"q": "What is 2 + 3?"}, reward_required=False).rollout_id for _ in range(2)]
        lone_unlabelled = runner.step({"q": "Name a colour."}, reward_required=False).rollout_id
        client = OpenAI(base_url=proxy.traffic_endpoint(), api_key="x", max_retries=0)
        sent = [client.chat.completions.with_raw_response.create(
            model=llm_model(store), messages=[{"role": "user", "content": f"Say a word about {w}."}],
            max_tokens=6, temperature=1.0).headers["X-Rollout-Id"] for w in ("cats", "rain", "tea")]
        trainer = GRPOTrainer(engine, GRPOConfig(track_reference_kl=False, micro_batch_size=8))
        algo = TrafficLearner(store, trainer, TrafficConfig(min_labelled=4, poll_s=0.2), checkpoint_dir=tmp_path)
        assert algo.step() is None and algo.last_poll["labelled"] == 0  # nothing labelled: no update
        name = next(iter(engine.model.state_dict()))  # the embedding, a parameter every update moves
        before = engine.model.state_dict()[name].detach().clone()
        algo.start()  # polls in the background until stopped, while users keep working
        assert algo.pause(timeout=30) and algo.state == "paused" and trainer.updates_applied == 0
        # a human labels a few replies in a cell: one task seen twice, two singletons
        for rid, reward in zip([*same, *sent[:2]], (1.0, 0.0, 1.0, 0.0)):
            store.label(rid, reward)
        algo.resume()
        assert algo.wait(timeout=120, until_step=1)
        assert algo.stop(timeout=60) and algo.state == "stopped" and trainer.updates_applied == 1
        after = engine.model.state_dict()[name].detach().clone()
        assert not after.equal(before)

    df = algo.updates_df()
    # the task seen twice (rewards 1, 0) is a GRPO group; each singleton trains against the baseline 0.5 (no update
    # before: TrafficConfig.baseline_init), so its advantage is reward − 0.5
    assert len(df) == 1 and df.loc[0, "n"] == 4 and df.loc[0, "baselined"] == 2 and df.loc[0, "groups"] == 3
    assert trainer.last_advantages[sent[0]] == pytest.approx(0.5) and trainer.last_advantages[sent[1]] == -0.5
    assert str(df["time"].dtype) == "datetime64[ns]"  # as the store's frames: UTC, timezone-naive
    assert sorted(df.loc[0, "rollout_ids"]) == sorted([*same, *sent[:2]])
    assert df.loc[0, "reward_mean"] == 0.5 and df.loc[0, "weight_version_after"] > df.loc[0, "weight_version_before"]
    assert algo.used == set(df.loc[0, "rollout_ids"])
    assert {lone_unlabelled, sent[2]} <= set(algo.pending) and not {lone_unlabelled, sent[2]} & algo.used
    assert algo.step() is None  # the used ones are never used again; the unlabelled ones wait
    version = engine.weight_version
    row = algo.undo()
    assert row["update"] == 1 and algo.updates_df().loc[0, "undone"]
    assert engine.model.state_dict()[name].equal(before) and engine.weight_version < version
    with pytest.raises(ConfigError, match="no update to undo"):
        algo.undo()
    resumed = TrafficLearner(store, trainer, TrafficConfig(min_labelled=2), checkpoint_dir=tmp_path)
    resumed.load_state_dict(algo.state_dict())  # what algo.save()/load() carry for the learner
    assert resumed.used == algo.used and resumed.updates_df()["undone"].tolist() == [True]
    assert resumed.labelled() == []  # a restored learner does not train on the used rollouts again


def _ask(client, model, question):
    """A user's request to the proxy's /traffic route; returns its rollout id."""
    return client.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": question}], max_tokens=6,
        temperature=1.0).headers["X-Rollout-Id"]


def _waits(algo, until_step):
    """``wait()`` with a short stall and timeout; returns the text of its warnings (stall first, then timeout)."""
    with pytest.warns(WaitWarning) as got:
        assert algo.wait(until_step=until_step, timeout=2.5, stall_s=0.5) is False
    return [str(w.message) for w in got]


def test_equal_labels_and_a_lone_label_train_against_the_running_baseline_and_wait_says_why_not(
        pristine, tmp_path, capsys):
    """Issue 43: every pair of equal requests labelled equally never trained, and wait() was silent for 10 minutes."""
    from lightning_nb.proxy.proxy import LLMProxy
    from lightning_nb.trainers.grpo import GRPOConfig, GRPOTrainer

    engine, store = pristine, InMemoryStore()
    with LLMProxy(engine, store) as proxy:
        client = OpenAI(base_url=proxy.traffic_endpoint(), api_key="x", max_retries=0)
        model = proxy.served_models[0]
        pairs = [_ask(client, model, q) for q in ("What is 12 + 7?", "What is 12 + 7?", "What is 9 * 3?",
                                                  "What is 9 * 3?")]
        trainer = GRPOTrainer(engine, GRPOConfig(track_reference_kl=False, micro_batch_size=8))
        algo = TrafficLearner(store, trainer, TrafficConfig(min_labelled=4, poll_s=0.2), checkpoint_dir=tmp_path)
        algo.start()
        stall, timeout = _waits(algo, 1)  # nothing labelled: it says so, why, and what to do
        assert re.search(r"TrafficLearner\.wait\(\): still waiting, no progress for [01]\.\d s( \(.*\))?\. "
                         r"Waiting at: step 1 · waiting 0/4 labelled", stall), stall
        assert "0 of 4 labelled, 4 unlabelled: waiting for 4 more labelled rollouts" in stall
        assert "store.label(rollout_id, reward)" in stall and pairs[0] in stall and "min_labelled" in stall
        assert "timeout=2.5 s expired" in timeout and "before step 1 (at step 0)" in timeout
        with pytest.warns(WaitWarning, match="expired"):
            assert algo.wait(until_step=1, timeout=1, progress=True) is False  # the bar shows the same line
        assert "waiting 0/4 labelled · 0 of 4 labelled, 4 unlabelled" in capsys.readouterr().err

        for rid, reward in zip(pairs, (1.0, 1.0, 0.25, 0.25)):  # each pair labelled equally: no group compares
            store.label(rid, reward)
        assert algo.wait(until_step=1, timeout=300)
        row = algo.updates_df().iloc[0]
        assert row["n"] == 4 and row["baselined"] == 4 and row["groups"] == 2
        # reward − baseline_init 0.5: +0.5 for the pair labelled 1, −0.25 for the pair labelled 0.25
        assert [trainer.last_advantages[r] for r in pairs] == pytest.approx([0.5, 0.5, -0.25, -0.25])

        assert algo.pause(timeout=60)
        algo.config.min_labelled = 1  # one labelled request is enough
        algo.resume()
        lone = _ask(client, model, "Name a colour.")
        store.label(lone, 1.0)
        assert algo.wait(until_step=2, timeout=300)
        # an input never used: the mean of every used reward, (1 + 1 + 0.25 + 0.25) / 4 = 0.625
        assert trainer.last_advantages == pytest.approx({lone: 1.0 - 0.625})
        assert algo.updates_df()["n"].tolist() == [4, 1] and algo.baseline() == pytest.approx(0.7)

        again = _ask(client, model, "What is 12 + 7?")  # its input's baseline is 1.0: a label of 1 teaches nothing
        store.label(again, 1.0)
        stall, _ = _waits(algo, 3)
        assert "1 of 1 labelled, 0 unlabelled: waiting for a reward that differs from its baseline" in stall
        assert "Each labelled reward equals its baseline" in stall
        assert algo.global_step == 2 and again in algo.pending and again not in algo.used
        assert algo.stop(timeout=60)


def llm_model(store):
    return store.get_latest_resources().resources["main_llm"].model


def test_wait_never_advises_labelling_when_nothing_is_unlabelled(pristine, tmp_path):
    """Issue 53: a learner short of labels advised ``store.label(...) (0 unlabelled, e.g. [])``."""
    from lightning_nb.proxy.proxy import LLMProxy
    from lightning_nb.trainers.grpo import GRPOConfig, GRPOTrainer

    engine, store = pristine, InMemoryStore()
    with LLMProxy(engine, store) as proxy:
        client = OpenAI(base_url=proxy.traffic_endpoint(), api_key="x", max_retries=0)
        sent = [_ask(client, proxy.served_models[0], q) for q in ("What is 12 + 7?", "What is 9 * 3?")]
        for rid in sent:
            store.label(rid, 1.0)
        trainer = GRPOTrainer(engine, GRPOConfig(track_reference_kl=False))
        algo = TrafficLearner(store, trainer, TrafficConfig(min_labelled=4, poll_s=0.2), checkpoint_dir=tmp_path)
        algo.start()
        try:
            stall, _ = _waits(algo, 1)
        finally:
            assert algo.stop(timeout=60)
    assert "2 of 4 labelled, 0 unlabelled: waiting for 2 more labelled rollouts" in stall
    assert "All 2 unused traffic rollouts are labelled: more traffic is needed" in stall, stall
    assert "store.label" not in stall and "min_labelled (now 4" in stall


def test_traffic_config_refuses_what_it_cannot_do():
    with pytest.raises(ConfigError, match="min_labelled must be an int >= 1"):
        TrafficConfig(min_labelled=0)
    assert TrafficConfig(min_labelled=1, max_batch=1).min_labelled == 1  # one labelled request is enough
    with pytest.raises(ConfigError, match=r"baseline_init must be a finite number.*0\.5 for 0/1"):
        TrafficConfig(baseline_init=float("nan"))
    with pytest.raises(ConfigError, match="max_batch must be an int >= min_labelled"):
        TrafficConfig(min_labelled=8, max_batch=4)
    with pytest.raises(ConfigError, match="poll_s"):
        TrafficConfig(poll_s=0)


def test_the_learners_own_checkpoint_folder_goes_with_it_and_a_named_one_stays(engine, tmp_path):
    """Issue 43: following the README (learner.stop()) left ~0.5 GB per checkpoint in /tmp after the kernel ended."""
    import gc
    import subprocess
    import sys
    from pathlib import Path

    from lightning_nb.trainers.grpo import GRPOConfig, GRPOTrainer

    store = InMemoryStore()
    trainer = GRPOTrainer(engine, GRPOConfig(track_reference_kl=False))
    own = TrafficLearner(store, trainer)
    folder = own.checkpoint_dir
    assert folder.is_dir() and folder.name.startswith("lightning_nb_traffic_")
    (folder / "before_update_1.pt").write_bytes(b"weights")
    assert own.stop(timeout=10) and not folder.exists()  # stop() removes it
    own.close()  # idempotent
    named = TrafficLearner(store, trainer, checkpoint_dir=tmp_path / "mine")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "before_update_1.pt").write_bytes(b"weights")
    assert named.stop(timeout=10)
    named.close()
    assert (tmp_path / "mine" / "before_update_1.pt").exists()  # a folder the user named is never removed
    # garbage collection: the learner with its trainer (the trainer holds the algorithm it drives)
    other = GRPOTrainer(engine, GRPOConfig(track_reference_kl=False))
    collected = TrafficLearner(store, other)
    folder = collected.checkpoint_dir
    del collected, other
    gc.collect()
    assert not folder.exists()
    # interpreter exit, the kernel shut down without stop() or close()
    code = ("from lightning_nb import GRPOConfig, GRPOTrainer, InMemoryStore, TrafficLearner\n"
            "from lightning_nb.engines.transformers import TransformersEngine\n"
            "engine = TransformersEngine.from_default()\n"
            "learner = TrafficLearner(InMemoryStore(), GRPOTrainer(engine, GRPOConfig(track_reference_kl=False)))\n"
            "(learner.checkpoint_dir / 'before_update_1.pt').write_bytes(b'weights')\n"
            "print(learner.checkpoint_dir)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    left = out.stdout.strip().splitlines()[-1]
    assert "lightning_nb_traffic_" in left and not Path(left).exists()


def test_two_learners_and_a_restart_on_a_sqlite_file_train_on_each_rollout_once(pristine, tmp_path):
    """Issue 53 item 2: a second learner, and one on the reopened file after a restart, skip what earlier updates
    trained on, say how many and why; the store's training record and updates_df() show where each rollout went."""
    from lightning_nb.proxy.proxy import LLMProxy
    from lightning_nb.store import SqliteStore
    from lightning_nb.trainers.grpo import GRPOConfig, GRPOTrainer

    engine, db = pristine, tmp_path / "traffic.db"
    # max_staleness=8: all six are sent before the first update; the third update must not drop its two as stale
    trainer = GRPOTrainer(engine, GRPOConfig(track_reference_kl=False, micro_batch_size=8, max_staleness=8))
    config = TrafficConfig(min_labelled=2, max_batch=2, keep_checkpoints=1)
    store = SqliteStore(db)
    with LLMProxy(engine, store) as proxy:
        client = OpenAI(base_url=proxy.traffic_endpoint(), api_key="x", max_retries=0)
        sent = [_ask(client, proxy.served_models[0], f"Say a word about {w}.")
                for w in ("cats", "rain", "tea", "snow", "bread", "wind")]
    for rid, reward in zip(sent, (1.0, 0.0) * 3):  # singletons: each trains against the baseline 0.5
        store.label(rid, reward)
    first = TrafficLearner(store, trainer, config, checkpoint_dir=tmp_path / "a", name="first")
    assert first.step()["rollout_ids"] == sent[:2]
    second = TrafficLearner(store, trainer, config, checkpoint_dir=tmp_path / "b")  # beside it, same store
    poll = second.poll()
    assert poll["skipped"] == 2 and poll["ready"] == sent[2:4] and poll["pending"] == 4
    assert poll["skipped_why"].startswith("2 labelled or unlabelled traffic rollout(s) skipped: already trained on "
                                          "(first update 1;") and "retrain=True" in poll["skipped_why"]
    assert second.step()["rollout_ids"] == sent[2:4] and first.poll()["skipped"] == 2  # each sees the other's
    first_df, second_df = first.updates_df(), second.updates_df()
    store.close()  # the kernel restarts

    store = SqliteStore(db)  # reopened: the training record is in the file
    try:
        third = TrafficLearner(store, trainer, config, checkpoint_dir=tmp_path / "c")
        assert third.poll()["skipped"] == 4 and third.last_poll["ready"] == sent[4:]
        assert third.step()["rollout_ids"] == sent[4:]
        assert third.step() is None and third.last_poll["pending"] == 0  # nothing left: nothing trained twice
        again = TrafficLearner(store, trainer, config, checkpoint_dir=tmp_path / "d", retrain=True)
        assert again.poll()["skipped"] == 0 and again.last_poll["pending"] == 6  # asked to: all of them again

        rows = [(row.learner, row.update, rid) for df in (first_df, second_df, third.updates_df())
                for row in df.itertuples() for rid in row.rollout_ids]
        assert sorted(rid for *_, rid in rows) == sorted(sent)  # each rollout trained on once, by one update
        assert [learner for learner, *_ in rows] == ["first"] * 2 + [second.name] * 2 + [third.name] * 2
        marks = {(m.learner, m.update, m.rollout_id) for m in store.query_trained()}
        assert marks == set(rows) and len(store.query_trained()) == 6  # the store says where each went, once
    finally:
        store.close()
