"""The worker's read sent ahead (JobReader.send / collect) against a real redis-server: what it
delivers, and what it leaves when Redis loses the script or the connection."""

from __future__ import annotations

import signal
import time

import redis

from producer.lanes import lane_keys
from producer.protocol import Keys
from tests.harness.fleet import RedisServer
from worker.config import WorkerConfig
from worker.reader import READ_LUA, JobReader
from worker.streams import WorkerKeys, ref

KEYS = Keys()
DEFAULT, HIGH, LOW = lane_keys(KEYS, "ahead")  # stream indexes 0, 1, 2


def reader_of(server: RedisServer) -> JobReader:
    cfg = WorkerConfig(redis_url=server.url, served_model_name="ahead", name="w1")
    wkeys = WorkerKeys(KEYS, "ahead", "w1")
    reader = JobReader(cfg, wkeys, redis.Redis(port=server.port, protocol=2, socket_timeout=10))
    assert reader.ensure_group(wait=False)
    return reader


def add(server: RedisServer, stream: str, job: str) -> str:
    return server.client().xadd(stream, {"job": job.encode()}).decode()  # type: ignore[no-any-return]


def test_a_read_sent_ahead_takes_at_most_its_count_most_urgent_lane_first(
        redis_server: RedisServer) -> None:
    reader = reader_of(redis_server)
    assert reader.can_send_ahead
    first, second = add(redis_server, DEFAULT, "d1"), add(redis_server, DEFAULT, "d2")
    urgent = add(redis_server, HIGH, "h1")
    redis_server.client().script_load(READ_LUA)
    assert reader.collect() is None  # nothing was sent
    reader.send(2)
    reader.send(2)  # one read in flight at a time: this one is not sent
    assert reader.collect() == [(ref(1, urgent), {b"job": b"h1"}, 1),
                                (ref(0, first), {b"job": b"d1"}, 1)]
    assert reader.collect() is None
    reader.send(5)
    assert reader.collect() == [(ref(0, second), {b"job": b"d2"}, 1)]
    reader.send(5)
    assert reader.collect() == []
    assert redis_server.client().xpending(DEFAULT, KEYS.group)["pending"] == 2


def test_a_read_sent_ahead_without_the_script_in_redis_delivers_nothing(
        redis_server: RedisServer) -> None:
    reader = reader_of(redis_server)
    entry = add(redis_server, LOW, "l1")
    redis_server.client().script_flush()
    reader.send(1)
    assert reader.collect() is None  # (the loop then reads as usual, which loads the script)
    assert redis_server.client().xpending(LOW, KEYS.group)["pending"] == 0
    assert reader.read(1, None) == [(ref(2, entry), {b"job": b"l1"}, 1)]
    assert not reader.failed


def test_a_read_sent_ahead_that_redis_never_answers_backs_off_and_loses_nothing(
        redis_server: RedisServer) -> None:
    reader = reader_of(redis_server)
    entry = add(redis_server, DEFAULT, "d1")
    redis_server.client().script_load(READ_LUA)
    assert reader.read_conn.ping()  # (connected: what waits below is the read alone)
    assert redis_server.proc is not None
    redis_server.proc.send_signal(signal.SIGSTOP)  # the read waits in its socket, never run
    reader.send(1)
    redis_server.kill()
    assert reader.collect() == []
    assert reader.failed  # the loop looks for entries delivered by a read whose reply was lost
    reader.send(1)  # backing off: not sent
    assert reader.collect() is None
    redis_server.start()
    time.sleep(0.06)  # past the first backoff (0.05 s)
    reader.send(1)
    assert reader.collect() is None  # (a restarted Redis has no scripts: read as usual)
    assert reader.read(1, None) == [(ref(0, entry), {b"job": b"d1"}, 1)]
