"""How the writer cuts a step's token events into WRITE_EVENTS_LUA calls: one stream's writes
per call (its slot), at most max_events_per_call events each, with the ownership check each
needs (worker/scripts.py explains the fence counter)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, NamedTuple, TypeVar

import msgpack

from producer.events import encode_event
from worker.batch import EventWrite, FinishWrite, chunks
from worker.streams import JobStream, split_ref

FENCE_RECHECK_S = 1.0  # the longest token writes go on without a full ownership check
W = TypeVar("W", EventWrite, FinishWrite)


class Fence:
    """The ownership checks of one stream's writes: its fence counter as the last full check
    read it ('' until a write has checked) and the attempts known to be ours since (entry ref ->
    deliveries); the others are checked, each on its own, at their next write."""

    def __init__(self) -> None:
        self.seen = ""
        self.checked_at = -math.inf
        self.verified: dict[str, int] = {}


class EventsCall(NamedTuple):
    """One WRITE_EVENTS_LUA call of a write: its stream, the writes it holds, the attempts it
    asks to check, and the fence counter value it passed."""

    stream: int
    writes: list[EventWrite]
    check: list[tuple[str, int]]
    fence: str


def event_calls(keys_of: JobStream, stream: int, fence_state: Fence, events: list[EventWrite],
                now: float, gone: tuple[dict[str, int], dict[tuple[str, int], float]],
                ttl_at: dict[str, float], reply_ttl: int, max_events: int,
                refreshed: list[str]) -> Iterator[tuple[EventsCall, list[str], list[Any]]]:
    """Per call: the call, its KEYS, and its ARGV after (group, me). Writes of attempts that
    are `gone` (lost, or finished) are left out; reply keys whose TTL the call refreshes are
    added to `refreshed`."""
    if keys_of.fence is None:
        fence = "-"
    elif now - fence_state.checked_at > FENCE_RECHECK_S:
        fence = ""  # a full check now and then, whatever the counter says
    else:
        fence = fence_state.seen
    gone_ids, gone_attempts = gone
    verified = fence_state.verified
    stale = now - reply_ttl / 4
    never = -math.inf
    num_events = sum(len(w.events) for w in events)
    for chunk in chunks(events, num_events, max_events):
        written: list[EventWrite] = []
        check: list[tuple[str, int]] = []
        keys = [keys_of.jobs, keys_of.fence or keys_of.jobs]
        index: list[Any] = []
        blobs: list[bytes] = []
        for w in chunk:
            if w.entry_id in gone_ids and (w.entry_id, w.deliveries) in gone_attempts:
                continue  # lost, or finished: nothing more of it
            written.append(w)
            if len(w.events) == 1:  # the common case: one step's tokens of one sequence
                blob = encode_event(w.events[0])
                blobs.append(blob)
                lengths = [len(blob)]
            else:
                encoded = [encode_event(e) for e in w.events]
                blobs += encoded
                lengths = [len(b) for b in encoded]
            refresh = ttl_at.get(w.reply_key, never) < stale
            if refresh:
                refreshed.append(w.reply_key)
            keys.append(w.reply_key)
            unverified = verified.get(w.entry_id) != w.deliveries
            if unverified:
                check.append((w.entry_id, w.deliveries))
            index.append([split_ref(w.entry_id)[1], w.deliveries, lengths, refresh, unverified])
        if written:
            yield (EventsCall(stream, written, check, fence), keys,
                   [reply_ttl, msgpack.packb(index), b"".join(blobs), fence])


def by_stream(writes: list[W]) -> dict[int, list[W]]:
    """`writes` by the stream of their entry, in order within each."""
    out: dict[int, list[W]] = {}
    for w in writes:
        out.setdefault(split_ref(w.entry_id)[0], []).append(w)
    return out


def raw_finish(fin: FinishWrite) -> FinishWrite:
    """`fin` as its stream's script names it: by its entry id."""
    return fin._replace(entry_id=split_ref(fin.entry_id)[1])
