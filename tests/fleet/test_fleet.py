"""The fleet end to end: real redis-server, real worker processes, outputs checked against the
offline LLM.generate oracle on the same tiny model."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from producer import Client
from producer.protocol import Keys, decode_heartbeat
from tests.harness.fleet import (
    Expected,
    RedisServer,
    WorkerFactory,
    WorkerProcess,
    as_expected,
    pending_of,
    reply_events,
    stream_all,
    streamed_tokens,
    wait_for,
    wait_heartbeats,
)
from tests.harness.models import corpus

Oracle = Callable[[list[str], Any], list[Expected]]
JOBS_KEY = Keys().jobs("tiny")
GROUP = "workers"


def mixed_params(i: int, max_tokens: int, **extra: Any) -> dict[str, Any]:
    if i % 2 == 0:
        return {"temperature": 0, "max_tokens": max_tokens, **extra}
    return {"temperature": 0.9, "top_k": 50, "seed": 1000 + i, "max_tokens": max_tokens, **extra}


def expected_for(offline: Oracle, prompts: list[str],
                 params: list[dict[str, Any]]) -> list[Expected]:
    return offline(prompts, params)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory,
         long_llama: Path) -> Iterator[tuple[RedisServer, list[WorkerProcess]]]:
    """Two workers shared by the tests that neither kill nor stop a worker (the Redis restart
    test runs last of them). They serve tiny_llama with room for long generations."""
    server = RedisServer(tmp_path_factory.mktemp("pair-redis"))
    server.start()
    factory = WorkerFactory(tmp_path_factory.mktemp("pair-workers"))
    procs = [factory.start(server.url, long_llama, name, "--max-num-seqs", "16",
                           "--reclaim-interval", "0.1") for name in ("w1", "w2")]
    wait_heartbeats(server, procs)
    yield server, procs
    factory.stop_all()
    server.kill()


def test_64_jobs_through_two_workers_equal_offline_outputs(
        pair: tuple[RedisServer, list[WorkerProcess]], offline: Oracle) -> None:
    redis_server, _procs = pair
    prompts = corpus(64, seed=7)
    params = [mixed_params(i, 12) for i in range(64)]
    for i in range(1, 64, 8):  # some seeded n=2, some with a stop string
        params[i] = {**params[i], "n": 2}
    for i in range(2, 64, 8):
        params[i] = {**params[i], "stop": ["the"]}
    client = Client(redis_server.url)
    jobs = [client.submit(p, q, model="tiny") for p, q in zip(prompts, params, strict=True)]
    results = [job.result(timeout=300) for job in jobs]
    expected = expected_for(offline, prompts, params)
    mismatches = [(i, params[i], r["attempt"], as_expected(r), want)
                  for i, (r, want) in enumerate(zip(results, expected, strict=True))
                  if as_expected(r) != want]
    assert mismatches == []
    served_by = {e["worker"] for job in jobs for e in reply_events(redis_server, job.id)
                 if e["type"] == "started"}
    assert served_by == {"w1", "w2"}
    assert all(r["attempt"] == 1 for r in results)


@pytest.mark.parametrize("intervals", [("1", "1"), ("4", "3")],
                         ids=["every-token", "stream-intervals-4-then-3"])
def test_kill_9_mid_generation_every_job_completes_once_on_the_survivor(
        redis_server: RedisServer, workers: WorkerFactory, tiny_llama: Path, offline: Oracle,
        intervals: tuple[str, str]) -> None:
    """With stream intervals that differ, the survivor's replay chunks straddle what the victim
    delivered: the client still sees each position once."""
    victim = workers.start(redis_server.url, tiny_llama, "w1", "--max-num-seqs", "32",
                           "--result-ttl", "600", "--stream-interval", intervals[0])
    survivor = workers.start(redis_server.url, tiny_llama, "w2", "--max-num-seqs", "8",
                             "--result-ttl", "600", "--stream-interval", intervals[1])
    wait_heartbeats(redis_server, [victim, survivor])
    prompts = corpus(30, seed=11)
    # 300 tokens each: none of w1's jobs can finish between "20+ held" and the kill.
    params = [mixed_params(i, 300, ignore_eos=True) for i in range(30)]
    client = Client(redis_server.url)
    jobs = [client.submit(p, q, model="tiny") for p, q in zip(prompts, params, strict=True)]
    seen, threads = stream_all(jobs, timeout=300)
    wait_for(lambda: pending_of(redis_server, "w1") >= 20
             and any(e["type"] == "tokens" for evs in seen.values() for e in evs),
             timeout=60, interval=0.01, what="w1 holding 20+ jobs mid-generation")
    # What w1 holds at the kill: its pending entries (its last events may never reach Redis:
    # the writer goes down with it)
    pending = redis_server.client().xpending_range(JOBS_KEY, GROUP, "-", "+", 100,
                                                   consumername="w1")
    victim.kill9()
    on_w1 = {p["message_id"].decode() for p in pending}
    held = {job.id for job in jobs if job.entry_id in on_w1}
    for t in threads:
        t.join(300)
    expected = expected_for(offline, prompts, params)
    for job, want in zip(jobs, expected, strict=True):
        events = seen[job.id]
        positions, tokens = streamed_tokens(events)
        assert positions == list(range(300)), job.id  # each position once, in order
        assert tokens == want[0][0]
        assert as_expected(events[-1]) == want
        raw = reply_events(redis_server, job.id)
        assert sum(e["type"] in ("done", "error") for e in raw) == 1
    finals = {job.id: seen[job.id][-1] for job in jobs}
    moved = [jid for jid in held if finals[jid]["attempt"] == 2]
    assert len(held) >= 20 and len(moved) >= 20
    assert survivor.alive()


def test_a_live_worker_with_a_long_generation_is_never_robbed(
        pair: tuple[RedisServer, list[WorkerProcess]]) -> None:
    redis_server, _procs = pair  # heartbeat TTL 2 s, the other one reclaims every 0.1 s
    # 3000 decode steps: several times the 2 s TTL even on a fast machine (256 blocks of 16).
    job = Client(redis_server.url).submit("the quick brown fox", {
        "temperature": 0, "max_tokens": 3000, "ignore_eos": True}, model="tiny")
    max_idle_ms = 0

    def finished() -> bool:
        nonlocal max_idle_ms
        pending = redis_server.client().xpending_range(JOBS_KEY, GROUP, "-", "+", 10)
        max_idle_ms = max([max_idle_ms] + [int(p["time_since_delivered"]) for p in pending])
        return bool(redis_server.client().exists(Keys().reply(job.id))) and not pending

    wait_for(finished, timeout=120, interval=0.02, what="the long job to finish")
    result = job.result(timeout=10)
    assert max_idle_ms > 2000  # the entry sat idle past the heartbeat TTL...
    started = [e for e in reply_events(redis_server, job.id) if e["type"] == "started"]
    assert len(started) == 1 and result["attempt"] == 1  # ...and was never taken away
    assert [len(o["token_ids"]) for o in result["outputs"]] == [3000]


def test_redis_restart_mid_run_workers_reconnect_and_all_jobs_complete(
        pair: tuple[RedisServer, list[WorkerProcess]], offline: Oracle) -> None:
    redis_server, procs = pair
    prompts = corpus(16, seed=5)
    params = [mixed_params(i, 80, ignore_eos=True) for i in range(16)]
    client = Client(redis_server.url)
    jobs = [client.submit(p, q, model="tiny") for p, q in zip(prompts, params, strict=True)]
    seen, threads = stream_all(jobs, timeout=300)
    wait_for(lambda: sum(e["type"] == "tokens" for evs in seen.values() for e in evs) >= 10,
             timeout=60, interval=0.01, what="tokens before the restart")
    redis_server.restart(down_s=1.0)
    for t in threads:
        t.join(300)
    expected = expected_for(offline, prompts, params)
    for job, want in zip(jobs, expected, strict=True):
        positions, tokens = streamed_tokens(seen[job.id])
        assert positions == list(range(80))
        assert tokens == want[0][0]
        assert as_expected(seen[job.id][-1]) == want
    assert all(p.alive() for p in procs)


def test_sigterm_hands_unfinished_jobs_back_at_once(
        redis_server: RedisServer, workers: WorkerFactory, tiny_llama: Path,
        offline: Oracle) -> None:
    first = workers.start(redis_server.url, tiny_llama, "w1", "--drain-timeout", "0")
    wait_heartbeats(redis_server, [first])
    prompts = corpus(3, seed=3)
    params = [{"temperature": 0, "max_tokens": 400, "ignore_eos": True}] * 3
    client = Client(redis_server.url)
    jobs = [client.submit(p, q, model="tiny") for p, q in zip(prompts, params, strict=True)]
    wait_for(lambda: all(any(e["type"] == "tokens" for e in reply_events(redis_server, j.id))
                         for j in jobs), timeout=60, interval=0.02, what="tokens of all jobs")
    assert first.terminate() == 0
    conn = redis_server.client()
    assert conn.xpending(JOBS_KEY, GROUP)["pending"] == 0  # nothing waits for a heartbeat TTL
    assert conn.xlen(JOBS_KEY) == 3  # handed back as new entries
    assert not conn.exists(Keys().worker("tiny", "w1"))
    # A hand-back is no end: the jobs' idempotency keys carry no ended mark (ResultExpired)
    assert [conn.get(Keys().idem(j.id)) for j in jobs] == [b"1"] * 3
    second = workers.start(redis_server.url, tiny_llama, "w2")
    results = [job.result(timeout=300) for job in jobs]
    assert [as_expected(r) for r in results] == expected_for(offline, prompts, params)
    assert [r["attempt"] for r in results] == [2, 2, 2]
    assert [conn.get(Keys().idem(j.id)) for j in jobs] == [b"ended"] * 3
    assert second.alive()


def test_a_restarted_worker_rereads_its_own_pending_jobs_first(
        redis_server: RedisServer, workers: WorkerFactory, tiny_llama: Path,
        offline: Oracle) -> None:
    first = workers.start(redis_server.url, tiny_llama, "w1", "--heartbeat-ttl", "60")
    wait_heartbeats(redis_server, [first])
    prompts = corpus(4, seed=9)
    params = [mixed_params(i, 400, ignore_eos=True) for i in range(4)]
    client = Client(redis_server.url)
    jobs = [client.submit(p, q, model="tiny") for p, q in zip(prompts, params, strict=True)]
    wait_for(lambda: pending_of(redis_server, "w1") == 4, timeout=60, what="w1 holding 4 jobs")
    first.kill9()
    # Its heartbeat lives on for a minute: only the restarted worker itself may take the jobs.
    again = workers.start(redis_server.url, tiny_llama, "w1", "--heartbeat-ttl", "60")
    results = [job.result(timeout=300) for job in jobs]
    assert [as_expected(r) for r in results] == expected_for(offline, prompts, params)
    assert [r["attempt"] for r in results] == [2, 2, 2, 2]
    assert again.alive()


def test_a_paused_worker_whose_jobs_were_reclaimed_never_writes_to_them_again(
        redis_server: RedisServer, workers: WorkerFactory, tiny_llama: Path,
        offline: Oracle) -> None:
    paused = workers.start(redis_server.url, tiny_llama, "w1", "--max-num-seqs", "8")
    other = workers.start(redis_server.url, tiny_llama, "w2", "--max-num-seqs", "8")
    wait_heartbeats(redis_server, [paused, other])
    prompts = corpus(12, seed=13)
    params = [mixed_params(i, 400, ignore_eos=True) for i in range(12)]
    client = Client(redis_server.url)
    jobs = [client.submit(p, q, model="tiny") for p, q in zip(prompts, params, strict=True)]
    wait_for(lambda: pending_of(redis_server, "w1") >= 3, timeout=60, interval=0.01,
             what="w1 holding jobs")
    os.kill(paused.pid, signal.SIGSTOP)
    try:
        held = wait_for(lambda: [j for j in jobs if any(
            e["type"] == "started" and e["worker"] == "w1" for e in reply_events(redis_server,
                                                                               j.id))],
            what="w1's jobs")
        # While w1 sleeps only w2 can change w1's pending list: empty means all were claimed.
        wait_for(lambda: pending_of(redis_server, "w1") == 0, timeout=60,
                 what="w2 reclaiming w1's jobs")
    finally:
        os.kill(paused.pid, signal.SIGCONT)
    results = [job.result(timeout=300) for job in jobs]
    assert [as_expected(r) for r in results] == expected_for(offline, prompts, params)
    time.sleep(1.0)  # give the woken worker every chance to write what it still had
    for job in held:
        raw = reply_events(redis_server, job.id)
        attempts = [e["attempt"] for e in raw]
        assert attempts == sorted(attempts), job.id  # nothing of attempt 1 after attempt 2
        assert sum(e["type"] in ("done", "error") for e in raw) == 1
        assert raw[-1]["type"] == "done" and raw[-1]["attempt"] == 2
    assert paused.alive()
    conn = redis_server.client()
    hb = wait_for(lambda: (v := conn.get(Keys().worker("tiny", "w1"))) and decode_heartbeat(v),
                  what="w1's heartbeat after waking")
    assert hb["lost"] >= 1
