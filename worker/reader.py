"""JobReader: how entries come in from the job streams (new reads and heartbeat-gated claims).

The streams are the model's priority lanes (producer/lanes.py) in each of its shards
(producer/shards.py; worker/streams.py). A read fills the free capacity from the most urgent
lane first, one script per shard (a shard's lanes share a slot; the shard read first rotates);
only when all are empty does it block, in one XREADGROUP over the lanes, asking each for no more
than its share of the capacity, so a read never returns more entries than there is room for. (On
a Redis Cluster a sharded model's streams span slots, which one command may not: the worker then
blocks briefly on one shard at a time, in turn.)

While the engine runs, the loop sends the next read as soon as the model has run (`send`) and
takes its answer at the next iteration (`collect`): the round trip overlaps the step's sampling
and hand-out instead of adding to every step, and a job that arrived during the forward pass is
still in it. (One shard on one server only: a cluster's or a sharded model's reads stay as
above.)

Blocking reads use a connection of their own whose socket timeout is above the BLOCK time. A
lost connection never raises out of here: reads back off (and say so) while the engine keeps
stepping; a missing consumer group (Redis lost its data, or the stream's TTL ran out) is
re-created from id 0 so no entry already in the stream is skipped.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import redis

from producer.connection import RETRYABLE, connect, parse
from producer.protocol import as_str
from worker.config import WorkerConfig
from worker.scripts import Scripts, reclaim_call
from worker.streams import WorkerKeys, ref, split_ref

log = logging.getLogger("genq.worker")
Entry = tuple[str, dict[bytes, bytes], int]  # entry ref, fields, deliveries (fencing token)

# Up to ARGV[3] new entries, from the lanes in KEYS order (most urgent first): each lane is read
# only for what the more urgent ones left of the count. Returns {{key index, entries}, ...}.
READ_LUA = """
local group, me, budget = ARGV[1], ARGV[2], tonumber(ARGV[3])
local out = {}
for k = 1, #KEYS do
  if budget <= 0 then break end
  local r = redis.call('XREADGROUP', 'GROUP', group, me, 'COUNT', budget, 'STREAMS', KEYS[k], '>')
  if r then
    out[#out + 1] = {k, r[1][2]}
    budget = budget - #r[1][2]
  end
end
return out
"""


class JobReader:
    def __init__(self, cfg: WorkerConfig, keys: WorkerKeys, conn: redis.Redis) -> None:
        self.cfg = cfg
        self.wkeys = keys
        self.keys = keys.keys
        self.me = cfg.name
        self.streams = keys.jobs  # stream index -> key
        self.groups = keys.read_order  # per shard: its streams, most urgent first
        # Every stream, most urgent lane first (the lanes of all shards)
        self.urgent_first = [i for lane in zip(*self.groups, strict=True) for i in lane]
        self.block_per_shard = keys.shards > 1 and parse(cfg.redis_url).is_cluster
        self._turn = 0  # the shard read first (in turn, so that no shard starves the others)
        self.conn = conn
        self.read_conn = connect(cfg.redis_url, socket_timeout=cfg.block_ms / 1000 + 10)
        self.scripts = Scripts(conn)
        self.read_script = conn.register_script(READ_LUA)
        self._next_read = 0.0
        self._backoff = 0.05
        self.failed = False  # a read failed since the loop last looked for orphans
        # A read sent ahead (`send`): the connection its answer will come on, until `collect`.
        self.can_send_ahead = len(self.groups) == 1 and not parse(cfg.redis_url).is_cluster
        self._ahead: redis.connection.Connection | None = None

    def read(self, count: int, block_ms: int | None) -> list[Entry]:
        """Up to `count` new entries (deliveries = 1); waits up to `block_ms` for the first
        (None: returns at once)."""
        if count <= 0 or time.monotonic() < self._next_read:
            return []

        def attempt() -> list[Entry]:
            entries = self._read_lanes(count)
            return entries if entries or block_ms is None else self._block(count, block_ms)

        return self._guarded(attempt, block=block_ms is not None)

    def send(self, count: int) -> None:
        """Send a read of up to `count` new entries without waiting for its answer (none while
        one is in flight, or while reads back off). `collect` takes the answer."""
        if (not self.can_send_ahead or self._ahead is not None or count <= 0
                or time.monotonic() < self._next_read):
            return
        keys = [self.streams[i] for i in self.groups[0]]
        pool = self.read_conn.connection_pool

        def attempt() -> list[Entry]:
            conn = pool.get_connection()
            try:
                conn.send_command("EVALSHA", self.read_script.sha, len(keys), *keys,
                                  self.keys.group, self.me, count)
            except BaseException:
                conn.disconnect()
                pool.release(conn)
                raise
            self._ahead = conn
            return []

        self._guarded(attempt, block=False)

    def collect(self) -> list[Entry] | None:
        """The entries of the read `send` sent; None when there was none (or Redis had lost
        the read script: then nothing was read, and a plain read loads the script again)."""
        conn, self._ahead = self._ahead, None
        if conn is None:
            return None
        pool = self.read_conn.connection_pool
        try:
            return self._guarded(lambda: self._lane_entries(self.groups[0], conn.read_response()),
                                 block=False)
        except redis.exceptions.NoScriptError:
            return None
        finally:
            pool.release(conn)  # (read_response disconnects it on an error)

    def _guarded(self, attempt: Callable[[], list[Entry]], block: bool) -> list[Entry]:
        """`attempt()`, or [] when Redis failed it: a lost connection backs the reads off
        (sleeping through the backoff when the caller meant to block), a lost group is made
        again."""
        now = time.monotonic()
        try:
            entries = attempt()
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
        return entries

    def _read_lanes(self, count: int) -> list[Entry]:
        """Up to `count` entries, most urgent lane first, without waiting (a round trip per
        shard while there is room)."""
        self._turn = (self._turn + 1) % len(self.groups)
        out: list[Entry] = []
        for k in range(len(self.groups)):
            if len(out) >= count:
                break
            group = self.groups[(self._turn + k) % len(self.groups)]
            got: Any = self.read_script(keys=[self.streams[i] for i in group],
                                        args=[self.keys.group, self.me, count - len(out)])
            out += self._lane_entries(group, got)
        return out

    @staticmethod
    def _lane_entries(group: list[int], got: Any) -> list[Entry]:
        """READ_LUA's answer over the streams `group` -> entries."""
        return [(ref(group[int(n) - 1], as_str(eid)), _pairs(flat), 1)
                for n, items in got or [] for eid, flat in items]

    def _block(self, count: int, block_ms: int | None) -> list[Entry]:
        """Wait up to `block_ms` for entries in any lane. XREADGROUP's COUNT is per stream: each
        lane is asked for its share of `count` (with fewer than one each, only the most urgent
        lanes are waited on; the next read looks at all), so no more than `count` come back."""
        order = self.urgent_first
        if self.block_per_shard:  # (streams of one slot only: this shard's, briefly)
            order = self.groups[self._turn]
            block_ms = min(block_ms or 1, 50)
        lanes = order[:count]
        per_lane = max(1, count // len(lanes))
        resp: Any = self.read_conn.xreadgroup(
            self.keys.group, self.me, {self.streams[i]: ">" for i in lanes}, count=per_lane,
            block=block_ms)
        index = {self.streams[i]: i for i in lanes}
        got = {index[as_str(key)]: items for key, items in resp or []}
        return [(ref(i, as_str(eid)), fields, 1) for i in lanes for eid, fields in got.get(i, [])]

    def own_pending(self, scan: int) -> dict[str, int] | None:
        """Up to `scan` of this worker's pending entries per stream: entry ref -> deliveries
        (the fencing token of the attempt it owns). None when Redis could not say."""
        try:
            pipe = self.conn.pipeline(transaction=False)
            for key in self.streams:
                pipe.xpending_range(key, self.keys.group, "-", "+", scan, consumername=self.me)
            per_stream: list[list[dict[str, Any]]] = pipe.execute()
        except RETRYABLE as exc:
            log.warning("reading this worker's pending entries failed: %s", exc)
            return None
        except redis.ResponseError as exc:  # NOGROUP after Redis lost its data
            log.warning("reading this worker's pending entries refused: %s", exc)
            return None
        return {ref(i, as_str(r["message_id"])): int(r["times_delivered"])
                for i, rows in enumerate(per_stream) for r in rows}

    def orphans(self, pending: dict[str, int], held: set[str], count: int) -> list[Entry]:
        """Up to `count` of the `pending` entries (own_pending) that this worker does not hold:
        delivered by a read whose reply was lost with the connection (Redis restarted or dropped
        us mid-read). No one else would ever run them: this worker's heartbeat is alive. They
        keep their delivery count, which is the fencing token the writes will carry."""
        wanted = [(r, n) for r, n in pending.items() if r not in held][:count]
        if not wanted:
            return []
        try:
            pipe = self.conn.pipeline(transaction=False)
            for entry_ref, _ in wanted:
                stream, entry_id = split_ref(entry_ref)
                pipe.xrange(self.streams[stream], entry_id, entry_id)
            found = pipe.execute()
            gone = [r for (r, _), got in zip(wanted, found, strict=True) if not got]
            if gone:  # pending but deleted from the stream: nothing left to run
                pipe = self.conn.pipeline(transaction=False)
                for entry_ref in gone:
                    stream, entry_id = split_ref(entry_ref)
                    pipe.xack(self.streams[stream], self.keys.group, entry_id)
                pipe.execute()
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
        return [(r, got[0][1], n) for (r, n), got in zip(wanted, found, strict=True) if got]

    def claim(self, count: int, include_self: bool) -> list[Entry]:
        """Up to `count` pending entries of workers whose heartbeat is gone (and this worker's
        own when `include_self`: a restart under the same name), most urgent lane first."""
        out: list[Entry] = []
        for stream in self.urgent_first:
            if count - len(out) <= 0:
                break
            out += self._claim_from(stream, count - len(out), include_self)
        return out

    def _claim_from(self, stream: int, count: int, include_self: bool) -> list[Entry]:
        key = self.streams[stream]
        try:
            consumers = [as_str(c["name"]) for c in self.conn.xinfo_consumers(key,
                                                                              self.keys.group)]
            keys, args = reclaim_call(self.keys, self.wkeys.model, key, self.me, consumers,
                                      count, include_self, self.wkeys.shard_of(stream))
            claimed = self.scripts.reclaim(keys=keys, args=args)
        except RETRYABLE as exc:
            log.warning("reclaim failed: %s", exc)
            return []
        except redis.ResponseError as exc:  # NOGROUP / no such key: nothing to claim
            log.warning("reclaim refused: %s", exc)
            return []
        return [(ref(stream, as_str(eid)), _pairs(flat), int(n)) for eid, flat, n in claimed]

    def ensure_group(self, wait: bool, stop: threading.Event | None = None) -> bool:
        """Create the streams' consumer groups where missing. With `wait`, retry until Redis
        answers or `stop` is set; False when it gave up (Redis unreachable)."""
        backoff = 0.05
        while True:
            try:
                for key in self.streams:
                    self._create_group(key)
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

    def _create_group(self, key: str) -> None:
        try:
            self.conn.xgroup_create(key, self.keys.group, id="0", mkstream=True)
            self.conn.expire(key, self.cfg.stream_ttl)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise


def _pairs(flat: list[bytes]) -> dict[bytes, bytes]:
    return {flat[i]: flat[i + 1] for i in range(0, len(flat) - 1, 2)}
