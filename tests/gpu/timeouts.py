"""Per-test time limits for the GPU suite (the lent machine has no pytest-timeout).

A test whose setup, call and teardown together run past GENQ_GPU_TEST_TIMEOUT seconds (default
300) fails with TimeoutError, raised where it runs, and the suite goes on. One stuck inside a
CUDA call, which a signal cannot interrupt, gets every thread's stack dumped to stderr and the
process ended 60 s later; benchmarks/gpu_check.sh's `timeout` per file is the last resort.
Imported by tests/gpu/conftest.py; `pytest -p tests.gpu.timeouts` loads it anywhere.
"""

from __future__ import annotations

import faulthandler
import os
import signal
from collections.abc import Iterator
from types import FrameType

import pytest

GRACE_S = 60.0


def limit_s() -> float:
    return float(os.environ.get("GENQ_GPU_TEST_TIMEOUT", "300"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    if item.get_closest_marker("gpu") is None or not hasattr(signal, "setitimer"):
        yield
        return
    limit = limit_s()

    def expire(signum: int, frame: FrameType | None) -> None:
        raise TimeoutError(f"{item.nodeid} ran past {limit:g} s (GENQ_GPU_TEST_TIMEOUT)")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, limit)
    faulthandler.dump_traceback_later(limit + GRACE_S, exit=True)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        faulthandler.cancel_dump_traceback_later()
