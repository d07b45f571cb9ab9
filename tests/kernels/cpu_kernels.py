"""Builds cuda/*.cu against the CPU shim (tests/kernels/shim) with g++ and executes
engine.kernels Launch records on CPU tensors through ctypes.

Builds land in a cache directory keyed by the hash of every input (sources, flags, compiler
version), never in the repository.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import torch

from engine import kernels

SHIM_DIR = Path(__file__).resolve().parent / "shim"
CXX = "g++"
BASE_FLAGS = ("-std=c++20", "-pthread", "-fno-strict-aliasing", "-Wall", "-Wextra", "-Werror",
              "-Wno-unknown-pragmas", "-Wno-unused-parameter")


def cache_root() -> Path:
    root = os.environ.get("GENQ_KERNEL_CACHE") or Path(
        os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "genq" / "kernel-shim"
    return Path(root)


def _tool_version(tool: str) -> str:
    if shutil.which(tool) is None:
        raise RuntimeError(f"{tool} is missing: the kernel tests need it (apt-get install g++)")
    return subprocess.run([tool, "--version"], check=True, capture_output=True,
                          text=True).stdout


def build(source: Path, output_name: str, flags: tuple[str, ...], cuda_dir: Path = kernels.CUDA_DIR,
          shared: bool = True) -> Path:
    """Compiles `source` (which #includes the shim and cuda/ files) and returns the binary."""
    inputs = sorted(cuda_dir.glob("*.cu*")) + sorted(SHIM_DIR.glob("*"))
    digest = hashlib.sha256()
    for part in (_tool_version(CXX), *BASE_FLAGS, *flags, str(shared), source.read_text()):
        digest.update(part.encode())
    for path in inputs:
        digest.update(path.name.encode() + path.read_bytes())
    out_dir = cache_root() / digest.hexdigest()[:24]
    target = out_dir / output_name
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = [CXX, *BASE_FLAGS, *flags, f"-I{cuda_dir}", f"-I{SHIM_DIR}", str(source)]
    if shared:
        cmd += ["-fPIC", "-shared"]
    with tempfile.NamedTemporaryFile(dir=out_dir, delete=False) as tmp:
        pass
    result = subprocess.run([*cmd, "-o", tmp.name], capture_output=True, text=True)
    if result.returncode != 0:
        os.unlink(tmp.name)
        raise RuntimeError(f"shim build failed: {' '.join(cmd)}\n{result.stderr}")
    os.replace(tmp.name, target)  # atomic: a concurrent build never sees half a file
    return target


class CpuKernels:
    """Executes engine.kernels Launch records with the g++ build of the unchanged cuda/ sources."""

    def __init__(self, library: Path) -> None:
        self.lib = ctypes.CDLL(str(library))
        self.lib.genq_launch.restype = ctypes.c_int
        self.lib.genq_launch.argtypes = [ctypes.c_char_p, *[ctypes.c_uint] * 6,
                                         ctypes.POINTER(ctypes.c_void_p),
                                         ctypes.POINTER(ctypes.c_int), ctypes.c_int]
        self.lib.genq_has_kernel.argtypes = [ctypes.c_char_p]

    def has_kernel(self, name: str) -> bool:
        return bool(self.lib.genq_has_kernel(name.encode()))

    def run(self, launches: list[kernels.Launch]) -> None:
        for launch in launches:
            values: list[ctypes._SimpleCData] = []
            for arg in launch.args:
                if isinstance(arg, torch.Tensor):
                    assert arg.device.type == "cpu"
                    values.append(ctypes.c_void_p(arg.data_ptr() if arg.numel() else None))
                elif isinstance(arg, np.int32):
                    values.append(ctypes.c_int32(int(arg)))
                elif isinstance(arg, np.int64):
                    values.append(ctypes.c_int64(int(arg)))
                elif isinstance(arg, np.float32):
                    values.append(ctypes.c_float(float(arg)))
                else:
                    raise TypeError(f"{launch.kernel}: unsized argument {arg!r}")
            params = (ctypes.c_void_p * len(values))(
                *[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values])
            sizes = (ctypes.c_int * len(values))(*[ctypes.sizeof(v) for v in values])
            rc = self.lib.genq_launch(launch.kernel.encode(), *launch.grid, *launch.block, params,
                                      sizes, len(values))
            if rc != 0:
                raise RuntimeError(f"shim launch of {launch.kernel} failed with {rc}")
