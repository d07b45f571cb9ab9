"""Building blocks shared by the model files: RMSNorm, rotary embedding, the forward context."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
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
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # One op computing exactly Hugging Face's float32 arithmetic below.
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Hugging Face normalises in float32 and rounds before the weight multiplies.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to max_positions, in the Hugging Face convention
    (rotate_half over the two halves of the head). The sin table has rotate_half's minus sign
    folded into its first half, an exact change that saves a negation per layer; cos and sin sit
    in one table so a step gathers them in one op."""

    def __init__(self, config: Any, head_dim: int, max_positions: int) -> None:
        super().__init__()
        with torch.device("cpu"):  # real numbers even when the model is built on "meta"
            inv_freq, scaling = _inv_freq(config, head_dim)
            t = torch.arange(max_positions, dtype=torch.float32)
            emb = torch.outer(t, inv_freq).repeat(1, 2)
        sin = emb.sin() * scaling
        sin[:, : head_dim // 2].neg_()
        self.register_buffer("cos_sin", torch.stack((emb.cos() * scaling, sin), dim=1),
                             persistent=False)

    cos_sin: torch.Tensor  # [max_positions, 2, head_dim]

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # cos, sin: [num_tokens, 1, head_dim], broadcast over heads.
        cos, sin = self.cos_sin.index_select(0, positions).split(1, dim=1)
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin for x [num_tokens, heads, head_dim], `sin` sign-folded
    (see RotaryEmbedding); computed in float32. Pass q and k as one tensor: half the ops."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    if x.dtype != torch.float32:
        return (x.float() * cos + swapped.float() * sin).to(x.dtype)
    return swapped.mul_(sin).add_(x * cos)


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
