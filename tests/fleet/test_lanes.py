"""Priority lanes in Redis (producer/lanes.py): a job waits in its model's lane for its priority,
and a worker fills its free capacity from the most urgent lane first, so an urgent job overtakes
a backlog that no worker has read yet. Reclaim, dead letters and cancels work in every lane."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
from redis.crc import key_slot

from engine.config import EngineConfig
from engine.engine import Engine
from producer import Client
from producer.lanes import job_stream, lane_key, lane_keys
from producer.protocol import JobSpec, Keys
from tests.harness.fleet import (
    Expected,
    RedisServer,
    WorkerFactory,
    as_expected,
    reply_events,
    wait_for,
    wait_heartbeats,
)
from tests.harness.models import corpus
from tests.harness.oracle import OracleOf
from worker.config import WorkerConfig
from worker.loop import Worker

Oracle = Callable[[list[str], Any], list[Expected]]
KEYS = Keys()
HIGH, DEFAULT, LOW = lane_key(KEYS, "tiny", 1), KEYS.jobs("tiny"), lane_key(KEYS, "tiny", 2)


def test_each_priority_waits_in_its_lane_and_the_lanes_share_the_models_slot(
        redis_server: RedisServer) -> None:
    assert lane_keys(KEYS, "tiny") == ["genq:jobs:{tiny}", "genq:jobs:{tiny}:high",
                                       "genq:jobs:{tiny}:low"]
    assert len({key_slot(k.encode()) for k in [*lane_keys(KEYS, "tiny"), KEYS.dead("tiny"),
                                               KEYS.fence("tiny", "w")]}) == 1
    assert job_stream(KEYS, JobSpec(id="a", model="tiny", priority=-1)) == HIGH
    with Client(redis_server.url) as client:
        for priority in (-5, 0, 0, 3, 10):
            client.submit("x", {"max_tokens": 1}, model="tiny", priority=priority)
        conn = client.redis
        assert [conn.xlen(k) for k in (HIGH, DEFAULT, LOW)] == [1, 2, 2]


def test_an_urgent_job_overtakes_a_backlog_of_200_queued_jobs(
        redis_server: RedisServer, tiny_llama: Path, offline: Oracle) -> None:
    """A worker running 4 jobs at a time, with 200 priority-10 jobs queued: a priority-0 job
    starts within two rounds of its running jobs (2 x max_tokens steps: the round that ends,
    and one more if a read took priority-10 jobs while it was being enqueued). In one stream
    it would wait for every job queued ahead of it: more than two rounds (asserted), however
    fast the worker runs."""
    max_tokens = 4
    params = {"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True}
    engine = Engine(EngineConfig(model=str(tiny_llama), device="cpu", max_num_seqs=4,
                                 num_gpu_blocks_override=256, swap_space=0.01, num_threads=1,
                                 output_kind="delta"))
    worker = Worker(engine, WorkerConfig(redis_url=redis_server.url, served_model_name="tiny",
                                         name="lanes", heartbeat_ttl=2.0, result_ttl=60,
                                         drain_timeout=10.0, block_ms=100, writer="thread"))
    admitted_at: dict[str, int] = {}  # engine request id (entry ref) -> the worker's step count
    add_request = engine.add_request

    def recording_add(request_id: str, *args: Any) -> None:
        admitted_at[request_id] = worker.counters["steps"]
        add_request(request_id, *args)

    engine.add_request = recording_add  # type: ignore[method-assign]
    thread = threading.Thread(target=worker.run, daemon=True)
    with Client(redis_server.url) as client:
        backlog = client.submit_many(corpus(200, seed=5), params, model="tiny", priority=10)
        thread.start()
        try:
            wait_for(lambda: worker.counters["admitted"] >= 8, what="the worker busy")
            steps_before = worker.counters["steps"]
            admitted_before = worker.counters["admitted"]
            prompt = corpus(1, seed=6)[0]
            urgent = client.submit(prompt, params, model="tiny")
            result = urgent.result(timeout=240)
        finally:
            worker.request_stop()
            thread.join(60)
    assert as_expected(result) == offline([prompt], params)[0]
    urgent_at = admitted_at[str(urgent.entry_id)]  # (the default lane's ref: its entry id)
    assert urgent_at - steps_before <= 2 * max_tokens
    # More than two rounds were queued when it was submitted (in one stream it would have waited
    # for all of them), and it went ahead of all but the at most two rounds a read took meanwhile.
    rounds = 2 * engine.config.max_num_seqs
    assert len(backlog) - admitted_before > rounds
    ahead = sum(1 for step in admitted_at.values() if step < urgent_at)
    assert ahead <= admitted_before + rounds


def test_a_high_lane_job_of_a_killed_worker_is_reclaimed_and_completes(
        redis_server: RedisServer, workers: WorkerFactory, long_llama: Path,
        oracle_of: OracleOf) -> None:
    w1 = workers.start(redis_server.url, long_llama, "w1")
    wait_heartbeats(redis_server, [w1])
    prompt = corpus(1, seed=23)[0]
    params = {"temperature": 0, "max_tokens": 1000, "ignore_eos": True}
    job = Client(redis_server.url).submit(prompt, params, model="tiny", priority=-2)
    wait_for(lambda: any(e["type"] == "tokens" for e in reply_events(redis_server, job.id)),
             timeout=60, interval=0.01, what="the job's first tokens")
    w1.kill9()
    w2 = workers.start(redis_server.url, long_llama, "w2")
    result = job.result(timeout=300)
    assert result["outputs"][0]["token_ids"] == oracle_of(long_llama)([prompt], params)[0][0][0]
    started = [e for e in reply_events(redis_server, job.id) if e["type"] == "started"]
    assert [(e["attempt"], e["worker"]) for e in started] == [(1, "w1"), (2, "w2")]
    conn = redis_server.client()
    assert conn.xlen(HIGH) == 0 and conn.xpending(HIGH, "workers")["pending"] == 0
    assert w2.alive()


def test_a_bad_entry_in_the_low_lane_is_dead_lettered_and_a_queued_low_job_is_cancelled(
        redis_server: RedisServer, workers: WorkerFactory, tiny_llama: Path) -> None:
    conn = redis_server.client()
    conn.xgroup_create(LOW, "workers", id="0", mkstream=True)
    bad = conn.xadd(LOW, {"v": b"2", "job": msgpack.packb({"id": "a b"})}).decode()
    with Client(redis_server.url) as client:
        job = client.submit("hello", {"max_tokens": 4}, model="tiny", priority=7)
        client.cancel(job.id)
        w = workers.start(redis_server.url, tiny_llama, "w1")
        wait_heartbeats(redis_server, [w])
        events = wait_for(lambda: [e for e in reply_events(redis_server, job.id)
                                   if e["type"] == "error"], what="the cancel's error event")
    assert [(e["code"], e["attempt"]) for e in events] == [("cancelled", 1)]
    [(_, letter)] = wait_for(lambda: conn.xrange(KEYS.dead("tiny")), what="the dead letter")
    assert (letter[b"code"], letter[b"entry"], letter[b"worker"]) == (b"bad_id", bad.encode(),
                                                                     b"w1")
    wait_for(lambda: conn.xlen(LOW) == 0, what="the low lane emptied")
    assert conn.xpending(LOW, "workers")["pending"] == 0
