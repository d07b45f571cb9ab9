"""ModelRunner: a SchedulerOutput's sequences -> flat model inputs -> logits of sampling rows.

Inputs are built per sequence (slicing token lists), never per token: positions and slot
mappings come from tensor arithmetic over the whole batch.
"""

from __future__ import annotations

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
        return self.model.compute_logits(hidden[sample_rows]).float()  # type: ignore[operator]

    def _prepare(self, batch: list[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor,
                                                           AttentionMetadata, torch.Tensor]:
        starts = [s.seq.num_computed_tokens for s in batch]
        q_lens = [s.num_new_tokens for s in batch]
        seq_lens = [a + b for a, b in zip(starts, q_lens)]
        tokens = list(chain.from_iterable(
            s.seq.token_ids[a:b] for s, a, b in zip(batch, starts, seq_lens)))
        input_ids = torch.tensor(tokens, dtype=torch.int64)
        q_lens_t = torch.tensor(q_lens, dtype=torch.int64)
        cu_q = torch.zeros(len(batch) + 1, dtype=torch.int64)
        torch.cumsum(q_lens_t, 0, out=cu_q[1:])
        seq_index = torch.repeat_interleave(torch.arange(len(batch)), q_lens_t)
        positions = torch.tensor(starts, dtype=torch.int64)[seq_index] + \
            torch.arange(len(tokens)) - cu_q[:-1][seq_index]
        tables = [self.block_manager.table(s.seq) for s in batch]
        width = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)
        slots = block_tables[seq_index, positions // self.block_size] * self.block_size + \
            positions % self.block_size
        sample_rows = (cu_q[1:] - 1)[torch.tensor([s.do_sample for s in batch])]
        num_decode = next((i for i, q in enumerate(q_lens) if q != 1), len(q_lens))
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=slots.to(dev), query_start_loc=cu_q.to(torch.int32).to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=block_tables.to(torch.int32).to(dev), max_query_len=max(q_lens),
            max_seq_len=max(seq_lens), num_decode_seqs=num_decode, seq_lens_list=seq_lens,
            query_lens_list=q_lens)
        return input_ids.to(dev), positions.to(dev), meta, sample_rows.to(dev)
