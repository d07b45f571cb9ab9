"""BlockAllocator: a pool of physical KV blocks (device or host) with reference counts.

A block is free when no block table holds it; ids are handed out lowest first, so a run of
fresh blocks is contiguous in memory. Pure Python: no torch.
"""

from __future__ import annotations

from collections.abc import Iterable


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
