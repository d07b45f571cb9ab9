"""What the engine hands back: one RequestOutput per request that progressed in a step."""

from __future__ import annotations

from dataclasses import dataclass, field


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
    metrics: dict[str, float] = field(default_factory=dict)
