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
- The masks of all constrained rows of a step fill one packed bitmask in one call into
  llguidance (without the GIL), as do the matchers' one-token syncs; the sampler applies the
  bitmask to all rows at once (greedy rows: only to those whose argmax it bans). Where a core
  is free while the model runs (a device worker's host; a CPU worker whose torch threads leave
  a core over), the matchers' syncs and the masks run on a thread of their own meanwhile (they
  depend only on the tokens sampled before the step), and on a CPU worker the masks' addends
  (token_masks) with them; elsewhere they run in turn. Steps without constrained rows do none
  of this.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from engine.grammar import DEFAULT_CACHE_SIZE, GrammarCompiler, _llguidance
from engine.token_masks import addends, unpack

if TYPE_CHECKING:
    from engine.sequence import Sequence, SequenceGroup

DEFAULT_COMPILE_TIMEOUT_S = 10.0
# Prefetched masks come with their addends (token_masks.addends) while they fit this many floats.
_MAX_ADDEND_FLOATS = 1 << 22


@dataclass(slots=True)
class _Masks:
    index: dict[int, int]  # seq_id -> its row
    packed: np.ndarray
    add: np.ndarray | None = None  # (made ahead, on a CPU worker)


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
                 device_type: str = "cpu", overlap: bool = False,
                 cache_size: int = DEFAULT_CACHE_SIZE,
                 compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.compile_timeout_s = compile_timeout_s
        self.device_type = device_type  # where the model runs: "cpu" fills masks on one thread
        self.overlap = overlap  # compute masks while the model runs (prefetch)
        self._mask_pool: ThreadPoolExecutor | None = None
        self._one_thread: Any = None  # llguidance's executor of one thread, on a CPU worker
        self._mask_words = (max(vocab_size, len(tokenizer)) + 31) // 32
        self._prefetched: Future[_Masks | None] | None = None
        self._ready: _Masks | None = None
        self.compiler = GrammarCompiler(tokenizer, vocab_size, self.eos_token_ids, cache_size)
        self.counters = self.compiler.counters
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
        future = self.compiler.compile(grammar)
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
                    return False, (f"the grammar refused output token(s) {new}: "
                                   f"{matcher.get_error()}"[:500])
            state.num_consumed = num_out
        return matcher.is_stopped(), None

    def sync_all(self, items: list[tuple[SequenceGroup, Sequence]]) -> str | None:
        """sync() for many sequences, those one token behind (the common case) in one call into
        llguidance: None, or the first error met."""
        pending, states = [], []
        for group, seq in items:
            state = self._matchers.get(seq.seq_id)
            ids = seq.token_ids
            num_out = len(ids) - seq.num_prompt_tokens
            if state is not None and state.num_consumed == num_out - 1 \
                    and not state.matcher.is_stopped():
                pending.append((state.matcher, ids[-1]))
                states.append(state)
            else:
                error = self.sync(group, seq)[1]
                if error is not None:
                    return error
        error = None
        if pending:  # (every matcher consumes its token: count each one that took it)
            for ok, state, (matcher, token) in zip(
                    self._executor().consume_token_par(pending), states, pending):
                if ok:
                    state.num_consumed += 1
                elif error is None:
                    error = (f"the grammar refused output token(s) {[token]}: "
                             f"{matcher.get_error()}")
        return None if error is None else error[:500]

    def prefetch(self, items: list[tuple[SequenceGroup, Sequence]]) -> None:
        """Before the model runs: on the mask thread, bring the matchers of this step's
        constrained samples up to date and fill their masks. wait() before touching a matcher."""
        if self._mask_pool is None:
            self._mask_pool = ThreadPoolExecutor(1, thread_name_prefix="genq-masks")
        self._prefetched = self._mask_pool.submit(self._sync_and_fill, items)

    def _sync_and_fill(self, items: list[tuple[SequenceGroup, Sequence]]) -> _Masks | None:
        seqs = [seq for _, seq in items]
        if self.sync_all(items) is not None:  # (the step reports the broken row; not its mask)
            seqs = [seq for group, seq in items if self.sync(group, seq)[1] is None]
        if not seqs:
            return None
        masks = self._fill(seqs)
        if self.device_type == "cpu" and masks.packed.size * 32 <= _MAX_ADDEND_FLOATS:
            masks.add = addends(masks.packed, self.vocab_size)
        return masks

    def wait(self) -> None:
        if self._prefetched is not None:
            self._ready = self._prefetched.result()
            self._prefetched = None

    def packed(self, seqs: list[Sequence]) -> tuple[np.ndarray, np.ndarray | None]:
        """The tokens each (synced) sequence may draw next, packed: int32 [len(seqs), words],
        bit t % 32 of word t // 32 set when token t is allowed (prefetched, or filled now); and
        their addends (token_masks.addends) where they were made ahead, else None."""
        ready, self._ready = self._ready, None
        if ready is None or any(s.seq_id not in ready.index for s in seqs):
            ready = self._fill(seqs)
        rows = [ready.index[s.seq_id] for s in seqs]
        if rows == list(range(len(ready.index))):
            return ready.packed, ready.add
        return ready.packed[rows], None if ready.add is None else ready.add[rows]

    def masks(self, seqs: list[Sequence], device: torch.device) -> torch.Tensor:
        """The tokens each (synced) sequence may draw next: a bool [len(seqs), vocab] tensor."""
        return unpack(self.packed(seqs)[0], self.vocab_size, device)

    def _fill(self, seqs: list[Sequence]) -> _Masks:
        index: dict[int, int] = {}
        for seq in seqs:
            index.setdefault(seq.seq_id, len(index))
        width = self._mask_words
        packed = np.zeros((len(index), width), dtype=np.int32)
        matchers = [(self._matchers[sid].matcher, k) for sid, k in index.items()]
        self._executor().unsafe_compute_mask_ptr(matchers, packed.ctypes.data, width * 4,
                                                 len(index))
        return _Masks(index, packed)

    def _executor(self) -> Any:
        """llguidance's executor for a step's matchers: its pool where a device runs the model
        and the CPU's cores are free; on a CPU worker, whose cores run the model, one thread (not
        a pool whose idle threads spin against the model's)."""
        if self.device_type != "cpu":
            return self.compiler.executor
        if self._one_thread is None:
            self._one_thread = _llguidance().LLExecutor(num_threads=1)
        return self._one_thread

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
