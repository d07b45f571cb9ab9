"""Postprocessor: applies a step's samples to its sequences, for Scheduler.update (nano-vllm's
Scheduler.postprocess).

Each sampled token is appended to its sequence (the first sample of a best_of group forks the
sequence first: forks copy the parent before any append), and a sequence that ends frees its
blocks at once. Beam search's choices fork and free through the same methods. A group ends when
all its sequences have (a beam group: when it keeps no live beam); it is then FINISHED.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from engine.block_manager import BlockManager
from engine.sampling_params import SamplingParams
from engine.scheduler_output import Sampled
from engine.sequence import Sequence, SequenceGroup, SequenceStatus
from engine.stop_checker import StopChecker


class Postprocessor:
    def __init__(self, block_manager: BlockManager, checker: StopChecker,
                 seq_ids: Iterator[int]) -> None:
        self.block_manager = block_manager
        self.checker = checker
        self.seq_ids = seq_ids

    def apply(self, sampled: Sampled) -> list[SequenceGroup]:
        """Append the step's samples; returns the groups that ended."""
        if sampled.tokens is not None:
            return self._apply_greedy(sampled)
        samples = sampled.samples
        targets = [s.seq for s in samples]
        for r, s in enumerate(samples):  # forks first: a fork copies its parent as it was
            if s.index != s.seq.index:
                targets[r] = self.fork(s.group, s.seq, s.index, True)
        append, free = self.checker.append, self.block_manager.free
        for s, seq in zip(samples, targets):
            if seq.finish_reason is not None:
                continue  # (a speculated run's tokens past a stop: never emitted)
            if s.token is None:
                seq.finish_reason = "error"
                s.group.error = s.error
                free(seq)
            elif append(s.group, seq, s.token, s.logprob, s.top, s.grammar_done):
                free(seq)
        for choice in sampled.beams:
            choice.apply(self)
        now = time.monotonic()
        done = []
        for group in dict.fromkeys(item.group for item in sampled.items):
            if group.first_token_time is None:
                group.first_token_time = now
            seqs = group.seqs
            if len(seqs) > 1:
                seqs.sort(key=lambda s: s.index)
            if not seqs or (seqs[0].finish_reason is not None and group.is_finished()):
                self.finish(group, now)
                done.append(group)
        return done

    def _apply_greedy(self, sampled: Sampled) -> list[SequenceGroup]:
        """apply() for plain greedy requests: one sequence each, one token each."""
        assert sampled.tokens is not None
        append, free = self.checker.append, self.block_manager.free
        now = time.monotonic()
        done = []
        for item, token in zip(sampled.items, sampled.tokens):
            group, seq = item.group, item.seq
            if append(group, seq, token, None, None):
                free(seq)
            if group.first_token_time is None:
                group.first_token_time = now
            if seq.finish_reason is not None:  # (its one sequence)
                self.finish(group, now)
                done.append(group)
        return done

    def end(self, group: SequenceGroup, reason: str, error: str | None) -> None:
        """End `group` before its sequences do (the scheduler found it cannot run): its live
        sequences end with `reason`, every block it holds is freed."""
        self.block_manager.free_group(group)
        for seq in group.live_seqs():
            seq.finish_reason = reason
        for seq in group.seqs:
            if seq.finish_reason != "stop":  # (those that stopped have their text)
                self.checker.final_text(seq, group.params)
        group.error = error
        self.finish(group)

    @staticmethod
    def finish(group: SequenceGroup, now: float | None = None) -> None:
        group.status = SequenceStatus.FINISHED
        group.finished_time = time.monotonic() if now is None else now

    # -- what beam search's choices apply through (beam_search.SequenceOwner) --------------------
    def fork(self, group: SequenceGroup, parent: Sequence, index: int | None,
             share_blocks: bool) -> Sequence:
        """A new sequence of `group`, a copy of `parent` (`index` None: a fresh id); with
        `share_blocks` it shares the parent's blocks (a finished hypothesis needs none)."""
        seq_id = next(self.seq_ids)
        child = parent.fork(seq_id, next(self.seq_ids) if index is None else index)
        if share_blocks:
            self.block_manager.fork(parent, child)
        group.seqs.append(child)
        return child

    def free_seq(self, seq: Sequence) -> None:
        self.block_manager.free(seq)

    def hypothesis_text(self, seq: Sequence, params: SamplingParams) -> None:
        self.checker.hypothesis_text(seq, params)
