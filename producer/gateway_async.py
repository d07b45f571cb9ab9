"""Small asyncio helpers for the gateway's requests: awaiting work while watching the HTTP client,
and chaining async iterators."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import Request

T = TypeVar("T")
_CANCELLED_WAIT_S = 1.0  # the longest a client's going away waits for the work it cancels


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


async def watch_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`; raise ClientGone (and cancel it) if the HTTP client disconnects first. The
    request's body is read by now, so its next ASGI message is the disconnect: awaited, not
    polled (a poll per request every quarter second was a gateway's CPU under a flood)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        raise ClientGone
    finally:
        for pending in (task, gone):
            if not pending.done():
                pending.cancel()
        # Bounded: what the client's going away must do next (cancel its job) never waits on
        # a cancelled read that is slow to end (seen under load: a request whose job was never
        # cancelled). What it ends with is retrieved, not raised.
        await asyncio.wait({task, gone}, timeout=_CANCELLED_WAIT_S)
        for pending in (task, gone):
            pending.add_done_callback(_retrieve)


def _retrieve(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass  # (what is left of a body read already)
