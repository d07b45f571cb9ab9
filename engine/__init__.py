"""genq's continuous-batching engine: paged KV cache, chunked prefill, preemption."""

from engine.config import EngineConfig
from engine.engine import Engine
from engine.llm import LLM
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "Engine", "EngineConfig", "RequestOutput", "SamplingParams"]
