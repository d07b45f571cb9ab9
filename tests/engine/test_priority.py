"""scheduling_policy="priority" (vLLM's): (priority, arrival) order, the least urgent running
request preempted for a more urgent arrival, and outputs unchanged by any of it."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from tests.harness.engine import assert_drained, hf_greedy, random_prompts

PROMPTS = random_prompts(8, seed=21, lo=4, hi=20)
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def seeded(i: int, n: int = 1) -> SamplingParams:
    return SamplingParams(n=n, temperature=0.8, top_p=0.9, seed=300 + i, max_tokens=16,
                          ignore_eos=True)


def run(llm: LLM, requests: list[tuple[str, list[int], SamplingParams, int]],
        arrive_later: dict[str, int] | None = None
        ) -> tuple[list[str], dict[str, list], dict[str, int]]:
    """Step the engine; `arrive_later`: request id -> the step before which it is added.
    Returns the finish order, each request's token ids per sequence index, and the step at
    which each request had its first token."""
    engine = llm.engine
    later = arrive_later or {}
    for rid, prompt, params, priority in requests:
        if rid not in later:
            engine.add_request(rid, prompt, params, priority)
    order: list[str] = []
    tokens: dict[str, list] = {}
    first: dict[str, int] = {}
    step = 0
    while engine.has_unfinished() or any(s >= step for s in later.values()):
        for rid, prompt, params, priority in requests:
            if later.get(rid) == step:
                engine.add_request(rid, prompt, params, priority)
        for out in engine.step():
            if any(c.token_ids for c in out.outputs):
                first.setdefault(out.request_id, step)
            if out.finished:
                order.append(out.request_id)
                tokens[out.request_id] = [c.token_ids for c in
                                          sorted(out.outputs, key=lambda c: c.index)]
        step += 1
    return order, tokens, first


@pytest.fixture(scope="module")
def greedy_oracle(tiny_llama):
    return hf_greedy(tiny_llama, PROMPTS, 16)


@pytest.fixture(scope="module")
def seeded_reference(tiny_llama):
    llm = LLM(str(tiny_llama), block_size=8, swap_space=0.05)
    return {n: [[c.token_ids for c in o.outputs]
                for o in llm.generate(PROMPTS, [seeded(i, n) for i in range(len(PROMPTS))],
                                      use_tqdm=False)] for n in (1, 2)}


def test_requests_run_in_priority_then_arrival_order(tiny_llama, greedy_oracle):
    llm = LLM(str(tiny_llama), block_size=8, swap_space=0.05, max_num_seqs=1,
              scheduling_policy="priority")
    priorities = [3, 1, 2, 1, 0, 3, 2, 0]
    order, tokens, _ = run(llm, [(f"r{i}", p, GREEDY, priorities[i])
                                 for i, p in enumerate(PROMPTS)])
    assert order == ["r4", "r7", "r1", "r3", "r2", "r6", "r0", "r5"]
    assert [tokens[f"r{i}"][0] for i in range(len(PROMPTS))] == greedy_oracle
    assert_drained(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_an_urgent_arrival_preempts_the_least_urgent_and_no_output_changes(
        mode, tiny_llama, greedy_oracle):
    # 12 blocks of 8 tokens: the six low-priority requests (up to 36 tokens each) cannot all
    # run, and the late urgent one finds the cache full.
    requests = [(f"r{i}", p, GREEDY, 5) for i, p in enumerate(PROMPTS[:6])]
    requests.append(("urgent", PROMPTS[6], GREEDY, 0))
    waits = {}
    for policy in ("fcfs", "priority"):
        llm = LLM(str(tiny_llama), block_size=8, swap_space=0.05, num_gpu_blocks_override=12,
                  watermark=0.0, preemption_mode=mode, scheduling_policy=policy)
        fcfs = policy == "fcfs"
        order, tokens, first = run(llm, [(r, p, s, 0 if fcfs else k) for r, p, s, k in requests],
                                   arrive_later={"urgent": 6})
        waits[policy] = first["urgent"] - 6  # steps from its arrival to its first token
        assert [tokens[f"r{i}"][0] for i in range(6)] + [tokens["urgent"][0]] == \
            greedy_oracle[:7]
        assert_drained(llm)
    stats = llm.stats()
    assert stats["num_priority_preemptions"] >= 1
    # Preempting takes one step and prefilling the next: it samples within 2 steps. Under FCFS
    # it waits for the running requests to finish.
    assert waits["priority"] <= 2 < waits["fcfs"]
    if mode == "swap":
        assert stats["num_swap_outs"] >= 1 and stats["num_swap_ins"] == stats["num_swap_outs"]
    else:
        assert stats["num_recompute_preemptions"] >= 1 and stats["num_swap_outs"] == 0


@pytest.mark.parametrize("n", [1, 2])
def test_seeded_outputs_are_unchanged_by_priority_preemption(n, tiny_llama, seeded_reference):
    llm = LLM(str(tiny_llama), block_size=8, swap_space=0.05, num_gpu_blocks_override=14,
              watermark=0.0, scheduling_policy="priority")
    # Urgency against arrival: the later a request comes, the more urgent it is.
    requests = [(f"r{i}", p, seeded(i, n), len(PROMPTS) - i) for i, p in enumerate(PROMPTS)]
    order, tokens, _ = run(llm, requests, arrive_later={f"r{i}": 2 * i for i in range(1, 8)})
    assert llm.stats()["num_priority_preemptions"] >= 1
    assert [tokens[f"r{i}"] for i in range(len(PROMPTS))] == seeded_reference[n]
    assert order[-1] == "r0"
    assert_drained(llm)


def test_equal_priorities_schedule_exactly_as_fcfs(tiny_llama):
    stats, orders = [], []
    for policy in ("fcfs", "priority"):
        llm = LLM(str(tiny_llama), block_size=8, swap_space=0.05, num_gpu_blocks_override=10,
                  max_num_batched_tokens=16, scheduling_policy=policy,
                  artificial_preemption_prob=0.3, artificial_preemption_seed=5)
        orders.append(run(llm, [(f"r{i}", p, seeded(i), 0) for i, p in enumerate(PROMPTS)],
                          arrive_later={"r5": 3, "r6": 3, "r7": 9}))
        stats.append({k: v for k, v in llm.stats().items() if k.startswith("num_") and
                      "preempt" in k or k.startswith("num_swap")})
    assert orders[0] == orders[1]
    assert stats[0] == stats[1] and stats[0]["num_preemptions"] > 0


def test_priority_needs_the_priority_policy():
    with pytest.raises(ValueError, match="scheduling_policy must be one of"):
        EngineConfig(model="m", scheduling_policy="lifo")


def test_a_priority_under_fcfs_is_refused_with_the_fix(tiny_llama):
    llm = LLM(str(tiny_llama), block_size=8, swap_space=0.05)
    with pytest.raises(ValueError, match="priority 1 needs scheduling_policy='priority'"):
        llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False, priority=[1])
    with pytest.raises(ValueError, match="got 2 priorities for 1 prompts"):
        llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False, priority=[0, 0])
