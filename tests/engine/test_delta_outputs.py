"""Delta outputs (EngineConfig.output_kind="delta"): each output holds only what is new, and the
deltas of a request add up to what cumulative outputs give."""

from __future__ import annotations

from engine import Engine, EngineConfig, SamplingParams
from engine.outputs import RequestOutput
from tests.harness.engine import KV_CACHE_MEMORY, assert_drained, random_prompts

_PARAMS = [
    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=1.0, seed=5, n=2, max_tokens=20, ignore_eos=True),
    SamplingParams(temperature=1.0, seed=6, max_tokens=30, stop_token_ids=[7, 9, 11]),
    SamplingParams(temperature=0.8, seed=7, max_tokens=16, logprobs=2, ignore_eos=True),
    SamplingParams(temperature=1.0, seed=8, n=1, best_of=3, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=0, use_beam_search=True, best_of=3, max_tokens=10,
                   ignore_eos=True),
    SamplingParams(temperature=1.0, seed=9, n=3, max_tokens=18, min_tokens=4),
]


def _run(engine: Engine, prompts: list, params: list[SamplingParams]) -> dict[str, list]:
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), prompt, p)
    seen: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out)
    assert_drained(engine)
    return seen


def test_deltas_add_up_to_the_cumulative_outputs(tiny_llama):
    prompts = random_prompts(len(_PARAMS), seed=31)
    cumulative = _run(Engine(EngineConfig(model=str(tiny_llama), kv_cache_memory=KV_CACHE_MEMORY,
                                          swap_space=0.01)), prompts,
                      _PARAMS)
    delta = _run(Engine(EngineConfig(model=str(tiny_llama), kv_cache_memory=KV_CACHE_MEMORY,
                                     swap_space=0.01, output_kind="delta")), prompts, _PARAMS)
    assert sorted(delta) == sorted(cumulative) == [str(i) for i in range(len(_PARAMS))]
    for request_id, outs in delta.items():
        final = cumulative[request_id][-1]
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        ids: dict[int, list[int]] = {}
        texts: dict[int, str] = {}
        logprobs: dict[int, list] = {}
        for out in outs:
            for comp in out.outputs:
                ids[comp.index] = ids.get(comp.index, []) + comp.token_ids
                texts[comp.index] = texts.get(comp.index, "") + comp.text
                logprobs[comp.index] = logprobs.get(comp.index, []) + (comp.logprobs or [])
        # The last output names every sequence, with its end.
        assert sorted(c.index for c in outs[-1].outputs) == [c.index for c in final.outputs]
        for comp in final.outputs:
            assert ids[comp.index] == comp.token_ids, request_id
            assert texts[comp.index] == comp.text, request_id
            assert logprobs[comp.index] == (comp.logprobs or [])
            last = next(c for c in outs[-1].outputs if c.index == comp.index)
            assert (last.finish_reason, last.stop_reason) == (comp.finish_reason,
                                                              comp.stop_reason)
            assert last.cumulative_logprob == comp.cumulative_logprob
        params = _PARAMS[int(request_id)]
        if params.best_of != params.n:  # ranked: one output, at the end, whole
            assert len(outs) == 1
        else:  # every step that sampled handed out exactly one new token per live sequence
            assert all(len(c.token_ids) == 1 for o in outs[:-1] for c in o.outputs)
            assert len(outs) == max(len(c.token_ids) for c in final.outputs)


def _stop_across_tokens(engine: Engine, tokens: list[int], text: str) -> tuple[str, int]:
    """A 3-character stop string that starts inside one token's text and ends in the next's,
    found nowhere earlier in `text`; and the index of the token where it starts."""
    pieces = [engine.tokenizer.decode(tokens[:i]) for i in range(len(tokens) + 1)]
    for i in range(1, len(tokens) - 1):
        a, b, c = len(pieces[i]), len(pieces[i + 1]), len(pieces[i + 2])
        if "\ufffd" in pieces[i + 2] or not (b - a >= 2 and c > b) or pieces[i + 2][:c] != text[:c]:
            continue
        stop = text[b - 2:b + 1]
        if text.find(stop) == b - 2:
            return stop, i
    raise AssertionError(f"no stop string across a token boundary in {text!r}")


def test_text_a_stop_string_may_still_cut_is_held_back(tiny_llama):
    prompt = random_prompts(1, seed=12)[0]
    free = SamplingParams(temperature=1.0, seed=3, max_tokens=24, ignore_eos=True)
    engine = Engine(EngineConfig(model=str(tiny_llama), kv_cache_memory=KV_CACHE_MEMORY,
                                 swap_space=0.01))
    full = _run(engine, [prompt], [free])["0"][-1].outputs[0]
    stop, _ = _stop_across_tokens(engine, full.token_ids, full.text)
    expected = full.text[:full.text.find(stop)]
    stopped = SamplingParams(temperature=1.0, seed=3, max_tokens=24, ignore_eos=True, stop=[stop])
    streams = {}
    for kind in ("cumulative", "delta"):
        engine = Engine(EngineConfig(model=str(tiny_llama), kv_cache_memory=KV_CACHE_MEMORY,
                                     swap_space=0.01, output_kind=kind))
        outs = _run(engine, [prompt], [stopped])["0"]
        texts, so_far = [], ""
        for out in outs:
            so_far = so_far + out.outputs[0].text if kind == "delta" else out.outputs[0].text
            texts.append(so_far)
        assert texts[-1] == expected and outs[-1].outputs[0].stop_reason == stop
        streams[kind] = texts
    # Cumulative outputs showed the stop string's first characters before it was complete;
    # delta outputs never hand out text that is cut later.
    assert any(not expected.startswith(t) for t in streams["cumulative"])
    assert all(expected.startswith(t) for t in streams["delta"])


def test_output_kind_is_validated(tiny_llama):
    import pytest

    with pytest.raises(ValueError, match="output_kind must be one of"):
        EngineConfig(model=str(tiny_llama), output_kind="deltas")


class _CountingSampler:
    """The engine's own sampler, counting how it was called."""

    def __init__(self, sampler) -> None:
        self.sampler = sampler
        self.calls = {"rows": 0, "greedy": 0}

    def __call__(self, logits, rows):
        self.calls["rows"] += 1
        return self.sampler(logits, rows)

    def greedy(self, logits):
        self.calls["greedy"] += 1
        return self.sampler.greedy(logits)


def test_plain_greedy_batches_skip_the_sampler_and_match_the_general_path(tiny_llama):
    prompts = random_prompts(6, seed=41)
    greedy = [SamplingParams(temperature=0, max_tokens=12 + i, ignore_eos=i % 2 == 0,
                             stop_token_ids=[5] if i == 3 else []) for i in range(6)]
    sampled = SamplingParams(temperature=0.9, seed=3, max_tokens=30, ignore_eos=True)
    runs = {}
    for name, extra in (("greedy only", []), ("with a sampled request", [sampled])):
        engine = Engine(EngineConfig(model=str(tiny_llama), kv_cache_memory=KV_CACHE_MEMORY,
                                     swap_space=0.01, output_kind="delta"))
        counting = _CountingSampler(engine.step_sampler.sampler)
        engine.step_sampler.sampler = counting
        seen = _run(engine, prompts + ["a sampled one"] * len(extra), greedy + extra)
        runs[name] = ({rid: ([t for o in outs for c in o.outputs for t in c.token_ids],
                             outs[-1].outputs[0].finish_reason,
                             outs[-1].outputs[0].cumulative_logprob)
                       for rid, outs in seen.items() if int(rid) < 6}, counting.calls)
    fast, fast_calls = runs["greedy only"]
    general, general_calls = runs["with a sampled request"]
    assert fast_calls["rows"] == 0 and fast_calls["greedy"] > 0
    # (the sampled request outlives every greedy one: each of their steps took the rows path)
    assert general_calls["greedy"] == 0 and general_calls["rows"] > 0
    assert fast == general
    assert {reason for _, reason, _ in fast.values()} <= {"length", "stop"}
    assert all(logprob is None for _, _, logprob in fast.values())  # (none asked for)
    assert [len(ids) for ids, reason, _ in fast.values() if reason == "length"] == [
        12 + i for i in range(6) if fast[str(i)][1] == "length"]


def test_request_metrics_are_read_from_the_request(tiny_llama):
    engine = Engine(EngineConfig(model=str(tiny_llama), kv_cache_memory=KV_CACHE_MEMORY,
                                 swap_space=0.01, output_kind="delta"))
    engine.add_request("m", "the quick brown fox", SamplingParams(temperature=0, max_tokens=5,
                                                                  ignore_eos=True))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    first, last = outs[0].metrics, outs[-1].metrics
    assert sorted(last) == ["arrival_time", "latency", "num_preemptions",
                            "time_to_first_token"]
    assert first["arrival_time"] == last["arrival_time"]
    assert 0 <= last["time_to_first_token"] <= last["latency"]
    assert last["num_preemptions"] == 0.0
