"""The gateway's shared reply reader against a real redis-server: every subscription gets each
entry of its key once, in order, whether it joined a key another subscription reads further on,
or a key the XREAD in flight did not cover."""

from __future__ import annotations

import asyncio

from producer.gateway_hub import ReplyHub
from tests.harness.fleet import RedisServer


def ids(batch: list[tuple[bytes, dict[bytes, bytes]]]) -> list[bytes]:
    return [fields[b"n"] for _id, fields in batch]


def test_each_subscription_gets_every_entry_of_its_key_once(redis_server: RedisServer) -> None:
    conn = redis_server.client()

    async def scenario() -> None:
        hub = ReplyHub(redis_server.url)
        try:
            first = hub.subscribe("r:a")
            for n in (b"1", b"2", b"3"):
                conn.xadd("r:a", {"n": n})
            assert ids(await hub.next(first, 30)) == [b"1", b"2", b"3"]
            # A second reader of the same key (a resume) starts from the beginning; the first
            # gets nothing twice.
            second = hub.subscribe("r:a")
            assert ids(await hub.next(second, 30)) == [b"1", b"2", b"3"]
            conn.xadd("r:a", {"n": b"4"})
            assert ids(await hub.next(first, 30)) == [b"4"]
            assert ids(await hub.next(second, 30)) == [b"4"]
            # A key subscribed while the XREAD in flight blocks on the others is read too.
            await asyncio.sleep(0.05)
            other = hub.subscribe("r:b")
            conn.xadd("r:b", {"n": b"x"})
            assert ids(await hub.next(other, 30)) == [b"x"]
            hub.unsubscribe(first)
            conn.xadd("r:a", {"n": b"5"})
            assert ids(await hub.next(second, 30)) == [b"5"]
            assert first.inbox == [] and other.inbox == []
            # Nothing new within the wait: [] (and no waiter left behind); a wait that is
            # cancelled leaves none either.
            assert await hub.next(other, 0.05) == [] and other.waiter is None
            waiting = asyncio.ensure_future(hub.next(other, 30))
            await asyncio.sleep(0.05)
            waiting.cancel()
            await asyncio.gather(waiting, return_exceptions=True)
            assert waiting.cancelled() and other.waiter is None
            conn.xadd("r:b", {"n": b"y"})
            assert ids(await hub.next(other, 30)) == [b"y"]
        finally:
            await hub.close()

    asyncio.run(scenario())
