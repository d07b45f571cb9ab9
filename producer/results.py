"""Waiting for many jobs at once: a few round trips per pass over many reply streams, and work
per job, not per token.

`Client.results(jobs)` is `[job.result() for job in jobs]` in a few round trips (Celery's
ResultSet.get, asyncio.gather's return_exceptions): for a burst of short jobs, a read per job
would be the client's largest cost, larger than the worker's per job.

It needs each job's terminal event (done / error) only, never its tokens. A worker writes the
terminal event once, fenced, in the same script as the XACK of the job's entry, and nothing is
written to the reply stream after it (worker/scripts.py FINISH_LUA): the terminal event of a
finished job is the LAST entry of its reply stream. So a pass reads, in one Lua call per 512
unfinished streams (LAST_ENTRIES_LUA: XREVRANGE + - COUNT 1 each, cheaper for the client than a
pipeline of XREVRANGEs), the last entry of each stream whose last entry is not the one the
previous pass saw, and decodes only that one: a terminal event ends its job; of any other event
only the type is read, and its id is the one seen. The entries before it are neither sent nor
decoded. A stream that does not exist yet (the job has not started) has no last entry and is
asked again next pass.

A pass that finds no stream changed waits: one XREAD BLOCK COUNT 1 on the oldest unfinished
jobs' 512 streams from the entries seen (at most 100 ms) learns that one has news; what it reads
is not decoded. Passes start at least `pass_interval(unfinished)` apart: 50 us per unfinished
stream, from 2 ms up to 1 s. A crowd of streams that trickle tokens then makes one pass per
interval, not one per token, so waiting costs a bounded share of a core however fast the tokens
come; as jobs end the interval shrinks, so the last ones are seen within a few ms of their ends
(results come back when all have ended, so only the last ones' matter).

Every multi-key call names keys of one slot only (`_slot_chunks`: a cluster refuses one that
crosses slots): the streams are grouped by slot first (a job's keys carry its model's hash tag,
so on one server as on a cluster, jobs of one model are one group) and each group is read in
chunks of 512.

A Redis user that may not run the script (an ACL without the selector docs/security.md gives
it, which grants EVALSHA and XREVRANGE on reply streams) waits on XREAD alone, paced the same
way: every new entry is sent, but only each stream's newest one is decoded. The refusal is
remembered per connection.
"""

from __future__ import annotations

import time
import weakref
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import msgpack
import redis
from redis.crc import key_slot

from producer.connection import retryable
from producer.errors import JobError, ProtocolError, ResultExpired
from producer.events import EVENT_TYPES, TERMINAL_EVENT_TYPES, TerminalEvent, decode_event
from producer.protocol import DEFAULT_MAX_EVENT_BYTES, REPLY_FIELD, as_str
from producer.reply_reader import result_from_events

if TYPE_CHECKING:
    from producer.client import Job

_STREAMS_PER_READ = 512  # reply streams named in one XREAD or LAST_ENTRIES_LUA call
_ENTRIES_PER_READ = 512  # entries per stream in one XREAD (without the script)
_BLOCK_MS = 100  # the longest one XREAD waits on the oldest unfinished jobs' streams
_PACE_PER_STREAM_S = 50e-6  # passes start at least this much per unfinished stream apart,
_PACE_MIN_S = 0.002  # ... and at least this
_PACE_MAX_S = 1.0  # ... and at most this (only 20,000 streams and more reach it)
_RETRYABLE = (redis.ConnectionError, redis.TimeoutError)
_NOT_TERMINAL = frozenset(EVENT_TYPES) - frozenset(TERMINAL_EVENT_TYPES)
_FIELD = REPLY_FIELD.encode()

# The last entry of each stream in KEYS whose last entry is not the one seen.
# ARGV[1]: the event field; ARGV[1 + i]: the id of the entry of KEYS[i] seen last ("0-0": none).
# Returns flat {i, entry id, value of the field (nil when the entry lacks it), ...}.
LAST_ENTRIES_LUA = """
local out = {}
local field = ARGV[1]
for i = 1, #KEYS do
  local entry = redis.call('XREVRANGE', KEYS[i], '+', '-', 'COUNT', 1)[1]
  if entry and entry[1] ~= ARGV[i + 1] then
    local value = false
    local fields = entry[2]
    for j = 1, #fields, 2 do
      if fields[j] == field then value = fields[j + 1] end
    end
    out[#out + 1] = i
    out[#out + 1] = entry[1]
    out[#out + 1] = value
  end
end
return out
"""

# Connections whose user may not run LAST_ENTRIES_LUA (asked once, not once per call).
_SCRIPT_REFUSED: weakref.WeakSet[redis.Redis] = weakref.WeakSet()


ENDED_MARK = b"ended"  # FINISH_LUA sets a job's idempotency key to this with its terminal event
_EXPIRY_CHECK_S = 1.0  # how often streams with no entry yet are asked whether they expired


def reply_expired(conn: redis.Redis, idem_key: str, reply_key: str) -> bool:
    """Whether a job's result expired unread: its idempotency key carries the worker's ended
    mark and its reply stream is gone. Read in that order: the mark is written with the terminal
    event, so a stream missing after the mark was seen has expired. False when this user may not
    read the key (an ACL without docs/security.md's GET on idem keys) or Redis cannot be
    reached: the caller waits as before."""
    pipe = conn.pipeline(transaction=False)
    pipe.get(idem_key)
    pipe.exists(reply_key)
    try:
        mark, exists = pipe.execute()
    except (redis.ResponseError, *_RETRYABLE):
        return False
    return bool(mark == ENDED_MARK and not exists)


async def reply_expired_async(conn: Any, idem_key: str, reply_key: str) -> bool:
    """reply_expired on a redis.asyncio connection (AsyncJob, the gateway); False also when
    Redis cannot be reached (the caller's next read says so)."""
    pipe = conn.pipeline(transaction=False)
    pipe.get(idem_key)
    pipe.exists(reply_key)
    try:
        mark, exists = await pipe.execute()
    except (redis.ResponseError, *_RETRYABLE):
        return False
    return bool(mark == ENDED_MARK and not exists)


def pass_interval(unfinished: int) -> float:
    """The least time in seconds between the starts of two passes over `unfinished` streams."""
    return min(_PACE_MAX_S, max(_PACE_MIN_S, unfinished * _PACE_PER_STREAM_S))


def wait_results(conn: redis.Redis, jobs: Sequence[Job], timeout: float | None,
                 return_exceptions: bool) -> list[Any]:
    """Each job's done event, in order. A job that ended in an error raises its JobError (the
    first in order, once every job has ended), or with `return_exceptions` stands in the list in
    place of its result. When `timeout` seconds pass with jobs unfinished: TimeoutError, or with
    `return_exceptions` one in place of each unfinished job."""
    out: list[Any] = [None] * len(jobs)
    for index, value in iter_results(conn, jobs, timeout):
        if isinstance(value, TimeoutError) and not return_exceptions:
            raise value
        out[index] = value
    if not return_exceptions:
        for value in out:
            if isinstance(value, JobError):
                raise value
    return out


def iter_results(conn: redis.Redis, jobs: Sequence[Job],
                 timeout: float | None) -> Iterator[tuple[int, Any]]:
    """(index in jobs, its done event or JobError) as each job ends, in the order they are
    seen; when `timeout` seconds pass, (index, TimeoutError) for each job still unfinished."""
    end = None if timeout is None else time.monotonic() + timeout
    wait = _Wait(conn, jobs)
    next_pass = 0.0
    next_expiry_check = time.monotonic() + _EXPIRY_CHECK_S
    backoff = 0.05
    while wait.waiting:
        now = time.monotonic()
        if now < next_pass:
            time.sleep(next_pass - now if end is None else max(0.0, min(next_pass, end) - now))
        next_pass = time.monotonic() + pass_interval(len(wait.waiting))
        changed = None
        try:
            changed = wait.one_pass()
            backoff = 0.05
        except redis.RedisError as exc:
            if not retryable(exc):
                raise
            time.sleep(backoff)
            backoff = min(backoff * 2, 2.0)
        if wait.waiting and time.monotonic() >= next_expiry_check:
            next_expiry_check = time.monotonic() + _EXPIRY_CHECK_S
            try:
                wait.expired_pass()
            except _RETRYABLE:
                pass
        while wait.ended:
            index = wait.ended.popleft()
            yield index, wait.out[index]
        if wait.waiting and end is not None and time.monotonic() >= end:
            late = TimeoutError(f"{len(wait.waiting)} of {len(jobs)} job(s) had no terminal "
                                f"event within {timeout} s")
            for index in list(wait.waiting.values()):
                yield index, late
            return
        if wait.waiting and changed == 0:
            left = _BLOCK_MS if end is None else (end - time.monotonic()) * 1000
            try:
                wait.until_news(int(max(1, min(_BLOCK_MS, left))))
            except redis.RedisError as exc:  # (UNBLOCKED: a failover demoted the server)
                if not retryable(exc):
                    raise
                time.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
    while wait.ended:
        index = wait.ended.popleft()
        yield index, wait.out[index]


class _Wait:
    """What one wait_results call knows: results so far and, per unfinished stream, the id of the
    last entry looked at."""

    def __init__(self, conn: redis.Redis, jobs: Sequence[Job]) -> None:
        self.conn = conn
        self.jobs = jobs
        self.out: list[Any] = [None] * len(jobs)
        self.ended: deque[int] = deque()  # indexes whose out[] was set, not yet handed on
        self.waiting: dict[str, int] = {}  # reply key -> index in jobs, oldest first
        for i, job in enumerate(jobs):
            if job.reply_key in self.waiting:
                raise ValueError(f"job {job.id} is given twice")
            self.waiting[job.reply_key] = i
        self.seen = dict.fromkeys(self.waiting, "0-0")  # reply key -> id of the entry seen last
        self.slots = {key: key_slot(key.encode()) for key in self.waiting}  # (once, not a pass)
        self.script = conn.register_script(LAST_ENTRIES_LUA)

    def one_pass(self) -> int:
        """Reads the newest entry of each unfinished stream that has one it has not seen;
        returns how many streams had one."""
        if self.conn not in _SCRIPT_REFUSED:
            try:
                return self._pass_last_entries()
            except redis.ResponseError as exc:
                if not _refused(exc):
                    raise
                _SCRIPT_REFUSED.add(self.conn)
        return self._pass_new_entries()

    def until_news(self, block_ms: int) -> None:
        """Returns when one of the oldest 512 unfinished streams of the oldest one's slot has an
        entry after the one seen (at once if one has), or after block_ms."""
        oldest = _slot_chunks(self.waiting, self.slots)[0]
        self.conn.xread({k: self.seen[k] for k in oldest}, count=1, block=block_ms)

    def expired_pass(self) -> None:
        """Jobs whose stream has shown no entry yet: those whose result expired unread
        (reply_expired, for many: one MGET of marks per 512, then EXISTS for the marked) end
        with ResultExpired."""
        never = [k for k in self.waiting if self.seen[k] == "0-0"]
        for chunk in _slot_chunks(never, self.slots):
            jobs = [self.jobs[self.waiting[k]] for k in chunk]
            try:  # (a job's idem key shares its reply key's slot)
                marks = self.conn.mget([job.client.keys.idem(job.id, job.model or None)
                                        for job in jobs])
            except redis.ResponseError:
                return  # no GET on idem keys for this user: wait as before
            marked = [k for k, mark in zip(chunk, marks, strict=True) if mark == ENDED_MARK]
            if not marked:
                continue
            pipe = self.conn.pipeline(transaction=False)
            for key in marked:
                pipe.exists(key)
            for key, exists in zip(marked, pipe.execute(), strict=True):
                if not exists:
                    index = self.waiting.pop(key)
                    del self.seen[key]
                    self.out[index] = ResultExpired(self.jobs[index].id)
                    self.ended.append(index)

    def _pass_last_entries(self) -> int:
        changed = 0
        for chunk in _slot_chunks(self.waiting, self.slots):
            reply: Any = self.script(keys=chunk, args=[REPLY_FIELD, *map(self.seen.__getitem__,
                                                                          chunk)])
            changed += len(reply) // 3
            for k in range(0, len(reply), 3):
                self._newest(chunk[int(reply[k]) - 1], as_str(reply[k + 1]), reply[k + 2])
        return changed

    def _pass_new_entries(self) -> int:
        """The same with XREAD alone: every entry after the one seen is sent, up to 512 a stream;
        only the newest of them is decoded (the terminal event is the last one)."""
        changed = 0
        for chunk in _slot_chunks(self.waiting, self.slots):
            resp: Any = self.conn.xread({k: self.seen[k] for k in chunk},
                                        count=_ENTRIES_PER_READ)
            for raw_key, entries in resp or []:
                changed += 1
                key = as_str(raw_key)
                if len(entries) == _ENTRIES_PER_READ:
                    # Maybe not the newest: read on from the one before (a terminal event that
                    # is this last one comes first, and alone, next time).
                    self.seen[key] = as_str(entries[-2][0])
                    continue
                entry_id, fields = entries[-1]
                self._newest(key, as_str(entry_id), fields.get(_FIELD))
        return changed

    def _newest(self, key: str, entry_id: str, value: bytes | None) -> None:
        """`value`: the event field of the entry `entry_id`, the newest of stream `key`."""
        if value is None:
            raise ProtocolError("missing_field", f"entry {entry_id} of {key} has no field "
                                                 f"{REPLY_FIELD!r}")
        event = _terminal_event(value)
        if event is None:
            self.seen[key] = entry_id
            return
        index = self.waiting.pop(key)
        del self.seen[key]
        try:
            self.out[index] = result_from_events(self.jobs[index].id, event)
        except JobError as exc:
            self.out[index] = exc
        self.ended.append(index)


def _slot_chunks(keys: Iterable[str], slots: dict[str, int]) -> list[list[str]]:
    """`keys` grouped by cluster slot (`slots`: key -> slot; the groups in the order of their
    first key, each in the keys' order) and cut into chunks of at most _STREAMS_PER_READ."""
    groups: dict[int, list[str]] = {}
    for key in keys:
        groups.setdefault(slots[key], []).append(key)
    return [group[lo:lo + _STREAMS_PER_READ] for group in groups.values()
            for lo in range(0, len(group), _STREAMS_PER_READ)]


def _refused(exc: redis.ResponseError) -> bool:
    """Whether `exc` says this user may not run LAST_ENTRIES_LUA (ACL, or EVALSHA disabled)."""
    text = str(exc)
    return isinstance(exc, redis.exceptions.NoPermissionError) or (
        "user executing the script" in text or "unknown command" in text)


def _terminal_event(value: bytes) -> TerminalEvent | None:
    """The terminal event `value` holds, strictly decoded; None when it holds another event: of
    that one only the type is read (a quarter of decode_event's cost). ProtocolError when it is
    not an event."""
    if len(value) <= DEFAULT_MAX_EVENT_BYTES:
        try:
            peek = msgpack.unpackb(value, raw=False)
        except Exception:
            peek = None  # decode_event says what is wrong with it
        kind = peek.get("type") if isinstance(peek, dict) else None
        if isinstance(kind, str) and kind in _NOT_TERMINAL:
            return None
    event = decode_event(value)
    return event if event["type"] == "done" or event["type"] == "error" else None
