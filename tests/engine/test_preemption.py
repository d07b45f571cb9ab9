"""Preemption never changes an answer: greedy and seeded outputs are identical with and without
forced preemption, by recompute and by swap, with and without chunked prefill."""

from __future__ import annotations

import pytest

from engine import SamplingParams
from tests.harness.engine import KV_CACHE_MEMORY, hf_greedy, random_prompts

PROMPTS = random_prompts(10, seed=7, lo=3, hi=30)
MODES = ["recompute", "swap", "auto"]


@pytest.fixture(scope="module")
def greedy_oracle(model_dirs):
    return {arch: hf_greedy(model_dirs[arch], PROMPTS, 24) for arch in ("llama", "gpt2")}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "whole"])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_greedy_is_unchanged_by_injected_preemption(arch, mode, chunked, model_dirs,
                                                    greedy_oracle, make_llm):
    llm = make_llm(model_dirs[arch], block_size=8, preemption_mode=mode,
                   enable_chunked_prefill=chunked, max_num_batched_tokens=16 if chunked else 64,
                   max_num_seqs=16, artificial_preemption_prob=0.5, artificial_preemption_seed=3)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == greedy_oracle[arch]
    stats = llm.stats()
    assert stats["num_preemptions"] > 0
    if mode == "recompute" or mode == "auto":  # auto recomputes one-sequence groups
        assert stats["num_recompute_preemptions"] > 0 and stats["num_swap_outs"] == 0
    else:
        assert stats["num_swap_outs"] > 0 and stats["num_swap_ins"] == stats["num_swap_outs"]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_and_seeded_are_unchanged_by_prefills_first(mode, model_dirs, greedy_oracle,
                                                           seeded_reference, make_llm):
    """New and recomputed prompts prefilled in steps of their own: the same tokens."""
    llm = make_llm(model_dirs["llama"], block_size=8, preemption_mode=mode, prefills_first=True,
                   max_num_batched_tokens=16, max_num_seqs=16, artificial_preemption_prob=0.5,
                   artificial_preemption_seed=3)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == greedy_oracle["llama"]
    assert _tokens(llm.generate(PROMPTS, _seeded(3), use_tqdm=False)) == seeded_reference[3]
    stats = llm.stats()
    assert stats["num_prefill_only_steps"] > 0 and stats["num_preemptions"] > 0


def _seeded(n: int) -> list[SamplingParams]:
    return [SamplingParams(n=n, temperature=0.8, top_p=0.9, seed=100 + i, max_tokens=20,
                           ignore_eos=True) for i in range(len(PROMPTS))]


def _tokens(outs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def seeded_reference(tiny_llama):
    from engine import LLM

    llm = LLM(str(tiny_llama), kv_cache_memory=KV_CACHE_MEMORY, block_size=8, swap_space=0.05)
    return {n: _tokens(llm.generate(PROMPTS, _seeded(n), use_tqdm=False)) for n in (1, 3)}


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("mode", MODES)
def test_seeded_sampling_is_unchanged_by_preemption(n, mode, tiny_llama, seeded_reference,
                                                    make_llm):
    llm = make_llm(tiny_llama, block_size=8, preemption_mode=mode, max_num_batched_tokens=16,
                   artificial_preemption_prob=0.5, artificial_preemption_seed=11)
    outs = llm.generate(PROMPTS, _seeded(n), use_tqdm=False)
    assert _tokens(outs) == seeded_reference[n]
    assert llm.stats()["num_preemptions"] > 0
    if n == 3:
        assert all(len({tuple(c) for c in o}) > 1 for o in _tokens(outs))  # samples differ


def test_seeded_sampling_is_independent_of_batch_order(tiny_llama, seeded_reference, make_llm):
    llm = make_llm(tiny_llama, block_size=8)
    order = list(reversed(range(len(PROMPTS))))
    params = _seeded(3)
    outs = llm.generate([PROMPTS[i] for i in order], [params[i] for i in order], use_tqdm=False)
    assert [_tokens(outs)[order.index(i)] for i in range(len(PROMPTS))] == seeded_reference[3]


def _sampling_4422(seed: int) -> SamplingParams:
    return SamplingParams(n=4, best_of=4, temperature=1.0, seed=seed, max_tokens=256,
                          ignore_eos=True)


def test_4422_n4_groups_swap_through_a_cache_that_holds_one_group(tiny_llama, make_llm):
    """vLLM issue 4422: n>1 with long outputs under KV pressure crashed on swap-in."""
    prompts = random_prompts(4, seed=22, lo=9, hi=16)
    params = [_sampling_4422(s) for s in range(4)]
    free = make_llm(tiny_llama, block_size=8, num_gpu_blocks_override=1000)
    expected = _tokens(free.generate(prompts, params, use_tqdm=False))
    tight = make_llm(tiny_llama, block_size=8, num_gpu_blocks_override=138, watermark=0.0,
                     max_num_seqs=64)
    outs = tight.generate(prompts, params, use_tqdm=False)
    assert _tokens(outs) == expected
    assert all(len(c.token_ids) == 256 for o in outs for c in o.outputs)
    stats = tight.stats()
    assert stats["num_swap_outs"] > 0 and stats["num_swap_ins"] == stats["num_swap_outs"]


def test_4422_group_sized_for_n1_cannot_fit_and_ends_instead_of_hanging(tiny_llama, make_llm):
    llm = make_llm(tiny_llama, block_size=8, num_gpu_blocks_override=2 + 256 // 8,
                   watermark=0.0)
    prompts = random_prompts(2, seed=22, lo=9, hi=16)
    outs = llm.generate(prompts, [_sampling_4422(1), _sampling_4422(2)], use_tqdm=False)
    for o in outs:
        assert [c.finish_reason for c in o.outputs] == ["length"] * 4
        # The four sequences outgrew 34 blocks together, long before 256 tokens each.
        assert all(0 < len(c.token_ids) < 256 for c in o.outputs)
    assert llm.stats()["num_infeasible"] == 2


def test_a_swapped_group_that_fits_is_swapped_back_in_not_ended(tiny_llama, make_llm):
    """7 blocks of 16. B (n=4, a one-block prompt) holds 5 and never needs a sixth; A's growth
    swaps it out. Once A is done, B needs its 5 blocks and nothing more (each sequence's last
    block has room): it is swapped back in and finishes its 16 tokens, as it does alone (a spare
    block per sequence, reserved whatever the need, made it 9 > 7: ended with "length")."""
    a = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    b = SamplingParams(n=4, temperature=0.8, seed=1, max_tokens=16, ignore_eos=True)
    prompt_a, prompt_b = list(range(3, 23)), list(range(30, 46))
    alone = make_llm(tiny_llama, block_size=16, num_gpu_blocks_override=7)
    (want,) = alone.generate([prompt_b], b, use_tqdm=False)
    both = make_llm(tiny_llama, block_size=16, num_gpu_blocks_override=7)
    outs = both.generate([prompt_a, prompt_b], [a, b], use_tqdm=False)
    assert [(len(c.token_ids), c.finish_reason) for c in outs[1].outputs] == [(16, "length")] * 4
    assert _tokens(outs[1:]) == _tokens([want])
    stats = both.stats()
    assert (stats["num_swap_outs"], stats["num_swap_ins"], stats["num_infeasible"]) == (1, 1, 0)


@pytest.mark.parametrize("mode", MODES)
def test_n2_survivor_resumes_after_its_sibling_stopped(mode, tiny_llama, make_llm):
    prompt = random_prompts(1, seed=5)[0]
    base = dict(n=2, temperature=1.0, seed=9, max_tokens=30, ignore_eos=True)
    probe = make_llm(tiny_llama, block_size=8).generate([prompt], SamplingParams(**base),
                                                        use_tqdm=False)[0]
    stop_token = probe.outputs[0].token_ids[3]  # branch 0 stops at its 4th token
    assert stop_token not in probe.outputs[1].token_ids[:3]
    params = SamplingParams(**base, stop_token_ids=[stop_token])
    reference = make_llm(tiny_llama, block_size=8).generate([prompt], params,
                                                            use_tqdm=False)[0]
    assert reference.outputs[0].token_ids == probe.outputs[0].token_ids[:4]
    assert reference.outputs[0].finish_reason == "stop"
    llm = make_llm(tiny_llama, block_size=8, preemption_mode=mode,
                   artificial_preemption_prob=0.3, artificial_preemption_seed=1)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert _tokens([out]) == _tokens([reference])
    assert llm.stats()["num_preemptions"] > 0


def test_exhausted_host_swap_space_recomputes_instead_of_failing(tiny_llama, make_llm):
    prompts = random_prompts(4, seed=3, lo=9, hi=16)
    params = [SamplingParams(n=3, temperature=1.0, seed=s, max_tokens=40, ignore_eos=True)
              for s in range(4)]
    expected = _tokens(make_llm(tiny_llama, block_size=8).generate(prompts, params,
                                                                   use_tqdm=False))
    llm = make_llm(tiny_llama, block_size=8, num_gpu_blocks_override=24, watermark=0.0,
                   preemption_mode="swap", swap_space=0)  # no host block at all
    assert llm.stats()["num_host_blocks"] == 0
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert _tokens(outs) == expected
    stats = llm.stats()
    assert stats["num_swap_outs"] == 0 and stats["num_recompute_preemptions"] > 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_group_preempted_after_growing_into_the_watermark_resumes(mode, tiny_llama, make_llm):
    """A running group may grow into the watermark (only admission keeps it free); preempted
    there, it must come back on the whole cache, not be judged as a new request (it ended with
    an error, or 'length', five tokens in)."""
    long_prompt = random_prompts(1, seed=8, lo=68, hi=68)[0]
    config = dict(block_size=4, num_gpu_blocks_override=20, watermark=0.1, preemption_mode=mode,
                  swap_space=0.01)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    [alone] = make_llm(tiny_llama, **config).generate([long_prompt], params, use_tqdm=False)
    llm = make_llm(tiny_llama, **config)
    _, crowded = llm.generate([[5], long_prompt], params, use_tqdm=False)  # the first is older
    assert llm.stats()["num_preemptions"] >= 1
    assert crowded.error is None and alone.error is None
    assert (crowded.outputs[0].token_ids, crowded.outputs[0].finish_reason) == \
        (alone.outputs[0].token_ids, alone.outputs[0].finish_reason)
    assert len(alone.outputs[0].token_ids) > 5


@pytest.mark.parametrize("beam", [False, True], ids=["greedy", "beam"])
def test_a_recomputed_group_outgrowing_the_budget_re_prefills_in_chunks(beam, tiny_llama,
                                                                         make_llm):
    """Chunked prefill off: a group's first prefill fits the budget, but after a recompute
    preemption it must prefill its outputs too, which may not: it runs in chunks then (it
    ended with 'length', cut short)."""
    # (the whole budget: its first decode needs a new block, which the forced preemption takes)
    prompt = random_prompts(1, seed=9, lo=60 if beam else 32, hi=60 if beam else 32)[0]
    params = SamplingParams(n=2, best_of=2, use_beam_search=True, temperature=0, max_tokens=8,
                            ignore_eos=True) if beam else \
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    config = dict(block_size=4, enable_chunked_prefill=False, preemption_mode="recompute",
                  max_num_batched_tokens=100 if beam else 32)
    [plain] = make_llm(tiny_llama, **config).generate([prompt], params, use_tqdm=False)
    llm = make_llm(tiny_llama, **config, artificial_preemption_prob=1.0,
                   artificial_preemption_max=1)
    [preempted] = llm.generate([prompt], params, use_tqdm=False)
    assert llm.stats()["num_recompute_preemptions"] == 1
    assert [(o.token_ids, o.finish_reason) for o in preempted.outputs] == \
        [(o.token_ids, o.finish_reason) for o in plain.outputs]
    assert len(plain.outputs[0].token_ids) == (8 if beam else 30)


def test_a_recomputed_group_whose_sequences_no_longer_fit_unshared_ends_with_length(
        tiny_llama, make_llm, caplog):
    """Known limit: recompute drops the sharing of an n > 1 group's prompt blocks, so its
    re-prefill may need more than the whole cache (swap keeps the sharing). It ends with
    'length' and what it had, and a warning that says what to give the engine; not an
    error that blames the prompt, and no hang."""
    prompt = random_prompts(1, seed=10, lo=48, hi=48)[0]
    params = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
    llm = make_llm(tiny_llama, block_size=4, num_gpu_blocks_override=24,
                   preemption_mode="recompute", swap_space=0.01, artificial_preemption_prob=1.0,
                   artificial_preemption_max=1)
    [out] = llm.generate([prompt], params, use_tqdm=False)
    assert out.error is None
    assert [o.finish_reason for o in out.outputs] == ["length", "length"]
    assert all(1 <= len(o.token_ids) < 8 for o in out.outputs)
    assert "preempted by recompute, its 2 sequences need 26 KV blocks unshared but the cache " \
           "holds 24" in caplog.text
