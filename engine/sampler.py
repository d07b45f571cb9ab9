"""Sampler: logits processors and the choice of the next token, for a whole batch at once.

Randomness is a pure function of (request seed, sequence index, output position, token id)
(engine/noise.py), and sampling is the Gumbel-max race argmax(logits / T + Gumbel). So a seeded
request draws the same tokens in any batch, after any preemption, on any worker.

Order of processing (vLLM's): the grammar mask (structured outputs), allowed_token_ids, the
min_tokens ban, logit_bias, repetition/presence/frequency penalties, temperature, top-k, top-p,
min-p, then the draw. Every mask applies before the draw, so a constrained seeded row races the
same noise as an unconstrained one. Logprobs are of the processed logits before temperature.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.noise import Noise
from engine.sampling_params import SamplingParams


@dataclass(slots=True)
class SampleRow:
    params: SamplingParams
    seed: int
    seq_index: int
    position: int  # index of the output token being drawn
    token_ids: list[int]  # the sequence's prompt and outputs (a reference, not a copy)
    num_prompt_tokens: int
    banned_token_ids: list[int] | None = None  # EOS and stop ids while under min_tokens


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[float | None]  # of the chosen tokens; None where no one asked (see below)
    top_logprobs: list[dict[int, float] | None]
    # Rows whose masks (grammar, allowed_token_ids, min_tokens) left no token: their draw is
    # meaningless and the caller ends them.
    no_token_rows: frozenset[int] = frozenset()


class Sampler:
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.noise = Noise(vocab_size)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, rows: list[SampleRow],
                 grammar_rows: list[int] | None = None,
                 allowed: torch.Tensor | None = None) -> SampleResult:
        """`allowed` (bool [len(grammar_rows), vocab]): the tokens the grammar lets each of
        `grammar_rows` draw; the other rows are not touched."""
        logits = logits[:, : self.vocab_size].float()
        no_token: set[int] = set()
        if grammar_rows:
            assert allowed is not None
            no_token.update(grammar_rows[k] for k in
                            (~allowed.any(dim=1)).nonzero().flatten().tolist())
            if len(grammar_rows) == len(rows):
                logits = torch.where(allowed, logits, float("-inf"))
            else:
                idx = torch.tensor(grammar_rows, device=logits.device)
                logits[idx] = torch.where(allowed, logits[idx], float("-inf"))
        if any(r.params.allowed_token_ids is not None for r in rows):
            logits = _apply_token_lists(logits, rows)
        # Rows a later mask may have emptied: allowed_token_ids, or the min_tokens ban on top of
        # one of the others (a grammar row's own emptiness is read from its mask above).
        grammar = set(grammar_rows or ())
        check = [i for i, row in enumerate(rows) if row.params.allowed_token_ids is not None
                 or (row.banned_token_ids and i in grammar)]
        for i, row in enumerate(rows):
            if row.banned_token_ids:
                logits[i, row.banned_token_ids] = float("-inf")
        if check:
            idx = torch.tensor(check, device=logits.device)
            empty = torch.isneginf(logits[idx]).all(dim=1).nonzero().flatten().tolist()
            no_token.update(check[k] for k in empty)
        if any(r.params.logit_bias for r in rows):
            logits = _apply_logit_bias(logits, rows)
        if any(has_penalty(r.params) for r in rows):
            logits = _apply_penalties(logits, rows)
        random_rows = [i for i, r in enumerate(rows) if r.params.temperature > 0.0]
        if random_rows and len(random_rows) == len(rows):  # (no argmax to overwrite)
            chosen = self._draw(logits, rows)
        else:
            chosen = _argmax(logits)
            if random_rows:
                idx = torch.tensor(random_rows, device=logits.device)
                chosen[idx] = self._draw(logits[idx], [rows[i] for i in random_rows])
        token_ids = chosen.tolist()
        # The chosen token's logprob (cumulative_logprob) for rows that asked for logprobs or
        # rank samples (best_of > n), as vLLM does: a logsumexp over the vocabulary is a
        # large share of a decode step on a small model. The top-k only on request.
        chosen_lp: list[float | None] = [None] * len(rows)
        need = [i for i, r in enumerate(rows) if _wants_logprobs(r.params)]
        if need:
            idx = torch.tensor(need, device=logits.device)
            sub = logits[idx]
            values = (sub.gather(1, chosen[idx, None]).squeeze(1)
                      - torch.logsumexp(sub, dim=-1)).tolist()
            for i, value in zip(need, values):
                chosen_lp[i] = value
        tops: list[dict[int, float] | None] = [None] * len(rows)
        for i, row in enumerate(rows):
            if row.params.logprobs is not None:
                lp = chosen_lp[i]
                assert lp is not None
                tops[i] = _top(torch.log_softmax(logits[i], dim=-1), row.params.logprobs,
                               token_ids[i], lp)
        return SampleResult(token_ids, chosen_lp, tops, frozenset(no_token))

    @torch.inference_mode()
    def greedy(self, logits: torch.Tensor) -> list[int]:
        """The argmax of each row (what __call__ draws for plain_greedy rows, without rows)."""
        return _argmax(logits[:, : self.vocab_size].float()).tolist()  # type: ignore[no-any-return]

    def _draw(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        temps = torch.tensor([r.params.temperature for r in rows], device=logits.device)
        logits = _filter(logits / temps[:, None], rows)  # (a new tensor: added to in place)
        keys = [(r.seed, r.seq_index, r.position) for r in rows]
        drawn = self.noise.draw(logits, keys)
        return drawn if drawn is not None else _argmax(logits.add_(self.noise(keys,
                                                                              logits.device)))


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax (first maximum; NaN counts as the maximum). On the CPU float32 rows go
    through numpy's vectorised argmax, the cheaper of the two there."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return torch.from_numpy(logits.numpy().argmax(axis=1))
    return logits.argmax(dim=-1)


def plain_greedy(p: SamplingParams) -> bool:
    """Whether every token of a request is the argmax of its raw logits (no penalty, no ban
    under min_tokens, no logprobs, one sequence): the engine then skips the sampler."""
    return p.structured_outputs is None and greedy_but_grammar(p)


def greedy_but_grammar(p: SamplingParams) -> bool:
    """plain_greedy but for a grammar: each token is the argmax of what the grammar allows."""
    return (p.temperature == 0.0 and p.best_of == 1 and not p.use_beam_search
            and p.logprobs is None and p.min_tokens == 0 and not has_penalty(p)
            and not p.logit_bias and p.allowed_token_ids is None)


def _wants_logprobs(p: SamplingParams) -> bool:
    return p.logprobs is not None or (p.best_of or p.n) > p.n


def has_penalty(p: SamplingParams) -> bool:
    return p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0


def _counts(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    width = max((len(t) for t in token_lists), default=0)
    counts = torch.zeros(len(token_lists), vocab + 1, device=device)
    if width:
        padded = torch.tensor([t + [vocab] * (width - len(t)) for t in token_lists],
                              dtype=torch.int64, device=device)
        counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=counts.dtype))
    return counts[:, :vocab]


def _apply_penalties(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    vocab, dev = logits.shape[1], logits.device
    out_counts = _counts([r.token_ids[r.num_prompt_tokens:] for r in rows], vocab, dev)
    prompt_seen = _counts([r.token_ids[:r.num_prompt_tokens] for r in rows], vocab, dev) > 0
    rep = torch.tensor([r.params.repetition_penalty for r in rows], device=dev)[:, None]
    seen = prompt_seen | (out_counts > 0)
    # Kept finite: a penalty that rounds to 0 or inf in float32 (1e-300, 1e300) turns a seen
    # token's logit into inf or 0 / 0; the largest float instead (ties pick the first, as
    # transformers' inf does), and 0. (Banned tokens stay -inf.)
    penalised = torch.where(logits < 0, logits * rep, logits / rep) \
        .nan_to_num(nan=0.0, posinf=torch.finfo(logits.dtype).max, neginf=float("-inf"))
    logits = torch.where(seen, penalised, logits)
    freq = torch.tensor([r.params.frequency_penalty for r in rows], device=dev)[:, None]
    pres = torch.tensor([r.params.presence_penalty for r in rows], device=dev)[:, None]
    return logits - freq * out_counts - pres * (out_counts > 0).float()


def _apply_token_lists(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """allowed_token_ids: every other token of the row is -inf (ids past the vocabulary are
    dropped: the model cannot draw them)."""
    vocab, dev = logits.shape[1], logits.device
    keep_rows = [i for i, r in enumerate(rows) if r.params.allowed_token_ids is not None]
    allowed = torch.zeros(len(keep_rows), vocab, dtype=torch.bool, device=dev)
    for k, i in enumerate(keep_rows):
        ids = [t for t in rows[i].params.allowed_token_ids or () if t < vocab]
        allowed[k, ids] = True
    idx = torch.tensor(keep_rows, device=dev)
    logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))
    return logits


def _apply_logit_bias(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """OpenAI's logit_bias: added to the token's logit (ids past the vocabulary ignored)."""
    vocab, dev = logits.shape[1], logits.device
    row_ids, token_ids, biases = [], [], []
    for i, row in enumerate(rows):
        for token, bias in (row.params.logit_bias or {}).items():
            if token < vocab:
                row_ids.append(i)
                token_ids.append(token)
                biases.append(bias)
    if row_ids:
        logits.index_put_((torch.tensor(row_ids, device=dev), torch.tensor(token_ids, device=dev)),
                          torch.tensor(biases, device=dev), accumulate=True)
    return logits


def _filter(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    dev = logits.device
    top_k = [r.params.top_k for r in rows]
    top_p = [r.params.top_p for r in rows]
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(logits.shape[1], device=dev)[None, :]
        k = torch.tensor([k if k > 0 else logits.shape[1] for k in top_k], device=dev)[:, None]
        drop = ranks >= k
        probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of the tokens ranked above
        drop |= before >= torch.tensor(top_p, device=dev)[:, None]
        drop[:, 0] = False  # the most likely token always survives
        logits = logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
    min_p = [r.params.min_p for r in rows]
    if any(p > 0.0 for p in min_p):
        probs = torch.softmax(logits, dim=-1)
        floor = probs.max(dim=-1, keepdim=True).values * torch.tensor(min_p, device=dev)[:, None]
        logits = logits.masked_fill(probs < floor, float("-inf"))
    return logits


def _top(logprobs: torch.Tensor, k: int, chosen: int, chosen_lp: float) -> dict[int, float]:
    result = {chosen: chosen_lp}
    if k:
        values, ids = logprobs.topk(k)
        result.update(zip(ids.tolist(), values.tolist()))
    return result
