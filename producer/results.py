"""Waiting for many jobs at once: one XREAD over many reply streams instead of one per job.

`Client.results(jobs)` is `[job.result() for job in jobs]` in a few round trips (Celery's
ResultSet.get, asyncio.gather's return_exceptions): for a burst of short jobs the client's own
per-job read was its largest cost, larger than the worker's per job.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import redis

from producer.protocol import REPLY_FIELD, as_str, decode_event
from producer.replies import ReplyDeduper

if TYPE_CHECKING:
    from producer.client import Job

_STREAMS_PER_READ = 512  # reply streams named in one XREAD
_BLOCK_MS = 100  # the longest one XREAD waits on the oldest unfinished jobs' streams
_RETRYABLE = (redis.ConnectionError, redis.TimeoutError)


def wait_results(conn: redis.Redis, jobs: Sequence[Job], timeout: float | None,
                 return_exceptions: bool) -> list[Any]:
    """Each job's done event, in order. A job that ended in an error raises its JobError (the
    first in order, once every job has ended), or with `return_exceptions` stands in the list in
    place of its result. When `timeout` seconds pass with jobs unfinished: TimeoutError, or with
    `return_exceptions` one in place of each unfinished job."""
    from producer.client import JobError, result_from_events

    end = None if timeout is None else time.monotonic() + timeout
    out: list[Any] = [None] * len(jobs)
    waiting: dict[str, tuple[int, ReplyDeduper]] = {}  # reply key -> (index, its deduper)
    last: dict[str, str] = {}
    for i, job in enumerate(jobs):
        if job.reply_key in waiting:
            raise ValueError(f"job {job.id} is given twice")
        waiting[job.reply_key] = (i, ReplyDeduper())
        last[job.reply_key] = "0-0"
    backoff = 0.05
    while waiting:
        keys = list(waiting)
        for lo in range(0, len(keys), _STREAMS_PER_READ):
            chunk = keys[lo:lo + _STREAMS_PER_READ]
            # The oldest unfinished jobs' streams wait (until any of them has news, at once if
            # one has); the rest are only looked at: no pass spins while nothing arrives.
            block = None
            if lo == 0:
                left = _BLOCK_MS if end is None else (end - time.monotonic()) * 1000
                block = int(max(1, min(_BLOCK_MS, left)))
            try:
                resp: Any = conn.xread({k: last[k] for k in chunk}, count=512, block=block)
                backoff = 0.05
            except _RETRYABLE:
                time.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
                continue
            for raw_key, entries in resp or []:
                key = as_str(raw_key)
                index, dedupe = waiting[key]
                for entry_id, fields in entries:
                    last[key] = as_str(entry_id)
                    dedupe.feed(decode_event(fields[REPLY_FIELD.encode()]))
                    if dedupe.finished:
                        break
                if dedupe.finished:
                    del waiting[key]
                    try:
                        out[index] = result_from_events(jobs[index].id, dedupe.terminal)
                    except JobError as exc:
                        out[index] = exc
        if waiting and end is not None and time.monotonic() >= end:
            late = TimeoutError(f"{len(waiting)} of {len(jobs)} job(s) had no terminal event "
                                f"within {timeout} s")
            if not return_exceptions:
                raise late
            for index, _ in waiting.values():
                out[index] = late
            break
    if not return_exceptions:
        for value in out:
            if isinstance(value, JobError):
                raise value
    return out
