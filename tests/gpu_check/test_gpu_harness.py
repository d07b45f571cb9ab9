"""The GPU suite's own machinery, on the CPU: the precompile fixture's children are read while
they run (a compile log over a pipe's 64 KB cannot deadlock the run), and a GPU test that runs
past its time limit fails alone while the suite goes on."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

from tests.gpu.precompile import run_children

REPO = Path(__file__).resolve().parents[2]


def test_children_that_write_more_than_a_pipe_holds_finish(tmp_path: Path) -> None:
    def child(size: int, code: int) -> list[str]:
        return ["-c", f"import sys; sys.stderr.write('e' * {size}); sys.exit({code})"]

    results: list[tuple[int, str]] = []
    runner = threading.Thread(target=lambda: results.extend(run_children(
        [child(200_000, 3), child(100_000, 0), child(0, 0)], tmp_path)), daemon=True)
    runner.start()
    runner.join(timeout=120)  # a cap, not a speed claim: the old wait() never returned
    assert not runner.is_alive(), "reading the children's stderr deadlocked"
    assert results == [(3, "e" * 200_000), (0, "e" * 100_000), (0, "")]


def test_a_gpu_test_past_its_limit_fails_and_the_suite_goes_on(tmp_path: Path) -> None:
    (tmp_path / "test_limits.py").write_text(
        "import time\nimport pytest\n\n"
        "@pytest.mark.gpu\ndef test_stuck():\n    time.sleep(600)\n\n"
        "@pytest.mark.gpu\ndef test_after():\n    pass\n")
    env = {**os.environ, "PYTHONPATH": str(REPO), "GENQ_GPU_TEST_TIMEOUT": "1"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.gpu.timeouts", "-q",
                           "-p", "no:cacheprovider", "-W",
                           "ignore::pytest.PytestUnknownMarkWarning",
                           "test_limits.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout[-3000:]
    assert "TimeoutError: test_limits.py::test_stuck ran past 1 s (GENQ_GPU_TEST_TIMEOUT)" \
        in done.stdout
    assert "1 failed, 1 passed" in done.stdout
