"""The gateway's side of Redis: its connections, submitting and cancelling jobs, and one job's
reply stream with the entry ids that become server-sent event ids (which models live workers
serve and how deep their queues are: producer/fleet_view.py).

Connections come from bounded *blocking* pools: with more requests in flight than connections,
a request waits for a free one instead of failing (redis-py's default asyncio pool raises
MaxConnectionsError past 100).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncGenerator, Mapping
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from producer.client import DEFAULT_CANCEL_TTL, DEFAULT_IDEMPOTENCY_TTL, DEFAULT_STREAM_TTL
from producer.connection import connect_async, retryable
from producer.events import ClientEvent, DoneEvent
from producer.lanes import job_stream
from producer.openai_schema import GatewayError
from producer.protocol import (
    PROTOCOL_VERSION,
    SUBMIT_LUA,
    JobSpec,
    Keys,
    ProtocolError,
)
from producer.reply_hub import ReplyHub, Subscription
from producer.reply_reader import BLOCK_MS, REPLY_READ_COUNT, ReplyReader, entry_key
from producer.results import reply_expired_async
from producer.shards import ShardCounts, sharded_job_id
from producer.slot_hubs import SlotHubs

# A job's error code -> (HTTP status, OpenAI error type).
_ERROR_STATUS: dict[str, tuple[int, str]] = {
    "unknown_model": (404, "invalid_request_error"),
    "deadline_exceeded": (504, "timeout"),
    "cancelled": (499, "cancelled"),
    "engine_error": (500, "server_error"),
    "max_attempts": (500, "server_error"),
    "no_result": (500, "server_error"),
}


def error_status(event: Mapping[str, Any]) -> GatewayError:
    """An error event as an OpenAI error: bad input is a 400 unless the code says otherwise."""
    status, type_ = _ERROR_STATUS.get(event["code"], (400, "invalid_request_error"))
    return GatewayError(status, event["message"], type_=type_, code=event["code"])


class GatewayRedis:
    """Commands on one pool, blocking reply reads (XREAD BLOCK) on another."""

    def __init__(self, url: str, keys: Keys, max_connections: int) -> None:
        self.keys = keys
        self.conn = connect_async(url, max_connections=max(8, max_connections // 8))
        self.blocking_conn = connect_async(url, max_connections=max_connections,
                                           socket_timeout=BLOCK_MS / 1000 + 10)
        self._submit_script = self.conn.register_script(SUBMIT_LUA)
        self.shard_counts = ShardCounts(keys)

    async def new_job_id(self, model: str) -> str:
        """A fresh id in one of the model's shards (producer/shards.py)."""
        return sharded_job_id(model, await self.shard_counts.get_async(self.conn, model))

    async def submit(self, spec: JobSpec, payload: bytes) -> bool:
        """Enqueue a checked job once per id (Client.submit's recipe); False: the id existed.
        `payload`: the job encoded (encode_job_entry's "job")."""
        entry_id = await self._submit_script(
            keys=[self.keys.idem(spec.id, spec.model), job_stream(self.keys, spec)],
            args=[DEFAULT_IDEMPOTENCY_TTL, PROTOCOL_VERSION, payload, DEFAULT_STREAM_TTL])
        return entry_id is not None

    async def cancel(self, job_id: str, model: str) -> None:
        pipe = self.conn.pipeline(transaction=False)
        pipe.set(self.keys.cancel(job_id, model), 1, ex=DEFAULT_CANCEL_TTL)
        pipe.spublish(self.keys.cancel_channel(model), job_id)
        await pipe.execute()

    async def close(self) -> None:
        await self.conn.aclose()
        await self.blocking_conn.aclose()


_ENTRY_ID_RE = re.compile(r"[0-9]{1,20}(-[0-9]{1,20})?")


def check_last_event_id(value: str | None) -> str | None:
    """A Last-Event-ID header is a reply entry id (what this gateway sent as `id:`), or a 400."""
    if value is None or _ENTRY_ID_RE.fullmatch(value):
        return value
    raise GatewayError(400, f"Last-Event-ID {value[:64]!r} is not a reply entry id "
                       "(<ms>-<seq>, as the id: lines of this stream)", param="Last-Event-ID",
                       code="bad_last_event_id")


class JobReader:
    """One job's reply stream, deduplicated across attempts, as (entry id, event) pairs: the
    reads and waits around a ReplyReader (producer/reply_reader.py has the rules). With
    `after`, everything up to that entry is read and folded into the deduper but not yielded: a
    resumed stream continues exactly where the client stopped. What the deduper made of those
    entries is kept in `replayed` (complete by the first yield), so the caller can bring its own
    per-stream state up to where the client is."""

    def __init__(self, conn: aioredis.Redis, reply_key: str, job_id: str, after: str | None,
                 timeout_s: float, idem_key: str | None = None,
                 hub: ReplyHub | SlotHubs | None = None) -> None:
        self.conn = conn
        self.hub = hub  # the process's shared reader (None: XREAD on `conn` itself)
        self.reply_key = reply_key
        self.idem_key = idem_key  # its ended mark tells an expired result from a queued job
        self.job_id = job_id
        self.timeout_s = timeout_s
        self.reader = ReplyReader(timeout_s, time.monotonic(), after=after or None)
        self.batch_left = 0  # events read with the one just yielded, still to come

    @property
    def created(self) -> int | None:
        """Epoch seconds of the first reply entry (its id's clock); None before one is read."""
        first = self.reader.first_id
        return None if first is None else entry_key(first)[0] // 1000

    @property
    def replayed(self) -> list[ClientEvent]:
        """The events the client had before `after`."""
        return self.reader.replayed

    async def events(self) -> AsyncGenerator[tuple[str, ClientEvent], None]:
        sub = self.hub.subscribe(self.reply_key) if self.hub is not None else None
        try:
            async for item in self._events(sub):
                yield item
        finally:
            if sub is not None and self.hub is not None:
                self.hub.unsubscribe(sub)

    async def _read(self, sub: Subscription | None) -> list[Any] | None:
        """The entries after the reader's cursor; None when Redis could not be read."""
        reader = self.reader
        block_ms = reader.block_ms(time.monotonic())
        if sub is not None and self.hub is not None:
            return await self.hub.next(sub, block_ms / 1000)
        try:
            resp: Any = await self.conn.xread({self.reply_key: reader.cursor},
                                              count=REPLY_READ_COUNT, block=block_ms)
        except RedisError as exc:
            if not retryable(exc):
                raise
            # Redis is down: a refused connect fails at once, so wait before the next try
            # (without it, every open stream would spin the event loop at full CPU).
            await asyncio.sleep(reader.read_failed(time.monotonic()))
            return None
        return [entry for _key, entries in resp or [] for entry in entries]

    async def _events(self, sub: Subscription | None
                      ) -> AsyncGenerator[tuple[str, ClientEvent], None]:
        reader = self.reader
        while True:
            entries = await self._read(sub)
            try:
                batch = [] if entries is None else list(reader.feed(
                    entries, caught_up=None if sub is None else not sub.behind))
            except ProtocolError as exc:  # not a worker's writing: nothing to relay
                raise GatewayError(502, f"job {self.job_id}: its reply stream holds an entry "
                                   f"that is not a genq event ({exc.message})",
                                   type_="server_error", code="bad_reply") from None
            for k, item in enumerate(batch):
                self.batch_left = len(batch) - 1 - k
                yield item
            if reader.finished:
                return
            if reader.expiry_check_due(time.monotonic()) and await self._expired():
                raise GatewayError(410, f"job {self.job_id} ended, but its reply stream has "
                                   "expired (the workers' --result-ttl); submit it under a new "
                                   "id to run it again", code="result_expired")
            if reader.timed_out(time.monotonic()):
                raise GatewayError(504, f"job {self.job_id} did not finish within "
                                   f"{self.timeout_s:.0f} s", type_="timeout",
                                   code="deadline_exceeded")

    async def _expired(self) -> bool:
        return self.idem_key is not None and await reply_expired_async(
            self.conn, self.idem_key, self.reply_key)

    async def result(self) -> DoneEvent:
        """The done event; an error event raises its GatewayError."""
        async for _entry_id, event in self.events():
            if event["type"] == "done":
                return event
            if event["type"] == "error":
                raise error_status(event)
        raise GatewayError(500, f"job {self.job_id}: the reply ended without a result",
                           type_="server_error")
