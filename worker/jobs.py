"""ActiveJob: one attempt of one job inside this worker, and the reply events built from the
engine's outputs (the engine hands back FULL token lists; we send only what was not sent yet)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from engine.outputs import CompletionOutput, RequestOutput
from producer.protocol import JobSpec, done_event, encode_event, error_event, tokens_event
from worker.token_text import TokenTexts


@dataclass
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
    sent_tokens: dict[int, int] = field(default_factory=dict)
    sent_text: dict[int, str] = field(default_factory=dict)
    token_texts: TokenTexts | None = None  # set when the job asked for logprobs
    logprob_rows: dict[tuple[int, int], list[list[Any]]] = field(default_factory=dict)

    @property
    def job_id(self) -> str:
        return self.spec.id


def token_events(job: ActiveJob, output: RequestOutput) -> list[dict[str, Any]]:
    """Tokens events for what each sequence produced since the last call (and bookkeeping)."""
    events: list[dict[str, Any]] = []
    for comp in output.outputs:
        sent = job.sent_tokens.get(comp.index, 0)
        if len(comp.token_ids) <= sent:
            continue
        if job.first_token_at is None:
            job.first_token_at = time.time()
        text_sent = job.sent_text.get(comp.index, "")
        delta = comp.text[len(text_sent):] if comp.text.startswith(text_sent) else ""
        job.sent_tokens[comp.index] = len(comp.token_ids)
        job.sent_text[comp.index] = comp.text if comp.text.startswith(text_sent) else text_sent
        if job.stream_tokens:
            events.append(tokens_event(
                job.attempt, comp.index, sent, list(comp.token_ids[sent:]), delta,
                _logprobs(job, output.prompt_token_ids, comp, sent)))
    return events


def terminal_event(job: ActiveJob, output: RequestOutput) -> bytes:
    if output.error is not None or any(c.finish_reason == "error" for c in output.outputs):
        return encode_event(error_event(job.attempt, "engine_error",
                                        output.error or "the engine could not run this job"))
    now = time.time()
    outputs = [_output_map(job, output.prompt_token_ids, c)
               for c in sorted(output.outputs, key=lambda c: c.index)]
    usage = {"prompt_tokens": len(output.prompt_token_ids),
             "completion_tokens": sum(len(c.token_ids) for c in output.outputs)}
    first = job.first_token_at or now
    timing = {"queued_s": max(0.0, job.admitted_at - job.spec.created),
              "ttft_s": first - job.admitted_at, "generate_s": now - job.admitted_at}
    return encode_event(done_event(job.attempt, outputs, usage, timing))


def _output_map(job: ActiveJob, prompt_ids: list[int], comp: CompletionOutput) -> dict[str, Any]:
    out: dict[str, Any] = {"index": comp.index, "token_ids": list(comp.token_ids),
                           "text": comp.text, "finish_reason": comp.finish_reason,
                           "cumulative_logprob": None if comp.cumulative_logprob is None
                           else float(comp.cumulative_logprob),
                           "stop_reason": comp.stop_reason}
    if comp.logprobs is not None:
        out["logprobs"] = _logprobs(job, prompt_ids, comp, 0)
    return out


def _logprobs(job: ActiveJob, prompt_ids: list[int], comp: CompletionOutput,
              start: int) -> list[list[list[Any]]] | None:
    """Per position from `start`: [[token_id, logprob, text], ...], the sampled token first
    (then the top-k), each token's text as it reads right after the tokens before it."""
    if comp.logprobs is None:
        return None
    positions = []
    for pos in range(start, len(comp.logprobs)):
        top = comp.logprobs[pos]
        if job.token_texts is None:
            positions.append([[int(t), float(lp)] for t, lp in top.items()])
            continue
        row = job.logprob_rows.get((comp.index, pos))  # streamed already: reuse its texts
        if row is None:
            context = _tail(prompt_ids, comp.token_ids, pos, job.token_texts.context_size)
            texts = job.token_texts.texts(context, top)
            row = [[int(t), float(lp), texts[int(t)]] for t, lp in top.items()]
            job.logprob_rows[(comp.index, pos)] = row
        positions.append(row)
    return positions


def _tail(prompt_ids: list[int], token_ids: list[int], pos: int, size: int) -> list[int]:
    """The last `size` tokens before output position `pos` (reaching into the prompt)."""
    out = list(token_ids[max(0, pos - size):pos])
    if len(out) < size:
        out = list(prompt_ids[max(0, len(prompt_ids) - (size - len(out))):]) + out
    return out
