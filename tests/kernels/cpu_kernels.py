"""The kernel tests' builds of the CPU shim: the engine's "cuda-shim" launcher
(engine/attention/cuda_shim.py) over one library holding every variant the tests use, and the
self-test and ThreadSanitizer binaries of tests/kernels/shim."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from engine import kernels
from engine.attention.cuda_shim import CSRC, ShimLauncher, ShimLibrary, build

SHIM_DIR = Path(__file__).resolve().parent / "shim"
# The ThreadSanitizer builds run each CUDA thread as an OS thread (cuda_cpu_threads.h).
TSAN_FLAGS = ("-Werror", "-O1", "-g", "-fsanitize=thread", "-DGENQ_SHIM_THREADS")


def all_variants_launcher() -> ShimLauncher:
    """kernels_glue.cpp with its default variant list (every dtype, head size and block size)."""
    return ShimLauncher(ShimLibrary(build(CSRC / "kernels_glue.cpp", "libgenq_kernels.so",
                                          ("-Werror", "-O1"))))


__all__ = ["SHIM_DIR", "TSAN_FLAGS", "CountingLauncher", "ShimLauncher", "all_variants_launcher",
           "build"]


class CountingLauncher:
    """A kernels.Launcher over another that counts planned kernel lookups (`function` calls) and
    launches, per kernel (its name without namespace and template arguments)."""

    def __init__(self, inner: kernels.Launcher) -> None:
        self.inner = inner
        self.planned: Counter[str] = Counter()
        self.counts: Counter[str] = Counter()
        self.grids: list[tuple[str, kernels.Dim3]] = []

    def function(self, kernel: str, variant: kernels.Variant) -> kernels.KernelFn:
        fn = self.inner.function(kernel, variant)
        name = kernel.split("<")[0].removeprefix("genq::")
        self.planned[name] += 1

        def launch(grid: kernels.Dim3, block: kernels.Dim3,
                   params: tuple[kernels.Param, ...]) -> None:
            self.counts[name] += 1
            self.grids.append((name, grid))
            fn(grid, block, params)

        return launch
