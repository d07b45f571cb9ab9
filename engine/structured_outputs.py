"""Structured outputs: decoding constrained to a JSON Schema, a regex, a choice or a grammar.

The backend is llguidance (a Rust library without torch): it compiles a grammar against the
tokenizer's vocabulary and, for a matcher state, computes the mask of tokens that keep the output
inside the grammar, in bytes, so byte-level BPE tokens that split a character are handled.

Rules this module keeps:
- A matcher's state is a function of the sequence's output tokens: before each mask the matcher
  consumes the tokens it has not seen yet, and a sequence without a matcher (a fork, a replay on
  another worker) gets a fresh one that consumes all its outputs. Preemption (recompute or swap)
  keeps output tokens, so it keeps the state.
- Each distinct grammar compiles once per engine (an LRU of compiled matchers, copied per
  sequence). Compiling runs on a thread of its own with a deadline: the request waits, the steps
  of everyone else do not.
- The masks of all constrained rows of a step fill one packed bitmask (llguidance works without
  the GIL); the sampler applies it with one masked_fill. On a device worker the masks are
  computed on a thread of their own while the model runs (they depend only on the tokens sampled
  before the step); a CPU worker's cores run the model, so there they are computed in turn.
  Steps without constrained rows do none of this.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from engine.sampling_params import SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from engine.sequence import Sequence, SequenceGroup

DEFAULT_COMPILE_TIMEOUT_S = 10.0
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


@dataclass(slots=True)
class _Pending:
    group: SequenceGroup
    future: Future[Any]
    deadline: float


@dataclass(slots=True)
class _SeqMatcher:
    matcher: Any
    num_consumed: int = 0


class StructuredOutputs:
    """The engine's grammar state: compiled grammars, one matcher per constrained sequence."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: set[int],
                 overlap: bool = False, cache_size: int = DEFAULT_CACHE_SIZE,
                 compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.cache_size = cache_size
        self.compile_timeout_s = compile_timeout_s
        self.overlap = overlap  # compute masks while the model runs (prefetch)
        self._mask_pool: ThreadPoolExecutor | None = None
        self._prefetched: Future[tuple[dict[int, int], np.ndarray]] | None = None
        self._ready: tuple[dict[int, int], np.ndarray] | None = None
        self.counters = {"num_grammar_compiles": 0, "num_grammar_cache_hits": 0}
        self._ll_tokenizer: Any = None
        self._executor: Any = None
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()  # the cache is filled from the compile thread
        self._cache: OrderedDict[str, Future[Any]] = OrderedDict()
        self._templates: dict[str, Any] = {}  # request id -> its compiled, unused matcher
        self._matchers: dict[int, _SeqMatcher] = {}  # seq_id -> its matcher
        self.pending: dict[str, _Pending] = {}  # request id -> compiling

    @property
    def num_pending(self) -> int:
        return len(self.pending)

    @property
    def active(self) -> bool:
        """Whether any admitted request is constrained (else a step does no grammar work)."""
        return bool(self._templates)

    # -- compiling -------------------------------------------------------------------------------
    def start(self, group: SequenceGroup, grammar: str) -> bool:
        """Compile (or find) the request's grammar: True when ready now, else it is pending."""
        future = self._compile(grammar)
        if future.done() and future.exception() is None:
            self._templates[group.request_id] = future.result()
            return True
        self.pending[group.request_id] = _Pending(group, future,
                                                  time.monotonic() + self.compile_timeout_s)
        return False

    def poll(self, wait: bool) -> tuple[list[SequenceGroup], list[tuple[SequenceGroup, str]]]:
        """Pending requests whose grammar is ready, and those whose compile failed or ran past
        its deadline (with why). With `wait`, block until at least one is decided."""
        if wait and self.pending:
            first = min(self.pending.values(), key=lambda p: p.deadline)
            try:
                first.future.exception(timeout=max(0.0, first.deadline - time.monotonic()))
            except TimeoutError:
                pass
        ready, failed = [], []
        now = time.monotonic()
        for request_id, p in list(self.pending.items()):
            if p.future.done():
                del self.pending[request_id]
                exc = p.future.exception()
                if exc is None:
                    self._templates[request_id] = p.future.result()
                    ready.append(p.group)
                else:
                    failed.append((p.group, str(exc)))
            elif now >= p.deadline:
                del self.pending[request_id]
                failed.append((p.group, f"the grammar did not compile within "
                                        f"{self.compile_timeout_s:g} s; simplify the schema"))
        return ready, failed

    def _compile(self, grammar: str) -> Future[Any]:
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
        matcher = llg.LLMatcher(self._tokenizer(), grammar, log_level=0, limits=_limits())
        if matcher.is_error():
            with self._lock:  # (a failure is not cached: its message goes to the requests
                self._cache.pop(grammar, None)  # that wait on it, a later one tries again)
            raise ValueError(f"the grammar does not compile: {matcher.get_error()}"[:1000])
        return matcher

    def _tokenizer(self) -> Any:
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
            self._executor = llg.LLExecutor()
        return self._ll_tokenizer

    # -- matching --------------------------------------------------------------------------------
    def sync(self, group: SequenceGroup, seq: Sequence) -> tuple[bool, str | None]:
        """Bring `seq`'s matcher up to its output tokens -> (the grammar is complete, so only EOS
        may follow; an error message when an output token broke the grammar)."""
        state = self._matchers.get(seq.seq_id)
        if state is None:
            state = _SeqMatcher(self._templates[group.request_id].deep_copy())
            self._matchers[seq.seq_id] = state
        matcher = state.matcher
        num_out = seq.num_tokens - seq.num_prompt_tokens
        if state.num_consumed < num_out:
            if not matcher.is_stopped():  # (after the end only EOS comes: nothing to consume)
                new = seq.token_ids[seq.num_prompt_tokens + state.num_consumed:]
                if not matcher.consume_tokens(new):
                    return False, ("no allowed token: the grammar and allowed_token_ids leave "
                                   f"none at output position {num_out - 1}")
            state.num_consumed = num_out
        return matcher.is_stopped(), None

    def prefetch(self, items: list[tuple[SequenceGroup, Sequence]], device: torch.device) -> None:
        """Before the model runs: bring the matchers of this step's constrained samples up to
        date and start their masks on the mask thread. wait() before touching a matcher."""
        seqs = []
        for group, seq in items:
            if self.sync(group, seq)[1] is None:
                seqs.append(seq)
        if seqs:
            if self._mask_pool is None:
                self._mask_pool = ThreadPoolExecutor(1, thread_name_prefix="genq-masks")
            self._prefetched = self._mask_pool.submit(self._fill, seqs, device.type)

    def wait(self) -> None:
        if self._prefetched is not None:
            self._ready = self._prefetched.result()
            self._prefetched = None

    def masks(self, seqs: list[Sequence], device: torch.device) -> torch.Tensor:
        """The tokens each (synced) sequence may NOT draw next: a bool [len(seqs), vocab]
        tensor, from one packed bitmask of every distinct sequence (prefetched, or filled now)."""
        ready, self._ready = self._ready, None
        if ready is None or any(s.seq_id not in ready[0] for s in seqs):
            ready = self._fill(seqs, device.type)
        index, packed = ready
        rows = [index[s.seq_id] for s in seqs]
        if rows != list(range(len(index))):
            packed = packed[rows]
        if device.type == "cpu":  # (numpy's unpackbits is one C pass; little-endian words)
            bits = np.unpackbits((~packed).view(np.uint8), axis=1, bitorder="little")
            return torch.from_numpy(bits[:, : self.vocab_size]).view(torch.bool)
        shifts = torch.arange(32, dtype=torch.int32, device=device)
        bits_t = (torch.from_numpy(packed).to(device).unsqueeze(-1) >> shifts) & 1
        return bits_t.view(len(seqs), -1)[:, : self.vocab_size] == 0

    def _fill(self, seqs: list[Sequence], device_type: str) -> tuple[dict[int, int], np.ndarray]:
        index: dict[int, int] = {}
        for seq in seqs:
            index.setdefault(seq.seq_id, len(index))
        width = (max(self.vocab_size, len(self.tokenizer)) + 31) // 32
        packed = np.zeros((len(index), width), dtype=np.int32)
        matchers = [(self._matchers[sid].matcher, k) for sid, k in index.items()]
        if device_type == "cpu":
            # On a CPU worker the cores run the model: compute on one thread, not on a pool
            # whose idle threads spin against the model's.
            base, row_bytes = packed.ctypes.data, width * 4
            for matcher, k in matchers:
                matcher.unsafe_compute_mask_ptr(base + k * row_bytes, row_bytes)
        else:  # (the device runs the model: the CPU's cores are free for the pool)
            self._executor.unsafe_compute_mask_ptr(matchers, packed.ctypes.data, width * 4,
                                                   len(index))
        return index, packed

    def release(self, group: SequenceGroup) -> None:
        self.pending.pop(group.request_id, None)
        self._templates.pop(group.request_id, None)
        for seq in group.seqs:
            self._matchers.pop(seq.seq_id, None)

    def clear(self) -> None:
        self.wait()
        self._ready = None
        self.pending.clear()
        self._templates.clear()
        self._matchers.clear()


def constrained(params: SamplingParams) -> bool:
    return params.structured_outputs is not None
