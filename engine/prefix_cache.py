"""The prefix cache: device blocks found again by what they hold (vLLM's automatic prefix caching).

A full block of prompt tokens is named by a chained hash: BLAKE2b over its parent block's hash
and its own token ids, so equal hashes mean equal tokens at equal positions under an equal
prefix, hence equal keys and values. A block keeps its contents and its hash when its ref count
drops to 0: it is then evictable, in least-recently-freed order. Allocation takes never-used and
uncached free blocks first, then evicts the least recently used cached block (its hash goes with
it). Evictable blocks count as free everywhere the scheduler counts free blocks.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from hashlib import blake2b

from engine.block_allocator import BlockAllocator
from engine.sequence import Sequence as Seq

ROOT = b"genq-prefix-cache-v1"  # the parent of every sequence's first block


def block_hashes(token_ids: Sequence[int], num_blocks: int, block_size: int) -> list[bytes]:
    """The chained hashes of the first `num_blocks` full blocks of `token_ids`."""
    data = memoryview(array("q", token_ids[:num_blocks * block_size])).cast("B")
    step = block_size * 8
    hashes = []
    parent = ROOT
    for i in range(num_blocks):
        h = blake2b(parent, digest_size=16)
        h.update(data[i * step:(i + 1) * step])
        parent = h.digest()
        hashes.append(parent)
    return hashes


class CachingAllocator(BlockAllocator):
    """A device block pool whose freed blocks stay findable by hash until they are evicted."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks)
        self.block_size = block_size
        self.block_of: dict[bytes, int] = {}  # hash -> block
        self.hash_of: dict[int, bytes] = {}  # block -> hash
        self.evictable: OrderedDict[int, None] = OrderedDict()  # ref count 0, hashed; LRU first
        self.num_evictions = 0
        # Per sequence: its prompt's block hashes; and, for those on the device whose full
        # prompt blocks are not all cached yet, how many are.
        self.hashes: dict[int, list[bytes]] = {}
        self.filling: dict[int, tuple[Seq, int]] = {}

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self.evictable)

    @property
    def num_cached(self) -> int:
        return len(self.hash_of)

    # -- allocation ------------------------------------------------------------------------------
    def allocate(self) -> int:
        if self._free:
            return super().allocate()
        if not self.evictable:
            raise RuntimeError("no free block: the scheduler must check capacity first")
        block = self._evict()
        self.ref_counts[block] = 1
        return block

    def allocate_many(self, count: int) -> list[int]:
        if count > self.num_free:
            raise RuntimeError("no free block: the scheduler must check capacity first")
        fresh = min(count, len(self._free))
        blocks = super().allocate_many(fresh) if fresh else []
        ref_counts = self.ref_counts
        for _ in range(count - fresh):
            block = self._evict()
            ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def _evict(self) -> int:
        block, _ = self.evictable.popitem(last=False)
        del self.block_of[self.hash_of.pop(block)]
        self.num_evictions += 1
        return block

    def decref(self, block: int) -> None:
        count = self.ref_counts[block] - 1
        if count < 0:
            raise RuntimeError(f"block {block} freed twice")
        self.ref_counts[block] = count
        if count == 0:
            if block in self.hash_of:
                self.evictable[block] = None  # most recently used: evicted last
            else:
                self._free.append(block)

    def decref_all(self, blocks: Iterable[int]) -> None:
        for block in blocks:
            self.decref(block)

    # -- the cache -------------------------------------------------------------------------------
    def match(self, hashes: Sequence[bytes]) -> list[int]:
        """The cached blocks of the longest run of `hashes` from the start."""
        blocks = []
        block_of = self.block_of
        for h in hashes:
            block = block_of.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def hits(self, seqs: list[Seq], room: int) -> list[list[int]]:
        """Per sequence, the cached blocks its prompt starts with. A wholly cached prompt writes
        its last token into a copy of its last block; where the `room` of the cache could never
        hold that copy as well, it recomputes the block instead."""
        hits = [self.match(self.prompt_hashes(s)) for s in seqs]
        bs = self.block_size
        whole = [len(h) * bs >= s.num_tokens for s, h in zip(seqs, hits)]
        if sum(-(-s.num_tokens // bs) for s in seqs) + sum(whole) > room:
            hits = [h[:-1] if w else h for h, w in zip(hits, whole)]
        return hits

    def blocks_needed(self, seqs: list[Seq], hits: list[list[int]]) -> int:
        """Free blocks admitting `seqs` with `hits` takes: fresh ones, the evictable ones it
        hits (once each), and for a wholly cached prompt the copy of its last block that its
        last token goes into (a cached block is never written)."""
        needed, bs, ref_counts = 0, self.block_size, self.ref_counts
        evictable: set[int] = set()
        for seq, blocks in zip(seqs, hits):
            needed += -(-seq.num_tokens // bs) - len(blocks)
            needed += len(blocks) * bs >= seq.num_tokens
            evictable.update(b for b in blocks if ref_counts[b] == 0)
        return needed + len(evictable)

    def take(self, block: int) -> None:
        """One more holder of a cached block (a hit): an evictable one is in use again."""
        if self.ref_counts[block] == 0:
            del self.evictable[block]
        self.ref_counts[block] += 1

    def insert(self, block: int, block_hash: bytes) -> None:
        """Cache a held block whose tokens are all computed. A hash already cached elsewhere
        keeps its block (this one stays uncached)."""
        if block_hash not in self.block_of and block not in self.hash_of:
            self.block_of[block_hash] = block
            self.hash_of[block] = block_hash

    # -- sequences -------------------------------------------------------------------------------
    def prompt_hashes(self, seq: Seq) -> list[bytes]:
        hashes = self.hashes.get(seq.seq_id)
        if hashes is None:
            bs = self.block_size
            hashes = block_hashes(seq.token_ids, seq.num_prompt_tokens // bs, bs)
            self.hashes[seq.seq_id] = hashes
        return hashes

    def has_hit(self, seq: Seq) -> bool:
        """Whether `seq`'s prompt starts with a cached block."""
        hashes = self.prompt_hashes(seq)
        return bool(hashes) and hashes[0] in self.block_of

    def fork(self, parent: Seq, child: Seq) -> None:
        if parent.seq_id in self.hashes:  # (the same prompt)
            self.hashes[child.seq_id] = self.hashes[parent.seq_id]

    def start_filling(self, seq: Seq, num_cached_blocks: int) -> None:
        """`seq`'s table holds its first `num_cached_blocks` prompt blocks cached: cache the
        others as they are computed."""
        if num_cached_blocks < seq.num_prompt_tokens // self.block_size:
            self.prompt_hashes(seq)
            self.filling[seq.seq_id] = (seq, num_cached_blocks)

    def stop_filling(self, seq: Seq, table: list[int] | None, forget: bool = False) -> None:
        """Cache what `seq` computed, before its blocks leave the device (`forget`: and its
        hashes, when it is freed)."""
        entry = self.filling.pop(seq.seq_id, None)
        if entry is not None and table is not None:
            self._cache_blocks(seq, table, entry[1])
        if forget:
            self.hashes.pop(seq.seq_id, None)

    def cache_computed(self, tables: dict[int, list[int]]) -> None:
        """Cache every filling sequence's full prompt blocks whose tokens are now computed."""
        if not self.filling:
            return
        done = []
        for seq_id, (seq, start) in self.filling.items():
            table = tables.get(seq_id)
            end = start if table is None else self._cache_blocks(seq, table, start)
            if table is None or end >= len(self.hashes[seq_id]):
                done.append(seq_id)
            elif end > start:
                self.filling[seq_id] = (seq, end)
        for seq_id in done:
            del self.filling[seq_id]

    def _cache_blocks(self, seq: Seq, table: list[int], start: int) -> int:
        """Cache `seq`'s full, computed prompt blocks from `start` on; returns where it ended."""
        hashes = self.hashes[seq.seq_id]
        end = min(seq.num_computed_tokens, seq.num_prompt_tokens) // self.block_size
        for i in range(start, end):
            self.insert(table[i], hashes[i])
        return max(start, end)

    # -- invariants (tests) ----------------------------------------------------------------------
    def check_invariants(self, tables: dict[int, list[int]]) -> None:
        """Free and evictable blocks are disjoint and unheld; evictable blocks are exactly the
        unheld cached ones; the two hash maps mirror each other; a cached block at position i
        of a table holds that sequence's prompt block i; filling sequences are on the device and
        write into no cached block."""
        for seq_id, table in tables.items():
            hashes = self.hashes.get(seq_id, ())
            for i, block in enumerate(table):
                cached = self.hash_of.get(block)
                if cached is not None and i < len(hashes) and cached != hashes[i]:
                    raise AssertionError(f"block {block} at position {i} of sequence {seq_id} "
                                         "is cached under another prefix")
        if not self.filling.keys() <= tables.keys():
            raise AssertionError("a sequence off the device is still filling the cache")
        for seq, _ in self.filling.values():  # (its next tokens go from here on)
            table = tables[seq.seq_id]
            if any(b in self.hash_of for b in table[seq.num_computed_tokens // self.block_size:]):
                raise AssertionError(f"sequence {seq.seq_id} is to write into a cached block")
        free, evictable = set(self._free), set(self.evictable)
        if len(free) != len(self._free) or free & evictable:
            raise AssertionError("a block is free twice, or free and evictable")
        if any(self.ref_counts[b] for b in free | evictable):
            raise AssertionError("a free or evictable block is held")
        if {b for b, h in self.hash_of.items() if self.ref_counts[b] == 0} != evictable:
            raise AssertionError("evictable blocks differ from the unheld cached blocks")
        if free & self.hash_of.keys():
            raise AssertionError("a block on the free list is still cached")
        if len(self.block_of) != len(self.hash_of) or any(
                self.hash_of.get(b) != h for h, b in self.block_of.items()):
            raise AssertionError("the hash -> block and block -> hash maps differ")
