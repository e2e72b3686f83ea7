"""Pause is a pause, under load; interrupting ``trainer.wait()`` in a real Jupyter kernel leaves the trainer truthful."""

from __future__ import annotations

import re
import threading
import time

import pytest

from lightning_nb import AlgorithmConfig, GRPOConfig, GRPOTrainer, InMemoryStore, LightningRL, LLMProxy, start_runners
from lightning_nb.tasks.calc import calc_agent, load_tasks
from lightning_nb.algorithm.checkpoint import RunCheckpoint
from lightning_nb.algorithm.control import BackgroundLoop, LoopProgress
from lightning_nb.errors import ConfigError, LightningNbError

pytestmark = pytest.mark.slow


def _checksum(model) -> float:
    return float(sum(p.detach().double().sum() for p in model.parameters()))


def test_pause_returns_only_at_a_step_boundary_under_load(engine, pristine):
    store = InMemoryStore()
    proxy = LLMProxy(engine, store).start()
    store.add_resources({"main_llm": proxy.as_resource()})
    runners = start_runners(calc_agent, store, n=4)
    trainer = GRPOTrainer(engine, GRPOConfig(learning_rate=1e-5, track_reference_kl=False))
    algo = LightningRL(store, trainer, load_tasks("train"), config=AlgorithmConfig(
        tasks_per_step=2, group_size=2, max_tokens=16, temperature=1.0, max_sample_rounds=2))
    try:
        trainer.start(algo, steps=100)
        seen = set()
        for delay in (0.5, 3.0, 6.0, 2.0):
            time.sleep(delay)
            assert trainer.pause(timeout=300), trainer.state
            assert trainer.state == "paused" and trainer.paused_at, (trainer.state, trainer.paused_at)
            seen.add(trainer.paused_at)
            # nothing in flight: no rollout queued or running, no update, the engine free at once
            active = [r.status for r in store.query_rollouts() if r.status not in ("succeeded", "failed", "cancelled")]
            assert active == []
            assert not trainer._updating.locked()
            assert engine.lock.acquire(timeout=0)
            engine.lock.release()
            n, step, weights = len(store.query_rollouts()), trainer.step, _checksum(engine.model)
            assert engine.chat("What is 3 + 4?", max_tokens=8)
            time.sleep(3)  # a loop that was not really parked would enqueue or update by now
            assert (len(store.query_rollouts()), trainer.step, _checksum(engine.model)) == (n, step, weights)
            assert trainer.state == "paused"
            trainer.resume()
            assert trainer.state in ("running", "finished")
        assert seen <= {"before collect", "between sample rounds", "before update", "before evaluate"}
        assert trainer.stop(timeout=300) and trainer.state == "stopped"
        assert trainer.error is None
    finally:
        trainer.stop(timeout=60)
        runners.stop()
        proxy.stop()


class _Sleeper(BackgroundLoop, RunCheckpoint):
    """An algorithm whose steps only reach one boundary and sleep: the control surface alone (the loop
    and the run's checkpoint belong to the algorithm, as in LightningRL; the trainer's verbs delegate here).

    With ``units``, a step reports its progress as ``LightningRL.step`` and the trainer's update do
    (0 to ``units`` rollouts, the boundary ``before update``, 0 to ``units`` micro-batches, ``sleep_s`` after each),
    then counts itself done (``trainer.step += 1``).
    """

    def __init__(self, trainer, boundary: str, sleep_s: float, units: int = 0):
        self.trainer, self.boundary, self.sleep_s, self.units = trainer, boundary, sleep_s, units
        self._init_loop()

    def run(self, steps):
        for _ in range(steps):
            self.at_boundary(self.boundary)
            if not self.units:
                time.sleep(self.sleep_s)
                continue
            self._phase("rollouts", "rollouts")
            self.at_boundary("before update")
            self._phase("update", "micro-batches")
            self.trainer.step += 1

    def _phase(self, phase, unit):
        for done in range(self.units + 1):
            self.report_progress(phase, done, self.units, unit=unit, step=self.trainer.step + 1)
            time.sleep(self.sleep_s)


def _watch(trainer):
    """Record every distinct ``trainer.progress`` (polled each 2 ms) until the returned event is set."""
    seen, done = [], threading.Event()

    def poll():
        while not done.is_set():
            p = trainer.progress
            if not seen or seen[-1] != p:
                seen.append(p)
            time.sleep(0.002)

    threading.Thread(target=poll, daemon=True).start()
    return seen, done


def _frames(err: str) -> list[tuple[float, str]]:
    """``(n, frame)`` of each frame of a text tqdm bar of ``wait(progress=True)`` (``| 0.25/2 steps [...]``)."""
    out = []
    for frame in re.split(r"[\r\n]+", err):
        m = re.search(r"\| (\d+\.\d\d)/\d+ steps \[", frame)
        if m:
            out.append((float(m.group(1)), frame))
    return out


def _until(predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def test_start_refuses_a_second_loop_and_state_follows_the_loop(engine):
    trainer = GRPOTrainer(engine, GRPOConfig(track_reference_kl=False))
    assert trainer.state == "idle"
    trainer.start(_Sleeper(trainer, "before collect", 0.1), steps=10_000)
    assert trainer.state == "running"
    with pytest.raises(LightningNbError, match="already running"):
        trainer.start(_Sleeper(trainer, "before collect", 0.1), steps=1)
    assert trainer.wait(timeout=0.3) is False and trainer.state == "running"
    assert trainer.pause(timeout=10) and trainer.state == "paused" and trainer.paused_at == "before collect"
    assert trainer.stop(timeout=10) and trainer.state == "stopped"


def test_save_refuses_while_paused_before_evaluate(engine, tmp_path):
    """Paused after a step's update and before its evaluation, a checkpoint would continue differently."""
    trainer = GRPOTrainer(engine, GRPOConfig(track_reference_kl=False))
    trainer.start(_Sleeper(trainer, "before evaluate", 0.05), steps=10_000)  # parks only where a step evaluates
    try:
        assert trainer.pause(timeout=10) and trainer.paused_at == "before evaluate"
        with pytest.raises(ConfigError, match=r"paused before step 0's evaluation.*trainer.resume\(\) and save"):
            trainer.save(tmp_path / "ckpt.pt")
        assert list(tmp_path.iterdir()) == []
        trainer.resume()
    finally:
        assert trainer.stop(timeout=10) and trainer.state == "stopped"


KERNEL_SETUP = """
import time
from lightning_nb import GRPOConfig, GRPOTrainer, TransformersEngine
from lightning_nb.algorithm.control import BackgroundLoop
engine = TransformersEngine.from_default()
trainer = GRPOTrainer(engine, GRPOConfig(track_reference_kl=False))
class Sleeper(BackgroundLoop):
    trainer = trainer
    def __init__(self):
        self._init_loop()
    def run(self, steps):
        for _ in range(steps):
            self.at_boundary("before collect")
            time.sleep(0.1)
            trainer.step += 1
"""


def _run_cell(kc, code: str, timeout: float = 180) -> str:
    out: list[str] = []

    def hook(msg):
        if msg["msg_type"] == "stream":
            out.append(msg["content"]["text"])
        elif msg["msg_type"] == "error":
            out.append(f"{msg['content']['ename']}: {msg['content']['evalue']}")

    reply = kc.execute_interactive(code, output_hook=hook, timeout=timeout)
    assert reply["content"]["status"] == "ok", "".join(out)
    return "".join(out)


def test_interrupting_wait_in_a_real_kernel_keeps_state_true():
    """Kernel ▸ Interrupt during ``trainer.wait()`` (cpython#90882 would mark the live thread dead)."""
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3")
    try:
        _run_cell(kc, KERNEL_SETUP)
        msg_id = kc.execute("trainer.start(Sleeper(), steps=100_000)\ntrainer.wait()")
        time.sleep(3)
        km.interrupt_kernel()
        deadline = time.monotonic() + 60
        while True:
            reply = kc.get_shell_msg(timeout=max(1, deadline - time.monotonic()))
            if reply["parent_header"].get("msg_id") == msg_id:
                break
        assert reply["content"]["status"] == "error" and reply["content"]["ename"] == "KeyboardInterrupt"
        out = _run_cell(kc, "s0 = trainer.step; time.sleep(1.5)\n"
                            "print(trainer.state, trainer.running, trainer.step > s0)")
        assert out.split() == ["running", "True", "True"], out
        out = _run_cell(kc, "try:\n    trainer.start(Sleeper(), steps=5)\nexcept Exception as e:\n"
                            "    print('refused:', type(e).__name__)")
        assert out.strip() == "refused: LightningNbError", out
        out = _run_cell(kc, "print(trainer.pause(timeout=30), trainer.state)")
        assert out.split() == ["True", "paused"], out
        out = _run_cell(kc, "s = trainer.step; time.sleep(1); print(trainer.step == s)")
        assert out.strip() == "True", out
        out = _run_cell(kc, "print(trainer.stop(timeout=30), trainer.state, trainer.running)")
        assert out.split() == ["True", "stopped", "False"], out
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def test_a_new_reward_function_set_while_paused_takes_effect_on_resume(engine, pristine, proxied_store,
                                                                        agent_with_reward):
    store = proxied_store
    runners = start_runners(agent_with_reward([0.0, 1.0]), store, n=2)
    trainer = GRPOTrainer(engine, GRPOConfig(track_reference_kl=False))
    algo = LightningRL(store, trainer, load_tasks("train"), config=AlgorithmConfig(
        tasks_per_step=1, group_size=2, max_tokens=4, max_sample_rounds=1))
    try:
        trainer.start(algo, steps=3)  # the pause may park after step 2's rollouts ran: step 3 is after it
        deadline = time.monotonic() + 300
        while trainer.step < 1:
            assert time.monotonic() < deadline and trainer.state != "failed", trainer.error
            time.sleep(0.2)
        assert trainer.pause(timeout=300)
        first = {r.rollout_id for r in store.query_rollouts()}
        with pytest.warns(UserWarning, match="stopped"):  # the cell re-run: the old runners are replaced
            runners = start_runners(agent_with_reward([0.25, 0.75]), store, n=2)
        trainer.config.learning_rate = 1e-5
        trainer.resume()
        assert trainer.wait(timeout=300) and trainer.step == 3
    finally:
        trainer.stop(timeout=60)
        runners.stop()
    rewards = store.final_rewards()
    later = {rid: rw for rid, rw in rewards.items() if rid not in first}
    assert later and set(later.values()) <= {0.25, 0.75}, later
    changed = [m["step"] for m in trainer.metrics if "learning_rate 2e-05 → 1e-05" in m["config_changes"]]
    assert len(changed) == 1 and changed[0] >= 2 and trainer.metrics[-1]["lr"] == 1e-5


def test_progress_moves_within_a_step_and_reads_paused_where_the_loop_parks(engine):
    trainer = GRPOTrainer(engine, GRPOConfig(track_reference_kl=False))
    assert (trainer.progress.phase, trainer.progress.step) == ("idle", 0)
    seen, done = _watch(trainer)
    trainer.start(_Sleeper(trainer, "before collect", 0.1, units=4), steps=1000)
    try:
        _until(lambda: trainer.step >= 1)
        assert trainer.pause(timeout=10) and trainer.state == "paused"
        p = trainer.progress
        assert p.phase == "paused" and p.boundary == trainer.paused_at and f"paused {p.boundary}" in str(p)
        trainer.resume()
        assert trainer.progress.phase != "paused"
    finally:
        assert trainer.stop(timeout=10)
        done.set()
    assert trainer.progress.phase == "ended"
    step1 = [p for p in seen if p.step == 1 and p.phase in ("rollouts", "update")]
    assert [p.phase for p in step1] == sorted((p.phase for p in step1), key=["rollouts", "update"].index)
    for phase in ("rollouts", "update"):
        counts = [p.done for p in step1 if p.phase == phase]
        assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == 4 and len(set(counts)) >= 3, counts
    assert str(step1[-1]) == "step 1 · update 4/4 micro-batches"


def test_wait_progress_moves_within_a_step_and_shows_no_eta_before_a_step_was_measured(engine, capsys):
    trainer = GRPOTrainer(engine, GRPOConfig(track_reference_kl=False))
    trainer.start(_Sleeper(trainer, "before collect", 0.3, units=4), steps=2)  # a step: 10 reports 0.3 s apart
    try:
        assert trainer.wait(progress=True, timeout=60) is True
    finally:
        trainer.stop(timeout=10)
    frames = _frames(capsys.readouterr().err)
    ns = [n for n, _ in frames]
    assert ns and ns == sorted(ns) and ns[-1] == 2.0, ns
    assert len({n for n in ns if 0 < n < 1}) >= 4, ns  # moved inside step 1, not once per step
    before = [f for n, f in frames if n < 1]
    assert before and not any("<" in f for f in before), before  # tqdm's "<remaining" only after a step
    assert any(re.search(r"<\d\d:\d\d", f) for n, f in frames if n >= 1)
    assert any("step 1 · rollouts" in f for f in before) and any("step 1 · update" in f for f in before)


def test_pause_progress_shows_the_phase_it_waits_for(engine, capsys):
    trainer = GRPOTrainer(engine, GRPOConfig(track_reference_kl=False))
    trainer.start(_Sleeper(trainer, "before collect", 0.3, units=4), steps=1000)
    try:
        _until(lambda: trainer.progress.phase == "update" and trainer.progress.done == 1)
        assert trainer.pause(timeout=30, progress=True) is True
        assert trainer.state == "paused" and trainer.paused_at == "before collect" and trainer.step == 1
        err = capsys.readouterr().err
        assert "pausing: step 1 update" in err and re.search(r"\| [234]/4 micro-batches", err), err
    finally:
        assert trainer.stop(timeout=10)


def test_the_algorithm_and_the_update_report_progress_and_wait_returns_at_until_step(
        engine, pristine, proxied_store, agent_with_reward, capsys):
    store = proxied_store
    runners = start_runners(agent_with_reward([0.0, 1.0]), store, n=2)
    trainer = GRPOTrainer(engine, GRPOConfig(track_reference_kl=False, micro_batch_size=1))
    algo = LightningRL(store, trainer, load_tasks("train"), config=AlgorithmConfig(
        tasks_per_step=1, group_size=4, max_tokens=4, max_sample_rounds=1))
    seen, done = _watch(trainer)
    try:
        trainer.start(algo, steps=3)
        assert trainer.wait(until_step=1, progress=True, timeout=300) is True
        assert trainer.step == 1 and trainer.running  # returned at step 1; the loop goes on
        frames = _frames(capsys.readouterr().err)
        _until(lambda: len(store.query_rollouts()) == 8)  # step 2 collects (its LLM calls take a second or more)
        assert trainer.pause(timeout=300) and trainer.paused_at == "before update"
        assert trainer.progress == LoopProgress(step=2, phase="paused", done=4, total=4, unit="rollouts",
                                                boundary="before update")
    finally:
        trainer.stop(timeout=60)
        runners.stop()
        done.set()
    step1 = [p for p in seen if p.step == 1]
    rollouts = [p for p in step1 if p.phase == "rollouts"]
    update = [p for p in step1 if p.phase == "update"]
    assert rollouts[0].done == 0 and {p.total for p in rollouts} == {4}, rollouts
    assert [p.done for p in rollouts] == sorted(p.done for p in rollouts)
    assert step1.index(rollouts[-1]) < step1.index(update[0])
    # 4 sequences with non-zero advantages, one per micro-batch (each a forward and backward: the poll sees most)
    counts = [p.done for p in update if p.total]
    assert counts == sorted(counts) and len(set(counts)) >= 3 and {p.total for p in update if p.total} == {4}, update
    assert frames and frames[-1][0] == 1.0 and "training to step 1" in frames[-1][1]
    assert any(0 < n < 1 and "step 1 · update" in f for n, f in frames), frames
