#!/usr/bin/env bash
# One run on a lent GPU, in stages, at most 8 minutes in all; everything goes to $OUT (the device
# tool's output folder) or benchmarks/results:
#   1. smoke (<= 75 s): versions, each kernel compiled and launched once through the engine's
#      launch path, one LLM.generate equal to transformers   -> smoke.txt, smoke.json
#   2. the GPU suite (<= 300 s): one pytest per tests/gpu file, each test limited by
#      GENQ_GPU_TEST_TIMEOUT, each file by `timeout`          -> tests-<file>.txt, junit-<file>.xml
#   3. python -m benchmarks.kernels (<= 75 s)                  -> kernels.txt, kernels.json
# summary.txt gets one line per stage. Installs nothing: the machine's python3 (torch with CUDA,
# cupy-cuda13x, transformers, numpy, pytest) with PYTHONPATH=. as it is.
# Exit code: 2 without a CUDA device (stops after the smoke stage), else the first failed stage's.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=.
export GENQ_GPU_TEST_TIMEOUT="${GENQ_GPU_TEST_TIMEOUT:-120}"
out_dir="${OUT:-benchmarks/results}"
mkdir -p "$out_dir"
py="${PYTHON:-python3}"
total_s=450  # 8 minutes less the 10 s `timeout -k` grace of each of the three stages
smoke_s=75 suite_s=300 bench_s=75
began=$SECONDS
rc=0

log() { echo "$*" | tee -a "$out_dir/summary.txt"; }
# The seconds a stage may take: its own cap, or what is left of the whole run if that is less.
cap() {
  local left=$((total_s - (SECONDS - began)))
  left=$(($1 < left ? $1 : left))
  echo $((left > 1 ? left : 1))  # (timeout 0 would mean no limit)
}
record() {  # record <stage> <exit code>
  log "$1: exit $2 after $((SECONDS - began)) s$([ "$2" -eq 124 ] && echo ' (time limit)')"
  if [ "$rc" -eq 0 ] && [ "$2" -ne 0 ]; then rc=$2; fi
}

log "gpu_check $(date -u +%FT%TZ) commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
timeout 20 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv \
  >"$out_dir/gpu.txt" 2>&1
cat "$out_dir/gpu.txt"

timeout -k 10 "$(cap $smoke_s)" "$py" -m benchmarks.gpu_smoke --out "$out_dir" 2>&1 \
  | tee "$out_dir/smoke.txt"
smoke_rc=${PIPESTATUS[0]}
record smoke "$smoke_rc"
if [ "$smoke_rc" -eq 2 ]; then
  log "no CUDA device: the GPU suite and the benchmark were not run"
  exit 2
fi

suite_began=$SECONDS
for file in tests/gpu/test_*.py; do
  name=$(basename "$file" .py)
  left=$((suite_s - (SECONDS - suite_began)))
  limit=$(cap "$left")
  if [ "$limit" -lt 30 ]; then
    record "suite $name: not run (the stage's time is spent)" 124
    continue
  fi
  # -m gpu comes after the project's addopts (-m 'not gpu') and so wins.
  timeout -k 10 "$limit" "$py" -m pytest -m gpu -q -rfE -p no:cacheprovider "$file" \
    --junitxml="$out_dir/junit-$name.xml" 2>&1 | tee "$out_dir/tests-$name.txt"
  record "suite $name" "${PIPESTATUS[0]}"
done

timeout -k 10 "$(cap $bench_s)" "$py" -m benchmarks.kernels --json "$out_dir/kernels.json" 2>&1 \
  | tee "$out_dir/kernels.txt"
record "benchmark" "${PIPESTATUS[0]}"

log "total $((SECONDS - began)) s, exit $rc"
exit "$rc"
