"""The committed demo model (models/genq-tiny-stdlib) is a small, loadable, trained Llama.

It is read with plain transformers, the way any user (and genq's loader) reads a model directory.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

MODEL_DIR = Path(__file__).resolve().parents[2] / "models" / "genq-tiny-stdlib"
# Not from the standard library's sources verbatim: ordinary Python the model should find likely.
SNIPPET = '''import os
import sys


def main(argv=None):
    """Print the arguments."""
    if argv is None:
        argv = sys.argv[1:]
    for name in argv:
        path = os.path.join(os.getcwd(), name)
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
'''


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(MODEL_DIR)


@pytest.fixture(scope="module")
def model():
    return AutoModelForCausalLM.from_pretrained(MODEL_DIR).eval()


def greedy(model, input_ids: torch.Tensor, num_tokens: int) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(input_ids, max_new_tokens=num_tokens, min_new_tokens=num_tokens,
                              do_sample=False)


def test_model_directory_is_under_20_mb_with_weights_and_tokenizer() -> None:
    files = {p.name: p.stat().st_size for p in MODEL_DIR.iterdir() if p.is_file()}
    assert {"config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= set(files)
    assert sum(files.values()) < 20 * 1024 * 1024


def test_config_is_a_tiny_gqa_llama() -> None:
    config = AutoConfig.from_pretrained(MODEL_DIR)
    assert config.model_type == "llama"
    assert config.architectures == ["LlamaForCausalLM"]
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (128, 344, 4)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert config.head_dim == 32
    assert config.max_position_embeddings == 512
    assert config.tie_word_embeddings is True
    raw = json.loads((MODEL_DIR / "config.json").read_text())
    assert raw["dtype"] == "float32"
    assert raw["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}


def test_vocab_and_special_tokens_agree_between_model_and_tokenizer(model, tokenizer) -> None:
    config = model.config
    assert config.vocab_size == len(tokenizer) == 4096
    assert model.get_input_embeddings().weight.shape == (4096, 128)
    special = (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token)
    assert special == ("<s>", "</s>", "<pad>")
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (0, 1, 2)
    assert tokenizer.convert_tokens_to_ids(["<s>", "</s>", "<pad>"]) == [0, 1, 2]
    # Like Llama: encoding a prompt prepends <s>.
    assert tokenizer("import ").input_ids[0] == tokenizer.bos_token_id


def test_tokenizer_round_trips_python_source_byte_for_byte(tokenizer) -> None:
    ids = tokenizer(SNIPPET).input_ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == SNIPPET
    # Byte-level BPE trained on Python: far fewer tokens than characters.
    assert len(ids) < len(SNIPPET) / 2


def test_model_predicts_python_far_better_than_chance(model, tokenizer) -> None:
    ids = tokenizer(SNIPPET, return_tensors="pt").input_ids
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss.item()
    # Uniform guessing costs ln(4096) = 8.32 nats a token; the trained model needs under half.
    assert loss < 0.5 * math.log(4096)


def test_greedy_generation_from_import_is_deterministic_and_printable(model, tokenizer) -> None:
    prompt = tokenizer("import ", return_tensors="pt").input_ids
    first, second = greedy(model, prompt, 20), greedy(model, prompt, 20)
    assert first.shape == (1, prompt.shape[1] + 20)
    assert torch.equal(first, second)
    assert torch.equal(first[:, : prompt.shape[1]], prompt)
    text = tokenizer.decode(first[0], skip_special_tokens=True)
    assert text.startswith("import ")
    assert all(ch.isprintable() or ch in "\n\t" for ch in text), repr(text)


def test_greedy_generation_is_the_argmax_of_a_full_forward_pass_at_each_step(
        model, tokenizer) -> None:
    # Derived here, not hard-coded: without a KV cache, re-run the whole sequence and take argmax.
    prompt = tokenizer("def ", return_tensors="pt").input_ids
    ids = prompt
    with torch.no_grad():
        for _ in range(20):
            logits = model(input_ids=ids, use_cache=False).logits[:, -1]
            logits[:, model.config.eos_token_id] = -math.inf  # as min_new_tokens does
            ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(greedy(model, prompt, 20), ids)
