"""cuda/cache_kernels.cu on the CPU shim: reshape_and_cache, copy_blocks and swap_blocks move
exactly the bytes the torch reference moves, and nothing else."""

from __future__ import annotations

import pytest
import torch

from engine import kernels
from engine.attention.cupy_backend import CupyAttentionBackend, swap_blocks
from tests.kernels import reference
from tests.kernels.cpu_kernels import ShimLauncher

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _random(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reshape_and_cache_writes_each_token_to_its_slot_and_skips_minus_one(
        cpu_kernels: ShimLauncher, dtype: torch.dtype) -> None:
    num_blocks, block, kvh, head = 6, 8, 2, 64
    key_cache = _random((num_blocks, block, kvh, head), dtype, 0)
    value_cache = _random((num_blocks, block, kvh, head), dtype, 1)
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    key, value = _random((5, kvh, head), dtype, 2), _random((5, kvh, head), dtype, 3)
    slot_mapping = torch.tensor([17, -1, 0, 47, -1], dtype=torch.int64)
    reference.reshape_and_cache(key, value, expected_k, expected_v, slot_mapping)
    cpu_kernels.run(kernels.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping))
    assert torch.equal(key_cache, expected_k) and torch.equal(value_cache, expected_v)


def test_reshape_and_cache_reads_strided_views_of_a_fused_projection(
        cpu_kernels: ShimLauncher) -> None:
    kvh, head = 2, 80
    qkv = _random((4, 4 + 2 * kvh, head), torch.bfloat16, 4)  # [tokens, q|k|v heads, head]
    key, value = qkv[:, 4:4 + kvh], qkv[:, 4 + kvh:]
    key_cache = torch.zeros(3, 16, kvh, head, dtype=torch.bfloat16)
    value_cache = torch.zeros_like(key_cache)
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    slot_mapping = torch.tensor([3, 40, 41, 5], dtype=torch.int64)
    reference.reshape_and_cache(key, value, expected_k, expected_v, slot_mapping)
    CupyAttentionBackend(cpu_kernels).write_kv(key, value, key_cache, value_cache,
                                                       slot_mapping)
    assert torch.equal(key_cache, expected_k) and torch.equal(value_cache, expected_v)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_copy_blocks_copies_every_layer_k_and_v_in_one_launch(cpu_kernels: ShimLauncher,
                                                              dtype: torch.dtype) -> None:
    cache = _random((3, 2, 7, 16, 2, 64), dtype, 5)  # 3 layers
    expected = cache.clone()
    pairs = [(0, 4), (2, 5), (2, 6)]  # one source copied twice (two forks of a shared block)
    reference.copy_blocks(expected, expected, pairs)
    src = torch.tensor([p[0] for p in pairs])
    dst = torch.tensor([p[1] for p in pairs])
    launches = kernels.copy_blocks(cache, cache, torch.stack([src, dst], 1))
    assert len(launches) == 1 and launches[0].grid == (3, 6, 1)
    CupyAttentionBackend(cpu_kernels).copy_blocks(cache, src, dst)
    assert torch.equal(cache, expected)


def test_swap_blocks_moves_blocks_between_caches_of_different_sizes(
        cpu_kernels: ShimLauncher) -> None:
    device_cache = _random((2, 2, 5, 8, 2, 96), torch.float16, 6)
    host_cache = _random((2, 2, 9, 8, 2, 96), torch.float16, 7)
    expected_host = host_cache.clone()
    reference.copy_blocks(device_cache, expected_host, [(4, 8), (1, 0)])
    assert swap_blocks(device_cache, host_cache, [4, 1], [8, 0], launcher=cpu_kernels) is None
    assert torch.equal(host_cache, expected_host)
    expected_device = device_cache.clone()
    reference.copy_blocks(host_cache, expected_device, [(8, 2)])
    backend = CupyAttentionBackend(cpu_kernels)  # the engine's route to swap_blocks
    backend.swap_blocks(host_cache, device_cache, torch.tensor([8]), torch.tensor([2]))
    assert torch.equal(device_cache, expected_device)


def test_cache_kernels_plan_nothing_for_empty_work() -> None:
    cache = torch.zeros(1, 2, 4, 8, 1, 64)
    assert kernels.copy_blocks(cache, cache, torch.zeros(0, 2, dtype=torch.int64)) == []
    k = torch.zeros(0, 1, 64)
    assert kernels.reshape_and_cache(k, k, cache[0, 0], cache[0, 1],
                                     torch.zeros(0, dtype=torch.int64)) == []
