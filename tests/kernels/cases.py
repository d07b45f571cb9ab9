"""Attention cases shared by the CPU-shim tests and the GPU tests: a paged cache whose unused slots
(free blocks and the stale tail of every last block) hold NaN, random block tables, ragged
context lengths, GQA."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engine.attention.base import AttentionMetadata


@dataclass
class Case:
    query: torch.Tensor          # [num_tokens, num_heads, head_size]
    key_cache: torch.Tensor      # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: torch.Tensor
    block_tables: torch.Tensor   # [num_seqs, max_blocks] int32, padded with 0
    seq_lens: list[int]
    query_lens: list[int]
    scale: float

    def metadata(self, num_decode_seqs: int) -> AttentionMetadata:
        starts = [0]
        for q in self.query_lens:
            starts.append(starts[-1] + q)
        device = self.query.device
        return AttentionMetadata(
            slot_mapping=torch.full((self.query.shape[0],), -1, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(self.seq_lens, dtype=torch.int32, device=device),
            block_tables=self.block_tables, max_query_len=max(self.query_lens),
            max_seq_len=max(self.seq_lens), num_decode_seqs=num_decode_seqs,
            seq_lens_list=list(self.seq_lens), query_lens_list=list(self.query_lens))


def make_case(seq_lens: list[int], query_lens: list[int], num_heads: int, num_kv_heads: int,
              head_size: int, block_size: int, dtype: torch.dtype = torch.float32, seed: int = 0,
              device: str = "cpu", spare_blocks: int = 3) -> Case:
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    key_cache = torch.full((num_blocks, block_size, num_kv_heads, head_size), float("nan"),
                           dtype=dtype)
    value_cache = key_cache.clone()
    for i, (n, nb) in enumerate(zip(seq_lens, blocks_per_seq, strict=True)):
        blocks = [order.pop() for _ in range(nb)]
        tables[i, :nb] = torch.tensor(blocks, dtype=torch.int32)
        k = torch.randn(nb * block_size, num_kv_heads, head_size, generator=g)
        v = torch.randn(nb * block_size, num_kv_heads, head_size, generator=g)
        kc = key_cache[blocks].view(-1, num_kv_heads, head_size)
        vc = value_cache[blocks].view(-1, num_kv_heads, head_size)
        kc[:n], vc[:n] = k[:n].to(dtype), v[:n].to(dtype)  # rows >= n stay NaN: the stale tail
        key_cache[blocks] = kc.view(nb, block_size, num_kv_heads, head_size)
        value_cache[blocks] = vc.view(nb, block_size, num_kv_heads, head_size)
    query = torch.randn(sum(query_lens), num_heads, head_size, generator=g).to(dtype)
    return Case(query.to(device), key_cache.to(device), value_cache.to(device), tables.to(device),
                list(seq_lens), list(query_lens), head_size ** -0.5)


def max_rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref|: NaN anywhere in out makes it NaN (and fails any bound)."""
    return float((out.double().cpu() - ref).abs().max() / ref.abs().max())


FP32_REL_ERR = 1e-5
# One rounding of the output to the storage type (half an ulp), plus the fp32 error above.
ROUNDING = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}


def assert_matches(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """A kernel's output (on any device) against the float64 reference."""
    out = out.cpu()
    assert not out.isnan().any(), "NaN in the output: a stale or free slot was read"
    if dtype == torch.float32:
        assert max_rel_err(out, ref) < FP32_REL_ERR
    else:
        err = (out.double() - ref).abs()
        bound = ROUNDING[dtype] * ref.abs() + FP32_REL_ERR * ref.abs().max()
        assert bool((err <= bound).all()), f"max excess {float((err - bound).max())}"
