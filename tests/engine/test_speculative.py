"""Speculative decoding never changes an answer: greedy and seeded outputs (n=1 and n=3) are
token-identical with and without speculation (n-gram, and a draft model: the target's first
layers), under preemption by recompute and by swap, in any batch order; stops inside an
accepted run end at the same token; nothing leaks.

The prompts make proposals that are accepted (every test asserts accepted tokens in the stats,
or it would prove nothing): the demo model (models/genq-tiny-stdlib) greedy-decodes code that
repeats itself, and the tiny random llama samples mostly among five tokens that a logit_bias
favours.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import SamplingParams
from engine.config import EngineConfig
from engine.spec_proposer import NgramProposer
from tests.harness.engine import hf_greedy, random_prompts
from tests.harness.models import build_truncated

DEMO = Path(__file__).resolve().parents[2] / "models" / "genq-tiny-stdlib"
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
CODE = ["def __init__(self, name):\n    self.name = ",  # (each at most 16 tokens)
        "import os\nimport sys\nimport ", "for i in range(10):\n    print(i)\n",
        "class Foo(object):\n    def "]
PROMPTS = random_prompts(6, seed=5, lo=6, hi=16)
BIAS = {t: 6.0 for t in (40, 41, 42, 43, 44)}  # the tiny llama then repeats itself


def _tokens(outs) -> list[list[list[int]]]:
    return [[list(c.token_ids) for c in sorted(o.outputs, key=lambda c: c.index)]
            for o in outs]


def _seeded(n: int, max_tokens: int = 40) -> list[SamplingParams]:
    return [SamplingParams(n=n, temperature=0.8, top_p=0.9, seed=100 + i, max_tokens=max_tokens,
                           ignore_eos=True, logit_bias=BIAS) for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def demo_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo model's first 2 of its 4 layers."""
    return build_truncated(DEMO, tmp_path_factory.mktemp("demo_draft"), 2)


@pytest.fixture(scope="module")
def tiny_draft(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama's first layer of its 2."""
    return build_truncated(tiny_llama, tmp_path_factory.mktemp("tiny_draft"), 1)


def _draft(model: Path) -> dict:
    return {"model": str(model), "num_speculative_tokens": 2}


def _accepted(llm) -> int:
    return llm.stats()["spec_decode_num_accepted_tokens"]


# -- config and proposer ---------------------------------------------------------------------------
@pytest.mark.parametrize("config, message", [
    ({"method": "ngram", "num_speculative_tokens": 4, "lookahead": 2},
     r"unknown key\(s\) \['lookahead'\]"),
    ({"method": "eagle", "num_speculative_tokens": 4}, "'method' must be one of"),
    ({"method": "ngram"}, "needs 'num_speculative_tokens'"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "must be at least 1, got 0"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3,
      "prompt_lookup_max": 2}, "prompt_lookup_min <= prompt_lookup_max, got min 3 and max 2"),
    ({"method": "ngram", "num_speculative_tokens": "4"}, "must be an integer, got '4'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0},
     "'disable_by_batch_size' must be at least 1"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
    ({"method": "ngram", "model": "/a/draft", "num_speculative_tokens": 2}, "takes no 'model'"),
    (["ngram"], "must be a dict"),
])
def test_a_bad_speculative_config_is_refused_with_what_to_change(config, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="unused", speculative_config=config)


def test_ngram_proposals_follow_the_most_recent_longest_match():
    proposer = NgramProposer(1, 3)
    # "7 8" matches at the start (followed by 9 5) and "6 7 8" later (followed by 4 4): longest.
    assert proposer.propose([7, 8, 9, 5, 6, 7, 8, 4, 4, 6, 7, 8], 2) == [4, 4]
    # One-token matches: the most recent wins; a loop of period 2 continues past the end.
    assert proposer.propose([1, 2, 3, 1, 2], 5) == [3, 1, 2, 3, 1]
    assert proposer.propose([5, 5], 3) == [5, 5, 5]
    assert proposer.propose([1, 2, 3], 3) == []  # (3 never occurred before)
    assert NgramProposer(2, 3).propose([1, 2, 3, 1], 3) == []  # a 1-gram match is too short


def test_beam_search_is_refused_when_speculation_is_on(tiny_llama, make_llm):
    llm = make_llm(tiny_llama, speculative_config=NGRAM)
    with pytest.raises(ValueError, match="beam search cannot run with speculative decoding"):
        llm.generate([[5, 6, 7]], SamplingParams(n=2, use_beam_search=True, max_tokens=4),
                     use_tqdm=False)
    llm.engine.abort_all()


def test_a_draft_with_another_vocabulary_is_refused_at_start(tiny_llama):
    from engine import LLM

    with pytest.raises(ValueError, match="has another vocabulary than the target"):
        LLM(str(DEMO), speculative_config=_draft(tiny_llama))


# -- greedy ----------------------------------------------------------------------------------------
SEED_CONFIG = dict(block_size=8, num_gpu_blocks_override=2 + 256 // 8,
                   max_model_len=(2 + 256 // 8) * 8)  # vLLM's end-to-end preemption test
SEED_PARAMS = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)


@pytest.fixture(scope="module")
def seed_expected() -> list[list[list[int]]]:
    from engine import LLM

    plain = LLM(str(DEMO), swap_space=0.05, **SEED_CONFIG)
    expected = _tokens(plain.generate(CODE, SEED_PARAMS, use_tqdm=False))
    assert [len(t[0]) for t in expected] == [256] * 4
    assert max(len(plain.tokenizer(p)["input_ids"]) for p in CODE) <= 16
    return expected


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_seed_scenario_greedy_is_identical_under_preemption_and_nothing_leaks(
        method, seed_expected, demo_draft, make_llm):
    """2 + 256 // 8 blocks of 8 for 4 sequences of 256 tokens: they preempt each other."""
    spec = make_llm(DEMO, **SEED_CONFIG,
                    speculative_config=NGRAM if method == "ngram" else _draft(demo_draft))
    assert _tokens(spec.generate(CODE, SEED_PARAMS, use_tqdm=False)) == seed_expected
    stats = spec.stats()
    assert stats["num_preemptions"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0
    assert stats["spec_decode_num_emitted_tokens"] == \
        stats["spec_decode_num_drafts"] + stats["spec_decode_num_accepted_tokens"]


def test_greedy_with_speculation_equals_transformers(make_llm):
    prompts = [list(p) for p in random_prompts(3, seed=2, lo=4, hi=12)]
    llm = make_llm(DEMO, speculative_config=NGRAM)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True),
                        use_tqdm=False)
    assert [t[0] for t in _tokens(outs)] == hf_greedy(DEMO, prompts, 48)
    assert _accepted(llm) > 0


# -- seeded sampling -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def seeded_reference(tiny_llama):
    from engine import LLM

    llm = LLM(str(tiny_llama), block_size=8, swap_space=0.05)
    return {n: _tokens(llm.generate(PROMPTS, _seeded(n), use_tqdm=False)) for n in (1, 3)}


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_seeded_sampling_is_identical_with_speculation_under_preemption(n, mode, tiny_llama,
                                                                        seeded_reference,
                                                                        make_llm):
    llm = make_llm(tiny_llama, block_size=8, preemption_mode=mode, max_num_batched_tokens=32,
                   artificial_preemption_prob=0.3, artificial_preemption_seed=11,
                   speculative_config=NGRAM)
    assert _tokens(llm.generate(PROMPTS, _seeded(n), use_tqdm=False)) == seeded_reference[n]
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0
    if mode == "swap":
        assert stats["num_swap_outs"] > 0
    if n == 3:
        assert all(len({tuple(c) for c in o}) > 1 for o in seeded_reference[3])  # they differ


@pytest.mark.parametrize("n, mode", [(1, "recompute"), (3, "swap")])
def test_seeded_sampling_is_identical_with_a_draft_model_under_preemption(
        n, mode, tiny_llama, tiny_draft, seeded_reference, make_llm):
    """The draft's cache is swapped with its sequence, and refilled after a recompute."""
    llm = make_llm(tiny_llama, block_size=8, preemption_mode=mode, max_num_batched_tokens=32,
                   artificial_preemption_prob=0.3, artificial_preemption_seed=11,
                   speculative_config=_draft(tiny_draft))
    assert _tokens(llm.generate(PROMPTS, _seeded(n), use_tqdm=False)) == seeded_reference[n]
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0
    assert (stats["num_swap_outs"] > 0) == (mode == "swap")


def test_speculation_with_prefix_caching_is_exact_and_caches_only_prompts(tiny_llama,
                                                                          seeded_reference,
                                                                          make_llm):
    llm = make_llm(tiny_llama, block_size=4, enable_prefix_caching=True,
                   speculative_config=NGRAM)
    for _ in range(2):  # the second time, every full prompt block is a cache hit
        assert _tokens(llm.generate(PROMPTS, _seeded(1), use_tqdm=False)) == \
            seeded_reference[1]
        llm.engine.block_manager.check_invariants()
    stats = llm.stats()
    assert stats["num_cached_tokens"] == sum(min(len(p) - 1, len(p) // 4 * 4) for p in PROMPTS)
    assert stats["num_cached_blocks"] == sum(len(p) // 4 for p in PROMPTS)
    assert _accepted(llm) > 0


def test_seeded_sampling_with_speculation_is_independent_of_batch_order(tiny_llama,
                                                                        seeded_reference,
                                                                        make_llm):
    llm = make_llm(tiny_llama, block_size=8, speculative_config=NGRAM)
    order = [3, 0, 5, 1, 4, 2]
    params = _seeded(3)
    outs = _tokens(llm.generate([PROMPTS[i] for i in order], [params[i] for i in order],
                                use_tqdm=False))
    assert [outs[order.index(i)] for i in range(len(PROMPTS))] == seeded_reference[3]
    assert _accepted(llm) > 0


def test_processors_and_logprobs_are_as_without_speculation(eos_llama, make_llm):
    """min_tokens' ban of EOS, a stop id, penalties over the accepted tokens, logprobs."""
    params = [SamplingParams(temperature=t, seed=7 + i, max_tokens=30, min_tokens=6,
                             stop_token_ids=[45], frequency_penalty=0.3, logprobs=2,
                             logit_bias=BIAS) for i, t in enumerate([0.0, 0.8] * 3)]
    plain = make_llm(eos_llama, block_size=8)
    spec = make_llm(eos_llama, block_size=8, speculative_config=NGRAM)
    expected = plain.generate(PROMPTS, params, use_tqdm=False)
    got = spec.generate(PROMPTS, params, use_tqdm=False)
    assert _tokens(got) == _tokens(expected)
    assert [o.outputs[0].finish_reason for o in got] == \
        [o.outputs[0].finish_reason for o in expected]
    for a, b in zip(got, expected):
        ca, cb = a.outputs[0], b.outputs[0]
        assert [sorted(d) for d in ca.logprobs] == [sorted(d) for d in cb.logprobs]
        assert ca.cumulative_logprob == pytest.approx(cb.cumulative_logprob, abs=1e-3)
    assert _accepted(spec) > 0


# -- stops -----------------------------------------------------------------------------------------
def _steps(engine, prompt: str, params: SamplingParams) -> tuple[list[tuple[int, int, int]],
                                                                  object]:
    """Run one request step by step: per step, the output positions [start, end) it appended
    and the tokens verification emitted; and the final output."""
    engine.add_request("r", prompt, params)
    runs, num, last = [], 0, None
    while engine.has_unfinished():
        before = engine.stats()["spec_decode_num_emitted_tokens"]
        for out in engine.step():
            last = out
            emitted = engine.stats()["spec_decode_num_emitted_tokens"] - before
            runs.append((num, len(out.outputs[0].token_ids), emitted))
            num = runs[-1][1]
    return runs, last


def test_a_stop_string_inside_an_accepted_run_ends_at_the_same_token(make_llm):
    """The stop string ends at the first token of a step that emitted several: the tokens
    verification emitted after it never reach the output."""
    spec = make_llm(DEMO, speculative_config=NGRAM)
    base = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    runs, out = _steps(spec.engine, CODE[0], base)
    ids = list(out.outputs[0].token_ids)
    decode = spec.tokenizer.decode
    for start, end, _ in runs:  # the first run whose first token ends a string seen nowhere before
        text = decode(ids[:start + 1])
        stop = text[-6:]
        if end - start > 1 and start > 10 and stop.strip() and text.find(stop) == len(text) - 6:
            break
    else:
        raise AssertionError("no run of accepted tokens to stop inside")
    params = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True, stop=[stop])
    expected = make_llm(DEMO).generate([CODE[0]], params, use_tqdm=False)[0].outputs[0]
    stopped_runs, got = _steps(spec.engine, CODE[0], params)
    got = got.outputs[0]
    assert (list(got.token_ids), got.text, got.finish_reason, got.stop_reason) == \
        (ids[:start + 1], text[:-6], "stop", stop)
    assert (list(expected.token_ids), expected.text) == (list(got.token_ids), got.text)
    assert stopped_runs[-1] == (start, start + 1, end - start)  # kept 1 of those it emitted


# -- when speculation is off -----------------------------------------------------------------------
@pytest.mark.parametrize("limit, speculates", [(3, False), (6, True)])
def test_disable_by_batch_size_turns_speculation_off_for_larger_batches(limit, speculates,
                                                                        tiny_llama, make_llm):
    llm = make_llm(tiny_llama, block_size=8,
                   speculative_config={**NGRAM, "disable_by_batch_size": limit})
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logit_bias=BIAS)
    llm.generate([[5, 6, 7, 8]] * 6, params, use_tqdm=False)  # all 6 in the engine to the end
    assert (llm.stats()["spec_decode_num_drafts"] > 0) == speculates
