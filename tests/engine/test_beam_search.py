"""Beam search equals transformers' (num_beams=4), also under injected swap preemption."""

from __future__ import annotations

import pytest
import torch

from engine import Engine, EngineConfig, SamplingParams
from tests.harness.engine import EOS_ID, KV_CACHE_MEMORY, assert_drained, hf_greedy, random_prompts

PROMPTS = random_prompts(3, seed=31, lo=5, hi=20)


def hf_beams(model_dir, prompt, width, n, max_tokens, length_penalty, early_stopping,
             eos_token_id=None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)),
                         num_beams=width, num_return_sequences=n, max_new_tokens=max_tokens,
                         do_sample=False, length_penalty=length_penalty,
                         early_stopping=early_stopping, eos_token_id=eos_token_id,
                         pad_token_id=2)
    rows = [row[len(prompt):].tolist() for row in out]
    # A hypothesis that ended on EOS is padded after it.
    return [row[:row.index(eos_token_id) + 1] if eos_token_id in row else row for row in rows]


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


def test_beam_search_prefills_a_prompt_longer_than_the_token_budget_in_chunks(
        model_dirs, oracle, make_llm):
    # Chunked prefill is on: a beam request's prompt runs in chunks like any other (it was
    # refused with "chunked prefill is off").
    llm = make_llm(model_dirs["llama"], block_size=8, max_num_batched_tokens=8)
    outs = llm.generate(PROMPTS, _params(), use_tqdm=False)
    assert [o.error for o in outs] == [None, None, None]
    assert [[c.token_ids for c in o.outputs] for o in outs] == oracle["llama"]


def test_beam_search_is_unchanged_by_injected_recompute_preemption(model_dirs, oracle, make_llm):
    # After a recompute every beam prefills its whole sequence again: four beams of up to
    # 52 tokens, far over a 16-token budget (they ended after one token with "length").
    llm = make_llm(model_dirs["llama"], block_size=8, preemption_mode="recompute",
                   max_num_batched_tokens=16, artificial_preemption_prob=0.4,
                   artificial_preemption_seed=2)
    outs = llm.generate(PROMPTS, _params(), use_tqdm=False)
    assert [o.error for o in outs] == [None, None, None]
    assert [[c.token_ids for c in o.outputs] for o in outs] == oracle["llama"]
    assert llm.stats()["num_recompute_preemptions"] > 0


def test_beam_width_over_the_token_budget_errors_instead_of_hanging(tiny_llama):
    # Four beams decode together, four tokens a step: a 3-token budget never holds them.
    engine = Engine(EngineConfig(model=str(tiny_llama), kv_cache_memory=KV_CACHE_MEMORY,
                                 max_num_batched_tokens=3, swap_space=0.01))
    engine.add_request("beam", [5, 6], _params())
    engine.add_request("greedy", [5, 6], SamplingParams(temperature=0, max_tokens=3,
                                                         ignore_eos=True))
    finished = {}
    for _ in range(20):
        finished.update({o.request_id: o for o in engine.step() if o.finished})
        if not engine.has_unfinished():
            break
    assert sorted(finished) == ["beam", "greedy"]
    assert [c.finish_reason for c in finished["beam"].outputs] == ["error"]
    assert finished["beam"].error == (
        "beam search advances its 4 beams together, one token each per step, but "
        "max_num_batched_tokens is 3; lower best_of or raise max_num_batched_tokens")
    assert finished["greedy"].outputs[0].token_ids == hf_greedy(tiny_llama, [[5, 6]], 3)[0]
    assert_drained(engine)


def test_early_stopping_never_without_max_tokens_runs_to_max_model_len(eos_llama, make_llm):
    # Two hypotheses end on EOS before the end: "never" then compares with the best score a beam
    # could still reach at the longest length, which max_model_len sets when max_tokens is None
    # (an AssertionError).
    prompt = [96, 356, 103, 199, 155, 14]
    llm = make_llm(eos_llama, block_size=8, max_model_len=40)
    params = SamplingParams(use_beam_search=True, best_of=2, n=2, temperature=0, max_tokens=None,
                            early_stopping="never")
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    expected = hf_beams(eos_llama, prompt, 2, 2, 40 - len(prompt), 1.0, "never", EOS_ID)
    assert [c.token_ids for c in out.outputs] == expected
    assert [c.finish_reason for c in out.outputs] == [
        "stop" if row[-1] == EOS_ID else "length" for row in expected]


@pytest.mark.parametrize("length_penalty", [1e308, -1e308])
def test_a_huge_length_penalty_saturates_instead_of_raising(length_penalty, tiny_llama,
                                                            make_llm):
    """length ** 1e308 overflows a Python float (OverflowError killed the step, and the
    worker with it) and length ** -1e308 divides by zero; in IEEE doubles the scores saturate
    to -0.0 / -inf and the search ends normally."""
    from engine.beam_search import score

    assert score(-3.0, 4, 1e308) == 0.0 and score(-3.0, 4, -1e308) == float("-inf")
    assert score(-3.0, 4, 1.0) == -0.75 and score(-3.0, 0, 2.0) == -3.0
    params = SamplingParams(use_beam_search=True, best_of=2, temperature=0.0, max_tokens=6,
                            length_penalty=length_penalty, ignore_eos=True)
    [out] = make_llm(tiny_llama).generate([[5, 6, 7, 8]], params, use_tqdm=False)
    assert [len(c.token_ids) for c in out.outputs] == [6]
    assert out.outputs[0].finish_reason == "length"
