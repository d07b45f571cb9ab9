"""The cancel listener: job ids published on the model's shard channel <prefix>:cancel:{<model>}
(SPUBLISH: on a cluster it reaches the node of the model's slot, not every node), handed to the
loop via a queue.

Pub/sub can miss a message (a reconnect); the loop also sweeps the cancel keys of its running
jobs every cancel_poll_interval, so a cancel is never lost, only sometimes a little later.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Collection

import redis

from producer.connection import RETRYABLE, connect
from producer.protocol import Keys

log = logging.getLogger("genq.worker")
_MAX_EARLY = 10_000  # cancels remembered for jobs not held (yet)
_EARLY_KEEP_S = 60.0


class CancelListener(threading.Thread):
    def __init__(self, url: str, channel: str) -> None:
        super().__init__(name="genq-cancel", daemon=True)
        self.url = url
        self.channel = channel
        self.cancelled: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._halt = threading.Event()

    def run(self) -> None:
        backoff = 0.05
        while not self._halt.is_set():
            conn = connect(self.url, socket_timeout=10)
            try:
                pubsub = conn.pubsub(ignore_subscribe_messages=True)
                pubsub.ssubscribe(self.channel)
                # (a cluster's pub/sub reads shard channels apart from the others)
                next_message = getattr(pubsub, "get_sharded_message", pubsub.get_message)
                backoff = 0.05
                while not self._halt.is_set():
                    message = next_message(timeout=0.5)
                    if message and message["type"] == "smessage":
                        data = message["data"]
                        self.cancelled.put(data.decode(errors="replace")
                                           if isinstance(data, bytes) else str(data))
            except RETRYABLE as exc:
                log.warning("cancel listener lost Redis (%s); reconnecting", exc)
                self._halt.wait(backoff)
                backoff = min(backoff * 2, 2.0)
            finally:
                conn.close()

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)


class Cancels:
    """Which held jobs to cancel now: ids from the listener, plus a sweep of the held jobs'
    cancel keys every `poll_interval` (pub/sub can miss a message). Cancels of jobs this
    worker does not hold are kept a while (`early`): the job may be in a read on its way in."""

    def __init__(self, listener: CancelListener, conn: redis.Redis, keys: Keys,
                 poll_interval: float) -> None:
        self.listener = listener
        self.conn = conn
        self.keys = keys
        self.poll_interval = poll_interval
        self.early: dict[str, float] = {}  # job id -> when its cancel was heard
        self._next_sweep = 0.0

    def due(self, held: Collection[str]) -> list[str]:
        """The ids of `held` (job ids) cancelled since the last call; the others heard of are
        remembered in `early`."""
        ids: set[str] = set()
        while not self.listener.cancelled.empty():
            ids.add(self.listener.cancelled.get())
        now = time.monotonic()
        if held and now >= self._next_sweep:
            self._next_sweep = now + self.poll_interval
            ids |= self._swept(list(held))
        due = [job_id for job_id in ids if job_id in held]
        for job_id in ids.difference(due):
            self.early[job_id] = now
        early = self.early
        if len(early) > _MAX_EARLY or (early and now - next(iter(early.values())) > _EARLY_KEEP_S):
            self.early = {k: t for k, t in early.items() if now - t < _EARLY_KEEP_S}
        return due

    def _swept(self, job_ids: list[str]) -> set[str]:
        try:
            pipe = self.conn.pipeline(transaction=False)
            for job_id in job_ids:
                pipe.exists(self.keys.cancel(job_id))
            flags = pipe.execute()
        except RETRYABLE:
            return set()
        return {job_id for job_id, flag in zip(job_ids, flags, strict=True) if flag}
