"""JobReader: how entries come in from the job stream (new reads and heartbeat-gated claims).

Blocking reads use a connection of their own whose socket timeout is above the BLOCK time. A
lost connection never raises out of here: reads back off (and say so) while the engine keeps
stepping; a missing consumer group (Redis lost its data, or the stream's TTL ran out) is
re-created from id 0 so no entry already in the stream is skipped.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import redis

from producer.connection import RETRYABLE, connect
from producer.protocol import Keys, as_str
from worker.config import WorkerConfig
from worker.scripts import Scripts, reclaim_call

log = logging.getLogger("genq.worker")
Entry = tuple[str, dict[bytes, bytes], int]  # entry id, fields, deliveries (fencing token)


class JobReader:
    def __init__(self, cfg: WorkerConfig, keys: Keys, conn: redis.Redis) -> None:
        self.cfg = cfg
        self.keys = keys
        self.me = cfg.name
        self.jobs_key = keys.jobs(cfg.served_model_name)
        self.conn = conn
        self.read_conn = connect(cfg.redis_url, socket_timeout=cfg.block_ms / 1000 + 10)
        self.scripts = Scripts(conn)
        self._next_read = 0.0
        self._backoff = 0.05
        self.failed = False  # a read failed since the loop last looked for orphans

    def read(self, count: int, block_ms: int | None) -> list[Entry]:
        """Up to `count` new entries (deliveries = 1); waits up to `block_ms` for the first
        (None: returns at once)."""
        block = block_ms is not None
        now = time.monotonic()
        if count <= 0 or now < self._next_read:
            return []
        try:
            resp = self.read_conn.xreadgroup(self.keys.group, self.me, {self.jobs_key: ">"},
                                             count=count,
                                             block=block_ms)
            self._backoff = 0.05
        except RETRYABLE as exc:
            # Redis may have handed us entries whose reply never arrived: Loop adopts them.
            self.failed = True
            log.warning("reading jobs failed (%s); retrying in %.2f s", exc, self._backoff)
            self._next_read = now + self._backoff
            if block:
                time.sleep(self._backoff)
            self._backoff = min(self._backoff * 2, 2.0)
            return []
        except redis.ResponseError as exc:
            # NOGROUP: the group is gone (Redis lost its data); UNBLOCKED: the stream key was
            # deleted (DEL, FLUSHALL) or the server became a replica under a blocked read.
            # Either way: re-create (or wait for a primary), read again.
            if "NOGROUP" not in str(exc) and not str(exc).startswith("UNBLOCKED"):
                raise
            log.warning("the job stream or its group is gone (%s); re-creating it", exc)
            self.failed = True
            self.ensure_group(wait=False)
            return []
        entries: Any = resp or []
        return [(as_str(eid), fields, 1) for _key, items in entries for eid, fields in items]

    def own_pending(self, scan: int) -> dict[str, int] | None:
        """Up to `scan` of this worker's pending entries: entry id -> deliveries (the fencing
        token of the attempt it owns). None when Redis could not say."""
        try:
            rows: list[dict[str, Any]] = self.conn.xpending_range(
                self.jobs_key, self.keys.group, "-", "+", scan, consumername=self.me)
        except RETRYABLE as exc:
            log.warning("reading this worker's pending entries failed: %s", exc)
            return None
        except redis.ResponseError as exc:  # NOGROUP after Redis lost its data
            log.warning("reading this worker's pending entries refused: %s", exc)
            return None
        return {as_str(r["message_id"]): int(r["times_delivered"]) for r in rows}

    def orphans(self, pending: dict[str, int], held: set[str], count: int) -> list[Entry]:
        """Up to `count` of the `pending` entries (own_pending) that this worker does not hold:
        delivered by a read whose reply was lost with the connection (Redis restarted or dropped
        us mid-read). No one else would ever run them: this worker's heartbeat is alive. They
        keep their delivery count, which is the fencing token the writes will carry."""
        wanted = [(eid, n) for eid, n in pending.items() if eid not in held][:count]
        if not wanted:
            return []
        try:
            pipe = self.conn.pipeline(transaction=False)
            for entry_id, _ in wanted:
                pipe.xrange(self.jobs_key, entry_id, entry_id)
            found = pipe.execute()
            gone = [eid for (eid, _), got in zip(wanted, found, strict=True) if not got]
            if gone:  # pending but deleted from the stream: nothing left to run
                self.conn.xack(self.jobs_key, self.keys.group, *gone)
        except RETRYABLE as exc:
            log.warning("looking for orphaned entries failed: %s", exc)
            return []
        except redis.ResponseError as exc:
            log.warning("looking for orphaned entries refused: %s", exc)
            return []
        if len(wanted) > len(gone):
            log.warning("adopting %d entr%s Redis delivered to this worker in a read whose reply "
                        "was lost", len(wanted) - len(gone), "y" if len(wanted) - len(gone) == 1
                        else "ies")
        return [(eid, got[0][1], n) for (eid, n), got in zip(wanted, found, strict=True) if got]

    def claim(self, count: int, include_self: bool) -> list[Entry]:
        """Up to `count` pending entries of workers whose heartbeat is gone (and this worker's
        own when `include_self`: a restart under the same name)."""
        if count <= 0:
            return []
        try:
            consumers = [as_str(c["name"]) for c in
                         self.conn.xinfo_consumers(self.jobs_key, self.keys.group)]
            keys, args = reclaim_call(self.keys, self.cfg.served_model_name, self.me, consumers,
                                      count, include_self)
            claimed = self.scripts.reclaim(keys=keys, args=args)
        except RETRYABLE as exc:
            log.warning("reclaim failed: %s", exc)
            return []
        except redis.ResponseError as exc:  # NOGROUP / no such key: nothing to claim
            log.warning("reclaim refused: %s", exc)
            return []
        return [(as_str(eid), _pairs(flat), int(n)) for eid, flat, n in claimed]

    def ensure_group(self, wait: bool, stop: threading.Event | None = None) -> bool:
        """Create the consumer group if it is missing. With `wait`, retry until Redis answers
        or `stop` is set; False when it gave up (Redis unreachable)."""
        backoff = 0.05
        while True:
            try:
                self.conn.xgroup_create(self.jobs_key, self.keys.group, id="0", mkstream=True)
                self.conn.expire(self.jobs_key, self.cfg.stream_ttl)
                return True
            except RETRYABLE as exc:
                if not wait:
                    log.warning("re-creating the job stream's group failed (%s); the next "
                                "read tries again", exc)
                    return False
                log.warning("waiting for Redis: %s", exc)
                if stop is None:
                    time.sleep(backoff)
                elif stop.wait(backoff):
                    return False
                backoff = min(backoff * 2, 2.0)
            except redis.ResponseError as exc:
                if "BUSYGROUP" in str(exc):
                    return True
                raise


def _pairs(flat: list[bytes]) -> dict[bytes, bytes]:
    return {flat[i]: flat[i + 1] for i in range(0, len(flat) - 1, 2)}
