"""The "cuda-shim" launcher: genq's unchanged cuda/*.cu kernels on the CPU.

The sources are compiled with g++ against csrc/cuda_cpu_shim.h (a CTA's CUDA threads run as
fibers; a grid's CTAs spread over a pool of OS threads) and launched through ctypes with exactly
the parameters engine/kernels.py marshals for CuPy. One library per (dtype, head size, block
size), as CuPy compiles one module per variant, built on first use into a cache directory keyed
by a digest of every input (compiler, flags, sources): never into the repository. The cuda/ path
and its digest come from engine/kernels.py, the one module that reads cuda/.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import struct
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engine import kernels
from engine.kernel_plans import DTYPE_NAMES, Dim3, KernelFn, Launch, Param, Variant

CSRC = kernels.package_dir("engine.attention") / "csrc"
CXX = os.environ.get("CXX", "g++")
# (No -Werror here: a user's newer compiler may warn where ours does not. The kernel tests add it.)
BASE_FLAGS = ("-std=c++20", "-pthread", "-fno-strict-aliasing", "-Wall", "-Wextra",
              "-Wno-unknown-pragmas", "-Wno-unused-parameter")
ENGINE_FLAGS = ("-O1",)  # a correctness tool: compile time counts more than speed
# Each parameter travels in an 8-byte slot (kernels_glue.cpp reads its first `size` bytes).
_SLOT: dict[type, tuple[str, int]] = {
    np.uint64: ("Q", 8), int: ("Q", 8), np.int64: ("q", 8), np.int32: ("i4x", 4),
    np.float32: ("f4x", 4)}


def cache_root() -> Path:
    root = os.environ.get("GENQ_KERNEL_CACHE") or Path(
        os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "genq" / "kernel-shim"
    return Path(root)


@functools.cache
def _compiler_version() -> str:
    if shutil.which(CXX) is None:
        raise RuntimeError(f"attention_backend='cuda-shim' needs a C++20 compiler ({CXX}); "
                           "install g++ or use attention_backend='torch'")
    return subprocess.run([CXX, "--version"], check=True, capture_output=True, text=True).stdout


def build(source: Path, output_name: str, flags: Sequence[str], cuda_dir: Path | None = None,
          shared: bool = True) -> Path:
    """Compiles `source` (which #includes the shim and cuda/ files) and returns the binary.
    `cuda_dir` replaces cuda/ (the kernel tests build edited copies)."""
    digest = hashlib.sha256()
    if cuda_dir is None:
        cuda_dir, cuda_key = kernels.CUDA_DIR, kernels.cuda_digest()
    else:
        cuda_key = "".join(p.name + p.read_text() for p in sorted(cuda_dir.glob("*.cu*")))
    for part in (_compiler_version(), *BASE_FLAGS, *flags, str(shared), source.read_text(),
                 cuda_key, *(p.name + p.read_text() for p in sorted(CSRC.glob("*.h")))):
        digest.update(part.encode())
    out_dir = cache_root() / digest.hexdigest()[:24]
    target = out_dir / output_name
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = [CXX, *BASE_FLAGS, *flags, f"-I{cuda_dir}", f"-I{CSRC}", str(source)]
    if shared:  # (hidden: see kernels_glue.cpp)
        cmd += ["-fPIC", "-shared", "-fvisibility=hidden", "-fvisibility-inlines-hidden"]
    with tempfile.NamedTemporaryFile(dir=out_dir, delete=False) as tmp:
        pass
    result = subprocess.run([*cmd, "-o", tmp.name], capture_output=True, text=True)
    if result.returncode != 0:
        os.unlink(tmp.name)
        raise RuntimeError(f"shim build failed: {' '.join(cmd)}\n{result.stderr[-4000:]}")
    os.replace(tmp.name, target)  # atomic: a concurrent build never sees half a file
    return target


def variant_flags(variant: Variant) -> tuple[str, ...]:
    dtype, head_size, block_size = variant
    return (*ENGINE_FLAGS,
            f"-DGENQ_SHIM_VARIANTS(X)=X({DTYPE_NAMES[dtype]},{head_size},{block_size})")


class ShimLibrary:
    """One g++ build of csrc/kernels_glue.cpp, loaded through ctypes (calls release the GIL)."""

    def __init__(self, path: Path, num_threads: int | None = None) -> None:
        self.lib = ctypes.CDLL(str(path))
        self.lib.genq_launch.restype = ctypes.c_int
        self.lib.genq_launch.argtypes = [ctypes.c_char_p, *[ctypes.c_uint] * 6, ctypes.c_char_p,
                                         ctypes.POINTER(ctypes.c_int), ctypes.c_int]
        self.lib.genq_has_kernel.argtypes = [ctypes.c_char_p]
        self.lib.genq_set_num_threads.argtypes = [ctypes.c_int]
        self.lib.genq_set_num_threads(num_threads or torch.get_num_threads())

    def has_kernel(self, name: str) -> bool:
        return bool(self.lib.genq_has_kernel(name.encode()))


@dataclass(frozen=True)
class _Layout:
    packer: struct.Struct
    sizes: ctypes.Array[ctypes.c_int]


@functools.cache
def _layout(types: tuple[type, ...]) -> _Layout:
    try:
        slots = [_SLOT[t] for t in types]
    except KeyError as e:
        raise TypeError(f"not a marshalled kernel parameter: {e}") from None
    sizes = (ctypes.c_int * len(slots))(*[size for _, size in slots])
    return _Layout(struct.Struct("<" + "".join(code for code, _ in slots)), sizes)


class ShimLauncher:
    """kernels.Launcher for CPU tensors. With `library`, every variant comes from that one build
    (the kernel tests'); otherwise each variant is built on first use."""

    def __init__(self, library: ShimLibrary | None = None) -> None:
        self.library = library
        self._libraries: dict[Variant, ShimLibrary] = {}

    def function(self, kernel: str, variant: Variant) -> KernelFn:
        lib = self._library(variant)
        if not lib.has_kernel(kernel):
            raise ValueError(f"the shim build has no kernel {kernel}")
        launch_c, name = lib.lib.genq_launch, kernel.encode()

        def launch(grid: Dim3, block: Dim3, params: tuple[Param, ...]) -> None:
            layout = _layout(tuple(map(type, params)))
            rc = launch_c(name, *grid, *block, layout.packer.pack(*params), layout.sizes,
                          len(params))
            if rc != 0:
                raise RuntimeError(f"shim launch of {kernel} with grid {grid} failed with {rc} "
                                   "(-1: no such kernel, -2: a kernel thread threw, -3: wrong "
                                   "parameters; the shim printed why on stderr)")

        return launch

    def run(self, launches: list[Launch]) -> None:
        kernels.run_launches(launches, self)

    def _library(self, variant: Variant) -> ShimLibrary:
        if self.library is not None:
            return self.library
        lib = self._libraries.get(variant)
        if lib is None:
            kernels.check_variant(*variant)
            path = build(CSRC / "kernels_glue.cpp", "libgenq_kernels.so", variant_flags(variant))
            lib = self._libraries[variant] = ShimLibrary(path)
        return lib
