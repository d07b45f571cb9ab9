"""The CUDA kernels' start-up check (engine/attention/kernel_check.py) through the CPU shim
build of cuda/: it passes on correct kernels, names the kernel whose result is wrong, and a
passing check gives an engine on a CUDA device the kernels' backend."""

from __future__ import annotations

import logging

import pytest
import torch

from engine import kernels
from engine.attention.cupy_backend import CupyAttentionBackend
from engine.attention.kernel_check import KernelCheckError, check_kernels
from engine.attention.selector import select_backend
from engine.config import EngineConfig

CPU = torch.device("cpu")
# Variants every shim build of the kernel tests compiles.
VARIANTS = [(torch.float32, 64, 16), (torch.float16, 64, 16), (torch.bfloat16, 128, 32)]


@pytest.mark.parametrize("variant", VARIANTS, ids=str)
def test_correct_kernels_pass_the_check(cpu_kernels, variant) -> None:
    launched: list[str] = []

    def run(launches: list[kernels.Launch]) -> None:
        launched.extend(launch.kernel.split("<")[0] for launch in launches)
        cpu_kernels.run(launches)

    check_kernels(*variant, CPU, run=run)
    assert launched == ["genq::reshape_and_cache_kernel", "genq::paged_attention_decode_kernel",
                        "genq::paged_attention_reduce_kernel",
                        "genq::paged_attention_prefill_kernel", "genq::copy_blocks_kernel"]


@pytest.mark.parametrize("dropped, kernel", [
    ("prefill", "prefill"), ("reduce", "decode"), ("copy_blocks", "copy_blocks")])
def test_a_kernel_that_does_not_do_its_work_fails_the_check(cpu_kernels, dropped: str,
                                                            kernel: str) -> None:
    def run(launches: list[kernels.Launch]) -> None:
        cpu_kernels.run([launch for launch in launches if dropped not in launch.kernel])

    with pytest.raises(KernelCheckError, match=f"^{kernel} returned wrong values"):
        check_kernels(torch.float32, 64, 16, CPU, run=run)


def test_a_passing_check_gives_the_kernels_backend(cpu_kernels,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    config = EngineConfig(model="m", dtype="bfloat16", block_size=32)
    with caplog.at_level(logging.INFO):
        backend = select_backend(config, torch.device("cuda", 0), 128, check=lambda: check_kernels(
            torch.bfloat16, 128, 32, CPU, run=cpu_kernels.run))
    assert isinstance(backend, CupyAttentionBackend)
    assert caplog.records == []
