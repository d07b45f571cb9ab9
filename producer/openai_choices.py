"""One request's OpenAI choices and stream chunks from genq's done and tokens events, with what
a request may add to a choice: `echo` (the prompt's text before each completion's) and logprobs
(producer/openai_logprobs.py).

A stream keeps per-choice state: which choices have started (the first chat chunk carries the
role, the first completions chunk the echoed prompt) and, for completions logprobs, the character
offset where the next token's text starts.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from producer import openai_schema as oa
from producer.gateway_fleet import error_status
from producer.openai_logprobs import chat_logprobs, completion_logprobs

Request = oa.CompletionRequest | oa.ChatCompletionRequest


class Choices:
    def __init__(self, req: Request, chat: bool, response_id: str, created: int,
                 prompts: list[str | list[int]]) -> None:
        self.req = req
        self.chat = chat
        self.response_id = response_id
        self.created = created
        self.k = req.logprobs_k
        self.top_n = 0  # chat: how many alternatives each token lists
        if isinstance(req, oa.ChatCompletionRequest):
            self.top_n = req.top_logprobs or 0
        echo = isinstance(req, oa.CompletionRequest) and req.echo
        # The text echoed before each prompt's completions (a chat has no prompts: one job).
        self.echoes = [p if echo and isinstance(p, str) else "" for p in prompts] or [""]
        self.started: set[int] = set()  # streamed choices that had their first chunk
        self.offsets: dict[int, int] = {}  # streamed choice -> text offset of its next token
        self._frames: dict[int, tuple[str, str]] = {}  # choice -> its text chunk around the text

    def _logprobs(self, rows: list[Any] | None, offset: int) -> tuple[dict[str, Any] | None, int]:
        if self.k is None or rows is None:
            return None, offset
        if self.chat:
            return chat_logprobs(rows, self.top_n), offset
        return completion_logprobs(rows, offset)

    # ------------------------------------------------------------------ whole answers

    def choice(self, prompt_index: int, out: Mapping[str, Any]) -> dict[str, Any]:
        """The choice for one done output of the job of prompts[prompt_index]."""
        echo = self.echoes[prompt_index]
        logprobs, _ = self._logprobs(out.get("logprobs"), len(echo))
        return oa.choice(prompt_index * self.req.n + out["index"], echo + out["text"],
                         out["finish_reason"], self.chat, logprobs)

    # ------------------------------------------------------------------ streams (one prompt)

    def _chunk(self, index: int, text: str | None, reason: str | None,
               rows: list[Any] | None) -> dict[str, Any]:
        first = index not in self.started
        self.started.add(index)
        if first and self.echoes[0]:
            text = self.echoes[0] + (text or "")
        offset = self.offsets.get(index, len(self.echoes[0]))
        logprobs, self.offsets[index] = self._logprobs(rows, offset)
        return oa.chunk(self.response_id, self.req.model, self.created, index, text, reason,
                        self.chat, first, logprobs)

    def restart_error(self, event: Mapping[str, Any]) -> dict[str, Any] | None:
        """A `restart` (a replay after a failover that diverged from what was streamed) once
        text went out: OpenAI's stream has no way to take text back, so the stream ends with
        this error object; before any text, the restart changes nothing."""
        if event["type"] != "restart" or not self.started:
            return None
        return oa.GatewayError(
            502, "the job was run again after a worker failed and produced other tokens than "
            "those already streamed: the streamed text is void; the request's full result is "
            "the new run's (the same request with stream=false returns it)", type_="server_error",
            code="stream_restarted").body()

    def sse_data(self, event: Mapping[str, Any]) -> list[str]:
        """sse_payloads as JSON text. A tokens event of a choice past its first chunk, without
        logprobs (each streamed token of most streams), fills a template of its chunk: the
        same text json.dumps gives for the whole chunk, for the cost of dumping its text."""
        if event["type"] == "tokens" and self.k is None and event["index"] in self.started:
            around = self._frames.get(event["index"])
            if around is None:
                parts = json.dumps(self._chunk(event["index"], _MARK, None, None)).split(
                    json.dumps(_MARK))
                around = self._frames[event["index"]] = \
                    (parts[0], parts[1]) if len(parts) == 2 else ("", "")
            if around[1]:  # (else the mark was in the id or the model name: no template)
                return [around[0] + json.dumps(event["text"]) + around[1]]
        return [json.dumps(data) for data in self.sse_payloads(event)]

    def sse_payloads(self, event: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The SSE data objects one genq event becomes (restart and started become none)."""
        kind = event["type"]
        if kind == "tokens":
            return [self._chunk(event["index"], event["text"], None, event.get("logprobs"))]
        if kind == "done":  # a sequence never streamed (beam search, best_of > n) comes whole
            out = []
            for o in event["outputs"]:
                whole = o["index"] not in self.started
                out.append(self._chunk(o["index"], o["text"] if whole else None,
                                       o["finish_reason"], o.get("logprobs") if whole else None))
            if self.req.include_usage:
                u = event["usage"]
                out.append(oa.usage_chunk(self.response_id, self.req.model, self.created,
                                          oa.usage(u["prompt_tokens"], u["completion_tokens"]),
                                          self.chat))
            return out
        if kind == "error":
            return [error_status(event).body()]
        return []


_MARK = "\ue000genq-chunk-text\ue000"  # (a private-use mark no chunk's frame holds)
