"""What the gateway knows of the fleet for its admission checks: which models live workers
serve (from their heartbeats) and how deep each model's queue is, read behind the requests so
that none waits on Redis for them."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import Any

import redis.asyncio as aioredis

from producer.gateway_limits import check_queue_room
from producer.lanes import lane_keys
from producer.openai_schema import GatewayError
from producer.protocol import Keys, ProtocolError, waiting_entries
from producer.registry import heartbeats_async
from producer.shards import ShardCounts


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
