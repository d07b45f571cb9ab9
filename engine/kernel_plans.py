"""What genq's CUDA kernels (cuda/*.cu) are asked to do: launch records, validated.

Pure torch, no CUDA: `decode`, `prefill`, `reshape_and_cache` and `copy_blocks` validate their
tensors and return `Launch` records (kernel name expression, grid, block, arguments in the
kernel's parameter order, sized exactly: int32 for `int`, int64 for `long long`, float32 for
`float`, a tensor for a pointer). engine/kernels.py marshals and launches them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

DTYPE_NAMES = {torch.float32: "float", torch.float16: "genq::half_t",
               torch.bfloat16: "genq::bf16_t"}
HEAD_SIZES = (64, 80, 96, 128, 256)
BLOCK_SIZES = (8, 16, 32)
# Constants of cuda/paged_attention.cu and cuda/cache_kernels.cu.
PARTITION_SIZE = 512
DECODE_THREADS = 128
REDUCE_THREADS = 128
PREFILL_THREADS = 128
CACHE_THREADS = 128
MAX_GRID_YZ = 65535
MIN_DECODE_CTAS = 512  # grouping query heads per CTA only while the grid still fills a big GPU

KernelArg = torch.Tensor | np.int32 | np.int64 | np.float32
# A marshalled argument: a pointer is a uint64, or a plain int (8 bytes; what a layer's replay
# writes, being several times cheaper to make than a numpy scalar); scalars keep their size.
Param = np.uint64 | int | np.int32 | np.int64 | np.float32
Variant = tuple[torch.dtype, int, int]  # (dtype, head size, block size): one compiled module
Dim3 = tuple[int, int, int]
KernelFn = Callable[[Dim3, Dim3, tuple[Param, ...]], None]  # (grid, block, params): one launch


@dataclass(frozen=True)
class Launch:
    kernel: str  # name expression, e.g. "genq::paged_attention_decode_kernel<float, 128, 16>"
    variant: tuple[torch.dtype, int, int]  # (dtype, head size, block size): the module it lives in
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    args: tuple[KernelArg, ...]


def name_expressions(dtype: torch.dtype, head_size: int, block_size: int) -> tuple[str, ...]:
    t = DTYPE_NAMES[dtype]
    return (
        f"genq::paged_attention_decode_kernel<{t}, {head_size}, {block_size}>",
        f"genq::paged_attention_reduce_kernel<{t}, {head_size}>",
        f"genq::paged_attention_prefill_kernel<{t}, {head_size}, {block_size}>",
        "genq::reshape_and_cache_kernel",
        "genq::copy_blocks_kernel",
    )


def all_name_expressions() -> set[str]:
    """Every kernel the engine can launch: cuda/instances.cu instantiates exactly this set."""
    return {name for dtype in DTYPE_NAMES for head in HEAD_SIZES for block in BLOCK_SIZES
            for name in name_expressions(dtype, head, block)}


def supports(dtype: torch.dtype, head_size: int, block_size: int) -> bool:
    """Whether the CUDA kernels have a variant for this cache (else use the torch backend)."""
    return dtype in DTYPE_NAMES and head_size in HEAD_SIZES and block_size in BLOCK_SIZES


def check_variant(dtype: torch.dtype, head_size: int, block_size: int) -> None:
    if not supports(dtype, head_size, block_size):
        raise ValueError(
            f"the CUDA kernels support dtypes {sorted(str(d) for d in DTYPE_NAMES)}, head sizes "
            f"{HEAD_SIZES} and block sizes {BLOCK_SIZES}; got {dtype}, head size {head_size}, "
            f"block size {block_size}: use attention_backend='torch' or a supported configuration")


def _i32(x: int) -> np.int32:
    return np.int32(x)


def _cache_variant(key_cache: torch.Tensor) -> tuple[torch.dtype, int, int]:
    if key_cache.dim() != 4 or not key_cache.is_contiguous():
        raise ValueError("a layer's cache must be a contiguous [num_blocks, block_size, "
                         f"num_kv_heads, head_size] tensor, got shape {tuple(key_cache.shape)}")
    variant = (key_cache.dtype, key_cache.shape[3], key_cache.shape[1])
    check_variant(*variant)
    return variant


def _check_rows(name: str, t: torch.Tensor, dtype: torch.dtype, num_heads: int,
                head_size: int) -> None:
    if t.dtype != dtype or t.dim() != 3 or tuple(t.shape[1:]) != (num_heads, head_size):
        raise ValueError(f"{name} must be [num_tokens, {num_heads}, {head_size}] {dtype}, got "
                         f"{tuple(t.shape)} {t.dtype}")
    if t.stride(2) != 1 or t.stride(1) != head_size or t.data_ptr() % 16 or (
            t.stride(0) * t.element_size()) % 16:
        raise ValueError(f"{name} needs contiguous heads and 16-byte aligned rows: call "
                         ".contiguous() first")


def _check_index(name: str, t: torch.Tensor, dtype: torch.dtype, device: torch.device) -> None:
    if t.dtype != dtype or not t.is_contiguous() or t.device != device:
        raise ValueError(f"{name} must be a contiguous {dtype} tensor on {device}, got "
                         f"{t.dtype} on {t.device}")


def decode_heads_per_cta(num_heads: int, num_kv_heads: int, num_seqs: int,
                         num_partitions: int) -> int:
    """Query heads per decode CTA: the largest of 4, 2, 1 that divides the GQA group and still
    leaves MIN_DECODE_CTAS CTAs (so small batches keep one head per CTA and more CTAs)."""
    group = num_heads // num_kv_heads
    for heads in (4, 2):
        if group % heads == 0 and num_heads // heads * num_seqs * num_partitions >= MIN_DECODE_CTAS:
            return heads
    return 1


def decode(out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor,
           value_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
           max_seq_len: int, scale: float, heads_per_cta: int | None = None) -> list[Launch]:
    """One query per sequence: out[i] = attention(query[i], context of sequence i).
    heads_per_cta (1, 2 or 4, dividing num_heads / num_kv_heads) defaults to
    decode_heads_per_cta."""
    dtype, head_size, block_size = variant = _cache_variant(key_cache)
    num_seqs, num_heads = query.shape[0], query.shape[1]
    num_kv_heads = key_cache.shape[2]
    _check_rows("query", query, dtype, num_heads, head_size)
    _check_rows("out", out, dtype, num_heads, head_size)
    _check_index("block_tables", block_tables, torch.int32, query.device)
    _check_index("seq_lens", seq_lens, torch.int32, query.device)
    if not out.is_contiguous() or num_heads % num_kv_heads or num_seqs > MAX_GRID_YZ:
        raise ValueError("decode needs a contiguous out, num_heads a multiple of num_kv_heads and "
                         f"at most {MAX_GRID_YZ} sequences")
    num_partitions = max(1, math.ceil(max_seq_len / PARTITION_SIZE))
    if heads_per_cta is None:
        heads_per_cta = decode_heads_per_cta(num_heads, num_kv_heads, num_seqs, num_partitions)
    if heads_per_cta not in (1, 2, 4) or (num_heads // num_kv_heads) % heads_per_cta:
        raise ValueError("heads_per_cta must be 1, 2 or 4 and divide the "
                         f"{num_heads // num_kv_heads} query heads per KV head, got "
                         f"{heads_per_cta}")
    t = DTYPE_NAMES[dtype]
    dev = query.device
    tmp_out = torch.empty(num_seqs, num_heads, num_partitions, head_size, dtype=torch.float32,
                          device=dev) if num_partitions > 1 else _empty(dev)
    max_logits = torch.empty(num_seqs, num_heads, num_partitions, dtype=torch.float32,
                             device=dev) if num_partitions > 1 else _empty(dev)
    exp_sums = torch.empty_like(max_logits)
    launches = [Launch(
        f"genq::paged_attention_decode_kernel<{t}, {head_size}, {block_size}>", variant,
        (num_heads // heads_per_cta, num_seqs, num_partitions), (DECODE_THREADS, 1, 1),
        (out, tmp_out, max_logits, exp_sums, query, key_cache, value_cache, block_tables,
         seq_lens, _i32(num_kv_heads), _i32(block_tables.shape[1]), _i32(num_partitions),
         _i32(query.stride(0)), np.float32(scale), _i32(heads_per_cta)))]
    if num_partitions > 1:
        launches.append(Launch(
            f"genq::paged_attention_reduce_kernel<{t}, {head_size}>", variant,
            (num_heads, num_seqs, 1), (REDUCE_THREADS, 1, 1),
            (out, tmp_out, max_logits, exp_sums, seq_lens, _i32(num_partitions))))
    return launches


def prefill(out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor,
            value_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
            query_start_loc: torch.Tensor, seq_offset: int, num_seqs: int, max_query_len: int,
            scale: float) -> list[Launch]:
    """Sequences seq_offset .. seq_offset + num_seqs - 1: their queries (rows query_start_loc[i]
    .. query_start_loc[i + 1] - 1) attend causally to their cached context."""
    dtype, head_size, block_size = variant = _cache_variant(key_cache)
    num_heads = query.shape[1]
    _check_rows("query", query, dtype, num_heads, head_size)
    _check_rows("out", out, dtype, num_heads, head_size)
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens),
                    ("query_start_loc", query_start_loc)):
        _check_index(name, t, torch.int32, query.device)
    rows_per_tile = (2 if head_size > 128 else 4) * (PREFILL_THREADS // 32)
    num_tiles = math.ceil(max_query_len / rows_per_tile)
    if not out.is_contiguous() or num_seqs > MAX_GRID_YZ or num_tiles > MAX_GRID_YZ:
        raise ValueError(f"prefill needs a contiguous out, at most {MAX_GRID_YZ} sequences and "
                         f"queries of at most {MAX_GRID_YZ * rows_per_tile} tokens")
    return [Launch(
        f"genq::paged_attention_prefill_kernel<{DTYPE_NAMES[dtype]}, {head_size}, {block_size}>",
        variant, (num_heads, num_seqs, num_tiles), (PREFILL_THREADS, 1, 1),
        (out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
         _i32(seq_offset), _i32(key_cache.shape[2]), _i32(block_tables.shape[1]),
         _i32(query.stride(0)), np.float32(scale)))]


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> list[Launch]:
    """key/value [num_tokens, num_kv_heads, head_size] into their slots; slot -1 writes nothing."""
    variant = _cache_variant(key_cache)
    num_kv_heads, head_size = key_cache.shape[2], key_cache.shape[3]
    for name, t in (("key", key), ("value", value)):
        _check_rows(name, t, key_cache.dtype, num_kv_heads, head_size)
    if value_cache.shape != key_cache.shape or not value_cache.is_contiguous():
        raise ValueError("value_cache must be contiguous and shaped like key_cache")
    if slot_mapping.shape != (key.shape[0],):
        raise ValueError("slot_mapping must be [num_tokens]")
    _check_index("slot_mapping", slot_mapping, torch.int64, key.device)
    vec = 16 // key.element_size()  # elements per 16-byte vector
    if key.shape[0] == 0:
        return []
    return [Launch("genq::reshape_and_cache_kernel", variant, (key.shape[0], 1, 1),
                   (CACHE_THREADS, 1, 1),
                   (key, value, key_cache, value_cache, slot_mapping,
                    _i32(num_kv_heads * head_size // vec), np.int64(key.stride(0) // vec),
                    np.int64(value.stride(0) // vec)))]


def copy_blocks(src_cache: torch.Tensor, dst_cache: torch.Tensor,
                pairs: torch.Tensor) -> list[Launch]:
    """dst_cache[:, :, pairs[i, 1]] = src_cache[:, :, pairs[i, 0]] for every layer, K and V.

    Both caches are [num_layers, 2, num_blocks, block_size, num_kv_heads, head_size] (their
    num_blocks may differ); src_cache may be dst_cache (copy-on-write)."""
    for c in (src_cache, dst_cache):
        if c.dim() != 6 or not c.is_contiguous() or c.data_ptr() % 16:
            raise ValueError("a KV cache must be a contiguous, 16-byte aligned [num_layers, 2, "
                             "num_blocks, block_size, num_kv_heads, head_size] tensor")
    if src_cache.shape[:2] != dst_cache.shape[:2] or src_cache.shape[3:] != dst_cache.shape[3:] \
            or src_cache.dtype != dst_cache.dtype:
        raise ValueError("the two caches differ in layers, block shape or dtype")
    if pairs.dim() != 2 or pairs.shape[1] != 2:
        raise ValueError("pairs must be [num_pairs, 2] (src block, dst block)")
    cuda = [c.device for c in (src_cache, dst_cache) if c.device.type == "cuda"]
    _check_index("pairs", pairs, torch.int64, cuda[0] if cuda else src_cache.device)
    num_planes = src_cache.shape[0] * 2
    if pairs.shape[0] == 0:
        return []
    block_vecs = src_cache[0, 0, 0].numel() * src_cache.element_size() // 16
    variant = (src_cache.dtype, src_cache.shape[5], src_cache.shape[3])
    check_variant(*variant)
    return [Launch("genq::copy_blocks_kernel", variant, (pairs.shape[0], num_planes, 1),
                   (CACHE_THREADS, 1, 1),
                   (src_cache, dst_cache, pairs, np.int64(src_cache.shape[2] * block_vecs),
                    np.int64(dst_cache.shape[2] * block_vecs), np.int64(block_vecs)))]


def _empty(device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.float32, device=device)
