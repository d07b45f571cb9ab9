from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine import LLM


def random_prompts(num: int, seed: int, lo: int = 3, hi: int = 40, vocab: int = 400) -> list:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(num)]


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int,
              bias: dict[int, float] | None = None) -> list[list[int]]:
    """The oracle: transformers generate(do_sample=False), one prompt at a time, no EOS stop;
    `bias`: token id -> logit bias, as sequence_bias of one-token sequences."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p)),
                                 max_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=None, pad_token_id=2,
                                 sequence_bias={(t,): b for t, b in (bias or {}).items()} or None)
            outs.append(ids[0, len(p):].tolist())
    return outs


def assert_drained(llm_or_engine) -> None:
    """No leaked blocks: every device and host block is free, ref counts match the tables."""
    engine = getattr(llm_or_engine, "engine", llm_or_engine)
    stats = engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert stats["num_free_host_blocks"] == stats["num_host_blocks"]
    engine.block_manager.check_invariants()
    assert not engine.has_unfinished()


@pytest.fixture
def make_llm():
    """Build LLMs for a test and check after it that none leaked a block."""
    made: list[LLM] = []

    def make(model_dir: Path, **config) -> LLM:
        config.setdefault("swap_space", 0.05)
        llm = LLM(str(model_dir), **config)
        made.append(llm)
        return llm

    yield make
    for llm in made:
        assert_drained(llm)


@pytest.fixture(scope="session")
def eos_llama(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny_llama with EOS_ID as its EOS token (config and generation config), a token it
    often generates, so that EOS endings happen within a few tokens."""
    import json
    import shutil

    path = tmp_path_factory.mktemp("eos_llama") / "model"
    shutil.copytree(tiny_llama, path)
    for name in ("config.json", "generation_config.json"):
        config = json.loads((path / name).read_text())
        config["eos_token_id"] = EOS_ID
        (path / name).write_text(json.dumps(config))
    return path


EOS_ID = 16
