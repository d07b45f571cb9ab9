"""Tiny random Hugging Face models and a locally trained tokenizer, built on the spot.

Nothing is downloaded: the tokenizer is a byte-level BPE trained on text generated here, and the
models are random-initialised transformers models saved with save_pretrained, so the engine loads
them through the same loader users use.
"""

from __future__ import annotations

import random
from pathlib import Path

VOCAB_SIZE = 512
_WORDS = ("the quick brown fox jumps over a lazy dog while redis streams carry tokens to every "
          "worker in the fleet and the engine batches requests continuously").split()
_EXTRA = ["héllo", "naïve", "日本語", "café", "über", "🙂", "😀", "ß", "π", "→"]

ARCHS = ("llama", "llama_mha_untied", "llama3_rope", "llama_biases", "qwen2", "mistral", "gpt2")


def corpus(num_lines: int = 400, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = list(_WORDS) + _EXTRA
    return [" ".join(rng.choice(words) for _ in range(rng.randint(3, 14)))
            for _ in range(num_lines)]


def build_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")
    fast.save_pretrained(str(path))


def model_config(arch: str, vocab_size: int = VOCAB_SIZE):  # -> transformers.PretrainedConfig
    from transformers import GPT2Config, LlamaConfig, MistralConfig, Qwen2Config

    common = dict(vocab_size=vocab_size, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    llama = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                 rms_norm_eps=1e-5, **common)
    if arch == "llama":
        return LlamaConfig(**llama, tie_word_embeddings=True)
    if arch == "llama_mha_untied":
        return LlamaConfig(**{**llama, "num_key_value_heads": 4}, tie_word_embeddings=False)
    if arch == "llama3_rope":
        rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
                "rope_theta": 500000.0}
        return LlamaConfig(**llama, tie_word_embeddings=False, rope_parameters=rope)
    if arch == "llama_biases":  # attention_bias (q/k/v and o_proj) and mlp_bias
        return LlamaConfig(**llama, tie_word_embeddings=True, attention_bias=True, mlp_bias=True)
    if arch == "qwen2":
        return Qwen2Config(**llama, tie_word_embeddings=True, use_sliding_window=False)
    if arch == "mistral":
        return MistralConfig(**llama, tie_word_embeddings=False, sliding_window=None)
    if arch == "gpt2":
        return GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=512, **common)
    raise ValueError(f"unknown tiny arch {arch!r}")


def build_model(arch: str, path: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """Save a random tiny model of `arch` plus the shared tokenizer into `path`."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    vocab = len(AutoTokenizer.from_pretrained(str(tokenizer_dir)))  # every id decodes to text
    model = AutoModelForCausalLM.from_config(model_config(arch, vocab), dtype=torch.float32)
    # Random init is close to uniform; sharpen it so greedy decoding is not a coin toss on ties.
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.mul_(3.0) if p.dim() > 1 else None
            if arch == "llama_biases" and name.endswith("bias"):  # (0 at init: no effect)
                p.normal_(0.0, 0.5)
    model.save_pretrained(str(path))
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, path / f.name)
    return path


def build_kernel_llama(path: Path, tokenizer_dir: Path | None = None, heads: int = 4,
                       kv_heads: int = 2, head: int = 64, tie: bool = False) -> Path:
    """A 2-layer random Llama whose head size the CUDA kernels serve (64 by default, GQA 4/2),
    saved in float32 with its weights sharpened so greedy decoding has no near-ties, with the
    tests' tokenizer (copied from `tokenizer_dir`, or built)."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=VOCAB_SIZE, bos_token_id=0, eos_token_id=1, pad_token_id=2,
                         hidden_size=heads * head, intermediate_size=2 * heads * head,
                         num_hidden_layers=2, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, max_position_embeddings=1024,
                         rms_norm_eps=1e-5, tie_word_embeddings=tie)
    torch.manual_seed(heads * 1000 + head)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(3.0)
    model.save_pretrained(str(path))
    if tokenizer_dir is None:
        build_tokenizer(path)
    else:
        for f in tokenizer_dir.iterdir():
            shutil.copy(f, path / f.name)
    return path


def build_truncated(source: Path, path: Path, num_layers: int) -> Path:
    """A draft model for speculative decoding: `source`'s first `num_layers` decoder layers
    (embeddings, final norm and head kept), with its tokenizer."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32)
    model.model.layers = model.model.layers[:num_layers]
    model.config.num_hidden_layers = num_layers
    model.save_pretrained(str(path))
    for f in source.iterdir():
        if f.name.startswith("tokenizer") or f.name == "generation_config.json":
            shutil.copy(f, path / f.name)
    return path
