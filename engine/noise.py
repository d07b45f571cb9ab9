"""The sampling noise: Gumbel noise that is a pure function of (request seed, sequence index,
output position, token id).

A counter-based hash gives every (row, token) a 32-bit value h; u = (h + 0.5) / 2**32 and the
noise is -log(-log(u)), computed in double and rounded to float32. The CPU and the torch path
(any device) give the same bits, so a seeded job samples the same tokens on any worker.

A step's rows are known before its model runs, so on a CPU worker with a core its torch threads
leave over the noise is made ahead, on a thread of its own, while the model runs (prefetch); the
draw takes it when it asks for the same rows, and makes its own otherwise.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

_M32 = 0xFFFFFFFF


class Noise:
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.ahead = False  # make a step's CPU noise while its model runs (a core to spare)
        self._vocab_hash: torch.Tensor | None = None
        self._vocab_hash_u32: np.ndarray | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._made: tuple[list[tuple[int, int, int]], Future[torch.Tensor]] | None = None

    def __call__(self, rows: list[tuple[int, int, int]], device: torch.device) -> torch.Tensor:
        """Gumbel noise [rows, vocab] for rows of (seed, sequence index, output position)."""
        made, self._made = self._made, None
        if made is not None and device.type == "cpu" and made[0] == rows:
            return made[1].result()
        return self._make(rows, device)

    def prefetch(self, rows: list[tuple[int, int, int]]) -> None:
        """Start making the CPU noise of `rows` on the noise thread (the next call for exactly
        these rows takes it; any other call drops it)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="genq-noise")
        self._made = (rows, self._pool.submit(self._make, rows, torch.device("cpu")))

    def _make(self, rows: list[tuple[int, int, int]], device: torch.device) -> torch.Tensor:
        keys = [row_key(*row) for row in rows]
        if device.type == "cpu":
            if self._vocab_hash_u32 is None:
                self._vocab_hash_u32 = vocab_hash(self.vocab_size).numpy().astype(np.uint32)
            return gumbel_cpu(self._vocab_hash_u32, keys)
        if self._vocab_hash is None or self._vocab_hash.device != device:
            self._vocab_hash = vocab_hash(self.vocab_size).to(device)
        return gumbel_torch(self._vocab_hash, keys)


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
