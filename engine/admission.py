"""Admission: whether the oldest waiting group starts running this step.

Admission is all-or-nothing on the blocks of the whole prompt (with prefix caching, the cached
blocks it starts with are shared and their tokens count as computed); the prompt is then
prefilled in chunks. A group that can never run ends: with "error" (its prompt exceeds the
cache, or the budget without chunked prefill), or with "length" when it has outputs already (a
recomputed group whose sequences, unshared, outgrew the cache).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable

from engine.block_manager import AllocStatus, BlockManager
from engine.budget import StepBudget, chunks, never_fits_budget, take
from engine.config import EngineConfig
from engine.scheduler_output import ScheduledSeq, SchedulerOutput
from engine.sequence import SequenceGroup, SequenceStatus

logger = logging.getLogger(__name__)


class Admit(enum.Enum):
    ADMITTED = "admitted"  # running from this step
    ENDED = "ended"  # it can never run: ended
    LATER = "later"  # no room in the cache or the budget this step


class Admission:
    """`end(group, reason, error, out)` ends a group that can never run; `fast_path` False
    sends every group through the general path (tests check that both admit alike)."""

    def __init__(self, config: EngineConfig, block_manager: BlockManager,
                 counters: dict[str, int],
                 end: Callable[[SequenceGroup, str, str | None, SchedulerOutput], None],
                 fast_path: bool = True) -> None:
        self.config = config
        self.block_manager = block_manager
        self.counters = counters  # (the scheduler's)
        self.end = end
        self.fast_path = fast_path

    def admit(self, group: SequenceGroup, out: SchedulerOutput, budget: StepBudget) -> Admit:
        bm, seqs = self.block_manager, group.seqs
        if self.fast_path and len(seqs) == 1 and group.params.best_of == 1 \
                and seqs[0].finish_reason is None \
                and (bm.cache is None or not bm.cache.has_hit(seqs[0])):
            # Fast path, the common case: one sequence whose prompt starts with no cached
            # block. The general path's decisions (never_fits_budget, fit, take) without
            # building a plan; fresh blocks for the whole prompt, so nothing to copy.
            seq = seqs[0]
            num_tokens = len(seq.token_ids)
            num_blocks = bm.blocks_for(num_tokens)
            fit = bm.fit(num_blocks, group.num_preemptions > 0)
            if fit is not AllocStatus.NEVER and not never_fits_budget(group, self.config):
                remaining = num_tokens - seq.num_computed_tokens
                num = take(remaining, budget.tokens, chunks(group, self.config))
                if fit is AllocStatus.LATER or budget.seqs < 1 or not num:
                    return Admit.LATER
                bm.tables[seq.seq_id] = bm.device.allocate_many(num_blocks)
                self.counters["num_prompt_tokens"] += num_tokens
                if bm.cache is not None:
                    bm.cache.start_filling(seq, 0)
                group.status = SequenceStatus.RUNNING
                out.scheduled.append(ScheduledSeq(group, seq, num, num == remaining))
                budget.tokens -= num
                budget.seqs -= 1
                out.num_batched_tokens += num
                return Admit.ADMITTED
        if never_fits_budget(group, self.config):
            self.end(group, "length" if group.seqs[0].num_output_tokens else "error",
                     f"the request has {group.seqs[0].num_tokens} tokens but "
                     f"max_num_batched_tokens is {self.config.max_num_batched_tokens} and "
                     "chunked prefill is off; enable it or raise the budget", out)
            return Admit.ENDED
        hits = bm.prefix_hits(group)  # (None without prefix caching)
        status = bm.can_allocate(group, hits)
        if status is AllocStatus.NEVER:
            self._refuse(group, out)
            return Admit.ENDED
        if status is AllocStatus.LATER:
            return Admit.LATER
        plan = budget.plan(group, self.config, bm.cached_tokens(group, hits))
        if not plan:
            return Admit.LATER
        self.counters["num_cached_tokens"] += bm.allocate(group, hits)
        self.counters["num_prompt_tokens"] += sum(s.num_tokens for s in group.live_seqs())
        group.status = SequenceStatus.RUNNING
        budget.commit(group, plan, out, bm)
        return Admit.ADMITTED

    def _refuse(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        """End a group whose blocks exceed the whole cache."""
        bm = self.block_manager
        blocks = bm.blocks_to_allocate(group)
        if group.num_preemptions:  # recomputed, its sequences no longer share blocks
            logger.warning(
                "request %s ends with 'length': preempted by recompute, its %d sequences need "
                "%d KV blocks unshared but the cache holds %d; give the engine swap space "
                "(swap_space) or more KV cache", group.request_id, len(group.live_seqs()),
                blocks, bm.num_total_blocks)
            self.counters["num_infeasible"] += 1
            self.end(group, "length", None, out)
            return
        self.end(group, "error", f"the request needs {blocks} KV blocks of {bm.block_size} "
                 f"tokens but the cache holds only {bm.num_total_blocks - bm.watermark_blocks}; "
                 "shorten the prompt or give the engine more KV cache", out)
