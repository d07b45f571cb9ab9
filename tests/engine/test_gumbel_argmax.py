"""The CPU draw (engine/csrc/gumbel_argmax.cpp): argmax(logits + noise) without the whole noise,
held to the full noise's argmax on rows built to make the estimate's shortcut go wrong."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from engine.noise import Noise, _library, gumbel_cpu, row_key, vocab_hash


def _full(noise: Noise, logits: torch.Tensor, rows: list[tuple[int, int, int]]) -> list[int]:
    """What the draw must pick: the full noise added, numpy's first maximum (NaN counts)."""
    return list(logits.add(noise(rows, logits.device)).numpy().argmax(axis=1))


def _rows(n: int, seed: int) -> list[tuple[int, int, int]]:
    rng = random.Random(seed)
    return [(rng.getrandbits(64), rng.randrange(4), rng.randrange(500)) for _ in range(n)]


@pytest.mark.parametrize("vocab", [17, 4096, 4099])
def test_the_draw_picks_what_the_full_noise_picks(vocab):
    gen = torch.Generator().manual_seed(vocab)
    noise = Noise(vocab)
    rows = _rows(64, vocab)
    exact = noise(rows, torch.device("cpu"))
    cases = {
        "model-like": torch.randn(64, vocab, generator=gen) * 3,
        "temperature 0.01": torch.randn(64, vocab, generator=gen) * 3000,
        "flat": torch.zeros(64, vocab),  # the noise alone decides
        # Every sum is C up to one rounding: most tokens tie with the maximum, the first wins.
        "ties": (7.0 - exact),
        "ties, large": (4096.0 - exact),
        "top-k": torch.randn(64, vocab, generator=gen).masked_fill(
            torch.rand(64, vocab, generator=gen) < 0.97, float("-inf")),
    }
    for name, logits in cases.items():
        drawn = noise.draw(logits.clone(), rows)
        assert drawn is not None, "the C++ draw did not build"
        assert drawn.tolist() == _full(noise, logits, rows), name
    ties = (7.0 - exact).add(exact)
    tied = (ties == ties.max(dim=1, keepdim=True).values).sum(dim=1)
    assert (tied > 1).sum() >= 32  # (real ties: in most rows several tokens hold the maximum)


def test_nan_inf_and_empty_rows_pick_as_argmax_does():
    vocab = 4099
    noise = Noise(vocab)
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(1))
    logits[0, [4097, 9]] = float("nan")  # the first NaN: 9
    logits[1, [30, 4098]] = float("inf")  # the first +inf: 30
    logits[2] = float("-inf")  # nothing drawable: token 0
    logits[3, 12] = float("inf")
    logits[3, 4000] = float("nan")  # NaN before +inf
    logits[4, :] = float("-inf")
    logits[4, 4098] = -1e30  # the only finite token is in the tail
    rows = _rows(6, 2)
    drawn = noise.draw(logits.clone(), rows)
    assert drawn is not None
    assert drawn.tolist()[:5] == [9, 30, 0, 4000, 4098]
    assert drawn.tolist() == _full(noise, logits, rows)


def test_the_draw_is_the_same_on_any_number_of_threads():
    noise = Noise(4096)
    logits = torch.randn(300, 4096, generator=torch.Generator().manual_seed(3)) * 2
    rows = _rows(300, 3)
    before = torch.get_num_threads()
    try:
        drawn = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            drawn.append(noise.draw(logits.clone(), rows))
    finally:
        torch.set_num_threads(before)
    assert drawn[0] is not None and drawn[0].tolist() == _full(noise, logits, rows)
    assert torch.equal(drawn[0], drawn[1]) and torch.equal(drawn[0], drawn[2])


def test_the_estimate_is_within_a_tenth_of_the_margin_the_draw_allows():
    # The kernel keeps every token whose estimated sum is within 2e-4 (+ roundings) of the
    # row's largest: it relies on the estimated noise being within 1e-4 of the exact noise
    # (2e-6 over all 2^32 hashes, checked once). Here: the extremes, both sides of the switch
    # at 2^31 between its two series, the worst hash of that check, and 2^20 random hashes.
    lib = _library()
    assert lib is not None
    rng = np.random.default_rng(5)
    hashes = np.concatenate([
        np.array([0, 1, 2**31 - 2, 2**31 - 1, 2**31, 2**31 + 1, 2**32 - 2, 2**32 - 1,
                  4294966831], dtype=np.uint32),
        rng.integers(0, 2**32, size=2**20, dtype=np.uint32)])
    estimate = np.empty(len(hashes), dtype=np.float32)
    lib.genq_gumbel_estimate(hashes.ctypes.data, len(hashes), estimate.ctypes.data)
    u = (hashes.astype(np.float64) + 0.5) / 2.0**32
    exact = (-np.log(-np.log(u))).astype(np.float32)
    error = np.abs(estimate.astype(np.float64) - exact)
    assert error.max() < 1e-5, (error.max(), hashes[error.argmax()])


def test_seeded_rows_draw_the_same_tokens_as_the_documented_noise():
    # One row through the documented definition in plain numpy (the uint32 hash, double logs).
    vocab = 4096
    noise = Noise(vocab)
    row = (12345, 1, 7)
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(9))
    g = gumbel_cpu(vocab_hash(vocab).numpy().astype(np.uint32), [row_key(*row)])
    drawn = noise.draw(logits.clone(), [row])
    assert drawn is not None and drawn.tolist() == [int((logits + g).numpy().argmax())]
