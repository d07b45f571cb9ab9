"""Greedy output equals transformers generate, token for token, on every architecture."""

from __future__ import annotations

import pytest

from engine import Engine, EngineConfig, SamplingParams
from tests.harness.engine import KV_CACHE_MEMORY, assert_drained, hf_greedy, random_prompts
from tests.harness.models import ARCHS

MAX_TOKENS = 16
PROMPTS = random_prompts(16, seed=1, lo=3, hi=45)  # lengths rarely multiples of the block size


@pytest.fixture(scope="module")
def oracle(model_dirs):
    return {arch: hf_greedy(model_dirs[arch], PROMPTS, MAX_TOKENS) for arch in ARCHS}


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("budget", [2048, 16], ids=["whole-prefill", "chunked-prefill"])
def test_one_batch_matches_transformers(arch, budget, model_dirs, oracle, make_llm):
    llm = make_llm(model_dirs[arch], block_size=16, max_num_batched_tokens=budget,
                   max_num_seqs=16)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == oracle[arch]
    assert all(o.outputs[0].finish_reason == "length" for o in outs)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_requests_joining_a_running_batch_match_transformers(arch, model_dirs, oracle):
    engine = Engine(EngineConfig(model=str(model_dirs[arch]), kv_cache_memory=KV_CACHE_MEMORY,
                                 block_size=8, max_num_batched_tokens=24, swap_space=0.01))
    results: dict[str, list[int]] = {}
    pending = list(enumerate(PROMPTS))
    steps = 0
    while pending or engine.has_unfinished():
        if pending and steps % 3 == 0:  # a new request every third step, mid-decode of others
            i, prompt = pending.pop(0)
            engine.add_request(str(i), prompt, GREEDY)
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
        steps += 1
    assert [results[str(i)] for i in range(len(PROMPTS))] == oracle[arch]
    assert_drained(engine)


def test_text_prompts_are_tokenized_like_transformers(tiny_llama, make_llm):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_llama))
    texts = ["the quick brown fox", "redis streams carry tokens", "héllo café 🙂"]
    llm = make_llm(tiny_llama)
    outs = llm.generate(texts, GREEDY, use_tqdm=False)
    ids = [tok(t).input_ids for t in texts]
    assert [o.prompt_token_ids for o in outs] == ids
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(tiny_llama, ids, MAX_TOKENS)
    assert [o.outputs[0].text for o in outs] == [
        tok.decode(o.outputs[0].token_ids, skip_special_tokens=True) for o in outs]


@pytest.mark.parametrize("arch", ["llama", "llama_mha_untied", "gpt2"])
def test_equal_length_prompts_prefilled_as_one_batch_match_transformers(arch, model_dirs,
                                                                        make_llm):
    # Whole prompts of one length share a single batched attention call in the prefill step.
    prompts = [p[:7] for p in random_prompts(5, seed=4, lo=7, hi=7)] + \
        [p[:12] for p in random_prompts(4, seed=5, lo=12, hi=12)] + random_prompts(1, seed=6)
    assert sorted(map(len, prompts))[:9] == [7] * 5 + [12] * 4
    llm = make_llm(model_dirs[arch], max_num_batched_tokens=2048)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(model_dirs[arch], prompts,
                                                               MAX_TOKENS)


def test_generation_config_eos_ids_end_sequences_as_in_transformers(tiny_llama, tmp_path,
                                                                    make_llm):
    """Chat checkpoints list their end-of-turn token in generation_config.json (config.json
    has only the base EOS): transformers' generate() stops on either, and so must the engine."""
    import json
    import shutil
    from collections import Counter

    import torch
    from transformers import AutoModelForCausalLM

    # The extra EOS: the token this model generates most (so that it ends sequences early)
    free = hf_greedy(tiny_llama, PROMPTS, MAX_TOKENS)
    eos_id = Counter(t for ids in free for t in ids if t != 1).most_common(1)[0][0]
    path = tmp_path / "model"
    shutil.copytree(tiny_llama, path)
    gen = json.loads((path / "generation_config.json").read_text())
    assert json.loads((path / "config.json").read_text())["eos_token_id"] == 1
    (path / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [1, eos_id]}))
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    expected = [hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p)),
                            max_new_tokens=MAX_TOKENS, do_sample=False,
                            pad_token_id=2)[0, len(p):].tolist() for p in PROMPTS]
    assert sum(ids[-1] == eos_id and len(ids) < MAX_TOKENS for ids in expected) >= 2
    outs = make_llm(path).generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                                   use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert [o.outputs[0].finish_reason for o in outs] == [
        "stop" if len(ids) < MAX_TOKENS or ids[-1] in (1, eos_id) else "length"
        for ids in expected]
