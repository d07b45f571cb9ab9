"""The kernel tests' builds of the CPU shim: the engine's "cuda-shim" launcher
(engine/attention/cuda_shim.py) over one library holding every variant the tests use, and the
self-test and ThreadSanitizer binaries of tests/kernels/shim."""

from __future__ import annotations

from pathlib import Path

from engine.attention.cuda_shim import CSRC, ShimLauncher, ShimLibrary, build

SHIM_DIR = Path(__file__).resolve().parent / "shim"
# The ThreadSanitizer builds run each CUDA thread as an OS thread (cuda_cpu_threads.h).
TSAN_FLAGS = ("-O1", "-g", "-fsanitize=thread", "-DGENQ_SHIM_THREADS")


def all_variants_launcher() -> ShimLauncher:
    """kernels_glue.cpp with its default variant list (every dtype, head size and block size)."""
    return ShimLauncher(ShimLibrary(build(CSRC / "kernels_glue.cpp", "libgenq_kernels.so",
                                          ("-O1",))))


__all__ = ["SHIM_DIR", "TSAN_FLAGS", "ShimLauncher", "build", "all_variants_launcher"]
