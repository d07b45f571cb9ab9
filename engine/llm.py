"""LLM: offline batch generation over the Engine, with a progress bar."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from engine.config import EngineConfig
from engine.engine import Engine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str, **config: Any) -> None:
        config.setdefault("stream_text", False)  # generate() returns whole outputs only
        self.engine = Engine(EngineConfig(model=str(model), **config))
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(self, prompts: Sequence[str] | Sequence[list[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """`priority`: one per prompt, lower runs sooner (scheduling_policy="priority")."""
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        priority = [0] * len(prompts) if priority is None else list(priority)
        if len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts")
        ids = [f"llm-{next(self._ids)}" for _ in prompts]
        for request_id, prompt, p, rank in zip(ids, prompts, params, priority):
            self.engine.add_request(request_id, prompt, p, rank)  # type: ignore[arg-type]
        results: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generate", unit="req", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished():
                for out in self.engine.step(finished_only=True):
                    if out.finished:
                        results[out.request_id] = out
                        bar.update(1)
        return [results[i] for i in ids]

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()
