"""One worker (capacity 4, tight caps) through capacity, cancel, bad input, fuzz, dead-letter and
TTL checks. The worker and its redis-server are shared by the module; the last test checks what
the whole module left in Redis."""

from __future__ import annotations

import asyncio
import itertools
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from producer import AsyncClient, Client, JobError
from producer.protocol import Keys, ProtocolError, decode_heartbeat, validate_name
from tests.harness.fleet import (
    REPO,
    RedisServer,
    WorkerProcess,
    reply_events,
    serving_worker,
    wait_for,
)

KEYS = Keys(model="tiny")  # (the jobs of the replies here: model tiny's)
JOBS_KEY = KEYS.jobs("tiny")
DEAD_KEY = KEYS.dead("tiny")
_ids = itertools.count()


@pytest.fixture(scope="module")
def worker(server: RedisServer, long_llama: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    # long_llama: tiny_llama with 4096 positions, so a job can outlast a deadline.
    yield from serving_worker(server, long_llama, tmp_path_factory.mktemp("workers"), "solo",
                              "--max-num-seqs", "4", "--max-tokens-cap", "4000", "--max-n", "2",
                              "--max-prompt-tokens", "64", "--max-attempts", "3",
                              "--result-ttl", "6")


def heartbeat(server: RedisServer) -> dict[str, Any]:
    value = server.client().get(KEYS.worker("tiny", "solo"))
    assert value is not None
    return decode_heartbeat(value)


def raw_job(job_id: str, **overrides: Any) -> dict[str, Any]:
    job = {"id": job_id, "model": "tiny", "prompt": "the quick brown fox",
           "params": {"temperature": 0, "max_tokens": 4}, "seed": None, "created": time.time(),
           "deadline": None, "stream": True}
    job.update(overrides)
    return job


def xadd_raw(server: RedisServer, fields: dict[str, bytes]) -> str:
    return server.client().xadd(JOBS_KEY, fields).decode()  # type: ignore[no-any-return]


def finished_entry(server: RedisServer, entry_id: str) -> bool:
    """The worker acked and deleted the entry (its fenced finish ran)."""
    conn = server.client()
    return not conn.xrange(JOBS_KEY, entry_id, entry_id) and not conn.xpending_range(
        JOBS_KEY, "workers", entry_id, entry_id, 1)


def terminal(server: RedisServer, job_id: str) -> dict[str, Any] | None:
    ends = [e for e in reply_events(server, job_id) if e["type"] in ("done", "error")]
    assert len(ends) <= 1
    return ends[0] if ends else None


def test_capacity_4_never_holds_more_than_4_pending_entries(server: RedisServer,
                                                            worker: WorkerProcess) -> None:
    client = Client(server.url)
    # Each job runs for 100 steps, 4 at a time: a poll every few ms sees the worker at its cap.
    jobs = [client.submit(f"prompt {i}", {"temperature": 0, "max_tokens": 100, "ignore_eos": True},
                          model="tiny") for i in range(12)]
    conn = server.client()
    most = 0
    ended = threading.Event()

    def poll() -> None:
        nonlocal most
        while not ended.is_set():
            for c in conn.xinfo_consumers(JOBS_KEY, "workers"):
                most = max(most, int(c["pending"]))
            time.sleep(0.005)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        for job in jobs:  # until every job has ended, however slow the machine
            job.result(timeout=600)
    finally:
        ended.set()
        poller.join()
    assert most == 4
    assert all(terminal(server, job.id)["type"] == "done" for job in jobs)  # type: ignore[index]


def test_cancel_mid_generation_frees_blocks_and_ends_with_cancelled(
        server: RedisServer, worker: WorkerProcess) -> None:
    job = Client(server.url).submit("the quick brown", {"temperature": 0, "max_tokens": 4000,
                                                        "ignore_eos": True}, model="tiny")
    stream = job.stream(timeout=60)
    assert next(stream)["type"] == "started"
    assert next(stream)["type"] == "tokens"
    job.cancel()
    with pytest.raises(JobError) as exc:
        job.result(timeout=30)
    assert exc.value.code == "cancelled"
    idle = wait_for(lambda: (hb := heartbeat(server))["cancelled"] >= 1 and hb["held"] == 0
                    and hb, timeout=10, what="a heartbeat after the cancel")
    assert idle["num_free_blocks"] == idle["num_total_blocks"]


def test_jobs_enqueued_while_the_engine_runs_come_in_through_the_read_sent_ahead(
        server: RedisServer, worker: WorkerProcess) -> None:
    client = Client(server.url)
    before = heartbeat(server)
    running = client.submit("the quick brown", {"temperature": 0, "max_tokens": 4000,
                                                "ignore_eos": True}, model="tiny")
    stream = running.stream(timeout=60)
    assert [next(stream)["type"], next(stream)["type"]] == ["started", "tokens"]
    short = [client.submit(f"prompt {i}", {"temperature": 0, "max_tokens": 4, "ignore_eos": True},
                           model="tiny") for i in range(3)]
    assert [len(job.result(timeout=600)["outputs"][0]["token_ids"]) for job in short] == [4] * 3
    running.cancel()
    with pytest.raises(JobError):
        running.result(timeout=60)
    after = wait_for(lambda: (hb := heartbeat(server))["cancelled"] == before["cancelled"] + 1
                     and hb["held"] == 0 and hb, what="a heartbeat after the cancel")
    assert after["read_ahead"] - before["read_ahead"] == 3  # none came through a plain read


def test_a_job_cancelled_before_any_worker_read_it_ends_cancelled(
        server: RedisServer, worker: WorkerProcess) -> None:
    client = Client(server.url)
    client.cancel("early-1", "tiny")
    job = client.submit("the quick", {"temperature": 0, "max_tokens": 500, "ignore_eos": True},
                        model="tiny", job_id="early-1")
    with pytest.raises(JobError) as exc:
        job.result(timeout=30)
    assert exc.value.code == "cancelled"


def test_a_deadline_passing_mid_generation_ends_the_job_and_frees_its_blocks(
        server: RedisServer, worker: WorkerProcess) -> None:
    # 4000 decode steps take several seconds on any CPU; the deadline comes mid-generation.
    job = Client(server.url).submit("the quick", {"temperature": 0, "max_tokens": 4000,
                                                  "ignore_eos": True}, model="tiny",
                                    deadline=time.time() + 1.5)
    with pytest.raises(JobError) as exc:
        job.result(timeout=30)
    assert exc.value.code == "deadline_exceeded"
    kinds = [e["type"] for e in reply_events(server, job.id)]
    assert kinds[0] == "started" and "tokens" in kinds and kinds[-1] == "error"
    idle = wait_for(lambda: (hb := heartbeat(server))["held"] == 0 and hb["running"] == 0
                    and hb, timeout=10, what="an idle heartbeat")
    assert idle["num_free_blocks"] == idle["num_total_blocks"]


def test_an_entry_delivered_by_a_read_whose_reply_was_lost_is_adopted_and_run(
        server: RedisServer, worker: WorkerProcess) -> None:
    # What a Redis restart mid-read leaves: the entry sits in this worker's pending list (its
    # heartbeat is alive, so no one reclaims it) but the worker never saw it. The XADD and the
    # read as "solo" run in one transaction, so the worker's own blocked read cannot win it.
    job = raw_job("orphan-1", params={"temperature": 0, "max_tokens": 5, "ignore_eos": True})
    pipe = server.client().pipeline(transaction=True)
    pipe.xadd(JOBS_KEY, {"v": b"2", "job": msgpack.packb(job)})
    pipe.xreadgroup("workers", "solo", {JOBS_KEY: ">"}, count=1)
    entry_id, read = pipe.execute()
    assert read[0][1][0][0] == entry_id  # pending for "solo", delivered once
    result = Client(server.url).job("orphan-1", "tiny").result(timeout=30)
    assert result["attempt"] == 1 and len(result["outputs"][0]["token_ids"]) == 5
    kinds = [e["type"] for e in reply_events(server, "orphan-1")]
    assert kinds[0] == "started" and kinds[-1] == "done" and kinds.count("started") == 1
    wait_for(lambda: finished_entry(server, entry_id.decode()), timeout=10,
             what="the adopted entry acked")
    assert "adopting 1 entry" in worker.output()


def test_n2_stream_delivers_each_sequence_once_and_matches_done(
        server: RedisServer, worker: WorkerProcess) -> None:
    job = Client(server.url).submit("the quick", {"temperature": 0.8, "seed": 5, "n": 2,
                                                  "max_tokens": 20, "ignore_eos": True},
                                    model="tiny")
    streamed: dict[int, list[int]] = {0: [], 1: []}
    events = list(job.stream(timeout=60))
    for e in events:
        if e["type"] == "tokens":
            assert e["pos"] == len(streamed[e["index"]])
            streamed[e["index"]] += e["token_ids"]
    done = events[-1]
    assert done["type"] == "done"
    assert streamed == {o["index"]: o["token_ids"] for o in done["outputs"]}
    assert [len(v) for v in streamed.values()] == [20, 20]


def test_async_client_streams_a_real_job(server: RedisServer, worker: WorkerProcess) -> None:
    async def scenario() -> tuple[list[str], dict[str, Any], dict[str, Any]]:
        async with AsyncClient(server.url) as client:
            job = await client.submit("the quick brown", {"temperature": 0, "max_tokens": 6},
                                      model="tiny")
            kinds = [e["type"] async for e in job.stream(timeout=60)]
            return kinds, await job.result(timeout=60), Client(server.url).submit(
                "the quick brown", {"temperature": 0, "max_tokens": 6},
                model="tiny").result(timeout=60)

    kinds, async_result, sync_result = asyncio.run(scenario())
    assert kinds[0] == "started" and kinds[-1] == "done" and kinds.count("tokens") >= 1
    assert async_result["outputs"] == sync_result["outputs"]


def test_async_submit_many_and_results_mirror_the_sync_client(server: RedisServer,
                                                              worker: WorkerProcess) -> None:
    prompts = ["the quick brown", "a b c", "hello there"]
    params = {"temperature": 0, "max_tokens": 5}

    async def scenario() -> tuple[list[Any], list[Any], list[Any]]:
        async with AsyncClient(server.url) as client:
            jobs = await client.submit_many(prompts, params, model="tiny")
            assert all(j.created and j.entry_id is not None for j in jobs)
            results = await client.results(jobs, timeout=60)
            bad = [await client.submit("x", {"max_tokens": 4001}, model="tiny"), jobs[0]]
            mixed = await client.results(bad, timeout=60, return_exceptions=True)
            with pytest.raises(JobError) as exc:
                await client.results(bad, timeout=60)
            assert exc.value.code == "limit_exceeded"
            return results, mixed, [j.id for j in jobs]

    results, mixed, ids = asyncio.run(scenario())
    sync = Client(server.url)
    expected = sync.results(sync.submit_many(prompts, params, model="tiny"), timeout=60)
    assert [r["outputs"] for r in results] == [r["outputs"] for r in expected]
    assert isinstance(mixed[0], JobError) and mixed[0].code == "limit_exceeded"
    assert mixed[1]["outputs"] == results[0]["outputs"]
    assert [sync.job(i).result(timeout=5)["outputs"] for i in ids] == \
        [r["outputs"] for r in results]


BAD_JOBS: list[tuple[str, dict[str, Any], str]] = [
    ("unknown param", {"params": {"temprature": 0}}, "unknown_field"),
    ("wrong type", {"params": {"max_tokens": "4"}}, "wrong_type"),
    ("max_tokens <= 0", {"params": {"max_tokens": 0}}, "invalid_params"),
    ("max_tokens over cap", {"params": {"max_tokens": 4001}}, "limit_exceeded"),
    ("n over cap", {"params": {"n": 3, "temperature": 0}}, "limit_exceeded"),
    ("giant prompt", {"prompt": "the quick brown fox " * 100}, "limit_exceeded"),
    ("bad value", {"params": {"top_p": 2.0}}, "invalid_params"),
    ("unknown model", {"model": "other"}, "unknown_model"),
    ("missing field", {"params": None}, "missing_field"),
    ("expired deadline", {"deadline": 1.0}, "deadline_exceeded"),
    ("token id out of vocab", {"prompt": None, "prompt_token_ids": [10**9]}, "bad_prompt"),
    ("stop token id out of vocab", {"params": {"stop_token_ids": [10**9]}}, "invalid_params"),
    ("empty prompt", {"prompt": ""}, "bad_prompt"),
    # (over --max-job-bytes, 1 MiB: refused before decoding, answered on its id's stream)
    ("payload over the job byte cap", {"prompt": "x" * (1 << 20)}, "too_large"),
]


@pytest.mark.parametrize("why, overrides, code", BAD_JOBS, ids=[b[0] for b in BAD_JOBS])
def test_bad_input_gets_an_error_event_with_a_reason(server: RedisServer, worker: WorkerProcess,
                                                     why: str, overrides: dict[str, Any],
                                                     code: str) -> None:
    job_id = f"bad-{next(_ids)}"
    job = {k: v for k, v in raw_job(job_id, **overrides).items() if v is not None
           or k in ("seed", "deadline")}
    entry = xadd_raw(server, {"v": b"2", "job": msgpack.packb(job)})
    end = wait_for(lambda: terminal(server, job_id), timeout=30, what=f"an answer to {why}")
    assert (end["type"], end["code"]) == ("error", code)
    assert len(end["message"]) > 10
    wait_for(lambda: finished_entry(server, entry), timeout=10, what="the entry acked")
    assert worker.alive()


def test_a_handed_back_job_that_fails_to_decode_answers_in_its_current_attempt(
        server: RedisServer, worker: WorkerProcess) -> None:
    """A job handed back after attempt 2 (entry field a=2) whose payload this worker refuses:
    its error event is attempt 3, so a client that saw attempt 2 does not drop it as stale."""
    job_id = f"bad-{next(_ids)}"
    job = {**raw_job(job_id), "colour": "red"}  # (an unknown field: decoding refuses it)
    xadd_raw(server, {"v": b"2", "job": msgpack.packb(job), "a": b"2"})
    end = wait_for(lambda: terminal(server, job_id), timeout=30, what="the error event")
    assert (end["type"], end["code"], end["attempt"]) == ("error", "unknown_field", 3)
    with pytest.raises(JobError) as exc:
        Client(server.url).job(job_id, "tiny").result(timeout=5)
    assert exc.value.code == "unknown_field"


@pytest.mark.parametrize("fields, code", [
    ({"v": b"2", "job": b"\xc1 not msgpack"}, "malformed"),
    ({"v": b"2", "job": msgpack.packb(raw_job("has space"))}, "bad_id"),
    ({"v": b"9", "job": msgpack.packb(raw_job("v9"))}, "bad_version"),
    ({"x": b"1"}, "unknown_field"),
])
def test_input_without_a_valid_id_is_dead_lettered_with_a_reason(
        server: RedisServer, worker: WorkerProcess, fields: dict[str, bytes], code: str) -> None:
    entry = xadd_raw(server, fields)
    dead = wait_for(lambda: dead_letter(server, entry), timeout=30, what="a dead letter")
    assert dead[b"code"].decode() == code and len(dead[b"reason"]) > 10
    assert dead[b"worker"] == b"solo"
    assert finished_entry(server, entry)


def dead_letter(server: RedisServer, entry_id: str) -> dict[bytes, bytes] | None:
    for _id, fields in server.client().xrange(DEAD_KEY):
        if fields.get(b"entry") == entry_id.encode():
            return fields  # type: ignore[no-any-return]
    return None


def test_a_job_delivered_more_than_max_attempts_is_dead_lettered(
        server: RedisServer, worker: WorkerProcess) -> None:
    """A job that (say) crashed three workers: a ghost consumer with no heartbeat holds it after
    three deliveries; the worker reclaims it as the 4th delivery and dead-letters it unrun."""
    conn = server.client()
    pipe = conn.pipeline(transaction=True)  # the ghost reads it before the worker can
    pipe.xadd(JOBS_KEY, {"v": b"2", "job": msgpack.packb(raw_job("poison"))})
    pipe.xreadgroup("workers", "ghost", {JOBS_KEY: ">"}, count=1)
    entry = pipe.execute()[0].decode()
    for _ in range(2):
        conn.xclaim(JOBS_KEY, "workers", "ghost", 0, [entry])
    end = wait_for(lambda: terminal(server, "poison"), timeout=30, what="the poison job's end")
    assert (end["type"], end["code"], end["attempt"]) == ("error", "max_attempts", 4)
    assert dead_letter(server, entry) is not None
    wait_for(lambda: b"ghost" not in [c["name"] for c in conn.xinfo_consumers(JOBS_KEY,
                                                                               "workers")],
             timeout=10, what="the ghost consumer removed")


_leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**63 - 1),
                  st.floats(allow_nan=True), st.text(max_size=6), st.binary(max_size=6))
_value = st.recursive(_leaf, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=8)
_mutated_job = st.builds(
    lambda field, value: {**raw_job("x"), field: value},
    st.sampled_from(["id", "model", "prompt", "prompt_token_ids", "params", "seed", "created",
                     "deadline", "stream", "zzz"]), _value)
_params_job = st.builds(lambda params: raw_job("x", params=params),
                        st.dictionaries(st.sampled_from(["n", "temperature", "max_tokens", "stop",
                                                         "top_k", "seed", "bogus"]), _value,
                                        max_size=3))
_payload = st.one_of(st.binary(max_size=40),
                     _mutated_job.map(lambda j: msgpack.packb(j)),
                     _params_job.map(lambda j: msgpack.packb(j)),
                     _value.map(lambda v: msgpack.packb(v)))


def _with_unique_id(payload: bytes) -> tuple[bytes, str | None]:
    """Give a payload whose id is valid a fresh id, so examples never share a reply stream."""
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=True)
        if isinstance(obj, dict):
            validate_name(obj.get("id"))
            obj["id"] = f"fz-{next(_ids)}"
            return msgpack.packb(obj), obj["id"]
    except (ValueError, TypeError, ProtocolError, msgpack.UnpackException):
        pass
    except Exception:  # msgpack's ExtraData and friends
        pass
    return payload, None


@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(st.lists(_payload, min_size=1, max_size=4))
def test_fuzzed_payloads_interleaved_with_good_jobs(server: RedisServer, worker: WorkerProcess,
                                                    payloads: list[bytes]) -> None:
    client = Client(server.url)
    sent: list[tuple[str, str | None]] = []
    good = []
    for payload in payloads:
        body, job_id = _with_unique_id(payload)
        sent.append((xadd_raw(server, {"v": b"2", "job": body}), job_id))
        good.append(client.submit("the quick", {"temperature": 0, "max_tokens": 3},
                                  model="tiny"))
    for job in good:
        assert job.result(timeout=60)["outputs"][0]["finish_reason"] == "length"
    for entry, job_id in sent:
        wait_for(lambda e=entry: finished_entry(server, e), timeout=30, what="fuzz entry done")
        if job_id is None:
            dead = dead_letter(server, entry)
            assert dead is not None and dead[b"reason"]
        else:
            end = wait_for(lambda j=job_id: terminal(server, j), timeout=30, what="an answer")
            assert end["type"] == "done" or end["message"]
    assert worker.alive()


def genq(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "producer.cli", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_genq_submit_and_status_commands(server: RedisServer, worker: WorkerProcess) -> None:
    out = genq("submit", "the quick", "--model", "tiny", "--max-tokens", "4", "--temperature",
               "0", "--json", "--redis", server.url)
    assert out.returncode == 0, out.stderr
    done = json.loads(out.stdout)
    assert (done["type"], len(done["outputs"][0]["token_ids"])) == ("done", 4)
    live = genq("submit", "the quick", "--model", "tiny", "--max-tokens", "4", "--temperature",
                "0", "--redis", server.url)
    assert live.returncode == 0 and live.stdout == done["outputs"][0]["text"] + "\n"
    bad = genq("submit", "x", "--model", "tiny", "--job-id", "a b", "--redis", server.url)
    assert bad.returncode == 2 and "job id" in bad.stderr
    status = json.loads(genq("status", "--json", "--redis", server.url).stdout)
    assert [(q["model"], q["lane"], q["consumers"]) for q in status["queues"]] == [
        ("tiny", "default", 1), ("tiny", "high", 1), ("tiny", "low", 1)]
    assert [(w["name"], w["model"], w["capacity"], w["prefix_hits"])
            for w in status["workers"]] == [("solo", "tiny", 4, "off")]
    table = genq("status", "--redis", server.url).stdout
    assert "solo" in table and "heartbeat_age_s" in table and "prefix_hits" in table
    # A model no live worker serves (a typo): refused at once, nothing enqueued.
    typo = genq("submit", "x", "--model", "nobdy", "--redis", server.url)
    assert (typo.returncode, typo.stderr) == (1, (
        "genq submit: no live worker serves 'nobdy' (live workers serve: tiny): nothing was "
        "enqueued (--allow-no-worker queues it for a worker yet to start)\n"))
    # Asked to queue anyway: the job waits (it is not refused), and the CLI says why.
    lost = genq("submit", "x", "--model", "nobody", "--timeout", "0.5", "--job-id", "lost-1",
                "--allow-no-worker", "--redis", server.url)
    warning = "no live worker serves 'nobody' (live workers serve: tiny)"
    assert lost.returncode == 1 and lost.stderr.count(warning) == 2, lost.stderr
    # Given up on: cancelled, so a worker that starts later does not run it for no one.
    assert lost.stderr.rstrip().endswith(f"({warning}; the job waits in its queue until one "
                                         "starts); cancelled it"), lost.stderr
    assert server.client().exists(KEYS.cancel("lost-1", "nobody")) == 1
    status = json.loads(genq("status", "--json", "--redis", server.url).stdout)
    assert [(q["model"], q["length"], q["lag"], q["consumers"]) for q in status["queues"]] == [
        ("nobody", 1, 1, 0), *[("tiny", 0, 0, 1)] * 3]


def test_genq_bench_times_round_trips_and_says_why_jobs_failed(
        server: RedisServer, worker: WorkerProcess) -> None:
    out = genq("bench", "--model", "tiny", "--jobs", "3", "--max-tokens", "2", "--ignore-eos",
               "--redis", server.url)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("jobs 3 (failed 0) in ") and lines[0].endswith(" jobs/s")
    assert lines[3].startswith("tokens streamed 6: ")
    # A model nobody serves: said up front; the jobs time out, the reason is printed, and the
    # jobs are cancelled (a worker that starts later does not run them for no one).
    cancels = len(list(server.client().scan_iter(match="genq:cancel:*")))
    lost = genq("bench", "--model", "nobody", "--jobs", "2", "--timeout", "0.5", "--redis",
                server.url)
    assert lost.returncode == 1
    assert lost.stderr == ("genq bench: no live worker serves 'nobody' (live workers serve: "
                           "tiny); the job waits in its queue until one starts\n")
    assert lost.stdout.splitlines()[1] == (
        "  2 failed: TimeoutError: 2 of 2 job(s) had no terminal event within 0.5 s")
    assert len(list(server.client().scan_iter(match="genq:cancel:*"))) == cancels + 2
    bad = genq("bench", "--model", "tiny", "--jobs", "0", "--redis", server.url)
    assert bad.returncode == 2 and "--jobs must be at least 1, got 0" in bad.stderr


def test_no_genq_key_outlives_its_ttl(server: RedisServer, worker: WorkerProcess) -> None:
    """Runs last: after the module's jobs finish and the reply TTL passes, no reply stream is
    left, the job stream holds no entries, and every genq key still present has a TTL."""
    conn = server.client()
    wait_for(lambda: not list(conn.scan_iter(match="genq:reply:*")), timeout=30,
             interval=0.2, what="reply streams to expire")
    assert conn.xlen(JOBS_KEY) == 0
    assert conn.xpending(JOBS_KEY, "workers")["pending"] == 0
    keys = sorted(k.decode() for k in conn.scan_iter(match="genq:*"))
    assert keys and {k: conn.ttl(k) for k in keys if conn.ttl(k) < 0} == {}
    assert worker.alive()
