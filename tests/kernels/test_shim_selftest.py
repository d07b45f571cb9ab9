"""The CPU shim itself behaves as CUDA specifies (tests/kernels/shim/shim_selftest.cpp): 3-D
indices, shared memory per CTA, __syncthreads ordering, shuffle widths and out-of-range lanes,
threads that exit before a barrier; with CUDA threads as fibers (the engine's build) and as OS
threads, and race-free under ThreadSanitizer."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.kernels.cpu_kernels import SHIM_DIR, TSAN_FLAGS, build


@pytest.mark.parametrize("flags", [("-Werror", "-O1"), ("-Werror", "-O1", "-DGENQ_SHIM_THREADS"),
                                   TSAN_FLAGS],
                         ids=["fibers", "threads", "tsan"])
def test_shim_follows_cuda_semantics(flags: tuple[str, ...]) -> None:
    binary = build(SHIM_DIR / "shim_selftest.cpp", "shim_selftest", flags, shared=False)
    env = dict(os.environ, TSAN_OPTIONS="halt_on_error=0 exitcode=66")
    result = subprocess.run([str(binary)], capture_output=True, text=True, env=env, timeout=300)
    assert "ThreadSanitizer" not in result.stderr, result.stderr[-4000:]
    assert result.returncode == 0, result.stdout
    assert result.stdout.strip().endswith("shim self-test passed")
