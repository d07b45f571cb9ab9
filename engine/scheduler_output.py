"""What passes between the scheduler and the rest of a step: the step's schedule
(SchedulerOutput, read by the model runner) and what the step sampled (Sampled, read back by
Scheduler.update)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.sequence import Sequence, SequenceGroup

if TYPE_CHECKING:
    from engine.beam_search import BeamChoice


@dataclass(slots=True)
class ScheduledSeq:
    group: SequenceGroup
    seq: Sequence
    num_new_tokens: int
    do_sample: bool  # this step reaches the end of the sequence, so it draws the next token
    # Speculation: the proposals that follow the sequence's last token in this step's query
    # (num_new_tokens is 1 + their number); each position is verified (engine/spec_decode.py).
    spec_token_ids: list[int] | None = None


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


@dataclass(slots=True)
class Sample:
    """One sampled token for one sequence. A sample whose `index` is not its sequence's forks a
    new sequence of that index first (the first sample of a best_of group fans out); a sample
    without a token ends its sequence with "error" and `error` as the request's message."""

    group: SequenceGroup
    seq: Sequence
    index: int
    token: int | None
    logprob: float | None = None
    top: dict[int, float] | None = None
    grammar_done: bool = False  # the grammar is complete: only EOS may follow
    error: str | None = None


@dataclass
class Sampled:
    """A step's samples, in logits row order. `items`: the scheduled sequences that sampled.
    A batch of plain greedy requests (one sequence each, no logprobs) gives `tokens`, one per
    item; any other batch gives `samples` and `beams` (beam search's choices)."""

    items: list[ScheduledSeq]
    tokens: list[int] | None = None
    samples: list[Sample] = field(default_factory=list)
    beams: list[BeamChoice] = field(default_factory=list)
    num_generated: int = 0  # tokens sampled (rows drawn and beam candidates taken)
    # The items that ran proposals: Scheduler.update settles their computed tokens and blocks
    # to what was accepted. Their samples (several per sequence, in order) end at a stop.
    speculated: list[ScheduledSeq] = field(default_factory=list)
