"""benchmarks/gpu_check.sh and its smoke stage (benchmarks/gpu_smoke.py) on a machine without a
GPU: the smoke stage says so in one line and exits 2, with only the lent machine's packages
importable, and the script stops after it with the reason in summary.txt."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.gpu_check.restricted_env import build_site, command, restricted_env

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_check.sh"

pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="checks the run without a CUDA device")


def test_the_script_parses() -> None:
    done = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_the_smoke_stage_reports_no_cuda_device_with_the_lent_packages(tmp_path: Path) -> None:
    site = build_site(tmp_path / "site")
    done = subprocess.run(command("-m", "benchmarks.gpu_smoke", "--out", str(tmp_path / "out")),
                          cwd=REPO, env=restricted_env(site, REPO), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert len(lines) == 2 and lines[0].startswith("versions: python ")
    assert lines[1].startswith("no CUDA device: torch ") and lines[1].endswith(
        "sees none; nothing was checked")
    assert "Traceback" not in done.stderr
    report = json.loads((tmp_path / "out" / "smoke.json").read_text())
    assert report["result"] == "no CUDA device"
    assert report["versions"]["cupy"].startswith("not importable")


def test_the_script_stops_after_the_smoke_stage_without_a_device(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(SCRIPT)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]
    summary = (tmp_path / "summary.txt").read_text().splitlines()
    assert summary[0].startswith("gpu_check ")
    assert summary[1].startswith("smoke: exit 2 after ")
    assert summary[2:] == ["no CUDA device: the GPU suite and the benchmark were not run"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu.txt", "smoke.json", "smoke.txt",
                                                         "summary.txt"]
