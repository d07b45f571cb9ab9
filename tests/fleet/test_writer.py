"""The writer thread and the fenced Lua scripts against a real redis-server (no engine)."""

from __future__ import annotations

import msgpack

from producer.protocol import (
    REPLY_FIELD,
    Keys,
    decode_event,
    encode_event,
    error_event,
    started_event,
    tokens_event,
)
from tests.fleet.harness import RedisServer
from worker.io_thread import Batch, EventWrite, FinishWrite, Writer, coalesce, finish_args
from worker.scripts import Scripts

KEYS = Keys()
JOBS = KEYS.jobs("m")


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


def setup_group(server: RedisServer, consumer: str, count: int) -> list[str]:
    conn = server.client()
    conn.xgroup_create(JOBS, "workers", id="0", mkstream=True)
    for i in range(count):
        conn.xadd(JOBS, {"v": b"1", "job": msgpack.packb({"id": f"j{i}"})})
    got = conn.xreadgroup("workers", consumer, {JOBS: ">"}, count=count)
    return [eid.decode() for eid, _ in got[0][1]]


def events_of(server: RedisServer, job_id: str) -> list[dict[str, object]]:
    return [decode_event(f[REPLY_FIELD.encode()])
            for _, f in server.client().xrange(KEYS.reply(job_id))]


def test_writes_to_an_entry_another_worker_claimed_are_refused(redis_server: RedisServer) -> None:
    mine, stolen = setup_group(redis_server, "me", 2)
    conn = redis_server.client()
    conn.xclaim(JOBS, "workers", "thief", 0, [stolen])
    writer = Writer(conn, JOBS, KEYS.dead("m"), "workers", "me", reply_ttl=60, dead_ttl=60)
    writer.start()
    writer.submit(Batch(events=[EventWrite(mine, 1, KEYS.reply("j0"), [started_event(1, "me")]),
                                EventWrite(stolen, 1, KEYS.reply("j1"),
                                           [started_event(1, "me")])]))
    writer.submit(Batch(finishes=[
        FinishWrite(mine, 1, KEYS.reply("j0"), encode_event(error_event(1, "x", "done"))),
        FinishWrite(stolen, 1, KEYS.reply("j1"), encode_event(error_event(1, "x", "done")))]))
    writer.flush()
    writer.stop()
    assert writer.lost.get_nowait() == stolen and writer.lost.empty()
    assert [e["type"] for e in events_of(redis_server, "j0")] == ["started", "error"]
    assert events_of(redis_server, "j1") == []
    pending = conn.xpending_range(JOBS, "workers", "-", "+", 10)
    assert [(p["message_id"].decode(), p["consumer"]) for p in pending] == [(stolen, b"thief")]
    assert conn.xlen(JOBS) == 1  # the finished entry was acked and deleted, the stolen one not
    assert 0 < conn.ttl(KEYS.reply("j0")) <= 60


def test_a_stale_delivery_count_is_fenced_too(redis_server: RedisServer) -> None:
    """Same consumer name, older attempt (a restarted worker re-claimed its own entry)."""
    (entry,) = setup_group(redis_server, "me", 1)
    conn = redis_server.client()
    conn.xclaim(JOBS, "workers", "me", 0, [entry])  # deliveries is now 2
    done = Scripts(conn).finish(keys=[JOBS, KEYS.dead("m"), KEYS.reply("j0")],
                                args=finish_args([FinishWrite(entry, 1, KEYS.reply("j0"), None)],
                                                 "workers", "me", 60, 60))
    assert done == [0] and conn.xpending(JOBS, "workers")["pending"] == 1


def test_reclaim_takes_only_entries_of_workers_without_a_heartbeat(
        redis_server: RedisServer) -> None:
    entries = setup_group(redis_server, "alive", 2)
    conn = redis_server.client()
    conn.xclaim(JOBS, "workers", "dead", 0, [entries[1]])
    conn.set(KEYS.worker("alive"), b"x", px=10_000)
    claimed = Scripts(conn).reclaim(keys=[JOBS], args=["workers", "me", KEYS.worker_prefix, 10,
                                                       "0"])
    assert [(c[0].decode(), c[2]) for c in claimed] == [(entries[1], 3)]
    owners = {p["message_id"].decode(): p["consumer"]
              for p in conn.xpending_range(JOBS, "workers", "-", "+", 10)}
    assert owners == {entries[0]: b"alive", entries[1]: b"me"}


def test_reply_ttl_is_set_on_the_first_events_and_then_only_now_and_then(
        redis_server: RedisServer) -> None:
    (entry,) = setup_group(redis_server, "me", 1)
    conn = redis_server.client()
    reply = KEYS.reply("j0")
    writer = Writer(conn, JOBS, KEYS.dead("m"), "workers", "me", reply_ttl=60, dead_ttl=60)
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
    done = Scripts(conn).finish(keys=[JOBS, KEYS.dead("m"), KEYS.reply("j0"), KEYS.reply("j0")],
                                args=finish_args([fin, fin], "workers", "me", 60, 60))
    assert done == [1, 0]
    assert [e["type"] for e in events_of(redis_server, "j0")] == ["error"]


def test_writes_go_on_after_redis_forgets_the_scripts(redis_server: RedisServer) -> None:
    (entry,) = setup_group(redis_server, "me", 1)
    conn = redis_server.client()
    writer = Writer(conn, JOBS, KEYS.dead("m"), "workers", "me", reply_ttl=60, dead_ttl=60)
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
