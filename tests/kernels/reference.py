"""Plain-torch references for the kernels, in float64: the context of each sequence gathered
through its block table, causal softmax attention, and the cache writes and copies."""

from __future__ import annotations

import math

import torch


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: list[int], query_lens: list[int],
                    scale: float) -> torch.Tensor:
    """query [num_tokens, num_heads, head] (sequences' queries concatenated) -> float64 output."""
    num_heads = query.shape[1]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    out = torch.empty(query.shape, dtype=torch.float64)
    start = 0
    for i, (seq_len, q_len) in enumerate(zip(seq_lens, query_lens, strict=True)):
        blocks = block_tables[i, : math.ceil(seq_len / block_size)].long().cpu()
        k = key_cache.cpu()[blocks].reshape(-1, num_kv_heads, key_cache.shape[3])[:seq_len]
        v = value_cache.cpu()[blocks].reshape(-1, num_kv_heads, key_cache.shape[3])[:seq_len]
        k = k.double().repeat_interleave(num_heads // num_kv_heads, dim=1)
        v = v.double().repeat_interleave(num_heads // num_kv_heads, dim=1)
        q = query[start : start + q_len].cpu().double()
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        positions = torch.arange(seq_len - q_len, seq_len)
        hidden = torch.arange(seq_len)[None, :] > positions[:, None]
        scores = scores.masked_fill(hidden, float("-inf"))
        out[start : start + q_len] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
        start += q_len
    return out


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    flat_k = key_cache.view(-1, *key_cache.shape[2:])
    flat_v = value_cache.view(-1, *value_cache.shape[2:])
    for token, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            flat_k[slot] = key[token]
            flat_v[slot] = value[token]


def copy_blocks(src_cache: torch.Tensor, dst_cache: torch.Tensor,
                pairs: list[tuple[int, int]]) -> None:
    for src, dst in pairs:
        dst_cache[:, :, dst] = src_cache[:, :, src]
