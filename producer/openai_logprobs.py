"""Logprobs in OpenAI's two shapes, from the rows genq's reply events carry: per position
[[token_id, logprob, text], ...], the sampled token first, then the top-k (producer/events.py,
Logprobs).

- Completions (legacy): {"tokens", "token_logprobs", "top_logprobs", "text_offset"}. Each
  top_logprobs map holds the sampled token and the top `logprobs` tokens, so up to logprobs + 1
  entries (what OpenAI documents); text_offset is each token's character offset in the choice's
  text (after the echoed prompt, with echo).
- Chat: {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}], "refusal": None}, with
  exactly the `top_logprobs` most likely tokens, most likely first.

A logprob of -inf (a token the sampler ruled out) is sent as -9999.0, since JSON has no infinity
(vLLM does the same). A row without a text (a worker older than this gateway) shows its token as
"token_id:<id>".
"""

from __future__ import annotations

import math
from typing import Any

FLOOR = -9999.0
Row = list[list[Any]]  # one position: [[token_id, logprob, text], ...], the sampled token first


def logprob(value: Any) -> float:
    value = float(value)
    return FLOOR if math.isnan(value) or value < FLOOR else value


def token_text(entry: list[Any]) -> str:
    return str(entry[2]) if len(entry) > 2 else f"token_id:{int(entry[0])}"


def _most_likely_first(row: Row) -> Row:
    return sorted(row, key=lambda entry: -logprob(entry[1]))  # stable: ties keep wire order


def completion_logprobs(rows: list[Row], offset: int) -> tuple[dict[str, Any], int]:
    """The completions shape for `rows`, whose first token starts at character `offset`;
    returns it and the offset after the last token."""
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float]] = []
    text_offset: list[int] = []
    for row in rows:
        text = token_text(row[0])
        tokens.append(text)
        token_logprobs.append(logprob(row[0][1]))
        text_offset.append(offset)
        offset += len(text)
        top: dict[str, float] = {}
        for entry in _most_likely_first(row):  # two ids with one text: the likelier one shows
            top.setdefault(token_text(entry), logprob(entry[1]))
        top_logprobs.append(top)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": text_offset}, offset


def _chat_token(entry: list[Any]) -> dict[str, Any]:
    text = token_text(entry)
    return {"token": text, "logprob": logprob(entry[1]), "bytes": list(text.encode())}


def chat_logprobs(rows: list[Row], top_n: int) -> dict[str, Any]:
    """The chat shape for `rows`, with the `top_n` most likely tokens of each position."""
    content = [{**_chat_token(row[0]),
                "top_logprobs": [_chat_token(e) for e in _most_likely_first(row)[:top_n]]}
               for row in rows]
    return {"content": content, "refusal": None}
