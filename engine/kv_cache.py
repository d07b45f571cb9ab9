"""KVCache: the device cache, the host swap space, and the block moves a step asks for.

Moves run before the step's forward pass, in the order swap-out, swap-in, copy-on-write: a block
swapped out this step may be handed to another sequence, and a block swapped in may be the
source of a copy. A cache's followers (a draft model's cache over the same block tables) get
the same moves.
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
        # Memory torch's caching allocator reserved but holds no tensor in (an earlier engine's
        # cache, the load's temporaries) is used as far as the driver knows, yet this process
        # can allocate it: count it as free, or a second engine in the process gets no cache.
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
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
        self.followers: list[KVCache] = []

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            src, dst = _index(pairs)
            self.backend.swap_blocks(self.device_cache, self.host_cache, src, dst)
            for cache in self.followers:
                cache.swap_out(pairs)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            src, dst = _index(pairs)
            self.backend.swap_blocks(self.host_cache, self.device_cache, src, dst)
            for cache in self.followers:
                cache.swap_in(pairs)

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: each destination gets its source's content from before the step's
        copies (a block can be both: a copy's source, evicted from the prefix cache and handed
        out as another copy's destination). One launch per round of copy_rounds."""
        device = self.device_cache.device
        for round_pairs in copy_rounds(pairs):
            src, dst = _index(round_pairs)
            self.backend.copy_blocks(self.device_cache, src.to(device), dst.to(device))
        for cache in self.followers:
            cache.copy(pairs)


def copy_rounds(pairs: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """`pairs` (source, destination) in rounds whose copies may all run at once (a CUDA kernel
    runs a launch's copies in no order) with the effect of reading every source first: a copy
    that overwrites a block another copy still reads waits for a later round. Almost always a
    single round."""
    rounds: list[list[tuple[int, int]]] = []
    pending = list(pairs)
    while pending:
        sources = {s for s, _ in pending}
        ready = [p for p in pending if p[1] not in sources or p[0] == p[1]]
        if not ready:
            raise RuntimeError(f"block copies {pending} form a cycle")
        rounds.append(ready)
        pending = [p for p in pending if p[1] in sources and p[0] != p[1]]
    return rounds


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
