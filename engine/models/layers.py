"""Building blocks shared by the model files: RMSNorm, rotary embedding, the forward context."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engine.attention.base import AttentionBackend, AttentionMetadata


@dataclass
class ForwardContext:
    """Everything a layer needs besides its input: passed down explicitly, never global."""

    backend: AttentionBackend
    meta: AttentionMetadata
    kv_cache: torch.Tensor  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_size]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to max_positions, in the Hugging Face convention
    (rotate_half over the two halves of the head)."""

    def __init__(self, config: Any, head_dim: int, max_positions: int) -> None:
        super().__init__()
        with torch.device("cpu"):  # real numbers even when the model is built on "meta"
            inv_freq, scaling = _inv_freq(config, head_dim)
            t = torch.arange(max_positions, dtype=torch.float32)
            emb = torch.outer(t, inv_freq).repeat(1, 2)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)

    cos: torch.Tensor
    sin: torch.Tensor

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # [num_tokens, 1, head_dim], broadcast over heads.
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


def _inv_freq(config: Any, head_dim: int) -> tuple[torch.Tensor, float]:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (base ** exponent), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"rope type {rope_type!r} is not supported; "
                         f"known: default, {', '.join(ROPE_INIT_FUNCTIONS)}")
    if rope_type == "dynamic":
        raise ValueError("dynamic NTK rope changes with sequence length; it is not supported")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    return inv_freq.float(), float(scaling)


def attention_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
