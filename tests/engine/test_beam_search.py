"""Beam search equals transformers' (num_beams=4), also under injected swap preemption."""

from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from tests.engine.conftest import random_prompts

PROMPTS = random_prompts(3, seed=31, lo=5, hi=20)


def hf_beams(model_dir, prompt, width, n, max_tokens, length_penalty, early_stopping):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)),
                         num_beams=width, num_return_sequences=n, max_new_tokens=max_tokens,
                         do_sample=False, length_penalty=length_penalty,
                         early_stopping=early_stopping, eos_token_id=None, pad_token_id=2)
    return [row[len(prompt):].tolist() for row in out]


def _params(n: int = 2) -> SamplingParams:
    return SamplingParams(use_beam_search=True, best_of=4, n=n, temperature=0, max_tokens=32,
                          length_penalty=1.0, early_stopping=False, ignore_eos=True)


@pytest.fixture(scope="module")
def oracle(model_dirs):
    return {arch: [hf_beams(model_dirs[arch], p, 4, 2, 32, 1.0, False) for p in PROMPTS]
            for arch in ("llama", "gpt2")}


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_beam_search_matches_transformers(arch, model_dirs, oracle, make_llm):
    llm = make_llm(model_dirs[arch], block_size=8)
    outs = llm.generate(PROMPTS, _params(), use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in outs] == oracle[arch]
    assert all(c.finish_reason == "length" for o in outs for c in o.outputs)


def test_beam_search_is_unchanged_by_injected_swap_preemption(model_dirs, oracle, make_llm):
    llm = make_llm(model_dirs["llama"], block_size=8, preemption_mode="swap",
                   artificial_preemption_prob=0.4, artificial_preemption_seed=2)
    outs = llm.generate(PROMPTS, _params(), use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in outs] == oracle["llama"]
    stats = llm.stats()
    assert stats["num_swap_outs"] > 0 and stats["num_swap_ins"] == stats["num_swap_outs"]


def test_beam_group_wider_than_the_cache_ends_instead_of_hanging(tiny_llama, make_llm):
    llm = make_llm(tiny_llama, block_size=8, num_gpu_blocks_override=6, watermark=0.0)
    out = llm.generate([PROMPTS[0]], _params(n=1), use_tqdm=False)[0]
    assert out.finished and llm.stats()["num_infeasible"] == 1


def test_beam_and_n2_requests_in_one_batch_keep_their_own_logits(model_dirs, make_llm):
    # After their joint prefill the beam request samples from logits row 0 and the n=2
    # request's two first samples both from row 1: as many sample rows as logits rows, yet
    # not one row each. Two prompts whose next tokens differ make a mix-up visible.
    llm = make_llm(model_dirs["llama"], block_size=8)
    prompts = random_prompts(12, seed=77, lo=5, hi=20)
    first = [o.outputs[0].token_ids[0] for o in llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)]
    a = prompts[0]
    b = next(p for p, t in zip(prompts, first) if t != first[0])
    sampled = SamplingParams(n=2, temperature=0.5, seed=9, max_tokens=6, ignore_eos=True)
    beam_alone = llm.generate([a], _params(), use_tqdm=False)[0]
    alone = llm.generate([b], sampled, use_tqdm=False)[0]
    beam, mixed = llm.generate([a, b], [_params(), sampled], use_tqdm=False)
    assert [c.token_ids for c in beam.outputs] == [c.token_ids for c in beam_alone.outputs]
    assert [c.token_ids for c in mixed.outputs] == [c.token_ids for c in alone.outputs]
