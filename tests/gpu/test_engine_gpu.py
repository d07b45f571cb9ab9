"""The engine on a CUDA device with attention_backend="cupy": greedy output equals transformers
token for token (float32), with chunked prefill, and with swap preemption forced by a small
cache."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from tests.harness.models import build_kernel_llama

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

MAX_TOKENS = 24
# Each engine gets a fixed, ample cache and little pinned swap space: sized from free memory,
# the first engine of the process would take 90% of the device.
ROOMY = dict(num_gpu_blocks_override=512, swap_space=0.05)
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def llama_head64(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    """A tiny Llama whose head size (64) the CUDA kernels support; GQA 4 query / 2 KV heads."""
    return build_kernel_llama(tmp_path_factory.mktemp("llama_head64"), tokenizer_dir)


def prompts(num: int, seed: int, lo: int, hi: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 400) for _ in range(rng.randint(lo, hi))] for _ in range(num)]


def hf_greedy(model_dir: Path, batch: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).cuda()
    outs = []
    with torch.no_grad():
        for p in batch:
            ids = model.generate(torch.tensor([p], device="cuda"),
                                 attention_mask=torch.ones(1, len(p), device="cuda"),
                                 max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None,
                                 pad_token_id=2)
            outs.append(ids[0, len(p):].tolist())
    return outs


@pytest.mark.parametrize("budget", [2048, 24], ids=["whole-prefill", "chunked-prefill"])
def test_cupy_backend_greedy_equals_transformers(llama_head64: Path, budget: int) -> None:
    batch = prompts(16, seed=1, lo=3, hi=200)
    llm = LLM(model=str(llama_head64), device="cuda", dtype="float32", attention_backend="cupy",
              block_size=16, max_num_batched_tokens=budget, max_num_seqs=16, seed=0,
              **ROOMY)
    outs = llm.generate(batch, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(llama_head64, batch)
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_swap_preemption_on_cuda_keeps_greedy_output(llama_head64: Path) -> None:
    batch = prompts(12, seed=2, lo=20, hi=60)
    roomy = LLM(model=str(llama_head64), device="cuda", dtype="float32",
                attention_backend="cupy", block_size=16, max_num_seqs=12, seed=0, **ROOMY)
    expected = [o.outputs[0].token_ids for o in roomy.generate(batch, GREEDY, use_tqdm=False)]
    # 24 blocks of 16 tokens hold about 4 of these sequences at once: the rest must be swapped.
    tight = LLM(model=str(llama_head64), device="cuda", dtype="float32",
                attention_backend="cupy", block_size=16, max_num_seqs=12, seed=0,
                num_gpu_blocks_override=24, preemption_mode="swap", swap_space=0.05)
    outs = tight.generate(batch, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    stats = tight.stats()
    assert stats["num_preemptions"] > 0
    assert stats["num_swap_outs"] > 0 and stats["num_swap_ins"] == stats["num_swap_outs"]
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
