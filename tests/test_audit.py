"""Token fidelity, preflight and the optimizer's-eye view, on the real model behind the real proxy."""

from __future__ import annotations

import hashlib
import html
import itertools
import json
import math
import re

import openai
import pytest
import torch

from lightning_nb import semconv
from lightning_nb import AlgorithmConfig, GRPOConfig, GRPOTrainer, InMemoryStore, LightningRL, LLMProxy, start_runners
from lightning_nb.inspect.audit import FIDELITY_COLUMNS, batch_df, batch_html, token_fidelity
from lightning_nb.models import DEFAULT_MODEL_NAME as M
from lightning_nb.trainers.packing import pack_episode
from lightning_nb.types import Triplet

pytestmark = pytest.mark.slow

CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


def _client(store, proxy):
    """A rollout of its own and an OpenAI client on its URL."""
    rid = store.enqueue_rollout("t").rollout_id
    aid = store.dequeue_rollout().attempt.attempt_id
    return rid, openai.OpenAI(base_url=proxy.endpoint(rid, aid), api_key="unused", max_retries=0)


def _ask(client, messages, **kw):
    reply = client.chat.completions.create(model=M, messages=messages, temperature=kw.pop("temperature", 0.0),
                                           max_tokens=kw.pop("max_tokens", 12), **kw)
    return reply.choices[0].message.content or ""


# ----- token fidelity ---------------------------------------------------------------------
def test_served_calls_re_render_identically_and_verbatim_turns_extend(proxied, engine):
    """Plain, developer-role, tool-rendered and multi-turn calls: every served prompt re-renders token for token."""
    store, proxy = proxied
    rid, client = _client(store, proxy)
    history = [{"role": "developer", "content": "Answer briefly."}, {"role": "user", "content": "What is 2 + 2?"}]
    history.append({"role": "assistant", "content": _ask(client, history)})
    history.append({"role": "user", "content": "And 3 + 3?"})
    history.append({"role": "assistant", "content": _ask(client, history)})
    tools_rid, tools_client = _client(store, proxy)
    _ask(tools_client, [{"role": "user", "content": "What is 17 * 23?"}], tools=[CALCULATOR])
    _ask(tools_client, [{"role": "user", "content": "What is 17 * 23?"}], tools=[CALCULATOR], tool_choice="auto")

    df = token_fidelity(store, [rid, tools_rid], engine.tokenizer)
    assert list(df.columns) == FIDELITY_COLUMNS
    assert df.attrs == {"calls_checked": 4, "rollouts_checked": 2}
    renders = df[df.kind == "render"]
    assert renders.empty, renders.to_dict("records")
    # the verbatim conversation (reply sent back as is) extends turn by turn, so the packer merges it
    assert df[(df.kind == "fork") & (df.rollout_id == rid)].empty, df.to_dict("records")
    # the two tool calls share no history: the second prompt does not extend the first, and that is a fork
    (fork,) = df[(df.kind == "fork") & (df.rollout_id == tools_rid)].itertuples()
    assert fork.turn == 1


def test_a_hand_made_fork_is_reported_at_the_first_differing_token(proxied, engine):
    """The agent rewrites its system message between turns: the fork is at the first edited token."""
    store, proxy = proxied
    tok = engine.tokenizer
    rid, client = _client(store, proxy)
    first = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Hi!"}]
    reply = _ask(client, first)
    edited = [{"role": "system", "content": "You are a terse assistant."}, {"role": "user", "content": "Hi!"},
              {"role": "assistant", "content": reply}, {"role": "user", "content": "Bye!"}]
    _ask(client, edited)

    df = token_fidelity(store, [rid], tok)
    (row,) = df.itertuples()  # a fork, and no render mismatch
    assert (row.rollout_id, row.turn, row.kind, row.cause) == (rid, 1, "fork", "history_edited")
    head = "<|im_start|>system\nYou are a"
    pos = len(tok(head, add_special_tokens=False)["input_ids"])
    terse, helpful = (tok(head + w, add_special_tokens=False)["input_ids"][pos] for w in (" terse", " helpful"))
    assert (row.position, row.served_id, row.expected_id) == (pos, terse, helpful)
    assert f"«{tok.decode([terse])}»" in row.served and f"«{tok.decode([helpful])}»" in row.expected
    assert row.served.startswith("…") and "|" in row.served
    # the packer agrees: the second turn starts a new sequence
    spans = [s for s in store.query_spans(rid) if s.name == "llm.chat.completions"]
    triplets = [Triplet(rollout_id=rid, attempt_id=s.attempt_id, group_id="g", turn=i, reward=0.0,
                        prompt_ids=s.attributes[semconv.PROMPT_TOKEN_IDS],
                        response_ids=s.attributes[semconv.COMPLETION_TOKEN_IDS])
                for i, s in enumerate(spans)]
    assert len(pack_episode(triplets, 1.0)) == 2


def test_a_render_mismatch_is_reported_where_the_messages_differ(proxied, engine):
    """A span whose recorded messages do not render to its served prompt (here: edited after the fact)."""
    store, proxy = proxied
    tok = engine.tokenizer
    rid, client = _client(store, proxy)
    _ask(client, [{"role": "user", "content": "What is 2 + 2?"}])
    (span,) = store.query_spans(rid)
    other, _ = _client(store, proxy)
    aid = store.query_attempts(other)[0].attempt_id
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    store.add_span(span.model_copy(update={"rollout_id": other, "attempt_id": aid, "span_id": "edited", "attributes": {
        **span.attributes, "gen_ai.prompt": json.dumps(messages)}}))
    assert token_fidelity(store, [rid], tok).empty
    (row,) = token_fidelity(store, [other], tok).itertuples()
    served, rendered = span.attributes[semconv.PROMPT_TOKEN_IDS], engine.apply_chat_template(messages)
    pos = next(i for i, (a, b) in enumerate(zip(served, rendered)) if a != b)
    assert (row.kind, row.cause, row.turn, row.position, row.served_id, row.expected_id) == (
        "render", "template", 0, pos, served[pos], rendered[pos])
    assert tok.decode([row.served_id]).strip() == "2" and tok.decode([row.expected_id]).strip() == "3"


# ----- preflight --------------------------------------------------------------------------
def _weights_hash(model) -> str:
    h = hashlib.sha256()
    for k, v in model.state_dict().items():
        h.update(k.encode())
        h.update(v.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def _optimizer_hash(optimizer) -> str:
    h = hashlib.sha256()
    state = optimizer.state_dict()
    h.update(repr(state["param_groups"]).encode())
    for i, s in sorted(state["state"].items()):
        for k, v in sorted(s.items()):
            h.update(f"{i}.{k}".encode())
            h.update(v.contiguous().numpy().tobytes() if torch.is_tensor(v) else repr(v).encode())
    return h.hexdigest()


def _snapshot(algo):
    t = algo.trainer
    return (_weights_hash(t.model), _optimizer_hash(t.optimizer), t.step, t.engine.weight_version, len(algo.metrics),
            algo.state_dict(), dict(algo.adapter.skipped))


def _one_call_agent(reward_of, prompt="Reply with one word: yes or no."):
    """An agent making one real LLM call through the proxy; ``reward_of()`` gives its return value."""
    def agent(task, llm):
        client = openai.OpenAI(base_url=llm.endpoint, api_key=llm.api_key, max_retries=0)
        try:
            client.chat.completions.create(model=llm.model, messages=[{"role": "user", "content": prompt}],
                                           **llm.sampling_parameters)
        finally:
            client.close()
        return reward_of(task)
    return agent


def _alternating():
    """Rewards 0, 1, 0, ... per task id: each group (one task) gets both values, whatever the finishing order."""
    counters: dict = {}
    return lambda task: float(next(counters.setdefault(task["id"], itertools.count())) % 2)


@pytest.fixture
def rig(engine, pristine):
    """build(agent, **algorithm_config) -> LightningRL on a fresh store, proxy and runners (stopped after)."""
    made = []

    def build(agent, trainer_config=None, **cfg):
        store = InMemoryStore()
        proxy = LLMProxy(engine, store).start()
        store.add_resources({"main_llm": proxy.as_resource()})
        runners = start_runners(agent, store, n=4)
        trainer = GRPOTrainer(engine, GRPOConfig(track_reference_kl=False, skip_zero_advantage=False,
                                                 **(trainer_config or {})))
        config = AlgorithmConfig(**{"tasks_per_step": 2, "group_size": 2, "max_tokens": 16, "max_sample_rounds": 1,
                                    **cfg})
        made.append((runners, proxy))
        return LightningRL(store, trainer, [{"id": f"t{i}"} for i in range(8)], config=config)

    yield build
    for runners, proxy in made:
        runners.stop()
        proxy.stop()


STORY = "Tell me a long story about a dragon."


@pytest.mark.parametrize("case", ["no_reward", "no_signal", "truncated", "all_zero_masks"])
def test_preflight_reports_the_blocker_with_its_fix_and_changes_nothing(rig, case):
    agent, cfg, trainer_config, fix = {
        "no_reward": (_one_call_agent(lambda task: None), {}, {}, "emit_reward"),
        "no_signal": (_one_call_agent(lambda task: 1.0), {}, {}, "group_size"),
        "truncated": (_one_call_agent(_alternating(), STORY), {"max_tokens": 2}, {}, "max_tokens = 4"),
        "all_zero_masks": (_one_call_agent(_alternating(), STORY), {"max_tokens": 2}, {"overlong_filter": True},
                           "overlong_filter = False"),
    }[case]
    algo = rig(agent, trainer_config, **cfg)
    before = _snapshot(algo)
    report = algo.preflight()
    assert _snapshot(algo) == before  # weights, optimizer, step, weight version, task sampler, adapter counts
    assert not report.ok and case in [b.name for b in report.blockers], str(report)
    (blocker,) = [b for b in report.blockers if b.name == case]
    assert fix in blocker.fix
    rollouts = algo.store.query_rollouts(rollout_ids=report.rollout_ids)
    assert len(rollouts) == 4 and all(r.mode == "train" and r.metadata["preflight"] is True for r in rollouts)
    if case == "no_reward":
        assert "no_triplets" in report.names() and report.stats["triplets"] == 0
        assert "not_succeeded" in next(b.message for b in report.blockers if b.name == "no_triplets")
    if case == "no_signal":
        assert report.stats["groups_with_signal"] == 0 and report.stats["rewards"] == [1.0]
    if case in ("truncated", "all_zero_masks"):
        assert report.stats["truncated"] == report.stats["llm_calls"] == 4
        assert "no_signal" not in report.names()
        assert ("all_zero_masks" in report.names()) == (case == "all_zero_masks")
    frame = report.to_frame()
    assert list(frame.columns) == ["severity", "name", "message", "fix"] and (frame.severity == "blocker").any()
    assert "BLOCKER " + case in str(report) and f'data-name="{case}"' in report._repr_html_()


def test_preflight_without_runners_says_so_and_cancels_its_rollouts(engine):
    store = InMemoryStore()
    algo = LightningRL(store, GRPOTrainer(engine, GRPOConfig(track_reference_kl=False)), [{"id": "t"}],
                       config=AlgorithmConfig(tasks_per_step=1, group_size=2))
    report = algo.preflight(start_timeout_s=1.0)
    assert report.names() == ["no_runners"] and "start_runners" in report.blockers[0].fix
    assert {r.status for r in store.query_rollouts(rollout_ids=report.rollout_ids)} == {"cancelled"}


def test_preflight_on_a_healthy_setup_is_ok_then_the_batch_view_shows_the_update(rig):
    def agent(task, llm):  # two turns, the reply sent back verbatim: the packer merges them
        client = openai.OpenAI(base_url=llm.endpoint, api_key=llm.api_key, max_retries=0)
        messages = [{"role": "user", "content": "Reply with one word: yes or no."}]
        try:
            for follow_up in ("Are you sure? One word.", None):
                reply = client.chat.completions.create(model=llm.model, messages=messages, **llm.sampling_parameters)
                messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
                if follow_up:
                    messages.append({"role": "user", "content": follow_up})
        finally:
            client.close()
        return reward(task)

    reward = _alternating()
    # 48 tokens, not 24: at temperature 0.7 the model now and then rambles past 24 tokens on both turns of half
    # the rollouts (seen once in a full suite run: 4 of 8 responses truncated, the 50% blocker), and a healthy
    # set-up leaves its answers room
    algo = rig(agent, max_tokens=48, temperature=0.7)
    before = _snapshot(algo)
    report = algo.preflight()
    assert report.ok, str(report)
    assert _snapshot(algo) == before
    s = report.stats
    assert s["rollouts"] == s["succeeded"] == 4 and s["llm_calls"] == s["triplets"] == 8
    assert s["groups_with_signal"] == 2 and s["render_mismatches"] == 0
    # the reply goes back verbatim, so the packer merges each rollout's two turns into one sequence; a sampled
    # reply may still re-tokenize differently (a non-canonical split, rare at 0.7: once in a CI run), and that
    # turn then forks, with the cause named and one sequence more, never an edited history
    forks = report.fidelity[report.fidelity.kind == "fork"]
    assert set(forks.cause) <= {"retokenized"}, forks.to_dict("records")
    assert s["forks"] == len(forks) and s["sequences"] == 4 + len(forks), report.fidelity.to_dict("records")
    assert 'data-ok="true"' in report._repr_html_() and str(report).startswith("preflight: OK")

    trainer = algo.trainer
    metrics = algo.step()
    batch = getattr(trainer, "last_batch", None)
    if batch is None:
        pytest.skip("GRPOTrainer.last_batch is not there yet; batch_df/batch_html are tested on hand-made batches")
    df = batch_df(batch, trainer.engine.tokenizer)
    assert len(df) == len(batch) == metrics["sequences_trained"]
    assert df.response_tokens.sum() == metrics["tokens_trained"]
    assert df.max_abs_logprob_diff.max() == pytest.approx(metrics["logprob_diff_max"], abs=1e-6)
    assert (df.mean_ratio - 1).abs().max() < 1e-3  # same weights sampled and scored
    page = batch_html(batch, trainer.engine.tokenizer, max_rows=len(batch))
    assert page.count('class="lnb-tok') == sum(len(b["input_ids"]) for b in batch)


# ----- the optimizer's-eye view -----------------------------------------------------------
def _hand_made_batch(engine):
    """Two sequences in the GRPOTrainer.last_batch format, from real prompts and real sampled tokens."""
    out = []
    for i, (question, adv) in enumerate([("What is 2 + 2?", 1.5), ("Name a colour.", -0.5)]):
        prompt = engine.apply_chat_template([{"role": "user", "content": question}])
        gen = engine.generate(prompt, max_tokens=6, temperature=1.0)
        ids = prompt + gen.completion_ids
        mask = [0] * len(prompt) + [1] * len(gen.completion_ids)
        old = [0.0] * len(prompt) + list(gen.logprobs)
        new = None
        if i == 0:  # the trainer's log-probs: equal, except the first response token, at ratio 1.5
            new = list(old)
            new[len(prompt)] += math.log(1.5)
        out.append({"rollout_id": f"r{i}", "group_id": "g", "input_ids": ids, "response_mask": mask,
                    "advantage": adv, "engine_logprobs": old, "trainer_logprobs": new})
    return out


def test_batch_html_has_one_span_per_token_with_the_mask_classes(engine):
    tok = engine.tokenizer
    batch = _hand_made_batch(engine)
    page = batch_html(batch, tok)
    tokens = re.findall(r'<span class="(lnb-tok[^"]*)"[^>]*title="([^"]*)">([^<]*)</span>', page)
    assert len(tokens) == sum(len(b["input_ids"]) for b in batch)
    expected_classes = [m for b in batch for m in b["response_mask"]]
    assert [("lnb-resp" in c) for c, _, _ in tokens] == [bool(m) for m in expected_classes]
    assert [("lnb-ctx" in c) for c, _, _ in tokens] == [not m for m in expected_classes]
    pieces = [p for b in batch for p in tok.batch_decode([[t] for t in b["input_ids"]])]
    assert [html.unescape(text) for _, _, text in tokens] == pieces  # every token, in order
    clipped = [t for t in tokens if "lnb-clipped" in t[0]]
    assert len(clipped) == 1 and "ratio 1.5000" in html.unescape(clipped[0][1])
    first_resp = len(batch[0]["input_ids"]) - sum(batch[0]["response_mask"])
    title = html.unescape(tokens[first_resp][1])
    assert f"old (engine) log-p {batch[0]['engine_logprobs'][first_resp]:.4f}" in title
    second_resp = len(batch[0]["input_ids"]) + batch[1]["response_mask"].index(1)  # its sampled reply may be short
    assert "not forwarded" in html.unescape(tokens[second_resp][1])
    assert "rgba(26,127,55" in page and "rgba(207,34,46" in page  # positive and negative advantage
    assert "1 more sequences" in batch_html(batch, tok, max_rows=1)

    df = batch_df(batch, tok)
    assert list(df.rollout_id) == ["r0", "r1"] and list(df.advantage) == [1.5, -0.5]
    assert list(df.tokens) == [len(b["input_ids"]) for b in batch]
    assert list(df.response_tokens) == [sum(b["response_mask"]) for b in batch]
    n = df.response_tokens[0]
    assert df.mean_ratio[0] == pytest.approx((n - 1 + 1.5) / n)
    assert df.max_abs_logprob_diff[0] == pytest.approx(math.log(1.5))
    assert math.isnan(df.mean_ratio[1]) and math.isnan(df.max_abs_logprob_diff[1])
    assert df.response_text[0] == tok.decode(batch[0]["input_ids"][-n:])
