"""One reader of reply streams per process, fanned out to the coroutines reading them.

Each reader of a job's reply stream (a gateway request, an AsyncJob) subscribes to its key with a
cursor of its own; one task keeps one XREAD BLOCK in flight over every subscribed key (at the
lowest cursor of each) and hands each subscription the entries past its cursor. An engine step's
tokens for a hundred streams then cost one Redis read and one connection, not a hundred of each.

A subscription that the XREAD in flight does not cover (a new key, or a key read from before the
cursor in flight: a resume) is picked up at once: a new reader generation starts an XREAD over
all keys, and the older one ends once its XREAD returns, handing nothing over: the newer XREAD
was sent from cursors no further on, so it reads the same entries (each subscription's cursor
drops anything it already has). No Redis command beyond XREAD is needed. Of one XREAD's
streams, those getting their first entries are handed over first.

On a Redis Cluster one XREAD may not cross slots, but a model's reply streams share its slot
(the hash tag of its name, producer/keys.py): producer/slot_hubs.py keeps one hub per slot, all
on one cluster client, whose XREADs go through the client (it follows a slot that moves).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from redis.exceptions import ResponseError

from producer.connection import connect_async, retryable
from producer.reply_reader import BLOCK_MS, REPLY_READ_COUNT, entry_key

Entry = tuple[Any, Any]  # (entry id, fields) as XREAD gives them


@dataclass(eq=False)
class Subscription:
    key: str
    cursor: tuple[int, int] = (0, 0)  # entries up to here were handed over
    inbox: list[Entry] = field(default_factory=list)  # handed over, not yet taken
    waiter: asyncio.Future[None] | None = None  # next()'s, while it waits
    behind: bool = False  # the last XREAD of its key came back full: more may wait in Redis
    error: Exception | None = None  # the reader's XREAD was refused: next() raises it
    home: Any = None  # on a cluster, the hub of its slot (producer/slot_hubs.py)


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class ReplyHub:
    def __init__(self, url: str, block_ms: int = BLOCK_MS, max_connections: int = 64,
                 conn: Any = None) -> None:
        """`conn`: a cluster client to share (producer/slot_hubs.py's; closed by its owner);
        None: a pool of its own, whose connections each reader generation holds."""
        self.shared = conn
        self.conn = conn if conn is not None else connect_async(
            url, max_connections=max_connections, socket_timeout=block_ms / 1000 + 10)
        self.block_ms = block_ms
        self._subs: dict[str, list[Subscription]] = {}
        self._fresh = 0  # subscriptions handed no entry yet (their streams go first)
        self._generation = 0  # the newest reader's; older readers end after their XREAD
        self._in_flight: dict[str, str] | None = None  # the newest reader's blocked XREAD
        self._restart_due = False
        self._wake = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False

    @property
    def subscriptions(self) -> int:
        return sum(map(len, self._subs.values()))

    def subscribe(self, key: str, after: str = "0-0") -> Subscription:
        """Entries of `key` past the entry id `after` (from its start by default)."""
        sub = Subscription(key, entry_key(after))
        self._subs.setdefault(key, []).append(sub)
        self._fresh += sub.cursor == (0, 0)
        self._wake.set()
        in_flight = None if self._in_flight is None else self._in_flight.get(key)
        if not self._tasks or (self._in_flight is not None and (
                in_flight is None or entry_key(in_flight) > sub.cursor)):
            self._restart_soon()  # (no reader, or its XREAD reads this key from further on)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        subs = self._subs.get(sub.key, [])
        if sub in subs:
            subs.remove(sub)
            self._fresh -= sub.cursor == (0, 0)
        if not subs:
            self._subs.pop(sub.key, None)

    async def next(self, sub: Subscription, timeout_s: float) -> list[Entry]:
        """The entries past the subscription's cursor, waiting up to timeout_s ([]: none);
        while `sub.behind`, until the reader has read on (its XREAD returns at once then, or
        fails and clears `behind`). (A bare future and a timer: a stream waits here for every
        token.) An XREAD Redis refused (not a lost connection) raises its error."""
        if self._closed and sub.error is None:
            sub.error = RuntimeError("the reply reader is closed")
        if not sub.inbox and sub.error is None:
            loop = asyncio.get_running_loop()
            sub.waiter = loop.create_future()
            if sub.behind:
                timeout_s = max(timeout_s, self.block_ms / 1000 + 10)
            timer = loop.call_later(timeout_s, _wake, sub.waiter)
            try:
                await sub.waiter
            finally:
                timer.cancel()
                sub.waiter = None
        if sub.error is not None and not sub.inbox:
            error, sub.error = sub.error, None
            raise error
        entries, sub.inbox = sub.inbox, []
        return entries

    async def close(self) -> None:
        """Stop reading; a reader waiting in next(), or calling it later, gets a RuntimeError
        instead of waiting on a hub that reads no more."""
        self._closed = True
        self._fail(RuntimeError("the reply reader is closed (its client or gateway was "
                                "closed while this stream was read)"))
        self._generation += 1
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.shared is None:
            await self.conn.aclose()

    # ------------------------------------------------------------------ the readers

    def _restart_soon(self) -> None:
        """A new reader generation, once per event-loop turn however many subscribe in it."""
        if self._restart_due:
            return
        self._restart_due = True
        asyncio.get_running_loop().call_soon(self._restart)

    def _restart(self) -> None:
        self._restart_due = False
        self._generation += 1
        task = asyncio.get_running_loop().create_task(self._run(self._generation))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, generation: int) -> None:
        reads = _HeldConnection(self.conn.connection_pool) if self.shared is None \
            else _ClusterReads(self.conn)
        backoff = 0.05
        try:
            while generation == self._generation:
                if not self._subs:
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                streams: dict[Any, Any] = {key: "{}-{}".format(*min(s.cursor for s in subs))
                                           for key, subs in self._subs.items()}
                self._in_flight = streams
                try:
                    resp = await reads.xread(streams, self.block_ms)
                    backoff = 0.05
                except Exception as exc:
                    lost = retryable(exc) or isinstance(exc, OSError)
                    if lost:
                        # Redis is down, or its primary became a replica under the blocked
                        # XREAD (a failover: UNBLOCKED): connect again (to the primary Sentinel
                        # names now). Each reader times out on its own deadline (nothing can be
                        # read on now, so none is behind); retry, not spin.
                        await reads.reset()
                    # A refusal (an ACL, a reply key that is not a stream): every reader
                    # raises it, rather than wait on a dead read.
                    self._fail(None if lost else exc)
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, 2.0)
                    continue
                finally:
                    if generation == self._generation:
                        self._in_flight = None
                if generation != self._generation:
                    return  # (the newer reader's XREAD, sent from cursors no further on, has it)
                self._hand_over(resp)
        finally:
            await reads.close()

    def _hand_over(self, resp: Any) -> None:
        """An XREAD's answer ([[key, [[id, [field, value, ...]], ...]], ...] or None) to the
        subscriptions of its keys."""
        batches = [(key.decode() if isinstance(key, bytes) else key,
                    [(entry_id, kv if isinstance(kv, dict)  # (the cluster client's, parsed)
                      else dict(zip(kv[::2], kv[1::2], strict=True)) if kv else {})
                     for entry_id, kv in entries])
                   for key, entries in resp or []]
        # Streams about to get their first entries go first: their requests' tasks wake
        # first, so a first token is not sent after every other stream's token of the step.
        if self._fresh:
            batches.sort(key=lambda batch: all(
                sub.cursor != (0, 0) for sub in self._subs.get(batch[0], ())))
        for key, entries in batches:
            self._dispatch(self._subs.get(key, []), entries)

    def _fail(self, error: Exception | None) -> None:
        for subs in self._subs.values():
            for sub in subs:
                if error is not None or sub.behind:
                    sub.behind, sub.error = False, error
                    if sub.waiter is not None:
                        _wake(sub.waiter)

    def _dispatch(self, subs: list[Subscription], entries: list[Entry]) -> None:
        if not entries:
            return
        first, last = entry_key(entries[0][0]), entry_key(entries[-1][0])
        for sub in subs:
            sub.behind = len(entries) >= REPLY_READ_COUNT
            if sub.cursor < first:
                batch = entries  # (the common case: nothing to filter)
            else:
                batch = [e for e in entries if entry_key(e[0]) > sub.cursor]
            if batch:
                self._fresh -= sub.cursor == (0, 0)
                sub.inbox += batch
                sub.cursor = last
                if sub.waiter is not None:
                    _wake(sub.waiter)


class _HeldConnection:
    """A reader generation's XREADs on one connection of the pool, held for its life and sent
    on directly: redis-py's per-command path (take a connection from the pool, check it, give
    it back, the retry wrapper) costs as much CPU as the XREAD's own write, and the hub sends
    one or two per engine step."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.conn: Any = None
        self.sent = False  # an XREAD is in flight (a reader cancelled then must drop it)

    async def xread(self, streams: dict[Any, Any], block_ms: int) -> Any:
        if self.conn is None:
            self.conn = await self.pool.get_connection()
        self.sent = True
        await self.conn.send_command("XREAD", "COUNT", REPLY_READ_COUNT, "BLOCK", block_ms,
                                     "STREAMS", *streams, *streams.values())
        try:
            resp = await self.conn.read_response()
        except ResponseError:  # (an error answer, read whole: the connection is clean)
            self.sent = False
            raise
        self.sent = False
        return resp

    async def reset(self) -> None:
        self.sent = False
        if self.conn is not None:
            await self.conn.disconnect()  # (the next send connects again)

    async def close(self) -> None:
        if self.conn is not None:
            if self.sent:  # (its answer would be read by the connection's next user)
                await self.conn.disconnect()
            await self.pool.release(self.conn)


class _ClusterReads:
    """XREADs through the cluster client: to the node of their slot, following a slot that
    moves (per command: a cluster's XREAD takes the client's path)."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn

    async def xread(self, streams: dict[Any, Any], block_ms: int) -> Any:
        return await self.conn.xread(streams, count=REPLY_READ_COUNT, block=block_ms)

    async def reset(self) -> None:
        pass

    async def close(self) -> None:
        pass
