"""ModelRunner: a SchedulerOutput's sequences -> flat model inputs -> logits of sampling rows.

Inputs are built per sequence, never per token in Python: token slices, and position and slot
ranges (one per block) that C-level iteration expands. Every step's inputs are host lists turned
into one int64 and one int32 tensor; a step of decodes only (one token per sequence) needs no
ranges at all. On CUDA they go up from pinned memory without blocking the host, so the host
queues the whole forward pass and the step's one sync is the sampler reading the sampled ids.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from itertools import accumulate, chain

import torch
from torch import nn

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.block_manager import BlockManager
from engine.models.layers import ForwardContext
from engine.scheduler_output import ScheduledSeq


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
        """Run `batch` (already ordered) and return logits [num_sampling_rows, vocab] in batch
        order of the sequences that sample: one row each, 1 + k for one speculating k tokens."""
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
        block_tables = self.block_manager.tables
        tables = [block_tables[s.seq.seq_id] for s in batch]
        width = max(map(len, tables))
        pad = [0] * width
        flat_tables = list(chain.from_iterable(
            t if len(t) == width else t + pad[len(t):] for t in tables))
        if all(s.num_new_tokens == 1 for s in batch):
            return self._prepare_decodes(batch, starts, tables, flat_tables, width)
        if all(s.num_new_tokens == 1 or s.spec_token_ids for s in batch):
            return self._prepare_speculated(batch, starts, tables, pad, width)
        bs = self.block_size
        q_lens = [s.num_new_tokens for s in batch]
        seq_lens = [a + b for a, b in zip(starts, q_lens)]
        num_decode = next((i for i, q in enumerate(q_lens) if q != 1), len(q_lens))
        # Per sequence, never per token: token slices, and position and slot ranges.
        tokens = list(chain.from_iterable(
            s.seq.token_ids[a:b] if s.spec_token_ids is None else s.seq.token_ids[a:]
            + s.spec_token_ids for s, a, b in zip(batch, starts, seq_lens)))
        positions = list(chain.from_iterable(map(range, starts, seq_lens)))
        slots = list(chain.from_iterable(
            _slots(t, a, b, bs) for t, a, b in zip(tables, starts, seq_lens)))
        cu_q = list(accumulate(q_lens, initial=0))
        n, num_tokens = len(batch), cu_q[-1]
        # A speculated sequence samples at each of its positions (last token, proposals).
        sample_rows = [c - 1 for c, s in zip(cu_q[1:], batch) if s.do_sample] \
            if not any(s.spec_token_ids for s in batch) else list(chain.from_iterable(
                range(c - q, c) if s.spec_token_ids else (c - 1,)
                for c, q, s in zip(cu_q[1:], q_lens, batch) if s.do_sample))
        longs = self._upload(_int_tensor(tokens + positions + slots + sample_rows, torch.int64))
        ints = self._upload(_int_tensor(cu_q + seq_lens + flat_tables, torch.int32))
        input_ids, positions_t, slot_mapping = longs[:3 * num_tokens].view(3, num_tokens)
        meta = AttentionMetadata(
            slot_mapping=slot_mapping, query_start_loc=ints[:n + 1],
            seq_lens=ints[n + 1:2 * n + 1], block_tables=ints[2 * n + 1:].view(n, width),
            max_query_len=max(q_lens), max_seq_len=max(seq_lens), num_decode_seqs=num_decode,
            seq_lens_list=seq_lens, query_lens_list=q_lens)
        return input_ids, positions_t, meta, longs[3 * num_tokens:]

    def _prepare_decodes(self, batch: list[ScheduledSeq], starts: list[int],
                         tables: list[list[int]], flat_tables: list[int],
                         width: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata,
                                              torch.Tensor | None]:
        """One query per sequence, at position `start` (its number of computed tokens)."""
        bs = self.block_size
        tokens = [s.seq.token_ids[p] for s, p in zip(batch, starts)]
        slots = [t[p // bs] * bs + p % bs for t, p in zip(tables, starts)]
        rows = [i for i, s in enumerate(batch) if s.do_sample]
        return self._decode_rows(tokens, starts, slots, flat_tables, width, rows)

    def _prepare_speculated(self, batch: list[ScheduledSeq], starts: list[int],
                            tables: list[list[int]], pad: list[int],
                            width: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata,
                                                 torch.Tensor | None]:
        """Decodes and speculated sequences only: each query token of a speculated sequence
        (its last token, then its proposals) is a decode row of its own, at its position, with
        the sequence's block table and the context up to it (the decode kernels then serve
        the whole step; a row's keys and values are written before any row attends)."""
        bs = self.block_size
        tokens: list[int] = []
        positions: list[int] = []
        rows: list[int] = []  # per query row, its sequence's index in the batch
        sample_rows: list[int] = []
        for i, (s, p) in enumerate(zip(batch, starts)):
            q = s.num_new_tokens
            if s.do_sample:
                sample_rows.extend(range(len(tokens), len(tokens) + q))
            tokens.append(s.seq.token_ids[p])
            if s.spec_token_ids:
                tokens.extend(s.spec_token_ids)
            positions.extend(range(p, p + q))
            rows.extend([i] * q)
        slots = [tables[i][p // bs] * bs + p % bs for i, p in zip(rows, positions)]
        padded = [t if len(t) == width else t + pad[len(t):] for t in tables]
        flat_tables = list(chain.from_iterable(padded[i] for i in rows))
        return self._decode_rows(tokens, positions, slots, flat_tables, width, sample_rows)

    def _decode_rows(self, tokens: list[int], positions: list[int], slots: list[int],
                     flat_tables: list[int], width: int, sample_rows: list[int]
                     ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata,
                                torch.Tensor | None]:
        """The inputs of a step of one-token query rows (row i: tokens[i] at positions[i],
        its keys and values to slots[i], its table flat_tables[i * width:]); `sample_rows`:
        the rows that sample."""
        n = len(tokens)
        seq_lens = [p + 1 for p in positions]
        longs = self._upload(_int_tensor(tokens + positions + slots, torch.int64))
        ints = self._upload(_int_tensor(list(range(n + 1)) + seq_lens + flat_tables, torch.int32))
        input_ids, positions_t, slot_mapping = longs.view(3, n)
        meta = AttentionMetadata(
            slot_mapping=slot_mapping, query_start_loc=ints[:n + 1],
            seq_lens=ints[n + 1:2 * n + 1], block_tables=ints[2 * n + 1:].view(n, width),
            max_query_len=1, max_seq_len=max(seq_lens), num_decode_seqs=n,
            seq_lens_list=seq_lens, query_lens_list=[1] * n)
        if len(sample_rows) == n:
            return input_ids, positions_t, meta, None
        return input_ids, positions_t, meta, self._upload(_int_tensor(sample_rows, torch.int64))

    def _upload(self, host: torch.Tensor) -> torch.Tensor:
        """A step input on the model's device: on CUDA a non-blocking copy from pinned memory
        (the caching host allocator reuses the pinned block only after the copy has run)."""
        if self.device.type != "cuda":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)


def _slots(table: list[int], start: int, end: int, block_size: int) -> Iterable[int]:
    """Cache slots of positions start..end-1 of a sequence with block table `table`: one range
    per block."""
    first, last = start // block_size, (end - 1) // block_size
    if first == last:
        base = (table[first] - first) * block_size
        return range(base + start, base + end)
    return chain.from_iterable(
        range((table[j] - j) * block_size + max(start, j * block_size),
              (table[j] - j) * block_size + min(end, (j + 1) * block_size))
        for j in range(first, last + 1))


_TYPECODES = {torch.int64: "q", torch.int32: "i"}


def _int_tensor(values: list[int], dtype: torch.dtype) -> torch.Tensor:
    """torch.tensor(values, dtype=dtype) through array's C conversion, one C loop over the
    thousands of ints of a step's block tables rather than a conversion per Python int."""
    if not values:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(array(_TYPECODES[dtype], values), dtype=dtype)
