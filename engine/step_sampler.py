"""StepSampler: a step's logits -> what it sampled (Sampled), changing no sequence.

Logits row r belongs to the r-th scheduled sequence that samples. Each such sequence gets one
sample row, except the first sample of a best_of group, which fans out into best_of rows (one
per sequence the group forks into). min_tokens bans EOS and the stop ids; structured outputs
mask what the grammar refuses; beam-search groups choose their candidates together. A batch of
plain greedy requests needs no sample rows: its tokens are the argmax of each row; nor does
one of greedy requests some of which a grammar constrains (each takes the argmax of what it
allows).
"""

from __future__ import annotations

import torch

from engine import beam_search
from engine.sampler import Sampler, SampleRow, greedy_but_grammar
from engine.scheduler_output import Sample, Sampled, ScheduledSeq
from engine.sequence import Sequence, SequenceGroup
from engine.structured_outputs import StructuredOutputs
from engine.token_masks import fix_disallowed


class StepSampler:
    def __init__(self, sampler: Sampler, structured: StructuredOutputs, eos_token_ids: set[int],
                 vocab_size: int, max_model_len: int) -> None:
        self.sampler = sampler
        self.structured = structured
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len

    def __call__(self, batch: list[ScheduledSeq], logits: torch.Tensor) -> Sampled:
        items = [item for item in batch if item.do_sample]  # logits row r <-> items[r]
        if all(item.group.plain_greedy for item in items):  # the common case: argmax only
            tokens = self.sampler.greedy(logits) if items else []
            return Sampled(items, tokens, num_generated=len(tokens))
        if all(item.group.plain_greedy or greedy_but_grammar(item.group.params)
               for item in items):
            constrained = self._greedy_under_grammars(items, logits)
            if constrained is not None:
                return Sampled(items, constrained, num_generated=len(constrained))
        sampled = Sampled(items)
        rows: list[SampleRow] = []
        row_index: list[int] = []  # per sample row, its logits row
        grammar_rows: list[int] = []  # rows the grammar masks, and the seq each one extends
        grammar_seqs: list[Sequence] = []
        beams: dict[int, tuple[SequenceGroup, list[tuple[Sequence, int]]]] = {}
        samples: list[Sample] = []  # per sample row, what it extends (its token comes later)
        failed: list[Sample] = []
        eos = self.eos_token_ids
        fanned = False
        for r, item in enumerate(items):
            group, seq = item.group, item.seq
            params = group.params
            if params.use_beam_search:
                beams.setdefault(id(group), (group, []))[1].append((seq, r))
                continue
            num_out = len(seq.token_ids) - seq.num_prompt_tokens
            done = False
            if params.structured_outputs is not None:
                done, error = self.structured.sync(group, seq)
                if error is not None:  # (an output token the grammar refuses: a bug)
                    failed.append(Sample(group, seq, seq.index, None, error=error))
                    fanned = True  # (a logits row without a sample row: rows are re-indexed)
                    continue
            banned = None
            # min_tokens bans EOS and stop ids unless the grammar is complete and allows only
            # EOS: then EOS may end it early (vLLM's rule).
            if num_out < params.min_tokens and not done:
                banned = params.stop_token_ids + ([] if params.ignore_eos else sorted(eos))
            for index in _sample_indexes(group, seq):
                if params.structured_outputs is not None:
                    grammar_rows.append(len(rows))
                    grammar_seqs.append(seq)
                rows.append(SampleRow(params, group.seed, index, num_out, seq.token_ids,
                                      seq.num_prompt_tokens, banned))
                samples.append(Sample(group, seq, index, None, grammar_done=done))
                row_index.append(r)
            fanned = fanned or _fans_out(group)
        if rows:
            self._draw(rows, samples, logits, row_index if fanned or beams else None,
                       grammar_rows, grammar_seqs)
        sampled.samples = failed + samples
        for group, members in beams.values():
            sampled.beams.append(beam_search.choose(group, members, logits[:, : self.vocab_size],
                                                    eos, self.max_model_len))
        sampled.num_generated = len(rows) + sum(c.num_tokens for c in sampled.beams)
        return sampled

    def _greedy_under_grammars(self, items: list[ScheduledSeq],
                               logits: torch.Tensor) -> list[int] | None:
        """The tokens of a batch of greedy requests, some constrained (no min_tokens, so a
        complete grammar changes nothing but the mask). None when a constrained row has no
        token to take: the general path then ends it with its error."""
        rows = [r for r, item in enumerate(items)
                if item.group.params.structured_outputs is not None]
        if self.structured.sync_all([(items[r].group, items[r].seq) for r in rows]) is not None:
            return None
        seqs = [items[r].seq for r in rows]
        tokens = self.sampler.greedy(logits)
        packed, add = self.structured.packed(seqs)
        if not fix_disallowed(logits, tokens, rows, packed, self.vocab_size, add):
            return None
        return tokens

    def _draw(self, rows: list[SampleRow], samples: list[Sample], logits: torch.Tensor,
              row_index: list[int] | None, grammar_rows: list[int],
              grammar_seqs: list[Sequence]) -> None:
        """Sample `rows` (logits rows `row_index`; None: one per logits row, in order) into
        `samples`; a row where nothing may be drawn gets an error instead."""
        if row_index is not None:  # fan-out rows repeat their parent's row, beam rows go elsewhere
            logits = logits[torch.tensor(row_index, device=logits.device)]
        if grammar_seqs:
            allowed = self.structured.masks(grammar_seqs, logits.device)
            result = self.sampler(logits, rows, grammar_rows, allowed)
        else:
            result = self.sampler(logits, rows)
        for r, (sample, token, lp, top) in enumerate(zip(
                samples, result.token_ids, result.logprobs, result.top_logprobs)):
            if r in result.no_token_rows:
                position = sample.seq.num_output_tokens
                sample.error = (f"no token is allowed at output position {position}: the "
                                "grammar, allowed_token_ids and the min_tokens ban of EOS leave "
                                "none")
                continue
            sample.token, sample.logprob, sample.top = token, lp, top


def _fans_out(group: SequenceGroup) -> bool:
    """The first sample of a best_of group: one sample row per sequence it forks into."""
    return group.params.best_of != 1 and not group.forked


def _sample_indexes(group: SequenceGroup, seq: Sequence) -> list[int] | range:
    """The sequence indexes of the sample rows `seq` draws this step."""
    return range(group.width) if _fans_out(group) else [seq.index]
