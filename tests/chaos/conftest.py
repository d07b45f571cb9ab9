"""Chaos fixtures: the offline oracle (the same LLM.generate the fleet tests compare with). The
hook that shows worker logs on a failure lives in tests/conftest.py."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.fleet.harness import Expected

Oracle = Callable[[list[str], list[dict[str, Any]]], list[Expected]]


@pytest.fixture(scope="session")
def chaos_offline(tiny_llama: Path) -> Oracle:
    """LLM.generate on the same model: one result per prompt as
    [(token_ids, text, finish_reason) per sequence index]."""
    from engine import LLM, SamplingParams

    llm = LLM(model=str(tiny_llama), num_gpu_blocks_override=2048, swap_space=0.01,
              num_threads=1)

    def run(prompts: list[str], params: list[dict[str, Any]]) -> list[Expected]:
        outs = llm.generate(prompts, [SamplingParams.from_dict(p) for p in params],
                            use_tqdm=False)
        return [[(list(c.token_ids), c.text, c.finish_reason)
                 for c in sorted(o.outputs, key=lambda c: c.index)] for o in outs]

    return run
