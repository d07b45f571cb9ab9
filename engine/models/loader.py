"""Load a Hugging Face model directory: config.json, safetensors weights (one file or sharded
with model.safetensors.index.json) and the tokenizer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.models.gpt2 import GPT2LMHeadModel
from engine.models.llama import LlamaForCausalLM

_ARCHITECTURES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "GPT2LMHeadModel": GPT2LMHeadModel,
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_config(model_dir: str) -> Any:
    from transformers import AutoConfig

    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise ValueError(f"{model_dir!r} is not a Hugging Face model directory (no config.json)")
    return AutoConfig.from_pretrained(str(path))


def max_positions(config: Any) -> int:
    for name in ("max_position_embeddings", "n_positions"):
        if getattr(config, name, None):
            return int(getattr(config, name))
    raise ValueError("the model config states no maximum length (max_position_embeddings)")


def load_model(model_dir: str, config: Any, dtype: str, device: torch.device,
               max_len: int) -> nn.Module:
    arch = (getattr(config, "architectures", None) or ["?"])[0]
    if arch not in _ARCHITECTURES:
        raise ValueError(f"architecture {arch!r} is not supported; supported: "
                         f"{', '.join(sorted(_ARCHITECTURES))}")
    with torch.device("meta"):
        model = _ARCHITECTURES[arch](config, max_len)
    model = model.to_empty(device=device)
    model.load_weights(read_safetensors(Path(model_dir)))  # type: ignore[operator]
    model = model.to(DTYPES[dtype]).eval()
    _rebuild_buffers(model, config, max_len, device)  # rope tables stay float32
    return model


def _rebuild_buffers(model: nn.Module, config: Any, max_len: int, device: torch.device) -> None:
    from engine.models.layers import RotaryEmbedding

    for name, module in list(model.named_modules()):
        if isinstance(module, RotaryEmbedding):
            head_dim = int(module.cos_sin.shape[-1])
            fresh = RotaryEmbedding(config, head_dim, max_len).to(device)
            parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
            setattr(parent, name.rsplit(".", 1)[-1], fresh)


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = [f.name for f in sorted(path.glob("*.safetensors"))]
    if not files:
        raise ValueError(f"no .safetensors weights in {path}; convert the checkpoint first")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        tensors.update(load_file(str(path / name)))
    return {k: v.float() for k, v in tensors.items()}


def load_tokenizer(model_dir: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)
