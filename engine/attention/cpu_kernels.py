"""The CPU decode kernel (engine/csrc/paged_decode.cpp), built by engine/native.py on first use.
Without a compiler the torch path runs instead."""

from __future__ import annotations

import ctypes
import functools

import torch

from engine import native


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = native.library(native.CSRC / "paged_decode.cpp")
    if lib is None:
        return None
    lib.genq_paged_decode_f32.restype = ctypes.c_int
    lib.genq_paged_decode_f32.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 6 + [
        ctypes.c_float, ctypes.c_int]
    return lib


def available() -> bool:
    return _library() is not None


def paged_decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """query [B, H, D] float32 contiguous; caches [N, block, Hkv, D]; int32 tables and lengths."""
    lib = _library()
    assert lib is not None
    batch, num_heads, head_size = query.shape
    out = torch.empty_like(query)
    tables = block_tables.contiguous()
    lens = seq_lens.contiguous()
    rc = lib.genq_paged_decode_f32(
        query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), tables.data_ptr(),
        lens.data_ptr(), out.data_ptr(), batch, num_heads, key_cache.shape[2], head_size,
        key_cache.shape[1], tables.shape[1], scale, torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"CPU decode kernel: unsupported shape (heads {num_heads}, "
                         f"kv heads {key_cache.shape[2]}, head size {head_size})")
    return out


def supports(query: torch.Tensor, key_cache: torch.Tensor) -> bool:
    num_heads, head_size = query.shape[1], query.shape[2]
    num_kv_heads = key_cache.shape[2]
    return (query.device.type == "cpu" and query.dtype == torch.float32
            and key_cache.dtype == torch.float32 and key_cache.is_contiguous()
            and head_size % 8 == 0 and head_size <= 256 and num_heads % num_kv_heads == 0
            and num_heads // num_kv_heads <= 32 and available())
