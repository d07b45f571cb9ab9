"""The compile checks' tools: nvcc -Xptxas -v for sm_80 and sm_90, and NVRTC (the compiler CuPy
uses at run time) through cuda-bindings. Started in the background as soon as a session has
collected tests/kernels/test_compile.py (tests/kernels/conftest.py), so they overlap the rest of
the suite. A missing tool is an error."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from engine import kernels

ARCHS = ("sm_80", "sm_90")
NVRTC_ARCH = "compute_90"  # the PTX NVRTC emits is then assembled by ptxas for sm_90


@dataclass(frozen=True)
class Resources:
    registers: int
    smem: int
    stack: int
    spill_stores: int
    spill_loads: int


class Job:
    """A background command whose stderr (where ptxas -v reports) is kept in a file."""

    def __init__(self, cmd: list[str], log: Path) -> None:
        self.cmd, self.log = cmd, log
        self._log_file = log.open("w")
        self.proc = subprocess.Popen(["nice", "-n", "5", *cmd], stdout=self._log_file,
                                     stderr=subprocess.STDOUT, cwd=Path(__file__).parents[2])

    def result(self, timeout: float = 900) -> str:
        rc = self.proc.wait(timeout)
        self._log_file.close()
        text = self.log.read_text()
        if rc != 0:
            raise AssertionError(f"{' '.join(self.cmd)} exited {rc}:\n{text[-4000:]}")
        return text

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._log_file.close()


def require(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        raise AssertionError(f"{tool} is not on PATH: the kernel compile checks need the CUDA "
                             "13.0 toolkit (nvcc, ptxas)")
    return path


def nvcc_job(source: Path, arch: str, out_dir: Path) -> Job:
    cmd = [require("nvcc"), "-cubin", f"-arch={arch}", "-std=c++17", "-Xptxas", "-v",
           f"-I{kernels.CUDA_DIR}", str(source), "-o", str(out_dir / f"{source.stem}.{arch}.cubin")]
    return Job(cmd, out_dir / f"{source.stem}.{arch}.log")


def nvrtc_job(out_dir: Path) -> Job:
    return Job([sys.executable, "-m", "tests.kernels.nvrtc_compile", str(out_dir), NVRTC_ARCH],
               out_dir / "nvrtc.log")


def parse_ptxas(text: str) -> dict[str, Resources]:
    """{mangled kernel name: resources} from `ptxas -v` output."""
    found: dict[str, Resources] = {}
    for chunk in re.split(r"ptxas info\s+: Compiling entry function '", text)[1:]:
        name = chunk.split("'", 1)[0]
        spill = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, "
                          r"(\d+) bytes spill loads", chunk)
        used = re.search(r"Used (\d+) registers", chunk)
        smem = re.search(r"(\d+) bytes smem", chunk)
        assert spill and used, f"unparsed ptxas report for {name}:\n{chunk}"
        found[name] = Resources(int(used.group(1)), int(smem.group(1)) if smem else 0,
                                int(spill.group(1)), int(spill.group(2)), int(spill.group(3)))
    return found


def demangle(names: list[str]) -> dict[str, str]:
    """{mangled: name expression} ("genq::copy_blocks_kernel", "genq::...<float, 64, 8>")."""
    out = subprocess.run([require("c++filt")], input="\n".join(names), capture_output=True,
                         text=True, check=True).stdout.splitlines()
    # "void genq::f<float, 64, 8>(float*, ...)" -> "genq::f<float, 64, 8>"
    return {m: re.sub(r"^void ", "", d.split("(", 1)[0]) for m, d in zip(names, out, strict=True)}
