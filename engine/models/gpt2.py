"""GPT-2: learned positions, LayerNorm, GELU (tanh), multi-head attention, tied embeddings.

Hugging Face stores GPT-2's projections as Conv1D ([in, out] weights); load_weights transposes
them into nn.Linear.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.layers import ForwardContext, attention_scale
from engine.models.weights import Weights

_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


class GPT2Attention(nn.Module):
    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.n_head
        self.head_dim = config.n_embd // config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.scale = attention_scale(self.head_dim) if config.scale_attn_weights else 1.0
        if getattr(config, "scale_attn_by_inverse_layer_idx", False):
            self.scale /= float(layer_idx + 1)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        q, k, v = self.c_attn(x).view(-1, 3, self.num_heads, self.head_dim).unbind(1)
        key_cache, value_cache = ctx.kv_cache[self.layer_idx]
        ctx.backend.write_kv(k, v, key_cache, value_cache, ctx.meta.slot_mapping)
        out = ctx.backend.forward(q, key_cache, value_cache, ctx.meta, self.scale, key=k, value=v)
        return self.c_proj(out.reshape(-1, self.num_heads * self.head_dim))


class GPT2MLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        inner = config.n_inner or 4 * config.n_embd
        self.c_fc = nn.Linear(config.n_embd, inner)
        self.c_proj = nn.Linear(inner, config.n_embd)
        if config.activation_function not in ("gelu_new", "gelu_pytorch_tanh", "gelu"):
            raise ValueError(f"GPT-2 activation {config.activation_function!r} is not supported")
        self.approximate = "none" if config.activation_function == "gelu" else "tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate=self.approximate))


class GPT2Block(nn.Module):
    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = GPT2Attention(config, layer_idx)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = GPT2MLP(config)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), ctx)
        return x + self.mlp(self.ln_2(x))


class GPT2Model(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        self.h = nn.ModuleList(GPT2Block(config, i) for i in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)


class GPT2LMHeadModel(nn.Module):
    def __init__(self, config: Any, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.transformer = GPT2Model(config)
        self.num_kv_heads = config.n_head
        self.head_dim = config.n_embd // config.n_head
        self.num_layers = config.n_layer

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        t = self.transformer
        x = t.wte(input_ids) + t.wpe(positions)
        for block in t.h:
            x = block(x, ctx)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of the rows of `forward`'s output that sample (ln_f is row-wise, so it runs on
        those rows only)."""
        return self.transformer.ln_f(hidden) @ self.transformer.wte.weight.t()

    def load_weights(self, tensors: Weights) -> None:
        for name, param in self.named_parameters():
            source = tensors.get(name)
            if source is None:  # checkpoints saved from GPT2Model lack the prefix
                source = tensors.get(name.removeprefix("transformer."))
            if source is None:
                raise ValueError(f"the checkpoint has no tensor {name!r}; is this a GPT-2 model?")
            if name.endswith(_CONV1D):
                source = source.t()
            with torch.no_grad():
                param.copy_(source)
