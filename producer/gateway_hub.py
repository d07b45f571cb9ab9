"""One reader of reply streams per gateway process, fanned out to the requests reading them.

Each request that reads a job's reply stream subscribes to its key with a cursor of its own; one
task keeps one XREAD BLOCK in flight over every subscribed key (at the lowest cursor of each)
and hands each subscription the entries past its cursor. An engine step's tokens for a hundred
streams then cost one Redis read and one connection, not a hundred of each.

A subscription that the XREAD in flight does not cover (a new key, or a resume that reads a
key from its start) is picked up at once: the hub wakes its own blocked XREAD with CLIENT
UNBLOCK. Where the Redis user may not run CLIENT (an ACL), the hub blocks for at most
`fallback_block_ms` instead, so a new subscription waits at most that long.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from redis import ConnectionError as RedisConnectionError
from redis import ResponseError
from redis import TimeoutError as RedisTimeoutError

from producer.client import BLOCK_MS, REPLY_READ_COUNT

log = logging.getLogger("uvicorn.error")
Entry = tuple[Any, Any]  # (entry id, fields) as XREAD gives them


def entry_key(entry_id: str | bytes) -> tuple[int, int]:
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


@dataclass(eq=False)
class Subscription:
    key: str
    cursor: tuple[int, int] = (0, 0)  # entries up to here were handed over
    inbox: asyncio.Queue[list[Entry]] = field(default_factory=asyncio.Queue)


class ReplyHub:
    def __init__(self, url: str, control: aioredis.Redis, block_ms: int = BLOCK_MS,
                 fallback_block_ms: int = 20) -> None:
        self.conn = aioredis.Redis.from_url(
            url, protocol=2, single_connection_client=True, socket_connect_timeout=5.0,
            socket_timeout=block_ms / 1000 + 10)
        self.control = control  # another connection: CLIENT UNBLOCK reaches the blocked one
        self.block_ms = block_ms
        self.fallback_block_ms = fallback_block_ms
        self._subs: dict[str, list[Subscription]] = {}
        self._in_flight: dict[str, str] | None = None  # the streams of the XREAD now blocked
        self._client_id: int | None = None
        self._can_unblock = True
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()

    def subscribe(self, key: str) -> Subscription:
        sub = Subscription(key)
        self._subs.setdefault(key, []).append(sub)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())
        self._wake.set()
        if self._in_flight is not None and self._in_flight.get(key) != "0-0":
            self._unblock()  # the XREAD in flight does not read this key from its start
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        subs = self._subs.get(sub.key, [])
        if sub in subs:
            subs.remove(sub)
        if not subs:
            self._subs.pop(sub.key, None)

    async def next(self, sub: Subscription, timeout_s: float) -> list[Entry]:
        """The entries past the subscription's cursor, waiting up to timeout_s ([]: none)."""
        if not sub.inbox.empty():
            return sub.inbox.get_nowait()
        try:
            return await asyncio.wait_for(sub.inbox.get(), timeout_s)
        except asyncio.TimeoutError:
            return []

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
        await self.conn.aclose()

    # ------------------------------------------------------------------ the reader task

    def _unblock(self) -> None:
        if not self._can_unblock or self._client_id is None:
            return
        task = asyncio.get_running_loop().create_task(self._send_unblock(self._client_id))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send_unblock(self, client_id: int) -> None:
        try:
            await self.control.client_unblock(client_id)
        except ResponseError:  # (NOPERM under an ACL without CLIENT)
            self._can_unblock = False
        except (RedisConnectionError, RedisTimeoutError):
            pass

    async def _learn_client_id(self) -> None:
        if not self._can_unblock or self._client_id is not None:
            return
        try:
            self._client_id = int(await self.conn.client_id())
        except ResponseError:
            self._can_unblock = False

    async def _run(self) -> None:
        backoff = 0.05
        while True:
            if not self._subs:
                self._wake.clear()
                await self._wake.wait()
                continue
            streams: dict[Any, Any] = {key: "{}-{}".format(*min(s.cursor for s in subs))
                                       for key, subs in self._subs.items()}
            try:
                await self._learn_client_id()
                self._in_flight = streams
                block = self.block_ms if self._can_unblock else self.fallback_block_ms
                resp: Any = await self.conn.xread(streams, count=REPLY_READ_COUNT, block=block)
                backoff = 0.05
            except (RedisConnectionError, RedisTimeoutError):
                # Redis is down: each reader times out on its own deadline; retry, not spin
                self._client_id = None  # (a new connection has a new id)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
                continue
            finally:
                self._in_flight = None
            for raw_key, entries in resp or []:
                key = raw_key.decode() if isinstance(raw_key, bytes) else raw_key
                self._dispatch(self._subs.get(key, []), entries)

    @staticmethod
    def _dispatch(subs: list[Subscription], entries: list[Entry]) -> None:
        if not entries:
            return
        first, last = entry_key(entries[0][0]), entry_key(entries[-1][0])
        for sub in subs:
            if sub.cursor < first:
                batch = entries  # (the common case: nothing to filter)
            else:
                batch = [e for e in entries if entry_key(e[0]) > sub.cursor]
            if batch:
                sub.inbox.put_nowait(batch)
                sub.cursor = last
