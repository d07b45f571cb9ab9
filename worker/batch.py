"""What the worker loop hands the writer: a Batch of one step's writes (EventWrite: events of an
attempt, FinishWrite: the end of one), and how batches queued behind a round trip are merged
(one write per attempt, one tokens event per sequence) and cut into script calls."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import msgpack

from producer.events import Event, TokensEvent, tokens_event


class EventWrite(NamedTuple):
    """Events of one attempt (unencoded), written only while this worker still owns the entry.
    (Tuples: a step's batch goes to a writer process in one msgpack call.)"""

    entry_id: str
    deliveries: int
    reply_key: str
    events: list[Event]


class FinishWrite(NamedTuple):
    """The end of one attempt: terminal event / dead letter / hand-back, then XACK + XDEL."""

    entry_id: str
    deliveries: int
    reply_key: str | None
    event: bytes | None
    dead_fields: list[object] = []  # (never mutated: shared defaults are safe)
    readd_fields: list[object] = []
    idem_key: str | None = None  # marked 'ended' if this finish writes a terminal event


@dataclass(slots=True)
class Batch:
    events: list[EventWrite] = field(default_factory=list)
    finishes: list[FinishWrite] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.events or self.finishes)


def merge(batches: list[Batch]) -> Batch:
    """Batches queued behind a round trip, as one: an attempt's events after its finish (in an
    earlier batch) are dropped, and the events coalesced to one write per attempt."""
    if len(batches) == 1:  # one step's worth: one write per attempt already
        return batches[0]
    merged = Batch()
    ended: set[tuple[str, int]] = set()  # attempts a batch merged so far finishes
    for batch in batches:
        merged.events += [w for w in batch.events if (w.entry_id, w.deliveries) not in ended] \
            if ended else batch.events
        merged.finishes += batch.finishes
        ended.update((f.entry_id, f.deliveries) for f in batch.finishes)
    merged.events = coalesce(merged.events)
    return merged


def first_tokens_first(writes: list[EventWrite]) -> list[EventWrite]:
    """`writes` with those that begin a sequence's tokens (pos 0) first, in order otherwise. A
    reader blocked on many reply streams (the gateway's hub) is woken by the first stream a
    write touches, and Redis 7.0 answers it with that stream alone (the rest at its next read):
    a first token then goes out one read sooner."""
    first = [w for w in writes if any(e["type"] == "tokens" and e["pos"] == 0 for e in w.events)]
    if not first or len(first) == len(writes):
        return writes
    begun = {id(w) for w in first}
    return first + [w for w in writes if id(w) not in begun]


def finish_keys(finishes: list[FinishWrite], jobs_key: str, dead_key: str,
                mark_ended: bool = True) -> list[str]:
    """KEYS of one FINISH_LUA call for `finishes` (without `mark_ended`, no idem keys)."""
    return [jobs_key, dead_key, *(fin.reply_key or jobs_key for fin in finishes),
            *((fin.idem_key if mark_ended else None) or jobs_key for fin in finishes)]


def finish_args(finishes: list[FinishWrite], group: str, me: str, reply_ttl: int,
                dead_ttl: int) -> list[Any]:
    """ARGV of one FINISH_LUA call (worker/scripts.py) for `finishes`. The index is packed with
    msgpack's str type for bytes too: Redis's cmsgpack reads it as Lua strings."""
    index = [[fin.entry_id, fin.deliveries, len(fin.event or b""), fin.dead_fields,
              fin.readd_fields] for fin in finishes]
    blob = b"".join(fin.event or b"" for fin in finishes)
    return [group, me, reply_ttl, dead_ttl, msgpack.packb(index, use_bin_type=False), blob]


def coalesce(writes: list[EventWrite]) -> list[EventWrite]:
    """One write per attempt, and one tokens event per sequence index in it: when the writer
    fell behind, the steps it merges cost one XADD per sequence instead of one per step. Order
    within an attempt is kept (a tokens event never moves past another kind of event); chunks
    stay contiguous (pos + len == next pos)."""
    if len({(w.entry_id, w.deliveries) for w in writes}) == len(writes):
        return writes  # one step's worth: already one event per sequence
    merged: dict[tuple[str, int], EventWrite] = {}
    open_chunks: dict[tuple[str, int], dict[int, TokensEvent]] = {}  # per attempt, per index
    for w in writes:
        key = (w.entry_id, w.deliveries)
        if key not in merged:
            merged[key] = EventWrite(w.entry_id, w.deliveries, w.reply_key, [])
            open_chunks[key] = {}
        out, chunks = merged[key].events, open_chunks[key]
        for event in w.events:
            if event["type"] != "tokens":
                chunks.clear()  # later tokens must not jump ahead of this event
                out.append(event)
                continue
            last = chunks.get(event["index"])
            if last is not None and last["attempt"] == event["attempt"] \
                    and last["pos"] + len(last["token_ids"]) == event["pos"]:
                last["token_ids"] += event["token_ids"]  # our own copy (below)
                last["text"] += event["text"]
                if "logprobs" in last or "logprobs" in event:
                    last["logprobs"] = last.get("logprobs", []) + event.get("logprobs", [])
                continue
            # (a copy: the inputs are left as they were)
            chunk = tokens_event(event["attempt"], event["index"], event["pos"],
                                 list(event["token_ids"]), event["text"], event.get("logprobs"))
            chunks[event["index"]] = chunk
            out.append(chunk)
    return list(merged.values())


def chunks(items: list[EventWrite], num_events: int,
            max_events: int) -> list[list[EventWrite]]:
    """`items` in runs of at most `max_events` events (`num_events` in all)."""
    if num_events <= max_events:
        return [items] if items else []
    chunks: list[list[EventWrite]] = []
    current: list[EventWrite] = []
    count = 0
    for item in items:
        if current and count + len(item.events) > max_events:
            chunks.append(current)
            current, count = [], 0
        current.append(item)
        count += len(item.events)
    if current:
        chunks.append(current)
    return chunks
