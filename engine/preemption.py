"""Preemptor: takes a running group off the device for lack of room.

Swap (a group's blocks move to host swap space, shared blocks copied once) keeps its computed
tokens; recompute frees its blocks and prefills it again. Under "auto" multi-sequence groups
swap (their sequences share blocks that a recompute would unshare) and single ones recompute.
A group whose swap does not fit the host space is recomputed. Artificial preemptions (tests)
are drawn from a seeded generator, at most artificial_preemption_max of them.
"""

from __future__ import annotations

import random
from collections import deque

from engine.block_manager import AllocStatus, BlockManager
from engine.config import EngineConfig
from engine.scheduler_output import SchedulerOutput
from engine.sequence import SequenceGroup, SequenceStatus


class Preemptor:
    def __init__(self, config: EngineConfig, block_manager: BlockManager,
                 counters: dict[str, int]) -> None:
        self.config = config
        self.block_manager = block_manager
        self.counters = counters  # (the scheduler's)
        self.reset()

    def reset(self) -> None:
        self._rng = random.Random(self.config.artificial_preemption_seed)

    def preempt(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        """Swap `group` out or free it for recompute; its status says which queue it joins."""
        bm = self.block_manager
        out.num_preempted += 1
        group.num_preemptions += 1
        mode = self.config.preemption_mode
        if mode == "auto":
            mode = "swap" if len(group.live_seqs()) > 1 else "recompute"
        if mode == "swap" and bm.can_swap_out(group):
            out.blocks_to_swap_out.extend(bm.swap_out(group))
            group.status = SequenceStatus.SWAPPED
            self.counters["num_swap_outs"] += 1
            return
        bm.free_group(group)
        for seq in group.live_seqs():
            seq.reset_for_recompute()
        group.status = SequenceStatus.WAITING
        self.counters["num_recompute_preemptions"] += 1

    def preempt_for(self, urgent: SequenceGroup, running: deque[SequenceGroup],
                    out: SchedulerOutput) -> list[SequenceGroup]:
        """Under "priority": preempt the least urgent running groups (the tail of `running`),
        while they are less urgent than the waiting group `urgent` and it cannot be admitted
        (its blocks, or its sequences). Returns them, in the order they were preempted."""
        bm, victims = self.block_manager, []
        while running and running[-1].priority > urgent.priority:
            status = bm.can_allocate(urgent, bm.prefix_hits(urgent))
            if status is AllocStatus.NEVER:
                break  # (it ends with an error when its turn comes; preempting cannot help)
            seqs = sum(max(len(g.live_seqs()), 1 if g.forked else g.width) for g in running)
            if status is AllocStatus.OK and seqs + urgent.width <= self.config.max_num_seqs:
                break
            victims.append(running.pop())
            self.preempt(victims[-1], out)
            self.counters["num_priority_preemptions"] += 1
        return victims

    def draw_artificial(self) -> bool:
        """Whether this running group is preempted artificially (one draw per group)."""
        p = self.config.artificial_preemption_prob
        if p <= 0.0 or self.counters["num_artificial_preemptions"] >= \
                self.config.artificial_preemption_max:
            return False
        if self._rng.random() < p:
            self.counters["num_artificial_preemptions"] += 1
            return True
        return False
