"""KVCache.copy: copy-on-write pairs where a block is both a source and another copy's
destination (a cached block evicted and handed out in the step that copies it) still give each
destination its source's content from before the step, however a launch orders its copies."""

from __future__ import annotations

import pytest
import torch

from engine.attention.torch_backend import TorchAttentionBackend
from engine.config import EngineConfig
from engine.kv_cache import KVCache, copy_rounds, num_device_blocks


class AnyOrderBackend(TorchAttentionBackend):
    """Runs a launch's copies one at a time, last first: a CUDA kernel runs them in no order."""

    def copy_blocks(self, cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        for s, d in reversed(list(zip(src.tolist(), dst.tolist(), strict=True))):
            cache[:, :, d] = cache[:, :, s]


@pytest.mark.parametrize("pairs, rounds", [
    ([(1, 2), (3, 4)], [[(1, 2), (3, 4)]]),  # the common case: one launch
    ([(5, 6), (7, 5)], [[(5, 6)], [(7, 5)]]),  # 5 is read before it is overwritten
    ([(1, 2), (2, 3), (3, 4)], [[(3, 4)], [(2, 3)], [(1, 2)]]),
    ([], []),
])
def test_copy_rounds_read_every_source_before_it_is_overwritten(pairs, rounds) -> None:
    assert copy_rounds(pairs) == rounds


def test_copies_that_form_a_cycle_are_refused() -> None:
    with pytest.raises(RuntimeError, match=r"block copies \[\(1, 2\), \(2, 1\)\] form a cycle"):
        copy_rounds([(1, 2), (2, 1)])


def test_the_cache_copies_as_if_every_source_were_read_first() -> None:
    cache = KVCache(num_layers=2, num_blocks=8, num_host_blocks=0, block_size=4, num_kv_heads=2,
                    head_dim=8, dtype=torch.float32, device=torch.device("cpu"),
                    backend=AnyOrderBackend())
    for block in range(8):
        cache.device_cache[:, :, block] = float(block)
    before = cache.device_cache.clone()
    pairs = [(5, 6), (7, 5), (1, 2), (2, 3)]
    cache.copy(pairs)
    expected = before.clone()
    for s, d in pairs:
        expected[:, :, d] = before[:, :, s]
    assert torch.equal(cache.device_cache, expected)
    assert [float(cache.device_cache[0, 0, b, 0, 0, 0]) for b in range(8)] == \
        [0.0, 1.0, 1.0, 2.0, 4.0, 7.0, 5.0, 7.0]


GIB = 1 << 30


def _stub_cuda_memory(monkeypatch: pytest.MonkeyPatch, free: int, total: int, reserved: int,
                      allocated: int) -> None:
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (free, total))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: reserved)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d: allocated)


def test_memory_torch_reserved_but_does_not_use_counts_as_free(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A second engine in the process: the driver sees 10 of 80 GiB free, but torch's allocator
    still caches 12 GiB the first engine freed (30 reserved, 18 allocated). With 0.9 of the
    device usable, 8 GiB stay free: 10 + 12 - 8 = 14 GiB of 1 MiB blocks."""
    _stub_cuda_memory(monkeypatch, free=10 * GIB, total=80 * GIB, reserved=30 * GIB,
                      allocated=18 * GIB)
    config = EngineConfig(model="m", gpu_memory_utilization=0.9)
    assert num_device_blocks(config, 1 << 20, torch.device("cuda", 0)) == 14 * 1024


def test_nothing_cached_and_too_little_free_gives_no_blocks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _stub_cuda_memory(monkeypatch, free=7 * GIB, total=80 * GIB, reserved=2 * GIB,
                      allocated=2 * GIB)
    config = EngineConfig(model="m", gpu_memory_utilization=0.9)
    assert num_device_blocks(config, 1 << 20, torch.device("cuda", 0)) == 0


def test_the_override_and_the_cpu_budget_ignore_device_memory(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _stub_cuda_memory(monkeypatch, free=0, total=80 * GIB, reserved=0, allocated=0)
    assert num_device_blocks(EngineConfig(model="m", num_gpu_blocks_override=24), 1 << 20,
                             torch.device("cuda", 0)) == 24
    assert num_device_blocks(EngineConfig(model="m", kv_cache_memory=3 * GIB), 1 << 20,
                             torch.device("cpu")) == 3 * 1024
