"""EngineConfig's units and option types."""

from __future__ import annotations

from typing import get_args, get_type_hints

import pytest

from engine.config import ATTENTION_BACKENDS, DTYPES, OUTPUT_KINDS, PREEMPTION_MODES, EngineConfig


def test_swap_space_is_in_gib_and_an_old_byte_count_is_refused_with_its_gib() -> None:
    assert EngineConfig(model="m", swap_space=0.5).swap_space_bytes == 1 << 29
    assert EngineConfig(model="m", swap_space=1023).swap_space_bytes == 1023 << 30
    with pytest.raises(ValueError) as exc:
        EngineConfig(model="m", swap_space=4 << 30)
    assert str(exc.value) == (
        "swap_space is in GiB: 4294967296 GiB is beyond any host (a byte count, as older "
        "releases took, is no longer accepted); 4294967296 bytes is swap_space=4")


def test_enum_like_options_are_literal_types_checked_against_their_values() -> None:
    hints = get_type_hints(EngineConfig)
    assert get_args(hints["dtype"]) == DTYPES == ("auto", "float32", "bfloat16", "float16")
    assert get_args(hints["preemption_mode"]) == PREEMPTION_MODES == ("auto", "recompute", "swap")
    assert get_args(hints["scheduling_policy"]) == ("fcfs", "priority")
    assert get_args(hints["output_kind"]) == OUTPUT_KINDS == ("cumulative", "delta")
    assert get_args(get_args(hints["attention_backend"])[0]) == ATTENTION_BACKENDS == (
        "torch", "cupy", "cuda-shim")
    with pytest.raises(ValueError, match="scheduling_policy must be one of"):
        EngineConfig(model="m", scheduling_policy="lifo")  # type: ignore[arg-type]
