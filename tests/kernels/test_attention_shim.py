"""The unchanged cuda/paged_attention.cu, run on the CPU through the shim, equals the float64 torch
reference. Every case's cache holds NaN in every slot outside the sequences' contexts (free blocks
and the stale tail of each last block), so a single stray read shows up as NaN in the output."""

from __future__ import annotations

import math

import pytest
import torch

from engine import kernels
from engine.attention.cupy_backend import CupyAttentionBackend
from tests.kernels import reference
from tests.kernels.cases import Case, assert_matches, make_case
from tests.kernels.cpu_kernels import ShimLauncher

# (dtype, head size, block size) of the shim build: every dtype, head size and block size.
VARIANTS = [
    (torch.float32, 64, 8), (torch.float32, 64, 16), (torch.float32, 64, 32),
    (torch.float32, 80, 16), (torch.float32, 96, 32), (torch.float32, 128, 16),
    (torch.float32, 256, 8), (torch.float16, 64, 16), (torch.float16, 96, 8),
    (torch.bfloat16, 80, 8), (torch.bfloat16, 128, 32),
]


def _ids(v: tuple[torch.dtype, int, int]) -> str:
    return f"{str(v[0]).removeprefix('torch.')}-h{v[1]}-b{v[2]}"


def run_decode(cpu_kernels: ShimLauncher, c: Case,
               heads_per_cta: int | None = None) -> torch.Tensor:
    out = torch.empty_like(c.query)
    seq_lens = torch.tensor(c.seq_lens, dtype=torch.int32)
    cpu_kernels.run(kernels.decode(out, c.query, c.key_cache, c.value_cache, c.block_tables,
                                   seq_lens, max(c.seq_lens), c.scale, heads_per_cta))
    return out


def run_prefill(cpu_kernels: ShimLauncher, c: Case) -> torch.Tensor:
    out = torch.empty_like(c.query)
    meta = c.metadata(num_decode_seqs=0)
    cpu_kernels.run(kernels.prefill(out, c.query, c.key_cache, c.value_cache, c.block_tables,
                                    meta.seq_lens, meta.query_start_loc, 0, len(c.seq_lens),
                                    meta.max_query_len, c.scale))
    return out


def reference_of(c: Case) -> torch.Tensor:
    return reference.paged_attention(c.query, c.key_cache, c.value_cache, c.block_tables,
                                     c.seq_lens, c.query_lens, c.scale)


def test_shim_build_holds_every_tested_variant(cpu_kernels: ShimLauncher) -> None:
    for dtype, head, block in VARIANTS:
        for name in kernels.name_expressions(dtype, head, block):
            assert cpu_kernels.library.has_kernel(name), name


@pytest.mark.parametrize("variant", VARIANTS, ids=_ids)
def test_decode_equals_reference_with_gqa_ragged_lengths_and_random_tables(
        cpu_kernels: ShimLauncher, variant: tuple[torch.dtype, int, int]) -> None:
    dtype, head, block = variant
    # 1 token; a partial last block; exactly full blocks; several blocks plus a partial one.
    seq_lens = [1, block + 3, 2 * block, 3 * block + block // 2 + 1]
    c = make_case(seq_lens, [1] * 4, num_heads=2, num_kv_heads=1, head_size=head,
                  block_size=block, dtype=dtype, seed=head + block)
    assert_matches(run_decode(cpu_kernels, c, heads_per_cta=2), reference_of(c), dtype)


@pytest.mark.parametrize("num_kv_heads", [1, 2, 4], ids=["mqa", "gqa", "mha"])
def test_decode_and_prefill_map_query_heads_to_their_kv_head(cpu_kernels: ShimLauncher,
                                                              num_kv_heads: int) -> None:
    c = make_case([9, 30], [1, 1], num_heads=4, num_kv_heads=num_kv_heads, head_size=64,
                  block_size=8, seed=7)
    ref = reference_of(c)
    for heads_per_cta in (1, 2, 4):  # every grouping of query heads per CTA the ratio allows
        if (4 // num_kv_heads) % heads_per_cta == 0:
            assert_matches(run_decode(cpu_kernels, c, heads_per_cta), ref, torch.float32)
    c = make_case([9, 30], [9, 4], num_heads=4, num_kv_heads=num_kv_heads, head_size=64,
                  block_size=8, seed=8)
    assert_matches(run_prefill(cpu_kernels, c), reference_of(c), torch.float32)


def test_decode_splits_long_contexts_into_partitions_and_reduces_them(
        cpu_kernels: ShimLauncher) -> None:
    # 2 and 3 partitions of 512 tokens, and a short sequence (one partition) in the same launch;
    # 1025 puts a single token in the last partition.
    seq_lens = [600, 1025, 37]
    c = make_case(seq_lens, [1, 1, 1], num_heads=2, num_kv_heads=1, head_size=64, block_size=16,
                  seed=11)
    launches = kernels.decode(torch.empty_like(c.query), c.query, c.key_cache, c.value_cache,
                              c.block_tables, torch.tensor(seq_lens, dtype=torch.int32),
                              max(seq_lens), c.scale, heads_per_cta=1)
    assert [launch.grid for launch in launches] == [(2, 3, 3), (2, 3, 1)]
    assert_matches(run_decode(cpu_kernels, c, heads_per_cta=2), reference_of(c), torch.float32)


def test_stale_tail_of_the_last_block_never_reaches_the_output(cpu_kernels: ShimLauncher) -> None:
    c = make_case([17], [1], num_heads=2, num_kv_heads=2, head_size=64, block_size=16, seed=3)
    last_block = int(c.block_tables[0, 1])
    assert c.key_cache[last_block, 1:].isnan().all() and c.value_cache[last_block, 1:].isnan().all()
    assert_matches(run_decode(cpu_kernels, c), reference_of(c), torch.float32)


@pytest.mark.parametrize("variant", VARIANTS, ids=_ids)
def test_chunked_prefill_attends_to_cached_context_and_causally_within_the_chunk(
        cpu_kernels: ShimLauncher, variant: tuple[torch.dtype, int, int]) -> None:
    dtype, head, block = variant
    # A whole prompt over several query tiles; a chunk after a cached context that ends inside a
    # block; a one-token chunk; a chunk that starts on a block boundary.
    seq_lens = [37, 2 * block + 9, block + 5, 2 * block + 3]
    query_lens = [37, 11, 1, block + 3]
    c = make_case(seq_lens, query_lens, num_heads=2, num_kv_heads=1, head_size=head,
                  block_size=block, dtype=dtype, seed=100 + head + block)
    assert_matches(run_prefill(cpu_kernels, c), reference_of(c), dtype)


def test_backend_runs_a_mixed_batch_written_through_write_kv(cpu_kernels: ShimLauncher) -> None:
    """CupyAttentionBackend end to end on the shim: write this step's K/V (padding slot -1), then
    two decodes and two prefill chunks in one forward."""
    block, kvh, heads, head = 8, 2, 4, 64
    seq_lens, query_lens = [13, 30, 20, 9], [1, 1, 6, 9]
    c = make_case(seq_lens, query_lens, num_heads=heads, num_kv_heads=kvh, head_size=head,
                  block_size=block, seed=5)
    g = torch.Generator().manual_seed(6)
    # This step's new tokens, plus one padding token at the end that must not be cached.
    num_new = sum(query_lens)
    new_k = torch.randn(num_new + 1, kvh, head, generator=g)
    new_v = torch.randn(num_new + 1, kvh, head, generator=g)
    slots = []
    for i, (n, q) in enumerate(zip(seq_lens, query_lens, strict=True)):
        for pos in range(n - q, n):
            slots.append(int(c.block_tables[i, pos // block]) * block + pos % block)
    slot_mapping = torch.tensor(slots + [-1], dtype=torch.int64)
    expected_k, expected_v = c.key_cache.clone(), c.value_cache.clone()
    reference.reshape_and_cache(new_k, new_v, expected_k, expected_v, slot_mapping)

    backend = CupyAttentionBackend(cpu_kernels)
    backend.write_kv(new_k, new_v, c.key_cache, c.value_cache, slot_mapping)
    assert torch.equal(c.key_cache.nan_to_num(7.0), expected_k.nan_to_num(7.0))
    assert torch.equal(c.value_cache.nan_to_num(7.0), expected_v.nan_to_num(7.0))

    # The query arrives as a view of a fused projection: rows are not contiguous.
    fused = torch.randn(num_new, heads + 2 * kvh, head, generator=g)
    query = fused[:, :heads]
    out = backend.forward(query, c.key_cache, c.value_cache, c.metadata(num_decode_seqs=2),
                          c.scale)
    ref = reference.paged_attention(query, c.key_cache, c.value_cache, c.block_tables, seq_lens,
                                    query_lens, c.scale)
    assert_matches(out, ref, torch.float32)


def test_unsupported_head_size_is_a_value_error_naming_the_fix() -> None:
    cache = torch.zeros(4, 16, 2, 72)
    with pytest.raises(ValueError, match="attention_backend='torch'"):
        kernels.decode(torch.zeros(1, 2, 72), torch.zeros(1, 2, 72), cache, cache,
                       torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 1,
                       72 ** -0.5)


def test_query_heads_are_grouped_per_cta_only_while_the_grid_stays_large() -> None:
    assert kernels.decode_heads_per_cta(32, 8, num_seqs=64, num_partitions=4) == 4
    assert kernels.decode_heads_per_cta(32, 8, num_seqs=16, num_partitions=1) == 1
    assert kernels.decode_heads_per_cta(32, 8, num_seqs=32, num_partitions=1) == 2
    assert kernels.decode_heads_per_cta(28, 4, num_seqs=256, num_partitions=4) == 1  # groups of 7
    assert kernels.decode_heads_per_cta(32, 32, num_seqs=256, num_partitions=4) == 1  # MHA


def test_partition_count_follows_the_longest_context() -> None:
    c = make_case([512, 513], [1, 1], num_heads=2, num_kv_heads=1, head_size=64, block_size=16)
    for max_len, partitions in ((512, 1), (513, 2)):
        launches = kernels.decode(torch.empty_like(c.query), c.query, c.key_cache, c.value_cache,
                                  c.block_tables, torch.tensor(c.seq_lens, dtype=torch.int32),
                                  max_len, c.scale, heads_per_cta=1)
        assert launches[0].grid == (2, 2, partitions)
        assert len(launches) == (1 if partitions == 1 else 2)
        assert math.ceil(max_len / kernels.PARTITION_SIZE) == partitions


def test_plans_refuse_index_tensors_the_kernels_would_misread() -> None:
    c = make_case([20], [1], num_heads=2, num_kv_heads=1, head_size=64, block_size=16)
    seq_lens = torch.tensor(c.seq_lens, dtype=torch.int32)
    out = torch.empty_like(c.query)
    with pytest.raises(ValueError, match="block_tables must be a contiguous torch.int32"):
        kernels.decode(out, c.query, c.key_cache, c.value_cache, c.block_tables.long(), seq_lens,
                       20, c.scale)
    with pytest.raises(ValueError, match="seq_lens must be a contiguous torch.int32"):
        kernels.decode(out, c.query, c.key_cache, c.value_cache, c.block_tables, seq_lens.long(),
                       20, c.scale)
    with pytest.raises(ValueError, match="slot_mapping must be a contiguous torch.int64"):
        k = torch.zeros(1, 1, 64)
        kernels.reshape_and_cache(k, k, c.key_cache, c.value_cache,
                                  torch.zeros(1, dtype=torch.int32))
