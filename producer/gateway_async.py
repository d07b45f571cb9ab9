"""Small asyncio helpers for the gateway's requests: awaiting work while watching the HTTP client,
and chaining async iterators."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from fastapi import Request

T = TypeVar("T")


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


async def anext_or_none(it: AsyncIterator[T]) -> T | None:
    try:
        return await it.__anext__()
    except StopAsyncIteration:
        return None


async def chain(first: list[T], rest: AsyncIterator[T]) -> AsyncIterator[T]:
    for item in first:
        yield item
    async for item in rest:
        yield item


async def watch_disconnect(request: Request, work: Awaitable[T], poll_s: float = 0.25) -> T:
    """Await `work`; raise ClientGone (and cancel it) if the HTTP client disconnects first."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientGone
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


