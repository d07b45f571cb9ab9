"""Every kernel variant compiles for sm_80 and sm_90 with nvcc (ptxas -v: no spills, no stack),
and through NVRTC 13.0 with engine.kernels' own source and options, the way CuPy compiles at run
time; the set nvcc instantiates from cuda/instances.cu is the set the engine names."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from engine import kernels
from tests.kernels import toolchain


def _job(compile_jobs: dict[str, object], key: str) -> toolchain.Job:
    job = compile_jobs[key]
    if isinstance(job, Exception):
        raise AssertionError(f"{key}: {job}")
    assert isinstance(job, toolchain.Job)
    return job


def _report(title: str, found: dict[str, toolchain.Resources]) -> None:
    print(f"\n{title}: {len(found)} kernels")
    names = toolchain.demangle(sorted(found))
    for mangled, res in sorted(found.items(), key=lambda kv: names[kv[0]]):
        print(f"  {names[mangled]:<62} regs {res.registers:>3}  smem {res.smem:>6}  "
              f"stack {res.stack}  spills {res.spill_stores}/{res.spill_loads}")


def _assert_no_spills(found: dict[str, toolchain.Resources]) -> None:
    names = toolchain.demangle(sorted(found))
    bad = {names[m]: r for m, r in found.items() if r.stack or r.spill_stores or r.spill_loads}
    assert not bad, f"kernels that spill or use a stack frame: {bad}"


@pytest.mark.parametrize("arch", toolchain.ARCHS)
def test_every_instance_compiles_with_nvcc_without_spills(compile_jobs: dict[str, object],
                                                          arch: str) -> None:
    found = toolchain.parse_ptxas(_job(compile_jobs, arch).result())
    _report(f"nvcc {arch}", found)
    assert set(toolchain.demangle(sorted(found)).values()) == kernels.all_name_expressions()
    _assert_no_spills(found)
    assert all(r.smem <= 48 * 1024 for r in found.values())  # static shared memory limit


@pytest.mark.parametrize("source", ["paged_attention.cu", "cache_kernels.cu"])
def test_each_source_compiles_on_its_own(source: str, tmp_path: Path) -> None:
    job = toolchain.nvcc_job(kernels.CUDA_DIR / source, "sm_90", tmp_path)
    job.result(timeout=300)


def test_nvrtc_13_0_compiles_what_cupy_compiles_and_ptxas_accepts_it(
        compile_jobs: dict[str, object]) -> None:
    log = _job(compile_jobs, "nvrtc").result()
    assert "NVRTC 13.0" in log
    out_dir = compile_jobs["dir"]
    assert isinstance(out_dir, Path)
    lowered = json.loads((out_dir / "lowered.json").read_text())
    assert set(lowered) == kernels.all_name_expressions()
    result = subprocess.run([toolchain.require("ptxas"), "-arch=sm_90", "-v",
                             str(out_dir / "genq.ptx"), "-o", str(out_dir / "nvrtc.cubin")],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    found = toolchain.parse_ptxas(result.stdout + result.stderr)
    assert set(found) == set(lowered.values())
    _assert_no_spills(found)
