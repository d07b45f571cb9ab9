"""The Llama family (Llama 2/3, Mistral, Qwen2): GQA, RoPE (incl. llama3 scaling), RMSNorm,
SwiGLU, optional qkv bias, tied or untied embeddings.

Parameter names follow Hugging Face's, except that q/k/v and gate/up are stored fused
(qkv_proj, gate_up_proj): fewer, larger matmuls per layer. `load_weights` does the fusing.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.layers import (
    ForwardContext,
    RMSNorm,
    RotaryEmbedding,
    apply_rotary,
    attention_scale,
)
from engine.models.weights import Weights


class LlamaAttention(nn.Module):
    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        bias = bool(getattr(config, "attention_bias", False) or config.model_type == "qwen2")
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qk_size = q_size + kv_size
        self.qkv_proj = nn.Linear(config.hidden_size, q_size + 2 * kv_size, bias=bias)
        # (Llama's attention_bias covers o_proj too; Qwen2's q/k/v bias does not)
        o_bias = config.model_type == "llama" and bool(getattr(config, "attention_bias", False))
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=o_bias)
        self.scale = attention_scale(self.head_dim)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                ctx: ForwardContext) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        # q and k share the rotation: rotate them as one [num_tokens, heads + kv_heads] view.
        qk = qkv[:, : self.qk_size].view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(qk, *rope).split((self.num_heads, self.num_kv_heads), dim=1)
        v = qkv[:, self.qk_size:].view(-1, self.num_kv_heads, self.head_dim)
        key_cache, value_cache = ctx.kv_cache[self.layer_idx]
        ctx.backend.write_kv(k, v, key_cache, value_cache, ctx.meta.slot_mapping)
        out = ctx.backend.forward(q, key_cache, value_cache, ctx.meta, self.scale, key=k, value=v)
        return self.o_proj(out.reshape(-1, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.intermediate = config.intermediate_size
        bias = config.model_type == "llama" and bool(getattr(config, "mlp_bias", False))
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * self.intermediate, bias=bias)
        self.down_proj = nn.Linear(self.intermediate, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate, inplace=True).mul_(up))  # gate_up is ours to reuse


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                ctx: ForwardContext) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: Any, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        head_dim = getattr(config, "head_dim", None) or \
            config.hidden_size // config.num_attention_heads
        self.rotary_emb = RotaryEmbedding(config, head_dim, max_positions)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: Any, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, max_positions)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.num_kv_heads: int = getattr(config, "num_key_value_heads", None) or \
            config.num_attention_heads
        self.head_dim: int = getattr(config, "head_dim", None) or \
            config.hidden_size // config.num_attention_heads
        self.num_layers = config.num_hidden_layers

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        rope = self.model.rotary_emb(positions)
        for layer in self.model.layers:
            x = layer(x, rope, ctx)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of the rows of `forward`'s output that sample (the final norm is row-wise, so
        it runs on those rows only)."""
        return self.lm_head(self.model.norm(hidden))

    def load_weights(self, tensors: Weights) -> None:
        fused = {"qkv_proj": ("q_proj", "k_proj", "v_proj"),
                 "gate_up_proj": ("gate_proj", "up_proj")}
        used: set[str] = set()
        for name, param in self.named_parameters():
            if name == "lm_head.weight" and (self.tie_word_embeddings
                                             or "lm_head.weight" not in tensors):
                name = "model.embed_tokens.weight"
            parts = next(((k, v) for k, v in fused.items() if f".{k}." in name), None)
            with torch.no_grad():
                if parts is None:
                    tensors.copy_to(_take(tensors, name, used), param)
                    continue
                # Each part straight into its rows of the fused parameter: no concatenated copy.
                kv = self.num_kv_heads * self.head_dim
                sizes = [param.shape[0] // 2] * 2 if parts[0] == "gate_up_proj" else \
                    [param.shape[0] - 2 * kv, kv, kv]
                for part, rows in zip(parts[1], param.split(sizes), strict=True):
                    tensors.copy_to(_take(tensors, name.replace(parts[0], part), used), rows)
        # A tensor left over is a weight this model would silently run without (a bias its
        # config does not announce, a layer of another architecture): refuse, do not guess.
        left = sorted(k for k in set(tensors) - used if not k.endswith("rotary_emb.inv_freq")
                      and not (k == "lm_head.weight" and self.tie_word_embeddings))
        if left:
            raise ValueError(f"the checkpoint holds {len(left)} tensor(s) this Llama-family model "
                             f"does not use (e.g. {', '.join(left[:3])}): its config.json does "
                             "not describe these weights, or the architecture is another")


def _take(tensors: Weights, name: str, used: set[str]) -> str:
    if name not in tensors:
        raise ValueError(f"the checkpoint has no tensor {name!r}; is this a Llama-family model?")
    used.add(name)
    return name
