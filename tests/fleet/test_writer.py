"""The writer thread and the fenced Lua scripts against a real redis-server (no engine)."""

from __future__ import annotations

import logging
import threading

import msgpack
import pytest
import redis

from producer.events import encode_event, error_event, started_event, tokens_event
from producer.protocol import as_str
from tests.harness.fleet import RedisServer, wait_for
from tests.harness.writer import FENCED, JOBS, KEYS, STREAMS, events_of, setup_group
from worker.batch import (
    Batch,
    EventWrite,
    FinishWrite,
    coalesce,
    finish_args,
    finish_keys,
    first_tokens_first,
)
from worker.io_thread import Writer
from worker.scripts import DEAD_LETTER_MAXLEN, FENCE_TTL_S, Scripts, reclaim_call


def test_coalesce_merges_steps_per_sequence_and_keeps_order() -> None:
    steps = [EventWrite("1-0", 1, "r", [started_event(1, "w")]),
             EventWrite("1-0", 1, "r", [tokens_event(1, 0, 0, [5], "a"),
                                         tokens_event(1, 1, 0, [6], "b")]),
             EventWrite("2-0", 1, "q", [tokens_event(1, 0, 3, [9], "z")]),
             EventWrite("1-0", 1, "r", [tokens_event(1, 0, 1, [7], "c"),
                                         tokens_event(1, 1, 1, [8], "d")])]
    merged = coalesce(steps)
    assert [(w.entry_id, w.events) for w in merged] == [
        ("1-0", [started_event(1, "w"), tokens_event(1, 0, 0, [5, 7], "ac"),
                 tokens_event(1, 1, 0, [6, 8], "bd")]),
        ("2-0", [tokens_event(1, 0, 3, [9], "z")])]
    assert steps[1].events[0]["token_ids"] == [5]  # the inputs are left as they were


def test_coalesce_never_joins_a_gap_or_another_attempt() -> None:
    events = [tokens_event(1, 0, 0, [1], "a"), tokens_event(1, 0, 2, [3], "c"),
              tokens_event(2, 0, 3, [4], "d")]
    assert coalesce([EventWrite("1-0", 1, "r", events)])[0].events == events


def test_writes_that_begin_a_sequence_go_first_and_the_rest_keep_their_order() -> None:
    writes = [EventWrite("1-0", 1, "a", [tokens_event(1, 0, 4, [1], "a")]),
              EventWrite("2-0", 1, "b", [started_event(1, "w"), tokens_event(1, 0, 0, [2], "b")]),
              EventWrite("3-0", 1, "c", [tokens_event(1, 0, 9, [3], "c")]),
              EventWrite("4-0", 1, "d", [tokens_event(1, 0, 2, [4], "d"),
                                          tokens_event(1, 1, 0, [5], "e")]),
              EventWrite("5-0", 1, "e", [started_event(1, "w")])]
    assert [w.entry_id for w in first_tokens_first(writes)] == ["2-0", "4-0", "1-0", "3-0", "5-0"]
    assert first_tokens_first(writes[2:3]) == writes[2:3]


def test_a_reader_blocked_on_many_reply_streams_wakes_with_the_one_getting_its_first_tokens(
        redis_server: RedisServer) -> None:
    """Redis 7.0 answers a blocked XREAD with the one stream whose write woke it (7.2 and later
    with all): a stream's first tokens are written before the other streams' tokens of the step,
    so the gateway's hub has them from the read it has in flight."""
    a, b = setup_group(redis_server, "me", 2)
    conn = redis_server.client()
    ra, rb = KEYS.reply("j0"), KEYS.reply("j1")
    writer = Writer(conn, STREAMS, "workers", "me", reply_ttl=60, dead_ttl=60)
    writer.start()
    writer.submit(Batch(events=[EventWrite(a, 1, ra, [tokens_event(1, 0, 0, [5], "x")])]))
    writer.flush()
    woken: list[str] = []
    reader = threading.Thread(target=lambda: woken.extend(
        as_str(key) for key, _ in redis_server.client().xread({ra: "$", rb: "$"}, block=120_000)))
    reader.start()
    wait_for(lambda: conn.info("clients")["blocked_clients"] == 1, what="the XREAD blocked")
    writer.submit(Batch(events=[
        EventWrite(a, 1, ra, [tokens_event(1, 0, 1, [6], "y")]),
        EventWrite(b, 1, rb, [started_event(1, "me"), tokens_event(1, 0, 0, [7], "z")])]))
    writer.flush()
    reader.join()
    writer.stop()
    assert rb in woken
    assert [e["pos"] for e in events_of(redis_server, "j0")] == [0, 1]


def test_writes_to_an_entry_another_worker_claimed_are_refused(redis_server: RedisServer) -> None:
    mine, stolen = setup_group(redis_server, "me", 2)
    conn = redis_server.client()
    conn.xclaim(JOBS, "workers", "thief", 0, [stolen])
    writer = Writer(conn, STREAMS, "workers", "me", reply_ttl=60, dead_ttl=60)
    writer.start()
    writer.submit(Batch(events=[EventWrite(mine, 1, KEYS.reply("j0"), [started_event(1, "me")]),
                                EventWrite(stolen, 1, KEYS.reply("j1"),
                                           [started_event(1, "me")])]))
    writer.submit(Batch(finishes=[
        FinishWrite(mine, 1, KEYS.reply("j0"), encode_event(error_event(1, "x", "done"))),
        FinishWrite(stolen, 1, KEYS.reply("j1"), encode_event(error_event(1, "x", "done")))]))
    writer.flush()
    writer.stop()
    assert writer.lost.get_nowait() == (stolen, 1) and writer.lost.empty()
    assert [e["type"] for e in events_of(redis_server, "j0")] == ["started", "error"]
    assert events_of(redis_server, "j1") == []
    pending = conn.xpending_range(JOBS, "workers", "-", "+", 10)
    assert [(p["message_id"].decode(), p["consumer"]) for p in pending] == [(stolen, b"thief")]
    assert conn.xlen(JOBS) == 1  # the finished entry was acked and deleted, the stolen one not
    assert 0 < conn.ttl(KEYS.reply("j0")) <= 60


def test_a_reply_key_that_is_not_a_stream_fails_only_its_own_job(
        redis_server: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    """Something other than genq wrote a string at job j1's reply key (WRONGTYPE for XADD). The
    jobs written in the same script call still get every event; j1's events are dropped (said
    once in the log), and its end goes to the dead letters instead, acked like any finish."""
    entries = setup_group(redis_server, "me", 3)
    conn = redis_server.client()
    conn.set(KEYS.reply("j1"), "not a stream")
    writer = Writer(conn, STREAMS, "workers", "me", reply_ttl=60, dead_ttl=60)
    caplog.set_level(logging.WARNING, logger="genq.worker")
    for pos in range(3):
        writer.write_batches([Batch(events=[
            EventWrite(e, 1, KEYS.reply(f"j{i}"), [tokens_event(1, 0, pos, [pos], "x")])
            for i, e in enumerate(entries)])])
    writer.write_batches([Batch(finishes=[
        FinishWrite(e, 1, KEYS.reply(f"j{i}"), encode_event(error_event(1, "x", "end")),
                    idem_key=KEYS.idem(f"j{i}")) for i, e in enumerate(entries)])])
    for job in ("j0", "j2"):
        assert [(e["type"], e.get("pos")) for e in events_of(redis_server, job)] == [
            ("tokens", 0), ("tokens", 1), ("tokens", 2), ("error", None)]
    assert conn.get(KEYS.reply("j1")) == b"not a stream"  # (left as it was)
    (dead,) = conn.xrange(KEYS.dead("m"))
    fields = {k.decode(): v.decode() for k, v in dead[1].items()}
    assert fields == {
        "reason": "its reply key genq:reply:{m}:j1 is not a stream (WRONGTYPE Operation against a "
                  "key holding the wrong kind of value): its end could not be written",
        "code": "reply_unwritable", "entry": entries[1], "worker": "me"}
    assert conn.xlen(JOBS) == 0 and conn.xpending(JOBS, "workers")["pending"] == 0
    warnings = [r.getMessage() for r in caplog.records if entries[1] in r.getMessage()]
    assert warnings == [
        f"entry {entries[1]}: its reply key genq:reply:{{m}}:j1 holds something other than a "
        "stream (not genq's writing); its events are not written",
        f"entry {entries[1]}: its reply key genq:reply:{{m}}:j1 is not a stream; the job is "
        "dead-lettered (code reply_unwritable) instead of ending there"]


def test_a_stale_delivery_count_is_fenced_too(redis_server: RedisServer) -> None:
    """Same consumer name, older attempt (a restarted worker re-claimed its own entry)."""
    (entry,) = setup_group(redis_server, "me", 1)
    conn = redis_server.client()
    conn.xclaim(JOBS, "workers", "me", 0, [entry])  # deliveries is now 2
    fins = [FinishWrite(entry, 1, KEYS.reply("j0"), None)]
    done = Scripts(conn).finish(keys=finish_keys(fins, JOBS, KEYS.dead("m")),
                                args=finish_args(fins, "workers", "me", 60, 60))
    assert done == [0] and conn.xpending(JOBS, "workers")["pending"] == 1


def test_reclaim_takes_only_entries_of_workers_without_a_heartbeat(
        redis_server: RedisServer) -> None:
    entries = setup_group(redis_server, "alive", 2)
    conn = redis_server.client()
    conn.xclaim(JOBS, "workers", "dead", 0, [entries[1]])
    conn.set(KEYS.worker("m", "alive"), b"x", px=10_000)
    claimed = reclaim(conn, "me")
    assert [(c[0].decode(), c[2]) for c in claimed] == [(entries[1], 3)]
    owners = {p["message_id"].decode(): p["consumer"]
              for p in conn.xpending_range(JOBS, "workers", "-", "+", 10)}
    assert owners == {entries[0]: b"alive", entries[1]: b"me"}
    # The victim's fence counter moved (its writer will check ownership again); the live
    # worker's did not.
    assert conn.get(KEYS.fence("m", "dead")) == b"1"
    assert conn.get(KEYS.fence("m", "alive")) is None
    assert 0 < conn.ttl(KEYS.fence("m", "dead")) <= FENCE_TTL_S


def reclaim(conn: redis.Redis, me: str, include_self: bool = False) -> list[list[object]]:
    consumers = [as_str(c["name"]) for c in conn.xinfo_consumers(JOBS, "workers")]
    keys, args = reclaim_call(KEYS, "m", KEYS.jobs("m"), me, consumers, 10, include_self)
    return Scripts(conn).reclaim(keys=keys, args=args)  # type: ignore[no-any-return]


def fenced_writer(conn: redis.Redis) -> Writer:
    writer = Writer(conn, FENCED, "workers", "me", reply_ttl=60, dead_ttl=60)
    writer.start()
    return writer


def write_tokens(writer: Writer, entry: str, pos: int) -> None:
    writer.submit(Batch(events=[EventWrite(entry, 1, KEYS.reply("j0"),
                                           [tokens_event(1, 0, pos, [5], "x")])]))
    writer.flush()


def test_a_claim_by_the_reclaim_script_stops_the_next_token_write(
        redis_server: RedisServer) -> None:
    """The token writes skip the ownership check while the fence counter stands still; the
    reclaim that robs a (paused) worker moves it, so that worker's very next write is fenced."""
    (entry,) = setup_group(redis_server, "me", 1)
    conn = redis_server.client()
    writer = fenced_writer(conn)
    write_tokens(writer, entry, 0)  # the first write checks, and learns the counter (none: 0)
    assert writer.fences[0].seen == "0"
    write_tokens(writer, entry, 1)
    assert writer.lost.empty()
    assert [c[0].decode() for c in reclaim(conn, "thief")] == [entry]  # "me" has no heartbeat
    write_tokens(writer, entry, 2)
    assert writer.lost.get_nowait() == (entry, 1)
    assert writer.fences[0].seen == "1"
    # Events the loop queued before it heard of the loss: this write skips the check (the
    # counter stands still again), and the writer itself drops them.
    write_tokens(writer, entry, 3)
    writer.stop()
    assert writer.lost.empty()
    assert [e["pos"] for e in events_of(redis_server, "j0")] == [0, 1]


def test_a_restart_under_the_same_name_fences_the_old_process(redis_server: RedisServer) -> None:
    """The new process re-claims its own entries (delivery count 2): the old one, paused with
    delivery count 1, must not write again."""
    (entry,) = setup_group(redis_server, "me", 1)
    conn = redis_server.client()
    old = fenced_writer(conn)
    write_tokens(old, entry, 0)
    assert [(c[0].decode(), c[2]) for c in reclaim(conn, "me", include_self=True)] == [
        (entry, 2)]
    write_tokens(old, entry, 1)
    old.stop()
    assert old.lost.get_nowait() == (entry, 1)
    assert [e["pos"] for e in events_of(redis_server, "j0")] == [0]


def test_a_claim_the_counter_missed_is_caught_by_the_periodic_full_check(
        redis_server: RedisServer) -> None:
    """An XCLAIM by hand does not move the counter; within a second the writer checks anyway."""
    (entry,) = setup_group(redis_server, "me", 1)
    conn = redis_server.client()
    writer = fenced_writer(conn)
    write_tokens(writer, entry, 0)
    conn.xclaim(JOBS, "workers", "thief", 0, [entry])
    write_tokens(writer, entry, 1)  # not checked: lands (the client drops a stale attempt's)
    assert writer.lost.empty()
    writer.fences[0].checked_at -= 2.0  # a second later
    write_tokens(writer, entry, 2)
    writer.stop()
    assert writer.lost.get_nowait() == (entry, 1)
    assert [e["pos"] for e in events_of(redis_server, "j0")] == [0, 1]


def test_reply_ttl_is_set_on_the_first_events_and_then_only_now_and_then(
        redis_server: RedisServer) -> None:
    (entry,) = setup_group(redis_server, "me", 1)
    conn = redis_server.client()
    reply = KEYS.reply("j0")
    writer = Writer(conn, STREAMS, "workers", "me", reply_ttl=60, dead_ttl=60)
    writer.start()

    def write(pos: int) -> None:
        writer.submit(Batch(events=[EventWrite(entry, 1, reply,
                                               [tokens_event(1, 0, pos, [5], "x")])]))
        writer.flush()

    write(0)
    assert 0 < conn.ttl(reply) <= 60
    conn.persist(reply)
    write(1)  # within a quarter of the TTL of the last EXPIRE: no EXPIRE per event
    assert conn.ttl(reply) == -1
    writer._ttl_set_at[reply] -= 16  # a quarter of the TTL later
    write(2)
    assert 0 < conn.ttl(reply) <= 60
    writer.submit(Batch(finishes=[FinishWrite(entry, 1, reply,
                                              encode_event(error_event(1, "x", "end")))]))
    writer.flush()
    writer.stop()
    assert writer._ttl_set_at == {}  # forgotten at the finish
    assert [e["pos"] for e in events_of(redis_server, "j0")[:3]] == [0, 1, 2]


def test_a_second_finish_of_one_entry_in_the_same_call_writes_nothing(
        redis_server: RedisServer) -> None:
    (entry,) = setup_group(redis_server, "me", 1)
    conn = redis_server.client()
    fin = FinishWrite(entry, 1, KEYS.reply("j0"), encode_event(error_event(1, "x", "end")))
    done = Scripts(conn).finish(keys=finish_keys([fin, fin], JOBS, KEYS.dead("m")),
                                args=finish_args([fin, fin], "workers", "me", 60, 60))
    assert done == [1, 0]
    assert [e["type"] for e in events_of(redis_server, "j0")] == ["error"]


def test_writes_go_on_after_redis_forgets_the_scripts(redis_server: RedisServer) -> None:
    (entry,) = setup_group(redis_server, "me", 1)
    conn = redis_server.client()
    writer = Writer(conn, STREAMS, "workers", "me", reply_ttl=60, dead_ttl=60)
    writer.start()
    for pos in range(3):
        if pos == 1:
            conn.script_flush()  # what a restarted Redis knows of our scripts: nothing
        writer.submit(Batch(events=[EventWrite(entry, 1, KEYS.reply("j0"),
                                               [tokens_event(1, 0, pos, [5 + pos], "x")])]))
        writer.flush()
    writer.submit(Batch(finishes=[FinishWrite(entry, 1, KEYS.reply("j0"),
                                              encode_event(error_event(1, "x", "end")))]))
    writer.flush()
    writer.stop()
    assert writer.error is None
    assert [(e["type"], e.get("pos")) for e in events_of(redis_server, "j0")] == [
        ("tokens", 0), ("tokens", 1), ("tokens", 2), ("error", None)]


def test_nothing_is_written_after_an_attempts_terminal_event(redis_server: RedisServer) -> None:
    """Token writes skip the ownership check, so the writer itself keeps the rule the fenced
    check used to: events queued for an attempt after its finish (in the same merged round
    trip, or later) are dropped, and the terminal event stays the reply stream's last entry."""
    (entry,) = setup_group(redis_server, "me", 1)
    conn = redis_server.client()
    reply = KEYS.reply("j0")
    writer = Writer(conn, FENCED, "workers", "me", reply_ttl=60, dead_ttl=60)
    fin = FinishWrite(entry, 1, reply, encode_event(error_event(1, "x", "end")))
    late = [Batch(events=[EventWrite(entry, 1, reply, [tokens_event(1, 0, pos, [5], "x")])])
            for pos in (1, 2)]
    writer.submit(Batch(events=[EventWrite(entry, 1, reply, [tokens_event(1, 0, 0, [5], "x")])],
                        finishes=[fin]))
    writer.submit(late[0])  # queued before the writer runs: merged behind the finish
    writer.start()
    writer.flush()
    writer.submit(late[1])  # a later round trip
    writer.flush()
    writer.stop()
    assert [(e["type"], e.get("pos")) for e in events_of(redis_server, "j0")] == [
        ("tokens", 0), ("error", None)]
    assert writer.lost.empty()


def test_after_a_claim_an_entry_the_first_write_did_not_carry_is_checked_at_its_own(
        redis_server: RedisServer) -> None:
    """The write that sees the counter move checks the entries it carries; an entry of another
    job (it had nothing to write then) is checked on its own at its next write, not trusted."""
    first, second = setup_group(redis_server, "me", 2)
    conn = redis_server.client()
    writer = fenced_writer(conn)

    def write(entry: str, job: str, pos: int) -> None:
        writer.submit(Batch(events=[EventWrite(entry, 1, KEYS.reply(job),
                                               [tokens_event(1, 0, pos, [5], "x")])]))
        writer.flush()

    write(first, "j0", 0)
    write(second, "j1", 0)
    assert sorted(c[0].decode() for c in reclaim(conn, "thief")) == sorted([first, second])
    write(first, "j0", 1)  # the counter moved: this write checks, and learns of `first`
    assert writer.lost.get_nowait() == (first, 1)
    write(second, "j1", 1)  # the counter stands still again, but `second` was not checked yet
    assert writer.lost.get_nowait() == (second, 1)
    conn.xadd(JOBS, {"v": b"2", "job": msgpack.packb({"id": "j2"})})
    ((_, [(third, _)]),) = conn.xreadgroup("workers", "me", {JOBS: ">"}, count=1)
    write(third.decode(), "j2", 0)  # a new entry: checked once, and it is ours
    writer.stop()
    assert writer.lost.empty()
    assert [[e["pos"] for e in events_of(redis_server, j)] for j in ("j0", "j1", "j2")] == [
        [0], [0], [0]]


def test_gone_attempts_are_forgotten_ten_seconds_after_their_last_mark() -> None:
    # (no Redis call: the bookkeeping alone, on a writer that never starts)
    writer = Writer(redis.Redis(), STREAMS, "workers", "me", 60, 60)
    writer._mark_gone("1-0", 1, now=100.0)
    writer._mark_gone("2-0", 1, now=101.0)
    writer._mark_gone("1-0", 2, now=102.0)  # the same entry, a later attempt
    writer._mark_gone("1-0", 1, now=105.0)  # marked again: its 10 s start over
    assert writer._gone_ids == {"1-0": 2, "2-0": 1}
    writer._forget_gone(now=111.5)  # 2-0 (101) goes, then 1-0/2 (102) is still young enough
    assert list(writer._gone) == [("1-0", 2), ("1-0", 1)]
    assert writer._gone_ids == {"1-0": 2}
    writer._forget_gone(now=112.5)
    assert list(writer._gone) == [("1-0", 1)] and writer._gone_ids == {"1-0": 1}
    writer._forget_gone(now=115.5)
    assert writer._gone == {} and writer._gone_ids == {}


def test_the_dead_letter_stream_keeps_about_the_newest_ten_thousand(
        redis_server: RedisServer) -> None:
    """A trickle of bad jobs over days must not grow the dead-letter stream (each letter may
    carry a raw job of up to --max-job-bytes) without end: MAXLEN ~ keeps the newest
    DEAD_LETTER_MAXLEN, trimmed by whole stream nodes (100 entries each)."""
    count = DEAD_LETTER_MAXLEN + 250
    conn = redis_server.client()
    conn.xgroup_create(JOBS, "workers", id="0", mkstream=True)
    pipe = conn.pipeline(transaction=False)
    for _ in range(count):
        pipe.xadd(JOBS, {"v": b"2", "job": b"bad"})
    pipe.execute()
    got = conn.xreadgroup("workers", "me", {JOBS: ">"}, count=count)
    entry_ids = [eid.decode() for eid, _ in got[0][1]]
    writer = Writer(conn, STREAMS, "workers", "me", 60, 60)
    for lo in range(0, count, 1000):
        writer.write_batches([Batch(finishes=[
            FinishWrite(eid, 1, None, None, dead_fields=["reason", "bad", "entry", eid])
            for eid in entry_ids[lo:lo + 1000]])])
    length = conn.xlen(KEYS.dead("m"))
    assert DEAD_LETTER_MAXLEN <= length < DEAD_LETTER_MAXLEN + 100
    newest = conn.xrevrange(KEYS.dead("m"), count=1)[0][1]
    oldest = conn.xrange(KEYS.dead("m"), count=1)[0][1]
    assert newest[b"entry"].decode() == entry_ids[-1]
    assert oldest[b"entry"].decode() == entry_ids[count - length]
    assert conn.xlen(JOBS) == 0  # (every entry acked and deleted)


def test_a_write_refused_for_good_counts_a_failed_attempt_of_its_job_only(
        redis_server: RedisServer) -> None:
    """A worker user that may not write j1's reply key (any lasting refusal: an ACL, a cluster's
    CROSSSLOT): j0, written in the same pipeline, gets its events; j1's attempt counts as failed
    (a delivery more, handed back as lost, so the worker runs it again as its next attempt and
    past --max-attempts dead-letters it). That dead-lettering, refused at j1's reply key too,
    writes the dead letter and the ack alone."""
    first, second = setup_group(redis_server, "me", 2)
    admin = redis_server.client()
    admin.execute_command("ACL", "SETUSER", "narrow", "on", ">pw", "resetkeys", "~genq:jobs:*",
                          "~genq:dead:*", "~genq:idem:*", "~genq:reply:{m}:j0", "+@all")
    conn = redis.Redis(port=redis_server.port, username="narrow", password="pw", protocol=2)
    writer = Writer(conn, STREAMS, "workers", "me", reply_ttl=60, dead_ttl=60)
    writer.start()
    writer.submit(Batch(events=[
        EventWrite(first, 1, KEYS.reply("j0"), [started_event(1, "me")]),
        EventWrite(second, 1, KEYS.reply("j1"), [started_event(1, "me")])]))
    writer.flush()
    assert writer.lost.get_nowait() == (second, 1) and writer.lost.empty()
    assert [e["type"] for e in events_of(redis_server, "j0")] == ["started"]
    pending = admin.xpending_range(JOBS, "workers", "-", "+", 10)
    assert [(p["message_id"].decode(), p["times_delivered"]) for p in pending] == [
        (first, 1), (second, 2)]
    writer.submit(Batch(finishes=[FinishWrite(
        second, 2, KEYS.reply("j1"), encode_event(error_event(2, "max_attempts", "x")),
        dead_fields=["code", "max_attempts", "entry", second], idem_key=KEYS.idem("j1"))]))
    writer.flush()
    writer.stop()
    assert writer.finished.get_nowait() == second
    assert [(f[b"code"], f[b"entry"].decode()) for _, f in admin.xrange(KEYS.dead("m"))] == [
        (b"max_attempts", second)]
    assert [p["message_id"].decode() for p in admin.xpending_range(
        JOBS, "workers", "-", "+", 10)] == [first]
