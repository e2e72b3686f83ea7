#!/usr/bin/env bash
# One GPU check for a short lease (issue 42, item 5): run from the project root on a machine with one CUDA GPU,
#   bench/gpu_check.sh OUT [BUDGET_S]
# Each part writes OUT/<part>.log (and gpu_step's JSON lines) as soon as it runs, so a lease that ends early still
# leaves the finished parts. BUDGET_S (default 540; the issue asks for 8 minutes) caps the whole run: a part gets at
# most its own cap and what is left of the budget, and is skipped when under 40 s are left. Parts, most informative
# first:
#   1. bench/gpu_generate.py: the engine (static and continuous batching, with CUDA graphs) at 1/8/64 concurrent
#      against transformers' own generation paths
#   2. bench/gpu_step.py, 3 demo steps, GRPOTrainer + TransformersEngine(batching="continuous", CUDA graphs)
#   3. the same with the static engine (at 438ac88 on one H100: 23-57 s a step, rollouts 20-54 s of it)
#   4. bench/gpu_update.py --trainer grpo,verl (each update against the plain loop)
#   5. bench/gpu_step.py, 2 demo steps, VerlTrainer (verl's token budget and truncated IS on), the second one under
#      torch.profiler (at 438ac88 verl's pi_old forward took 8.1 s of a step where GRPOTrainer's took 0.15 s)
#   6. bench/gpu_step.py --engine vllm, where vllm imports
#   7. pytest -m gpu (the CUDA-only tests)
# Off a staged GPU machine (../shared/gpu/), the project's venv python is used: PY=.venv/bin/python bench/gpu_check.sh
set -u
OUT=${1:?usage: bench/gpu_check.sh OUT [BUDGET_S]}
BUDGET=${2:-540}
PY=${PY:-python3}
mkdir -p "$OUT"
START=$(date +%s)
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

left() { echo $(( BUDGET - ($(date +%s) - START) )); }

part() {  # part NAME CAP_S COMMAND...: run COMMAND with at most CAP_S and what is left; log to OUT/NAME.log
  local name=$1 cap=$2; shift 2
  local rest; rest=$(left)
  if [ "$rest" -lt 40 ]; then echo "[gpu_check] $name skipped: ${rest}s left of ${BUDGET}s" | tee -a "$OUT/summary.txt"; return; fi
  local t=$(( cap < rest ? cap : rest ))
  local t0; t0=$(date +%s)
  echo "[gpu_check] $name (cap ${t}s): $*" | tee -a "$OUT/summary.txt"
  timeout -k 5 "$t" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "[gpu_check] $name rc=$rc in $(( $(date +%s) - t0 ))s" | tee -a "$OUT/summary.txt"
  grep -E "ratio|target|tok/s|^ *[0-9]+ +[0-9.]+ |^\||RESULT|passed|failed|error|Error" "$OUT/$name.log" | grep -v Warning | tail -25 \
    | sed "s/^/  [$name] /" | tee -a "$OUT/summary.txt"
}

{
  date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
  $PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"
  git rev-parse --short HEAD 2>/dev/null || cat COMMIT 2>/dev/null || true
} > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

part generate 150 $PY bench/gpu_generate.py --variants static,engine,enginecb,enginecbgraph,cbgraph,greedy \
  --budget-s 120 --kill-after-s 140 --out "$OUT/generate.jsonl"
part step_grpo_cb 200 $PY bench/gpu_step.py --trainer grpo --steps 3 --val-size 16 --batching continuous \
  --cb-options '{"use_cuda_graph": true}' --out "$OUT/step_grpo_cb"
part step_grpo 200 $PY bench/gpu_step.py --trainer grpo --steps 3 --val-size 16 --out "$OUT/step_grpo"
part update 150 $PY bench/gpu_update.py --trainer grpo,verl --plain-micro-batches 16,32,64 --repeats 2
part step_verl 170 $PY bench/gpu_step.py --trainer verl --steps 2 --val-size 16 --profile --out "$OUT/step_verl"
if $PY -c "import vllm" > /dev/null 2>&1; then
  part step_vllm 170 $PY bench/gpu_step.py --engine vllm --steps 3 --val-size 32 --out "$OUT/step_vllm"
else
  echo "[gpu_check] step_vllm skipped: vllm does not import here" | tee -a "$OUT/summary.txt"
fi
part pytest_gpu 300 $PY -m pytest -m gpu -q -x -p no:cacheprovider tests/test_microbatch.py tests/test_device.py tests/test_cli.py
echo "[gpu_check] done in $(( $(date +%s) - START ))s of ${BUDGET}s" | tee -a "$OUT/summary.txt"
