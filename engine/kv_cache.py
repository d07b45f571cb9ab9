"""KVCache: the device cache, the host swap space, and the block moves a step asks for.

Moves run before the step's forward pass, in the order swap-out, swap-in, copy-on-write: a block
swapped out this step may be handed to another sequence, and a block swapped in may be the
source of a copy.
"""

from __future__ import annotations

import mmap

import torch

from engine.attention.base import AttentionBackend
from engine.config import EngineConfig


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                    dtype: torch.dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element


def num_device_blocks(config: EngineConfig, block_bytes: int, device: torch.device) -> int:
    if config.num_gpu_blocks_override is not None:
        return config.num_gpu_blocks_override
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = free - (1.0 - config.gpu_memory_utilization) * total
        return max(int(budget // block_bytes), 0)
    return config.kv_cache_memory // block_bytes


class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, num_host_blocks: int, block_size: int,
                 num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 backend: AttentionBackend) -> None:
        shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        host_shape = (num_layers, 2, num_host_blocks, block_size, num_kv_heads, head_dim)
        if device.type == "cpu":
            self.device_cache = _lazy_zeros(shape, dtype)
            self.host_cache = _lazy_zeros(host_shape, dtype)
        else:
            self.device_cache = torch.zeros(shape, dtype=dtype, device=device)
            # Swap-in reads only what swap-out wrote: no need to clear the pinned pages.
            self.host_cache = torch.empty(host_shape, dtype=dtype, pin_memory=True)
        self.backend = backend

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            src, dst = _index(pairs)
            self.backend.swap_blocks(self.device_cache, self.host_cache, src, dst)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            src, dst = _index(pairs)
            self.backend.swap_blocks(self.host_cache, self.device_cache, src, dst)

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            src, dst = _index(pairs)
            device = self.device_cache.device
            self.backend.copy_blocks(self.device_cache, src.to(device), dst.to(device))


def _lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor backed by an anonymous mapping: the OS hands out zero pages on first touch,
    so a large cache costs memory only for the blocks actually used."""
    numel = 1
    for dim in shape:
        numel *= dim
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buffer = mmap.mmap(-1, nbytes)
    return torch.frombuffer(buffer, dtype=dtype).view(shape)


def _index(pairs: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.tensor(pairs, dtype=torch.int64)
    return t[:, 0], t[:, 1]
