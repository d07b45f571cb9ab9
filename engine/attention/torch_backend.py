"""Paged attention in plain torch: the CPU path and the reference for the CUDA kernels.

Decode sequences (one query each) run as one batch: on the CPU in float32 through a small C++
kernel that reads the cache in place (cpu_kernels.py); otherwise their keys and values are
gathered through the block table into a padded [batch, context] view, grouped by context length
so short sequences do not pay for the longest one. Prefills with no cached context (the whole
prompt in this step) of equal length run as one batch on this step's keys and values; other
prefill chunks run one sequence at a time with a causal mask offset by the cached context.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention import cpu_kernels
from engine.attention.base import AttentionBackend, AttentionMetadata

_BUCKET_RATIO = 1.5  # a decode bucket's longest context is at most this times its shortest


class TorchAttentionBackend(AttentionBackend):
    def __init__(self) -> None:
        # The last slot mapping seen to hold no -1: every layer of a step passes the same tensor,
        # so the check (a host sync) runs once a step. Holding it keeps its id from being reused.
        self._valid_slots: torch.Tensor | None = None

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        flat_k = key_cache.view(-1, *key_cache.shape[2:])
        flat_v = value_cache.view(-1, *value_cache.shape[2:])
        if slot_mapping is not self._valid_slots:
            if bool((slot_mapping < 0).any()):
                keep = slot_mapping >= 0
                key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
            else:
                self._valid_slots = slot_mapping
        flat_k.index_copy_(0, slot_mapping, key)
        flat_v.index_copy_(0, slot_mapping, value)

    def forward(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, key: torch.Tensor | None = None,
                value: torch.Tensor | None = None) -> torch.Tensor:
        nd = meta.num_decode_seqs
        if nd and nd == len(meta.seq_lens_list) and cpu_kernels.supports(query, key_cache):
            return cpu_kernels.paged_decode(query.contiguous(), key_cache, value_cache,
                                            meta.block_tables, meta.seq_lens, scale)
        out = torch.empty_like(query)
        if nd and cpu_kernels.supports(query, key_cache):
            out[:nd] = cpu_kernels.paged_decode(query[:nd].contiguous(), key_cache, value_cache,
                                                meta.block_tables[:nd], meta.seq_lens[:nd], scale)
        elif nd:
            for lo, hi in _buckets(meta.seq_lens_list[:nd]):
                out[lo:hi] = self._decode(query[lo:hi], key_cache, value_cache,
                                          meta.block_tables[lo:hi], meta.seq_lens[lo:hi],
                                          max(meta.seq_lens_list[lo:hi]), scale)
        if nd == len(meta.seq_lens_list):
            return out
        plan = meta.prefills()
        batched = key is not None and value is not None
        chunks = plan.chunks if batched else range(nd, len(meta.seq_lens_list))
        for i in chunks:
            lo, hi = plan.starts[i], plan.starts[i + 1]
            out[lo:hi] = self._prefill(query[lo:hi], key_cache, value_cache,
                                       meta.block_tables[i], meta.seq_lens_list[i], scale)
        if batched:
            assert key is not None and value is not None
            for length, rows in plan.fresh_rows.items():
                out[rows] = fresh_prompts_attention(query[rows], key[rows], value[rows],
                                                  len(plan.fresh[length]), scale)
        return out

    @staticmethod
    def _decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                block_tables: torch.Tensor, seq_lens: torch.Tensor, max_len: int,
                scale: float) -> torch.Tensor:
        batch, num_heads, head_dim = query.shape
        block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
        num_blocks = -(-max_len // block_size)
        tables = block_tables[:, :num_blocks]
        # [batch, num_kv_heads, context, head_dim]
        k = key_cache[tables].view(batch, -1, num_kv_heads, head_dim).transpose(1, 2)
        v = value_cache[tables].view(batch, -1, num_kv_heads, head_dim).transpose(1, 2)
        q = query.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
        scores = torch.matmul(q, k.transpose(2, 3)).float() * scale
        stale = torch.arange(k.shape[2], device=query.device)[None, :] >= seq_lens[:, None]
        scores.masked_fill_(stale[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        return torch.matmul(probs, v).view(batch, num_heads, head_dim)

    @staticmethod
    def _prefill(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 block_table: torch.Tensor, seq_len: int, scale: float) -> torch.Tensor:
        q_len, num_heads, head_dim = query.shape
        block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
        blocks = block_table[: -(-seq_len // block_size)]
        k = key_cache[blocks].view(-1, num_kv_heads, head_dim)[:seq_len]
        v = value_cache[blocks].view(-1, num_kv_heads, head_dim)[:seq_len]
        # Query i sits at position seq_len - q_len + i and sees keys at positions <= its own.
        mask = torch.ones(q_len, seq_len, dtype=torch.bool, device=query.device)
        mask = mask.tril(diagonal=seq_len - q_len)
        out = F.scaled_dot_product_attention(
            query.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0), attn_mask=mask, scale=scale,
            enable_gqa=num_heads != num_kv_heads)
        return out.squeeze(0).transpose(0, 1)

    def copy_blocks(self, cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        cache[:, :, dst] = cache[:, :, src]


def fresh_prompts_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            batch: int, scale: float) -> torch.Tensor:
    """`batch` whole prompts of one length, rows concatenated: causal attention over their own
    keys, one SDPA call (a tensor-core flash kernel on CUDA)."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = key.shape[1]

    def split(x: torch.Tensor) -> torch.Tensor:  # [batch, heads, length, head_dim]
        return x.view(batch, -1, x.shape[1], head_dim).transpose(1, 2)

    out = F.scaled_dot_product_attention(split(query), split(key), split(value),
                                         is_causal=True, scale=scale,
                                         enable_gqa=num_heads != num_kv_heads)
    return out.transpose(1, 2).reshape(-1, num_heads, head_dim)


def _buckets(lengths: list[int]) -> list[tuple[int, int]]:
    """Contiguous runs of decode sequences; the model runner sorts decodes by context length."""
    runs, lo = [], 0
    for i in range(1, len(lengths) + 1):
        if i == len(lengths) or lengths[i] > _BUCKET_RATIO * lengths[lo] + 16:
            runs.append((lo, i))
            lo = i
    return runs
