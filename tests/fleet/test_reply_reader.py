"""The reply reader's rules, fed by hand (no Redis): what it yields, where it reads next, when it
asks whether a result expired, when the deadline counts, how it backs off."""

from __future__ import annotations

import pytest

from producer.errors import JobError, ProtocolError
from producer.events import (
    done_event,
    encode_event,
    error_event,
    restart_event,
    started_event,
    tokens_event,
)
from producer.reply_reader import (
    BLOCK_MS,
    REPLY_READ_COUNT,
    Entry,
    ReplyReader,
    result_from_events,
)

DONE = done_event(1, [{"index": 0, "token_ids": [5, 6], "text": "ab", "finish_reason": "length"}],
                  {"prompt_tokens": 2, "completion_tokens": 2}, {})


def entry(entry_id: str, event: object) -> Entry:
    return entry_id.encode(), {b"e": encode_event(event)}  # type: ignore[arg-type]


def test_yields_each_position_once_across_attempts_and_stops_at_the_terminal_event() -> None:
    reader = ReplyReader(None, 0.0)
    got = list(reader.feed([
        entry("1-0", started_event(1, "w1")),
        entry("1-1", tokens_event(1, 0, 0, [5], "a")),
        entry("2-0", started_event(2, "w2")),  # a failover: attempt 2 replays from pos 0
        entry("2-1", tokens_event(2, 0, 0, [5, 6], "ab")),
        entry("2-2", tokens_event(1, 0, 1, [7], "x")),  # a superseded attempt's leftover
        entry("2-3", DONE | {"attempt": 2}),
        entry("2-4", error_event(2, "late", "never read")),
    ]))
    assert got == [("1-0", started_event(1, "w1")), ("1-1", tokens_event(1, 0, 0, [5], "a")),
                   ("2-0", started_event(2, "w2")), ("2-1", tokens_event(2, 0, 1, [6], "b")),
                   ("2-3", DONE | {"attempt": 2})]
    assert (reader.finished, reader.terminal, reader.cursor) == (True, DONE | {"attempt": 2},
                                                                 "2-3")


def test_without_dedupe_every_event_is_yielded_and_only_the_deadline_ends_it() -> None:
    reader = ReplyReader(5.0, 100.0, dedupe=False, cursor="7-0")
    events = [tokens_event(1, 0, 0, [5], "a"), tokens_event(1, 0, 0, [5], "a"), DONE]
    got = list(reader.feed([entry(f"8-{k}", e) for k, e in enumerate(events)]))
    assert got == [(f"8-{k}", e) for k, e in enumerate(events)]
    assert (reader.finished, reader.terminal, reader.cursor) == (False, None, "8-2")
    assert reader.timed_out(105.0)


def test_entries_up_to_after_go_to_replayed_not_to_the_caller() -> None:
    reader = ReplyReader(60.0, 0.0, after="1-1")
    got = list(reader.feed([entry("1-0", started_event(1, "w")),
                            entry("1-1", tokens_event(1, 0, 0, [5], "a")),
                            entry("1-2", tokens_event(1, 0, 1, [6], "b"))]))
    assert reader.replayed == [started_event(1, "w"), tokens_event(1, 0, 0, [5], "a")]
    assert got == [("1-2", tokens_event(1, 0, 1, [6], "b"))]
    assert reader.first_id == "1-0"


def test_asks_about_expiry_only_while_nothing_was_ever_read() -> None:
    reader = ReplyReader(None, 0.0)
    assert list(reader.feed([])) == [] and reader.may_be_expired
    list(reader.feed([entry("1-0", started_event(1, "w"))]))
    assert not reader.may_be_expired
    assert list(reader.feed([])) == [] and not reader.may_be_expired
    resumed = ReplyReader(None, 0.0, cursor="3-0")
    list(resumed.feed([]))
    assert not resumed.may_be_expired


def test_asks_about_expiry_at_once_then_at_doubling_intervals_up_to_30_s() -> None:
    """A job that waits in a long queue has nothing to read for minutes: its reader must not ask
    Redis about it after every empty read (once a second)."""
    reader = ReplyReader(None, 0.0)
    list(reader.feed([]))
    asked = [t for t in range(0, 200) if reader.expiry_check_due(float(t))]
    assert asked == [0, 1, 3, 7, 15, 31, 61, 91, 121, 151, 181]
    list(reader.feed([entry("1-0", started_event(1, "w"))]))
    assert not reader.expiry_check_due(1000.0)


def test_the_deadline_counts_only_once_caught_up() -> None:
    reader = ReplyReader(2.0, 10.0)
    assert (reader.block_ms(10.0), reader.block_ms(11.5), reader.block_ms(13.0)) == \
        (BLOCK_MS, 500, 1)
    full = [entry(f"1-{k}", tokens_event(1, 0, k, [k], "t")) for k in range(REPLY_READ_COUNT)]
    assert len(list(reader.feed(full))) == REPLY_READ_COUNT
    assert not reader.timed_out(13.0)  # a full read: more may be waiting, the end among them
    list(reader.feed(full[:1]))
    assert not reader.timed_out(11.9) and reader.timed_out(12.0)
    assert str(reader.timeout_error("j")) == "job j: no terminal event within 2.0 s"
    assert ReplyReader(None, 0.0).block_ms(1e9) == BLOCK_MS


def test_a_failed_read_backs_off_doubling_to_two_seconds_never_past_the_deadline() -> None:
    reader = ReplyReader(None, 0.0)
    assert [reader.read_failed(0.0) for _ in range(8)] == [0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 2.0,
                                                            2.0]
    list(reader.feed([]))  # a read that succeeds starts the doubling over
    assert reader.read_failed(0.0) == 0.05
    bounded = ReplyReader(1.0, 0.0)
    assert [bounded.read_failed(t) for t in (0.0, 0.5, 0.75, 0.875, 2.0)] == [0.05, 0.1, 0.2,
                                                                          0.125, 0.0]
    assert bounded.timed_out(2.0)


def test_an_entry_that_is_not_an_event_raises_after_the_events_before_it() -> None:
    reader = ReplyReader(None, 0.0)
    events = reader.feed([entry("1-0", started_event(1, "w")), (b"1-1", {b"x": b"y"})])
    assert next(events) == ("1-0", started_event(1, "w"))
    with pytest.raises(ProtocolError, match="needs the field 'e'"):
        next(events)
    assert reader.cursor == "1-1"  # (read past: the next read does not return it again)


def test_the_result_is_the_done_event_or_the_jobs_error() -> None:
    assert result_from_events("j", DONE) == DONE
    with pytest.raises(JobError, match=r"job j failed \(cancelled\): by the client"):
        result_from_events("j", error_event(1, "cancelled", "by the client"))
    with pytest.raises(JobError, match="no_result"):
        result_from_events("j", None)


def test_a_diverging_replay_restarts_the_stream() -> None:
    reader = ReplyReader(None, 0.0)
    got = [e for _, e in reader.feed([entry("1-0", tokens_event(1, 0, 0, [5], "a")),
                                      entry("2-0", tokens_event(2, 0, 0, [9], "z"))])]
    assert got == [tokens_event(1, 0, 0, [5], "a"),
                   restart_event(2, "attempt 2 diverged from the streamed tokens"),
                   tokens_event(2, 0, 0, [9], "z")]
