"""CupyAttentionBackend on the CPU shim plans a step's launches once, at its first layer, and every
layer replays them on its own tensors; with prompts_by_sdpa, whole prompts leave the prefill
kernel for SDPA while decodes and chunks stay on the kernels. Outputs equal the float64
reference."""

from __future__ import annotations

import torch

from engine.attention.cupy_backend import CupyAttentionBackend
from tests.kernels import reference
from tests.kernels.cases import Case, assert_matches, make_case
from tests.kernels.cpu_kernels import CountingLauncher, ShimLauncher


def _layer_of(c: Case, factor: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Another layer's query and cache under the same block tables (NaN slots stay NaN)."""
    return c.query * factor, c.key_cache * -factor, c.value_cache * factor


def test_every_layer_replays_the_step_plan_on_its_own_tensors(cpu_kernels: ShimLauncher) -> None:
    seq_lens, query_lens = [13, 30, 20], [1, 1, 6]  # two decodes and a chunk after 14 tokens
    c = make_case(seq_lens, query_lens, num_heads=4, num_kv_heads=2, head_size=64, block_size=8,
                  seed=21)
    meta = c.metadata(num_decode_seqs=2)
    launcher = CountingLauncher(cpu_kernels)
    backend = CupyAttentionBackend(launcher)
    for factor in (1.0, 0.5, -2.0):  # three layers of one step
        query, key_cache, value_cache = _layer_of(c, factor)
        out = backend.forward(query, key_cache, value_cache, meta, c.scale)
        ref = reference.paged_attention(query, key_cache, value_cache, c.block_tables, seq_lens,
                                        query_lens, c.scale)
        assert_matches(out, ref, torch.float32)
    assert launcher.planned == {"paged_attention_decode_kernel": 1,
                                "paged_attention_prefill_kernel": 1}
    assert launcher.counts == {"paged_attention_decode_kernel": 3,
                               "paged_attention_prefill_kernel": 3}
    backend.forward(c.query, c.key_cache, c.value_cache, c.metadata(num_decode_seqs=2), c.scale)
    assert launcher.planned["paged_attention_decode_kernel"] == 2  # a new step plans anew


def test_fresh_prompts_go_to_sdpa_and_chunks_to_the_prefill_kernel(
        cpu_kernels: ShimLauncher) -> None:
    # A decode, a whole prompt, a chunk after cached context, and another whole prompt.
    seq_lens, query_lens = [13, 9, 30, 9], [1, 9, 6, 9]
    c = make_case(seq_lens, query_lens, num_heads=4, num_kv_heads=2, head_size=64, block_size=8,
                  seed=22)
    # This step's keys and values, rows aligned with the queries: what the cache holds there.
    rows = [(i, pos) for i, (n, q) in enumerate(zip(seq_lens, query_lens))
            for pos in range(n - q, n)]
    slots = [int(c.block_tables[i, pos // 8]) * 8 + pos % 8 for i, pos in rows]
    key = c.key_cache.view(-1, 2, 64)[slots]
    value = c.value_cache.view(-1, 2, 64)[slots]
    launcher = CountingLauncher(cpu_kernels)
    backend = CupyAttentionBackend(launcher, prompts_by_sdpa=True)
    out = backend.forward(c.query, c.key_cache, c.value_cache, c.metadata(num_decode_seqs=1),
                          c.scale, key=key, value=value)
    assert_matches(out, reference.paged_attention(c.query, c.key_cache, c.value_cache,
                                                  c.block_tables, seq_lens, query_lens, c.scale),
                   torch.float32)
    # The prefill kernel ran for the chunk alone (grid y: one sequence).
    assert launcher.grids == [("paged_attention_decode_kernel", (4, 1, 1)),
                              ("paged_attention_prefill_kernel", (4, 1, 1))]
