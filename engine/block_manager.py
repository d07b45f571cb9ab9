"""BlockManager: ref-counted physical KV blocks on the device and in host swap space.

Each sequence owns a block table (its logical blocks -> physical block ids). Sequences of one
request share blocks after a fork (ref count > 1); the first write into a shared block copies it
(copy-on-write). Swapping moves a whole group between pools, copying each shared block once so the
sharing survives the round trip. Pure Python: no torch.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

from engine.sequence import Sequence, SequenceGroup


class AllocStatus(enum.Enum):
    OK = "ok"  # fits now
    LATER = "later"  # fits once others free blocks
    NEVER = "never"  # larger than the whole pool


class BlockAllocator:
    """A pool of physical blocks with reference counts."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("no free block: the scheduler must check capacity first")
        block = self._free.pop()
        self.ref_counts[block] = 1
        return block

    def allocate_many(self, count: int) -> list[int]:
        """`count` blocks, in the order `count` calls of allocate() would hand them out."""
        free = self._free
        if count > len(free):
            raise RuntimeError("no free block: the scheduler must check capacity first")
        cut = len(free) - count
        blocks = free[cut:]
        del free[cut:]
        blocks.reverse()
        ref_counts = self.ref_counts
        for block in blocks:
            ref_counts[block] = 1
        return blocks

    def incref(self, block: int) -> None:
        self.ref_counts[block] += 1

    def decref(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self._free.append(block)
        elif self.ref_counts[block] < 0:
            raise RuntimeError(f"block {block} freed twice")

    def decref_all(self, blocks: Iterable[int]) -> None:
        """decref() of each block, in order."""
        ref_counts, free = self.ref_counts, self._free
        for block in blocks:
            count = ref_counts[block] - 1
            ref_counts[block] = count
            if count == 0:
                free.append(block)
            elif count < 0:
                raise RuntimeError(f"block {block} freed twice")


class BlockManager:
    def __init__(self, num_device_blocks: int, num_host_blocks: int, block_size: int,
                 watermark: float = 0.01) -> None:
        self.block_size = block_size
        self.device = BlockAllocator(num_device_blocks)
        self.host = BlockAllocator(num_host_blocks)
        self.watermark_blocks = int(watermark * num_device_blocks)
        self.tables: dict[int, list[int]] = {}  # seq_id -> device blocks
        self.host_tables: dict[int, list[int]] = {}  # seq_id -> host blocks (swapped out)

    @property
    def num_total_blocks(self) -> int:
        return self.device.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.device.num_free

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- admission -------------------------------------------------------------------------------
    def blocks_to_allocate(self, group: SequenceGroup) -> int:
        return sum(self.blocks_for(s.num_tokens) for s in group.live_seqs())

    def can_allocate(self, group: SequenceGroup) -> AllocStatus:
        return self.fit(self.blocks_to_allocate(group))

    def allocate(self, group: SequenceGroup) -> None:
        for seq in group.live_seqs():
            self.tables[seq.seq_id] = self.device.allocate_many(self.blocks_for(seq.num_tokens))

    def fit(self, needed: int) -> AllocStatus:
        """Whether `needed` fresh device blocks fit: now, later, or never (the watermark kept)."""
        if needed > self.num_total_blocks - self.watermark_blocks:
            return AllocStatus.NEVER
        if self.device.num_free - needed >= self.watermark_blocks:
            return AllocStatus.OK
        return AllocStatus.LATER

    # -- growth ----------------------------------------------------------------------------------
    def blocks_to_append(self, seq: Sequence, num_new_tokens: int) -> int:
        """New blocks (appended or copied on write) that running `num_new_tokens` needs."""
        table = self.tables[seq.seq_id]
        end = seq.num_computed_tokens + num_new_tokens
        needed = max(0, self.blocks_for(end) - len(table))
        first = seq.num_computed_tokens // self.block_size
        for i in range(first, min(len(table), self.blocks_for(end))):
            if self.device.ref_counts[table[i]] > 1:
                needed += 1
        return needed

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]]:
        """Make room for the next tokens; returns copy-on-write (src, dst) pairs to run first."""
        table = self.tables[seq.seq_id]
        end = seq.num_computed_tokens + num_new_tokens
        copies = []
        first = seq.num_computed_tokens // self.block_size
        for i in range(first, min(len(table), self.blocks_for(end))):
            old = table[i]
            if self.device.ref_counts[old] > 1:
                table[i] = self.device.allocate()
                self.device.decref(old)
                copies.append((old, table[i]))
        while len(table) < self.blocks_for(end):
            table.append(self.device.allocate())
        return copies

    def num_group_blocks(self, group: SequenceGroup) -> int:
        """Distinct device blocks the group holds (shared blocks once)."""
        return len({b for s in group.live_seqs() for b in self.tables.get(s.seq_id, ())})

    # -- forks and frees -------------------------------------------------------------------------
    def fork(self, parent: Sequence, child: Sequence) -> None:
        table = list(self.tables[parent.seq_id])
        for block in table:
            self.device.incref(block)
        self.tables[child.seq_id] = table

    def free(self, seq: Sequence) -> None:
        # Last block first: the free stack then hands the run back in ascending order, so the
        # next prompt's blocks are contiguous in memory (the CPU decode kernel streams them).
        table = self.tables.pop(seq.seq_id, None)
        if table:
            self.device.decref_all(reversed(table))
        if self.host_tables:
            table = self.host_tables.pop(seq.seq_id, None)
            if table:
                self.host.decref_all(reversed(table))

    def free_group(self, group: SequenceGroup) -> None:
        for seq in group.seqs:
            self.free(seq)

    # -- swapping --------------------------------------------------------------------------------
    def can_swap_out(self, group: SequenceGroup) -> bool:
        return self.num_group_blocks(group) <= self.host.num_free

    def swap_out(self, group: SequenceGroup) -> list[tuple[int, int]]:
        """Move the group's blocks to host swap space; returns (device, host) pairs to copy."""
        return self._move(group, self.tables, self.host_tables, self.device, self.host)

    def can_swap_in(self, group: SequenceGroup) -> AllocStatus:
        held = {b for s in group.live_seqs() for b in self.host_tables.get(s.seq_id, ())}
        # One spare block per sequence so the step after the swap-in can append.
        return self.fit(len(held) + len(group.live_seqs()))

    def swap_in(self, group: SequenceGroup) -> list[tuple[int, int]]:
        """Move the group's blocks back to the device; returns (host, device) pairs to copy."""
        return self._move(group, self.host_tables, self.tables, self.host, self.device)

    @staticmethod
    def _move(group: SequenceGroup, src_tables: dict[int, list[int]],
              dst_tables: dict[int, list[int]], src: BlockAllocator,
              dst: BlockAllocator) -> list[tuple[int, int]]:
        mapping: dict[int, int] = {}
        for seq in group.live_seqs():
            new_table = []
            for block in src_tables.pop(seq.seq_id):
                if block in mapping:
                    dst.incref(mapping[block])
                else:
                    mapping[block] = dst.allocate()
                new_table.append(mapping[block])
                src.decref(block)
            dst_tables[seq.seq_id] = new_table
        return list(mapping.items())

    # -- invariants (tests) ----------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Ref counts equal the tables holding each block; free + used == total, per pool."""
        for pool, tables in ((self.device, self.tables), (self.host, self.host_tables)):
            expected = [0] * pool.num_blocks
            for table in tables.values():
                for block in table:
                    expected[block] += 1
            if expected != pool.ref_counts:
                raise AssertionError("ref counts differ from the tables that hold the blocks")
            used = sum(1 for c in expected if c > 0)
            if used + pool.num_free != pool.num_blocks:
                raise AssertionError(f"{used} used + {pool.num_free} free != {pool.num_blocks}")

    def table(self, seq: Sequence) -> list[int]:
        return self.tables[seq.seq_id]

    def seq_ids(self) -> Iterable[int]:
        return self.tables.keys()
