"""The start-up check of genq's CUDA kernels: compile the variant an engine will launch and run
each of its kernels once on a tiny cache, through the same planning functions and launcher as
every step (engine/kernels.py), comparing the results with plain torch.

A broken NVRTC, driver or kernel is then found before the first job, not as an error on every
step. The check takes a runner so that the CPU shim build of cuda/ can run it too.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from engine import kernels

Runner = Callable[[list[kernels.Launch]], None]
NUM_KV_HEADS, NUM_HEADS = 1, 2  # a GQA group of 2
# Largest difference from the float32 reference a correct kernel shows here (the inputs are
# exactly representable; only accumulation order and the output's rounding differ).
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}


class KernelCheckError(RuntimeError):
    """The CUDA kernels cannot serve this engine; the message says why."""


def check_kernels(dtype: torch.dtype, head_size: int, block_size: int, device: torch.device,
                  run: Runner | None = None) -> None:
    """Launches reshape_and_cache, decode (long enough to need the reduce kernel), prefill and
    copy_blocks once each for (dtype, head_size, block_size) on `device`, with `run`
    (kernels.run_launches by default), and checks their results. Raises KernelCheckError."""
    if run is None and not kernels.cupy_available():
        raise KernelCheckError("CuPy is not importable: pip install 'genq[gpu]'")
    try:
        kernels.check_variant(dtype, head_size, block_size)
        _check(dtype, head_size, block_size, device, run or kernels.run_launches)
    except KernelCheckError:
        raise
    except Exception as e:  # noqa: BLE001 - NVRTC, the driver and CuPy raise their own types
        raise KernelCheckError(f"{type(e).__name__}: {e}".splitlines()[0]) from e


def _check(dtype: torch.dtype, head_size: int, block_size: int, device: torch.device,
           run: Runner) -> None:
    g = torch.Generator().manual_seed(0)
    seq_lens = [kernels.PARTITION_SIZE + 3, 5]  # the first needs 2 partitions and the reduce
    sizes = [math.ceil(n / block_size) for n in seq_lens]
    tables = [list(range(sizes[0])), list(range(sizes[0], sum(sizes)))]
    num_blocks = sum(sizes) + 2  # the last two: copy_blocks' source and destination
    width = max(len(t) for t in tables)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype).to(device)

    cache = rand(1, 2, num_blocks, block_size, NUM_KV_HEADS, head_size)
    key_cache, value_cache = cache[0, 0], cache[0, 1]
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32,
                                device=device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    scale = head_size ** -0.5

    # reshape_and_cache: each sequence's last token into its slot.
    new_k, new_v = rand(2, NUM_KV_HEADS, head_size), rand(2, NUM_KV_HEADS, head_size)
    slots = [t[(n - 1) // block_size] * block_size + (n - 1) % block_size
             for t, n in zip(tables, seq_lens, strict=True)]
    run(kernels.reshape_and_cache(new_k, new_v, key_cache, value_cache,
                                  torch.tensor(slots, dtype=torch.int64, device=device)))
    written = torch.stack([c.reshape(-1, NUM_KV_HEADS, head_size)[slots]
                           for c in (key_cache, value_cache)])
    _expect("reshape_and_cache", written, torch.stack([new_k, new_v]), 0.0)

    # decode: one query per sequence over its whole context.
    query = rand(2, NUM_HEADS, head_size)
    out = torch.empty_like(query)
    run(kernels.decode(out, query, key_cache, value_cache, block_tables, lens, max(seq_lens),
                       scale))
    ref = torch.stack([_attend(query[i], key_cache, value_cache, tables[i], seq_lens[i], scale)
                       for i in range(2)])
    _expect("decode", out, ref, TOLERANCE[dtype])

    # prefill: the last 3 tokens of the short sequence, causally.
    rows = 3
    query = rand(rows, NUM_HEADS, head_size)
    out = torch.empty_like(query)
    run(kernels.prefill(out, query, key_cache, value_cache, block_tables[1:], lens[1:],
                        torch.tensor([0, rows], dtype=torch.int32, device=device), 0, 1, rows,
                        scale))
    ref = torch.stack([_attend(query[j], key_cache, value_cache, tables[1],
                               seq_lens[1] - rows + j + 1, scale) for j in range(rows)])
    _expect("prefill", out, ref, TOLERANCE[dtype])

    # copy_blocks: the second-to-last block into the last, K and V.
    expected = cache[:, :, num_blocks - 2].clone()
    run(kernels.copy_blocks(cache, cache, torch.tensor([[num_blocks - 2, num_blocks - 1]],
                                                       dtype=torch.int64, device=device)))
    _expect("copy_blocks", cache[:, :, num_blocks - 1], expected, 0.0)


def _attend(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
            table: list[int], length: int, scale: float) -> torch.Tensor:
    """One token's attention ([num_heads, head_size]) over the first `length` tokens of a
    sequence's blocks, in float32."""
    head_size = key_cache.shape[-1]
    k = key_cache[table].reshape(-1, NUM_KV_HEADS, head_size)[:length].float()
    v = value_cache[table].reshape(-1, NUM_KV_HEADS, head_size)[:length].float()
    group = NUM_HEADS // NUM_KV_HEADS
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    probs = torch.softmax(torch.einsum("hd,lhd->hl", query.float(), k) * scale, dim=-1)
    return torch.einsum("hl,lhd->hd", probs, v)


def _expect(kernel: str, got: torch.Tensor, want: torch.Tensor, tolerance: float) -> None:
    if got.device.type == "cuda":
        torch.cuda.synchronize(got.device)  # a failed launch surfaces here
    err = float((got.float() - want.float()).abs().max())
    if not err <= tolerance:  # NaN fails too
        raise KernelCheckError(f"{kernel} returned wrong values (largest error {err:.3g}, "
                               f"allowed {tolerance:.3g})")
