"""The text of single tokens, for logprobs: what each token adds to the text after the tokens
before it. Decoding a token alone is wrong for tokenizers that drop a leading space at the start
of a text (SentencePiece's "▁the" decodes to "the"), so each token is decoded after a short
window of its real context, and the context's own text is cut off (as engine/detokenizer.py does
for the streamed text; vLLM does the same for logprobs).

UTF-8: a token that ends inside a character adds no text yet (""); the token that completes the
character carries all of it. So the texts of a sequence's tokens concatenate to its text, as the
streamed deltas do. A context window that would start inside a character is widened (by at most
three tokens: a character has at most four bytes) so that its text starts cleanly. Special tokens
keep their text ("</s>"), unlike the output text.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from os.path import commonprefix
from typing import Any

REPLACEMENT = "\ufffd"  # what a decoder makes of bytes that are not (yet) a whole character
_WIDEN = 3


class TokenTexts:
    def __init__(self, tokenizer: Any, window: int = 4) -> None:
        self.tokenizer = tokenizer
        self.window = window

    @property
    def context_size(self) -> int:
        """How many tokens before a position `texts` may use."""
        return self.window + _WIDEN if self.window else 0

    def _decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=False))

    def _context(self, context: Sequence[int]) -> tuple[list[int], str]:
        ids = [int(t) for t in list(context)[max(0, len(context) - self.context_size):]] \
            if self.window else []
        start = max(0, len(ids) - self.window)
        text = self._decode(ids[start:]) if start < len(ids) else ""
        while start > 0 and text.startswith(REPLACEMENT):  # the window starts inside a character
            start -= 1
            text = self._decode(ids[start:])
        return ids[start:], text

    def texts(self, context: Sequence[int], token_ids: Iterable[int]) -> dict[int, str]:
        """{token id: its text right after `context`} for each of `token_ids`."""
        ctx, before = self._context(context)
        stable = before.rstrip(REPLACEMENT)  # the context may end inside a character
        out: dict[int, str] = {}
        for token in token_ids:
            token = int(token)
            if token in out:
                continue
            after = self._decode(ctx + [token])
            common = stable if after.startswith(stable) else commonprefix([stable, after])
            out[token] = after[len(common):].rstrip(REPLACEMENT)
        return out
