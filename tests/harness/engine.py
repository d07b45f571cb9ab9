"""Engine test helpers: random token prompts, the transformers greedy oracle, the leak check."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

EOS_ID = 16  # the EOS token of the eos_llama fixture: one tiny_llama often generates
# The KV cache of the engines tests build where the cache's size is not the claim: room for any
# test's batch (thousands of tiny-model blocks). The CPU default, 4 GiB, is a million such
# blocks, and building their free list and checking the block invariants over them costs
# seconds per engine and per checked step.
KV_CACHE_MEMORY = 32 << 20


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


def assert_drained(llm_or_engine: Any) -> None:
    """No leaked blocks: every device and host block is free, ref counts match the tables."""
    engine = getattr(llm_or_engine, "engine", llm_or_engine)
    stats = engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert stats["num_free_host_blocks"] == stats["num_host_blocks"]
    engine.block_manager.check_invariants()
    assert not engine.has_unfinished()
