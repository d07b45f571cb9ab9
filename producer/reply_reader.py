"""ReplyReader: the rules for reading one job's reply stream, with no I/O of its own.

Job (blocking), AsyncJob (asyncio) and the gateway's JobReader each run the same short loop
around one, doing only the reads and the waits:

    reader = ReplyReader(timeout, now)
    while True:
        read up to REPLY_READ_COUNT entries after reader.cursor, blocking reader.block_ms(now);
            a failed read: wait reader.read_failed(now) and skip the feed
        yield from reader.feed(entries)
        if reader.finished: stop
        if reader.expiry_check_due(now) and Redis says the result expired
            (results.reply_expired): raise
        if reader.timed_out(now): raise

The rules it owns:
- the cursor is the id of the last entry fed: the next read, after a reconnect too, resumes
  after it;
- with dedupe (ReplyDeduper's attempt rules, producer/replies.py) each (index, pos) is yielded
  once, events of superseded attempts are dropped, and the first terminal event of the newest
  attempt finishes the reader; without it every event is yielded as read (Job.raw_events);
- entries up to `after` (a resumed stream: the entry id the caller already has) go through the
  deduper but are not yielded: what they made is kept in `replayed`;
- a read that returned nothing while nothing was ever read may mean that the job ended and its
  stream expired: only then is Redis asked, at once the first time, then at doubling intervals
  from 1 s up to 30 s (a job waits in its queue with nothing to read; a stream that expired
  before the reader came is found by the first ask);
- the deadline counts only once the reader has caught up: a read that returned a full
  REPLY_READ_COUNT is read on (a shared reader, producer/reply_hub.py, says itself whether
  it has caught up), so a job that ended in time is not reported late for the entries in
  front of its end;
- a failed read waits 50 ms, doubling up to 2 s, never past the deadline; a read that
  succeeds starts the doubling over.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from producer.errors import JobError
from producer.events import ClientEvent, DoneEvent, TerminalEvent, decode_reply_entry
from producer.protocol import as_str
from producer.replies import ReplyDeduper

BLOCK_MS = 1000  # the longest one read blocks
REPLY_READ_COUNT = 512  # reply entries per read of one job's stream
_BACKOFF_FIRST_S = 0.05
_BACKOFF_MAX_S = 2.0
_EXPIRY_CHECK_FIRST_S = 1.0
_EXPIRY_CHECK_MAX_S = 30.0

Entry = tuple[bytes | str, Any]  # (entry id, fields) as XREAD returns them


def entry_key(entry_id: str | bytes) -> tuple[int, int]:
    """A stream entry id "<ms>-<seq>" (as text, or as Redis answers it) as a pair that orders
    like the stream."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


def result_from_events(job_id: str, terminal: TerminalEvent | None) -> DoneEvent:
    """The done event, or the JobError of an error event or of a stream with no end."""
    if terminal is None:
        raise JobError(job_id, "no_result", "the reply stream ended without a terminal event")
    if terminal["type"] == "error":
        raise JobError(job_id, terminal["code"], terminal["message"])
    return terminal


class ReplyReader:
    def __init__(self, timeout: float | None, now: float, *, dedupe: bool = True,
                 cursor: str = "0-0", after: str | None = None) -> None:
        self.timeout = timeout
        self.end = None if timeout is None else now + timeout
        self.cursor = cursor  # the id of the last entry fed
        self.first_id: str | None = None  # the id of the first entry fed
        self.deduper = ReplyDeduper() if dedupe else None
        self.after = None if after is None else entry_key(after)
        self.replayed: list[ClientEvent] = []  # what the entries up to `after` made
        self._num_read = 0  # entries the last read returned
        self._caught_up = True  # the last read left nothing unread
        self._backoff = _BACKOFF_FIRST_S
        self._next_expiry_check = -1e18  # (monotonic seconds)
        self._expiry_interval = _EXPIRY_CHECK_FIRST_S

    @property
    def finished(self) -> bool:
        return self.deduper is not None and self.deduper.finished

    @property
    def terminal(self) -> TerminalEvent | None:
        """The terminal event that finished the reader (None: not finished)."""
        return None if self.deduper is None else self.deduper.terminal

    @property
    def caught_up(self) -> bool:
        """Whether the last read left nothing unread (or failed: nothing can be read on)."""
        return self._caught_up

    @property
    def may_be_expired(self) -> bool:
        """Whether the job's result may have expired unread (nothing was ever read)."""
        return self._num_read == 0 and self.cursor == "0-0"

    def expiry_check_due(self, now: float) -> bool:
        """Whether the caller should ask Redis now if the job's result expired unread."""
        if not self.may_be_expired or now < self._next_expiry_check:
            return False
        self._next_expiry_check = now + self._expiry_interval
        self._expiry_interval = min(self._expiry_interval * 2, _EXPIRY_CHECK_MAX_S)
        return True

    def block_ms(self, now: float) -> int:
        """How long the next read may block."""
        if self.end is None:
            return BLOCK_MS
        return int(max(1, min(BLOCK_MS, (self.end - now) * 1000)))

    def read_failed(self, now: float) -> float:
        """A read failed (Redis unreachable): the seconds to wait before the next one."""
        wait = self._backoff if self.end is None else min(self._backoff, max(0.0, self.end - now))
        self._backoff = min(self._backoff * 2, _BACKOFF_MAX_S)
        self._num_read = 0
        self._caught_up = True
        return wait

    def timed_out(self, now: float) -> bool:
        return self.end is not None and now >= self.end and self.caught_up

    def timeout_error(self, job_id: str) -> TimeoutError:
        return TimeoutError(f"job {job_id}: no terminal event within {self.timeout} s")

    def feed(self, entries: Sequence[Entry], caught_up: bool | None = None
             ) -> Iterator[tuple[str, ClientEvent]]:
        """One read's entries in; (entry id, event) for each event to hand on, decoded as they
        are taken (a ProtocolError from an entry that is not an event comes after the events
        before it). `caught_up`: whether the read left nothing unread (None: a read of up to
        REPLY_READ_COUNT entries, caught up unless it came back full)."""
        self._num_read = len(entries)
        self._caught_up = len(entries) < REPLY_READ_COUNT if caught_up is None else caught_up
        self._backoff = _BACKOFF_FIRST_S
        return self._events(entries)

    def _events(self, entries: Sequence[Entry]) -> Iterator[tuple[str, ClientEvent]]:
        for raw_id, fields in entries:
            if self.finished:
                return
            entry_id = as_str(raw_id)
            self.cursor = entry_id
            if self.first_id is None:
                self.first_id = entry_id
            event = decode_reply_entry(fields)
            if self.deduper is None:
                yield entry_id, event
                continue
            out = self.deduper.feed(event)
            if self.after is not None and entry_key(entry_id) <= self.after:
                self.replayed += out
            else:
                for item in out:
                    yield entry_id, item
