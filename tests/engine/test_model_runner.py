"""ModelRunner inputs: what each token's row must hold, checked against a per-token reference."""

from __future__ import annotations

import random

import torch

from engine.block_manager import BlockManager
from engine.model_runner import ModelRunner
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledSeq
from engine.sequence import Sequence, SequenceGroup


def test_mixed_batch_inputs_hold_each_tokens_id_position_and_slot():
    rng = random.Random(0)
    for block_size in (1, 4, 16):
        bm = BlockManager(512, 0, block_size, 0.0)
        batch = []
        for i in range(12):
            num_tokens = rng.randint(1, 40)
            seq = Sequence(i, 0, [rng.randrange(400) for _ in range(num_tokens)], num_tokens)
            group = SequenceGroup(f"r{i}", SamplingParams(), [seq], seed=0)
            bm.allocate(group)
            seq.num_computed_tokens = rng.randint(0, num_tokens - 1)
            take = 1 if i < 4 else rng.randint(1, num_tokens - seq.num_computed_tokens)
            batch.append(ScheduledSeq(group, seq, take, rng.random() < 0.7))
        input_ids, positions, meta, sample_rows = \
            ModelRunner(torch.nn.Identity(), None, bm, torch.device("cpu"))._prepare(batch)
        ids, pos, slots, rows = [], [], [], []
        for item in batch:  # the reference: one token at a time
            table = bm.table(item.seq)
            for p in range(item.seq.num_computed_tokens,
                           item.seq.num_computed_tokens + item.num_new_tokens):
                ids.append(item.seq.token_ids[p])
                pos.append(p)
                slots.append(table[p // block_size] * block_size + p % block_size)
            if item.do_sample:
                rows.append(len(ids) - 1)
        assert input_ids.tolist() == ids and input_ids.dtype == torch.int64
        assert positions.tolist() == pos and positions.dtype == torch.int64
        assert meta.slot_mapping.tolist() == slots and meta.slot_mapping.dtype == torch.int64
        assert sample_rows is not None and sample_rows.tolist() == rows
        assert meta.num_decode_seqs == next(i for i, s in enumerate(batch) if s.num_new_tokens > 1)
        assert meta.query_start_loc.tolist()[-1] == len(ids)
        assert meta.seq_lens_list == [s.seq.num_computed_tokens + s.num_new_tokens for s in batch]
        assert meta.block_tables[5, : len(bm.table(batch[5].seq))].tolist() == \
            bm.table(batch[5].seq)
