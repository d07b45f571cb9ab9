"""Paged attention with genq's own CUDA kernels (cuda/*.cu through engine/kernels.py).

Same cache layout and contract as the torch backend (engine/attention/base.py): K/V are read
through the block table, never gathered. Decode sequences (the first num_decode_seqs, one query
each) run in the partitioned decode kernel; the rest (prefill and chunked prefill) in the prefill
kernel, whose queries attend to the cached context and causally within the chunk.

`run` executes the planned launches: CuPy on a GPU (the default); the CPU shim in tests/kernels
runs the same plans on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from engine import kernels
from engine.attention.base import AttentionBackend, AttentionMetadata

Runner = Callable[[list[kernels.Launch]], None]


class CupyAttentionBackend(AttentionBackend):
    def __init__(self, run: Runner | None = None) -> None:
        self.run: Runner = run or kernels.run_launches

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        self.run(kernels.reshape_and_cache(_rows(key), _rows(value), key_cache, value_cache,
                                           slot_mapping.to(torch.int64).contiguous()))

    def forward(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, key: torch.Tensor | None = None,
                value: torch.Tensor | None = None) -> torch.Tensor:
        query = _rows(query)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        num_seqs = len(meta.seq_lens_list)
        nd = meta.num_decode_seqs
        block_tables = meta.block_tables.to(torch.int32).contiguous()
        seq_lens = meta.seq_lens.to(torch.int32).contiguous()
        launches: list[kernels.Launch] = []
        if nd:
            launches += kernels.decode(out[:nd], query[:nd], key_cache, value_cache,
                                       block_tables[:nd], seq_lens[:nd],
                                       max(meta.seq_lens_list[:nd]), scale)
        if nd < num_seqs:
            launches += kernels.prefill(out, query, key_cache, value_cache, block_tables, seq_lens,
                                        meta.query_start_loc.to(torch.int32).contiguous(), nd,
                                        num_seqs - nd, max(meta.query_lens_list[nd:]), scale)
        self.run(launches)
        return out

    def copy_blocks(self, cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.run(kernels.copy_blocks(cache, cache, _pairs(src, dst, cache.device)))

    def swap_blocks(self, src_cache: torch.Tensor, dst_cache: torch.Tensor, src: torch.Tensor,
                    dst: torch.Tensor) -> None:
        swap_blocks(src_cache, dst_cache, src, dst, run=self.run)


def swap_blocks(src_cache: torch.Tensor, dst_cache: torch.Tensor,
                src_ids: Sequence[int] | torch.Tensor, dst_ids: Sequence[int] | torch.Tensor,
                run: Runner | None = None, wait: bool = True) -> torch.cuda.Event | None:
    """dst_cache[:, :, dst_ids[i]] = src_cache[:, :, src_ids[i]] for every layer, K and V, in one
    launch.

    One cache is on the GPU, the other in pinned host memory (swap out: device -> host; swap in:
    host -> device). The copy runs on a side stream after the work already queued on the current
    stream; the returned event marks its end, and with wait=True the current stream waits for it,
    so the step's forward pass sees the moved blocks while the host never blocks. With two CPU
    caches (the CPU shim) the copy simply runs, and None is returned.
    """
    runner = run or kernels.run_launches
    device = next((c.device for c in (src_cache, dst_cache) if c.device.type == "cuda"), None)
    if device is None:
        pairs = _pairs(src_ids, dst_ids, src_cache.device)
        runner(kernels.copy_blocks(src_cache, dst_cache, pairs))
        return None
    pairs = _pairs(src_ids, dst_ids, device)
    current = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(current)  # blocks written by earlier steps are final before they move
    with torch.cuda.stream(side):
        runner(kernels.copy_blocks(src_cache, dst_cache, pairs))
        done = torch.cuda.Event()
        done.record(side)
    pairs.record_stream(side)  # allocated on the current stream, read on the side stream
    if wait:
        current.wait_event(done)
    return done


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[tokens, heads, head_size] with contiguous heads and 16-byte aligned rows."""
    aligned = t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0
    if t.stride(2) == 1 and t.stride(1) == t.shape[2] and aligned:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _pairs(src: Sequence[int] | torch.Tensor, dst: Sequence[int] | torch.Tensor,
           device: torch.device) -> torch.Tensor:
    s = torch.as_tensor(src, dtype=torch.int64)
    d = torch.as_tensor(dst, dtype=torch.int64)
    if s.shape != d.shape or s.dim() != 1:
        raise ValueError(f"src and dst block ids must be two 1-d lists of one length, got "
                         f"{tuple(s.shape)} and {tuple(d.shape)}")
    return torch.stack([s, d], dim=1).to(device)
