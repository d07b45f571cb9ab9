"""ActiveJob: one attempt of one job inside this worker, and the reply events built from the
engine's delta outputs (EngineConfig.output_kind == "delta": each output holds only what is
new; the job keeps the whole of it for the done event)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from engine.outputs import CompletionOutput, RequestOutput
from producer.events import (
    Event,
    Logprobs,
    Output,
    TokensEvent,
    done_event,
    encode_event,
    error_event,
    tokens_event,
)
from producer.protocol import JobSpec
from worker.token_text import TokenTexts


@dataclass(slots=True)
class ActiveJob:
    entry_id: str  # the job-stream entry; also the engine request id (unique per attempt)
    deliveries: int  # with this worker's name: the fencing token of the attempt
    attempt: int
    spec: JobSpec
    fields: dict[bytes, bytes]  # the raw entry, re-added as-is when a draining worker hands back
    reply_key: str
    stream_tokens: bool
    admitted_at: float = field(default_factory=time.time)
    first_token_at: float | None = None
    # What each sequence produced so far, from the engine's delta outputs.
    token_ids: dict[int, list[int]] = field(default_factory=dict)
    texts: dict[int, list[str]] = field(default_factory=dict)
    top_logprobs: dict[int, list[dict[int, float]]] = field(default_factory=dict)
    token_texts: TokenTexts | None = None  # set when the job asked for logprobs
    logprob_rows: dict[tuple[int, int], list[list[Any]]] = field(default_factory=dict)
    # --stream-interval: a sequence's tokens go out every `stream_interval` tokens (the first
    # at once, the rest when it ends); `streamed` counts those sent, `held_text` what they read.
    stream_interval: int = 1
    streamed: dict[int, int] = field(default_factory=dict)
    held_text: dict[int, str] = field(default_factory=dict)

    @property
    def job_id(self) -> str:
        return self.spec.id


def token_events(job: ActiveJob, output: RequestOutput) -> tuple[list[Event], int]:
    """Take in one delta output: the tokens events for it (none when the job does not stream)
    and how many tokens it brought."""
    events: list[Event] = []
    new_tokens = 0
    for comp in output.outputs:
        index, new, text = comp.index, comp.token_ids, comp.text
        ids = job.token_ids.get(index)
        if ids is None:
            ids = job.token_ids[index] = []
            job.texts[index] = []
        pos = len(ids)
        ids += new
        if text:
            job.texts[index].append(text)
        if comp.logprobs:
            job.top_logprobs.setdefault(index, []).extend(comp.logprobs)
        if job.stream_interval > 1 and job.stream_tokens:
            new_tokens += len(new)
            event = _interval_event(job, output, comp, ids)
            if event is not None:
                events.append(event)
            continue
        if not new:
            continue  # text without a token (held back until the end) goes in the done event
        new_tokens += len(new)
        if job.stream_tokens:
            logprobs = None if comp.logprobs is None \
                else _logprobs(job, output.prompt_token_ids, index, pos)
            events.append(tokens_event(job.attempt, index, pos, new, text, logprobs))
    if new_tokens and job.first_token_at is None:
        job.first_token_at = time.time()
    return events, new_tokens


def _interval_event(job: ActiveJob, output: RequestOutput, comp: CompletionOutput,
                    ids: list[int]) -> TokensEvent | None:
    """The tokens event of sequence `comp.index` under a stream interval, when one is due: its
    first token, then every `stream_interval` tokens, and what is left when it ends."""
    index = comp.index
    sent = job.streamed.get(index, 0)
    if comp.text:
        job.held_text[index] = job.held_text.get(index, "") + comp.text
    ended = output.finished or comp.finish_reason is not None
    if len(ids) == sent or not (sent == 0 or len(ids) - sent >= job.stream_interval or ended):
        return None
    job.streamed[index] = len(ids)
    text = job.held_text.pop(index, "")
    logprobs = _logprobs(job, output.prompt_token_ids, index, sent) \
        if index in job.top_logprobs else None
    return tokens_event(job.attempt, index, sent, ids[sent:], text, logprobs)


def terminal_event(job: ActiveJob, output: RequestOutput) -> bytes:
    if output.error is not None or any(c.finish_reason == "error" for c in output.outputs):
        return encode_event(error_event(job.attempt, "engine_error",
                                        output.error or "the engine could not run this job"))
    now = time.time()
    outputs = [_output_map(job, output.prompt_token_ids, c)
               for c in sorted(output.outputs, key=lambda c: c.index)]
    usage = {"prompt_tokens": len(output.prompt_token_ids),
             "completion_tokens": sum(len(o["token_ids"]) for o in outputs)}
    first = job.first_token_at or now
    timing = {"queued_s": max(0.0, job.admitted_at - job.spec.created),
              "ttft_s": first - job.admitted_at, "generate_s": now - job.admitted_at}
    return encode_event(done_event(job.attempt, outputs, usage, timing))


def _output_map(job: ActiveJob, prompt_ids: list[int], comp: CompletionOutput) -> Output:
    """One sequence's whole output. A ranked request (best_of > n, beam search) outputs only at
    the end, whole, under indices of its own: its final output is all there is."""
    index = comp.index
    out: Output = {"index": index, "token_ids": job.token_ids.get(index, []),
                   "text": "".join(job.texts.get(index, [])),
                   "finish_reason": comp.finish_reason,
                   "cumulative_logprob": None if comp.cumulative_logprob is None
                   else float(comp.cumulative_logprob),
                   "stop_reason": comp.stop_reason}
    if comp.logprobs is not None:
        out["logprobs"] = _logprobs(job, prompt_ids, index, 0)
    return out


def _logprobs(job: ActiveJob, prompt_ids: list[int], index: int,
              start: int) -> Logprobs:
    """Per position from `start`: [[token_id, logprob, text], ...], the sampled token first
    (then the top-k), each token's text as it reads right after the tokens before it."""
    tops = job.top_logprobs.get(index, [])
    token_ids = job.token_ids.get(index, [])
    positions = []
    for pos in range(start, len(tops)):
        top = tops[pos]
        if job.token_texts is None:
            positions.append([[int(t), float(lp)] for t, lp in top.items()])
            continue
        row = job.logprob_rows.get((index, pos))  # streamed already: reuse its texts
        if row is None:
            context = _tail(prompt_ids, token_ids, pos, job.token_texts.context_size)
            texts = job.token_texts.texts(context, top)
            row = [[int(t), float(lp), texts[int(t)]] for t, lp in top.items()]
            job.logprob_rows[(index, pos)] = row
        positions.append(row)
    return positions


def _tail(prompt_ids: list[int], token_ids: list[int], pos: int, size: int) -> list[int]:
    """The last `size` tokens before output position `pos` (reaching into the prompt)."""
    out = list(token_ids[max(0, pos - size):pos])
    if len(out) < size:
        out = list(prompt_ids[max(0, len(prompt_ids) - (size - len(out))):]) + out
    return out
