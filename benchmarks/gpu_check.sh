#!/usr/bin/env bash
# One run on a lent GPU: the GPU test suite, then the decode-attention benchmark.
# Uses the machine's python3 as it is (torch with CUDA, cupy-cuda13x, transformers, pytest);
# installs nothing. Results go to $OUT (the device tool's output folder) or benchmarks/results.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=.
out_dir="${OUT:-benchmarks/results}"
mkdir -p "$out_dir"

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tee "$out_dir/gpu.txt"
python3 -c "import sys, torch, cupy; print(sys.version.split()[0], 'torch', torch.__version__,
'cuda', torch.version.cuda, 'cupy', cupy.__version__, torch.cuda.get_device_name())" \
  2>&1 | tee -a "$out_dir/gpu.txt"

# -m gpu comes after the project's addopts (-m 'not gpu') and so wins.
python3 -m pytest -m gpu -q -rfE -p no:cacheprovider tests/gpu tests/kernels \
  --junitxml="$out_dir/gpu_tests.xml" 2>&1 | tee "$out_dir/gpu_tests.txt"
tests_rc=${PIPESTATUS[0]}

python3 -m benchmarks.kernels --json "$out_dir/kernels.json" 2>&1 | tee "$out_dir/kernels.txt"
bench_rc=${PIPESTATUS[0]}

echo "gpu tests exit $tests_rc, benchmark exit $bench_rc"
if [ "$tests_rc" -ne 0 ]; then exit "$tests_rc"; fi
exit "$bench_rc"
