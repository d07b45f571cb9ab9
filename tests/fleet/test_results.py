"""Client.results against a real redis-server, the test playing the worker's part: only each
reply stream's last entry is decoded (earlier entries are garbage here, which would fail to
decode), streams may appear late, more than 512 streams are waited on, Redis restarts, and a user
docs/security.md's producer ACL limits to XREAD waits the same way without the script."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from producer import Client, JobError
from producer.events import done_event, encode_event, error_event, started_event, tokens_event
from producer.protocol import REPLY_FIELD, Keys, ProtocolError
from producer.results import _SCRIPT_REFUSED, pass_interval
from tests.harness.fleet import RedisServer
from tests.harness.secure_redis import ACL_RULES, PASSWORDS, RESULTS_SELECTOR

KEYS = Keys(model="tiny")  # (the jobs of the replies here: model tiny's)
GARBAGE = b"\xc1 not an event"  # 0xc1 is never valid MessagePack


def write(server: RedisServer, job_id: str, *events: dict[str, object] | bytes) -> None:
    conn = server.client()
    for event in events:
        value = event if isinstance(event, bytes) else encode_event(event)
        conn.xadd(KEYS.reply(job_id), {REPLY_FIELD: value})


def done(attempt: int, ids: list[int], text: str = "") -> dict[str, object]:
    return done_event(attempt, [{"index": 0, "token_ids": ids, "text": text, "finish_reason":
                                 "length", "cumulative_logprob": 0.0}],
                      {"prompt_tokens": 2, "completion_tokens": len(ids)}, {})


def streamed(server: RedisServer, job_id: str, ids: list[int]) -> dict[str, object]:
    """A job's reply stream as a worker writes it: started, one tokens event per token, done."""
    write(server, job_id, started_event(1, "w"),
          *[tokens_event(1, 0, pos, [t], f"<{t}>") for pos, t in enumerate(ids)])
    end = done(1, ids, "".join(f"<{t}>" for t in ids))
    write(server, job_id, end)
    return end


def producer_url(server: RedisServer, results_script: bool = True) -> str:
    """A URL for user genq-producer with docs/security.md's producer ACL lines, or without
    `results_script` those lines less the selector for Client.results' script (an ACL written
    before it) (made now: a restarted server has forgotten it)."""
    rules = [r for r in ACL_RULES["genq-producer"] if results_script or r != RESULTS_SELECTOR]
    server.client().execute_command("ACL", "SETUSER", "genq-producer", "reset", "on",
                                    ">" + PASSWORDS["genq-producer"], *rules)
    return f"redis://genq-producer:{PASSWORDS['genq-producer']}@127.0.0.1:{server.port}/0"


@pytest.fixture(params=["script", "producer-acl", "xread-only"])
def client(request: pytest.FixtureRequest, redis_server: RedisServer) -> Iterator[Client]:
    """A Client as the default user or docs/security.md's producer user (the script path), or as a
    producer whose ACL lacks the script's selector (the XREAD-only path)."""
    url = {"script": lambda: redis_server.url,
           "producer-acl": lambda: producer_url(redis_server),
           "xread-only": lambda: producer_url(redis_server, results_script=False)}[
        request.param]()
    with Client(url) as c:
        yield c


def test_only_each_streams_last_entry_is_decoded(redis_server: RedisServer,
                                                client: Client) -> None:
    """Entries before the terminal event are garbage that decode_event would refuse: results
    come out right, so they were never decoded (with the script they are not even sent)."""
    write(redis_server, "a", *[GARBAGE] * 700, done(1, [5, 6], "ab"))
    write(redis_server, "b", started_event(1, "w"), *[GARBAGE] * 3,
          error_event(1, "too_long", "the prompt is 9000 tokens, over the model's 4096"))
    write(redis_server, "c", GARBAGE, tokens_event(1, 0, 0, [7], "x"), done(2, [7, 8]))
    jobs = [client.job(j, "tiny") for j in "abc"]
    first, failed, third = client.results(jobs, timeout=10, return_exceptions=True)
    assert first == done(1, [5, 6], "ab")
    assert isinstance(failed, JobError) and (failed.job_id, failed.code, failed.message) == (
        "b", "too_long", "the prompt is 9000 tokens, over the model's 4096")
    assert third == done(2, [7, 8])
    with pytest.raises(JobError, match="^job b failed \\(too_long\\): the prompt is 9000 "):
        client.results(jobs, timeout=10)


def test_a_last_entry_that_is_not_an_event_is_a_protocol_error(redis_server: RedisServer,
                                                                client: Client) -> None:
    write(redis_server, "g", started_event(1, "w"), GARBAGE)
    with pytest.raises(ProtocolError, match="^event is not valid MessagePack"):
        client.results([client.job("g", "tiny")], timeout=10)
    redis_server.client().xadd(KEYS.reply("m"), {"other": b"x"})
    with pytest.raises(ProtocolError, match="^entry .* of genq:reply:{tiny}:m has no field 'e'$"):
        client.results([client.job("m", "tiny")], timeout=10)


def test_streams_that_appear_and_grow_while_it_waits(redis_server: RedisServer,
                                                     client: Client) -> None:
    """700 jobs (two XREADs / script calls per pass), none started when the wait begins; they
    start in reverse order, stream tokens interleaved with each other (so passes see streams whose
    last entry is a tokens event), then end."""
    ids = [f"j{i}" for i in range(700)]
    jobs = [client.job(j, "tiny") for j in ids]
    expected: dict[str, dict[str, object]] = {}

    def worker() -> None:
        conn = redis_server.client()
        for lo in reversed(range(0, 700, 100)):
            group = ids[lo:lo + 100]
            for j in group:
                conn.xadd(KEYS.reply(j), {REPLY_FIELD: encode_event(started_event(1, "w"))})
            for pos in range(5):
                pipe = conn.pipeline(transaction=False)
                for j in group:
                    pipe.xadd(KEYS.reply(j), {REPLY_FIELD: encode_event(
                        tokens_event(1, 0, pos, [int(j[1:]) + pos], "t"))})
                pipe.execute()
            for j in group:
                expected[j] = done(1, [int(j[1:]) + pos for pos in range(5)], "ttttt")
                write(redis_server, j, expected[j])

    thread = threading.Thread(target=worker)
    thread.start()
    results = client.results(jobs, timeout=60)
    thread.join()
    assert results == [expected[j] for j in ids]


def test_a_job_whose_stream_has_tokens_but_no_end_times_out(redis_server: RedisServer,
                                                            client: Client) -> None:
    end = streamed(redis_server, "ok", [1, 2, 3])
    write(redis_server, "slow", started_event(1, "w"), tokens_event(1, 0, 0, [4], "x"))
    jobs = [client.job("ok", "tiny"), client.job("slow", "tiny"), client.job("unborn", "tiny")]
    with pytest.raises(TimeoutError, match="^2 of 3 job\\(s\\) had no terminal event within "
                                           "0.4 s$"):
        client.results(jobs, timeout=0.4)
    ok, slow, unborn = client.results(jobs, timeout=0.4, return_exceptions=True)
    assert ok == end
    assert slow is unborn and isinstance(slow, TimeoutError) and str(slow) == (
        "2 of 3 job(s) had no terminal event within 0.4 s")
    write(redis_server, "slow", tokens_event(1, 0, 1, [5], "y"), done(1, [4, 5], "xy"))
    assert client.results(jobs[:2], timeout=10) == [end, done(1, [4, 5], "xy")]


def test_it_waits_through_a_redis_restart(redis_server: RedisServer, client: Client) -> None:
    """Redis goes away mid-wait (reconnect with backoff) and comes back without the script
    cache (the script is loaded again): every job still ends."""
    ids = [f"r{i}" for i in range(10)]
    jobs = [client.job(j, "tiny") for j in ids]
    for j in ids[:5]:
        streamed(redis_server, j, [int(j[1:])])

    def restart_then_finish() -> None:
        redis_server.restart(down_s=0.5)
        producer_url(redis_server)  # the ACL user again (unused by the default user)
        for j in ids[5:]:
            streamed(redis_server, j, [int(j[1:])])

    thread = threading.Thread(target=restart_then_finish)
    thread.start()
    results = client.results(jobs, timeout=60)
    thread.join()
    assert [r["outputs"][0]["token_ids"] for r in results] == [[i] for i in range(10)]


def test_an_acl_without_the_scripts_selector_is_refused_it_once_per_connection(
        redis_server: RedisServer) -> None:
    admin = redis_server.client()
    url = producer_url(redis_server, results_script=False)
    admin.execute_command("ACL", "LOG", "RESET")
    end = streamed(redis_server, "p1", [3, 1])
    with Client(url) as client:
        for _ in range(3):
            assert client.results([client.job("p1", "tiny")], timeout=10) == [end]
        assert client.blocking_redis in _SCRIPT_REFUSED
    log = admin.acl_log()
    assert [(e["reason"], e["object"], e["username"], e["count"]) for e in log] == [
        ("key", "genq:reply:{tiny}:p1", "genq-producer", 1)]
    admin.execute_command("ACL", "LOG", "RESET")
    with Client(producer_url(redis_server)) as client:  # docs/security.md's lines allow it
        assert client.results([client.job("p1", "tiny")], timeout=10) == [end]
        assert client.blocking_redis not in _SCRIPT_REFUSED
    assert admin.acl_log() == []


def test_a_job_given_twice_is_refused_before_any_read(redis_server: RedisServer) -> None:
    with Client(redis_server.url) as client:
        with pytest.raises(ValueError, match="^job d is given twice$"):
            client.results([client.job(j, "tiny") for j in "cdd"])


def test_pass_interval_scales_with_the_unfinished_streams() -> None:
    assert [pass_interval(n) for n in (0, 1, 40, 256, 1000, 20_000, 100_000)] == [
        0.002, 0.002, 0.002, 256 * 50e-6, 0.05, 1.0, 1.0]


def test_results_of_nothing_is_nothing(redis_server: RedisServer) -> None:
    with Client(redis_server.url) as client:
        assert client.results([], timeout=0) == []
