"""Stream chunks as JSON text: the template a plain tokens event fills gives the text json.dumps
gives for the whole chunk."""

from __future__ import annotations

import json

import pytest

from producer import openai_schema as oa
from producer.events import done_event, started_event, tokens_event
from producer.openai_choices import Choices

TEXTS = ["ab", ' "quoted" \\ back', "line\nnext\ttab", "\u00e9\u4e2d", "\U0001f600", "\x00\x1f",
         "\ue000genq-chunk-text\ue000", ""]


@pytest.mark.parametrize("kind", ["completion", "completion-echo", "chat", "chat-logprobs",
                                  "model-holding-the-mark"])
def test_stream_chunks_as_text_equal_json_dumps_of_the_chunks(kind: str) -> None:
    model = "\ue000genq-chunk-text\ue000" if kind == "model-holding-the-mark" else "tiny"
    chat = kind.startswith("chat")
    req = (oa.ChatCompletionRequest(model=model, messages=[{"role": "user", "content": "hi"}], n=2,
                                    logprobs=kind == "chat-logprobs")
           if chat else oa.CompletionRequest(model=model, prompt="hi", n=2,
                                             echo=kind == "completion-echo"))
    fast, slow = (Choices(req, chat, "cmpl-1", 7, ["hi"]) for _ in range(2))
    events = [started_event(1, "w")]
    for pos, text in enumerate(TEXTS):
        for index in (0, 1):
            rows = [[[5, -0.5]]] if kind == "chat-logprobs" else None
            events.append(tokens_event(1, index, pos, [5], text, rows))
    events.append(done_event(1, [{"index": i, "token_ids": [5] * len(TEXTS), "text": "".join(
        TEXTS), "finish_reason": "length"} for i in (0, 1)], {"prompt_tokens": 1,
                                                              "completion_tokens": 8}, {}))
    as_text = [data for e in events for data in fast.sse_data(e)]
    dumped = [json.dumps(p) for e in events for p in slow.sse_payloads(e)]
    assert as_text == dumped
    assert len(as_text) == 2 * len(TEXTS) + 2
    templated = kind in ("completion", "completion-echo", "chat")
    assert [bool(tail) for _head, tail in fast._frames.values()] == [templated] * 2 * (
        kind != "chat-logprobs")  # (the template is built once per choice, where it can be)
