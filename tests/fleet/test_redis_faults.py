"""Redis misbehaving under a worker: its job stream deleted or flushed, out of memory, down when
the worker is told to stop. Nothing is lost, no worker dies, and stopping stays bounded."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from producer import Client
from producer.protocol import Keys
from tests.harness.fleet import (
    Expected,
    RedisServer,
    WorkerFactory,
    WorkerProcess,
    as_expected,
    reply_events,
    serving_worker,
    stream_all,
    streamed_tokens,
    wait_for,
    wait_heartbeats,
)
from tests.harness.models import corpus
from tests.harness.oracle import OracleOf

Oracle = Callable[[list[str], Any], list[Expected]]
GREEDY = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def worker(server: RedisServer, tiny_llama: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    """One worker through the faults it must survive, one test each (its stream deleted and
    flushed, its Redis demoted to a replica, out of memory): each test leaves the server a
    primary with room, and the worker must serve the next test's jobs."""
    yield from serving_worker(server, tiny_llama, tmp_path_factory.mktemp("workers"), "w1")


def test_an_idle_worker_survives_its_job_stream_deleted_and_redis_flushed(
        server: RedisServer, worker: WorkerProcess, offline: Oracle) -> None:
    """A blocked XREADGROUP answers UNBLOCKED when its stream key goes (DEL, FLUSHALL): the
    worker re-creates the stream and its group, and serves the next job."""
    client = Client(server.url)
    prompts = corpus(3, seed=11)
    want = offline(prompts, GREEDY)
    assert as_expected(client.submit(prompts[0], GREEDY, model="tiny").result(60)) == want[0]
    conn = server.client()
    for k, wipe in enumerate((lambda: conn.delete(Keys().jobs("tiny")), conn.flushall), start=1):
        time.sleep(0.3)  # the worker is idle again, blocked in its read
        wipe()
        time.sleep(0.3)
        assert worker.alive(), worker.output()[-3000:]
        result = client.submit(prompts[k], GREEDY, model="tiny").result(60)
        assert as_expected(result) == want[k]
    assert worker.alive()
    assert "re-creating it" in worker.output()


def test_a_worker_whose_redis_turns_replica_waits_for_a_primary_and_serves_again(
        server: RedisServer, worker: WorkerProcess, offline: Oracle, tmp_path: Path) -> None:
    """A failover demotes the worker's Redis to a replica (REPLICAOF: the blocked read is
    UNBLOCKED, then every write answers READONLY): the worker retries as for a lost
    connection instead of dying, and serves again once the server is a primary."""
    (tmp_path / "primary").mkdir()
    primary = RedisServer(tmp_path / "primary")
    primary.start()
    try:
        conn = server.client()
        conn.execute_command("REPLICAOF", "127.0.0.1", str(primary.port))
        wait_for(lambda: "reading jobs failed (You can't write against a read only replica" in
                 worker.output(), timeout=30, what="a retried READONLY read")
        time.sleep(1.0)
        assert worker.alive(), worker.output()[-3000:]
        conn.execute_command("REPLICAOF", "NO", "ONE")  # (it took the primary's empty data)
        prompt = corpus(1, seed=14)
        result = Client(server.url).submit(prompt[0], GREEDY, model="tiny").result(60)
        assert as_expected(result) == offline(prompt, GREEDY)[0]
        assert worker.alive()
    finally:
        primary.kill()


def test_writes_refused_while_redis_is_out_of_memory_land_once_it_has_room(
        server: RedisServer, worker: WorkerProcess, offline: Oracle) -> None:
    """maxmemory with noeviction refuses every XADD: the writer holds the step's writes and
    retries (dropping them left a gap in the stream and the job unacked, run again)."""
    prompts = corpus(4, seed=12)
    params = {"temperature": 0, "max_tokens": 300, "ignore_eos": True}
    client = Client(server.url)
    jobs = [client.submit(p, params, model="tiny") for p in prompts]
    seen, threads = stream_all(jobs, timeout=300)
    wait_for(lambda: all(any(e["type"] == "tokens" for e in seen[j.id]) for j in jobs),
             timeout=60, interval=0.01, what="tokens of every job")
    conn = server.client()
    conn.config_set("maxmemory", 1)  # (noeviction is the default policy)
    time.sleep(1.5)
    lengths = [conn.xlen(Keys().reply(j.id)) for j in jobs]
    time.sleep(0.5)
    assert [conn.xlen(Keys().reply(j.id)) for j in jobs] == lengths  # nothing lands
    conn.config_set("maxmemory", 0)
    for t in threads:
        t.join(300)
    want = offline(prompts, params)
    for job, expected in zip(jobs, want, strict=True):
        positions, tokens = streamed_tokens(seen[job.id])
        assert positions == list(range(300))  # every token once, no gap
        assert tokens == expected[0][0]
        assert as_expected(seen[job.id][-1]) == expected
        assert [e["type"] for e in reply_events(server, job.id)].count("done") == 1
    assert worker.alive()
    assert "Redis is out of memory" in worker.output()


def test_sigterm_while_redis_is_down_stops_within_the_drain_and_loses_nothing(
        redis_server: RedisServer, workers: WorkerFactory, long_llama: Path,
        oracle_of: OracleOf) -> None:
    """With Redis down the writer falls behind and the loop waits for it; a stop request ends
    that wait: the worker drains for --drain-timeout, gives the final flush its --flush-timeout
    and exits. Its unacked jobs are still pending under its name: its next run re-reads them."""

    first = workers.start(redis_server.url, long_llama, "w1", "--drain-timeout", "1",
                          "--flush-timeout", "2")
    wait_heartbeats(redis_server, [first])
    prompts = corpus(3, seed=13)
    params = {"temperature": 0, "max_tokens": 1500, "ignore_eos": True}
    client = Client(redis_server.url)
    jobs = [client.submit(p, params, model="tiny") for p in prompts]
    wait_for(lambda: all(any(e["type"] == "tokens" for e in reply_events(redis_server, j.id))
                         for j in jobs), timeout=60, interval=0.02, what="tokens of all jobs")
    redis_server.kill()
    time.sleep(1.0)  # the writer retries; the loop waits for it, the jobs still running
    # It exits cleanly while Redis is still down: the drain and the final flush bound its wait,
    # not Redis coming back (the cap only bounds a failure; Redis starts again only after).
    assert first.terminate(timeout=120) == 0
    assert "Redis did not take the last writes within 2 s" in first.output()
    redis_server.start()
    again = workers.start(redis_server.url, long_llama, "w1")
    results = [job.result(timeout=300) for job in jobs]
    want = oracle_of(long_llama)(prompts, params)
    assert [r["outputs"][0]["token_ids"] for r in results] == [seqs[0][0] for seqs in want]
    assert [len(r["outputs"][0]["token_ids"]) for r in results] == [1500] * 3
    assert [r["attempt"] for r in results] == [2, 2, 2]
    assert again.alive()
