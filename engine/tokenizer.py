"""Fast paths to a Hugging Face tokenizer's Rust backend, used only where they give exactly what
the tokenizer itself gives.

transformers' `tokenizer(text)` and `tokenizer.decode(ids)` wrap one call into the `tokenizers`
backend in argument conversion and bookkeeping that cost several times the call itself. The engine
encodes every prompt and decodes twice per generated token per sequence, so it calls the backend
directly when the tokenizer is a plain fast tokenizer that adds nothing around it (no subclass
overriding the encode path, no space clean-up on decode, no truncation or padding configured), and
goes through the tokenizer otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class _BackendDecoder:
    def __init__(self, backend: Any) -> None:
        self._decode = backend.decode

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return str(self._decode(token_ids, skip_special_tokens=skip_special_tokens))


def fast_decoder(tokenizer: Any) -> Any:
    """An object with the tokenizer's `decode(ids, skip_special_tokens=...)`: the backend when
    transformers would do no clean-up of spaces, the tokenizer itself otherwise."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not hasattr(backend, "decode"):
        return tokenizer
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        model = getattr(getattr(tokenizer, "backend_tokenizer", None), "model", None)
        forced = "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"
        if type(model).__name__ != "BPE" or getattr(tokenizer, forced, False):
            return tokenizer  # transformers would clean up the text: let it
    return _BackendDecoder(backend)


class _BackendEncoder:
    def __init__(self, backend: Any) -> None:
        self._encode = backend.encode

    def __call__(self, text: str) -> list[int]:
        return list(self._encode(text, add_special_tokens=True).ids)


class _TokenizerEncoder:
    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        return list(self._tokenizer(text).input_ids)


def fast_encoder(tokenizer: Any) -> _BackendEncoder | _TokenizerEncoder:
    """A callable text -> token ids equal to `tokenizer(text).input_ids`."""
    slow = _TokenizerEncoder(tokenizer)
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # an older transformers: keep its own path
        return slow
    backend = getattr(tokenizer, "_tokenizer", None)
    if (not isinstance(tokenizer, TokenizersBackend) or backend is None
            or type(tokenizer)._encode_plus is not TokenizersBackend._encode_plus
            or type(tokenizer).__call__ is not TokenizersBackend.__call__):
        return slow
    slow("warm")  # transformers resets the backend's truncation/padding on its first call
    if (backend.truncation is not None or backend.padding is not None
            or bool(backend.encode_special_tokens) != bool(tokenizer.split_special_tokens)):
        return slow
    return _BackendEncoder(backend)


class ByteTable:
    """The bytes of every ordinary token of a byte-level BPE vocabulary (GPT-2, Llama 3, Qwen2):
    the decoder maps each token's characters back to bytes and decodes the concatenation as
    UTF-8, replacing invalid bytes, so the text of ordinary tokens is a table lookup and one
    `bytes.decode`. Added tokens (specials included) are None: callers take the tokenizer's path
    for them."""

    def __init__(self, token_bytes: list[bytes | None]) -> None:
        self.token_bytes = token_bytes

    def join(self, token_ids: list[int], start: int) -> bytes | None:
        """The bytes of token_ids[start:], or None if an added or unknown token is among them."""
        table = self.token_bytes
        try:
            if len(token_ids) - start == 1:
                return table[token_ids[start]]
            return b"".join(table[t] for t in token_ids[start:])  # type: ignore[misc]
        except (IndexError, TypeError):  # an id past the table, or None for an added token
            return None

    def decode(self, token_ids: list[int]) -> str | None:
        data = self.join(token_ids, 0)
        return None if data is None else data.decode("utf-8", "replace")


def _unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: printable bytes stand for themselves, the others
    for the characters from U+0100 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    mapping = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            mapping[chr(256 + extra)] = b
            extra += 1
    return mapping


def byte_table(tokenizer: Any, decoder: Any, num_checks: int = 300) -> ByteTable | None:
    """A ByteTable when `decoder` is the backend of a byte-level BPE tokenizer and the table
    gives exactly what the backend decodes (checked on random token sequences); None otherwise."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if not isinstance(decoder, _BackendDecoder) or backend is None \
            or type(getattr(backend, "decoder", None)).__name__ != "ByteLevel":
        return None
    import random

    char_bytes = _unicode_to_byte()
    added = set(backend.get_added_tokens_decoder())
    size = backend.get_vocab_size(with_added_tokens=True)
    table: list[bytes | None] = []
    for token_id in range(size):
        piece = backend.id_to_token(token_id)
        if token_id in added or piece is None:
            table.append(None)
        elif all(c in char_bytes for c in piece):
            table.append(bytes(char_bytes[c] for c in piece))
        else:
            table.append(piece.encode())
    ordinary = [i for i, b in enumerate(table) if b is not None]
    if not ordinary:
        return None
    result = ByteTable(table)
    rng = random.Random(0)
    for _ in range(num_checks):
        ids = [rng.choice(ordinary) for _ in range(rng.randint(1, 6))]
        for skip in (True, False):
            if result.decode(ids) != decoder.decode(ids, skip_special_tokens=skip):
                return None
    return result


def prompt_token_ids(prompt: str | list[int], encode: Callable[[str], list[int]],
                     vocab_size: int) -> list[int]:
    """A request's prompt as token ids: a string encoded, a list of ids checked."""
    if isinstance(prompt, str):
        token_ids = encode(prompt)
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                          for t in prompt):
        token_ids = list(prompt)
    else:
        raise ValueError("prompt must be a string or a list of token ids (ints)")
    if not token_ids:
        raise ValueError("the prompt is empty: give at least one token")
    if min(token_ids) < 0 or max(token_ids) >= vocab_size:
        bad = next(t for t in token_ids if not 0 <= t < vocab_size)
        raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    return token_ids
