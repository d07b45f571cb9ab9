"""The shared reply reader (the gateway's and AsyncClient's) against a real redis-server: every
subscription gets each entry of its key once, in order, whether it joined a key another
subscription reads further on, or a key the XREAD in flight did not cover; it starts after the
entry it names, knows when it is behind a full read, and raises what Redis refuses."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from redis.exceptions import ResponseError

from producer.reply_hub import ReplyHub
from tests.harness.fleet import RedisServer, blocked_xreads


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


def test_streams_getting_their_first_entries_are_handed_over_first(
        redis_server: RedisServer) -> None:
    """Of one XREAD's streams, a new request's stream wakes its reader before streams that
    already had entries, whatever their order in the XREAD: a first token is not sent after
    every other stream's token of the same engine step."""
    conn = redis_server.client()

    async def scenario() -> list[str]:
        hub = ReplyHub(redis_server.url)
        try:
            old, new = hub.subscribe("r:old"), hub.subscribe("r:new")  # (one reader for all)
            hub.subscribe("r:trigger")
            conn.xadd("r:old", {"n": b"1"})
            assert ids(await hub.next(old, 30)) == [b"1"]
            order: list[str] = []

            async def wait(sub: Any, name: str) -> None:
                assert len(await hub.next(sub, 30)) == 1
                order.append(name)

            waits = [asyncio.ensure_future(wait(old, "old")),
                     asyncio.ensure_future(wait(new, "new"))]
            await asyncio.sleep(0.1)  # both wait; the XREAD in flight reads r:old, then r:new
            # One transaction: a blocked XREAD returns with r:trigger alone (Redis 7.0) or with
            # all three streams (7.2); either way r:old and r:new come back in one reply.
            pipe = conn.pipeline(transaction=True)
            pipe.xadd("r:trigger", {"n": b"t"})
            pipe.xadd("r:old", {"n": b"2"})
            pipe.xadd("r:new", {"n": b"a"})
            pipe.execute()
            await asyncio.gather(*waits)
            return order
        finally:
            await hub.close()

    assert asyncio.run(scenario()) == ["new", "old"]


def test_a_subscription_starts_after_the_entry_it_names_and_knows_when_it_is_behind(
        redis_server: RedisServer) -> None:
    """`after`: only later entries; a key read from before the cursor in flight is read again
    from there. A full XREAD (512 entries) leaves the subscription `behind` until the rest is
    read."""
    conn = redis_server.client()
    first_ids = [conn.xadd("r:c", {"n": str(n).encode()}) for n in range(3)]

    async def scenario() -> None:
        hub = ReplyHub(redis_server.url)
        try:
            late = hub.subscribe("r:c", after=first_ids[1].decode())
            assert ids(await hub.next(late, 30)) == [b"2"]
            await asyncio.sleep(0.05)  # (the XREAD in flight reads r:c after entry 2)
            early = hub.subscribe("r:c", after=first_ids[0].decode())
            assert ids(await hub.next(early, 30)) == [b"1", b"2"]
            pipe = conn.pipeline(transaction=False)
            for n in range(600):
                pipe.xadd("r:long", {"n": str(n).encode()})
            pipe.execute()
            long = hub.subscribe("r:long")
            got = await hub.next(long, 30)
            assert (len(got), long.behind) == (512, True)
            # While behind, a wait shorter than the reader's next XREAD still gets the rest.
            rest = await hub.next(long, 0.001)
            assert (ids(got + rest), long.behind) == ([str(n).encode() for n in range(600)],
                                                      False)
        finally:
            await hub.close()

    asyncio.run(scenario())


def test_an_xread_redis_refuses_is_raised_to_each_reader(redis_server: RedisServer) -> None:
    """A reply key that is not a stream: the shared XREAD fails with WRONGTYPE, and each
    subscription's next() raises it instead of waiting out its timeout."""
    conn = redis_server.client()
    conn.set("r:not-a-stream", "x")

    async def scenario() -> list[str]:
        hub = ReplyHub(redis_server.url)
        try:
            subs = [hub.subscribe("r:not-a-stream"), hub.subscribe("r:fine")]
            errors = []
            for sub in subs:
                with pytest.raises(ResponseError) as exc:
                    await hub.next(sub, 600)
                errors.append(str(exc.value).split()[0])
            return errors
        finally:
            await hub.close()

    assert asyncio.run(scenario()) == ["WRONGTYPE", "WRONGTYPE"]


def test_a_subscription_reads_on_after_redis_restarts(redis_server: RedisServer) -> None:
    """The reader's held connection dies with the server: it connects again and reads on from
    each subscription's cursor."""

    async def scenario() -> list[bytes]:
        hub = ReplyHub(redis_server.url)
        try:
            sub = hub.subscribe("r:r")
            redis_server.client().xadd("r:r", {"n": b"before"})
            got = ids(await hub.next(sub, 30))
            await asyncio.to_thread(redis_server.restart, down_s=0.5)
            redis_server.client().xadd("r:r", {"n": b"after"})
            for _ in range(10):  # (each wait ends with the reader's failed reads, or 30 s)
                if len(got) == 2:
                    break
                got += ids(await hub.next(sub, 30))
            return got
        finally:
            await hub.close()

    assert asyncio.run(scenario()) == [b"before", b"after"]


def test_closing_the_hub_ends_the_waits_on_it(redis_server: RedisServer) -> None:
    """A reader waiting when its client closes the hub gets an error at once, not a wait on a
    hub that reads no more; so does one that asks afterwards."""

    async def scenario() -> list[str]:
        hub = ReplyHub(redis_server.url)
        sub = hub.subscribe("r:closing")
        waiting = asyncio.ensure_future(hub.next(sub, 600))
        await asyncio.sleep(0.05)
        await hub.close()
        errors = []
        for wait in (waiting, hub.next(sub, 600)):
            with pytest.raises(RuntimeError) as exc:
                await wait
            errors.append(str(exc.value).split(" (")[0])
        return errors

    assert asyncio.run(scenario()) == ["the reply reader is closed"] * 2


def test_an_unblocked_xread_is_read_again_not_raised(redis_server: RedisServer) -> None:
    """A primary that becomes a replica answers its blocked XREADs with UNBLOCKED (as CLIENT
    UNBLOCK ... ERROR does here): the reader connects again and reads on; nobody sees it."""
    conn = redis_server.client()

    def unblock_the_hub() -> int:
        blocked = blocked_xreads(conn)
        for client_id in blocked:
            conn.client_unblock(client_id, error=True)
        return len(blocked)

    async def scenario() -> tuple[int, list[bytes]]:
        hub = ReplyHub(redis_server.url)
        try:
            sub = hub.subscribe("r:u")
            conn.xadd("r:u", {"n": b"1"})
            got = ids(await hub.next(sub, 30))
            unblocked = 0
            for _ in range(300):  # (until the reader's next XREAD blocks)
                unblocked = await asyncio.to_thread(unblock_the_hub)
                if unblocked:
                    break
                await asyncio.sleep(0.01)
            conn.xadd("r:u", {"n": b"2"})
            for _ in range(10):
                if len(got) == 2:
                    break
                got += ids(await hub.next(sub, 30))
            return unblocked, got
        finally:
            await hub.close()

    assert asyncio.run(scenario()) == (1, [b"1", b"2"])
