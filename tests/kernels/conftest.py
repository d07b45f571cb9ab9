from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from engine import kernels
from tests.kernels import toolchain
from tests.kernels.cpu_kernels import ShimLauncher, all_variants_launcher

_COMPILE_TESTS = Path(__file__).parent / "test_compile.py"
_COMPILES = pytest.StashKey[dict[str, object]]()


@pytest.fixture(scope="session")
def cpu_kernels() -> ShimLauncher:
    """The unchanged cuda/ sources, compiled with g++ against the CPU shim."""
    return all_variants_launcher()


def start_compile_jobs() -> dict[str, object]:
    """Background compiles: nvcc per arch over cuda/instances.cu, and NVRTC, into a directory
    of their own (jobs["dir"]). A tool that cannot start is recorded and fails the tests that
    need it."""
    out_dir = Path(tempfile.mkdtemp(prefix="genq-nvcc-"))
    jobs: dict[str, object] = {}
    for arch in toolchain.ARCHS:
        try:
            jobs[arch] = toolchain.nvcc_job(kernels.CUDA_DIR / "instances.cu", arch, out_dir)
        except (AssertionError, OSError) as e:
            jobs[arch] = e
    jobs["nvrtc"] = toolchain.nvrtc_job(out_dir)
    jobs["dir"] = out_dir
    return jobs


def pytest_collection_finish(session: pytest.Session) -> None:
    """When test_compile.py is among the tests to run, its compiles start now, before the
    first test of the session: at nice 5 they take the CPU the suite leaves idle (waits on
    workers, Redis, heartbeats) instead of being waited for when the kernel tests come."""
    if any(item.path == _COMPILE_TESTS for item in session.items):
        session.stash[_COMPILES] = start_compile_jobs()


def pytest_sessionfinish(session: pytest.Session) -> None:
    jobs = session.stash.get(_COMPILES, None)
    if jobs is None:
        return
    for job in jobs.values():
        if isinstance(job, toolchain.Job):
            job.stop()
    shutil.rmtree(str(jobs["dir"]), ignore_errors=True)


@pytest.fixture(scope="session")
def compile_jobs(request: pytest.FixtureRequest) -> dict[str, object]:
    """The session's background compiles (started at collection, see above)."""
    jobs = request.session.stash.get(_COMPILES, None)
    if jobs is None:  # (a test_compile.py test reached without the hook: start them now)
        jobs = request.session.stash[_COMPILES] = start_compile_jobs()
    return jobs
