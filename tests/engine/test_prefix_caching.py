"""Prefix caching never changes an answer, and a request sharing a cached prefix computes only
what follows it: exact cached-token counts, eviction, preemption, forks, abort."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest

from engine import Engine, EngineConfig, SamplingParams
from engine.block_manager import AllocStatus, BlockManager
from engine.prefix_cache import block_hashes
from engine.sequence import Sequence, SequenceGroup
from tests.harness.engine import KV_CACHE_MEMORY, hf_greedy
from tests.harness.engine import assert_drained as assert_blocks_drained

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def assert_drained(llm_or_engine) -> None:
    """No leaked blocks, and the cache holds nothing of the finished sequences but blocks."""
    assert_blocks_drained(llm_or_engine)
    cache = getattr(llm_or_engine, "engine", llm_or_engine).block_manager.cache
    if cache is not None:
        assert not cache.hashes and not cache.filling


def tokens(num: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 400) for _ in range(num)]


PREFIX = tokens(70, seed=1)


def shared_prefix_prompts(bs: int) -> list[list[int]]:
    """A first prompt, then prompts sharing its prefix: ending on a block boundary, inside a
    block, wholly the prefix (on and off a boundary), and one equal to the first."""
    on, inside = 2 * bs, 2 * bs + 3
    return [PREFIX[:on] + tokens(5, 2),
            PREFIX[:on] + tokens(7, 3),
            PREFIX[:inside] + tokens(4, 4),
            PREFIX[:on],
            PREFIX[:inside],
            PREFIX[:on] + tokens(5, 2)]


def token_ids(outs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outs]


def first_then_rest(llm, prompts, params):
    """The first prompt alone (it fills the cache), then the others in one batch."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    first = llm.generate(prompts[:1], params[:1], use_tqdm=False)
    return first + llm.generate(prompts[1:], params[1:], use_tqdm=False)


@pytest.fixture(scope="module")
def oracle(tiny_llama):
    prompts = {p: None for bs in (8, 16) for p in map(tuple, shared_prefix_prompts(bs))}
    outs = hf_greedy(tiny_llama, [list(p) for p in prompts], GREEDY.max_tokens)
    return dict(zip(prompts, outs))


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "whole"])
@pytest.mark.parametrize("bs", [8, 16])
def test_shared_prefixes_match_transformers_and_no_cache(bs, chunked, tiny_llama, oracle,
                                                         make_llm):
    prompts = shared_prefix_prompts(bs)
    config = dict(block_size=bs, enable_chunked_prefill=chunked,
                  max_num_batched_tokens=16 if chunked else 256)
    cached = make_llm(tiny_llama, enable_prefix_caching=True, **config)
    plain = make_llm(tiny_llama, enable_prefix_caching=False, **config)
    outs = token_ids(first_then_rest(cached, prompts, GREEDY))
    assert outs == token_ids(first_then_rest(plain, prompts, GREEDY))
    assert outs == [[oracle[tuple(p)]] for p in prompts]
    stats = cached.stats()
    assert stats["num_prompt_tokens"] == sum(map(len, prompts))
    # The first prompt cached its 2 full blocks (the prefix to 2 * bs); the second batch hits
    # them all 5 times, and the prompt that is wholly those blocks still runs its last token
    # (chunked or not: the batch cannot hit its own blocks in either).
    assert stats["num_cached_tokens"] == 5 * 2 * bs - 1
    assert plain.stats()["num_cached_tokens"] == 0
    assert plain.stats()["num_cached_blocks"] == 0
    assert_drained(cached)


def record_steps(engine: Engine) -> list:
    """Every SchedulerOutput of the engine, with the invariants checked after each step."""
    outs = []
    schedule = engine.scheduler.schedule

    def wrapped(proposals=None):
        engine.block_manager.check_invariants()
        out = schedule(proposals)
        outs.append(out)
        return out

    engine.scheduler.schedule = wrapped  # type: ignore[method-assign]
    return outs


def run(engine: Engine, requests: dict[str, list[int]], params=GREEDY) -> dict[str, list[int]]:
    for request_id, prompt in requests.items():
        engine.add_request(request_id, prompt, params)
    results = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
    return results


def new_tokens(steps, request_id: str) -> list[int]:
    """The tokens each step ran for `request_id`."""
    return [item.num_new_tokens for out in steps for item in out.scheduled
            if item.group.request_id == request_id]


def test_a_second_request_computes_only_its_uncached_tokens(tiny_llama):
    engine = Engine(EngineConfig(model=str(tiny_llama), kv_cache_memory=KV_CACHE_MEMORY,
                                 block_size=8, swap_space=0.01, enable_prefix_caching=True))
    steps = record_steps(engine)
    a = PREFIX[:20] + tokens(5, 5)  # 25 tokens: 3 full blocks cached once computed
    b = PREFIX[:20] + tokens(7, 6)  # its third block differs from a's: 2 blocks hit
    expected = hf_greedy(tiny_llama, [a, b, a, a[:24], a[:10]], GREEDY.max_tokens)
    assert run(engine, {"a": a}) == {"a": expected[0]}
    assert engine.stats()["num_cached_blocks"] == 3
    assert engine.stats()["num_evictable_blocks"] == 3  # a is done: its blocks are free
    assert run(engine, {"b": b}) == {"b": expected[1]}
    assert new_tokens(steps, "b")[0] == 27 - 16
    assert engine.stats()["num_cached_tokens"] == 16
    assert run(engine, {"a2": a}) == {"a2": expected[2]}  # equal to a: 3 blocks hit
    assert new_tokens(steps, "a2")[0] == 25 - 24
    assert run(engine, {"a3": a[:24]}) == {"a3": expected[3]}  # wholly cached: 23 hit
    assert new_tokens(steps, "a3")[0] == 1
    assert run(engine, {"a4": a[:10]}) == {"a4": expected[4]}  # one full block
    assert new_tokens(steps, "a4")[0] == 10 - 8
    stats = engine.stats()
    assert stats["num_cached_tokens"] == 16 + 24 + 23 + 8
    assert stats["num_prompt_tokens"] == 25 + 27 + 25 + 24 + 10
    assert stats["prefix_cache_hit_rate"] == pytest.approx(71 / 111)
    assert_drained(engine)


def admission(steps, request_id: str):
    return next(out for out in steps if any(i.group.request_id == request_id
                                            for i in out.scheduled))


def test_a_wholly_cached_prompt_writes_its_last_token_into_a_copy(tiny_llama):
    engine = Engine(EngineConfig(model=str(tiny_llama), kv_cache_memory=KV_CACHE_MEMORY,
                                 block_size=8, swap_space=0.01, enable_prefix_caching=True))
    steps = record_steps(engine)
    prompt = PREFIX[:16]
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = hf_greedy(tiny_llama, [prompt, prompt + [7]], 40)
    assert run(engine, {"first": prompt}, long) == {"first": expected[0]}
    cached = dict(engine.block_manager.cache.block_of)
    last = cached[block_hashes(prompt, 2, 8)[1]]
    # Held by nobody, or by a running request: either way the cached block stays as it was.
    assert run(engine, {"alone": prompt}, long) == {"alone": expected[0]}
    [(src, _)] = admission(steps, "alone").blocks_to_copy
    assert src == last and engine.block_manager.cache.block_of == cached
    engine.add_request("holder", prompt + [7], long)
    for _ in range(3):
        engine.step()
    engine.add_request("copy", prompt, long)
    engine.add_request("copy2", prompt, long)  # the same step: it hits all 16 tokens too
    results = run(engine, {})
    assert results == {"holder": expected[1], "copy": expected[0], "copy2": expected[0]}
    assert [src for src, _ in admission(steps, "copy").blocks_to_copy] == [last, last]
    assert engine.stats()["num_cached_tokens"] == 15 + 16 + 15 + 15
    assert engine.block_manager.cache.block_of == cached
    assert_drained(engine)


def test_a_wholly_cached_prompt_the_size_of_the_cache_recomputes_its_last_block(tiny_llama):
    # 4 blocks, the prompt's 32 tokens fill them: no room for a copy of the last one.
    engine = Engine(EngineConfig(model=str(tiny_llama), block_size=8, swap_space=0.01,
                                 num_gpu_blocks_override=4, watermark=0.0, max_model_len=33,
                                 enable_prefix_caching=True))
    steps = record_steps(engine)
    prompt = PREFIX[:32]
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    [expected] = hf_greedy(tiny_llama, [prompt], 1)
    assert run(engine, {"a": prompt}, params) == {"a": expected}
    assert engine.stats()["num_evictable_blocks"] == 4
    assert run(engine, {"b": prompt}, params) == {"b": expected}
    assert new_tokens(steps, "b") == [8] and engine.stats()["num_cached_tokens"] == 24
    assert_drained(engine)


def test_a_prefix_is_hit_while_its_first_request_is_still_prefilling(tiny_llama):
    engine = Engine(EngineConfig(model=str(tiny_llama), kv_cache_memory=KV_CACHE_MEMORY,
                                 block_size=8, swap_space=0.01,
                                 max_num_batched_tokens=16, enable_prefix_caching=True))
    steps = record_steps(engine)
    a = PREFIX[:48]
    b = PREFIX[:40] + tokens(3, 7)
    expected = hf_greedy(tiny_llama, [a, b], GREEDY.max_tokens)
    engine.add_request("a", a, GREEDY)
    engine.step()
    engine.step()  # a has 32 tokens computed: 4 blocks, cached at the next step's start
    engine.add_request("b", b, GREEDY)
    results = run(engine, {})
    assert results == {"a": expected[0], "b": expected[1]}
    # Step 3 gives the whole budget to a's last chunk; b is admitted at step 4, when a's 6
    # blocks are computed, and hits the 5 it shares.
    assert new_tokens(steps, "a")[:3] == [16, 16, 16]
    assert new_tokens(steps, "b")[0] == 43 - 40
    assert engine.stats()["num_cached_tokens"] == 40
    assert_drained(engine)


def test_abort_caches_what_was_computed_and_abort_all_empties_the_cache(tiny_llama):
    engine = Engine(EngineConfig(model=str(tiny_llama), kv_cache_memory=KV_CACHE_MEMORY,
                                 block_size=8, swap_space=0.01,
                                 max_num_batched_tokens=16, enable_prefix_caching=True))
    steps = record_steps(engine)
    a = PREFIX[:48]
    expected = hf_greedy(tiny_llama, [a], GREEDY.max_tokens)[0]
    engine.add_request("a", a, GREEDY)
    engine.step()
    engine.step()
    assert engine.abort("a")  # 32 tokens computed: 4 blocks stay cached
    assert engine.stats()["num_evictable_blocks"] == 4
    assert_drained(engine)
    assert run(engine, {"b": a}) == {"b": expected}
    assert new_tokens(steps, "b")[0] == 16  # its budget's worth: 48 - 32 left
    assert engine.stats()["num_cached_tokens"] == 32
    engine.abort_all()
    steps = record_steps(engine)  # (a new scheduler)
    stats = engine.stats()
    assert stats["num_cached_blocks"] == 0 and stats["num_free_blocks"] == stats[
        "num_total_blocks"]
    assert stats["num_cached_tokens"] == 32  # (cumulative across abort_all)
    assert run(engine, {"c": a}) == {"c": expected}
    assert new_tokens(steps, "c")[0] == 16 and engine.stats()["num_cached_tokens"] == 32
    assert_drained(engine)


FAMILIES = [tokens(24, seed=10 + f) for f in range(3)]
SMALL_PROMPTS = [FAMILIES[i % 3] + tokens(3 + i % 7, seed=20 + i) for i in range(12)]


@pytest.fixture(scope="module")
def small_oracle(tiny_llama):
    return hf_greedy(tiny_llama, SMALL_PROMPTS, GREEDY.max_tokens)


def test_eviction_under_a_small_cache_keeps_outputs_exact(tiny_llama, small_oracle, make_llm):
    # 14 blocks of 8: two requests' worth (6 blocks each at most), so admissions evict.
    llm = make_llm(tiny_llama, block_size=8, num_gpu_blocks_override=14, watermark=0.0,
                   max_num_seqs=2, enable_prefix_caching=True)
    outs = []
    for start in range(0, len(SMALL_PROMPTS), 3):
        outs += llm.generate(SMALL_PROMPTS[start:start + 3], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == small_oracle
    stats = llm.stats()
    assert llm.engine.block_manager.cache.num_evictions > 0
    assert stats["num_cached_tokens"] > 0 and stats["num_preemptions"] == 0
    assert_drained(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "whole"])
def test_preemption_with_prefix_caching_keeps_outputs_exact(mode, chunked, tiny_llama,
                                                            small_oracle, make_llm):
    llm = make_llm(tiny_llama, block_size=8, preemption_mode=mode, max_num_seqs=4,
                   enable_chunked_prefill=chunked, max_num_batched_tokens=16 if chunked else 64,
                   artificial_preemption_prob=0.5, artificial_preemption_seed=3,
                   enable_prefix_caching=True)
    outs = first_then_rest(llm, SMALL_PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == small_oracle
    stats = llm.stats()
    assert stats["num_cached_tokens"] > 0
    if mode == "recompute":
        assert stats["num_recompute_preemptions"] > 0 and stats["num_swap_outs"] == 0
    else:
        assert stats["num_swap_outs"] > 0 and stats["num_swap_ins"] == stats["num_swap_outs"]
    assert_drained(llm)


def test_a_cache_too_small_for_the_batch_preempts_and_stays_exact(tiny_llama, small_oracle,
                                                                  make_llm):
    llm = make_llm(tiny_llama, block_size=8, num_gpu_blocks_override=12, watermark=0.0,
                   max_num_seqs=8, enable_prefix_caching=True)
    outs = first_then_rest(llm, SMALL_PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == small_oracle
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["num_cached_tokens"] > 0
    assert_drained(llm)


FORK_PARAMS = {
    "n3-seeded": SamplingParams(n=3, temperature=0.8, top_p=0.9, seed=5, max_tokens=16,
                                ignore_eos=True),
    "best_of4-n2": SamplingParams(n=2, best_of=4, temperature=1.0, seed=6, max_tokens=16,
                                  ignore_eos=True),
    "beam3": SamplingParams(n=2, best_of=3, use_beam_search=True, temperature=0,
                            max_tokens=12, ignore_eos=True),
    "seeded": SamplingParams(temperature=0.8, top_k=20, seed=7, max_tokens=16,
                             ignore_eos=True),
}


@pytest.mark.parametrize("preempt", [0.0, 0.5], ids=["plain", "preempted"])
@pytest.mark.parametrize("kind", list(FORK_PARAMS))
def test_forks_and_seeded_sampling_are_unchanged_by_prefix_caching(kind, preempt, tiny_llama,
                                                                   make_llm):
    prompts = SMALL_PROMPTS[:6]
    config = dict(block_size=8, max_num_batched_tokens=32, artificial_preemption_prob=preempt,
                  artificial_preemption_seed=4)
    params = FORK_PARAMS[kind]
    plain = token_ids(first_then_rest(make_llm(tiny_llama, enable_prefix_caching=False,
                                               **config), prompts, params))
    llm = make_llm(tiny_llama, enable_prefix_caching=True, **config)
    assert token_ids(first_then_rest(llm, prompts, params)) == plain
    assert llm.stats()["num_cached_tokens"] > 0
    if preempt:
        assert llm.stats()["num_preemptions"] > 0
    assert_drained(llm)


@pytest.mark.parametrize("flag,expected", [
    ([], False),  # (off by default: docs/benchmarks.md)
    (["--enable-prefix-caching"], True),
    (["--no-enable-prefix-caching"], False)])
def test_genq_worker_passes_its_flag_to_the_engine(flag, expected, tiny_llama):
    code = ("import sys\n"
            "import worker.loop\n"
            "class Stub:\n"
            "    def __init__(self, engine, cfg, metrics_server=None):\n"
            "        self.engine = engine\n"
            "    def request_stop(self):\n"
            "        pass\n"
            "    def run(self):\n"
            "        print('prefix caching', self.engine.config.enable_prefix_caching)\n"
            "        return 0\n"
            "worker.loop.Worker = Stub\n"
            "from worker.main import main\n"
            f"sys.exit(main(['--model', {str(tiny_llama)!r}] + {flag!r}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == f"prefix caching {expected}"


def test_logprobs_of_a_cached_prompt_are_close_to_an_uncached_ones(tiny_llama, make_llm):
    """Not bit-equal: the uncached tokens run through other kernels and shapes (why the
    default is off)."""
    prompts = [PREFIX[:32] + tokens(5, 8), PREFIX[:32], PREFIX[:32] + tokens(5, 8)]
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=2, ignore_eos=True)
    outs = {}
    for on in (False, True):
        llm = make_llm(tiny_llama, block_size=8, enable_prefix_caching=on)
        outs[on] = [o.outputs[0] for o in first_then_rest(llm, prompts, params)]
        assert llm.stats()["num_cached_tokens"] == (31 + 32 if on else 0)
    for plain, cached in zip(outs[False], outs[True]):
        assert cached.token_ids == plain.token_ids
        assert cached.cumulative_logprob == pytest.approx(plain.cumulative_logprob, abs=1e-4)
        for row_plain, row_cached in zip(plain.logprobs, cached.logprobs, strict=True):
            assert row_cached.keys() == row_plain.keys()
            assert all(row_cached[t] == pytest.approx(v, abs=1e-4) for t, v in row_plain.items())


# -- the block manager alone ---------------------------------------------------------------------
def group(token_ids: list[int], seq_id: int) -> SequenceGroup:
    seq = Sequence(seq_id, 0, list(token_ids), len(token_ids))
    return SequenceGroup(f"r{seq_id}", SamplingParams(), [seq], seed=0)


def computed(bm: BlockManager, g: SequenceGroup) -> None:
    """As a step would: the group's tokens are computed, then the next step caches them."""
    for seq in g.seqs:
        seq.num_computed_tokens = seq.num_tokens
    bm.cache_computed()


def test_block_hashes_are_stable_and_chained():
    first = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 2, 4)
    assert [h.hex() for h in first] == ["c9d5355a5a6754fe62360bb33b755f5d",
                                        "9b6d991fdb204dcfd8a2aa40275e9e5c"]
    assert block_hashes([9, 2, 3, 4, 5, 6, 7, 8], 2, 4)[1] != first[1]  # another prefix
    assert block_hashes([5, 6, 7, 8], 1, 4) != first[1:]  # another position


def test_freed_cached_blocks_stay_free_and_are_evicted_least_recently_used_first():
    bm = BlockManager(6, 0, block_size=4, watermark=0.0, enable_prefix_caching=True)
    a, b = group(list(range(10)), 1), group(list(range(100, 108)), 2)
    bm.allocate(a, bm.prefix_hits(a))
    bm.allocate(b, bm.prefix_hits(b))
    computed(bm, a)
    computed(bm, b)
    assert bm.num_cached_blocks == 4 and bm.num_free_blocks == 1
    a_blocks, b_blocks = bm.table(a.seqs[0]), bm.table(b.seqs[0])
    bm.free_group(b)
    bm.free_group(a)
    assert bm.num_free_blocks == 6 and bm.num_evictable_blocks == 4  # evictable is free
    bm.check_invariants()
    # Uncached blocks go first, then b's (freed first, tail first), then a's.
    c = group(list(range(200, 212)), 3)
    assert bm.can_allocate(c, bm.prefix_hits(c)) is AllocStatus.OK
    bm.allocate(c, bm.prefix_hits(c))
    assert bm.table(c.seqs[0]) == [a_blocks[2], 5, b_blocks[1]]
    assert bm.num_cached_blocks == 3
    # a's two cached blocks still hit: 8 tokens cached, and they cost no fresh block.
    a2 = group(list(range(10)), 4)
    hits = bm.prefix_hits(a2)
    assert hits == [a_blocks[:2]] and bm.cached_tokens(a2, hits) == [8]
    bm.free_group(c)
    bm.free_group(a2)
    bm.check_invariants()
