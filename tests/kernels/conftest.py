from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from engine import kernels
from tests.kernels import toolchain
from tests.kernels.cpu_kernels import ShimLauncher, all_variants_launcher


@pytest.fixture(scope="session")
def cpu_kernels() -> ShimLauncher:
    """The unchanged cuda/ sources, compiled with g++ against the CPU shim."""
    return all_variants_launcher()


@pytest.fixture(scope="session")
def compile_jobs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, object]]:
    """Background compiles: nvcc per arch over cuda/instances.cu, and NVRTC. A tool that cannot
    start is recorded and fails the tests that need it."""
    out_dir: Path = tmp_path_factory.mktemp("nvcc")
    jobs: dict[str, object] = {}
    for arch in toolchain.ARCHS:
        try:
            jobs[arch] = toolchain.nvcc_job(kernels.CUDA_DIR / "instances.cu", arch, out_dir)
        except (AssertionError, OSError) as e:
            jobs[arch] = e
    jobs["nvrtc"] = toolchain.nvrtc_job(out_dir)
    jobs["dir"] = out_dir
    yield jobs
    for job in jobs.values():
        if isinstance(job, toolchain.Job):
            job.stop()


@pytest.fixture(autouse=True, scope="session")
def _start_compiles_early(request: pytest.FixtureRequest) -> None:
    """Starts the compile jobs with the first kernel test when test_compile.py was collected, so
    nvcc and NVRTC run while the shim tests do."""
    if any(item.nodeid.startswith("tests/kernels/test_compile.py")
           for item in request.session.items):
        request.getfixturevalue("compile_jobs")
