"""Token masks: the packed bitmasks a grammar gives (bit t % 32 of little-endian int32 word
t // 32 set when token t is allowed), unpacked, turned into addends, and applied to greedy rows.

Rules this module keeps:
- A greedy row under a mask takes the argmax of what its mask allows, the first of a tie, as
  the sampler's masked draw does; most rows' raw argmax is allowed, so only the others are
  touched.
- On the CPU a mask is applied as an addend (0 where allowed, -inf where not) rather than a
  select: one gather of 8 floats per mask byte, then an add, where a select over a mask that
  mixes allowed and banned tokens costs several times more. The two agree exactly on rows
  whose raw maximum is finite (no NaN, no +inf to turn into NaN); a batch with another row
  takes the select.
"""

from __future__ import annotations

import numpy as np
import torch

# Per mask byte value, its 8 tokens' addends: 0.0 where the bit is set, -inf where it is not.
_BYTE_ADDENDS = np.where(
    np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little") != 0,
    np.float32(0.0), np.float32(-np.inf)).astype(np.float32)


def unpack(packed: np.ndarray, vocab_size: int, device: torch.device) -> torch.Tensor:
    """A packed bitmask as a bool [rows, vocab_size] tensor."""
    if device.type == "cpu":  # (numpy's unpackbits is one C pass)
        bits = np.unpackbits(packed.view(np.uint8), axis=1, bitorder="little")
        return torch.from_numpy(bits[:, :vocab_size]).view(torch.bool)
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    bits_t = (torch.from_numpy(packed).to(device).unsqueeze(-1) >> shifts) & 1
    return bits_t.view(len(packed), -1)[:, :vocab_size] != 0


def addends(packed: np.ndarray, vocab_size: int) -> np.ndarray:
    """A packed bitmask as float32 [rows, vocab_size] addends: 0 where allowed, -inf where not
    (a new array, the caller's to add into)."""
    out = np.take(_BYTE_ADDENDS, packed.view(np.uint8), axis=0).reshape(len(packed), -1)
    return out[:, :vocab_size]


@torch.inference_mode()
def fix_disallowed(logits: torch.Tensor, tokens: list[int], rows: list[int], packed: np.ndarray,
                   vocab_size: int, add: np.ndarray | None = None) -> bool:
    """Greedy under grammars: `tokens` (the raw argmax of each logits row) where each of `rows`
    takes the argmax of what its mask (row k of `packed`, and of `add`, its addends when they
    were made ahead) allows instead. False (tokens partly changed) when a row's mask allows
    nothing."""
    chosen = np.asarray([tokens[r] for r in rows], dtype=np.int64)
    words = packed[np.arange(len(rows)), chosen >> 5].astype(np.int64)
    redo = np.flatnonzero(((words >> (chosen & 31)) & 1) == 0)
    if not len(redo):
        return True
    banned = packed[redo]
    if vocab_size == 32 * banned.shape[1]:  # (no bits past the vocabulary to exclude)
        if not banned.any(axis=1).all():
            return False
    elif not unpack(banned, vocab_size, torch.device("cpu")).any(dim=1).all():
        return False
    take = np.asarray(rows, dtype=np.int64)[redo]
    if logits.device.type == "cpu" and logits.dtype == torch.float32:  # (numpy: cheaper here)
        table = logits.numpy()
        if not np.isfinite(table[take, chosen[redo]]).all():  # (NaN or +inf: the select)
            bits = np.unpackbits(banned.view(np.uint8), axis=1, bitorder="little")
            sub = table[take, :vocab_size]
            best = np.where(bits[:, :vocab_size].view(bool), sub, np.float32(-np.inf)).argmax(1)
        elif add is not None and 2 * len(redo) > len(rows):  # most rows: add into them all
            add += _rows(table, rows)[:, :vocab_size]
            best = add.argmax(1)[redo]
        else:
            sub = addends(banned, vocab_size) if add is None else add[redo]
            sub += table[take, :vocab_size]
            best = sub.argmax(1)
    else:
        allowed = unpack(banned, vocab_size, logits.device)
        sub_t = logits[torch.from_numpy(take).to(logits.device), :vocab_size].float()
        best = torch.where(allowed, sub_t, float("-inf")).argmax(dim=-1).cpu().numpy()
    for row, token in zip(take.tolist(), best.tolist()):
        tokens[row] = token
    return True


def _rows(table: np.ndarray, rows: list[int]) -> np.ndarray:
    """table[rows]: a view where `rows` is a run of consecutive rows (the common case)."""
    first = rows[0]
    if rows[-1] - first == len(rows) - 1 and rows == list(range(first, first + len(rows))):
        return table[first:first + len(rows)]
    return table[rows]
