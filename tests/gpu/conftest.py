from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine import kernels


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
    procs = [subprocess.Popen([sys.executable, "-m", "tests.gpu.precompile", *specs[i::workers]],
                              cwd=Path(__file__).parents[2], stderr=subprocess.PIPE, text=True)
             for i in range(workers)]
    errors = [p.communicate()[1] for p in procs if p.wait() != 0]
    assert not errors, f"precompiling kernel modules failed:\n{errors[0][-4000:]}"
