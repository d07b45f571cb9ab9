"""The kernels through CuPy on a CUDA device, against the same float64 torch reference as the CPU
shim tests: every variant the engine can launch, NaN-poisoned free slots and stale tails,
partitions, chunked prefill, the cache kernels, swap with pinned host memory, and torch stream
ordering."""

from __future__ import annotations

import pytest
import torch

from engine import kernels
from engine.attention.cupy_backend import CupyAttentionBackend, swap_blocks
from tests.kernels import reference
from tests.kernels.cases import Case, assert_matches, make_case

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

VARIANTS = [(dtype, head, block) for dtype in kernels.DTYPE_NAMES for head in kernels.HEAD_SIZES
            for block in kernels.BLOCK_SIZES]


def _ids(v: tuple[torch.dtype, int, int]) -> str:
    return f"{str(v[0]).removeprefix('torch.')}-h{v[1]}-b{v[2]}"


def forward(c: Case, num_decode_seqs: int) -> torch.Tensor:
    out = CupyAttentionBackend().forward(c.query, c.key_cache, c.value_cache,
                                         c.metadata(num_decode_seqs), c.scale)
    torch.cuda.synchronize()
    return out


def reference_of(c: Case) -> torch.Tensor:
    return reference.paged_attention(c.query, c.key_cache, c.value_cache, c.block_tables,
                                     c.seq_lens, c.query_lens, c.scale)


@pytest.mark.parametrize("variant", VARIANTS, ids=_ids)
def test_decode_equals_reference(variant: tuple[torch.dtype, int, int]) -> None:
    dtype, head, block = variant
    seq_lens = [1, block + 3, 2 * block, 5 * block + 1, 300, 1100]
    c = make_case(seq_lens, [1] * len(seq_lens), num_heads=8, num_kv_heads=2, head_size=head,
                  block_size=block, dtype=dtype, seed=head + block, device="cuda")
    ref = reference_of(c)
    assert_matches(forward(c, len(seq_lens)), ref, dtype)
    for heads_per_cta in (1, 2, 4):  # 4 query heads per KV head: every grouping
        out = torch.empty_like(c.query)
        kernels.run_launches(kernels.decode(
            out, c.query, c.key_cache, c.value_cache, c.block_tables,
            torch.tensor(seq_lens, dtype=torch.int32, device="cuda"), max(seq_lens), c.scale,
            heads_per_cta))
        torch.cuda.synchronize()
        assert_matches(out, ref, dtype)


@pytest.mark.parametrize("variant", VARIANTS, ids=_ids)
def test_chunked_prefill_equals_reference(variant: tuple[torch.dtype, int, int]) -> None:
    dtype, head, block = variant
    seq_lens, query_lens = [37, 2 * block + 9, block + 5, 200], [37, 11, 1, 64]
    c = make_case(seq_lens, query_lens, num_heads=8, num_kv_heads=2, head_size=head,
                  block_size=block, dtype=dtype, seed=100 + head + block, device="cuda")
    assert_matches(forward(c, 0), reference_of(c), dtype)


@pytest.mark.parametrize("dtype", list(kernels.DTYPE_NAMES), ids=str)
def test_long_contexts_split_into_partitions_equal_reference(dtype: torch.dtype) -> None:
    seq_lens = [600, 1025, 37, 4100]
    c = make_case(seq_lens, [1] * 4, num_heads=8, num_kv_heads=1, head_size=128, block_size=16,
                  dtype=dtype, seed=11, device="cuda")
    assert_matches(forward(c, 4), reference_of(c), dtype)


def test_mixed_batch_after_write_kv_equals_reference() -> None:
    block, kvh, heads, head = 16, 2, 8, 128
    seq_lens, query_lens = [13, 700, 40, 9], [1, 1, 6, 9]
    c = make_case(seq_lens, query_lens, num_heads=heads, num_kv_heads=kvh, head_size=head,
                  block_size=block, seed=5, device="cuda")
    g = torch.Generator().manual_seed(6)
    num_new = sum(query_lens)
    new_k = torch.randn(num_new + 1, kvh, head, generator=g).cuda()
    new_v = torch.randn(num_new + 1, kvh, head, generator=g).cuda()
    slots = [int(c.block_tables[i, pos // block]) * block + pos % block
             for i, (n, q) in enumerate(zip(seq_lens, query_lens, strict=True))
             for pos in range(n - q, n)]
    slot_mapping = torch.tensor(slots + [-1], dtype=torch.int64, device="cuda")
    expected_k, expected_v = c.key_cache.cpu(), c.value_cache.cpu()
    reference.reshape_and_cache(new_k.cpu(), new_v.cpu(), expected_k, expected_v,
                                slot_mapping.cpu())
    backend = CupyAttentionBackend()
    backend.write_kv(new_k, new_v, c.key_cache, c.value_cache, slot_mapping)
    torch.cuda.synchronize()
    assert torch.equal(c.key_cache.cpu().nan_to_num(7.0), expected_k.nan_to_num(7.0))
    assert torch.equal(c.value_cache.cpu().nan_to_num(7.0), expected_v.nan_to_num(7.0))
    assert_matches(forward(c, 2), reference_of(c), torch.float32)


def test_kernels_run_on_torchs_current_stream() -> None:
    """Queued behind a slow torch op on a side stream, the kernel must see that op's result."""
    c = make_case([500, 33], [1, 1], num_heads=4, num_kv_heads=2, head_size=64, block_size=16,
                  seed=9, device="cuda")
    expected = reference_of(c)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        big = torch.randn(4096, 4096, device="cuda")
        for _ in range(20):
            big = big @ big / 64  # keeps the stream busy
        query = c.query * 1.0  # produced on `side`, consumed there by the kernel
        out = CupyAttentionBackend().forward(query, c.key_cache, c.value_cache, c.metadata(2),
                                             c.scale)
    side.synchronize()
    assert_matches(out, expected, torch.float32)


def test_copy_blocks_copies_every_layer() -> None:
    cache = torch.randn(3, 2, 7, 16, 2, 64, device="cuda").to(torch.bfloat16)
    expected = cache.cpu()
    reference.copy_blocks(expected, expected, [(0, 4), (2, 5), (2, 6)])
    CupyAttentionBackend().copy_blocks(cache, torch.tensor([0, 2, 2]), torch.tensor([4, 5, 6]))
    torch.cuda.synchronize()
    assert torch.equal(cache.cpu(), expected)


def test_swap_blocks_round_trips_through_pinned_host_memory() -> None:
    device_cache = torch.randn(2, 2, 6, 16, 2, 128, device="cuda").half()
    host_cache = torch.zeros(2, 2, 9, 16, 2, 128, dtype=torch.float16).pin_memory()
    original = device_cache.cpu()
    done = swap_blocks(device_cache, host_cache, [4, 1], [8, 0])
    assert done is not None
    done.synchronize()
    assert torch.equal(host_cache[:, :, 8], original[:, :, 4])
    assert torch.equal(host_cache[:, :, 0], original[:, :, 1])
    device_cache[:, :, 2].zero_()  # the step that swaps in runs after this on the current stream
    swap_blocks(host_cache, device_cache, [8], [2])
    assert torch.equal(device_cache[:, :, 2].cpu(), original[:, :, 4])  # current stream waited


def test_unpinned_host_memory_is_refused() -> None:
    device_cache = torch.zeros(1, 2, 2, 16, 1, 64, device="cuda")
    host_cache = torch.zeros(1, 2, 2, 16, 1, 64)
    with pytest.raises(ValueError, match="pinned"):
        swap_blocks(device_cache, host_cache, [0], [1])
