"""The sampling noise: Gumbel noise that is a pure function of (request seed, sequence index,
output position, token id).

A counter-based hash gives every (row, token) a 32-bit value h; u = (h + 0.5) / 2**32 and the
noise is -log(-log(u)), computed in double and rounded to float32. The CPU and the torch path
(any device) give the same bits, so a seeded job samples the same tokens on any worker.

The draw is argmax(logits + noise). On the CPU it runs in C++ (engine/csrc/gumbel_argmax.cpp)
without making the whole noise: a float32 estimate of every token's sum, then the exact noise of
the few tokens the estimate leaves in contention, with the C library's log (math.log's: the
documented definition). It picks the token the full noise picks (the tests hold it to that);
the two double logs per token it skips were most of a step's sampling.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np
import torch

from engine import native

_M32 = 0xFFFFFFFF


class Noise:
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._vocab_hash: torch.Tensor | None = None
        self._vocab_hash_u32: np.ndarray | None = None

    def __call__(self, rows: list[tuple[int, int, int]], device: torch.device) -> torch.Tensor:
        """Gumbel noise [rows, vocab] for rows of (seed, sequence index, output position)."""
        keys = [row_key(*row) for row in rows]
        if device.type == "cpu":
            return gumbel_cpu(self._hash_u32(), keys)
        if self._vocab_hash is None or self._vocab_hash.device != device:
            self._vocab_hash = vocab_hash(self.vocab_size).to(device)
        return gumbel_torch(self._vocab_hash, keys)

    def draw(self, logits: torch.Tensor,
             rows: list[tuple[int, int, int]]) -> torch.Tensor | None:
        """argmax(logits + noise) of each row (the first maximum; a NaN counts as the maximum)
        for CPU float32 `logits` [rows, vocab]; None where the C++ draw cannot run (another
        device or dtype, no compiler): the caller adds the noise and takes the argmax."""
        lib = _library() if logits.device.type == "cpu" and logits.dtype == torch.float32 \
            else None
        if lib is None:
            return None
        logits = logits.contiguous()
        keys = np.array([row_key(*row) for row in rows], dtype=np.uint32)
        token_hash = self._hash_u32()
        out = torch.empty(len(rows), dtype=torch.int64)
        lib.genq_gumbel_argmax(logits.data_ptr(), len(rows), logits.shape[1],
                               token_hash.ctypes.data, keys.ctypes.data, out.data_ptr(),
                               torch.get_num_threads())
        return out

    def _hash_u32(self) -> np.ndarray:
        if self._vocab_hash_u32 is None:
            self._vocab_hash_u32 = vocab_hash(self.vocab_size).numpy().astype(np.uint32)
        return self._vocab_hash_u32


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = native.library(native.CSRC / "gumbel_argmax.cpp")
    if lib is not None:
        lib.genq_gumbel_argmax.restype = None
        lib.genq_gumbel_argmax.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                                           ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                           ctypes.c_int]
        lib.genq_gumbel_estimate.restype = None
        lib.genq_gumbel_estimate.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    return lib


def vocab_hash(vocab_size: int) -> torch.Tensor:
    """Each token id's hash (int64 holding 32 bits), the per-token half of the noise key."""
    ids = torch.arange(vocab_size, dtype=torch.int64)
    return _fmix32((ids * 0x9E3779B1 + 0x7F4A7C15) & _M32)


def gumbel_torch(token_hash: torch.Tensor, keys: list[int]) -> torch.Tensor:
    """The noise in torch int64 arithmetic: any device."""
    k = torch.tensor(keys, dtype=torch.int64, device=token_hash.device)
    h = _fmix32(token_hash[None, :] ^ k[:, None])
    u = (h.double() + 0.5) / 4294967296.0
    return (-torch.log(-torch.log(u))).float()


def gumbel_cpu(token_hash: np.ndarray, keys: list[int], chunk_rows: int = 16) -> torch.Tensor:
    """The same noise, bit for bit, on the CPU: the hash in uint32 (multiplication wraps mod
    2**32 by itself) and the same torch logs, in place, `chunk_rows` rows at a time so that the
    buffers stay in cache: several times cheaper than the int64 path for a batch's
    [rows, vocab]."""
    k = np.asarray(keys, dtype=np.uint32)
    out = torch.empty((len(keys), token_hash.shape[0]), dtype=torch.float32)
    h = np.empty((min(chunk_rows, len(keys)), token_hash.shape[0]), dtype=np.uint32)
    t = np.empty_like(h)
    u = np.empty(h.shape, dtype=np.float64)
    for a in range(0, len(keys), chunk_rows):
        b = min(a + chunk_rows, len(keys))
        hh, tt, uu = h[: b - a], t[: b - a], u[: b - a]
        np.bitwise_xor(token_hash[None, :], k[a:b, None], out=hh)
        for shift, mult in ((16, 0x85EBCA6B), (13, 0xC2B2AE35)):
            np.right_shift(hh, shift, out=tt)
            hh ^= tt
            hh *= np.uint32(mult)
        np.right_shift(hh, 16, out=tt)
        hh ^= tt
        np.add(hh, 0.5, out=uu, dtype=np.float64)  # (h + 0.5) / 2**32: exact in double
        out[a:b] = torch.from_numpy(uu).mul_(1.0 / 4294967296.0).log_().neg_().log_().neg_()
    return out


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's finaliser on 32-bit values held in int64 (products wrap; we keep 32 bits)."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def row_key(seed: int, seq_index: int, position: int) -> int:
    """splitmix64 over the row's coordinates, folded to 32 bits."""
    x = seed & 0xFFFFFFFFFFFFFFFF
    for part in (seq_index, position):
        x = _splitmix64((x ^ (part * 0x9E3779B97F4A7C15)) & 0xFFFFFFFFFFFFFFFF)
    return (x ^ (x >> 32)) & _M32


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)
