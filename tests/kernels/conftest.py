from __future__ import annotations

import pytest

from tests.kernels.cpu_kernels import SHIM_DIR, CpuKernels, build


@pytest.fixture(scope="session")
def cpu_kernels() -> CpuKernels:
    """The unchanged cuda/ sources, compiled with g++ against the CPU shim."""
    return CpuKernels(build(SHIM_DIR / "kernels_glue.cpp", "libgenq_kernels.so", ("-O2",)))
