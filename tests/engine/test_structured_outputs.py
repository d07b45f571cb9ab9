"""Structured outputs: constrained outputs parse and validate, match their regex or choice, and are
exact: the same under preemption (recompute and swap), chunked prefill and another batch order."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

from engine import LLM, SamplingParams
from engine.grammar import grammar_of
from engine.sampling_params import StructuredOutputsParams
from engine.sequence import Sequence, SequenceGroup
from engine.structured_outputs import StructuredOutputs
from tests.harness.engine import hf_greedy, random_prompts
from tests.harness.schemas import SCHEMAS

DEMO = Path(__file__).resolve().parents[2] / "models" / "genq-tiny-stdlib"
PROMPTS = ["def main():", "import os\n", "class Config:", "# settings\n", "return {",
           "x = [", "for key in", "print("]




@pytest.fixture(scope="module")
def demo_llm() -> LLM:
    return LLM(str(DEMO), block_size=8, kv_cache_memory=32 << 20, num_threads=1, swap_space=0.05)


def _json_params(k: int, schema: dict) -> SamplingParams:
    # Half greedy, half seeded sampling: both must stay inside the schema.
    sampling = dict(temperature=0) if k % 2 == 0 else dict(temperature=0.9, seed=k)
    return SamplingParams(max_tokens=64, structured_outputs={"json": schema}, **sampling)


def test_40_generated_json_schemas_give_outputs_that_validate(demo_llm):
    prompts = [PROMPTS[k % len(PROMPTS)] for k in range(len(SCHEMAS))]
    outs = demo_llm.generate(prompts, [_json_params(k, s) for k, s in enumerate(SCHEMAS)],
                             use_tqdm=False)
    finished = 0
    for schema, out in zip(SCHEMAS, outs):
        [comp] = out.outputs
        assert comp.finish_reason in ("stop", "length"), out.error
        if comp.finish_reason == "stop":  # (ended by EOS, which only a complete value allows)
            jsonschema.validate(json.loads(comp.text), schema)
            finished += 1
    assert finished >= 30  # the cap is the one way out, and most schemas end well before it
    stats = demo_llm.stats()
    assert stats["num_grammar_compiles"] >= len({json.dumps(s) for s in SCHEMAS})


def test_regex_and_choice_outputs_match(demo_llm):
    regex = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"
    choices = ["positive", "negative", "neutral"]
    params = [SamplingParams(temperature=t, seed=5, max_tokens=32,
                             structured_outputs={"regex": regex}) for t in (0, 1.0)]
    params += [SamplingParams(temperature=t, seed=6, n=2, max_tokens=16,
                              structured_outputs={"choice": choices}) for t in (0, 1.0)]
    outs = demo_llm.generate(PROMPTS[:4], params, use_tqdm=False)
    for comp in outs[0].outputs + outs[1].outputs:
        assert comp.finish_reason == "stop" and re.fullmatch(regex, comp.text), comp.text
    for comp in outs[2].outputs + outs[3].outputs:
        assert comp.finish_reason == "stop" and comp.text in choices, comp.text


def test_a_grammar_constrains_the_output(demo_llm):
    grammar = 'start: "(" num ("+" num)* ")"\nnum: /[1-9][0-9]?/'
    [out] = demo_llm.generate(["x ="], SamplingParams(temperature=0.8, seed=2, max_tokens=40,
                                                      structured_outputs={"grammar": grammar}),
                              use_tqdm=False)
    comp = out.outputs[0]
    assert comp.finish_reason == "stop" and re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)",
                                                         comp.text), comp.text


def _exact_requests() -> tuple[list[str], list[SamplingParams]]:
    prompts, params = [], []
    for k, schema in enumerate(SCHEMAS[:8]):
        prompts.append(PROMPTS[k % len(PROMPTS)] * 3)  # (long enough to prefill in chunks)
        kwargs = dict(temperature=0) if k % 3 == 0 else dict(temperature=0.9, seed=40 + k)
        if k % 3 == 2:
            kwargs.update(n=2, best_of=3)
        params.append(SamplingParams(max_tokens=40, structured_outputs={"json": schema},
                                     **kwargs))
    return prompts, params


def _tokens(outs) -> list[list[tuple]]:
    return [sorted((c.index, tuple(c.token_ids), c.finish_reason) for c in o.outputs)
            for o in outs]


@pytest.fixture(scope="module")
def exact_reference(demo_llm) -> list[list[tuple]]:
    prompts, params = _exact_requests()
    return _tokens(demo_llm.generate(prompts, params, use_tqdm=False))


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_constrained_outputs_are_unchanged_by_preemption_chunking_and_batch_order(
        mode, exact_reference, make_llm):
    llm = make_llm(DEMO, block_size=8, kv_cache_memory=32 << 20, num_threads=1,
                   preemption_mode=mode,
                   enable_chunked_prefill=True, max_num_batched_tokens=16,
                   artificial_preemption_prob=0.5, artificial_preemption_seed=5)
    # recompute: masks computed while the model runs (a device worker's way), here on the CPU
    llm.engine.structured.overlap = mode == "recompute"
    prompts, params = _exact_requests()
    order = list(reversed(range(len(prompts))))
    outs = llm.generate([prompts[i] for i in order], [params[i] for i in order], use_tqdm=False)
    assert [_tokens(outs)[order.index(i)] for i in range(len(prompts))] == exact_reference
    stats = llm.stats()
    assert stats["num_preemptions"] > 0
    key = "num_recompute_preemptions" if mode == "recompute" else "num_swap_outs"
    assert stats[key] > 0


def test_min_tokens_lets_a_complete_grammar_end_early_and_holds_one_that_can_go_on(demo_llm):
    """vLLM's rule: EOS is banned under min_tokens unless the grammar allows nothing else."""
    done, going = demo_llm.generate(["answer:", "answer:"], [
        SamplingParams(temperature=0, max_tokens=20, min_tokens=10,
                       structured_outputs={"choice": ["yes", "no"]}),
        SamplingParams(temperature=0, max_tokens=20, min_tokens=10,
                       structured_outputs={"regex": "[a-z ]+"})], use_tqdm=False)
    assert done.outputs[0].finish_reason == "stop" and done.outputs[0].text in ("yes", "no")
    assert len(going.outputs[0].token_ids) >= 10


@pytest.mark.parametrize("spec, words", [
    ({"json": {"type": "strin"}}, "Invalid type: strin"),
    ({"json": {"not": {"type": "string"}}}, "not"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"regex": "(ab"}, "unclosed group"),
    ({"grammar": "start: foo"}, "foo"),
])
def test_a_bad_grammar_is_a_value_error_naming_it_and_the_engine_keeps_serving(
        spec, words, demo_llm):
    with pytest.raises(ValueError, match=re.escape(words)):
        demo_llm.engine.add_request("bad", "x", SamplingParams(structured_outputs=spec))
    assert not demo_llm.engine.has_unfinished()
    [out] = demo_llm.generate(["x"], SamplingParams(temperature=0, max_tokens=4,
                                                    structured_outputs={"regex": "[0-9]+"}),
                              use_tqdm=False)
    assert re.fullmatch("[0-9]+", out.outputs[0].text)


def test_params_refuse_two_grammars_and_beam_search_with_a_grammar():
    with pytest.raises(ValueError, match="exactly one of"):
        SamplingParams(structured_outputs={"regex": "a", "choice": ["a"]})
    with pytest.raises(ValueError, match="beam search does not take structured_outputs"):
        SamplingParams(use_beam_search=True, best_of=2, temperature=0,
                       structured_outputs={"regex": "a"})
    with pytest.raises(ValueError, match=r"logit_bias\[5\] must be a number in \[-100, 100\]"):
        SamplingParams(logit_bias={"5": 101})


def test_a_compile_past_its_deadline_ends_only_its_request(make_llm):
    llm = make_llm(DEMO, block_size=8, kv_cache_memory=32 << 20, num_threads=1)
    llm.engine.structured.compile_timeout_s = 1e-4
    big = {"type": "object", "additionalProperties": False,
           "properties": {f"field_{i}": {"type": "string", "pattern": "[a-z]{1,9}(-[a-z]{1,9}){3}"}
                          for i in range(600)}}
    slow, fine = llm.generate(["a", "b"], [
        SamplingParams(temperature=0, structured_outputs={"json": big}),
        SamplingParams(temperature=0, max_tokens=5)], use_tqdm=False)
    assert slow.outputs[0].finish_reason == "error"
    assert slow.error == "the grammar did not compile within 0.0001 s; simplify the schema"
    assert fine.outputs[0].finish_reason == "length"


def test_each_distinct_grammar_compiles_once(make_llm):
    llm = make_llm(DEMO, block_size=8, kv_cache_memory=32 << 20, num_threads=1)
    params = [SamplingParams(temperature=0, max_tokens=8,
                             structured_outputs={"json": SCHEMAS[k % 2]}) for k in range(6)]
    llm.generate(PROMPTS[:6], params, use_tqdm=False)
    stats = llm.stats()
    assert (stats["num_grammar_compiles"], stats["num_grammar_cache_hits"]) == (2, 4)


def test_logit_bias_moves_the_argmax_and_equals_transformers_sequence_bias(tiny_llama, make_llm):
    prompts = random_prompts(4, seed=9)
    llm = make_llm(tiny_llama, block_size=8, num_threads=1)
    greedy = dict(temperature=0, max_tokens=8, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(**greedy),
                                                          use_tqdm=False)]
    first = plain[0][0]
    [down] = llm.generate(prompts[:1], SamplingParams(**greedy, logit_bias={first: -100}),
                          use_tqdm=False)
    assert down.outputs[0].token_ids[0] != first
    [up] = llm.generate(prompts[:1], SamplingParams(**greedy, logit_bias={"77": 100}),
                        use_tqdm=False)
    assert up.outputs[0].token_ids == [77] * 8
    bias = {first: -100.0, plain[1][1]: -4.5, 50: 3.0, 120: 2.5, 301: 6.0}
    outs = llm.generate(prompts, SamplingParams(**greedy, logit_bias=bias), use_tqdm=False)
    biased = [o.outputs[0].token_ids for o in outs]
    assert biased != plain
    assert biased == hf_greedy(tiny_llama, prompts, 8, bias)


def test_allowed_token_ids_bound_every_sampled_token(tiny_llama, make_llm):
    llm = make_llm(tiny_llama, block_size=8, num_threads=1)
    allowed = [11, 40, 41, 300]
    outs = llm.generate(random_prompts(3, seed=4), [
        SamplingParams(temperature=t, seed=1, n=2, max_tokens=10, ignore_eos=True,
                       allowed_token_ids=allowed) for t in (0, 1.0, 2.0)], use_tqdm=False)
    assert all(set(c.token_ids) <= set(allowed) for o in outs for c in o.outputs)


def test_json_keys_come_in_the_schema_order(demo_llm):
    schema = {"type": "object", "additionalProperties": False, "required": ["zeta", "alpha"],
              "properties": {"zeta": {"type": "boolean"}, "alpha": {"type": "boolean"}}}
    [out] = demo_llm.generate(["x ="], SamplingParams(temperature=0, max_tokens=20,
                                                      structured_outputs={"json": schema}),
                              use_tqdm=False)
    assert list(json.loads(out.outputs[0].text)) == ["zeta", "alpha"]


def test_a_grammar_and_allowed_token_ids_that_leave_no_token_end_with_an_error(demo_llm):
    letters = demo_llm.tokenizer.encode("abc", add_special_tokens=False)
    bad, good = demo_llm.generate(["x =", "x ="], [
        SamplingParams(temperature=0, max_tokens=1, allowed_token_ids=letters,
                       structured_outputs={"regex": "[0-9]+"}),
        SamplingParams(temperature=0, max_tokens=3, structured_outputs={"regex": "[0-9]+"})],
        use_tqdm=False)
    assert (bad.outputs[0].finish_reason, bad.outputs[0].token_ids) == ("error", [])
    assert bad.error == ("no token is allowed at output position 0: the grammar, "
                         "allowed_token_ids and the min_tokens ban of EOS leave none")
    assert good.outputs[0].text.isdigit()


@pytest.mark.parametrize("overlap", [False, True], ids=["masks-in-turn", "masks-made-ahead"])
def test_greedy_constrained_batches_skip_the_sampler_and_match_the_general_path(overlap,
                                                                                demo_llm):
    """Greedy rows under a grammar take the argmax of what it allows without sample rows (with
    masks made while the model runs, as addends, or in turn); the same requests asking for
    logprobs go through the sampler and must draw the same tokens."""
    prompts = PROMPTS[:6]
    specs = [{"json": s} for s in SCHEMAS[:4]] + [{"regex": "[a-z]{3,9}"}, {"choice": ["a", "b"]}]
    step_sampler = demo_llm.engine.step_sampler
    calls = []
    sampler = step_sampler.sampler
    step_sampler.sampler = CountingSampler(sampler, calls)
    was, demo_llm.engine.structured.overlap = demo_llm.engine.structured.overlap, overlap
    try:
        fast = demo_llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=24,
                                                          structured_outputs=spec)
                                           for spec in specs], use_tqdm=False)
        assert calls == []
        general = demo_llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=24,
                                                             logprobs=0, structured_outputs=spec)
                                              for spec in specs], use_tqdm=False)
        assert calls  # (logprobs need sample rows)
    finally:
        step_sampler.sampler = sampler
        demo_llm.engine.structured.overlap = was
    assert [o.outputs[0].token_ids for o in fast] == [o.outputs[0].token_ids for o in general]
    assert [o.outputs[0].text for o in fast] == [o.outputs[0].text for o in general]


class CountingSampler:
    def __init__(self, sampler, calls: list) -> None:
        self.sampler, self.calls = sampler, calls

    def __call__(self, *args):
        self.calls.append(len(args[1]))
        return self.sampler(*args)

    def greedy(self, logits):
        return self.sampler.greedy(logits)


def test_one_call_syncs_every_matcher_and_names_the_token_a_grammar_refuses(demo_llm):
    eng = demo_llm.engine
    so = StructuredOutputs(eng.tokenizer, eng.vocab_size, eng.eos_token_ids)
    one, x, two = (eng.tokenizer.convert_tokens_to_ids(c) for c in "1x2")
    groups = []
    for k in range(3):
        seq = Sequence(seq_id=k, index=0, token_ids=[5, 6, one], num_prompt_tokens=2)
        groups.append(SequenceGroup(f"r{k}", SamplingParams(), [seq], seed=0))
        if not so.start(groups[-1], grammar_of(StructuredOutputsParams(regex="1x2"))):
            assert so.poll(wait=True) == ([groups[-1]], [])
    items = [(g, g.seqs[0]) for g in groups]
    assert so.sync_all(items) is None
    for g, token in zip(groups, [x, one, x]):  # the middle one breaks "1x2"
        g.seqs[0].token_ids.append(token)
    assert so.sync_all(items) == f"the grammar refused output token(s) [{one}]: " + \
        so._matchers[1].matcher.get_error()
    for g in groups[::2]:  # the others took their token once: "2" is next, and only "2"
        g.seqs[0].token_ids.append(two)
    assert so.sync_all(items[::2]) is None
    for g in groups[::2]:
        assert so.sync(g, g.seqs[0]) == (True, None)
