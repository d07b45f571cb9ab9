"""The heartbeat thread: keeps <prefix>:worker:{<model>}:<name> alive while this process lives.

It runs in its own thread so a long engine step never starves it; if the process dies or is
paused, the key expires after heartbeat_ttl and other workers may reclaim this worker's jobs.
It also refreshes the TTL of the job stream it serves, so that stream lives while workers do, and
keeps the worker in the registry (its name in the model's set, the model in the set of models):
`genq status` and the gateway find workers there, not by a SCAN that would see one cluster node.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis

from producer.connection import RETRYABLE
from producer.protocol import Keys, ProtocolError, decode_heartbeat, encode_heartbeat

log = logging.getLogger("genq.worker")


@dataclass(frozen=True)
class Registry:
    """Where a worker is listed: its name in `workers` (the model's set), `model` in `models`."""

    workers: str
    name: str
    models: str
    model: str

    @staticmethod
    def of(keys: Keys, model: str, name: str) -> Registry:
        return Registry(keys.workers(model), name, keys.models, model)


class Heartbeat(threading.Thread):
    def __init__(self, conn: redis.Redis, key: str, ttl: float, interval: float,
                 info: Callable[[], dict[str, Any]], jobs_keys: list[str], stream_ttl: int,
                 sample: Callable[[redis.Redis], None] | None = None,
                 registry: Registry | None = None,
                 shards: tuple[str, int, list[tuple[str, str]]] | None = None) -> None:
        super().__init__(name="genq-heartbeat", daemon=True)
        self.conn = conn
        self.key = key
        self.ttl_ms = int(ttl * 1000)
        self.interval = interval
        self.info = info
        self.jobs_keys = jobs_keys  # the streams this worker reads: kept alive while it is
        self.stream_ttl = stream_ttl
        self.sample = sample  # e.g. metrics: queue lag, sampled after each beat
        self.registry = registry
        # A sharded model (--shards k > 1): (Keys.shards key, k, the worker's heartbeat key and
        # registry set in shards 1..k-1): each beat writes k and beats in every shard. (k = 1
        # writes nothing: producers take a missing count as 1, and an unsharded deployment's
        # keys and ACL stay as they were.)
        self.shards = shards
        self._halt = threading.Event()

    def beat(self) -> None:
        value = encode_heartbeat({**self.info(), "ts": time.time()})
        pipe = self.conn.pipeline(transaction=False)
        pipe.set(self.key, value, px=self.ttl_ms)
        for key in self.jobs_keys:
            pipe.expire(key, self.stream_ttl)
        if self.registry is not None:  # (the sets live as long as the streams they list)
            pipe.sadd(self.registry.workers, self.registry.name)
            pipe.expire(self.registry.workers, self.stream_ttl)
            pipe.sadd(self.registry.models, self.registry.model)
            pipe.expire(self.registry.models, self.stream_ttl)
        if self.shards is not None:
            count_key, k, copies = self.shards
            pipe.set(count_key, k, ex=self.stream_ttl)
            for key, workers in copies:
                pipe.set(key, value, px=self.ttl_ms)
                if self.registry is not None:
                    pipe.sadd(workers, self.registry.name)
                    pipe.expire(workers, self.stream_ttl)
        pipe.execute()

    def run(self) -> None:
        while not self._halt.wait(self.interval):
            try:
                self.beat()
            except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError) as exc:
                log.warning("heartbeat failed: %s", exc)
                continue
            if self.sample is not None:
                try:
                    self.sample(self.conn)
                except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError) as exc:
                    log.debug("metrics sample failed: %s", exc)

    def stop(self, delete: bool = True) -> None:
        self._halt.set()
        self.join()
        if delete:
            try:
                self.conn.delete(self.key)
                if self.registry is not None:
                    self.conn.srem(self.registry.workers, self.registry.name)
                for key, workers in self.shards[2] if self.shards is not None else []:
                    self.conn.delete(key)
                    if self.registry is not None:
                        self.conn.srem(workers, self.registry.name)
            except RETRYABLE:  # (READONLY: a failover demoted our node; the key expires)
                pass


def name_in_use(conn: redis.Redis, key: str, me: str) -> str | None:
    """Another live worker with this --name (heartbeat `key`): both would run, and fence, each
    other's jobs as their own. On this host with its process alive: a message (the caller
    refuses to start); on another host it cannot be told from this worker's own previous run
    within its heartbeat TTL: a warning."""
    try:
        raw = conn.get(key)
        info = decode_heartbeat(raw) if isinstance(raw, bytes) else {}
    except (*RETRYABLE, ProtocolError):
        return None
    pid, host = info.get("pid"), info.get("host")
    if not isinstance(pid, int) or pid == os.getpid():
        return None
    if host == socket.gethostname():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None  # this worker's previous run, dead: its jobs are this run's
        except PermissionError:
            pass  # alive, another user's
        return (f"another worker named {me!r} is running on this host (pid {pid}): two "
                "workers with one name would take each other's jobs; give each its own --name "
                "(e.g. one per GPU)")
    log.warning("a worker named %r on host %s (pid %s) has a live heartbeat: if it is not this "
                "worker's previous run, give each worker its own --name", me, host, pid)
    return None
