"""Queue shards: a hot model's jobs spread over k streams (`genq worker --shards k`), each
under a hash tag of its own ({m} for shard 0, {m#i} for shard i), so they land on different
Redis Cluster slots and nodes. Workers read all of the model's shards.

Producers learn k from `Keys.shards(model)` (the workers set it at start and keep it alive with
their heartbeats), cached for CACHE_S; none there: 1, exactly a model without shards. A job the
producer names (`new_job_id`) goes to a shard picked at random, and its id names the shard, so
its keys are found from the id alone and an idempotent resubmit (same id) lands on the same
shard. A job under an id of one's own goes to shard 0.
"""

from __future__ import annotations

import logging
import random
import time
from typing import Any

import redis

from producer.protocol import MAX_SHARDS, Keys, new_job_id

log = logging.getLogger("genq")
CACHE_S = 10.0


def parse_shards(raw: object) -> int:
    """k as the workers wrote it; 1 when it is missing or not a shard count."""
    try:
        k = int(raw.decode() if isinstance(raw, bytes) else str(raw)) if raw is not None else 1
    except ValueError:
        return 1
    return k if 1 <= k <= MAX_SHARDS else 1


class ShardCounts:
    """k per model, read from Redis at most once per CACHE_S."""

    def __init__(self, keys: Keys) -> None:
        self.keys = keys
        self._known: dict[str, tuple[int, float]] = {}

    def cached(self, model: str) -> int | None:
        known = self._known.get(model)
        return known[0] if known is not None and time.monotonic() < known[1] else None

    def remember(self, model: str, raw: object) -> int:
        k = parse_shards(raw)
        self._known[model] = (k, time.monotonic() + CACHE_S)
        return k

    def get(self, conn: Any, model: str) -> int:
        k = self.cached(model)
        if k is not None:
            return k
        try:
            raw = conn.get(self.keys.shards(model))
        except redis.exceptions.NoPermissionError as exc:  # an ACL without ~<p>:shards:*
            log.warning("reading %s refused (%s): submitting to shard 0", self.keys.shards(model),
                        exc)
            raw = None
        return self.remember(model, raw)

    async def get_async(self, conn: Any, model: str) -> int:
        k = self.cached(model)
        if k is not None:
            return k
        try:
            raw = await conn.get(self.keys.shards(model))
        except redis.exceptions.NoPermissionError:
            raw = None
        return self.remember(model, raw)


def sharded_job_id(model: str, shards: int) -> str:
    """A fresh id for a job of `model` in a shard picked at random among `shards`."""
    return new_job_id(model, random.randrange(shards) if shards > 1 else 0)
