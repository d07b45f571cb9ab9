"""Client and AsyncClient against a real redis-server (the test plays the worker's part by
writing reply events itself)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading

import pytest

from producer import AsyncClient, Client, JobError
from producer.events import done_event, encode_event, error_event, started_event, tokens_event
from producer.protocol import REPLY_FIELD, Keys, ProtocolError, decode_job_entry
from tests.harness.fleet import REPO, RedisServer, blocked_xreads, wait_for

KEYS = Keys(model="tiny")  # (the jobs of the replies here: model tiny's)


def write(server: RedisServer, job_id: str, *events: dict[str, object]) -> None:
    conn = server.client()
    for event in events:
        conn.xadd(KEYS.reply(job_id), {REPLY_FIELD: encode_event(event)})


def done(attempt: int, ids: list[int]) -> dict[str, object]:
    return done_event(attempt, [{"index": 0, "token_ids": ids, "text": "", "finish_reason":
                                 "length", "cumulative_logprob": 0.0}], {}, {})


def test_submitting_an_id_twice_enqueues_it_once(redis_server: RedisServer) -> None:
    client = Client(redis_server.url)
    first = client.submit("hi", {"temperature": 0}, model="tiny", job_id="j1")
    second = client.submit("other", {"temperature": 0}, model="tiny", job_id="j1")
    assert (first.created, second.created) == (True, False)
    entries = redis_server.client().xrange(KEYS.jobs("tiny"))
    assert len(entries) == 1
    spec, _ = decode_job_entry(entries[0][1])
    assert (spec.id, spec.prompt, spec.seed) == ("j1", "hi", None)


def test_sampling_without_a_seed_gets_one_from_the_producer(redis_server: RedisServer) -> None:
    Client(redis_server.url).submit([5, 6], {"temperature": 0.7}, model="tiny", job_id="s")
    spec, _ = decode_job_entry(redis_server.client().xrange(KEYS.jobs("tiny"))[0][1])
    assert spec.prompt_token_ids == [5, 6]
    assert isinstance(spec.seed, int) and 0 <= spec.seed < 2**63


def test_submit_and_cancel_keys_carry_ttls(redis_server: RedisServer) -> None:
    client = Client(redis_server.url, idempotency_ttl=100, stream_ttl=200, cancel_ttl=50)
    job = client.submit("hi", model="tiny", job_id="j2")
    pubsub = redis_server.client().pubsub(ignore_subscribe_messages=True)
    pubsub.ssubscribe(KEYS.cancel_channel("tiny"))
    job.cancel()
    message = wait_for(lambda: pubsub.get_message(timeout=0.1), what="cancel publish")
    assert message["type"] == "smessage"
    conn = redis_server.client()
    assert message["data"] == b"j2"
    assert 0 < conn.ttl(KEYS.idem("j2")) <= 100
    assert 100 < conn.ttl(KEYS.jobs("tiny")) <= 200
    assert 0 < conn.ttl(KEYS.cancel("j2")) <= 50


def test_bad_params_fail_fast_in_the_producer(redis_server: RedisServer) -> None:
    client = Client(redis_server.url)
    with pytest.raises(ValueError, match="unknown sampling parameter"):
        client.submit("hi", {"temprature": 0}, model="tiny")
    with pytest.raises(ValueError, match="must be 1-128 characters"):
        client.submit("hi", model="tiny", job_id="no spaces")
    assert redis_server.client().exists(KEYS.jobs("tiny")) == 0


def test_stream_drops_superseded_attempts_and_repeated_positions(
        redis_server: RedisServer) -> None:
    write(redis_server, "j3", started_event(1, "a"), tokens_event(1, 0, 0, [7], "x"),
          started_event(2, "b"), tokens_event(1, 0, 1, [9], "z"), tokens_event(2, 0, 0, [7], "x"),
          tokens_event(2, 0, 1, [8], "y"), done(2, [7, 8]))
    events = list(Client(redis_server.url).job("j3", "tiny").stream(timeout=10))
    assert [(e["type"], e.get("pos"), e.get("token_ids")) for e in events] == [
        ("started", None, None), ("tokens", 0, [7]), ("started", None, None),
        ("tokens", 1, [8]), ("done", None, None)]


def test_result_raises_job_error_on_error_event(redis_server: RedisServer) -> None:
    write(redis_server, "j4", started_event(1, "a"), error_event(1, "cancelled", "by you"))
    with pytest.raises(JobError) as exc:
        Client(redis_server.url).job("j4", "tiny").result(timeout=10)
    assert (exc.value.code, exc.value.message) == ("cancelled", "by you")


def test_result_times_out_without_terminal_event(redis_server: RedisServer) -> None:
    write(redis_server, "j5", started_event(1, "a"))
    with pytest.raises(TimeoutError):
        Client(redis_server.url).job("j5", "tiny").result(timeout=0.3)


def test_a_job_that_ended_in_time_is_not_timed_out_by_a_long_stream(
        redis_server: RedisServer) -> None:
    """3,000 entries before the end (six full reads) and a timeout shorter than reading them:
    the deadline is only checked once the reads have caught up, so the result comes back."""
    conn = redis_server.client()
    pipe = conn.pipeline(transaction=False)
    pipe.xadd(KEYS.reply("long"), {REPLY_FIELD: encode_event(started_event(1, "w"))})
    for pos in range(3000):
        pipe.xadd(KEYS.reply("long"), {REPLY_FIELD: encode_event(
            tokens_event(1, 0, pos, [pos % 7], "x"))})
    pipe.xadd(KEYS.reply("long"), {REPLY_FIELD: encode_event(done(1, [pos % 7 for pos in
                                                                     range(3000)]))})
    pipe.execute()
    want = [pos % 7 for pos in range(3000)]
    assert Client(redis_server.url).job("long", "tiny").result(timeout=0.001)["outputs"][0][
        "token_ids"] == want

    async def scenario() -> list[object]:
        async with AsyncClient(redis_server.url) as client:
            one = await client.job("long", "tiny").result(timeout=0.001)
            many = await client.results([client.job("long", "tiny")] * 3, timeout=0.001)
            return [r["outputs"][0]["token_ids"] for r in [one, *many]]

    assert asyncio.run(scenario()) == [want] * 4


def test_a_reply_entry_that_is_not_an_event_is_a_protocol_error(
        redis_server: RedisServer) -> None:
    """(Not a worker's writing: e.g. an app's XADD to the wrong key.)"""
    conn = redis_server.client()
    conn.xadd(KEYS.reply("odd"), {"note": "hello"})
    with pytest.raises(ProtocolError) as exc:
        Client(redis_server.url).job("odd", "tiny").result(timeout=5)
    assert (exc.value.code, exc.value.message) == (
        "missing_field", "a reply entry needs the field 'e' (it has note)")

    async def scenario() -> None:
        async with AsyncClient(redis_server.url) as client:
            await client.job("odd", "tiny").result(timeout=5)

    with pytest.raises(ProtocolError) as aexc:
        asyncio.run(scenario())
    assert aexc.value.code == "missing_field"


def test_stream_resumes_after_redis_restarts(redis_server: RedisServer) -> None:
    write(redis_server, "j6", started_event(1, "a"), tokens_event(1, 0, 0, [1], "a"))
    seen: list[dict[str, object]] = []
    reader = threading.Thread(target=lambda: seen.extend(
        Client(redis_server.url).job("j6", "tiny").stream(timeout=60)))
    reader.start()
    wait_for(lambda: len(seen) == 2, what="events before the restart")
    redis_server.restart(down_s=0.5)
    write(redis_server, "j6", tokens_event(1, 0, 1, [2], "b"), done(1, [1, 2]))
    reader.join(60)
    assert [(e["type"], e.get("pos")) for e in seen] == [("started", None), ("tokens", 0),
                                                          ("tokens", 1), ("done", None)]


@pytest.mark.parametrize("how", ["result", "results"])
def test_a_read_its_server_unblocks_reads_on(redis_server: RedisServer, how: str) -> None:
    """A primary that becomes a replica (a failover) ends the blocked XREADs on it with
    UNBLOCKED, as CLIENT UNBLOCK ... ERROR does here: Job.result and Client.results read on, as
    after a lost connection, and return the result written afterwards."""
    conn = redis_server.client()
    got: list[object] = []
    job_id = f"ub-{how}"

    def read() -> None:
        client = Client(redis_server.url)
        job = client.job(job_id, "tiny")
        try:
            got.append(job.result(timeout=60) if how == "result"
                       else client.results([job], timeout=60)[0])
        except Exception as exc:  # (the assertion below shows it)
            got.append(exc)

    def unblock() -> bool:
        return any([conn.client_unblock(client_id, error=True)
                    for client_id in blocked_xreads(conn)])

    reader = threading.Thread(target=read)
    reader.start()
    wait_for(unblock, what="a blocked read to unblock")
    write(redis_server, job_id, started_event(1, "w"), done(1, [5]))
    reader.join(60)
    assert [r["outputs"][0]["token_ids"] for r in got] == [[5]]  # type: ignore[index]


def test_async_client_mirrors_the_sync_one(redis_server: RedisServer) -> None:
    async def scenario() -> tuple[bool, bool, list[str], dict[str, object]]:
        async with AsyncClient(redis_server.url) as client:
            job = await client.submit("hi", {"temperature": 0}, model="tiny", job_id="a1")
            again = await client.submit("hi", {"temperature": 0}, model="tiny", job_id="a1")
            write(redis_server, "a1", started_event(1, "w"), tokens_event(1, 0, 0, [3], "c"),
                  done(1, [3]))
            kinds = [e["type"] async for e in job.stream(timeout=10)]
            return job.created, again.created, kinds, await job.result(timeout=10)

    created, again, kinds, result = asyncio.run(scenario())
    assert (created, again) == (True, False)
    assert kinds == ["started", "tokens", "done"]
    assert result["outputs"][0]["token_ids"] == [3]  # type: ignore[index]


def test_300_jobs_submitted_and_read_at_once_by_an_async_client(
        redis_server: RedisServer) -> None:
    """More concurrent callers than redis-py 8's default pool cap (100): each submit gets a
    connection, none is refused with "Too many connections"; the 300 streams wait on the
    client's one shared XREAD, not on a blocked connection each."""
    ids = [f"many-{k}" for k in range(300)]
    conn = redis_server.client()

    def blocked_reads() -> int:
        return len(blocked_xreads(conn))

    async def scenario() -> tuple[list[list[int]], tuple[int, int]]:
        async with AsyncClient(redis_server.url) as client:
            jobs = await asyncio.gather(*(client.submit("hi", {"temperature": 0}, model="tiny",
                                                        job_id=i) for i in ids))
            reads = [asyncio.ensure_future(job.result(timeout=60)) for job in jobs]
            # Each read finds its stream empty, then waits on the hub; readers the hub
            # superseded as subscriptions came in end with their XREAD's block (1 s).
            hub = client.hub()
            assert hub is not None
            for _ in range(3000):
                if hub.subscriptions == 300:
                    break
                await asyncio.sleep(0.01)
            blocked = -1
            for _ in range(300):
                blocked = await asyncio.to_thread(blocked_reads)
                if blocked == 1:
                    break
                await asyncio.sleep(0.1)
            for k, job_id in enumerate(ids):
                write(redis_server, job_id, started_event(1, "w"), done(1, [k]))
            results = await asyncio.gather(*reads)
            return [r["outputs"][0]["token_ids"] for r in results], (hub.subscriptions, blocked)  # type: ignore[index]

    results, (left, blocked) = asyncio.run(scenario())
    assert results == [[k] for k in range(300)]
    assert (left, blocked) == (0, 1)  # (every job's subscription ended with its read)


def test_text_that_is_not_unicode_is_refused_before_enqueueing(redis_server: RedisServer) -> None:
    """A lone surrogate (half a UTF-16 pair: what a non-UTF-8 byte in argv becomes) cannot be
    sent as MessagePack text: a ProtocolError naming the field, not a UnicodeEncodeError."""
    client = Client(redis_server.url)
    with pytest.raises(ProtocolError) as bad_stop:
        client.submit("hi", {"stop": ["ok", "\udcff"]}, model="tiny")
    assert bad_stop.value.code == "bad_text"
    assert str(bad_stop.value) == (
        "params.stop[1] is not valid Unicode text: it holds the lone surrogate '\\udcff' at "
        "character 0 (half a UTF-16 pair, which UTF-8 cannot encode)")
    out = subprocess.run([sys.executable, "-m", "producer.cli", "submit", b"caf\xe9", "--model",
                          "tiny", "--redis", redis_server.url], cwd=REPO, capture_output=True,
                         timeout=60)
    assert out.returncode == 2
    assert out.stderr.decode().strip() == (
        "genq submit: prompt is not valid Unicode text: it holds the lone surrogate '\\udce9' "
        "at character 3 (half a UTF-16 pair, which UTF-8 cannot encode)")
    assert redis_server.client().exists(KEYS.jobs("tiny")) == 0


def test_results_waits_for_many_jobs_in_order_across_xread_chunks(
        redis_server: RedisServer) -> None:
    """Client.results == [job.result() for job in jobs], reading up to 512 streams per XREAD:
    600 jobs whose ends arrive (out of order, after a superseded attempt for one) while it
    waits; a failed one raises its JobError only after the rest ended, or stands in the list."""
    client = Client(redis_server.url)
    jobs = [client.submit("hi", {"temperature": 0}, model="tiny", job_id=f"m{i}")
            for i in range(600)]

    def finish() -> None:
        for i in reversed(range(600)):
            if i == 7:
                write(redis_server, "m7", started_event(1, "w"), error_event(1, "cancelled",
                                                                             "by the client"))
            elif i == 3:  # attempt 1 dies mid-way; attempt 2 replays and ends
                write(redis_server, "m3", tokens_event(1, 0, 0, [9], "x"),
                      tokens_event(2, 0, 0, [9], "x"), done(2, [9, 4]))
            else:
                write(redis_server, f"m{i}", done(1, [i]))

    writer = threading.Thread(target=finish)
    writer.start()
    results = client.results(jobs, timeout=60, return_exceptions=True)
    writer.join()
    assert [r["outputs"][0]["token_ids"] for k, r in enumerate(results) if k not in (3, 7)] == [
        [i] for i in range(600) if i not in (3, 7)]
    assert results[3]["outputs"][0]["token_ids"] == [9, 4] and results[3]["attempt"] == 2
    assert isinstance(results[7], JobError) and (results[7].job_id, results[7].code) == (
        "m7", "cancelled")
    with pytest.raises(JobError, match="job m7 failed \\(cancelled\\): by the client"):
        client.results(jobs[5:9])
    with pytest.raises(ValueError, match="job m1 is given twice"):
        client.results([jobs[1], jobs[1]])


def test_results_times_out_naming_how_many_jobs_are_unfinished(
        redis_server: RedisServer) -> None:
    client = Client(redis_server.url)
    jobs = [client.submit("hi", {"temperature": 0}, model="tiny", job_id=j) for j in ("t1", "t2")]
    write(redis_server, "t1", done(1, [1]))
    with pytest.raises(TimeoutError, match="^1 of 2 job\\(s\\) had no terminal event within "
                                           "0.3 s$"):
        client.results(jobs, timeout=0.3)
    first, late = client.results(jobs, timeout=0.3, return_exceptions=True)
    assert first["outputs"][0]["token_ids"] == [1]
    assert isinstance(late, TimeoutError) and str(late) == (
        "1 of 2 job(s) had no terminal event within 0.3 s")
