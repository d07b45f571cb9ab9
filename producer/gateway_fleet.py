"""The gateway's side of Redis: its connections, submitting and cancelling jobs, which models live
workers serve, how deep their queues are, and one job's reply stream with the entry ids that
become server-sent event ids.

Connections come from bounded *blocking* pools: with more requests in flight than connections,
a request waits for a free one instead of failing (redis-py's default asyncio pool raises
MaxConnectionsError past 100).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncGenerator, Coroutine, Mapping
from typing import Any

import redis.asyncio as aioredis
from redis import ConnectionError as RedisConnectionError
from redis import TimeoutError as RedisTimeoutError

from producer.client import DEFAULT_CANCEL_TTL, DEFAULT_IDEMPOTENCY_TTL, DEFAULT_STREAM_TTL
from producer.connection import connect_async
from producer.events import ClientEvent, DoneEvent
from producer.gateway_hub import ReplyHub, Subscription
from producer.gateway_limits import check_queue_room
from producer.lanes import job_stream, lane_keys
from producer.openai_schema import GatewayError
from producer.protocol import (
    PROTOCOL_VERSION,
    SUBMIT_LUA,
    JobSpec,
    Keys,
    ProtocolError,
    waiting_entries,
)
from producer.registry import heartbeats_async
from producer.reply_reader import BLOCK_MS, REPLY_READ_COUNT, ReplyReader, entry_key
from producer.results import reply_expired_async
from producer.shards import ShardCounts, sharded_job_id

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


class FleetView:
    """Live workers' models (from heartbeats) and queue depths, read for the requests: no
    request waits on Redis for either unless it is about to be refused.

    The live models are re-read once the last read is `cache_s` old, in the background: the
    requests meanwhile go by that last read, and one whose model is not in it waits for a
    fresh one before its 404 or 503. A request is admitted against the last count of its
    model's queue plus what this gateway admitted since; a count `depth_cache_s` old is
    replaced by a new one, read in the background, one at a time however many requests ask (a
    flood costs Redis a read per interval, not one per request). A request that the last count
    would refuse waits for a fresh count, so a queue that drained admits at once."""

    def __init__(self, conn: aioredis.Redis, keys: Keys, cache_s: float = 1.0,
                 depth_cache_s: float = 0.1) -> None:
        self.conn = conn
        self.keys = keys
        self.cache_s = cache_s
        self.depth_cache_s = depth_cache_s
        self._models: dict[str, int] = {}
        self._models_at = -1e9
        self.shard_counts = ShardCounts(keys)
        # model -> [depth counted + admitted since, when counted]; the count in flight
        self._depths: dict[str, list[float]] = {}
        self._counting: dict[str, asyncio.Future[None]] = {}
        self._reading_models: asyncio.Future[None] | None = None

    async def close(self) -> None:
        """Stop the reads under way (before the connection closes)."""
        tasks = [t for t in (self._reading_models, *self._counting.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def live_models(self, fresh: bool = False) -> dict[str, int]:
        """{served model name: number of live workers}: as last read (a read older than cache_s
        starts a new one), or as read now when `fresh` or never read."""
        if fresh or self._models_at < 0:
            await asyncio.shield(self._read_models())
        elif time.monotonic() - self._models_at >= self.cache_s:
            self._read_models()
        return self._models

    def _read_models(self) -> asyncio.Future[None]:
        """The read of the live models under way, or a new one."""
        if self._reading_models is None:
            self._reading_models = _started(self._models_now())
        return self._reading_models

    async def _models_now(self) -> None:
        try:
            values = await heartbeats_async(self.conn, self.keys)
            models: dict[str, int] = {}
            for model, _name, _info in values:
                models[model] = models.get(model, 0) + 1
            self._models, self._models_at = models, time.monotonic()
        finally:
            self._reading_models = None

    async def queue_depth(self, model: str) -> int | None:
        """Jobs of the model not finished, over its shards' priority lanes: waiting
        for a worker + held by workers (pending). None when the model has no job stream."""
        shards = await self.shard_counts.get_async(self.conn, model)
        lanes = [key for shard in range(shards) for key in lane_keys(self.keys, model, shard)]
        pipe = self.conn.pipeline(transaction=False)
        for key in lanes:
            pipe.xinfo_groups(key)
            pipe.xlen(key)
        replies = await pipe.execute(raise_on_error=False)
        depths = [self._lane_depth(groups, length)
                  for groups, length in zip(replies[::2], replies[1::2], strict=True)]
        known = [d for d in depths if d is not None]
        return sum(known) if known else None

    def _lane_depth(self, groups: Any, length: Any) -> int | None:
        if isinstance(groups, Exception) or isinstance(length, Exception):
            return None  # no such stream
        for group in groups:
            name = group["name"]
            if (name.decode() if isinstance(name, bytes) else name) == self.keys.group:
                pending = int(group.get("pending") or 0)
                return waiting_entries(group.get("lag"), pending, int(length)) + pending
        return int(length)

    async def require_model(self, model: str, max_queue_depth: int,
                            num_sequences: int = 1) -> None:
        """404 unknown model, 503 a queue but no live worker, 429 the queue has no room for
        `num_sequences` more (400: it never will)."""
        try:
            self.keys.jobs(model)
        except ProtocolError as exc:
            raise GatewayError(404, exc.message, param="model", code="model_not_found") from None
        if model not in await self.live_models() and model not in await self.live_models(
                fresh=True):
            depth = await self.queue_depth(model)
            if depth is None:
                raise GatewayError(404, f"the model {model!r} does not exist: no live worker "
                                   "serves it (see /v1/models)", param="model",
                                   code="model_not_found")
            raise GatewayError(503, f"no live worker serves {model!r} right now; retry later",
                               type_="server_error", code="no_worker")
        depth = self._recent_depth(model)
        if depth is None or depth + num_sequences > max_queue_depth:
            await asyncio.shield(self._counted(model))  # (one that goes away leaves it to the rest)
            depth = int(self._depths[model][0])
        check_queue_room(model, depth, num_sequences, max_queue_depth)
        self._depths[model][0] += num_sequences  # (admitted: counted until the next read)

    def _recent_depth(self, model: str) -> int | None:
        """The model's queue depth as last counted plus what was admitted since (None: never
        counted); a count older than depth_cache_s starts a new one."""
        known = self._depths.get(model)
        if known is None:
            return None
        if time.monotonic() - known[1] >= self.depth_cache_s:
            self._counted(model)
        return int(known[0])

    def _counted(self, model: str) -> asyncio.Future[None]:
        """The count of the model's queue under way, or a new one."""
        task = self._counting.get(model)
        if task is None:
            task = self._counting[model] = _started(self._count(model))
        return task

    async def _count(self, model: str) -> None:
        started = time.monotonic()
        try:
            self._depths[model] = [await self.queue_depth(model) or 0, started]
        finally:
            self._counting.pop(model, None)


def _started(read: Coroutine[Any, Any, None]) -> asyncio.Future[None]:
    """A read as a task that requests may wait for or not: when none does, its failure (Redis
    down) is left for the next read to meet, not logged as never retrieved."""
    task = asyncio.ensure_future(read)
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
    return task


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
                 hub: ReplyHub | None = None) -> None:
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
        except (RedisConnectionError, RedisTimeoutError):
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
                batch = [] if entries is None else list(reader.feed(entries))
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
