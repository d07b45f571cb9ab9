"""The attention backend an engine gets on a CUDA device: the CUDA kernels only after their
start-up check passes. A failed check is one warning line and the torch backend, or, under an
explicit attention_backend="cupy", an error that says why. Here the check fails the way it does
on a machine without CuPy (the real check, run on this machine's tensors)."""

from __future__ import annotations

import logging

import pytest
import torch

from engine import kernels
from engine.attention.kernel_check import KernelCheckError, check_kernels
from engine.attention.selector import select_backend
from engine.attention.torch_backend import TorchAttentionBackend
from engine.config import EngineConfig

CUDA = torch.device("cuda", 0)
NO_CUPY = "CuPy is not importable: pip install 'genq[gpu]'"


@pytest.fixture
def failing_check() -> object:
    if kernels.cupy_available():
        pytest.skip("CuPy imports here: the check fails otherwise on a machine without a GPU")
    return lambda: check_kernels(torch.float32, 64, 16, torch.device("cpu"))


def test_the_check_reports_why_in_one_line(failing_check) -> None:
    with pytest.raises(KernelCheckError) as raised:
        failing_check()
    assert str(raised.value) == NO_CUPY


def test_a_failed_check_falls_back_to_torch_in_one_warning_line(
        failing_check, caplog: pytest.LogCaptureFixture) -> None:
    config = EngineConfig(model="m", dtype="float32", block_size=16)
    with caplog.at_level(logging.INFO):
        backend = select_backend(config, CUDA, 64, check=failing_check)
    assert isinstance(backend, TorchAttentionBackend)
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [(
        "WARNING", f"the CUDA kernels failed their start-up check ({NO_CUPY}): using the torch "
        "attention backend")]


def test_an_explicit_cupy_backend_whose_check_fails_is_an_error(
        failing_check, caplog: pytest.LogCaptureFixture) -> None:
    config = EngineConfig(model="m", dtype="float32", block_size=16, attention_backend="cupy")
    with pytest.raises(KernelCheckError) as raised:
        select_backend(config, CUDA, 64, check=failing_check)
    assert str(raised.value) == ("attention_backend='cupy': the CUDA kernels failed their "
                                 f"start-up check: {NO_CUPY}")
    assert caplog.records == []


def test_a_cache_without_a_kernel_variant_is_not_checked(
        caplog: pytest.LogCaptureFixture) -> None:
    def never() -> None:
        raise AssertionError("checked a variant the kernels do not have")

    config = EngineConfig(model="m", dtype="float32", block_size=16)
    with caplog.at_level(logging.INFO):
        backend = select_backend(config, CUDA, 72, check=never)
    assert isinstance(backend, TorchAttentionBackend)
    assert [r.getMessage() for r in caplog.records] == [
        "no CUDA kernel variant for float32, head size 72, block size 16: using the torch "
        "attention backend"]


def test_an_unsupported_variant_fails_the_check_before_any_launch() -> None:
    with pytest.raises(KernelCheckError, match=r"^ValueError: the CUDA kernels support .* got "
                       r"torch.float32, head size 72, block size 16"):
        check_kernels(torch.float32, 72, 16, torch.device("cpu"), run=lambda launches: None)
