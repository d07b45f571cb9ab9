"""Which attention backend an engine runs: our CUDA kernels (CuPy) on a CUDA device when they
can serve the cache, plain torch otherwise; "cuda-shim" runs the same kernels, through the same
backend, on the CPU."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from engine.attention.base import AttentionBackend
from engine.config import EngineConfig
from engine.models.loader import DTYPES

logger = logging.getLogger(__name__)


def select_backend(config: EngineConfig, device: torch.device, head_dim: int,
                   check: Callable[[], None] | None = None) -> AttentionBackend:
    """"cupy" (our CUDA kernels) on a CUDA device when a kernel variant exists for this cache
    and passes the start-up check (`check`, by default kernel_check.check_kernels on `device`);
    "torch" otherwise. An explicit attention_backend="cupy" whose check fails raises
    KernelCheckError instead of falling back."""
    name = config.attention_backend
    if name is None:
        name = "torch"
        if device.type == "cuda":
            from engine import kernels

            if not kernels.supports(DTYPES[config.dtype], head_dim, config.block_size):
                logger.warning("no CUDA kernel variant for %s, head size %d, block size %d: "
                               "using the torch attention backend", config.dtype, head_dim,
                               config.block_size)
            else:
                name = "cupy"
    if name == "cuda-shim":
        from engine import kernels

        if device.type != "cpu":
            raise ValueError("attention_backend='cuda-shim' runs the CUDA kernels on the CPU: "
                             "use device='cpu' (or attention_backend='cupy' on a GPU)")
        kernels.check_variant(DTYPES[config.dtype], head_dim, config.block_size)
        from engine.attention.cuda_shim import ShimLauncher
        from engine.attention.cupy_backend import CupyAttentionBackend

        return CupyAttentionBackend(ShimLauncher())
    if name == "cupy":
        if device.type != "cuda":
            raise ValueError("attention_backend='cupy' needs a CUDA device")
        if _kernels_pass(config, device, head_dim, check):
            from engine.attention.cupy_backend import CupyAttentionBackend

            return CupyAttentionBackend()
    from engine.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend()


def _kernels_pass(config: EngineConfig, device: torch.device, head_dim: int,
                  check: Callable[[], None] | None) -> bool:
    """Runs the kernels' start-up check. A failure is one warning line and False when the
    backend was chosen automatically, KernelCheckError when the user asked for "cupy"."""
    from engine.attention.kernel_check import KernelCheckError, check_kernels

    try:
        if check is None:
            check_kernels(DTYPES[config.dtype], head_dim, config.block_size, device)
        else:
            check()
    except KernelCheckError as e:
        if config.attention_backend == "cupy":
            raise KernelCheckError(f"attention_backend='cupy': the CUDA kernels failed their "
                                   f"start-up check: {e}") from e
        logger.warning("the CUDA kernels failed their start-up check (%s): using the torch "
                       "attention backend", e)
        return False
    return True
