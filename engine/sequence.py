"""Sequence (one generated continuation) and SequenceGroup (one request and its sequences)."""

from __future__ import annotations

import bisect
import enum
import time
from collections import deque
from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclass(slots=True)
class Sequence:
    seq_id: int  # engine-wide unique; keys the block manager's tables
    index: int  # position among the request's sequences (the sampler's key, the output index)
    token_ids: list[int]  # prompt followed by output
    num_prompt_tokens: int
    num_computed_tokens: int = 0  # tokens whose K/V sit in the cache
    cumulative_logprob: float | None = 0.0  # None when the request did not need logprobs
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    # Detokenizer state (engine/detokenizer.py).
    output_text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0
    # What delta outputs have handed out so far (EngineConfig.output_kind == "delta").
    num_emitted_tokens: int = 0
    num_emitted_chars: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def ranking_logprob(self) -> float:
        """cumulative_logprob where it ranks sequences (best_of > n, beam search: always kept)."""
        return self.cumulative_logprob if self.cumulative_logprob is not None else 0.0

    def fork(self, seq_id: int, index: int) -> Sequence:
        return Sequence(seq_id=seq_id, index=index, token_ids=list(self.token_ids),
                        num_prompt_tokens=self.num_prompt_tokens,
                        num_computed_tokens=self.num_computed_tokens,
                        cumulative_logprob=self.cumulative_logprob,
                        output_logprobs=list(self.output_logprobs), output_text=self.output_text,
                        prefix_offset=self.prefix_offset, read_offset=self.read_offset,
                        num_emitted_tokens=self.num_emitted_tokens,
                        num_emitted_chars=self.num_emitted_chars)

    def reset_for_recompute(self) -> None:
        """Drop the cached state: the whole sequence (prompt + outputs) is prefilled again."""
        self.num_computed_tokens = 0


@dataclass(slots=True, eq=False)
class SequenceGroup:
    """One request. It starts with one sequence; a request with best_of > 1 forks into best_of
    sequences at its first sample, so the prompt is computed once and its blocks are shared.
    Equality is identity: two requests are never the same one (and queue removals stay cheap)."""

    request_id: str
    params: SamplingParams
    seqs: list[Sequence]
    seed: int  # the request's seed, or one drawn from the engine's seed at admission
    arrival_time: float = field(default_factory=time.monotonic)
    status: SequenceStatus = SequenceStatus.WAITING
    error: str | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    priority: int = 0  # lower runs sooner (scheduling_policy "priority"; 0 under "fcfs")
    plain_greedy: bool = False  # every token the argmax (engine/sampler.py's plain_greedy)
    _prompt_token_ids: list[int] | None = field(default=None, repr=False)

    @property
    def prompt_token_ids(self) -> list[int]:
        """The prompt (one list per request, shared by its outputs: do not modify it)."""
        if self._prompt_token_ids is None:
            seq = self.seqs[0]
            self._prompt_token_ids = seq.token_ids[:seq.num_prompt_tokens]
        return self._prompt_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return self.seqs[0].num_prompt_tokens

    @property
    def width(self) -> int:
        """How many sequences the request runs once forked (best_of)."""
        assert self.params.best_of is not None
        return self.params.best_of

    @property
    def forked(self) -> bool:
        return len(self.seqs) > 1 or self.width == 1

    def live_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.finished]

    def is_finished(self) -> bool:
        return all(s.finished for s in self.seqs)

    def num_new_tokens_per_seq(self) -> list[int]:
        """Tokens each live sequence still has to run through the model before it samples."""
        return [s.num_tokens - s.num_computed_tokens for s in self.live_seqs()]

    def in_prefill(self) -> bool:
        return any(s.num_tokens - s.num_computed_tokens > 1 for s in self.live_seqs())


def priority(group: SequenceGroup) -> int:
    return group.priority


def rank(group: SequenceGroup) -> tuple[int, float]:
    """Queue order: (priority, arrival); under "fcfs" every priority is 0, so arrival order."""
    return group.priority, group.arrival_time


def insert_by_rank(queue: deque[SequenceGroup], group: SequenceGroup) -> None:
    """Insert `group` into `queue` (in rank order) after the groups of equal rank."""
    key = rank(group)
    if not queue or rank(queue[-1]) <= key:
        queue.append(group)
        return
    keys = [rank(g) for g in queue]
    queue.insert(bisect.bisect_right(keys, key), group)
