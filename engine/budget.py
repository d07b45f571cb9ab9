"""StepBudget: the tokens and sequences one step may still schedule, and how a group's next
tokens fit into them.

Decoding sequences move together (every sequence's token counts against the budget); prefills
take what the token budget leaves when chunking is on. Chunking is on for a group that was
preempted whatever the setting: it ran, and may have outgrown the budget since its first
prefill. Beams sample together: each runs its whole remainder, or prefill chunks that keep one
token each back.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.scheduler_output import ScheduledSeq, SchedulerOutput
from engine.sequence import SequenceGroup


@dataclass
class StepBudget:
    tokens: int
    seqs: int

    def plan(self, group: SequenceGroup, config: EngineConfig,
             computed: list[int] | None = None,
             proposals: dict[int, list[int]] | None = None) -> list[ScheduledSeq]:
        """This step's tokens for each live sequence, or [] when the budget cannot take them.
        `computed`: each live sequence's computed tokens once admitted (a waiting group's prefix
        cache hits). `proposals`: speculative tokens per seq_id, run after a decoding
        sequence's last token as far as the budget takes them (none: a plain decode)."""
        seqs = group.live_seqs()
        num_seqs = max(len(seqs), 1 if group.forked else group.width)
        if num_seqs > self.seqs:
            return []
        left = self.tokens
        plan = []
        if computed is None:
            computed = [s.num_computed_tokens for s in seqs]
        rest = [s.num_tokens - c for s, c in zip(seqs, computed)]
        chunk = chunks(group, config)
        if group.params.use_beam_search:
            if sum(rest) <= left:
                return [ScheduledSeq(group, s, r, True) for s, r in zip(seqs, rest)]
            for seq, r in zip(seqs, rest):
                if chunk and left and r > 1:
                    plan.append(ScheduledSeq(group, seq, min(r - 1, left), False))
                    left -= plan[-1].num_new_tokens
            return plan
        for seq, remaining in zip(seqs, rest):
            spec = proposals.get(seq.seq_id) if proposals and remaining == 1 else None
            if spec and (num := take(1 + len(spec), left, chunk)) > 1:
                plan.append(ScheduledSeq(group, seq, num, True, spec[:num - 1]))
                left -= num
                continue
            num = take(remaining, left, chunk)
            if not num:
                break  # the rest of the group runs in a later step
            plan.append(ScheduledSeq(group, seq, num, num == remaining))
            left -= num
        return plan

    def commit(self, group: SequenceGroup, plan: list[ScheduledSeq], out: SchedulerOutput,
               block_manager: BlockManager) -> None:
        """Schedule `plan`: its slots (copies on write into `out`), its share of the budget."""
        for item in plan:
            out.blocks_to_copy.extend(block_manager.append_slots(item.seq,
                                                                 item.num_new_tokens))
            self.tokens -= item.num_new_tokens
            out.num_batched_tokens += item.num_new_tokens
        self.seqs -= max(len(plan), 1 if group.forked else group.width)
        out.scheduled.extend(plan)


def chunks(group: SequenceGroup, config: EngineConfig) -> bool:
    """Whether `group` may run its prompt in chunks."""
    return config.enable_chunked_prefill or group.num_preemptions > 0


def take(remaining: int, left: int, chunk: bool) -> int:
    """Of a sequence's `remaining` tokens, those this step runs with `left` in the budget: 0
    when they do not fit (a sequence that does not chunk runs all its tokens or none)."""
    num = min(remaining, left) if chunk else remaining
    return num if 0 < num <= left else 0


def never_fits_budget(group: SequenceGroup, config: EngineConfig) -> bool:
    """Without chunked prefill a sequence longer than the token budget can never run."""
    if config.enable_chunked_prefill or group.num_preemptions:
        return False  # (beam width over the budget: refused by Engine.add_request)
    remaining = [s.num_tokens - s.num_computed_tokens for s in group.live_seqs()]
    if group.params.use_beam_search:
        return sum(remaining) > config.max_num_batched_tokens
    return any(r > config.max_num_batched_tokens for r in remaining)
