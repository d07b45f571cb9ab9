"""Engine.step's outputs: every progressing request by default, only finished ones on request."""

from __future__ import annotations

from engine import Engine, EngineConfig, SamplingParams
from tests.harness.engine import KV_CACHE_MEMORY, assert_drained, random_prompts


def _drive(engine: Engine, finished_only: bool) -> tuple[dict[str, list], int]:
    """Run to completion; per request the (finished, num tokens) of every output it got."""
    seen: dict[str, list] = {}
    steps = 0
    while engine.has_unfinished():
        steps += 1
        for out in engine.step(finished_only=finished_only):
            seen.setdefault(out.request_id, []).append(
                (out.finished, [list(c.token_ids) for c in out.outputs]))
    return seen, steps


def test_finished_only_returns_each_request_once_with_the_same_final_output(tiny_llama):
    prompts = random_prompts(6, seed=21)
    results = []
    for finished_only in (False, True):
        engine = Engine(EngineConfig(model=str(tiny_llama), kv_cache_memory=KV_CACHE_MEMORY,
                                     swap_space=0.01, seed=0))
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt,
                               SamplingParams(temperature=0, max_tokens=3 + i, ignore_eos=True))
        results.append(_drive(engine, finished_only))
        assert_drained(engine)
    (every, steps_all), (final, steps_final) = results
    assert steps_all == steps_final == 8  # prefill + the longest request's 8 decode steps
    assert sorted(final) == sorted(every) == [str(i) for i in range(6)]
    for request_id, outs in final.items():
        assert len(outs) == 1 and outs[0][0] is True
        assert outs[0] == every[request_id][-1]
        assert len(outs[0][1][0]) == 3 + int(request_id)
        # By default a request reports after every step it ran, the last one finished.
        assert [f for f, _ in every[request_id]] == [False] * (2 + int(request_id)) + [True]
        assert [len(t[0]) for _, t in every[request_id]] == list(range(1, 4 + int(request_id)))
