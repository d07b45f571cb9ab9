"""Scheduler invariants, driven without a model: a fake step samples token 1 for every sequence
that samples, and Scheduler.update applies it."""

from __future__ import annotations

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.scheduler_output import Sample, Sampled, SchedulerOutput
from engine.sequence import Sequence, SequenceGroup

_ids = iter(range(10**6))


def make(num_blocks=64, host_blocks=64, **config) -> Scheduler:
    cfg = EngineConfig(model="unused", block_size=4, watermark=0.0, **config)
    return Scheduler(cfg, BlockManager(num_blocks, host_blocks, 4, 0.0))


def add(sched: Scheduler, prompt_len: int, t: float, max_tokens: int = 8, n: int = 1):
    seq = Sequence(next(_ids), 0, [5] * prompt_len, prompt_len)
    g = SequenceGroup(f"r{t}", SamplingParams(n=n, max_tokens=max_tokens), [seq], 0,
                      arrival_time=t)
    sched.add(g)
    return g


def fake_step(sched: Scheduler) -> SchedulerOutput:
    """A step whose every sampling sequence draws token 1, applied by Scheduler.update."""
    out = sched.schedule()
    items = [item for item in out.scheduled if item.do_sample]
    sched.update(out, Sampled(items, samples=[Sample(i.group, i.seq, i.seq.index, 1)
                                              for i in items]))
    return out


def fake_spec_step(sched: Scheduler) -> SchedulerOutput:
    """fake_step with proposals [1, 1, 2] for every decoding sequence: verification draws 1 at
    every position, so two proposals are accepted and a third token (1) is emitted."""
    proposals = {s.seq_id: [1, 1, 2] for g in sched.running for s in g.live_seqs()
                 if s.num_tokens - s.num_computed_tokens == 1}
    out = sched.schedule(proposals)
    items = [item for item in out.scheduled if item.do_sample]
    samples = [Sample(i.group, i.seq, i.seq.index, 1) for i in items
               for _ in range(1 + min(2, len(i.spec_token_ids or ())))]
    sched.update(out, Sampled(items, samples=samples,
                              speculated=[i for i in items if i.spec_token_ids]))
    return out


def drain(sched: Scheduler, limit: int = 1000, spec: bool = False) -> list[SchedulerOutput]:
    outs = []
    while sched.num_unfinished() and len(outs) < limit:
        outs.append(fake_spec_step(sched) if spec else fake_step(sched))
    assert sched.num_unfinished() == 0, "the scheduler did not finish its work"
    return outs


def test_token_and_sequence_budgets_hold_every_step():
    sched = make(max_num_batched_tokens=10, max_num_seqs=3)
    for t in range(6):
        add(sched, 7, float(t))
    for out in drain(sched):
        assert out.num_batched_tokens <= 10
        assert len(out.scheduled) <= 3
        assert out.num_batched_tokens == sum(s.num_new_tokens for s in out.scheduled)
    assert sched.block_manager.num_free_blocks == 64


def test_chunked_prefill_splits_a_long_prompt_across_steps():
    sched = make(max_num_batched_tokens=8)
    g = add(sched, 20, 0.0)
    chunks = [fake_step(sched).scheduled[0].num_new_tokens for _ in range(3)]
    assert chunks == [8, 8, 4]
    assert g.seqs[0].num_output_tokens == 1


def test_admission_is_first_come_first_served():
    sched = make(max_num_batched_tokens=4, max_num_seqs=8)
    groups = [add(sched, 4, float(t)) for t in (3.0, 1.0, 2.0)]
    order = []
    for out in drain(sched):
        for item in out.scheduled:
            if item.group not in order:
                order.append(item.group)
    assert [g.arrival_time for g in order] == [1.0, 2.0, 3.0]
    assert set(map(id, order)) == set(map(id, groups))


def test_recompute_preemption_evicts_the_newest_and_requeues_it_at_the_head():
    sched = make(num_blocks=5, preemption_mode="recompute", max_num_seqs=4)
    old, new = add(sched, 8, 0.0, max_tokens=12), add(sched, 8, 1.0, max_tokens=12)
    late = add(sched, 8, 2.0)
    fake_step(sched)  # both 8-token prompts admitted (4 blocks); `late` waits for room
    assert list(sched.running) == [old, new] and list(sched.waiting) == [late]
    preempted_at = None
    for i in range(20):
        out = fake_step(sched)
        if out.num_preempted:
            preempted_at = i
            break
    assert preempted_at is not None
    assert list(sched.running) == [old]
    assert list(sched.waiting) == [new, late]  # arrival order, the preempted one first
    assert new.seqs[0].num_computed_tokens == 0
    assert sched.counters["num_recompute_preemptions"] == 1
    drain(sched)
    assert sched.block_manager.num_free_blocks == 5


def test_no_admission_while_a_group_is_swapped_out():
    sched = make(num_blocks=8, preemption_mode="swap", max_num_seqs=8)
    a, b = add(sched, 8, 0.0, max_tokens=16), add(sched, 8, 1.0, max_tokens=16)
    while not sched.swapped:
        fake_step(sched)
    assert list(sched.swapped) == [b]
    c = add(sched, 1, 2.0)  # fits in the free blocks, yet must wait for b
    while sched.swapped:
        out = fake_step(sched)
        assert not (out.blocks_to_swap_in and out.blocks_to_swap_out)
        if sched.swapped:
            assert c.seqs[0].num_computed_tokens == 0  # never admitted before b came back
    assert b in sched.running
    drain(sched)
    assert a.seqs[0].num_output_tokens == b.seqs[0].num_output_tokens == 16
    assert sched.counters["num_swap_outs"] >= 1 and sched.counters["num_swap_ins"] >= 1


def test_a_group_that_outgrows_the_whole_cache_finishes_with_length():
    sched = make(num_blocks=3, host_blocks=0, max_num_seqs=4)
    g = add(sched, 4, 0.0, max_tokens=100)
    outs = drain(sched, limit=50)
    assert g.seqs[0].finish_reason == "length"
    # 12 tokens fill 3 blocks; the 13th was sampled from them but has no slot to be run in.
    assert g.seqs[0].num_tokens == 13
    assert any(g in o.finished for o in outs)
    assert sched.block_manager.num_free_blocks == 3


def test_a_prompt_larger_than_the_cache_ends_with_an_error_and_others_run():
    sched = make(num_blocks=4)
    big, small = add(sched, 40, 0.0), add(sched, 3, 1.0, max_tokens=2)
    outs = drain(sched)
    assert big.seqs[0].finish_reason == "error" and "KV blocks" in (big.error or "")
    assert small.seqs[0].num_output_tokens == 2
    assert big in outs[0].finished


def test_artificial_preemption_is_bounded_and_work_completes():
    sched = make(artificial_preemption_prob=1.0, artificial_preemption_max=7,
                 preemption_mode="recompute")
    groups = [add(sched, 5, float(t), max_tokens=10) for t in range(3)]
    drain(sched)
    assert sched.counters["num_artificial_preemptions"] == 7
    assert all(g.seqs[0].num_output_tokens == 10 for g in groups)


def test_a_waiting_prompt_waits_at_the_watermark_then_takes_fresh_blocks_in_chunks():
    cfg = EngineConfig(model="unused", block_size=4, watermark=0.25, max_num_batched_tokens=6)
    sched = Scheduler(cfg, BlockManager(8, 0, 4, 0.25))  # 2 blocks held back from admission
    first = add(sched, 16, 0.0)  # 4 blocks
    second = add(sched, 9, 1.0)  # 3 blocks: 4 + 3 > 8 - 2, so it waits
    out = sched.schedule()
    assert [(s.group, s.num_new_tokens, s.do_sample) for s in out.scheduled] == \
        [(first, 6, False)]
    assert list(sched.waiting) == [second] and list(sched.running) == [first]
    assert sched.block_manager.table(first.seqs[0]) == [0, 1, 2, 3]
    assert sched.block_manager.device.ref_counts == [1, 1, 1, 1, 0, 0, 0, 0]
    sched.block_manager.free(first.seqs[0])
    first.seqs[0].finish_reason = "abort"
    sched.remove_running([first])
    out = sched.schedule()
    assert [(s.group, s.num_new_tokens, s.do_sample) for s in out.scheduled] == \
        [(second, 6, False)]
    assert sched.block_manager.table(second.seqs[0]) == [0, 1, 2]  # freed blocks, ascending
    assert out.num_batched_tokens == 6 and not sched.waiting


def test_remove_running_keeps_the_order_of_the_rest():
    sched = make()
    groups = [add(sched, 2, float(t)) for t in range(20)]
    sched.schedule()
    sched.remove_running([groups[3]])
    sched.remove_running(groups[10:19])  # more than a few: one pass
    assert list(sched.running) == groups[:3] + groups[4:10] + groups[19:]


def _schedules(fast: bool, mode: str, prob: float, caching: bool,
               spec: bool = False) -> list[tuple]:
    """Every step's schedule of one workload that preempts (a cache of 10 blocks for 7
    requests), keyed by request and sequence index; `spec`: with speculative proposals."""
    cfg = EngineConfig(model="unused", block_size=4, watermark=0.0, max_num_batched_tokens=16,
                       max_num_seqs=5, preemption_mode=mode, artificial_preemption_prob=prob,
                       artificial_preemption_seed=7)
    sched = Scheduler(cfg, BlockManager(10, 12, 4, 0.0, enable_prefix_caching=caching),
                      fast_paths=fast)
    for i, (prompt_len, max_tokens, n) in enumerate(
            [(5, 9, 1), (8, 6, 1), (3, 12, 2), (9, 7, 1), (4, 10, 1), (6, 8, 1), (2, 5, 1)]):
        add(sched, prompt_len, float(i), max_tokens=max_tokens, n=n)
    steps = []
    for out in drain(sched, spec=spec):
        steps.append(([(s.group.request_id, s.seq.index, s.num_new_tokens, s.do_sample,
                        s.spec_token_ids) for s in out.scheduled],
                      out.blocks_to_swap_in, out.blocks_to_swap_out,
                      out.blocks_to_copy, [g.request_id for g in out.finished],
                      out.num_preempted))
        sched.block_manager.check_invariants()
    return steps + [sorted(sched.counters.items())]


def test_the_fast_paths_schedule_as_the_general_path_under_preemption():
    for mode, prob, caching in [("recompute", 0.0, False), ("swap", 0.0, True),
                                ("recompute", 0.3, True), ("swap", 0.3, False)]:
        fast, general = (_schedules(f, mode, prob, caching) for f in (True, False))
        assert fast == general, (mode, prob, caching)
        counters = dict(fast[-1])
        assert counters["num_recompute_preemptions"] + counters["num_swap_outs"] > 0
        assert (counters["num_artificial_preemptions"] > 0) == (prob > 0)


def test_the_fast_paths_schedule_as_the_general_path_with_speculation():
    for mode, prob, caching in [("recompute", 0.0, False), ("swap", 0.0, True),
                                ("recompute", 0.3, True), ("swap", 0.3, False)]:
        fast, general = (_schedules(f, mode, prob, caching, spec=True) for f in (True, False))
        assert fast == general, (mode, prob, caching)
        speculated = [item for step in fast[:-1] for item in step[0] if item[4]]
        assert speculated and all(item[2] == 1 + len(item[4]) for item in speculated)
        counters = dict(fast[-1])
        preempted = counters["num_recompute_preemptions"] + counters["num_swap_outs"]
        assert (counters["num_artificial_preemptions"] > 0) == (prob > 0) and \
            (preempted > 0 or prob == 0), (mode, prob, caching)


def test_speculation_keeps_only_the_blocks_of_accepted_tokens():
    sched = make(max_num_batched_tokens=16)
    g = add(sched, 3, 0.0, max_tokens=20)
    seq = g.seqs[0]
    fake_step(sched)  # the prompt, and its first token: 4 tokens, 3 computed, one block
    out = fake_spec_step(sched)  # runs 4 tokens (3 .. 6), accepts 2 of 3 proposals
    assert [(s.num_new_tokens, s.spec_token_ids) for s in out.scheduled] == [(4, [1, 1, 2])]
    assert out.blocks_to_copy == [] and seq.num_tokens == 7 and seq.num_computed_tokens == 6
    assert len(sched.block_manager.table(seq)) == 2  # positions 0..5: blocks 0 and 1
    sched.block_manager.check_invariants()
    drain(sched, spec=True)
    assert seq.num_output_tokens == 20 and sched.block_manager.num_free_blocks == 64


def _names(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(s.group.request_id, s.num_new_tokens) for s in out.scheduled]


def test_prefills_first_runs_a_new_prompt_alone_then_with_the_decodes():
    sched = make(prefills_first=True, max_num_seqs=8)
    add(sched, 5, 0.0, max_tokens=6)
    add(sched, 3, 1.0, max_tokens=6)
    # Nothing runs yet: both prompts are admitted together, as without the option.
    assert _names(fake_step(sched)) == [("r0.0", 5), ("r1.0", 3)]
    assert _names(fake_step(sched)) == [("r0.0", 1), ("r1.0", 1)]
    add(sched, 7, 2.0, max_tokens=6)
    assert _names(fake_step(sched)) == [("r2.0", 7)]  # alone: the decodes wait this one step
    assert _names(fake_step(sched)) == [("r0.0", 1), ("r1.0", 1), ("r2.0", 1)]
    assert sched.counters["num_prefill_only_steps"] == 1


def test_without_prefills_first_a_new_prompt_joins_the_decode_step():
    sched = make(max_num_seqs=8)
    add(sched, 5, 0.0, max_tokens=6)
    fake_step(sched)
    add(sched, 7, 2.0, max_tokens=6)
    assert _names(fake_step(sched)) == [("r0.0", 1), ("r2.0", 7)]
    assert sched.counters["num_prefill_only_steps"] == 0


def test_prefills_first_never_runs_two_prefill_steps_in_a_row():
    """A prompt arriving every step: the decodes still run every other step, and every
    request gets all its tokens."""
    sched = make(prefills_first=True, max_num_seqs=64, num_blocks=256)
    first = add(sched, 4, 0.0, max_tokens=10)
    fake_step(sched)
    groups, alone = [first], []
    for t in range(1, 13):
        groups.append(add(sched, 4, float(t), max_tokens=10))
        out = fake_step(sched)
        alone.append(all(s.group is groups[-1] for s in out.scheduled))
    assert alone == [True, False] * 6
    drain(sched)
    assert [g.seqs[0].num_output_tokens for g in groups] == [10] * 13
    assert sched.counters["num_prefill_only_steps"] == 6


def test_prefills_first_does_not_run_a_prompt_ahead_of_a_more_urgent_decode():
    sched = make(prefills_first=True, scheduling_policy="priority", max_num_seqs=8)
    urgent = SequenceGroup("urgent", SamplingParams(max_tokens=6),
                           [Sequence(next(_ids), 0, [5] * 4, 4)], 0, arrival_time=0.0,
                           priority=0)
    sched.add(urgent)
    fake_step(sched)
    later = SequenceGroup("later", SamplingParams(max_tokens=6),
                          [Sequence(next(_ids), 0, [5] * 4, 4)], 0, arrival_time=1.0,
                          priority=5)
    sched.add(later)
    assert _names(fake_step(sched)) == [("urgent", 1), ("later", 4)]
    assert sched.counters["num_prefill_only_steps"] == 0
