"""Load: 10,000 small jobs through two real workers. Every job completes with the offline
oracle's output, and once the reply and idempotency TTLs pass nothing is left per job: the same
keys as the idle fleet's, holding what they held then, and no script cached per job. Redis's
used_memory, throughput and latency are printed, never asserted: used_memory also counts the
keyspace's hash tables and the allocator's pages, which Redis gives back on its own schedule
(slower on a loaded machine)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from producer import Client, Job
from tests.harness.fleet import RedisServer, WorkerFactory, as_expected, wait_for, wait_heartbeats
from tests.harness.models import corpus
from tests.harness.oracle import Oracle

NUM_JOBS = 10_000
BATCH = 500  # jobs per submit_many round trip
TTL_S = 10  # --result-ttl of the workers and the client's idempotency TTL
PARAMS = {"temperature": 0, "max_tokens": 4}
# What an idle fleet keeps: the model's three lane streams (high, default, low; the workers
# create each with its group), two heartbeats, the model's worker registry and the registry of
# models.
FLEET_KEYS = 7


def used_memory(server: RedisServer) -> int:
    return int(server.client().info("memory")["used_memory"])


def key_bytes(server: RedisServer) -> dict[str, int]:
    """MEMORY USAGE of every key (all of its elements counted)."""
    conn = server.client()
    return {key.decode(): int(conn.memory_usage(key, samples=0) or 0)
            for key in conn.scan_iter("*", count=1000)}


def lua_cache_bytes(server: RedisServer) -> int:
    return int(server.client().memory_stats()["lua.caches"])


def genq_keys(server: RedisServer) -> int:
    return sum(1 for _ in server.client().scan_iter("genq:*", count=1000))


def run_jobs(client: Client, prompts: list[str]) -> tuple[list[dict[str, Any]], float]:
    """Submit in pipelined batches from one thread while this one reads each batch's results as
    it ends, in a few round trips a batch: the reader keeps up with the workers however slow the
    machine, so no result expires (--result-ttl) before it is read. Returns the results and the
    wall time from first submit to last result."""
    batches: list[list[Job]] = []
    failure: list[BaseException] = []

    def submit() -> None:
        try:
            for i in range(0, len(prompts), BATCH):
                batches.append(client.submit_many(prompts[i:i + BATCH], PARAMS, model="tiny"))
        except BaseException as exc:  # surfaced by the reader below
            failure.append(exc)

    start = time.monotonic()
    submitter = threading.Thread(target=submit, name="submitter")
    submitter.start()
    results: list[dict[str, Any]] = []
    read = 0
    while len(results) < len(prompts):
        assert not failure, failure
        if read < len(batches):
            results.extend(client.results(batches[read], timeout=300))
            read += 1
        else:
            time.sleep(0.001)
    elapsed = time.monotonic() - start
    submitter.join(30)
    return results, elapsed


@pytest.mark.chaos
def test_10000_small_jobs_complete_and_redis_memory_returns_to_baseline(
        tmp_path: Path, tiny_llama: Path, offline: Oracle) -> None:
    server = RedisServer(tmp_path)
    server.start()
    factory = WorkerFactory(tmp_path)
    try:
        procs = [factory.start(server.url, tiny_llama, name, "--result-ttl", str(TTL_S))
                 for name in ("w1", "w2")]
        wait_heartbeats(server, procs)
        pool = corpus(50, seed=23)
        want = dict(zip(pool, offline(pool, [PARAMS] * len(pool)), strict=True))
        client = Client(server.url, idempotency_ttl=TTL_S)

        # Warm-up (scripts loaded, connections open), then the idle baseline once its keys expired.
        warm, _ = run_jobs(client, pool * 4)
        assert [as_expected(r) for r in warm] == [want[p] for p in pool * 4]
        wait_for(lambda: genq_keys(server) == FLEET_KEYS, timeout=TTL_S + 60, interval=0.2,
                 what="the warm-up's keys to expire")
        baseline = used_memory(server)
        baseline_keys, baseline_lua = key_bytes(server), lua_cache_bytes(server)

        prompts = [pool[i % len(pool)] for i in range(NUM_JOBS)]
        peak = [baseline]
        sampling = threading.Event()

        def sample() -> None:
            while not sampling.wait(0.25):
                peak[0] = max(peak[0], used_memory(server))

        sampler = threading.Thread(target=sample, name="memory-sampler")
        sampler.start()
        try:
            results, elapsed = run_jobs(client, prompts)
        finally:
            sampling.set()
            sampler.join(10)
        mismatches = [i for i, (p, r) in enumerate(zip(prompts, results, strict=True))
                      if r["type"] != "done" or as_expected(r) != want[p]]
        assert mismatches == []
        assert all(r["attempt"] == 1 for r in results)

        expired_at = time.monotonic()
        wait_for(lambda: genq_keys(server) == FLEET_KEYS, timeout=TTL_S + 60, interval=0.2,
                 what="the jobs' keys to expire")
        # The idle fleet's keys, each no larger than before the run (a byte per job kept in any
        # of them would be 10 KB), and no script cached per job.
        after_keys = key_bytes(server)
        assert after_keys.keys() == baseline_keys.keys()
        assert sum(after_keys.values()) <= sum(baseline_keys.values()) + 512, after_keys
        assert lua_cache_bytes(server) == baseline_lua
        after = used_memory(server)
        latencies = sorted(r["timing"]["queued_s"] + r["timing"]["generate_s"] for r in results)
        service = sorted(r["timing"]["generate_s"] for r in results)

        def pct(values: list[float], q: float) -> float:
            return values[min(len(values) - 1, int(q * len(values)))]

        tokens = sum(r["usage"]["completion_tokens"] for r in results)
        print(f"\nload: {NUM_JOBS} jobs ({tokens} tokens) through 2 workers in {elapsed:.1f} s: "
              f"{NUM_JOBS / elapsed:.0f} jobs/s, {tokens / elapsed:.0f} tokens/s; latency "
              f"submit -> done p50 {pct(latencies, 0.5) * 1000:.0f} ms, p99 "
              f"{pct(latencies, 0.99) * 1000:.0f} ms (all submitted at once); in the worker "
              f"p50 {pct(service, 0.5) * 1000:.0f} ms, p99 {pct(service, 0.99) * 1000:.0f} ms")
        print(f"load: used_memory baseline {baseline} B, peak {peak[0]} B, {after} B "
              f"({after / baseline - 1:+.1%}) {time.monotonic() - expired_at:.1f} s after the "
              f"last result (TTL {TTL_S} s)")
        assert all(p.alive() for p in procs)
    finally:
        factory.stop_all()
        server.kill()
