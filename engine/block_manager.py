"""BlockManager: ref-counted physical KV blocks on the device and in host swap space.

Each sequence owns a block table (its logical blocks -> physical block ids). Sequences of one
request share blocks after a fork (ref count > 1); the first write into a shared block copies it
(copy-on-write). Swapping moves a whole group between pools, copying each shared block once so the
sharing survives the round trip. With prefix caching (engine/prefix_cache.py) a new sequence
starts from the cached blocks its prompt begins with, and each full prompt block joins the cache
once its tokens are computed. Pure Python: no torch.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

from engine.block_allocator import BlockAllocator
from engine.prefix_cache import CachingAllocator
from engine.sequence import Sequence, SequenceGroup

_NO_HASHES: dict[int, bytes] = {}  # (block -> hash without a prefix cache: never written)


class AllocStatus(enum.Enum):
    OK = "ok"  # fits now
    LATER = "later"  # fits once others free blocks
    NEVER = "never"  # larger than the whole pool


class BlockManager:
    def __init__(self, num_device_blocks: int, num_host_blocks: int, block_size: int,
                 watermark: float = 0.01, enable_prefix_caching: bool = False) -> None:
        self.block_size = block_size
        self.watermark_blocks = int(watermark * num_device_blocks)
        self._sizes = (num_device_blocks, num_host_blocks, enable_prefix_caching)
        self.reset()

    def reset(self) -> None:
        """Every block free, no table, an empty prefix cache."""
        num_device_blocks, num_host_blocks, enable_prefix_caching = self._sizes
        self.cache: CachingAllocator | None = None
        if enable_prefix_caching:
            self.cache = CachingAllocator(num_device_blocks, self.block_size)
        self.device: BlockAllocator = self.cache or BlockAllocator(num_device_blocks)
        self.host = BlockAllocator(num_host_blocks)
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
        """Blocks the group's tables take, cached ones included."""
        return sum(self.blocks_for(s.num_tokens) for s in group.live_seqs())

    def prefix_hits(self, group: SequenceGroup) -> list[list[int]] | None:
        """Per live sequence, the cached blocks its prompt starts with; None without caching."""
        if self.cache is None:
            return None
        return self.cache.hits(group.live_seqs(), self.num_total_blocks - self.watermark_blocks)

    def cached_tokens(self, group: SequenceGroup, hits: list[list[int]] | None) -> list[int]:
        """Per live sequence, the tokens `hits` hold: all but the last token at most (its logits
        are needed, so a wholly cached prompt still runs one token)."""
        if hits is None:
            return [0] * len(group.live_seqs())
        return [min(len(h) * self.block_size, s.num_tokens - 1)
                for s, h in zip(group.live_seqs(), hits)]

    def can_allocate(self, group: SequenceGroup,
                     hits: list[list[int]] | None = None) -> AllocStatus:
        resumed = group.num_preemptions > 0
        if not hits or not any(hits):
            return self.fit(self.blocks_to_allocate(group), resumed)
        keep = 0 if resumed else self.watermark_blocks
        if self.blocks_to_allocate(group) > self.num_total_blocks - keep:
            return AllocStatus.NEVER  # (as without the cache: it may be evicted)
        assert self.cache is not None  # (hits come from it)
        needed = self.cache.blocks_needed(group.live_seqs(), hits)
        if self.device.num_free - needed >= keep:
            return AllocStatus.OK
        return AllocStatus.LATER

    def allocate(self, group: SequenceGroup, hits: list[list[int]] | None = None) -> int:
        """Tables for the group's live sequences, starting from the cached blocks `hits` (whose
        tokens then count as computed); returns the number of cached tokens."""
        seqs = group.live_seqs()
        if self.cache is None:
            for seq in seqs:
                self.tables[seq.seq_id] = self.device.allocate_many(
                    self.blocks_for(seq.num_tokens))
            return 0
        hits = hits or [[] for _ in seqs]
        for blocks in hits:  # hits first: no fresh allocation may evict them
            for block in blocks:
                self.cache.take(block)
        cached = self.cached_tokens(group, hits)
        for seq, blocks, num_cached in zip(seqs, hits, cached):
            fresh = self.device.allocate_many(self.blocks_for(seq.num_tokens) - len(blocks))
            self.tables[seq.seq_id] = blocks + fresh
            seq.num_computed_tokens = num_cached
            self.cache.start_filling(seq, num_cached // self.block_size)
        return sum(cached)

    def fit(self, needed: int, resumed: bool = False) -> AllocStatus:
        """Whether `needed` fresh device blocks fit: now, later, or never (the watermark kept).
        A `resumed` group (preempted: it ran in these blocks, and a running group may grow
        into the watermark) is judged against the whole cache, or it could end for lack of
        room it had."""
        keep = 0 if resumed else self.watermark_blocks
        if needed > self.num_total_blocks - keep:
            return AllocStatus.NEVER
        if self.device.num_free - needed >= keep:
            return AllocStatus.OK
        return AllocStatus.LATER

    # -- growth ----------------------------------------------------------------------------------
    def blocks_to_append(self, seq: Sequence, num_new_tokens: int) -> int:
        """New blocks (appended or copied on write) that running `num_new_tokens` needs."""
        table = self.tables[seq.seq_id]
        end = seq.num_computed_tokens + num_new_tokens
        needed = max(0, self.blocks_for(end) - len(table))
        first = seq.num_computed_tokens // self.block_size
        cached = self.cache.hash_of if self.cache is not None else _NO_HASHES
        for i in range(first, min(len(table), self.blocks_for(end))):
            if self.device.ref_counts[table[i]] > 1 or table[i] in cached:
                needed += 1
        return needed

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]]:
        """Make room for the next tokens; returns copy-on-write (src, dst) pairs to run first."""
        table = self.tables[seq.seq_id]
        end = seq.num_computed_tokens + num_new_tokens
        copies = []
        first = seq.num_computed_tokens // self.block_size
        # Shared blocks are copied on write, and so are cached ones (a wholly cached prompt's
        # last block): a cached block's contents never change.
        cached = self.cache.hash_of if self.cache is not None else _NO_HASHES
        for i in range(first, min(len(table), self.blocks_for(end))):
            old = table[i]
            if self.device.ref_counts[old] > 1 or old in cached:
                table[i] = self.device.allocate()
                self.device.decref(old)
                copies.append((old, table[i]))
        while len(table) < self.blocks_for(end):
            table.append(self.device.allocate())
        return copies

    def trim(self, seq: Sequence) -> None:
        """Give back the blocks past those `seq`'s computed tokens fill (the slots of
        speculative tokens that were rejected): its table is then what plain decoding holds."""
        table = self.tables[seq.seq_id]
        keep = self.blocks_for(seq.num_computed_tokens)
        if len(table) > keep:
            self.device.decref_all(reversed(table[keep:]))
            del table[keep:]

    def num_group_blocks(self, group: SequenceGroup) -> int:
        """Distinct device blocks the group holds (shared blocks once)."""
        return len({b for s in group.live_seqs() for b in self.tables.get(s.seq_id, ())})

    # -- forks and frees -------------------------------------------------------------------------
    def fork(self, parent: Sequence, child: Sequence) -> None:
        table = list(self.tables[parent.seq_id])
        for block in table:
            self.device.incref(block)
        self.tables[child.seq_id] = table
        if self.cache is not None:
            self.cache.fork(parent, child)

    def free(self, seq: Sequence) -> None:
        if self.cache is not None:  # cache what it computed, and forget its prompt
            self.cache.stop_filling(seq, self.tables.get(seq.seq_id), forget=True)
        # Last block first: the free stack then hands the run back in ascending order, so the
        # next prompt's blocks are contiguous in memory (the CPU decode kernel streams them).
        # (Cached blocks become evictable in that order too: a prompt's tail is evicted first.)
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
        """Move the group's blocks to host swap space; returns (device, host) pairs to copy.
        Cached device blocks stay cached (evictable) after the copy."""
        if self.cache is not None:
            for seq in group.live_seqs():
                self.cache.stop_filling(seq, self.tables.get(seq.seq_id))
        return self._move(group, self.tables, self.host_tables, self.device, self.host)

    def can_swap_in(self, group: SequenceGroup) -> AllocStatus:
        """Whether the group's blocks, and what the step after the swap-in appends, fit."""
        seqs = group.live_seqs()
        held = {b for s in seqs for b in self.host_tables.get(s.seq_id, ())}
        # What each sequence computes next (its next token; all of a prompt it was still
        # filling) needs: fresh blocks past its table, a copy of each shared one it writes
        # into (copy-on-write); exactly what blocks_to_append counts once it runs, so a group
        # that fits the cache is never judged NEVER.
        grow = 0
        for s in seqs:
            table = self.host_tables.get(s.seq_id, [])
            end = self.blocks_for(max(s.num_tokens, s.num_computed_tokens + 1))
            grow += max(0, end - len(table))
            for i in range(s.num_computed_tokens // self.block_size, min(len(table), end)):
                if self.host.ref_counts[table[i]] > 1:
                    grow += 1
        return self.fit(len(held) + grow, resumed=True)

    def swap_in(self, group: SequenceGroup) -> list[tuple[int, int]]:
        """Move the group's blocks back to the device; returns (host, device) pairs to copy.
        The copies are fresh blocks; their full prompt blocks join the cache where it does not
        hold those hashes already."""
        pairs = self._move(group, self.host_tables, self.tables, self.host, self.device)
        if self.cache is not None:
            for seq in group.live_seqs():
                self.cache.start_filling(seq, 0)
        return pairs

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

    # -- the prefix cache ------------------------------------------------------------------------
    def cache_computed(self) -> None:
        """Cache the full prompt blocks computed since the last call: the scheduler calls it at
        the start of each step, when the previous step's keys and values are written."""
        if self.cache is not None:
            self.cache.cache_computed(self.tables)

    @property
    def num_cached_blocks(self) -> int:
        return self.cache.num_cached if self.cache is not None else 0

    @property
    def num_evictable_blocks(self) -> int:
        return len(self.cache.evictable) if self.cache is not None else 0

    # -- invariants (tests) ----------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Ref counts equal the tables holding each block; free + used == total, per pool.
        With prefix caching: the cache's own invariants, and a cached block at position i of a
        table holds that sequence's prompt block i."""
        if self.cache is not None:
            self.cache.check_invariants(self.tables)
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
