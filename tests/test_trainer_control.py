"""Pause is a pause, under load; interrupting ``algo.wait()`` in a real Jupyter kernel leaves the trainer truthful."""

from __future__ import annotations

import re
import threading
import time
import warnings

import pytest

from lightning_nb import AlgorithmConfig, GRPOConfig, GRPOTrainer, InMemoryStore, LightningRL, LLMProxy, start_runners
from lightning_nb.tasks.calc import calc_agent, load_tasks
from lightning_nb.algorithm.checkpoint import load_run, save_run
from lightning_nb.algorithm.base import Algorithm
from lightning_nb.algorithm.control import LoopProgress
from lightning_nb.errors import ConfigError, LightningNbError, WaitWarning

from conftest import run_cell

pytestmark = pytest.mark.slow


def _checksum(model) -> float:
    return float(sum(p.detach().double().sum() for p in model.parameters()))


def test_pause_returns_only_at_a_step_boundary_under_load(engine, pristine):
    store = InMemoryStore()
    proxy = LLMProxy(engine, store).start()
    store.add_resources({"main_llm": proxy.as_resource()})
    runners = start_runners(calc_agent, store, n=2)
    trainer = GRPOTrainer(engine, GRPOConfig(learning_rate=1e-5, track_reference_kl=False))
    algo = LightningRL(store, trainer, load_tasks("train"), config=AlgorithmConfig(
        tasks_per_step=1, group_size=2, max_tokens=8, temperature=1.0, max_sample_rounds=2))
    try:
        algo.start(steps=100)
        seen = set()
        # the loop runs (and costs) between pauses, and a pause waits for the phase it lands in: one group of two
        # 8-token replies makes every phase short, and short waits still land the pauses in rollouts and updates
        for delay in (0.5, 1.5, 3.0, 1.0):
            time.sleep(delay)
            assert algo.pause(timeout=300), algo.state
            assert algo.state == "paused" and algo.paused_at, (algo.state, algo.paused_at)
            seen.add(algo.paused_at)
            # nothing in flight: no rollout queued or running, no update, the engine free at once
            active = [r.status for r in store.query_rollouts() if r.status not in ("succeeded", "failed", "cancelled")]
            assert active == []
            assert not trainer._updating.locked()
            assert engine.lock.acquire(timeout=0)
            engine.lock.release()
            n, step, weights = len(store.query_rollouts()), trainer.updates_applied, _checksum(engine.model)
            assert engine.chat("What is 3 + 4?", max_tokens=8)
            time.sleep(3)  # a loop that was not really parked would enqueue or update by now
            assert (len(store.query_rollouts()), trainer.updates_applied, _checksum(engine.model)) == (n, step, weights)
            assert algo.state == "paused"
            algo.resume()
            assert algo.state in ("running", "finished")
        print(f"\npaused at {sorted(seen)} after {trainer.updates_applied} updates")
        assert seen <= {"before collect", "between sample rounds", "before update", "before evaluate"}
        assert algo.stop(timeout=300) and algo.state == "stopped"
        assert algo.error is None
    finally:
        algo.stop(timeout=60)
        runners.stop()
        proxy.stop()


class _NoConfig:
    """A config with nothing to check."""

    def validate(self):
        pass


class _Sleeper(Algorithm):
    """An algorithm whose steps only reach one boundary and sleep: the control surface alone (the loop, the step
    counter and the run's checkpoint belong to the algorithm, as in LightningRL).

    With ``units``, a step reports its progress as ``LightningRL.step`` and the trainer's update do
    (0 to ``units`` rollouts, the boundary ``before update``, 0 to ``units`` micro-batches, ``sleep_s`` after each),
    then records its row (``global_step += 1``).
    """

    def __init__(self, trainer, boundary: str, sleep_s: float, units: int = 0):
        super().__init__(None, trainer, _NoConfig())
        self.boundary, self.sleep_s, self.units = boundary, sleep_s, units

    def state_dict(self):
        return self.run_record()

    def load_state_dict(self, state):
        self.load_run_record(state)

    def save(self, path):
        return save_run(self, path)

    def load(self, path, **options):
        load_run(self, path, **options)

    def run(self, steps):
        for _ in range(steps):
            self.step()

    def step(self):
        self.at_boundary(self.boundary)
        if not self.units:
            time.sleep(self.sleep_s)
            return None
        self._phase("rollouts", "rollouts")
        self.at_boundary("before update")
        self._phase("update", "micro-batches")
        return self.record({})

    def _phase(self, phase, unit):
        for done in range(self.units + 1):
            self.report_progress(phase, done, self.units, unit=unit, step=self.global_step + 1)
            time.sleep(self.sleep_s)


def _watch(algo):
    """Record every distinct ``algo.progress`` (polled each 2 ms) until the returned event is set."""
    seen, done = [], threading.Event()

    def poll():
        while not done.is_set():
            p = algo.progress
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
    algo = _Sleeper(trainer, "before collect", 0.1)
    assert algo.state == "idle"
    algo.start(steps=10_000)
    assert algo.state == "running"
    with pytest.raises(LightningNbError, match="already running"):
        algo.start(steps=1)
    with pytest.raises(LightningNbError, match="already running another algorithm's loop"):
        _Sleeper(trainer, "before collect", 0.1).start(steps=1)  # one loop at a time updates a trainer
    assert algo.wait(timeout=0.3) is False and algo.state == "running"
    assert algo.pause(timeout=10) and algo.state == "paused" and algo.paused_at == "before collect"
    assert algo.stop(timeout=10) and algo.state == "stopped"


def test_save_refuses_while_paused_before_evaluate(engine, tmp_path):
    """Paused after a step's update and before its evaluation, a checkpoint would continue differently."""
    trainer = GRPOTrainer(engine, GRPOConfig(track_reference_kl=False))
    algo = _Sleeper(trainer, "before evaluate", 0.05).start(steps=10_000)  # parks only where a step evaluates
    try:
        assert algo.pause(timeout=10) and algo.paused_at == "before evaluate"
        with pytest.raises(ConfigError, match=r"paused before step 0's evaluation.*algo.resume\(\) and save"):
            algo.save(tmp_path / "ckpt.pt")
        assert list(tmp_path.iterdir()) == []
        algo.resume()
    finally:
        assert algo.stop(timeout=10) and algo.state == "stopped"


KERNEL_SETUP = """
import time
from lightning_nb import GRPOConfig, GRPOTrainer, TransformersEngine
from lightning_nb.algorithm import Algorithm
engine = TransformersEngine.from_default()
trainer = GRPOTrainer(engine, GRPOConfig(track_reference_kl=False))
class NoConfig:
    def validate(self):
        pass
class Sleeper(Algorithm):
    def __init__(self):
        super().__init__(None, trainer, NoConfig())
    def run(self, steps):
        for _ in range(steps):
            self.step()
    def step(self):
        self.at_boundary("before collect")
        time.sleep(0.1)
        return self.record({})
    state_dict = load_state_dict = save = load = None
"""


def test_interrupting_wait_in_a_real_kernel_keeps_state_true():
    """Kernel ▸ Interrupt during ``algo.wait()`` (cpython#90882 would mark the live thread dead)."""
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3")
    try:
        run_cell(kc, KERNEL_SETUP)
        # stop_on_error=False: ipykernel 7 aborts requests that arrive between an error's
        # reply and its "stop aborting" message, so the next cell could come back 'aborted'
        # (a race of the kernel, not of wait(); CI hit it once at 95803ba).
        msg_id = kc.execute("algo = Sleeper().start(steps=100_000)\nalgo.wait()", stop_on_error=False)
        time.sleep(3)
        km.interrupt_kernel()
        deadline = time.monotonic() + 60
        while True:
            reply = kc.get_shell_msg(timeout=max(1, deadline - time.monotonic()))
            if reply["parent_header"].get("msg_id") == msg_id:
                break
        assert reply["content"]["status"] == "error" and reply["content"]["ename"] == "KeyboardInterrupt"
        out = run_cell(kc, "s0 = algo.global_step; time.sleep(1.5)\n"
                            "print(algo.state, algo.running, algo.global_step > s0)")
        assert out.split() == ["running", "True", "True"], out
        out = run_cell(kc, "try:\n    Sleeper().start(steps=5)\nexcept Exception as e:\n"
                            "    print('refused:', type(e).__name__)")
        assert out.strip() == "refused: LightningNbError", out
        out = run_cell(kc, "print(algo.pause(timeout=30), algo.state)")
        assert out.split() == ["True", "paused"], out
        out = run_cell(kc, "s = algo.global_step; time.sleep(1); print(algo.global_step == s)")
        assert out.strip() == "True", out
        out = run_cell(kc, "print(algo.stop(timeout=30), algo.state, algo.running)")
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
        algo.start(steps=3)  # the pause may park after step 2's rollouts ran: step 3 is after it
        deadline = time.monotonic() + 300
        while trainer.updates_applied < 1:
            assert time.monotonic() < deadline and algo.state != "failed", algo.error
            time.sleep(0.2)
        assert algo.pause(timeout=300)
        first = {r.rollout_id for r in store.query_rollouts()}
        with warnings.catch_warnings():  # a UserWarning only if the pause parked with attempts in flight (issue 53)
            warnings.simplefilter("ignore", UserWarning)
            runners = start_runners(agent_with_reward([0.25, 0.75]), store, n=2)  # the cell re-run
        assert runners.replaced.startswith("start_runners: stopped the previous group of 2 runner(s)"), runners.replaced
        trainer.config.learning_rate = 1e-5
        algo.resume()
        assert algo.wait(timeout=300) and trainer.updates_applied == 3
    finally:
        algo.stop(timeout=60)
        runners.stop()
    rewards = store.final_rewards()
    later = {rid: rw for rid, rw in rewards.items() if rid not in first}
    assert later and set(later.values()) <= {0.25, 0.75}, later
    changed = [m["step"] for m in algo.metrics if "learning_rate 2e-05 → 1e-05" in m["config_changes"]]
    assert len(changed) == 1 and changed[0] >= 2 and algo.metrics[-1]["lr"] == 1e-5


def test_progress_moves_within_a_step_and_reads_paused_where_the_loop_parks(engine):
    trainer = GRPOTrainer(engine, GRPOConfig(track_reference_kl=False))
    algo = _Sleeper(trainer, "before collect", 0.1, units=4)
    assert (algo.progress.phase, algo.progress.step) == ("idle", 0)
    seen, done = _watch(algo)
    algo.start(steps=1000)
    try:
        _until(lambda: algo.global_step >= 1)
        assert algo.pause(timeout=10) and algo.state == "paused"
        p = algo.progress
        assert p.phase == "paused" and p.boundary == algo.paused_at and f"paused {p.boundary}" in str(p)
        algo.resume()
        assert algo.progress.phase != "paused"
    finally:
        assert algo.stop(timeout=10)
        done.set()
    assert algo.progress.phase == "ended"
    step1 = [p for p in seen if p.step == 1 and p.phase in ("rollouts", "update")]
    assert [p.phase for p in step1] == sorted((p.phase for p in step1), key=["rollouts", "update"].index)
    for phase in ("rollouts", "update"):
        counts = [p.done for p in step1 if p.phase == phase]
        assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == 4 and len(set(counts)) >= 3, counts
    assert str(step1[-1]) == "step 1 · update 4/4 micro-batches"


def test_wait_progress_moves_within_a_step_and_shows_no_eta_before_a_step_was_measured(engine, capsys):
    trainer = GRPOTrainer(engine, GRPOConfig(track_reference_kl=False))
    algo = _Sleeper(trainer, "before collect", 0.3, units=4).start(steps=2)  # a step: 10 reports 0.3 s apart
    try:
        assert algo.wait(progress=True, timeout=60) is True
    finally:
        algo.stop(timeout=10)
    frames = _frames(capsys.readouterr().err)
    ns = [n for n, _ in frames]
    assert ns and ns == sorted(ns) and ns[-1] == 2.0, ns
    assert len({n for n in ns if 0 < n < 1}) >= 4, ns  # moved inside step 1, not once per step
    before = [f for n, f in frames if n < 1]
    assert before and not any("<" in f for f in before), before  # tqdm's "<remaining" only after a step
    assert any(re.search(r"<\d\d:\d\d", f) for n, f in frames if n >= 1)
    assert any("step 1 · rollouts" in f for f in before) and any("step 1 · update" in f for f in before)


def test_wait_says_what_it_waits_for_warns_after_a_stall_and_when_its_timeout_expires(engine, capsys):
    """Issue 43: a wait with no runner consuming the store returned at its timeout without a word."""
    store = InMemoryStore()
    algo = LightningRL(store, GRPOTrainer(engine, GRPOConfig(track_reference_kl=False)), load_tasks("train"),
                       config=AlgorithmConfig(tasks_per_step=4, group_size=4))  # 16 rollouts a step
    with pytest.raises(ConfigError, match=r"wait\(stall_s=\.\.\.\) must be a number of seconds > 0"):
        algo.wait(stall_s=0)
    algo.start(steps=1)
    try:
        with pytest.warns(WaitWarning) as got:
            assert algo.wait(until_step=1, timeout=4, progress=True, stall_s=1) is False
        stall, timeout = [str(w.message) for w in got]  # (before the wait saw a move: 3 × stall_s at most)
        assert re.match(r"LightningRL\.wait\(\): still waiting, no progress for [1-3]\.\d s", stall), stall
        assert "Waiting at: step 1 · rollouts 0/16 · 16 queued, 0 running in the store." in stall
        assert "16 rollouts queued, none started: are runners running? start_runners(agent, store)" in stall
        assert "timeout=4 s expired after 4" in timeout and "before step 1 (at step 0)" in timeout
        assert "wait() again, or stop()" in timeout and "16 rollouts queued, none started" in timeout
        assert "step 1 · rollouts 0/16 · 16 queued, 0 running in the store" in capsys.readouterr().err  # live
        assert got[0].filename == __file__  # the warning points at the cell that waits
    finally:
        assert algo.stop(timeout=30)


def test_pause_progress_shows_the_phase_it_waits_for(engine, capsys):
    trainer = GRPOTrainer(engine, GRPOConfig(track_reference_kl=False))
    algo = _Sleeper(trainer, "before collect", 0.3, units=4).start(steps=1000)
    try:
        _until(lambda: algo.progress.phase == "update" and algo.progress.done == 1)
        assert algo.pause(timeout=30, progress=True) is True
        assert algo.state == "paused" and algo.paused_at == "before collect" and algo.global_step == 1
        err = capsys.readouterr().err
        assert "pausing: step 1 update" in err and re.search(r"\| [234]/4 micro-batches", err), err
    finally:
        assert algo.stop(timeout=10)


def test_the_algorithm_and_the_update_report_progress_and_wait_returns_at_until_step(
        engine, pristine, proxied_store, agent_with_reward, capsys):
    store = proxied_store
    runners = start_runners(agent_with_reward([0.0, 1.0]), store, n=2)
    trainer = GRPOTrainer(engine, GRPOConfig(track_reference_kl=False, micro_batch_size=1))
    algo = LightningRL(store, trainer, load_tasks("train"), config=AlgorithmConfig(
        tasks_per_step=1, group_size=4, max_tokens=4, max_sample_rounds=1))
    seen, done = _watch(algo)
    try:
        algo.start(steps=3)
        assert algo.wait(until_step=1, progress=True, timeout=300) is True
        assert trainer.updates_applied == 1 and algo.running  # returned at step 1; the loop goes on
        frames = _frames(capsys.readouterr().err)
        _until(lambda: len(store.query_rollouts()) == 8)  # step 2 collects (its LLM calls take a second or more)
        assert algo.pause(timeout=300) and algo.paused_at == "before update"
        assert algo.progress == LoopProgress(step=2, phase="paused", done=4, total=4, unit="rollouts",
                                                boundary="before update")
    finally:
        algo.stop(timeout=60)
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
