"""Token masks: greedy rows under packed grammar masks take the first argmax of what each allows,
with addends made ahead (while the model ran) or in turn, or by select (non-finite rows)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.sampler import _argmax
from engine.token_masks import addends, fix_disallowed, unpack


@pytest.mark.parametrize("ahead", [False, True], ids=["in-turn", "made-ahead"])
def test_fix_disallowed_takes_the_best_allowed_token_and_the_first_of_a_tie(ahead):
    logits = torch.full((4, 64), -5.0)
    logits[0, 7], logits[0, 40] = 3.0, 1.0  # argmax 7, allowed: untouched
    logits[1, 7], logits[1, 40], logits[1, 50] = 3.0, 1.0, 2.0  # 7 banned: 50 beats 40
    logits[2, 33], logits[2, 35], logits[2, 63] = 2.0, 2.0, 9.0  # 63 banned: tie, the first
    logits[3, 1] = 4.0  # not a grammar row: untouched even though nothing marks 1 allowed
    packed = np.zeros((3, 2), dtype=np.int32)
    packed[0, 0] = 1 << 7
    packed[1, 1] = (1 << (40 - 32)) | (1 << (50 - 32))
    packed[2, 1] = (1 << 1) | (1 << 3)  # tokens 33 and 35
    tokens = [7, 7, 63, 1]
    add = addends(packed, 64) if ahead else None
    assert fix_disallowed(logits, tokens, [0, 1, 2], packed, 64, add)
    assert tokens == [7, 50, 33, 1]
    none = np.zeros((1, 2), dtype=np.int32)
    assert not fix_disallowed(logits, [7], [0], none, 64, addends(none, 64) if ahead else None)


def test_addends_are_zero_where_allowed_and_minus_inf_elsewhere():
    packed = np.array([[0b1011, -1, 0]], dtype=np.int32)  # tokens 0, 1, 3 and 32..63
    add = addends(packed, 70)
    allowed = unpack(packed, 70, torch.device("cpu")).numpy()
    assert add.shape == (1, 70) and add.dtype == np.float32
    assert np.flatnonzero(add[0] == 0).tolist() == [0, 1, 3, *range(32, 64)]
    assert np.flatnonzero(allowed[0]).tolist() == [0, 1, 3, *range(32, 64)]
    assert np.isneginf(add[0, ~allowed[0]]).all()


@pytest.mark.parametrize("rows, banned, branch", [
    (list(range(12)), {0, 2, 4, 7, 8, 10, 11}, "most rows, a run: add into all"),
    ([0, 1, 2, 3, 4, 5, 6, 8], {0, 1, 2, 3, 8}, "most rows, not a run"),
    ([1, 4, 9], {4}, "few rows: gather them"),
    ([0, 1, 2, 3, 4, 5, 6, 8], {0, 5, 6}, "NaN and +inf rows: the select")])
@pytest.mark.parametrize("vocab", [96, 83])
def test_addends_in_turn_and_made_ahead_take_the_first_best_allowed(rows, banned, branch,
                                                                   vocab):
    """Ties (logits rounded to one decimal), dense and sparse masks, bits past the vocabulary:
    the same tokens either way, and on the finite rows the first maximum of what is allowed.
    Rows in `banned` have their raw argmax banned."""
    rng = np.random.default_rng(vocab)
    table = np.round(rng.standard_normal((12, 96)), 1).astype(np.float32)
    table[5, 10] = np.nan  # (numpy's argmax takes a NaN: row 5's raw argmax is 10)
    table[6, 20] = np.inf
    logits = torch.from_numpy(table)
    raw = _argmax(logits[:, :vocab]).tolist()
    bits = rng.random((len(rows), 96)) < np.where([r in banned for r in rows], 0.05, 0.9)[:, None]
    bits[:, 3] = True  # (every row allows something)
    for k, r in enumerate(rows):
        bits[k, raw[r]] = r not in banned
    packed = np.packbits(bits, axis=1, bitorder="little").view(np.int32)
    in_turn, ahead = list(raw), list(raw)
    assert fix_disallowed(logits, in_turn, rows, packed, vocab)
    assert fix_disallowed(logits, ahead, rows, packed, vocab, addends(packed, vocab))
    assert ahead == in_turn
    for k, r in enumerate(rows):
        masked = np.where(bits[k, :vocab], table[r, :vocab], -np.inf)
        if r not in (5, 6):
            assert in_turn[r] == int(np.flatnonzero(masked == masked.max())[0])
        else:  # (numpy's own masked argmax: a NaN counts as the maximum)
            assert in_turn[r] == int(masked.argmax())
        assert (in_turn[r] == raw[r]) == (r not in banned)
    assert [t for r, t in enumerate(in_turn) if r not in rows] == \
        [t for r, t in enumerate(raw) if r not in rows]
