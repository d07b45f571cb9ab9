"""A worker whose job is delivered again, or taken from it without a word: it runs the attempt
it owns, and stops running the ones it no longer owns, even those that write nothing."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest

from producer import Client
from producer.protocol import Keys, decode_heartbeat
from tests.harness.fleet import (
    RedisServer,
    WorkerFactory,
    pending_of,
    reply_events,
    wait_for,
    wait_heartbeats,
)
from tests.harness.models import corpus
from tests.harness.oracle import OracleOf

JOBS_KEY = Keys().jobs("tiny")


@pytest.fixture(scope="module")
def long_offline(long_llama: Path, oracle_of: OracleOf) -> Any:
    """The offline oracle's token ids of one prompt's first sequence, on long_llama."""
    oracle = oracle_of(long_llama)
    return lambda prompt, params: oracle([prompt], params)[0][0][0]


def heartbeat_of(server: RedisServer, name: str) -> dict[str, Any]:
    value = server.client().get(Keys().worker("tiny", name))
    return decode_heartbeat(value) if value is not None else {}


def test_an_entry_redelivered_to_the_worker_running_it_restarts_instead_of_failing(
        redis_server: RedisServer, workers: WorkerFactory, long_llama: Path,
        long_offline: Any) -> None:
    """XGROUP SETID back to 0 (what a Redis restarted from a snapshot older than the read looks
    like) hands the running entry to the same worker again: the engine already has that
    request id. The new delivery is the one owned: the old run stops, the new one completes;
    it was a job error ('bad_prompt', "already in the engine")."""
    worker = workers.start(redis_server.url, long_llama, "w1")
    wait_heartbeats(redis_server, [worker])
    prompt = corpus(1, seed=21)[0]
    params = {"temperature": 0, "max_tokens": 2000, "ignore_eos": True}
    job = Client(redis_server.url).submit(prompt, params, model="tiny")
    wait_for(lambda: any(e["type"] == "tokens" for e in reply_events(redis_server, job.id)),
             timeout=60, interval=0.01, what="the job's first tokens")
    redis_server.client().xgroup_setid(JOBS_KEY, "workers", "0")
    result = job.result(timeout=300)
    assert result["outputs"][0]["token_ids"] == long_offline(prompt, params)
    assert "delivered to this worker again" in worker.output()
    raw = reply_events(redis_server, job.id)
    assert [e["type"] for e in raw].count("started") == 2
    assert [e["type"] for e in raw if e["type"] in ("done", "error")] == ["done"]
    assert worker.alive()


def test_a_job_that_writes_nothing_is_stopped_once_another_worker_claimed_it(
        redis_server: RedisServer, workers: WorkerFactory, long_llama: Path,
        long_offline: Any) -> None:
    """A non-streaming job writes nothing between started and done, so no write of it is ever
    fenced: the paused worker learns of the loss from its own pending list (every reclaim
    interval) and stops it, rather than running thousands of tokens for no one."""
    paused = workers.start(redis_server.url, long_llama, "w1")
    wait_heartbeats(redis_server, [paused])
    prompt = corpus(1, seed=22)[0]
    params = {"temperature": 0, "max_tokens": 3500, "ignore_eos": True}
    job = Client(redis_server.url).submit(prompt, params, model="tiny", stream=False)
    wait_for(lambda: heartbeat_of(redis_server, "w1").get("running") == 1, timeout=60,
             interval=0.02, what="w1 running the job")
    os.kill(paused.pid, signal.SIGSTOP)
    try:
        other = workers.start(redis_server.url, long_llama, "w2")
        wait_for(lambda: pending_of(redis_server, "w2") == 1, timeout=120,
                 what="w2 claiming w1's job once w1's heartbeat is gone")
    finally:
        os.kill(paused.pid, signal.SIGCONT)
    wait_for(lambda: (h := heartbeat_of(redis_server, "w1")) and h["lost"] == 1
             and h["running"] == 0, timeout=10, interval=0.02, what="w1 dropping the job it lost")
    assert "not pending for this worker any more" in paused.output()
    result = job.result(timeout=300)
    assert result["attempt"] == 2
    started = [e for e in reply_events(redis_server, job.id) if e["type"] == "started"]
    assert [(e["attempt"], e["worker"]) for e in started] == [(1, "w1"), (2, "w2")]
    assert result["outputs"][0]["token_ids"] == long_offline(prompt, params)
    assert paused.alive() and other.alive()
