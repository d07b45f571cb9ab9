"""ModelRunner: a SchedulerOutput's sequences -> flat model inputs -> logits of sampling rows.

Inputs are built per sequence (slicing token lists), never per token: positions and slot
mappings come from tensor arithmetic over the whole batch. A step of decodes only (one token per
sequence) needs no per-token arithmetic at all: its inputs are per-sequence host lists, turned
into one int64 and one int32 tensor.
"""

from __future__ import annotations

from array import array
from itertools import chain

import torch
from torch import nn

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.block_manager import BlockManager
from engine.models.layers import ForwardContext
from engine.scheduler import ScheduledSeq


class ModelRunner:
    def __init__(self, model: nn.Module, backend: AttentionBackend, block_manager: BlockManager,
                 device: torch.device) -> None:
        self.model = model
        self.backend = backend
        self.block_manager = block_manager
        self.device = device
        self.block_size = block_manager.block_size

    def order(self, scheduled: list[ScheduledSeq]) -> list[ScheduledSeq]:
        """Decodes first, shortest context first (the attention backend buckets them)."""
        decodes = [s for s in scheduled if s.num_new_tokens == 1]
        decodes.sort(key=lambda s: s.seq.num_tokens)
        return decodes + [s for s in scheduled if s.num_new_tokens != 1]

    @torch.inference_mode()
    def execute(self, batch: list[ScheduledSeq], kv_cache: torch.Tensor) -> torch.Tensor:
        """Run `batch` (already ordered) and return logits [num_sampling_seqs, vocab] in batch
        order of the sequences that sample."""
        input_ids, positions, meta, sample_rows = self._prepare(batch)
        ctx = ForwardContext(self.backend, meta, kv_cache)
        hidden = self.model(input_ids, positions, ctx)
        if sample_rows is not None:
            hidden = hidden[sample_rows]
        return self.model.compute_logits(hidden).float()  # type: ignore[operator]

    def _prepare(self, batch: list[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor,
                                                           AttentionMetadata, torch.Tensor | None]:
        """Model inputs, attention metadata and the rows that sample (None: every row, in
        order)."""
        starts = [s.seq.num_computed_tokens for s in batch]
        tables = [self.block_manager.table(s.seq) for s in batch]
        width = max(map(len, tables))
        pad = [0] * width
        flat_tables = list(chain.from_iterable(
            t if len(t) == width else t + pad[len(t):] for t in tables))
        if all(s.num_new_tokens == 1 for s in batch):
            return self._prepare_decodes(batch, starts, tables, flat_tables, width)
        q_lens = [s.num_new_tokens for s in batch]
        seq_lens = [a + b for a, b in zip(starts, q_lens)]
        num_decode = next((i for i, q in enumerate(q_lens) if q != 1), len(q_lens))
        tokens = list(chain.from_iterable(
            s.seq.token_ids[a:b] for s, a, b in zip(batch, starts, seq_lens)))
        input_ids = _int_tensor(tokens, torch.int64)
        q_lens_t = torch.tensor(q_lens, dtype=torch.int64)
        cu_q = torch.zeros(len(batch) + 1, dtype=torch.int64)
        torch.cumsum(q_lens_t, 0, out=cu_q[1:])
        seq_index = torch.repeat_interleave(torch.arange(len(batch)), q_lens_t)
        positions = torch.tensor(starts, dtype=torch.int64)[seq_index] + \
            torch.arange(len(tokens)) - cu_q[:-1][seq_index]
        block_tables = _int_tensor(flat_tables, torch.int32).view(len(batch), width)
        slots = block_tables[seq_index, positions // self.block_size].long() * self.block_size + \
            positions % self.block_size
        sample_rows = (cu_q[1:] - 1)[torch.tensor([s.do_sample for s in batch])]
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=slots.to(dev), query_start_loc=cu_q.to(torch.int32).to(dev),
            seq_lens=_int_tensor(seq_lens, torch.int32).to(dev),
            block_tables=block_tables.to(dev), max_query_len=max(q_lens),
            max_seq_len=max(seq_lens), num_decode_seqs=num_decode, seq_lens_list=seq_lens,
            query_lens_list=q_lens)
        return input_ids.to(dev), positions.to(dev), meta, sample_rows.to(dev)

    def _prepare_decodes(self, batch: list[ScheduledSeq], starts: list[int],
                         tables: list[list[int]], flat_tables: list[int],
                         width: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata,
                                              torch.Tensor | None]:
        """One query per sequence, at position `start` (its number of computed tokens)."""
        n, bs = len(batch), self.block_size
        tokens = [s.seq.token_ids[p] for s, p in zip(batch, starts)]
        slots = [t[p // bs] * bs + p % bs for t, p in zip(tables, starts)]
        seq_lens = [p + 1 for p in starts]
        longs = _int_tensor(tokens + starts + slots, torch.int64).to(self.device)
        ints = _int_tensor(list(range(n + 1)) + seq_lens + flat_tables,
                           torch.int32).to(self.device)
        input_ids, positions, slot_mapping = longs.view(3, n)
        meta = AttentionMetadata(
            slot_mapping=slot_mapping, query_start_loc=ints[:n + 1],
            seq_lens=ints[n + 1:2 * n + 1], block_tables=ints[2 * n + 1:].view(n, width),
            max_query_len=1, max_seq_len=max(seq_lens), num_decode_seqs=n,
            seq_lens_list=seq_lens, query_lens_list=[1] * n)
        if all(s.do_sample for s in batch):
            return input_ids, positions, meta, None
        rows = [i for i, s in enumerate(batch) if s.do_sample]
        return input_ids, positions, meta, torch.tensor(rows, dtype=torch.int64,
                                                        device=self.device)


_TYPECODES = {torch.int64: "q", torch.int32: "i"}


def _int_tensor(values: list[int], dtype: torch.dtype) -> torch.Tensor:
    """torch.tensor(values, dtype=dtype) through array's C conversion: several times faster for
    the thousands of ints of a step's block tables."""
    if not values:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(array(_TYPECODES[dtype], values), dtype=dtype)
