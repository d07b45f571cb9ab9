"""The CPU decode kernel equals the torch paged-attention path, and never reads stale tails."""

from __future__ import annotations

import pytest
import torch

from engine.attention import cpu_kernels
from engine.attention.torch_backend import TorchAttentionBackend


def _case(num_heads: int, num_kv_heads: int, head_size: int, block_size: int, seed: int,
          batch: int = 9, max_len: int = 70):
    g = torch.Generator().manual_seed(seed)
    num_blocks = batch * -(-max_len // block_size) + 7
    k = torch.randn(num_blocks, block_size, num_kv_heads, head_size, generator=g)
    v = torch.randn(num_blocks, block_size, num_kv_heads, head_size, generator=g)
    lens = torch.randint(1, max_len, (batch,), generator=g, dtype=torch.int32).sort().values
    width = -(-max_len // block_size)
    tables = torch.randperm(num_blocks, generator=g)[: batch * width].view(batch, width)
    q = torch.randn(batch, num_heads, head_size, generator=g)
    return q, k, v, tables.to(torch.int32), lens


@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("head_size", [32, 64, 128])
@pytest.mark.parametrize("block_size", [1, 4, 16, 32])
@pytest.mark.parametrize("batch", [3, 40], ids=["per-kv-head", "per-sequence"])
def test_kernel_equals_torch_reference(heads, head_size, block_size, batch):
    # 3 sequences split work by KV head, 40 by whole sequence; block sizes below, at and above
    # the kernel's 8 lanes, with partial last blocks.
    q, k, v, tables, lens = _case(*heads, head_size, block_size, seed=head_size + block_size,
                                  batch=batch)
    assert cpu_kernels.supports(q, k)
    ref = TorchAttentionBackend._decode(q, k, v, tables, lens, int(lens.max()), 0.125)
    out = cpu_kernels.paged_decode(q, k, v, tables, lens, 0.125)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads", [(6, 2), (16, 1), (64, 2)], ids=["group-3", "group-16",
                                                                    "group-32"])
@pytest.mark.parametrize("head_size", [8, 16, 24, 256])
def test_kernel_equals_torch_reference_for_other_head_and_group_sizes(heads, head_size):
    # Head sizes and groups with and without a specialised kernel (16, 256; groups 1/2/4/8).
    q, k, v, tables, lens = _case(*heads, head_size, 16, seed=head_size, batch=5)
    assert cpu_kernels.supports(q, k)
    ref = TorchAttentionBackend._decode(q, k, v, tables, lens, int(lens.max()), 0.125)
    out = cpu_kernels.paged_decode(q, k, v, tables, lens, 0.125)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("magnitude", [1e-3, 1.0, 30.0])
@pytest.mark.parametrize("head_size", [16, 64, 40])
def test_sequences_longer_than_a_chunk_match_the_reference(magnitude, head_size):
    # Contexts past the kernel's 256-token chunks: the softmax state carried from chunk to
    # chunk, rescaled when a later chunk holds a larger score.
    q, k, v, tables, lens = _case(8, 2, head_size, 16, seed=7, batch=6, max_len=1100)
    q = q * magnitude
    ref = TorchAttentionBackend._decode(q, k, v, tables, lens, int(lens.max()), 0.125)
    out = cpu_kernels.paged_decode(q, k, v, tables, lens, 0.125)
    tol = 1e-5 if magnitude <= 1 else 1e-4
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)


def test_nan_in_the_stale_tail_of_the_last_block_does_not_leak():
    q, k, v, tables, lens = _case(8, 2, 64, 16, seed=3)
    clean = cpu_kernels.paged_decode(q, k, v, tables, lens, 0.125)
    poisoned_rows = 0
    for b, n in enumerate(lens.tolist()):
        last = tables[b, (n - 1) // 16]
        k[last, (n - 1) % 16 + 1:] = float("nan")  # rows past the sequence's last token
        v[last, (n - 1) % 16 + 1:] = float("nan")
        poisoned_rows += 15 - (n - 1) % 16
    assert poisoned_rows > 0
    poisoned = cpu_kernels.paged_decode(q, k, v, tables, lens, 0.125)
    assert not poisoned.isnan().any()
    assert torch.equal(poisoned, clean)


@pytest.mark.parametrize("magnitude", [1e-3, 30.0])
def test_flat_and_peaked_softmax_match_the_reference(magnitude):
    # Near-uniform weights and weights peaked on single tokens whose maximum moves from block
    # to block: the online rescaling and the kernel's exp over a wide range of arguments.
    q, k, v, tables, lens = _case(8, 2, 64, 16, seed=11, batch=12)
    q = q * magnitude
    ref = TorchAttentionBackend._decode(q, k, v, tables, lens, int(lens.max()), 0.125)
    out = cpu_kernels.paged_decode(q, k, v, tables, lens, 0.125)
    # Scores in the hundreds carry float32 rounding of ~1e-5 in any summation order (the
    # previous two-pass kernel with libm's exp differed from torch by the same 2.4e-5).
    tol = 1e-5 if magnitude < 1 else 1e-4
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)


def test_kernel_shares_torchs_openmp_runtime_and_is_deterministic_across_threads():
    q, k, v, tables, lens = _case(8, 2, 64, 16, seed=5, batch=40)
    assert cpu_kernels.available()
    runtimes = {line.split()[-1] for line in open("/proc/self/maps").read().splitlines()
                if "libgomp" in line}
    assert len(runtimes) == 1  # the kernel's OpenMP is torch's, not a second pool
    library = cpu_kernels._library()
    assert library is not None and b"GOMP_parallel" in open(library._name, "rb").read()
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(cpu_kernels.paged_decode(q, k, v, tables, lens, 0.125))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
