"""Which attention backend an engine runs: our CUDA kernels (CuPy) on a CUDA device when they
can serve the cache, plain torch otherwise; "cuda-shim" runs the same kernels, through the same
backend, on the CPU."""

from __future__ import annotations

import logging

import torch

from engine.attention.base import AttentionBackend
from engine.config import EngineConfig
from engine.models.loader import DTYPES

logger = logging.getLogger(__name__)


def select_backend(config: EngineConfig, device: torch.device, head_dim: int) -> AttentionBackend:
    """"cupy" (our CUDA kernels) on a CUDA device when CuPy imports and a kernel variant exists
    for this cache; "torch" otherwise."""
    name = config.attention_backend
    if name is None:
        name = "torch"
        if device.type == "cuda":
            from engine import kernels

            if not kernels.cupy_available():
                logger.warning("cupy is not importable: using the torch attention backend")
            elif not kernels.supports(DTYPES[config.dtype], head_dim, config.block_size):
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
        from engine.attention.cupy_backend import CupyAttentionBackend

        return CupyAttentionBackend()
    from engine.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend()
