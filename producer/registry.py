"""The worker registry: which workers serve which model, read without a SCAN.

Workers list themselves (worker/heartbeat.py): their model in `Keys.models`, their name in the
model's set `Keys.workers(model)`, next to their heartbeat `Keys.worker(model, name)`. A model's
set and heartbeats share its slot, so one MGET reads them on a cluster as on one server; a SCAN
would see only the node it ran on.
"""

from __future__ import annotations

from typing import Any

import redis

from producer.protocol import Keys, ProtocolError, as_str, decode_heartbeat

Heartbeat = tuple[str, str, dict[str, Any]]  # model, worker name, heartbeat info


def _live(model: str, names: list[str], values: list[Any]) -> list[Heartbeat]:
    """The listed workers whose heartbeat is alive (an expired one is gone: not listed)."""
    out = []
    for name, value in zip(names, values, strict=True):
        if not isinstance(value, bytes):
            continue
        try:
            out.append((model, name, decode_heartbeat(value)))
        except ProtocolError:
            continue
    return out


def _names(raw: Any) -> list[str]:
    return sorted(as_str(n) for n in raw or ())


def heartbeats(conn: redis.Redis, keys: Keys) -> list[Heartbeat]:
    """Every live worker of every registered model, sorted by model then name."""
    models = _names(conn.smembers(keys.models))
    pipe = conn.pipeline(transaction=False)
    for model in models:
        pipe.smembers(keys.workers(model))
    out: list[Heartbeat] = []
    for model, raw in zip(models, pipe.execute() if models else [], strict=True):
        names = _names(raw)
        if names:
            out += _live(model, names, conn.mget([keys.worker(model, n) for n in names]))
    return out


async def heartbeats_async(conn: Any, keys: Keys) -> list[Heartbeat]:
    """heartbeats() on a redis.asyncio connection."""
    models = _names(await conn.smembers(keys.models))
    out: list[Heartbeat] = []
    for model in models:
        names = _names(await conn.smembers(keys.workers(model)))
        if names:
            out += _live(model, names, await conn.mget([keys.worker(model, n) for n in names]))
    return out
