from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from engine import kernels
from tests.gpu.precompile import run_children
from tests.gpu.timeouts import pytest_runtest_protocol  # noqa: F401  (the per-test limits)


@pytest.fixture(scope="session", autouse=True)
def _precompile_kernel_modules(request: pytest.FixtureRequest) -> None:
    """NVRTC compiles one module per variant (45 of them) in a few seconds each, one thread each:
    compile them all in parallel processes first (into CuPy's disk cache)."""
    if not torch.cuda.is_available() or not any(
            item.get_closest_marker("gpu") for item in request.session.items):
        return
    specs = [f"{str(d).removeprefix('torch.')}:{h}:{b}" for d in kernels.DTYPE_NAMES
             for h in kernels.HEAD_SIZES for b in kernels.BLOCK_SIZES]
    workers = max(1, min(len(specs), (os.cpu_count() or 2) - 1))
    commands = [["-m", "tests.gpu.precompile", *specs[i::workers]] for i in range(workers)]
    errors = [err for rc, err in run_children(commands, Path(__file__).parents[2]) if rc != 0]
    assert not errors, f"precompiling kernel modules failed:\n{errors[0][-4000:]}"
