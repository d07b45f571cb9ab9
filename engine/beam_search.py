"""Beam search, step by step, with transformers' semantics.

Each step scores every (beam, token) pair by the beam's cumulative logprob plus the token's, and
takes the best 2 x width candidates. In rank order: a candidate among the top `width` that ends
(EOS, or the last allowed token) becomes a finished hypothesis, scored
cumulative / generated_length ** length_penalty; other candidates become the next beams until
there are `width` of them. The request keeps its `width` best hypotheses and returns the n best.

The engine chooses (choose: logits in, candidates out, nothing changed); the scheduler's update
applies the choice (BeamChoice.apply) through the sequence owner it is: forks, appends, frees.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from engine.sampling_params import SamplingParams
from engine.sequence import Sequence, SequenceGroup


class SequenceOwner(Protocol):
    """What applying a choice needs of the owner of the group's sequences (the scheduler)."""

    def fork(self, group: SequenceGroup, parent: Sequence, index: int | None,
             share_blocks: bool) -> Sequence: ...

    def free_seq(self, seq: Sequence) -> None: ...

    def hypothesis_text(self, seq: Sequence, params: SamplingParams) -> None: ...


@dataclass
class Candidate:
    parent: Sequence
    token: int
    logprob: float
    cumulative: float
    finishes: bool  # EOS or the last allowed token: the candidate is a hypothesis, not a beam


def score(cumulative: float, length: int, length_penalty: float) -> float:
    """Hugging Face's cumulative / length ** length_penalty, in IEEE doubles that saturate (a
    huge penalty gives inf or 0 and a score of -0.0 or -inf) instead of raising OverflowError
    or ZeroDivisionError as Python floats do; the same value otherwise."""
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        return float(np.float64(cumulative) / np.power(np.float64(max(length, 1)),
                                                       np.float64(length_penalty)))


def select(beams: list[Sequence], logits: torch.Tensor, width: int, eos_ids: set[int],
           params: SamplingParams, last_step: bool) -> tuple[list[Candidate], list[Candidate]]:
    """The next beams and the new hypotheses from `beams`' logits rows."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    base = torch.tensor([b.ranking_logprob for b in beams], device=logprobs.device)
    totals = (logprobs + base[:, None]).view(-1)
    top, flat = totals.topk(min(2 * width, totals.numel()))
    vocab = logprobs.shape[1]
    next_beams: list[Candidate] = []
    hypotheses: list[Candidate] = []
    for rank, (total, index) in enumerate(zip(top.tolist(), flat.tolist())):
        parent, token = beams[index // vocab], index % vocab
        ends = not params.ignore_eos and token in eos_ids
        cand = Candidate(parent, token, float(logprobs[index // vocab, token]), total,
                         ends or last_step)
        if cand.finishes:
            if rank < width:
                hypotheses.append(cand)
            continue
        if len(next_beams) < width:
            next_beams.append(cand)
    return next_beams, hypotheses


def is_done(hypotheses: list[Sequence], beams: list[Sequence], params: SamplingParams,
            width: int, max_new_tokens: int) -> bool:
    """transformers' stopping rule once `width` hypotheses exist (`max_new_tokens`: the most
    tokens a beam may reach, max_tokens or what max_model_len leaves)."""
    if not beams:
        return True
    if len(hypotheses) < width:
        return False
    if params.early_stopping is True:
        return True
    worst = min(score(h.ranking_logprob, h.num_output_tokens, params.length_penalty)
                for h in hypotheses)
    length = beams[0].num_output_tokens
    if params.early_stopping == "never" and params.length_penalty > 0.0:
        length = max_new_tokens
    best = max(b.ranking_logprob for b in beams)
    return worst >= score(best, length, params.length_penalty)


def best(hypotheses: list[Sequence], params: SamplingParams, keep: int) -> list[Sequence]:
    return sorted(hypotheses, key=lambda h: -score(h.ranking_logprob, h.num_output_tokens,
                                                   params.length_penalty))[:keep]


def choose(group: SequenceGroup, members: list[tuple[Sequence, int]], logits: torch.Tensor,
           eos_ids: set[int], max_model_len: int) -> BeamChoice:
    """One beam-search step of `group`: its live beams `members` (sequence, logits row) pick
    their candidates."""
    params, width = group.params, group.width
    live = [seq for seq, _ in members]
    rows = logits[torch.tensor([r for _, r in members], device=logits.device)]
    max_new = max_model_len - group.num_prompt_tokens
    if params.max_tokens is not None:
        max_new = min(max_new, params.max_tokens)
    last = live[0].num_output_tokens + 1 >= max_new
    next_beams, finished = select(live, rows, width, eos_ids, params, last)
    return BeamChoice(group, live, next_beams, finished, eos_ids, max_new)


@dataclass
class BeamChoice:
    group: SequenceGroup
    live: list[Sequence]  # the beams that chose
    next_beams: list[Candidate]
    finished: list[Candidate]
    eos_ids: set[int]
    max_new: int  # the most tokens a beam may reach

    @property
    def num_tokens(self) -> int:
        """Tokens the choice appends: one per next beam and per new hypothesis."""
        return len(self.next_beams) + len(self.finished)

    def apply(self, owner: SequenceOwner) -> None:
        """Beams that continue fork (sharing blocks), finished hypotheses are kept up to the
        width, dropped beams free their blocks."""
        group, params, width = self.group, self.group.params, self.group.width
        reused: set[int] = set()
        targets = []
        for cand in self.next_beams + self.finished:  # forks first: they copy the parent
            if not cand.finishes and id(cand.parent) not in reused:
                reused.add(id(cand.parent))
                targets.append(cand.parent)
                continue
            targets.append(owner.fork(group, cand.parent, None, not cand.finishes))
        for cand, seq in zip(self.next_beams + self.finished, targets):
            seq.token_ids.append(cand.token)
            seq.cumulative_logprob = cand.cumulative
            if cand.finishes:
                seq.finish_reason = "stop" if cand.token in self.eos_ids \
                    and not params.ignore_eos else "length"
                owner.hypothesis_text(seq, params)
        dropped = [s for s in self.live if id(s) not in reused]
        hypotheses = best([s for s in group.seqs if s.finished], params, width)
        beams_now = [s for s in group.live_seqs() if id(s) not in {id(d) for d in dropped}]
        if is_done(hypotheses, beams_now, params, width, self.max_new):
            dropped, beams_now = dropped + beams_now, []
        keep = {id(s) for s in hypotheses} | {id(s) for s in beams_now}
        for seq in dropped:
            owner.free_seq(seq)
        group.seqs = [s for s in group.seqs if id(s) in keep]
