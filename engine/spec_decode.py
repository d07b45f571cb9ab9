"""Speculator: speculative decoding that never changes an output.

Each step, before scheduling, every running sequence that decodes gets up to k proposals
(propose; a draft model's are placeholders until the schedule is known, then fill() runs the
draft over what was scheduled, in slots the target's table holds by then). The scheduler runs
such a sequence with 1 + len(proposals) query tokens (its last token, then the proposals) in
the one forward pass, chunked-prefill style, and the model runner returns logits for every one
of those positions. Verification (sample) draws each position j exactly as plain decoding
would draw output position num_out + j: the same processors (min_tokens' ban, logit_bias,
penalties over the tokens before j, temperature, top-k/p, min-p) and the same position-keyed
noise (engine/sampler.py). It accepts proposals while the drawn token equals the proposal; the
first mismatch's drawn token is emitted too, and so is the token drawn after a fully accepted
run. So the emitted tokens are exactly plain decoding's, greedy or sampled, seeded or not. The
stop checker then appends them one at a time and drops those past a stop
(Postprocessor.apply), and Scheduler.update gives back the KV slots of rejected tokens: the
sequence keeps the blocks its computed tokens fill, as after plain decoding.

Not speculated: beam search (refused at add_request: its beams advance together, one token
each), structured outputs (the grammar's mask is known one token ahead only), a best_of group
before it forks, and every sequence in a step while the engine holds more requests (running,
waiting or swapped) than disable_by_batch_size.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from engine.sampler import Sampler, SampleRow, has_penalty
from engine.sampling_params import SamplingParams
from engine.scheduler_output import Sample, Sampled, ScheduledSeq
from engine.sequence import SequenceGroup
from engine.spec_config import SpeculativeConfig
from engine.spec_draft import DraftModel
from engine.spec_proposer import NgramProposer
from engine.step_sampler import StepSampler


class Speculator:
    def __init__(self, config: SpeculativeConfig, sampler: Sampler, eos_token_ids: set[int],
                 max_model_len: int, draft: DraftModel | None = None) -> None:
        self.config = config
        self.draft = draft  # None: n-gram proposals
        self.k = config.num_speculative_tokens
        self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.sampler = sampler
        self.eos_token_ids = sorted(eos_token_ids)
        self.max_model_len = max_model_len
        # vLLM's names: drafts (sequences verified with proposals), draft tokens, accepted
        # tokens; emitted: what verification handed to the stop checker (accepted + 1 each).
        self.counters = {"spec_decode_num_drafts": 0, "spec_decode_num_draft_tokens": 0,
                         "spec_decode_num_accepted_tokens": 0,
                         "spec_decode_num_emitted_tokens": 0}
        self.accepted_per_pos = [0] * self.k  # drafts whose position j was accepted
        self.drafts_per_pos = [0] * self.k  # drafts that proposed a position j

    @staticmethod
    def check(params: SamplingParams) -> None:
        """Refuse what speculation does not serve (add_request calls it when it is on)."""
        if params.use_beam_search:
            raise ValueError("beam search cannot run with speculative decoding (its beams "
                             "advance together, one token each): start the engine without "
                             "speculative_config to use it")

    # -- before scheduling -----------------------------------------------------------------------
    def propose(self, running: Iterable[SequenceGroup],
                num_requests: int) -> dict[int, list[int]]:
        """Proposals per seq_id for the running sequences that decode this step (none while
        the engine holds more than disable_by_batch_size requests)."""
        limit = self.config.disable_by_batch_size
        if limit is not None and num_requests > limit:
            return {}
        proposals: dict[int, list[int]] = {}
        for group in running:
            params = group.params
            if params.structured_outputs is not None or not group.forked:
                continue
            for seq in group.seqs:
                ids = seq.token_ids
                if seq.finish_reason is not None or len(ids) - seq.num_computed_tokens != 1:
                    continue
                # Every proposal a position the model has and an output max_tokens allows
                # (the token drawn after the proposals is one more).
                k = min(self.k, self.max_model_len - len(ids))
                if params.max_tokens is not None:
                    k = min(k, params.max_tokens - (len(ids) - seq.num_prompt_tokens) - 1)
                if k <= 0:
                    continue
                if self.draft is not None:  # (placeholders: the draft fills what is scheduled)
                    proposals[seq.seq_id] = [0] * k
                elif proposal := self.proposer.propose(ids, k):
                    proposals[seq.seq_id] = proposal
        return proposals

    def fill(self, batch: list[ScheduledSeq]) -> None:
        """After scheduling: the draft model's proposals for the scheduled placeholders."""
        if self.draft is not None:
            items = [item for item in batch if item.spec_token_ids]
            if items:
                self.draft.propose(items)

    # -- after the forward pass ------------------------------------------------------------------
    def sample(self, batch: list[ScheduledSeq], logits: torch.Tensor,
               step_sampler: StepSampler) -> Sampled:
        """What `batch` sampled; a speculated sequence's logits rows are its 1 + k positions."""
        items = [item for item in batch if item.do_sample]
        if not any(item.spec_token_ids for item in items):
            return step_sampler(batch, logits)
        plain: list[ScheduledSeq] = []
        plain_rows: list[int] = []
        spec: list[tuple[ScheduledSeq, int]] = []
        r = 0
        for item in items:
            if item.spec_token_ids:
                spec.append((item, r))
                r += 1 + len(item.spec_token_ids)
            else:
                plain.append(item)
                plain_rows.append(r)
                r += 1
        if plain:
            rows_t = torch.tensor(plain_rows, device=logits.device)
            sampled = step_sampler(plain, logits[rows_t])
        else:
            sampled = Sampled([])
        if sampled.tokens is not None:  # (plain greedy rows: one token each, no logprobs)
            sampled.samples = [Sample(i.group, i.seq, i.seq.index, t)
                               for i, t in zip(sampled.items, sampled.tokens)]
            sampled.tokens = None
        verified = self._verify(spec, logits)
        sampled.items = plain + [item for item, _ in spec]
        sampled.samples += verified
        sampled.num_generated += len(verified)
        sampled.speculated = [item for item, _ in spec]
        return sampled

    def _verify(self, spec: list[tuple[ScheduledSeq, int]], logits: torch.Tensor) -> list[Sample]:
        """Each speculated sequence's emitted tokens: the drawn tokens up to and including the
        first that differs from its proposal."""
        index = [start + j for item, start in spec
                 for j in range(1 + len(item.spec_token_ids or ()))]
        sub = logits[torch.tensor(index, device=logits.device)]
        no_token: frozenset[int] = frozenset()
        logprobs: list[float | None] | None = None
        tops: list[dict[int, float] | None] | None = None
        if all(item.group.plain_greedy for item, _ in spec):
            drawn = self.sampler.greedy(sub)
        else:
            result = self.sampler(sub, [row for item, _ in spec for row in self._rows(item)])
            drawn, no_token = result.token_ids, result.no_token_rows
            logprobs, tops = result.logprobs, result.top_logprobs
        samples: list[Sample] = []
        c = self.counters
        r = 0
        for item, _ in spec:
            group, seq, proposal = item.group, item.seq, item.spec_token_ids or []
            num = len(proposal)
            accepted = 0
            for j in range(num + 1):
                row = r + j
                if row in no_token:
                    samples.append(Sample(group, seq, seq.index, None, error=(
                        f"no token is allowed at output position {seq.num_output_tokens + j}: "
                        "allowed_token_ids and the min_tokens ban of EOS leave none")))
                    break
                token = drawn[row]
                samples.append(Sample(group, seq, seq.index, token,
                                      None if logprobs is None else logprobs[row],
                                      None if tops is None else tops[row]))
                if j == num or token != proposal[j]:
                    break
                accepted += 1
            r += num + 1
            c["spec_decode_num_drafts"] += 1
            c["spec_decode_num_draft_tokens"] += num
            c["spec_decode_num_accepted_tokens"] += accepted
            c["spec_decode_num_emitted_tokens"] += accepted + 1
            for j in range(num):
                self.drafts_per_pos[j] += 1
                self.accepted_per_pos[j] += j < accepted
        return samples

    def _rows(self, item: ScheduledSeq) -> list[SampleRow]:
        """The sample rows of a speculated sequence's positions: row j draws output position
        num_out + j as if proposals 0..j-1 had been appended."""
        group, seq, proposal = item.group, item.seq, item.spec_token_ids or []
        params = group.params
        num_out = seq.num_output_tokens
        penalised = has_penalty(params)
        ban = params.stop_token_ids + ([] if params.ignore_eos else self.eos_token_ids)
        return [SampleRow(params, group.seed, seq.index, num_out + j,
                          seq.token_ids + proposal[:j] if penalised and j else seq.token_ids,
                          seq.num_prompt_tokens, ban if num_out + j < params.min_tokens else None)
                for j in range(len(proposal) + 1)]

    def stats(self) -> dict[str, Any]:
        c = self.counters
        return {**c,
                "spec_decode_acceptance_rate": c["spec_decode_num_accepted_tokens"]
                / max(c["spec_decode_num_draft_tokens"], 1),
                "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_pos),
                "spec_decode_acceptance_rate_per_pos": [
                    a / max(d, 1) for a, d in zip(self.accepted_per_pos, self.drafts_per_pos)]}
