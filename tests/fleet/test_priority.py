"""Job priorities through the fleet: Client.submit(priority=) reaches the worker's engine, which
runs the jobs it holds in (priority, arrival) order (--scheduling-policy priority, the default)."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from producer import Client
from producer.events import decode_event
from producer.protocol import REPLY_FIELD, Keys, ProtocolError
from tests.harness.fleet import Expected, RedisServer, WorkerFactory, as_expected, wait_heartbeats

Oracle = Callable[[list[str], Any], list[Expected]]
PARAMS = {"temperature": 0, "max_tokens": 16, "ignore_eos": True}


def first_token_at(server: RedisServer, job_id: str) -> tuple[int, int]:
    """The stream id of the job's first tokens event: when its first token was written."""
    for entry_id, fields in server.client().xrange(Keys().reply(job_id, "tiny")):
        if decode_event(fields[REPLY_FIELD.encode()])["type"] == "tokens":
            ms, seq = entry_id.decode().split("-")
            return int(ms), int(seq)
    raise AssertionError(f"job {job_id} wrote no tokens")


def test_a_worker_runs_the_jobs_it_holds_by_priority(redis_server: RedisServer,
                                                     workers: WorkerFactory, tiny_llama: Path,
                                                     offline: Oracle) -> None:
    # 100-token prompts take 7 of the 8 blocks of 16: the jobs run one at a time, and the
    # worker reads all 8 queued jobs at once (8 free blocks).
    rng = random.Random(60)
    prompts = [[rng.randrange(3, 400) for _ in range(100)] for _ in range(8)]
    priorities = [5, 0, 9, 0, -3, 5, 2, 9]
    with Client(redis_server.url) as client:
        jobs = [client.submit(p, PARAMS, model="tiny", priority=k)
                for p, k in zip(prompts, priorities)]
        worker = workers.start(redis_server.url, tiny_llama, "prio", "--max-num-seqs", "8",
                               "--num-gpu-blocks-override", "8")
        wait_heartbeats(redis_server, [worker])
        results = [as_expected(job.result(timeout=240)) for job in jobs]
    assert results == offline(prompts, PARAMS)
    started = sorted(range(8), key=lambda i: first_token_at(redis_server, jobs[i].id))
    assert started == [4, 1, 3, 6, 0, 5, 2, 7]  # (priority, submit order)


def test_a_priority_out_of_range_is_refused_before_it_is_queued(
        redis_server: RedisServer) -> None:
    with Client(redis_server.url) as client:
        with pytest.raises(ProtocolError, match=r"'priority' must be int in \[-2\*\*31, 2\*\*31\)"):
            client.submit("x", PARAMS, model="tiny", priority=2**31)
        assert client.redis.xlen(Keys().jobs("tiny")) == 0
