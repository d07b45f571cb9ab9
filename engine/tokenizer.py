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
