"""benchmarks/gpu_check.sh and its smoke stage (benchmarks/gpu_smoke.py) on a machine without a
GPU, with only the lent machine's packages importable: the smoke stage says so in one line and
exits 2, and the script stops after it with the reason in summary.txt."""

from __future__ import annotations

import json
import subprocess
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


def test_without_a_device_the_script_stops_after_the_smoke_stage(tmp_path: Path) -> None:
    """The whole script, its python being one that sees only the lent machine's packages."""
    site = build_site(tmp_path / "site")
    python = tmp_path / "python"
    env = restricted_env(site, REPO)
    python.write_text(f"#!/bin/sh\nPYTHONPATH=\"$PYTHONPATH:{site}\" exec "
                      f"{' '.join(command())} \"$@\"\n")
    python.chmod(0o755)
    out = tmp_path / "out"
    done = subprocess.run(["bash", str(SCRIPT)], cwd=tmp_path,
                          env={**env, "OUT": str(out), "PYTHON": str(python)},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Traceback" not in done.stdout + done.stderr
    smoke = (out / "smoke.txt").read_text().splitlines()
    assert len(smoke) == 2 and smoke[0].startswith("versions: python ")
    assert smoke[1].startswith("no CUDA device: torch ") and smoke[1].endswith(
        "sees none; nothing was checked")
    report = json.loads((out / "smoke.json").read_text())
    assert report["result"] == "no CUDA device"
    assert report["versions"]["cupy"].startswith("not importable")
    summary = (out / "summary.txt").read_text().splitlines()
    assert summary[0].startswith("gpu_check ")
    assert summary[1].startswith("smoke: exit 2 after ")
    assert summary[2:] == ["no CUDA device: the GPU suite and the benchmark were not run"]
    assert sorted(p.name for p in out.iterdir()) == ["gpu.txt", "smoke.json", "smoke.txt",
                                                    "summary.txt"]
