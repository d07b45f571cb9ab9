"""What the engine hands back: one RequestOutput per request that progressed in a step, built
cumulative or as deltas (EngineConfig.output_kind)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine import beam_search
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence, SequenceGroup, SequenceStatus


@dataclass(slots=True)
class CompletionOutput:
    index: int  # sequence index within the request (0..n-1)
    token_ids: list[int]  # every output token so far
    text: str  # detokenized output so far (stop string excluded)
    finish_reason: str | None = None  # None while running; "stop" | "length" | "abort" | "error"
    # None unless the request asked for logprobs or ranks samples (best_of > n, beam search).
    cumulative_logprob: float | None = 0.0
    logprobs: list[dict[int, float]] | None = None  # per position: top-k ids -> logprob
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    error: str | None = None  # a message a person can act on when finish_reason == "error"
    group: SequenceGroup | None = field(default=None, repr=False, compare=False)

    @property
    def metrics(self) -> dict[str, float]:
        """arrival_time, num_preemptions and, once known, time_to_first_token and latency
        (seconds, monotonic clock), as of when read: built on demand, not at every step."""
        group = self.group
        if group is None:
            return {}
        metrics = {"arrival_time": group.arrival_time,
                   "num_preemptions": float(group.num_preemptions)}
        if group.first_token_time is not None:
            metrics["time_to_first_token"] = group.first_token_time - group.arrival_time
        if group.finished_time is not None:
            metrics["latency"] = group.finished_time - group.arrival_time
        return metrics


def request_output(group: SequenceGroup, delta: bool) -> RequestOutput | None:
    """A request's output after a step: cumulative, or with `delta` only what is new since its
    last output (ranked requests, best_of > n and beam search, output once, whole, at the end).
    None, with `delta`, when a running request has nothing new to hand out."""
    params = group.params
    finished = group.status is SequenceStatus.FINISHED
    ranked = params.best_of != params.n or params.use_beam_search
    if delta and not ranked:
        seqs = group.seqs
        if len(seqs) == 1:  # the common case, one sequence
            out = delta_output(seqs[0], params, finished)
            if out is None:
                return None
            outputs = [out]
        else:
            outputs = [o for o in (delta_output(s, params, finished) for s in seqs)
                       if o is not None]
            if not outputs and not finished:
                return None
    else:
        if ranked and not finished:
            if delta:
                return None
            seqs = []  # best_of > n and beam search pick their n outputs only at the end
        elif params.use_beam_search:
            seqs = beam_search.best(group.seqs, params, params.n)
        elif ranked:
            seqs = sorted(group.seqs, key=lambda s: -s.ranking_logprob)[: params.n]
        else:
            seqs = group.seqs
        outputs = [CompletionOutput(i if ranked else s.index,
                                    s.output_token_ids, s.output_text, s.finish_reason,
                                    s.cumulative_logprob,
                                    list(s.output_logprobs) if params.logprobs is not None
                                    else None, s.stop_reason)
                   for i, s in enumerate(seqs)]
    return RequestOutput(group.request_id, group.prompt_token_ids, outputs, finished,
                         group.error, group)


def delta_output(seq: Sequence, params: SamplingParams,
                 request_done: bool) -> CompletionOutput | None:
    """What `seq` has not handed out yet (None when nothing, unless the request ends: its last
    output names every sequence). Text a stop string could still cut stays back until then."""
    ids = seq.token_ids
    num_prompt = seq.num_prompt_tokens
    start = num_prompt + seq.num_emitted_tokens
    text = seq.output_text
    emitted_chars = seq.num_emitted_chars
    end = len(text)
    if params.stop and seq.finish_reason is None:
        end -= max(len(stop) for stop in params.stop) - 1
    if end > emitted_chars:
        new_text = text[emitted_chars:end]
        seq.num_emitted_chars = end
    elif start == len(ids) and not request_done:
        return None
    else:
        new_text = ""
    seq.num_emitted_tokens = len(ids) - num_prompt
    return CompletionOutput(seq.index, ids[start:], new_text, seq.finish_reason,
                            seq.cumulative_logprob,
                            None if params.logprobs is None
                            else seq.output_logprobs[start - num_prompt:],
                            seq.stop_reason)
