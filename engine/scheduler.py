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

With prefills_first (TGI's and SGLang's schedule; off by default), a step that could admit
waiting groups while others run admits them alone, steps 1 and 2 skipped: a new request's first
token comes without waiting for a step that also decodes every running sequence, which waits
one prefill step instead. Never twice in a row (the decodes run at least every other step), not
while groups are swapped out or speculation is on, and under "priority" not ahead of a more
urgent running group.

Under scheduling_policy "priority" (vLLM's), "oldest" reads "most urgent": the waiting and
swapped queues are ordered by (priority, arrival), lower first, the running queue by priority
(admission order within one), and preemption takes the least urgent running group.
Before step 1, while the most urgent waiting group cannot be admitted (cache or sequence budget)
and a less urgent group runs, the least urgent running group is preempted for it. Swapped groups
block only waiting groups that are not more urgent, and are swapped in only ahead of waiting
groups that are not more urgent. With every priority equal this is FCFS.

The scheduler owns each sequence's lifecycle: after the step ran, update() advances computed
tokens, appends the sampled tokens (engine/postprocess.py), frees the blocks of sequences that
end and takes ended groups out of the running queue. Nothing else advances a sequence, frees
its blocks or edits the queues.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Iterator

from engine.admission import Admission, Admit
from engine.block_manager import AllocStatus, BlockManager
from engine.budget import StepBudget
from engine.config import EngineConfig
from engine.postprocess import Postprocessor
from engine.preemption import Preemptor
from engine.scheduler_output import Sampled, ScheduledSeq, SchedulerOutput
from engine.sequence import SequenceGroup, SequenceStatus, insert_by_rank, priority
from engine.stop_checker import StopChecker

logger = logging.getLogger(__name__)


class Scheduler:
    """`checker` ends sequences (without one: no EOS, no text); `seq_ids` numbers the sequences
    forks create (the engine's counter). `fast_paths` False sends every group through the
    general path (tests check that both schedule alike)."""

    def __init__(self, config: EngineConfig, block_manager: BlockManager,
                 checker: StopChecker | None = None, seq_ids: Iterator[int] | None = None,
                 fast_paths: bool = True) -> None:
        self.config = config
        self.block_manager = block_manager
        checker = checker or StopChecker(set(), config.max_model_len or 2**62)
        self.postprocessor = Postprocessor(block_manager, checker, seq_ids or itertools.count())
        self._fast_paths = fast_paths
        # "priority" with more than one priority seen: with one (every request at 0, the usual
        # case) the policy schedules as FCFS, so the step skips its work altogether.
        self._by_priority = config.scheduling_policy == "priority"
        # num_prompt_tokens: the tokens of the sequences admitted from the waiting queue (a
        # recomputed one's outputs too); num_cached_tokens: those the prefix cache served.
        self.counters = {"num_recompute_preemptions": 0, "num_swap_outs": 0, "num_swap_ins": 0,
                         "num_artificial_preemptions": 0, "num_infeasible": 0,
                         "num_priority_preemptions": 0, "num_prefill_only_steps": 0,
                         "num_prompt_tokens": 0, "num_cached_tokens": 0}
        self.preemptor = Preemptor(config, block_manager, self.counters)
        self.admission = Admission(config, block_manager, self.counters, self._finish,
                                   fast_paths)
        self.reset()

    def reset(self) -> None:
        """Empty queues and every block free (counters stay: metrics never go backwards)."""
        self.block_manager.reset()
        self.waiting: deque[SequenceGroup] = deque()
        self.running: deque[SequenceGroup] = deque()
        self.swapped: deque[SequenceGroup] = deque()
        self.preemptor.reset()
        self._priorities: set[int] = set()
        self._preempted_last_step = False
        self._prefills_alone_last_step = False

    # -- queues ----------------------------------------------------------------------------------
    def add(self, group: SequenceGroup) -> None:
        self._priorities.add(group.priority)
        insert_by_rank(self.waiting, group)

    def abort(self, request_id: str) -> SequenceGroup | None:
        for queue in (self.waiting, self.running, self.swapped):
            for group in queue:
                if group.request_id == request_id:
                    queue.remove(group)
                    self.block_manager.free_group(group)
                    return group
        return None

    def remove_running(self, groups: list[SequenceGroup]) -> None:
        """Take `groups` (finished) out of the running queue, order kept."""
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
    def schedule(self, proposals: dict[int, list[int]] | None = None) -> SchedulerOutput:
        """`proposals`: speculative tokens per seq_id of running sequences that decode (see
        engine/spec_decode.py); a sequence runs them when the budget and the cache have room."""
        out = SchedulerOutput()
        budget = StepBudget(self.config.max_num_batched_tokens, self.config.max_num_seqs)
        self.block_manager.cache_computed()  # (the last step's keys and values are written)
        if self._by_priority and len(self._priorities) > 1:
            # Least urgent last, admission order within a priority (a stable sort): preemption
            # takes victims from the tail, as under FCFS.
            self.running = deque(sorted(self.running, key=priority))
            if self.waiting and self.running:
                for victim in self.preemptor.preempt_for(self.waiting[0], self.running, out):
                    self._requeue(victim)
        if out.num_preempted == 0 and self._prefills_alone():
            self._schedule_waiting(out, budget)
            self._prefills_alone_last_step = bool(out.scheduled)
            if out.scheduled:
                self.counters["num_prefill_only_steps"] += 1
                self._preempted_last_step = False
                return out
        else:
            self._prefills_alone_last_step = False
        self._schedule_running(out, budget, proposals or {})
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

    def update(self, output: SchedulerOutput, sampled: Sampled) -> list[SequenceGroup]:
        """After the step ran `output`: its sequences' tokens are computed, its samples join
        their sequences, sequences that end free their blocks, and groups that end leave the
        running queue. Returns the groups that ended."""
        for item in output.scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
        done = self.postprocessor.apply(sampled)
        for item in sampled.speculated:  # computed: up to the accepted tokens; the rest given back
            if item.seq.finish_reason is None:
                item.seq.num_computed_tokens = item.seq.num_tokens - 1
                self.block_manager.trim(item.seq)
        if done:
            self.remove_running(done)
        return done

    def _schedule_running(self, out: SchedulerOutput, budget: StepBudget,
                          proposals: dict[int, list[int]]) -> None:
        queue, kept = self.running, deque[SequenceGroup]()
        bm, bs = self.block_manager, self.block_manager.block_size
        ref_counts, tables = bm.device.ref_counts, bm.tables
        fast = self._fast_paths
        artificial = self.config.artificial_preemption_prob > 0.0
        scheduled = out.scheduled
        while queue:
            group = queue.popleft()
            seqs = group.seqs
            forced = None
            if fast and len(seqs) == 1 and group.params.best_of == 1 and budget.tokens \
                    and budget.seqs:
                # Fast path, the common case: one sequence decoding into a slot it owns. The
                # general path would plan its one token, find that it needs no block and
                # commit nothing but the budget; only an artificial preemption stops it.
                seq = seqs[0]
                pos = seq.num_computed_tokens
                table = tables.get(seq.seq_id, ())
                if len(seq.token_ids) - pos == 1 and pos // bs < len(table) \
                        and ref_counts[table[pos // bs]] == 1 and seq.seq_id not in proposals:
                    forced = artificial and self.preemptor.draw_artificial()
                    if not forced:
                        scheduled.append(ScheduledSeq(group, seq, 1, True))
                        budget.tokens -= 1
                        budget.seqs -= 1
                        out.num_batched_tokens += 1
                        kept.append(group)
                        continue
            plan = budget.plan(group, self.config, None, proposals)
            if proposals and not self._spec_fits(plan):
                plan = budget.plan(group, self.config)  # speculation never preempts anyone
            if not plan:
                kept.append(group)  # no budget left this step; it stays running
                continue
            if not self._make_room(group, plan, queue, out, forced):
                continue  # preempted or finished
            budget.commit(group, plan, out, self.block_manager)
            kept.append(group)
        self.running = kept

    def _prefills_alone(self) -> bool:
        """Whether this step runs the waiting prompts it can admit without the running groups
        (config.prefills_first): not twice in a row, so the decodes run at least every other
        step; not with speculation (its proposals are made for the running groups), nor while
        groups are swapped out (they go first), nor ahead of a more urgent running group (the
        running queue is in priority order by now: the most urgent first)."""
        return self.config.prefills_first and not self._prefills_alone_last_step \
            and bool(self.waiting) and bool(self.running) and not self.swapped \
            and self.config.speculative_config is None \
            and not (self._by_priority and len(self._priorities) > 1
                     and self.running[0].priority < self.waiting[0].priority)

    def _spec_fits(self, plan: list[ScheduledSeq]) -> bool:
        """Whether `plan`'s speculative tokens, if any, fit the free blocks."""
        bm = self.block_manager
        return not any(s.spec_token_ids for s in plan) or \
            sum(bm.blocks_to_append(s.seq, s.num_new_tokens) for s in plan) <= bm.num_free_blocks

    def _outranks_swapped(self) -> bool:
        """Under "priority": the most urgent waiting group may be admitted past swapped ones."""
        return self._by_priority and bool(self.waiting) and \
            self.waiting[0].priority < self.swapped[0].priority

    def _make_room(self, group: SequenceGroup, plan: list[ScheduledSeq],
                   queue: deque[SequenceGroup], out: SchedulerOutput,
                   forced: bool | None = None) -> bool:
        """Free blocks for `plan` by preempting the newest running groups; False if `group`
        itself had to go. `forced`: this group's artificial preemption draw, if made already
        (one draw per scheduled running group, whichever path it takes)."""
        bm = self.block_manager
        if forced is None:
            forced = self.preemptor.draw_artificial()
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

    def _schedule_swapped(self, out: SchedulerOutput, budget: StepBudget) -> None:
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
            plan = budget.plan(group, self.config)
            if status is AllocStatus.LATER or not plan:
                break
            self.swapped.popleft()
            out.blocks_to_swap_in.extend(bm.swap_in(group))
            self.counters["num_swap_ins"] += 1
            group.status = SequenceStatus.RUNNING
            budget.commit(group, plan, out, self.block_manager)
            self.running.append(group)

    def _schedule_waiting(self, out: SchedulerOutput, budget: StepBudget) -> None:
        waiting = self.waiting
        # Under "priority", swapped groups still block the waiting groups not more urgent.
        gate = self.swapped[0].priority if self.swapped else None
        while waiting:
            group = waiting[0]
            if gate is not None and group.priority >= gate:
                break
            admitted = self.admission.admit(group, out, budget)
            if admitted is Admit.LATER:
                break
            waiting.popleft()
            if admitted is Admit.ADMITTED:
                self.running.append(group)

    # -- helpers ---------------------------------------------------------------------------------
    def _preempt(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        self.preemptor.preempt(group, out)
        self._requeue(group)

    def _requeue(self, group: SequenceGroup) -> None:
        """A preempted group joins its queue in rank order, so FCFS holds across preemptions."""
        swapped = group.status is SequenceStatus.SWAPPED
        insert_by_rank(self.swapped if swapped else self.waiting, group)

    def _finish(self, group: SequenceGroup, reason: str, error: str | None,
                out: SchedulerOutput) -> None:
        self.postprocessor.end(group, reason, error)
        out.finished.append(group)
