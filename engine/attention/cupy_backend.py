"""Paged attention with genq's own CUDA kernels (cuda/*.cu through engine/kernels.py).

Same cache layout and contract as the torch backend (engine/attention/base.py): K/V are read
through the block table, never gathered. Decode sequences (the first num_decode_seqs, one query
each) run in the partitioned decode kernel; prefill chunks (queries after a cached context) in
the prefill kernel, whose queries attend to the cached context and causally within the chunk.
Whole prompts (no cached context) go to the prefill kernel too, or, with `prompts_by_sdpa` (the
default on CUDA), to torch's scaled_dot_product_attention over this step's keys and values.

The launches are planned once per step (at the step's first layer) and every layer replays them
on its own tensors (launch_plan.py). A `kernels.Launcher` executes them: CuPy on a GPU, the g++
shim build of the same sources on the CPU (attention_backend="cuda-shim"); nothing else differs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine import kernels
from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.attention.launch_plan import LayerLaunches
from engine.attention.torch_backend import fresh_prompts_attention


@dataclass
class _StepPlan:
    slot_mapping: torch.Tensor  # identifies the step: every layer passes the same tensor
    write: LayerLaunches | None = None
    attend: LayerLaunches | None = None
    scale: float = 0.0
    sdpa_rows: dict[int, torch.Tensor | slice] | None = None  # whole prompts by length: SDPA


class CupyAttentionBackend(AttentionBackend):
    def __init__(self, launcher: kernels.Launcher | None = None,
                 prompts_by_sdpa: bool | None = None) -> None:
        self.launcher = launcher  # None: CuPy, on the device of the first tensors it sees
        # Whole prompts by SDPA (None: on CUDA only). A plain attribute: tests set it on the CPU.
        self.prompts_by_sdpa = prompts_by_sdpa
        self._step: _StepPlan | None = None

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        layer = (_rows(key), _rows(value), key_cache, value_cache)
        step = self._plan(slot_mapping)
        if step.write is None:
            slots = slot_mapping.to(torch.int64).contiguous()
            step.write = LayerLaunches(kernels.reshape_and_cache(*layer, slots), layer,
                                       self._launcher(key.device))
        step.write.launch(layer)

    def forward(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, key: torch.Tensor | None = None,
                value: torch.Tensor | None = None) -> torch.Tensor:
        query = _rows(query)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        layer = (out, query, key_cache, value_cache)
        step = self._plan(meta.slot_mapping)
        if step.attend is None or step.scale != scale:
            self._plan_attention(step, layer, meta, scale, key is not None and value is not None)
        assert step.attend is not None
        step.attend.launch(layer)
        if step.sdpa_rows:
            assert key is not None and value is not None
            prompts = meta.prefills().fresh
            for length, rows in step.sdpa_rows.items():
                out[rows] = fresh_prompts_attention(query[rows], key[rows], value[rows],
                                                    len(prompts[length]), scale)
        return out

    def copy_blocks(self, cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        kernels.run_launches(kernels.copy_blocks(cache, cache, _pairs(src, dst, cache.device)),
                             self._launcher(cache.device))

    def swap_blocks(self, src_cache: torch.Tensor, dst_cache: torch.Tensor, src: torch.Tensor,
                    dst: torch.Tensor) -> None:
        device = next((c.device for c in (src_cache, dst_cache) if c.device.type == "cuda"),
                      src_cache.device)
        swap_blocks(src_cache, dst_cache, src, dst, launcher=self._launcher(device))

    def _plan(self, slot_mapping: torch.Tensor) -> _StepPlan:
        if self._step is None or self._step.slot_mapping is not slot_mapping:
            self._step = _StepPlan(slot_mapping)
        return self._step

    def _plan_attention(self, step: _StepPlan, layer: tuple[torch.Tensor, ...],
                        meta: AttentionMetadata, scale: float, have_kv: bool) -> None:
        out, query, key_cache, value_cache = layer
        nd, num_seqs = meta.num_decode_seqs, len(meta.seq_lens_list)
        block_tables = meta.block_tables.to(torch.int32).contiguous()
        seq_lens = meta.seq_lens.to(torch.int32).contiguous()
        launches: list[kernels.Launch] = []
        if nd:
            launches += kernels.decode(out[:nd], query[:nd], key_cache, value_cache,
                                       block_tables[:nd], seq_lens[:nd],
                                       max(meta.seq_lens_list[:nd]), scale)
        by_sdpa = self.prompts_by_sdpa
        if by_sdpa is None:
            by_sdpa = query.device.type == "cuda"
        step.sdpa_rows = None
        prefills: Sequence[int] = range(nd, num_seqs)
        if by_sdpa and have_kv and nd < num_seqs:
            plan = meta.prefills()
            step.sdpa_rows, prefills = plan.fresh_rows, plan.chunks
        query_start_loc = meta.query_start_loc.to(torch.int32).contiguous()
        q_lens = meta.query_lens_list
        for first, count in _runs(prefills):  # one launch per run of consecutive sequences
            launches += kernels.prefill(out, query, key_cache, value_cache, block_tables,
                                        seq_lens, query_start_loc, first, count,
                                        max(q_lens[first:first + count]), scale)
        step.attend = LayerLaunches(launches, layer, self._launcher(query.device))
        step.scale = scale

    def _launcher(self, device: torch.device) -> kernels.Launcher:
        if self.launcher is None:
            self.launcher = kernels.CupyLauncher(device)
        return self.launcher


def swap_blocks(src_cache: torch.Tensor, dst_cache: torch.Tensor,
                src_ids: Sequence[int] | torch.Tensor, dst_ids: Sequence[int] | torch.Tensor,
                launcher: kernels.Launcher | None = None,
                wait: bool = True) -> torch.cuda.Event | None:
    """dst_cache[:, :, dst_ids[i]] = src_cache[:, :, src_ids[i]] for every layer, K and V, in one
    launch.

    One cache is on the GPU, the other in pinned host memory (swap out: device -> host; swap in:
    host -> device). The copy runs on a side stream after the work already queued on the current
    stream; the returned event marks its end, and with wait=True the current stream waits for it,
    so the step's forward pass sees the moved blocks while the host never blocks. With two CPU
    caches (the CPU shim) the copy simply runs, and None is returned.
    """
    device = next((c.device for c in (src_cache, dst_cache) if c.device.type == "cuda"), None)
    if device is None:
        pairs = _pairs(src_ids, dst_ids, src_cache.device)
        kernels.run_launches(kernels.copy_blocks(src_cache, dst_cache, pairs), launcher)
        return None
    pairs = _pairs(src_ids, dst_ids, device)
    current = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(current)  # blocks written by earlier steps are final before they move
    with torch.cuda.stream(side):
        kernels.run_launches(kernels.copy_blocks(src_cache, dst_cache, pairs), launcher)
        done = torch.cuda.Event()
        done.record(side)
    pairs.record_stream(side)  # allocated on the current stream, read on the side stream
    if wait:
        current.wait_event(done)
    return done


def _runs(seqs: Sequence[int]) -> list[tuple[int, int]]:
    """(first, count) of each run of consecutive sequence indices."""
    runs: list[tuple[int, int]] = []
    for i in seqs:
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[tokens, heads, head_size] with contiguous heads and 16-byte aligned rows."""
    row_stride, head_stride, element_stride = t.stride()
    if element_stride == 1 and head_stride == t.size(2) and (
            t.data_ptr() | row_stride * t.element_size()) % 16 == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _pairs(src: Sequence[int] | torch.Tensor, dst: Sequence[int] | torch.Tensor,
           device: torch.device) -> torch.Tensor:
    s = torch.as_tensor(src, dtype=torch.int64)
    d = torch.as_tensor(dst, dtype=torch.int64)
    if s.shape != d.shape or s.dim() != 1:
        raise ValueError(f"src and dst block ids must be two 1-d lists of one length, got "
                         f"{tuple(s.shape)} and {tuple(d.shape)}")
    pairs = torch.stack([s, d], dim=1)
    if pairs.device.type == "cpu" and device.type == "cuda":  # (no host sync: pinned, async)
        return pairs.pin_memory().to(device, non_blocking=True)
    return pairs.to(device)
