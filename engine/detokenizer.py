"""Incremental detokenization and stop strings.

A delta is released only once its bytes form whole characters: decoding a window of recent
tokens and comparing with the window minus the new tokens avoids both quadratic re-decoding and
broken UTF-8 (a character split across tokens decodes to U+FFFD until its last byte arrives).

With a byte-level vocabulary (engine/tokenizer.py's ByteTable) the same rule runs on bytes:
once the text before the new tokens ends on a whole character (anything was emitted, or the
prompt's tail is ordinary tokens whose bytes decode cleanly), the window's text is the prefix's
text plus the new tokens' bytes decoded on their own, so no decoder call is needed for ordinary
tokens.
"""

from __future__ import annotations

from typing import Any

from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.tokenizer import ByteTable

_CONTEXT = 5  # tokens of left context so leading-space rules decode as in the full text


def init_offsets(seq: Sequence) -> None:
    seq.read_offset = seq.num_prompt_tokens
    seq.prefix_offset = max(seq.num_prompt_tokens - _CONTEXT, 0)


def decode_delta(tokenizer: Any, seq: Sequence, skip_special_tokens: bool,
                 table: ByteTable | None = None) -> str:
    """Advance `seq`'s detokenizer over its newest tokens; returns the new text (maybe '')."""
    ids = seq.token_ids
    # The byte path needs a prefix that ends on a whole character: true once anything was
    # emitted (emitted text never ends in U+FFFD); of the prompt's tail, when its tokens are
    # ordinary and their bytes decode on their own.
    if table is not None and (seq.read_offset > seq.num_prompt_tokens
                              or _whole_characters(table, ids[seq.prefix_offset:seq.read_offset])):
        data = table.join(ids, seq.read_offset)
        if data is not None:
            text = data.decode("utf-8", "replace")
            if text and not text.endswith("\ufffd"):
                seq.prefix_offset = seq.read_offset
                seq.read_offset = len(ids)
                return text
            return ""
    prefix = tokenizer.decode(ids[seq.prefix_offset:seq.read_offset],
                              skip_special_tokens=skip_special_tokens)
    full = tokenizer.decode(ids[seq.prefix_offset:], skip_special_tokens=skip_special_tokens)
    if len(full) > len(prefix) and not full.endswith("\ufffd"):
        seq.prefix_offset = seq.read_offset
        seq.read_offset = len(ids)
        return full[len(prefix):]
    return ""


def _whole_characters(table: ByteTable, token_ids: list[int]) -> bool:
    """Whether `token_ids` are ordinary tokens whose bytes are whole UTF-8 characters."""
    data = table.join(token_ids, 0)
    if data is None:
        return False
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def decode_output(tokenizer: Any, seq: Sequence, num_tokens: int, skip_special_tokens: bool) -> str:
    """The text of the first `num_tokens` outputs in one go, with the same left context."""
    start = max(seq.num_prompt_tokens - _CONTEXT, 0)
    end = seq.num_prompt_tokens
    prefix = tokenizer.decode(seq.token_ids[start:end], skip_special_tokens=skip_special_tokens)
    full = tokenizer.decode(seq.token_ids[start:end + num_tokens],
                            skip_special_tokens=skip_special_tokens)
    return full[len(prefix):]


def find_stop(seq: Sequence, delta: str, params: SamplingParams) -> str | None:
    """If a stop string completed within the last delta, trim the text and return it."""
    if not params.stop or not delta:
        return None
    longest = max(len(s) for s in params.stop)
    window_start = max(len(seq.output_text) - len(delta) - longest + 1, 0)
    found = [(at, stop) for stop in params.stop
             if (at := seq.output_text.find(stop, window_start)) != -1]
    if not found:
        return None
    at, stop = min(found)
    end = at + len(stop) if params.include_stop_str_in_output else at
    seq.output_text = seq.output_text[:end]
    return stop
