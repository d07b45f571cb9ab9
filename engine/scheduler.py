"""Scheduler: continuous batching with chunked prefill and preemption by recompute or swap.

The algorithm, once per step, under one token budget (max_num_batched_tokens) and one sequence
budget (max_num_seqs):

1. Running groups, oldest first. Each gets its decode tokens (one per live sequence: the budget
   counts every sequence) or its next prefill chunk. When the cache cannot hold the new tokens,
   the newest running group is preempted (swap for multi-sequence groups and recompute for
   single ones under "auto"; a group whose swap does not fit in host space is recomputed) until
   it fits, or the group itself is preempted. A group that needs more blocks than the whole
   cache finishes with "length".
2. Swapped groups, oldest first, only when step 1 preempted nothing (swap-in and swap-out never
   share a step).
3. Waiting groups, oldest first, only when nothing is swapped out (strict priority running >
   swapped > waiting) and nothing was preempted. Admission is all-or-nothing on the blocks of the
   whole prompt (with prefix caching, the cached blocks it starts with are shared and their
   tokens count as computed); the prompt is then prefilled in chunks. A group that can never fit
   finishes with "error".

Preempted groups go back into their queue in arrival order, so FCFS holds across preemptions.

Under scheduling_policy "priority" (vLLM's), "oldest" reads "most urgent": the waiting and
swapped queues are ordered by (priority, arrival), lower first, the running queue by priority
(admission order within one), and preemption takes the least urgent running group.
Before step 1, while the most urgent waiting group cannot be admitted (cache or sequence budget)
and a less urgent group runs, the least urgent running group is preempted for it. Swapped groups
block only waiting groups that are not more urgent, and are swapped in only ahead of waiting
groups that are not more urgent. With every priority equal this is FCFS.
"""

from __future__ import annotations

import bisect
import logging
import random
from collections import deque
from dataclasses import dataclass, field

from engine.block_manager import AllocStatus, BlockManager
from engine.config import EngineConfig
from engine.sequence import Sequence, SequenceGroup, SequenceStatus

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ScheduledSeq:
    group: SequenceGroup
    seq: Sequence
    num_new_tokens: int
    do_sample: bool  # this step reaches the end of the sequence, so it draws the next token


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # host -> device
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # device -> host
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # device -> device
    finished: list[SequenceGroup] = field(default_factory=list)  # ended by the scheduler
    num_batched_tokens: int = 0
    num_preempted: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class _Budget:
    tokens: int
    seqs: int


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[SequenceGroup] = deque()
        self.running: deque[SequenceGroup] = deque()
        self.swapped: deque[SequenceGroup] = deque()
        self._rng = random.Random(config.artificial_preemption_seed)
        # "priority" with more than one priority seen: with one (every request at 0, the usual
        # case) the policy schedules as FCFS, so the step skips its work altogether.
        self._by_priority = config.scheduling_policy == "priority"
        self._priorities: set[int] = set()
        self._preempted_last_step = False
        # num_prompt_tokens: the tokens of the sequences admitted from the waiting queue (a
        # recomputed one's outputs too); num_cached_tokens: those the prefix cache served.
        self.counters = {"num_recompute_preemptions": 0, "num_swap_outs": 0, "num_swap_ins": 0,
                         "num_artificial_preemptions": 0, "num_infeasible": 0,
                         "num_priority_preemptions": 0,
                         "num_prompt_tokens": 0, "num_cached_tokens": 0}

    # -- queues ----------------------------------------------------------------------------------
    def add(self, group: SequenceGroup) -> None:
        self._priorities.add(group.priority)
        _insert_by_rank(self.waiting, group)

    def abort(self, request_id: str) -> SequenceGroup | None:
        for queue in (self.waiting, self.running, self.swapped):
            for group in queue:
                if group.request_id == request_id:
                    queue.remove(group)
                    self.block_manager.free_group(group)
                    return group
        return None

    def remove_running(self, groups: list[SequenceGroup]) -> None:
        """Take `groups` (finished outside the scheduler) out of the running queue, order kept."""
        if len(groups) <= 8:
            for group in groups:
                self.running.remove(group)  # identity: SequenceGroup compares by identity
            return
        gone = {id(g) for g in groups}
        kept = deque(g for g in self.running if id(g) not in gone)
        if len(kept) + len(groups) != len(self.running):
            raise ValueError("a group to remove is not running")
        self.running = kept

    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    # -- the step --------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = _Budget(self.config.max_num_batched_tokens, self.config.max_num_seqs)
        self.block_manager.cache_computed()  # (the last step's keys and values are written)
        if self._by_priority and len(self._priorities) > 1:
            # Least urgent last, admission order within a priority (a stable sort): preemption
            # takes victims from the tail, as under FCFS.
            self.running = deque(sorted(self.running, key=_priority))
            if self.waiting and self.running:
                self._preempt_for_urgent(out)
        self._schedule_running(out, budget)
        if out.num_preempted == 0:
            self._schedule_swapped(out, budget)
        if out.num_preempted == 0 and (not self.swapped or self._outranks_swapped()):
            self._schedule_waiting(out, budget)
        if out.num_preempted and not self._preempted_last_step:
            logger.warning("preempted %d request(s): the KV cache (%d blocks) is full; "
                           "raise num_gpu_blocks_override/kv_cache_memory or lower max_num_seqs",
                           out.num_preempted, self.block_manager.num_total_blocks)
        self._preempted_last_step = out.num_preempted > 0
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: _Budget) -> None:
        queue, kept = self.running, deque[SequenceGroup]()
        bm, bs = self.block_manager, self.block_manager.block_size
        ref_counts, tables = bm.device.ref_counts, bm.tables
        fast = self.config.artificial_preemption_prob == 0.0
        scheduled = out.scheduled
        while queue:
            group = queue.popleft()
            seqs = group.seqs
            if fast and len(seqs) == 1 and group.params.best_of == 1 and budget.tokens \
                    and budget.seqs:
                # Fast path, the common case: one sequence decoding into a slot it owns.
                seq = seqs[0]
                pos = seq.num_computed_tokens
                table = tables.get(seq.seq_id, ())
                if len(seq.token_ids) - pos == 1 and pos // bs < len(table) \
                        and ref_counts[table[pos // bs]] == 1:
                    scheduled.append(ScheduledSeq(group, seq, 1, True))
                    budget.tokens -= 1
                    budget.seqs -= 1
                    out.num_batched_tokens += 1
                    kept.append(group)
                    continue
            plan = self._plan(group, budget)
            if not plan:
                kept.append(group)  # no budget left this step; it stays running
                continue
            if not self._make_room(group, plan, queue, out):
                continue  # preempted or finished
            self._commit(group, plan, out, budget)
            kept.append(group)
        self.running = kept

    def _preempt_for_urgent(self, out: SchedulerOutput) -> None:
        """Preempt the least urgent running groups, while they are less urgent than the most
        urgent waiting group and it cannot be admitted (its blocks, or its sequences)."""
        urgent, bm = self.waiting[0], self.block_manager
        while self.running and self.running[-1].priority > urgent.priority:
            status = bm.can_allocate(urgent, bm.prefix_hits(urgent))
            if status is AllocStatus.NEVER:
                return  # (it ends with an error when its turn comes; preempting cannot help)
            seqs = sum(max(len(g.live_seqs()), 1 if g.forked else g.width) for g in self.running)
            if status is AllocStatus.OK and seqs + urgent.width <= self.config.max_num_seqs:
                return
            self._preempt(self.running.pop(), out)
            self.counters["num_priority_preemptions"] += 1

    def _outranks_swapped(self) -> bool:
        """Under "priority": the most urgent waiting group may be admitted past swapped ones."""
        return self._by_priority and bool(self.waiting) and \
            self.waiting[0].priority < self.swapped[0].priority

    def _make_room(self, group: SequenceGroup, plan: list[ScheduledSeq],
                   queue: deque[SequenceGroup], out: SchedulerOutput) -> bool:
        """Free blocks for `plan` by preempting the newest running groups; False if `group`
        itself had to go."""
        bm = self.block_manager
        forced = self._artificial_preemption()
        while True:
            needed = sum(bm.blocks_to_append(s.seq, s.num_new_tokens) for s in plan)
            if needed <= bm.num_free_blocks and not forced:
                return True
            forced = False
            if not queue and bm.num_group_blocks(group) + needed > bm.num_total_blocks:
                self._finish(group, "length", None, out)
                self.counters["num_infeasible"] += 1
                return False
            victim = queue.pop() if queue else group
            self._preempt(victim, out)
            if victim is group:
                return False

    def _schedule_swapped(self, out: SchedulerOutput, budget: _Budget) -> None:
        bm = self.block_manager
        while self.swapped:
            group = self.swapped[0]
            if self._by_priority and self.waiting and self.waiting[0].priority < group.priority:
                break  # a more urgent request waits: it goes first
            status = bm.can_swap_in(group)
            if status is AllocStatus.NEVER:
                self.swapped.popleft()
                self._finish(group, "length", None, out)
                self.counters["num_infeasible"] += 1
                continue
            plan = self._plan(group, budget)
            if status is AllocStatus.LATER or not plan:
                break
            self.swapped.popleft()
            out.blocks_to_swap_in.extend(bm.swap_in(group))
            self.counters["num_swap_ins"] += 1
            group.status = SequenceStatus.RUNNING
            self._commit(group, plan, out, budget)
            self.running.append(group)

    def _schedule_waiting(self, out: SchedulerOutput, budget: _Budget) -> None:
        bm = self.block_manager
        device, tables = bm.device, bm.tables
        chunked = self.config.enable_chunked_prefill
        max_tokens = self.config.max_num_batched_tokens
        waiting, running, scheduled = self.waiting, self.running, out.scheduled
        cache, counters = bm.cache, self.counters
        # Under "priority", swapped groups still block the waiting groups not more urgent.
        gate = self.swapped[0].priority if self.swapped else None
        while waiting:
            group = waiting[0]
            if gate is not None and group.priority >= gate:
                break
            seqs = group.seqs
            if len(seqs) == 1 and group.params.best_of == 1 and seqs[0].finish_reason is None \
                    and (cache is None or not cache.has_hit(seqs[0])):
                # Fast path, the common case: one sequence whose prompt fits the budget and the
                # cache (and starts with no cached block); the same decisions as below,
                # without building a plan.
                seq = seqs[0]
                num_tokens = len(seq.token_ids)
                remaining = num_tokens - seq.num_computed_tokens
                num_blocks = bm.blocks_for(num_tokens)
                resumed = group.num_preemptions > 0
                fit = bm.fit(num_blocks, resumed)
                chunk = chunked or resumed  # (a recomputed group may have outgrown the budget)
                if (chunk or remaining <= max_tokens) and fit is not AllocStatus.NEVER:
                    left = budget.tokens
                    take = min(remaining, left) if chunk else remaining
                    if fit is AllocStatus.LATER or budget.seqs < 1 or take == 0 or take > left:
                        break  # no room in the cache, or no budget left this step
                    waiting.popleft()
                    # Fresh blocks for the whole prompt: no copy-on-write, nothing to append.
                    tables[seq.seq_id] = device.allocate_many(num_blocks)
                    counters["num_prompt_tokens"] += num_tokens
                    if cache is not None:
                        cache.start_filling(seq, 0)
                    group.status = SequenceStatus.RUNNING
                    scheduled.append(ScheduledSeq(group, seq, take, take == remaining))
                    budget.tokens = left - take
                    budget.seqs -= 1
                    out.num_batched_tokens += take
                    running.append(group)
                    continue
            if self._never_fits_budget(group):
                waiting.popleft()
                self._finish(group, "length" if group.seqs[0].num_output_tokens else "error",
                             f"the request has {group.seqs[0].num_tokens} tokens but "
                             f"max_num_batched_tokens is {self.config.max_num_batched_tokens} and "
                             "chunked prefill is off; enable it or raise the budget", out)
                continue
            hits = bm.prefix_hits(group)  # (None without prefix caching)
            status = bm.can_allocate(group, hits)
            if status is AllocStatus.NEVER:
                waiting.popleft()
                blocks = bm.blocks_to_allocate(group)
                if group.num_preemptions:  # recomputed, its sequences no longer share blocks
                    logger.warning(
                        "request %s ends with 'length': preempted by recompute, its %d "
                        "sequences need %d KV blocks unshared but the cache holds %d; give the "
                        "engine swap space (swap_space) or more KV cache", group.request_id,
                        len(group.live_seqs()), blocks, bm.num_total_blocks)
                    self.counters["num_infeasible"] += 1
                    self._finish(group, "length", None, out)
                    continue
                self._finish(group, "error", f"the request needs {blocks} KV blocks of "
                             f"{bm.block_size} tokens but the cache holds only "
                             f"{bm.num_total_blocks - bm.watermark_blocks}; shorten the prompt "
                             "or give the engine more KV cache", out)
                continue
            if status is AllocStatus.LATER:
                break
            plan = self._plan(group, budget, bm.cached_tokens(group, hits))
            if not plan:
                break
            waiting.popleft()
            counters["num_cached_tokens"] += bm.allocate(group, hits)
            counters["num_prompt_tokens"] += sum(s.num_tokens for s in group.live_seqs())
            group.status = SequenceStatus.RUNNING
            self._commit(group, plan, out, budget)
            running.append(group)

    # -- helpers ---------------------------------------------------------------------------------
    def _plan(self, group: SequenceGroup, budget: _Budget,
              computed: list[int] | None = None) -> list[ScheduledSeq]:
        """This step's tokens for each live sequence, or [] when the budgets cannot take them.
        Decoding sequences move together (every sequence's token counts against the budget);
        prefills take what the token budget leaves when chunking is on. `computed`: each live
        sequence's computed tokens once admitted (a waiting group's prefix cache hits)."""
        seqs = group.live_seqs()
        num_seqs = max(len(seqs), 1 if group.forked else group.width)
        if num_seqs > budget.seqs:
            return []
        left = budget.tokens
        plan = []
        if computed is None:
            computed = [s.num_computed_tokens for s in seqs]
        rest = [s.num_tokens - c for s, c in zip(seqs, computed)]
        if group.params.use_beam_search:  # beams sample together: each runs its whole remainder
            if sum(rest) <= left:
                return [ScheduledSeq(group, s, r, True) for s, r in zip(seqs, rest)]
            chunk = self.config.enable_chunked_prefill or group.num_preemptions > 0
            for seq, r in zip(seqs, rest):  # or prefill chunks that keep one token each back
                if chunk and left and r > 1:
                    plan.append(ScheduledSeq(group, seq, min(r - 1, left), False))
                    left -= plan[-1].num_new_tokens
            return plan
        chunk = self.config.enable_chunked_prefill or group.num_preemptions > 0
        for seq, remaining in zip(seqs, rest):
            take = min(remaining, left) if chunk else remaining
            if take == 0 or take > left:
                break  # the rest of the group runs in a later step
            plan.append(ScheduledSeq(group, seq, take, take == remaining))
            left -= take
        return plan

    def _never_fits_budget(self, group: SequenceGroup) -> bool:
        """Without chunked prefill a sequence longer than the token budget can never run. (A
        recomputed group re-prefills in chunks whatever the setting: it ran, and may have
        outgrown the budget since its first prefill.)"""
        if self.config.enable_chunked_prefill or group.num_preemptions:
            return False  # (beam width over the budget: refused by Engine.add_request)
        remaining = [s.num_tokens - s.num_computed_tokens for s in group.live_seqs()]
        if group.params.use_beam_search:
            return sum(remaining) > self.config.max_num_batched_tokens
        return any(r > self.config.max_num_batched_tokens for r in remaining)

    def _commit(self, group: SequenceGroup, plan: list[ScheduledSeq], out: SchedulerOutput,
                budget: _Budget) -> None:
        for item in plan:
            out.blocks_to_copy.extend(self.block_manager.append_slots(item.seq,
                                                                      item.num_new_tokens))
            budget.tokens -= item.num_new_tokens
            out.num_batched_tokens += item.num_new_tokens
        budget.seqs -= max(len(plan), 1 if group.forked else group.width)
        out.scheduled.extend(plan)

    def _preempt(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        bm = self.block_manager
        out.num_preempted += 1
        group.num_preemptions += 1
        mode = self.config.preemption_mode
        if mode == "auto":
            mode = "swap" if len(group.live_seqs()) > 1 else "recompute"
        if mode == "swap" and bm.can_swap_out(group):
            out.blocks_to_swap_out.extend(bm.swap_out(group))
            group.status = SequenceStatus.SWAPPED
            _insert_by_rank(self.swapped, group)
            self.counters["num_swap_outs"] += 1
            return
        # Recompute (also the fallback when host swap space is exhausted).
        bm.free_group(group)
        for seq in group.live_seqs():
            seq.reset_for_recompute()
        group.status = SequenceStatus.WAITING
        _insert_by_rank(self.waiting, group)
        self.counters["num_recompute_preemptions"] += 1

    def _artificial_preemption(self) -> bool:
        p = self.config.artificial_preemption_prob
        if p <= 0.0 or self.counters["num_artificial_preemptions"] >= \
                self.config.artificial_preemption_max:
            return False
        if self._rng.random() < p:
            self.counters["num_artificial_preemptions"] += 1
            return True
        return False

    def _finish(self, group: SequenceGroup, reason: str, error: str | None,
                out: SchedulerOutput) -> None:
        self.block_manager.free_group(group)
        for seq in group.live_seqs():
            seq.finish_reason = reason
        group.error = error
        group.status = SequenceStatus.FINISHED
        out.finished.append(group)


def _priority(group: SequenceGroup) -> int:
    return group.priority


def _rank(group: SequenceGroup) -> tuple[int, float]:
    """Queue order: (priority, arrival); under "fcfs" every priority is 0, so arrival order."""
    return group.priority, group.arrival_time


def _insert_by_rank(queue: deque[SequenceGroup], group: SequenceGroup) -> None:
    rank = _rank(group)
    if not queue or _rank(queue[-1]) <= rank:
        queue.append(group)
        return
    keys = [_rank(g) for g in queue]
    queue.insert(bisect.bisect_right(keys, rank), group)
