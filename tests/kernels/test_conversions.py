"""The portable fp16/bf16 conversions of cuda/genq_common.cuh (what the shim runs in place of the
GPU's cvt instructions) round exactly like torch: every half bit pattern, and float inputs that
cover every rounding case."""

from __future__ import annotations

import ctypes

import torch

from tests.kernels.cpu_kernels import ShimLauncher


def _convert(fn: ctypes._CFuncPtr, src: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty(src.shape, dtype=out_dtype)
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_longlong]
    fn(src.data_ptr(), out.data_ptr(), src.numel())
    return out


def _float_inputs() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    random_bits = torch.randint(-2**31, 2**31, (1 << 20,), generator=g, dtype=torch.int64)
    # Every half / bf16 value, and the midpoints between neighbours (ties round to even), +-1 ulp.
    halves = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(torch.float16)
    bf16 = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    grid = torch.cat([halves.float(), bf16.float()])
    grid = grid[grid.isfinite()].unique()
    mids = (grid[1:].double() + grid[:-1].double()) / 2
    bits = mids.float().view(torch.int32)
    return torch.cat([random_bits.to(torch.int32).view(torch.float32), grid, mids.float(),
                      (bits + 1).view(torch.float32), (bits - 1).view(torch.float32),
                      torch.tensor([65504.0, 65519.99, 65520.0, 2.0**-25, 2.0**-24, 3e-8, 1e30,
                                    float("inf"), -float("inf"), float("nan")])])


def test_every_half_bit_pattern_converts_to_the_float_torch_gives(
        cpu_kernels: ShimLauncher) -> None:
    halves = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16)
    out = _convert(cpu_kernels.library.lib.genq_half_to_float, halves, torch.float32)
    assert torch.equal(out.view(torch.int32), halves.view(torch.float16).float().view(torch.int32))


def test_every_bf16_bit_pattern_converts_to_the_float_torch_gives(
        cpu_kernels: ShimLauncher) -> None:
    raw = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16)
    out = _convert(cpu_kernels.library.lib.genq_bf16_to_float, raw, torch.float32)
    assert torch.equal(out.view(torch.int32), raw.view(torch.bfloat16).float().view(torch.int32))


def test_float_to_half_rounds_to_nearest_even_like_torch(cpu_kernels: ShimLauncher) -> None:
    x = _float_inputs()
    out = _convert(cpu_kernels.library.lib.genq_float_to_half, x, torch.int16).view(torch.float16)
    expected = x.half()
    nan = expected.isnan()
    assert torch.equal(out.isnan(), nan)  # NaN payloads may differ; NaN-ness may not
    assert torch.equal(out[~nan].view(torch.int16), expected[~nan].view(torch.int16))


def test_float_to_bf16_rounds_to_nearest_even_like_torch(cpu_kernels: ShimLauncher) -> None:
    x = _float_inputs()
    out = _convert(cpu_kernels.library.lib.genq_float_to_bf16, x, torch.int16).view(torch.bfloat16)
    expected = x.bfloat16()
    nan = expected.isnan()
    assert torch.equal(out.isnan(), nan)
    assert torch.equal(out[~nan].view(torch.int16), expected[~nan].view(torch.int16))
