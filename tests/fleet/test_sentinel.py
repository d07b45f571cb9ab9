"""Redis Sentinel: URLs, and a fleet that follows a failover (planned, and kill -9 of the
primary) with a real primary, replica and three sentinels."""

from __future__ import annotations

import argparse
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from producer import Client
from producer.connection import connect, parse
from producer.flags import redis_url
from producer.protocol import Keys
from tests.harness.fleet import (
    Expected,
    WorkerFactory,
    as_expected,
    reply_events,
    wait_for,
)
from tests.harness.models import corpus
from tests.harness.sentinels import SERVICE, SentinelSet
from worker.heartbeat import Heartbeat

Oracle = Callable[[list[str], Any], list[Expected]]


def test_sentinel_urls_parse_into_sentinels_service_db_and_credentials() -> None:
    t = parse("redis+sentinel://u:p%40ss@10.0.0.1:26379,[::1]:26380,h3/mymaster/2"
              "?sentinel_password=sp&socket_keepalive=true")
    assert t.is_sentinel
    assert t.sentinels == (("10.0.0.1", 26379), ("::1", 26380), ("h3", 26379))
    assert t.service == "mymaster"
    assert (t.node_kwargs["username"], t.node_kwargs["password"], t.node_kwargs["db"]) == \
        ("u", "p@ss", 2)
    assert t.sentinel_kwargs["password"] == "sp" and "db" not in t.sentinel_kwargs
    assert "ssl" not in t.node_kwargs
    tls = parse("rediss+sentinel://h:1/svc?ssl_cert_reqs=none")
    assert tls.node_kwargs["ssl"] is True and tls.sentinel_kwargs["ssl"] is True
    assert tls.node_kwargs["ssl_cert_reqs"] == "none" and tls.node_kwargs["db"] == 0
    assert not parse("redis://127.0.0.1:6379/0").is_sentinel
    assert not parse("unix:///tmp/r.sock?db=1").is_sentinel


@pytest.mark.parametrize("url, says", [
    ("redis+sentinel://h:1", "/service_name"),
    ("redis+sentinel://h:1/svc/x", "database 'x' is not a number"),
    ("redis+sentinel://h:port/svc", "'h:port' is not host:port"),
    ("redis+cluster://h:1/3", "a cluster has only database 0"),
    ("http://h:1/0", "unknown scheme 'http'"),
])
def test_a_bad_url_is_a_usage_error_that_says_what_is_wrong(url: str, says: str) -> None:
    with pytest.raises(ValueError, match="bad Redis URL") as err:
        parse(url)
    assert says in str(err.value)
    with pytest.raises(argparse.ArgumentTypeError) as usage:
        redis_url(url)
    assert says in str(usage.value)


@pytest.fixture
def sentinels(tmp_path: Path) -> Iterator[SentinelSet]:
    s = SentinelSet(tmp_path / "redis")
    try:
        s.start()
        yield s
    finally:
        s.stop()


def wait_worker(sentinels: SentinelSet, name: str, workers: WorkerFactory) -> None:
    def up() -> bool:
        for w in workers.workers:
            assert w.alive(), w.output()[-3000:]
        return bool(sentinels.primary().exists(Keys().worker("tiny", name)))
    wait_for(up, timeout=180, interval=0.1, what="the worker's heartbeat")


def params(i: int) -> dict[str, Any]:
    if i % 2 == 0:
        return {"temperature": 0, "max_tokens": 24}
    return {"temperature": 0.8, "top_p": 0.9, "seed": 500 + i, "max_tokens": 24}


def done_events(primary: redis.Redis, job_id: str) -> int:
    from producer.events import decode_event
    from producer.protocol import REPLY_FIELD

    entries = primary.xrange(Keys().reply(job_id, "tiny"))
    return sum(decode_event(f[REPLY_FIELD.encode()])["type"] == "done" for _i, f in entries)


def test_a_planned_failover_shows_no_error_to_the_client_and_the_worker_follows(
        sentinels: SentinelSet, workers: WorkerFactory, tiny_llama: Path,
        offline: Oracle) -> None:
    worker = workers.start(sentinels.url, tiny_llama, "s1")
    wait_worker(sentinels, "s1", workers)
    prompts = corpus(16, seed=41)
    want = offline(prompts, [params(i) for i in range(16)])
    with Client(sentinels.url) as client:
        before = [client.submit(p, params(i), model="tiny") for i, p in enumerate(prompts[:8])]
        old = sentinels.primary_port()
        sentinels.sentinel().sentinel_failover(SERVICE)
        # Submitted while the failover runs: the client retries a demoted or paused primary.
        after = [client.submit(p, params(8 + i), model="tiny")
                 for i, p in enumerate(prompts[8:])]
        new = sentinels.wait_primary_other_than(old)
        got = [as_expected(job.result(timeout=180)) for job in before + after]
    assert new != old
    assert got == want
    # The worker serves from the new primary: its heartbeat is there, and it is still the one.
    wait_for(lambda: sentinels.primary().exists(Keys().worker("tiny", "s1")), timeout=60,
             what="the worker's heartbeat on the new primary")
    assert worker.alive()
    assert worker.terminate() == 0


def test_kill_9_of_the_primary_with_min_replicas_loses_no_submitted_job(
        sentinels: SentinelSet, workers: WorkerFactory, tiny_llama: Path,
        offline: Oracle) -> None:
    workers.start(sentinels.url, tiny_llama, "s2", "--min-replicas", "1")
    wait_worker(sentinels, "s2", workers)
    prompts = corpus(24, seed=43)
    want = offline(prompts, [params(i) for i in range(24)])
    submitted: dict[int, str] = {}
    old = sentinels.primary_port()
    with Client(sentinels.url, min_replicas=1, failover_timeout=60) as client:
        for i, p in enumerate(prompts[:16]):
            submitted[i] = client.submit(p, params(i), model="tiny").id
        sentinels.node_on(old).kill()  # kill -9, jobs mid-run

        def late() -> None:  # submits racing the failover: some may raise; those are not ours
            for i in range(16, 24):
                try:
                    submitted[i] = client.submit(prompts[i], params(i), model="tiny").id
                except (redis.RedisError, RuntimeError):
                    pass

        racer = threading.Thread(target=late)
        racer.start()
        sentinels.wait_primary_other_than(old)
        sentinels.node_on(old).start()  # back as a replica of the new primary (sentinels say so)
        racer.join()
        results = {i: as_expected(client.job(job_id).result(timeout=240))
                   for i, job_id in submitted.items()}
    assert len(submitted) >= 16
    assert results == {i: want[i] for i in submitted}
    primary = sentinels.primary()
    assert [done_events(primary, submitted[i]) for i in sorted(submitted)] == [1] * len(submitted)


def test_the_heartbeat_stops_cleanly_on_a_demoted_node(sentinels: SentinelSet) -> None:
    replica = sentinels.nodes[1].client()
    beat = Heartbeat(replica, "genq:worker:x", ttl=2.0, interval=0.05, info=lambda: {},
                     jobs_keys=["genq:jobs:tiny"], stream_ttl=60)
    beat.start()
    beat.stop(delete=True)  # READONLY on its last DELETE: the key expires on its own
    assert not beat.is_alive()
    with pytest.raises(redis.exceptions.ReadOnlyError):
        replica.set("k", 1)
    # Through the factory, the same command reaches the primary.
    assert connect(sentinels.url).set("k", 1) is True
    assert reply_events is not None
