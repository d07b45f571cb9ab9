"""AsyncClient and AsyncJob: the asyncio mirror of producer.client."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError, RedisError

from producer import connection
from producer.client import (
    DEFAULT_URL,
    ClientSettings,
    Messages,
    Prompt,
    make_job_spec,
)
from producer.errors import JobError, ResultExpired
from producer.events import ClientEvent, DoneEvent
from producer.protocol import SUBMIT_LUA, JobSpec, as_str, job_model
from producer.reply_hub import ReplyHub, Subscription
from producer.reply_reader import REPLY_READ_COUNT, ReplyReader, result_from_events
from producer.results import reply_expired_async
from producer.shards import sharded_job_id
from producer.slot_hubs import SlotHubs, reply_hub


def connect_async(url: str) -> aioredis.Redis:
    return connection.connect_async(url, socket_timeout=5.0)


class AsyncClient(ClientSettings):
    def __init__(self, url: str = DEFAULT_URL, **settings: Any) -> None:
        super().__init__(url, **settings)
        self.redis = connect_async(url)
        self._submit_script = self.redis.register_script(SUBMIT_LUA)
        # Every AsyncJob's reads of its reply stream go through one XREAD (on a cluster, one
        # per slot: a model's streams share one): a thousand jobs streamed at once hold one
        # connection, not a thousand (made by the first read, in the event loop).
        self._hub: ReplyHub | SlotHubs | None = None

    def hub(self) -> ReplyHub | SlotHubs:
        if self._hub is None:
            self._hub = reply_hub(self.url)
        return self._hub

    async def submit(self, prompt: Prompt | None = None, params: dict[str, Any] | None = None,
                     *, model: str, messages: Messages | None = None, job_id: str | None = None,
                     deadline: float | None = None, stream: bool = True,
                     priority: int = 0) -> AsyncJob:
        """Client.submit's mirror: a prompt, or a chat as `messages=[...]` (keyword)."""
        job_id = job_id or sharded_job_id(
            model, await self.shard_counts.get_async(self.redis, model))
        spec = make_job_spec(prompt, params, model, job_id, deadline, stream, messages,
                             priority)
        (entry_id,) = await self._submit([spec])
        return AsyncJob(self, spec.id, model, created=entry_id is not None,
                        entry_id=None if entry_id is None else as_str(entry_id))

    async def submit_many(self, prompts: Sequence[str | Sequence[int]],
                          params: dict[str, Any] | None = None, *, model: str,
                          stream: bool = True, priority: int = 0) -> list[AsyncJob]:
        """Client.submit_many's mirror: many jobs in one pipelined round trip (fresh ids)."""
        shards = await self.shard_counts.get_async(self.redis, model)
        specs = [make_job_spec(p, params, model, sharded_job_id(model, shards), None, stream,
                               priority=priority) for p in prompts]
        ids = await self._submit(specs)
        return [AsyncJob(self, spec.id, model, created=eid is not None,
                         entry_id=None if eid is None else as_str(eid))
                for spec, eid in zip(specs, ids, strict=True)]

    async def _submit(self, specs: Sequence[JobSpec]) -> list[Any]:
        """Client._submit's mirror."""
        delays = self.failover_delays()
        while True:
            try:
                if len(specs) == 1 and not self.min_replicas:
                    keys, args = self.submit_call(specs[0])
                    return [await self._submit_script(keys=keys, args=args)]
                try:
                    return self.replicated(
                        await self.submit_pipeline(self.redis, specs).execute(), specs)
                except NoScriptError:  # (Client._submit_pipelined)
                    await self.redis.script_load(SUBMIT_LUA)
                    return self.replicated(
                        await self.submit_pipeline(self.redis, specs).execute(), specs)
            except connection.RETRYABLE:
                delay = next(delays, None)
                if delay is None:
                    raise
                await asyncio.sleep(delay)

    async def results(self, jobs: Sequence[AsyncJob], timeout: float | None = 60.0, *,
                      return_exceptions: bool = False, concurrency: int = 64) -> list[Any]:
        """Client.results' mirror: every job's result, in order; a failed job raises its
        JobError once all have ended (the first in order), or with `return_exceptions` takes
        its place (as does a TimeoutError for each job unfinished at `timeout`). At most
        `concurrency` jobs are waited for at once."""
        end = None if timeout is None else time.monotonic() + timeout
        gate = asyncio.Semaphore(concurrency)

        async def one(job: AsyncJob) -> Any:
            async with gate:
                left = None if end is None else max(0.001, end - time.monotonic())
                try:
                    return await job.result(timeout=left)
                except (JobError, TimeoutError) as exc:
                    return exc

        out = await asyncio.gather(*(one(job) for job in jobs))
        if not return_exceptions:
            for value in out:
                if isinstance(value, TimeoutError):
                    raise TimeoutError(f"{sum(isinstance(v, TimeoutError) for v in out)} of "
                                       f"{len(jobs)} job(s) had no terminal event within "
                                       f"{timeout} s")
            for value in out:
                if isinstance(value, JobError):
                    raise value
        return out

    def job(self, job_id: str, model: str = "") -> AsyncJob:
        return AsyncJob(self, job_id, model, created=False)

    async def cancel(self, job_id: str, model: str | None = None) -> None:
        """Client.cancel."""
        model = model or job_model(job_id)
        pipe = self.redis.pipeline(transaction=False)
        pipe.set(self.keys.cancel(job_id, model), 1, ex=self.cancel_ttl)
        pipe.spublish(self.keys.cancel_channel(model), job_id)
        await pipe.execute()

    async def close(self) -> None:
        if self._hub is not None:
            await self._hub.close()
            self._hub = None
        await self.redis.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class AsyncJob:
    def __init__(self, client: AsyncClient, job_id: str, model: str, created: bool,
                 entry_id: str | None = None) -> None:
        self.client = client
        self.id = job_id
        self.model = model
        self.created = created
        self.entry_id = entry_id  # the job-stream entry (its ms part is the enqueue time)
        self.reply_key = client.keys.reply(job_id, model or None)

    def __repr__(self) -> str:
        return f"AsyncJob(id={self.id!r}, model={self.model!r})"

    async def raw_events(self, timeout: float | None = None,
                         last_id: str = "0-0") -> AsyncIterator[ClientEvent]:
        reader = ReplyReader(timeout, time.monotonic(), dedupe=False, cursor=last_id)
        async for _entry_id, event in self._read(reader):
            yield event

    async def stream(self, timeout: float | None = None) -> AsyncIterator[ClientEvent]:
        async for _entry_id, event in self._read(ReplyReader(timeout, time.monotonic())):
            yield event

    async def result(self, timeout: float | None = 60.0) -> DoneEvent:
        reader = ReplyReader(timeout, time.monotonic())
        async for _item in self._read(reader):
            pass
        return result_from_events(self.id, reader.terminal)

    async def _read(self, reader: ReplyReader) -> AsyncIterator[tuple[str, ClientEvent]]:
        """Job._read's mirror, through the client's hub: what is already in the stream is read
        at once (reads that do not block), then the job waits on the hub from where it got to
        (the hub retries a failed read itself; whether the result expired is asked after a
        wait there, not after the first look)."""
        hub = self.client.hub()
        sub: Subscription | None = None
        try:
            while True:
                for item in await self._next(reader, hub, sub):
                    yield item
                if reader.finished:
                    return
                if sub is not None and reader.expiry_check_due(
                        time.monotonic()) and await reply_expired_async(
                        self.client.redis, self.client.keys.idem(self.id, self.model or None),
                        self.reply_key):
                    raise ResultExpired(self.id)
                if reader.timed_out(time.monotonic()):
                    raise reader.timeout_error(self.id)
                if sub is None and reader.caught_up:
                    sub = hub.subscribe(self.reply_key, reader.cursor)
        finally:
            if sub is not None:
                hub.unsubscribe(sub)

    async def _next(self, reader: ReplyReader, hub: ReplyHub | SlotHubs,
                    sub: Subscription | None) -> Iterable[tuple[str, ClientEvent]]:
        """One read's events (decoded as they are taken, advancing the reader's cursor)."""
        if sub is not None:
            entries = await hub.next(sub, reader.block_ms(time.monotonic()) / 1000)
            return reader.feed(entries, caught_up=not sub.behind)
        try:
            resp = await self.client.redis.xread({self.reply_key: reader.cursor},
                                                 count=REPLY_READ_COUNT)
        except RedisError as exc:
            if not connection.retryable(exc):
                raise
            await asyncio.sleep(reader.read_failed(time.monotonic()))
            return ()
        return reader.feed(_entries(resp))

    async def cancel(self) -> None:
        await self.client.cancel(self.id, self.model or None)


def _entries(resp: Any) -> list[Any]:
    """The entries of an XREAD answer on one stream."""
    return [entry for _key, entries in resp or [] for entry in entries]
