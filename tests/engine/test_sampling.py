"""Sampling: penalties, min_tokens and logprobs against transformers; seeded determinism;
validation errors."""

from __future__ import annotations

import math

import pytest
import torch

from engine import SamplingParams
from tests.harness.engine import hf_greedy, random_prompts

PROMPTS = random_prompts(6, seed=4, lo=4, hi=20)


def _hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)


def test_repetition_penalty_matches_transformers(tiny_llama, make_llm):
    hf = _hf_model(tiny_llama)
    expected = []
    for p in PROMPTS:
        out = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p)),
                          max_new_tokens=12, do_sample=False, repetition_penalty=1.5,
                          eos_token_id=None, pad_token_id=2)
        expected.append(out[0, len(p):].tolist())
    params = SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.5, ignore_eos=True)
    outs = make_llm(tiny_llama).generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert expected != hf_greedy(tiny_llama, PROMPTS, 12)  # the penalty changed something


@pytest.mark.parametrize("penalty", [1e-300, 1e300])
def test_a_repetition_penalty_that_rounds_to_0_or_inf_keeps_logprobs_finite(tiny_llama, make_llm,
                                                                            penalty):
    """In float32 1e-300 is 0 and 1e300 is inf: a seen token's logit would become inf (NaN
    logprobs, JSON that no client parses) or 0 * inf. Greedy tokens still match transformers."""
    hf = _hf_model(tiny_llama)
    expected = []
    for p in PROMPTS:
        out = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p)),
                          max_new_tokens=8, do_sample=False, repetition_penalty=penalty,
                          eos_token_id=None, pad_token_id=2)
        expected.append(out[0, len(p):].tolist())
    params = SamplingParams(temperature=0, max_tokens=8, repetition_penalty=penalty,
                            ignore_eos=True, logprobs=1)
    outs = make_llm(tiny_llama).generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    for o in outs:
        lps = [v for pos in o.outputs[0].logprobs for v in pos.values()]
        assert len(lps) >= 8 and all(math.isfinite(v) for v in lps)
        assert math.isfinite(o.outputs[0].cumulative_logprob)


def test_presence_and_frequency_penalties_follow_their_formula(tiny_llama, make_llm):
    """Reference: a greedy loop over the transformers model subtracting
    frequency * count + presence * [count > 0] of each output token."""
    hf = _hf_model(tiny_llama)
    expected = []
    with torch.no_grad():
        for p in PROMPTS:
            ids, out = list(p), []
            for _ in range(12):
                logits = hf(torch.tensor([ids])).logits[0, -1]
                counts = torch.bincount(torch.tensor(out, dtype=torch.long),
                                        minlength=logits.numel()).float()
                logits = logits - 0.7 * counts - 0.9 * (counts > 0).float()
                token = int(logits.argmax())
                ids.append(token)
                out.append(token)
            expected.append(out)
    params = SamplingParams(temperature=0, max_tokens=12, frequency_penalty=0.7,
                            presence_penalty=0.9, ignore_eos=True)
    outs = make_llm(tiny_llama).generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_min_tokens_bans_stop_tokens_like_transformers_min_new_tokens(tiny_llama, make_llm):
    prompt = PROMPTS[0]
    greedy = hf_greedy(tiny_llama, [prompt], 12)[0]
    stop = greedy[1]
    hf = _hf_model(tiny_llama)
    ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)),
                      max_new_tokens=12, min_new_tokens=5, do_sample=False, eos_token_id=stop,
                      pad_token_id=2)[0, len(prompt):].tolist()
    if stop in ref:
        ref = ref[: ref.index(stop) + 1]
    out = make_llm(tiny_llama).generate([prompt], SamplingParams(
        temperature=0, max_tokens=12, min_tokens=5, stop_token_ids=[stop], ignore_eos=True),
        use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ref
    assert stop not in out.token_ids[:5]
    assert out.finish_reason == ("stop" if out.token_ids[-1] == stop else "length")


def test_logprobs_equal_log_softmax_of_transformers_logits(tiny_llama, make_llm):
    prompt = PROMPTS[1]
    out = make_llm(tiny_llama).generate([prompt], SamplingParams(
        temperature=0, max_tokens=6, logprobs=3, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    hf = _hf_model(tiny_llama)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + out.token_ids[:-1]])).logits[0, len(prompt) - 1:]
    ref = torch.log_softmax(logits, dim=-1)
    assert out.logprobs is not None and len(out.logprobs) == 6
    total = 0.0
    for pos, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        top = ref[pos].topk(3)
        assert set(entry) == set(top.indices.tolist()) | {token}
        for tid, lp in entry.items():
            assert lp == pytest.approx(ref[pos, tid].item(), abs=1e-4)
        total += ref[pos, token].item()
    assert out.cumulative_logprob == pytest.approx(total, abs=1e-3)


def test_seeded_sampling_repeats_and_differs_by_seed(tiny_llama, make_llm):
    llm = make_llm(tiny_llama)

    def run(seed):
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=16, ignore_eos=True)
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_top_k_one_is_greedy(tiny_llama, make_llm):
    params = SamplingParams(temperature=1.3, top_k=1, seed=5, max_tokens=10, ignore_eos=True)
    outs = make_llm(tiny_llama).generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(tiny_llama, PROMPTS, 10)


def test_top_k_zero_disables_top_k_as_minus_one_does(tiny_llama, make_llm):
    """(vLLM's meaning of 0; models' generation configs carry "top_k": 0.)"""
    llm = make_llm(tiny_llama)
    runs = [[o.outputs[0].token_ids for o in llm.generate(PROMPTS, SamplingParams(
        temperature=1.0, top_k=k, seed=5, max_tokens=10, ignore_eos=True), use_tqdm=False)]
        for k in (0, -1, 3)]
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_tiny_top_p_is_greedy(tiny_llama, make_llm):
    params = SamplingParams(temperature=1.0, top_p=1e-6, seed=5, max_tokens=10, ignore_eos=True)
    outs = make_llm(tiny_llama).generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(tiny_llama, PROMPTS, 10)


def test_best_of_returns_the_n_most_likely_sequences(tiny_llama, make_llm):
    llm = make_llm(tiny_llama)
    base = dict(temperature=1.0, seed=3, max_tokens=8, ignore_eos=True)
    all4 = llm.generate(PROMPTS[:2], SamplingParams(n=4, logprobs=0, **base), use_tqdm=False)
    best2 = llm.generate(PROMPTS[:2], SamplingParams(n=2, best_of=4, **base), use_tqdm=False)
    for full, best in zip(all4, best2):
        ranked = sorted(full.outputs, key=lambda c: -c.cumulative_logprob)[:2]
        assert [c.token_ids for c in best.outputs] == [c.token_ids for c in ranked]
        assert [c.cumulative_logprob for c in best.outputs] == \
            [c.cumulative_logprob for c in ranked]
        assert [c.index for c in best.outputs] == [0, 1]


def test_cumulative_logprob_only_when_logprobs_are_asked_for(tiny_llama, make_llm):
    # As in vLLM: computing it costs a logsumexp over the vocabulary per token.
    llm = make_llm(tiny_llama)
    base = dict(temperature=0, max_tokens=5, ignore_eos=True)
    plain, asked = (llm.generate(PROMPTS[:1], SamplingParams(**base, **extra), use_tqdm=False)[0]
                    .outputs[0] for extra in ({}, {"logprobs": 0}))
    assert plain.token_ids == asked.token_ids
    assert plain.cumulative_logprob is None and plain.logprobs is None
    assert asked.logprobs is not None and len(asked.logprobs) == 5
    assert asked.cumulative_logprob == pytest.approx(
        sum(entry[t] for entry, t in zip(asked.logprobs, asked.token_ids)), abs=1e-5)


@pytest.mark.parametrize("field,value,message", [
    ("temperature", -0.5, "temperature must be >= 0"),
    ("top_p", 0.0, "top_p must be in"),
    ("top_k", -2, r"top_k must be -1 or 0 \(disable\) or at least 1, got -2"),
    ("n", 0, "n must be at least 1"),
    ("max_tokens", 0, "max_tokens must be at least 1"),
    ("best_of", 1, "best_of must be >= n"),
    ("min_p", 1.5, "min_p must be in"),
    ("logprobs", 50, "logprobs must be in"),
    ("repetition_penalty", 0.0, "repetition_penalty must be > 0"),
    ("seed", "7", "seed must be of type int"),
    ("temperature", float("nan"), "temperature must be a number, got nan"),
    ("repetition_penalty", float("nan"), "repetition_penalty must be a number, got nan"),
    ("length_penalty", float("nan"), "length_penalty must be a number, got nan"),
    ("stop", 5, "stop must be a string or a list of non-empty strings"),
    ("stop_token_ids", 7, "stop_token_ids must be a list of non-negative integers"),
])
def test_invalid_sampling_params_name_the_field(field, value, message):
    kwargs = {field: value}
    if field == "best_of":
        kwargs["n"] = 2
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_none_stop_and_stop_token_ids_mean_none_as_in_vllm():
    # vLLM's defaults are None; the wire form (from_dict) may carry them.
    for params in (SamplingParams(stop=None, stop_token_ids=None),
                   SamplingParams.from_dict({"stop": None, "stop_token_ids": None})):
        assert params.stop == [] and params.stop_token_ids == []


def test_unknown_sampling_param_is_named():
    with pytest.raises(ValueError, match="unknown sampling parameter.*temprature"):
        SamplingParams.from_dict({"temprature": 0.5})


def test_argmax_takes_the_first_maximum_and_nan_like_torch():
    import torch

    from engine.sampler import _argmax

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 300, generator=g)
    logits[3, [5, 17, 200]] = 50.0  # ties: the first one wins
    logits[4, 9] = float("nan")
    logits[5] = float("-inf")
    logits[6, 299] = float("inf")
    view = logits[:, :257]  # a strided view, as the sampler cuts the vocabulary padding
    for x in (logits, view):
        assert torch.equal(_argmax(x), x.argmax(dim=-1))
    assert _argmax(logits)[3:7].tolist() == [5, 9, 0, 299]


def test_a_temperature_below_001_samples_at_001_as_in_vllm(tiny_llama, make_llm):
    """Logits / 1e-300 overflow to inf and sampled garbage; vLLM raises such temperatures to
    0.01, and so does SamplingParams."""
    llm = make_llm(tiny_llama)
    assert SamplingParams(temperature=1e-300).temperature == 0.01

    def run(temperature):
        params = SamplingParams(temperature=temperature, seed=4, max_tokens=12, ignore_eos=True)
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]

    tiny = run(1e-300)  # (sampled at 0.01: the clamp above; no NaN, no garbage)
    # Near-greedy: most prompts follow the greedy tokens (a near-tie may go the other way).
    greedy = hf_greedy(tiny_llama, PROMPTS, 12)
    assert sum(t == g for t, g in zip(tiny, greedy)) >= len(PROMPTS) - 1



def _noise_reference(key: int, token_id: int) -> float:
    """The documented noise of one (row key, token id), in plain Python integers and math.log."""
    def fmix32(h: int) -> int:
        h ^= h >> 16
        h = (h * 0x85EBCA6B) & 0xFFFFFFFF
        h ^= h >> 13
        h = (h * 0xC2B2AE35) & 0xFFFFFFFF
        return h ^ (h >> 16)
    h = fmix32(fmix32((token_id * 0x9E3779B1 + 0x7F4A7C15) & 0xFFFFFFFF) ^ key)
    return -math.log(-math.log((h + 0.5) / 4294967296.0))


@pytest.mark.parametrize("vocab_size", [17, 4096, 32003])
def test_the_cpu_noise_is_the_torch_noise_bit_for_bit(vocab_size):
    # The CPU path (uint32 hashing in numpy, logs in place) and the torch path every device
    # runs must give the same float32 noise, or a seeded job would sample other tokens on a
    # CPU worker than on a GPU worker, and after a failover between them.
    import random

    import numpy as np

    from engine.noise import gumbel_cpu, gumbel_torch, vocab_hash

    rng = random.Random(vocab_size)
    keys = [rng.getrandbits(32) for _ in range(37)] + [0, 0xFFFFFFFF]
    token_hash = vocab_hash(vocab_size)
    cpu = gumbel_cpu(token_hash.numpy().astype(np.uint32), keys, chunk_rows=16)
    reference = gumbel_torch(token_hash, keys)
    assert cpu.dtype == reference.dtype == torch.float32
    assert cpu.shape == (len(keys), vocab_size)
    assert torch.equal(cpu, reference)
    for row, token in [(0, 0), (5, vocab_size - 1), (len(keys) - 1, vocab_size // 2)]:
        expected = torch.tensor(_noise_reference(keys[row], token), dtype=torch.float32)
        assert torch.equal(cpu[row, token], expected), (row, token)
