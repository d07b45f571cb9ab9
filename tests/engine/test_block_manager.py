"""BlockManager invariants: ref counts, copy-on-write, swapping shared blocks once."""

from __future__ import annotations

import pytest

from engine.block_manager import AllocStatus, BlockManager
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence, SequenceGroup


def group(num_tokens: int, best_of: int = 1, seq_id: int = 0) -> SequenceGroup:
    seq = Sequence(seq_id, 0, list(range(num_tokens)), num_tokens)
    return SequenceGroup(f"r{seq_id}", SamplingParams(n=best_of), [seq], seed=0)


def test_allocate_reports_ok_later_never():
    bm = BlockManager(10, 4, block_size=4, watermark=0.0)
    assert bm.can_allocate(group(41)) is AllocStatus.NEVER  # 11 blocks > 10
    g = group(33, seq_id=1)  # 9 blocks
    assert bm.can_allocate(g) is AllocStatus.OK
    bm.allocate(g)
    assert bm.num_free_blocks == 1
    assert bm.can_allocate(group(8, seq_id=2)) is AllocStatus.LATER
    bm.free_group(g)
    assert bm.num_free_blocks == 10
    bm.check_invariants()


def test_freed_blocks_come_back_in_ascending_runs():
    # A prompt's blocks are handed out contiguous and ascending, also when they are reused.
    bm = BlockManager(12, 0, block_size=4, watermark=0.0)
    a, b = group(16, seq_id=1), group(12, seq_id=2)
    bm.allocate(a)
    bm.allocate(b)
    assert bm.table(a.seqs[0]) == [0, 1, 2, 3] and bm.table(b.seqs[0]) == [4, 5, 6]
    bm.free_group(a)
    c = group(16, seq_id=3)
    bm.allocate(c)
    assert bm.table(c.seqs[0]) == [0, 1, 2, 3]
    bm.check_invariants()


def test_watermark_keeps_blocks_back_from_admission():
    bm = BlockManager(100, 0, block_size=4, watermark=0.1)
    assert bm.watermark_blocks == 10
    assert bm.can_allocate(group(4 * 91)) is AllocStatus.NEVER
    assert bm.can_allocate(group(4 * 90)) is AllocStatus.OK


def test_fork_shares_blocks_and_first_append_copies_on_write():
    bm = BlockManager(10, 4, block_size=4, watermark=0.0)
    g = group(6)  # blocks: [full, partial]
    bm.allocate(g)
    parent = g.seqs[0]
    parent.num_computed_tokens = 6
    child = parent.fork(1, 1)
    bm.fork(parent, child)
    assert bm.tables[0] == bm.tables[1] == [0, 1]
    assert bm.device.ref_counts[:2] == [2, 2]
    parent.token_ids.append(7)
    assert bm.blocks_to_append(parent, 1) == 1  # the shared partial block is copied
    copies = bm.append_slots(parent, 1)
    assert copies == [(1, 2)]
    assert bm.tables[0] == [0, 2] and bm.tables[1] == [0, 1]
    assert bm.device.ref_counts[:3] == [2, 1, 1]
    bm.check_invariants()


def test_append_into_a_new_block_allocates_without_copy():
    bm = BlockManager(10, 4, block_size=4, watermark=0.0)
    g = group(4)
    bm.allocate(g)
    seq = g.seqs[0]
    seq.num_computed_tokens = 4
    seq.token_ids.append(9)
    assert bm.append_slots(seq, 1) == []
    assert bm.tables[0] == [0, 1]


def test_swap_round_trip_copies_shared_blocks_once_and_keeps_sharing():
    bm = BlockManager(8, 8, block_size=4, watermark=0.0)
    g = group(6, best_of=2)
    bm.allocate(g)
    parent = g.seqs[0]
    child = parent.fork(1, 1)
    bm.fork(parent, child)
    g.seqs.append(child)
    assert bm.can_swap_out(g)
    out = bm.swap_out(g)
    assert sorted(out) == [(0, 0), (1, 1)]  # two distinct blocks, each copied once
    assert bm.num_free_blocks == 8 and bm.host.ref_counts[:2] == [2, 2]
    assert bm.can_swap_in(g) is AllocStatus.OK
    back = bm.swap_in(g)
    assert len(back) == 2
    assert bm.tables[0] == bm.tables[1]
    bm.check_invariants()
    bm.free_group(g)
    assert bm.num_free_blocks == 8 and bm.host.num_free == 8


def test_swap_out_refused_when_host_space_is_short():
    bm = BlockManager(8, 1, block_size=4, watermark=0.0)
    g = group(6)
    bm.allocate(g)
    assert not bm.can_swap_out(g)


def test_double_free_is_an_error():
    bm = BlockManager(2, 0, block_size=4)
    block = bm.device.allocate()
    bm.device.decref(block)
    with pytest.raises(RuntimeError, match="freed twice"):
        bm.device.decref(block)


def test_allocate_many_hands_out_the_blocks_that_single_allocations_would():
    one, many = BlockManager(16, 0, 4, 0.0).device, BlockManager(16, 0, 4, 0.0).device
    for pool in (one, many):  # a free stack out of order: blocks 2 and 5 come back
        taken = [pool.allocate() for _ in range(8)]
        pool.decref_all([taken[5], taken[2]])
    assert [one.allocate() for _ in range(5)] == many.allocate_many(5) == [2, 5, 8, 9, 10]
    assert one.ref_counts == many.ref_counts
    with pytest.raises(RuntimeError, match="no free block"):
        many.allocate_many(6)  # 5 left
    assert many.num_free == 5
