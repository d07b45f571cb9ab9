"""A result read after its reply stream expired: the worker marks the job's idempotency key
'ended' with the terminal event, so a client that finds no reply stream but that mark raises
ResultExpired at once instead of waiting out its timeout. A job that has not run yet is still
waited for."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from producer import AsyncClient, Client, ResultExpired
from producer.protocol import Keys
from tests.harness.fleet import RedisServer, WorkerProcess, serving_worker, wait_for

KEYS = Keys()
PARAMS = {"temperature": 0, "max_tokens": 2}


@pytest.fixture(scope="module")
def worker(server: RedisServer, tiny_llama: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    yield from serving_worker(server, tiny_llama, tmp_path_factory.mktemp("workers"), "brief",
                              "--result-ttl", "1")


def expired(server: RedisServer, job_id: str) -> None:
    conn = server.client()
    wait_for(lambda: conn.get(KEYS.idem(job_id, "tiny")) == b"ended"
             and not conn.exists(KEYS.reply(job_id, "tiny")), timeout=30, interval=0.1,
             what=f"job {job_id} ended and its reply stream expired")


def test_results_read_after_the_reply_expired_raise_result_expired(
        server: RedisServer, worker: WorkerProcess) -> None:
    client = Client(server.url)
    done = client.submit("the quick brown fox", PARAMS, model="tiny")
    client.cancel("cancelled-early", "tiny")  # ends with an error event ("cancelled")
    refused = client.submit("the quick brown fox", PARAMS, model="tiny", job_id="cancelled-early")
    expired(server, done.id)
    expired(server, refused.id)
    conn = server.client()
    assert conn.ttl(KEYS.idem(done.id)) > 23 * 3600  # the mark kept the key's own TTL
    for job in (done, refused):
        with pytest.raises(ResultExpired) as err:
            job.result(timeout=20)
        assert (err.value.job_id, err.value.code) == (job.id, "result_expired")
        assert "reply stream has expired" in err.value.message
        with pytest.raises(ResultExpired):
            list(job.stream(timeout=20))
        with pytest.raises(ResultExpired):
            client.job(job.id, model="tiny").result(timeout=20)  # a handle made elsewhere
    fresh = client.submit("jumps over", PARAMS, model="tiny")
    got = client.results([done, fresh, refused], timeout=20, return_exceptions=True)
    assert [type(r).__name__ for r in got] == ["ResultExpired", "dict", "ResultExpired"]
    assert got[1]["outputs"][0]["finish_reason"] == "length"
    with pytest.raises(ResultExpired):
        client.results([done], timeout=20)

    async def read_async() -> None:
        async with AsyncClient(server.url) as aclient:
            await aclient.job(done.id, model="tiny").result(timeout=20)

    with pytest.raises(ResultExpired):
        asyncio.run(read_async())


def test_a_job_that_has_not_run_is_still_waited_for(server: RedisServer,
                                                    worker: WorkerProcess) -> None:
    client = Client(server.url)
    queued = client.submit("nobody serves this", PARAMS, model="unserved")
    for wait in (lambda: queued.result(timeout=2.5), lambda: client.results([queued], 2.5)):
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            wait()
        assert time.monotonic() - start >= 2.5  # it waited its timeout out: no early give-up
    assert server.client().get(KEYS.idem(queued.id)) == b"1"
