"""genq's CUDA kernels (cuda/*.cu): what to launch, how its parameters are passed, and the CuPy
launcher.

The only module that imports cupy or reads cuda/ (the CPU shim, engine/attention/cuda_shim.py,
takes the cuda/ path and digest from here). Planning is pure torch: `decode`, `prefill`,
`reshape_and_cache` and `copy_blocks` validate their tensors and return `Launch` records (kernel
name expression, grid, block, arguments in the kernel's parameter order, sized exactly: int32 for
`int`, int64 for `long long`, float32 for `float`, a tensor for a pointer). `launch_params` turns a
record's arguments into what cuLaunchKernel takes (a raw pointer per tensor, the sized scalars);
a `Launcher` executes marshalled launches: `CupyLauncher` on a GPU (one RawModule per (dtype,
head size, block size), compiled by NVRTC and cached, launched on torch's current stream), the g++
shim build on the CPU. Everything but the few CuPy calls runs, and is tested, without a GPU.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.resources
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from engine.kernel_plans import (  # noqa: F401  (re-exported: callers plan through this module)
    BLOCK_SIZES,
    CACHE_THREADS,
    DECODE_THREADS,
    DTYPE_NAMES,
    HEAD_SIZES,
    MAX_GRID_YZ,
    MIN_DECODE_CTAS,
    PARTITION_SIZE,
    PREFILL_THREADS,
    REDUCE_THREADS,
    Dim3,
    KernelArg,
    KernelFn,
    Launch,
    Param,
    Variant,
    all_name_expressions,
    check_variant,
    copy_blocks,
    decode,
    decode_heads_per_cta,
    name_expressions,
    prefill,
    reshape_and_cache,
    supports,
)


def package_dir(package: str) -> Path:
    """A package's folder on disk, through importlib.resources: the compilers (NVRTC, nvcc, g++)
    read the kernel sources as files, so an install that is not plain files is refused."""
    folder = importlib.resources.files(package)
    if not isinstance(folder, Path):
        raise RuntimeError(f"genq's kernel sources must be files on disk, but {package} is "
                           f"loaded from {folder!r}: install genq unzipped (pip install does)")
    return folder


def find_cuda_dir() -> Path:
    """The kernel sources: a wheel ships the top-level cuda/ as engine/cuda_sources (package data,
    pyproject.toml maps it); a checkout, editable install or not, has it beside engine/."""
    engine_dir = package_dir("engine")
    shipped = engine_dir / "cuda_sources"
    return shipped if shipped.is_dir() else engine_dir.parent / "cuda"


CUDA_DIR = find_cuda_dir()


@functools.cache
def cuda_digest() -> str:
    """sha256 over cuda/ (names and contents): the key of every compiled-kernel cache."""
    digest = hashlib.sha256()
    for path in sorted(CUDA_DIR.glob("*.cu*")):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()


def module_source() -> str:
    """The source CuPy compiles. CuPy's on-disk kernel cache keys on this text, not on the files
    it includes, so the text carries a digest of cuda/: an edited kernel is never a stale hit."""
    return (f"// genq kernels, cuda/ sha256 {cuda_digest()}\n"
            '#include "paged_attention.cu"\n#include "cache_kernels.cu"\n')


def compile_options() -> tuple[str, ...]:
    return ("-std=c++17", f"-I{CUDA_DIR}")


def cupy_available() -> bool:
    """Whether CuPy imports here (the check for choosing the "cupy" backend on a CUDA device)."""
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return True


# ---- marshalling and launchers ----------------------------------------------------------------


class Launcher(Protocol):
    """Executes marshalled launches: CuPy on a GPU, the g++ shim build on the CPU."""

    def function(self, kernel: str, variant: Variant) -> KernelFn:
        """The launch function of one kernel, looked up (and compiled) once per variant."""


def launch_params(args: tuple[KernelArg, ...]) -> tuple[Param, ...]:
    """A launch's arguments as cuLaunchKernel takes them: each tensor as its raw pointer (uint64,
    0 when empty), each sized scalar as it is. Host memory next to device memory in one launch
    must be pinned: cudaHostAlloc memory is mapped at the same address on the device (unified
    addressing), so the kernel reads and writes it in place. (CuPy passes a plain int as 8
    bytes, so a launcher may also meet pointers as ints: see kernel_plans.Param.)"""
    on_device = any(isinstance(a, torch.Tensor) and a.device.type == "cuda" for a in args)
    params: list[Param] = []
    for a in args:
        if isinstance(a, torch.Tensor):
            if on_device and a.device.type == "cpu" and not a.is_pinned():
                raise ValueError("host memory handed to a kernel must be pinned (pin_memory=True)")
            params.append(np.uint64(a.data_ptr() if a.numel() else 0))
        elif isinstance(a, (np.int32, np.int64, np.float32)):
            params.append(a)
        else:
            raise TypeError(f"unsized kernel argument {a!r}: use np.int32, np.int64 or np.float32")
    return tuple(params)


def run_launches(launches: list[Launch], launcher: Launcher | None = None) -> None:
    """Launches each record in order (default: CuPy, on the device of the records' tensors)."""
    for launch in launches:
        run = launcher or CupyLauncher(next(a.device for a in launch.args if isinstance(
            a, torch.Tensor) and a.device.type == "cuda"))
        run.function(launch.kernel, launch.variant)(launch.grid, launch.block,
                                                     launch_params(launch.args))


def _cupy() -> Any:
    try:
        import cupy
    except ImportError as e:  # pragma: no cover - depends on the machine
        raise RuntimeError("attention_backend='cupy' needs CuPy: pip install 'genq[gpu]'") from e
    return cupy


@functools.cache
def compiled_module(dtype: torch.dtype, head_size: int, block_size: int,
                    device_index: int) -> Any:
    """The CuPy RawModule of one variant, compiled by NVRTC on first use (CuPy also keeps the
    binary in its on-disk cache, so other processes reuse it)."""
    cupy = _cupy()
    with cupy.cuda.Device(device_index):
        module = cupy.RawModule(code=module_source(), options=compile_options(),
                                name_expressions=name_expressions(dtype, head_size, block_size))
        module.compile()
    return module


@functools.cache
def _cupy_function(kernel: str, variant: Variant, device_index: int) -> Any:
    """The kernel's cupy.cuda.Function on the device (what RawKernel would look up per call)."""
    with _cupy().cuda.Device(device_index):
        return compiled_module(*variant, device_index).get_function(kernel).kernel


class CupyLauncher:
    """Launches on one CUDA device through CuPy, on torch's current stream of that device."""

    def __init__(self, device: torch.device) -> None:
        self.cupy = _cupy()
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self._streams: dict[int, Any] = {}  # torch stream handle -> cupy.cuda.Stream

    def function(self, kernel: str, variant: Variant) -> KernelFn:
        fn = _cupy_function(kernel, variant, self.index)
        device = self.cupy.cuda.Device(self.index)

        def launch(grid: Dim3, block: Dim3, params: tuple[Param, ...]) -> None:
            with device:
                try:
                    fn(grid, block, params, stream=self._stream())
                except Exception as e:  # CuPy raises on a failed cuLaunchKernel
                    raise RuntimeError(f"launching {kernel} with grid {grid} and block {block} "
                                       f"failed: {e}") from e

        return launch

    def _stream(self) -> Any:
        """torch's current stream as a cupy.cuda.Stream (CuPy 14's Stream.from_external, through
        the CUDA stream protocol; ExternalStream is deprecated), made once per torch stream."""
        current = torch.cuda.current_stream(self.index)
        stream = self._streams.get(current.cuda_stream)
        if stream is None:
            stream = self.cupy.cuda.Stream.from_external(current)  # (inside `with device`)
            self._streams[current.cuda_stream] = stream
        return stream
