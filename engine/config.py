"""EngineConfig: every knob of the engine, validated once (vLLM's names)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, get_args

from engine.spec_config import SpeculativeConfig

_GIB = 1 << 30
Dtype = Literal["auto", "float32", "bfloat16", "float16"]
PreemptionMode = Literal["auto", "recompute", "swap"]
OutputKind = Literal["cumulative", "delta"]
SchedulingPolicy = Literal["fcfs", "priority"]
AttentionBackend = Literal["torch", "cupy", "cuda-shim"]
DTYPES: tuple[Dtype, ...] = get_args(Dtype)
PREEMPTION_MODES: tuple[PreemptionMode, ...] = get_args(PreemptionMode)
OUTPUT_KINDS: tuple[OutputKind, ...] = get_args(OutputKind)
SCHEDULING_POLICIES: tuple[SchedulingPolicy, ...] = get_args(SchedulingPolicy)
ATTENTION_BACKENDS: tuple[AttentionBackend, ...] = get_args(AttentionBackend)
# A swap_space this large (1 TiB) was a byte count in an older release: refused, not misread.
_MAX_SWAP_GIB = 1024


@dataclass(frozen=True)
class EngineConfig:
    model: str
    device: str = "cpu"
    # "auto": the checkpoint's dtype, bfloat16 on CUDA for a float32 checkpoint (see
    # engine.models.loader.resolve_dtype); the Engine replaces it with the dtype it runs in.
    dtype: Dtype = "auto"
    block_size: int = 16
    num_gpu_blocks_override: int | None = None
    kv_cache_memory: int = 4 * _GIB  # bytes of KV cache on the CPU
    gpu_memory_utilization: float = 0.9  # fraction of free device memory on CUDA
    swap_space: float = 4.0  # GiB of host memory for swapped-out KV blocks (vLLM's unit)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    # A step that can admit waiting prompts while others decode admits them alone, without the
    # decodes, never twice in a row (TGI's and SGLang's schedule): a new request's first token
    # does not wait for a step that also decodes every running request, which waits for the
    # prefill step instead. Off: prompts join the decode step (vLLM V1's). docs/serving.md has
    # the trade-off measured.
    prefills_first: bool = False
    # Reuse the KV of full prompt blocks that earlier requests computed (vLLM's automatic
    # prefix caching): a request sharing a prompt prefix computes only what follows it. Off by
    # default (vLLM V1 turns it on): tokens are the same, but a request that hits the cache runs
    # its uncached tokens through other kernels and shapes, so its logprobs differ from an
    # uncached run's in the last float bits (~1e-7), where repeated identical requests now agree
    # bit for bit; and on the CPU the cache keeps freed blocks, so the KV cache's resident
    # memory grows towards kv_cache_memory instead of the peak working set.
    enable_prefix_caching: bool = False
    max_model_len: int | None = None
    seed: int = 0
    preemption_mode: PreemptionMode = "auto"
    # "fcfs": requests run in arrival order. "priority" (vLLM's): in (priority, arrival) order,
    # lower priority values first; a more urgent arrival preempts less urgent running requests
    # when the cache cannot take it.
    scheduling_policy: SchedulingPolicy = "fcfs"
    watermark: float = 0.01
    artificial_preemption_prob: float = 0.0
    artificial_preemption_seed: int = 0
    artificial_preemption_max: int = 500
    # "torch" | "cupy" | "cuda-shim" (the CUDA kernels on the CPU); None picks by device.
    attention_backend: AttentionBackend | None = None
    num_threads: int | None = None  # torch intra-op threads on the CPU
    # Every step's outputs carry the text so far (streaming). Off: text is decoded once at the
    # end (requests with stop strings still decode as they go); the offline LLM turns it off.
    stream_text: bool = True
    # "cumulative": every output holds each sequence's tokens and text so far. "delta" (vLLM's
    # RequestOutputKind.DELTA, engine-wide): only what is new since the request's last output;
    # the deltas concatenate to the cumulative output (text that a stop string may still cut
    # is held back until it cannot). Ranked requests (best_of > n, beam search) output once, whole.
    output_kind: OutputKind = "cumulative"
    # Speculative decoding (vLLM's keys, engine/spec_config.py): e.g. {"method": "ngram",
    # "num_speculative_tokens": 4, "prompt_lookup_max": 4}. Outputs stay exactly as without it.
    speculative_config: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.block_size < 1 or self.block_size > 256 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two up to 256 (the CUDA kernels "
                             f"take 8, 16 or 32), got {self.block_size}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError("num_gpu_blocks_override must be at least 1, "
                             f"got {self.num_gpu_blocks_override}")
        if self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1], "
                             f"got {self.gpu_memory_utilization}")
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0 GiB, got {self.swap_space}")
        if self.swap_space >= _MAX_SWAP_GIB:
            raise ValueError(f"swap_space is in GiB: {self.swap_space:.0f} GiB is beyond any host "
                             "(a byte count, as older releases took, is no longer accepted); "
                             f"{self.swap_space:.0f} bytes is swap_space="
                             f"{self.swap_space / _GIB:g}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be at least 1, "
                             f"got {self.max_num_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be at least 1, got {self.max_model_len}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, "
                             f"got {self.scheduling_policy!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, "
                             f"got {self.preemption_mode!r}")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        if not 0.0 <= self.artificial_preemption_prob <= 1.0:
            raise ValueError("artificial_preemption_prob must be in [0, 1], "
                             f"got {self.artificial_preemption_prob}")
        if self.output_kind not in OUTPUT_KINDS:
            raise ValueError(f"output_kind must be one of {OUTPUT_KINDS}, got {self.output_kind!r}")
        if self.speculative_config is not None:
            SpeculativeConfig.from_dict(self.speculative_config)  # (a ValueError names the fault)
        if self.attention_backend not in (None, *ATTENTION_BACKENDS):
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                             f"got {self.attention_backend!r}")

    @property
    def speculative(self) -> SpeculativeConfig | None:
        if self.speculative_config is None:
            return None
        return SpeculativeConfig.from_dict(self.speculative_config)

    @property
    def swap_space_bytes(self) -> int:
        return int(self.swap_space * _GIB)
