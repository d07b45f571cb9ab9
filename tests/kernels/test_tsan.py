"""ThreadSanitizer over the CPU shim: the kernels run race-free, and the check has teeth: a copy of
cuda/ with one __syncthreads removed is reported as a data race."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from engine import kernels
from tests.kernels.cpu_kernels import SHIM_DIR, TSAN_FLAGS, build

# The barrier between reading the K tile and overwriting the same shared memory with V.
REMOVED_SYNC = "__syncthreads();  // K tile fully read before V overwrites it"


def _run(binary: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, TSAN_OPTIONS="halt_on_error=0 exitcode=66")
    return subprocess.run([str(binary)], capture_output=True, text=True, env=env, timeout=600)


def test_kernels_run_clean_under_thread_sanitizer() -> None:
    binary = build(SHIM_DIR / "tsan_driver.cpp", "tsan_driver", TSAN_FLAGS, shared=False)
    result = _run(binary)
    assert "ThreadSanitizer" not in result.stderr, result.stderr[-4000:]
    assert result.returncode == 0 and "outputs finite" in result.stdout


def test_thread_sanitizer_reports_the_race_of_a_removed_syncthreads(tmp_path: Path) -> None:
    racy = tmp_path / "cuda"
    shutil.copytree(kernels.CUDA_DIR, racy)
    source = (racy / "paged_attention.cu").read_text()
    assert source.count(REMOVED_SYNC) == 1
    (racy / "paged_attention.cu").write_text(source.replace(REMOVED_SYNC, ""))
    binary = build(SHIM_DIR / "tsan_driver.cpp", "tsan_driver", TSAN_FLAGS, cuda_dir=racy,
                   shared=False)
    result = _run(binary)
    assert "WARNING: ThreadSanitizer: data race" in result.stderr
    assert "paged_attention_prefill_kernel" in result.stderr
    assert result.returncode == 66
