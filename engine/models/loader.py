"""Load a Hugging Face model directory: config.json, safetensors weights (one file or sharded
with model.safetensors.index.json) and the tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.config import DTYPES as CONFIG_DTYPES
from engine.config import Dtype
from engine.models.gpt2 import GPT2LMHeadModel
from engine.models.llama import LlamaForCausalLM
from engine.models.weights import SafetensorsWeights

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


def checkpoint_dtype(config: Any) -> str:
    """The dtype config.json states the weights are in (`dtype`; older files say `torch_dtype`,
    which AutoConfig reads into `dtype`); float32 when it states none, as transformers assumes."""
    value = getattr(config, "dtype", None)
    return "float32" if value is None else str(value).removeprefix("torch.")


def resolve_dtype(requested: Dtype, config: Any, device: torch.device,
                  bf16_supported: bool | None = None) -> Dtype:
    """The dtype an engine runs in. "auto" is the checkpoint's dtype, with two exceptions on
    CUDA, as vLLM decides: a float32 checkpoint runs in bfloat16 (tensor cores, half the
    memory), and bfloat16 becomes float16 on a GPU without bfloat16 (before Ampere). On the CPU
    "auto" keeps the checkpoint's dtype, float32 included: the CPU path runs all three, and
    float32 is both the exact one and, without AVX512-BF16 or AMX, the fast one (vLLM's CPU
    backend would run a float32 checkpoint in bfloat16). A stated dtype the engine does not run
    (float64, int8) counts as float32. `bf16_supported` defaults to asking the device."""
    if requested != "auto":
        return requested
    found = checkpoint_dtype(config)
    dtype: Dtype = next((d for d in CONFIG_DTYPES if d != "auto" and d == found), "float32")
    if device.type != "cuda":
        return dtype
    if dtype == "float32":
        dtype = "bfloat16"
    if bf16_supported is None:
        bf16_supported = torch.cuda.is_bf16_supported()
    return "float16" if dtype == "bfloat16" and not bf16_supported else dtype


def load_model(model_dir: str, config: Any, dtype: str, device: torch.device,
               max_len: int) -> nn.Module:
    """The model in `dtype` on `device`, its weights copied in straight from the checkpoint:
    parameters are allocated once, in the target dtype, and each tensor is read from disk and
    converted as it is copied in (peak memory: the model plus one checkpoint tensor)."""
    arch = (getattr(config, "architectures", None) or ["?"])[0]
    if arch not in _ARCHITECTURES:
        raise ValueError(f"architecture {arch!r} is not supported; supported: "
                         f"{', '.join(sorted(_ARCHITECTURES))}")
    with torch.device("meta"):
        model = _ARCHITECTURES[arch](config, max_len).to(DTYPES[dtype])
    model = model.to_empty(device=device)
    with torch.no_grad():
        model.load_weights(SafetensorsWeights(Path(model_dir)))  # type: ignore[operator]
    _rebuild_buffers(model, config, max_len, device)  # rope tables stay float32
    return model.eval()


def _rebuild_buffers(model: nn.Module, config: Any, max_len: int, device: torch.device) -> None:
    from engine.models.layers import RotaryEmbedding

    for name, module in list(model.named_modules()):
        if isinstance(module, RotaryEmbedding):
            head_dim = int(module.cos_sin.shape[-1])
            fresh = RotaryEmbedding(config, head_dim, max_len).to(device)
            parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
            setattr(parent, name.rsplit(".", 1)[-1], fresh)


def load_tokenizer(model_dir: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def load_eos_ids(hf_config: Any, tokenizer: Any, model_dir: str | None = None) -> set[int]:
    """The ids that end a sequence: config.json's (else the tokenizer's), plus those of
    generation_config.json, which transformers' generate() and vLLM stop on too (chat models
    list their end-of-turn token there)."""
    ids = getattr(hf_config, "eos_token_id", None)
    if ids is None:
        ids = tokenizer.eos_token_id
    found = set() if ids is None else set(ids) if isinstance(ids, list) else {int(ids)}
    if model_dir is not None and (Path(model_dir) / "generation_config.json").is_file():
        from transformers import GenerationConfig

        extra = GenerationConfig.from_pretrained(model_dir).eos_token_id
        if extra is not None:
            found |= set(extra) if isinstance(extra, list) else {int(extra)}
    return found
