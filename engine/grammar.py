"""Grammars for structured outputs, on llguidance: a request's spec checked and turned into
llguidance's grammar, and each distinct grammar compiled once per engine against the tokenizer.

Compiling runs on a thread of its own (llguidance releases the GIL), so a caller can bound it
with a deadline and the engine's steps go on meanwhile. Compiled matchers sit in an LRU; each
sequence gets a copy (cheap: the compiled grammar and lexer are shared)."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from functools import lru_cache
from typing import Any

from engine.sampling_params import StructuredOutputsParams

DEFAULT_CACHE_SIZE = 256


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError:
        raise ValueError("structured outputs need llguidance on the worker: "
                         "pip install 'genq[structured]'") from None
    return llguidance


def grammar_of(spec: StructuredOutputsParams) -> str:
    """llguidance's grammar for `spec`, checked: a ValueError names what is wrong (invalid JSON
    or regex, an unsupported JSON Schema keyword, a grammar that does not compile)."""
    kind = spec.kind
    value = getattr(spec, kind)
    # (key order kept: a schema's property order is the output's)
    key = json.dumps(value) if kind in ("json", "choice") else str(value)
    return _checked_grammar(kind, key)


@lru_cache(maxsize=1024)
def _checked_grammar(kind: str, key: str) -> str:
    llg = _llguidance()
    matcher = llg.LLMatcher
    if kind == "json":
        schema = json.loads(key)
        if isinstance(schema, str):  # the schema's text, as vLLM also takes it
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise ValueError("structured_outputs.json must be a JSON Schema object, got "
                             f"{type(schema).__name__}")
        grammar = matcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
    elif kind == "json_object":
        grammar = matcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
    elif kind == "choice":
        grammar = llg.grammar_from("choice", json.loads(key))
    elif kind == "regex":
        grammar = matcher.grammar_from_regex(key)
    else:
        try:
            grammar = llg.grammar_from("grammar", key)
        except ValueError as exc:
            raise ValueError(f"structured_outputs.grammar: {exc}") from None
    is_error, messages = matcher.validate_grammar_with_warnings(grammar, None, limits=_limits())
    if is_error:
        raise ValueError(f"structured_outputs.{kind} is not usable: {messages[0]}"[:1000])
    return str(grammar)


# Compact JSON (no optional whitespace): a model cannot spend its tokens on blank space.
_JSON_OPTIONS = {"whitespace_flexible": False}


def _limits() -> Any:
    # llguidance's defaults bound compile work and each step's mask work (fuel, Earley items);
    # errors stay short (no grammar dump that echoes a user's schema into logs).
    return _llguidance().LLParserLimits(verbose_errors=False)


class GrammarCompiler:
    """Compiles grammars against one tokenizer, each distinct one once (an LRU of futures)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int],
                 cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.cache_size = cache_size
        self.counters = {"num_grammar_compiles": 0, "num_grammar_cache_hits": 0}
        self.executor: Any = None  # llguidance's thread pool (masks of many rows in one call)
        self._ll_tokenizer: Any = None
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()  # the cache is filled from the compile thread
        self._cache: OrderedDict[str, Future[Any]] = OrderedDict()

    def compile(self, grammar: str) -> Future[Any]:
        with self._lock:
            future = self._cache.get(grammar)
            if future is not None:
                self._cache.move_to_end(grammar)
                self.counters["num_grammar_cache_hits"] += 1
                return future
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="genq-grammar")
            future = self._pool.submit(self._build, grammar)
            self._cache[grammar] = future
            self.counters["num_grammar_compiles"] += 1
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return future

    def _build(self, grammar: str) -> Any:
        llg = _llguidance()
        matcher = llg.LLMatcher(self.ll_tokenizer(), grammar, log_level=0, limits=_limits())
        if matcher.is_error():
            with self._lock:  # (a failure is not cached: its message goes to the requests
                self._cache.pop(grammar, None)  # that wait on it, a later one tries again)
            raise ValueError(f"the grammar does not compile: {matcher.get_error()}"[:1000])
        return matcher

    def ll_tokenizer(self) -> Any:
        if self._ll_tokenizer is None:
            backend = getattr(self.tokenizer, "backend_tokenizer", None)
            if backend is None:
                raise ValueError("structured outputs need a fast (Rust) Hugging Face tokenizer")
            backend = type(backend).from_str(backend.to_str())  # (a copy, then no padding)
            backend.no_padding()
            backend.no_truncation()
            llg = _llguidance()
            size = max(self.vocab_size, len(self.tokenizer))
            self._ll_tokenizer = llg.LLTokenizer(backend.to_str(), n_vocab=size,
                                                 eos_token=self.eos_token_ids)
            self.executor = llg.LLExecutor()
        return self._ll_tokenizer
