"""The offline oracle: LLM.generate on the model a fleet serves. What a worker, the gateway or
any client returns is compared with it, token for token."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

Expected = list[tuple[list[int], str, str | None]]  # (token_ids, text, finish_reason) per index
Prompt = str | list[int]
Params = dict[str, Any]


class Oracle:
    """One offline LLM on a model directory (the fixture `oracle_of` builds one per model per
    session). A cache large enough that nothing the tests ask for is preempted."""

    def __init__(self, model: Path) -> None:
        from engine import LLM

        self.llm = LLM(model=str(model), num_gpu_blocks_override=2048, swap_space=0.01,
                       num_threads=1)

    def outputs(self, prompts: list[Prompt], params: Params | list[Params]) -> list[list[Any]]:
        """Each prompt's CompletionOutputs in index order; `params` one for all or one each."""
        from engine import SamplingParams

        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        outs = self.llm.generate(prompts, [SamplingParams.from_dict(p) for p in per_prompt],
                                 use_tqdm=False)
        return [sorted(o.outputs, key=lambda c: c.index) for o in outs]

    def __call__(self, prompts: list[Prompt], params: Params | list[Params]) -> list[Expected]:
        """Each prompt's [(token_ids, text, finish_reason) per sequence index]."""
        return [[(list(c.token_ids), c.text, c.finish_reason) for c in seqs]
                for seqs in self.outputs(prompts, params)]


OracleOf = Callable[[Path], Oracle]
