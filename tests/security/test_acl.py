"""Redis ACL: a worker, producers and the gateway do all their work as users limited to genq's
keys, genq's cancel channel and the commands they need (secure_redis.ACL_RULES, the lines the
docs/security.md documents), and those users can do nothing else.

"Nothing was denied" is checked through ACL LOG: a command genq needs but the lines lack would be
logged there (and fail), even on a path whose caller swallows the error.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import msgpack
import pytest
import redis

from producer import Client, JobError
from producer.protocol import Keys
from tests.harness.fleet import (
    WorkerFactory,
    WorkerProcess,
    wait_for,
    wait_heartbeats,
)
from tests.harness.gateway import GatewayProcess
from tests.harness.oracle import Oracle
from tests.harness.secure_redis import ACL_RULES, ADMIN_PASSWORD, SecureRedis, acl_line

KEYS = Keys(model="tiny")  # (the jobs of the replies here: model tiny's)
JOBS_KEY = KEYS.jobs("tiny")
GREEDY = {"temperature": 0, "max_tokens": 4}
NO_CMD = "this user has no permissions to run the '{}' command"
NO_KEY = "this user has no permissions to access one of the keys used as arguments"
NO_CHANNEL = "this user has no permissions to access one of the channels used as arguments"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureRedis]:
    srv = SecureRedis(tmp_path_factory.mktemp("acl-redis"))
    srv.start()
    admin = srv.client()
    admin.set("otherkey", "another application's secret")
    admin.xadd("other:stream", {"f": "v"})
    yield srv
    srv.kill()


@pytest.fixture(scope="module")
def worker(server: SecureRedis, tiny_llama: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    """Worker "w1" as genq-worker. Before it starts, a ghost consumer (no heartbeat) holds the job
    "ghostjob", so the worker's start-up reclaim (XINFO CONSUMERS, XPENDING, XCLAIM and later
    XGROUP DELCONSUMER in Lua) runs under the ACL too."""
    admin = server.client()
    admin.xgroup_create(JOBS_KEY, "workers", id="0", mkstream=True)
    with Client(server.url_for("genq-producer")) as client:
        client.submit("held by a ghost", GREEDY, model="tiny", job_id="ghostjob")
    assert len(admin.xreadgroup("workers", "ghost", {JOBS_KEY: ">"}, count=1)[0][1]) == 1
    factory = WorkerFactory(tmp_path_factory.mktemp("acl-workers"))
    proc = factory.start(server.url_for("genq-worker"), tiny_llama, "w1", "--max-num-seqs", "8")
    try:
        wait_heartbeats(server, [proc], timeout=180)  # type: ignore[arg-type]
        yield proc
    finally:
        factory.stop_all()


def outputs(result: dict[str, Any]) -> list[tuple[list[int], str, str | None]]:
    return [(o["token_ids"], o["text"], o["finish_reason"]) for o in result["outputs"]]


def test_the_server_loaded_the_documented_lines(server: SecureRedis) -> None:
    users = sorted(x.decode().split()[1] for x in
                   server.client().execute_command("ACL", "LIST"))
    assert users == ["default", "genq-gateway", "genq-producer", "genq-worker"]
    assert (server.dir / "users.acl").read_text().splitlines()[1:] == [
        acl_line(user) for user in ("genq-worker", "genq-producer", "genq-gateway")]


def test_worker_and_producer_run_jobs_through_their_users(
        server: SecureRedis, worker: WorkerProcess, offline: Oracle) -> None:
    server.client().execute_command("ACL", "LOG", "RESET")
    admin = server.client()
    with Client(server.url_for("genq-producer")) as client:
        # the ghost's job: reclaimed by the worker, and the ghost consumer deleted afterwards
        assert outputs(client.job("ghostjob", "tiny").result(timeout=60)) == offline(
            ["held by a ghost"], GREEDY)[0]
        wait_for(lambda: [c["name"] for c in admin.xinfo_consumers(JOBS_KEY, "workers")]
                 == [b"w1"], timeout=30, what="the ghost consumer deleted")

        prompts = ["the quick brown fox", "jumps over", "the lazy dog"]
        single = client.submit(prompts[0], GREEDY, model="tiny")
        streamed = list(single.stream(timeout=60))
        many = client.submit_many(prompts[1:], GREEDY, model="tiny")
        expected = offline(prompts, GREEDY)
        tokens = [e for e in streamed if e["type"] == "tokens"]
        assert [t for e in tokens for t in e["token_ids"]] == expected[0][0][0]
        assert outputs(streamed[-1]) == expected[0]
        assert [outputs(job.result(timeout=60)) for job in many] == expected[1:]
        # the ended mark: written by the worker's finish script, read by the producer
        assert client.redis.mget([KEYS.idem(j.id) for j in [single, *many]]) == [b"ended"] * 3

        # cancel: SET of the cancel flag + SPUBLISH on genq:cancel:{tiny} (producer), received by
        # the worker's listener (SSUBSCRIBEd at start), which remembers it until the job is read.
        # Cancelled before it is submitted, so the outcome does not race the generation.
        client.cancel("cancelled-early", "tiny")
        early = client.submit("never runs", GREEDY, model="tiny", job_id="cancelled-early")
        with pytest.raises(JobError) as err:
            early.result(timeout=60)
        assert (err.value.code, err.value.message) == ("cancelled", "cancelled by the client")

    # input without a valid id: the worker dead-letters it (XADD on genq:dead:tiny in Lua)
    entry = admin.xadd(JOBS_KEY, {"v": b"2", "job": msgpack.packb({"id": "a b"})}).decode()
    dead = wait_for(lambda: admin.xrange(KEYS.dead("tiny")), timeout=30, what="a dead letter")
    assert [(f[b"entry"].decode(), f[b"code"]) for _id, f in dead] == [(entry, b"bad_id")]
    assert server.acl_log() == []


def test_the_gateway_serves_through_its_user(server: SecureRedis, worker: WorkerProcess,
                                             offline: Oracle, tmp_path: Path) -> None:
    server.client().execute_command("ACL", "LOG", "RESET")
    gateway = GatewayProcess(server.url_for("genq-gateway"), tmp_path / "gateway.log")
    try:
        models = httpx.get(f"{gateway.url}/v1/models", timeout=30).json()
        assert [(m["id"], m["workers"]) for m in models["data"]] == [("tiny", 1)]
        body = {"model": "tiny", "prompt": "over the lazy", "max_tokens": 4, "temperature": 0}
        answer = httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=120).json()
        expected = offline(["over the lazy"], GREEDY)[0][0]
        assert [(c["text"], c["finish_reason"]) for c in answer["choices"]] == [
            (expected[1], expected[2])]
        assert answer["usage"]["completion_tokens"] == 4
        # a model nobody serves: the queue-depth probe (XINFO GROUPS on a missing stream) answers
        missing = httpx.post(f"{gateway.url}/v1/completions", json={**body, "model": "nope"},
                             timeout=30)
        assert (missing.status_code, missing.json()["error"]["code"]) == (404, "model_not_found")
    finally:
        gateway.stop()
    assert server.acl_log() == []


def denied(call: Callable[[], object]) -> str:
    with pytest.raises(redis.ResponseError) as err:
        call()
    return str(err.value)


def test_the_producer_user_can_touch_nothing_else(server: SecureRedis) -> None:
    p = server.as_user("genq-producer")
    server.client().xadd(JOBS_KEY, {"v": b"2", "job": b"someone's prompt"})
    # other applications' keys and the server itself
    assert denied(lambda: p.get("otherkey")) == NO_KEY  # (GET, MGET: idem keys' ended marks)
    assert denied(lambda: p.mget(["otherkey"])) == NO_KEY
    assert denied(lambda: p.set("otherkey", "x")) == NO_KEY
    assert denied(lambda: p.xread({"other:stream": "0"})) == NO_KEY
    assert denied(lambda: p.flushall()) == NO_CMD.format("flushall")
    assert denied(lambda: p.flushdb()) == NO_CMD.format("flushdb")
    assert denied(lambda: p.config_get("*")) == NO_CMD.format("config|get")
    assert denied(lambda: p.config_set("appendonly", "no")) == NO_CMD.format("config|set")
    assert denied(lambda: p.keys("*")) == NO_CMD.format("keys")
    assert denied(lambda: p.scan()) == NO_CMD.format("scan")
    assert denied(lambda: p.acl_list()) == NO_CMD.format("acl|list")
    assert denied(lambda: p.execute_command("SELECT", 1)) == NO_CMD.format("select")
    assert denied(lambda: p.eval("return 1", 0)) == NO_CMD.format("eval")
    # genq keys a producer has no business with: other apps' prompts, forged replies,
    # forged heartbeats (which would stop a dead worker's jobs from being reclaimed), consuming
    assert denied(lambda: p.xread({JOBS_KEY: "0"})) == NO_KEY
    assert denied(lambda: p.xrange(JOBS_KEY)) == NO_CMD.format("xrange")
    assert denied(lambda: p.xadd(KEYS.reply("victim"), {"e": b"forged"})) == NO_KEY
    assert denied(lambda: p.set(KEYS.worker("tiny", "w1"), b"forged", ex=60)) == NO_KEY
    assert denied(lambda: p.xreadgroup("workers", "thief", {JOBS_KEY: ">"})) == NO_CMD.format(
        "xreadgroup")
    assert denied(lambda: p.spublish("other-channel", "x")) == NO_CHANNEL
    # a script runs as its caller: loading one does not widen what the user may do
    read_other = p.script_load("return redis.call('GET', KEYS[1])")
    assert denied(lambda: p.evalsha(read_other, 1, "otherkey")) == NO_KEY
    assert "The user executing the script can't access at least one of the keys" in denied(
        lambda: p.evalsha(read_other, 1, JOBS_KEY))
    assert server.client().get("otherkey") == b"another application's secret"


def test_the_worker_and_gateway_users_cannot_reach_other_keys(server: SecureRedis) -> None:
    w = server.as_user("genq-worker")
    g = server.as_user("genq-gateway")
    assert denied(lambda: g.get("otherkey")) == NO_KEY  # (GET: idem keys' ended marks)
    assert denied(lambda: w.get("otherkey")) == NO_KEY  # (GET, INCR: its fence counters only)
    assert denied(lambda: w.execute_command("INCR", "otherkey")) == NO_KEY
    for conn in (w, g):
        assert denied(lambda c=conn: c.flushall()) == NO_CMD.format("flushall")
        assert denied(lambda c=conn: c.config_get("*")) == NO_CMD.format("config|get")
        assert denied(lambda c=conn: c.set("otherkey", "x")) == NO_KEY
        assert denied(lambda c=conn: c.xadd("other:stream", {"f": "x"})) == NO_KEY
    assert denied(lambda: w.exists("otherkey")) == NO_KEY
    assert denied(lambda: w.xreadgroup("g", "c", {"other:stream": ">"})) == NO_KEY
    assert denied(lambda: g.xread({JOBS_KEY: "0"})) == NO_KEY  # the gateway reads no prompts
    assert denied(lambda: g.mget(["otherkey"])) == NO_KEY


def test_without_the_right_password_nothing_runs(server: SecureRedis) -> None:
    for username, password, message in (
            (None, None, "Authentication required."),
            ("genq-producer", "wrong", "invalid username-password pair or user is disabled."),
            ("default", ADMIN_PASSWORD + "x",
             "invalid username-password pair or user is disabled.")):
        conn = redis.Redis(port=server.port, username=username, password=password, protocol=2,
                           retry=None)
        with pytest.raises(redis.AuthenticationError) as err:
            conn.get("otherkey")
        assert str(err.value) == message


def test_a_worker_whose_acl_predates_the_ended_marks_still_finishes_its_jobs(
        server: SecureRedis, tiny_llama: Path, offline: Oracle, tmp_path: Path) -> None:
    """A worker user without ~genq:idem:* (the ACL line of an earlier release): its first finish
    is refused, the writer finishes without the marks from then on, and nothing is lost."""
    legacy = [rule for rule in ACL_RULES["genq-worker"] if rule != "~genq:idem:*"]
    assert len(legacy) == len(ACL_RULES["genq-worker"]) - 1
    server.client().execute_command("ACL", "SETUSER", "genq-worker-legacy", "on",
                                    ">legacy-secret", *legacy)
    factory = WorkerFactory(tmp_path)
    proc = factory.start(server.url_for("genq-worker-legacy", "legacy-secret"), tiny_llama,
                         "old", served_name="legacy")
    try:
        wait_heartbeats(server, [proc], timeout=180)  # type: ignore[arg-type]
        prompts = ["the quick brown fox", "jumps over"]
        with Client(server.url_for("genq-producer")) as client:
            jobs = [client.submit(p, GREEDY, model="legacy") for p in prompts]
            assert [outputs(job.result(timeout=60)) for job in jobs] == offline(prompts, GREEDY)
        assert [server.client().get(KEYS.idem(job.id, "legacy")) for job in jobs] == [b"1", b"1"]
        assert "may not use genq:idem:* keys" in proc.output()
    finally:
        factory.stop_all()


def test_a_worker_stops_cleanly_under_its_user(server: SecureRedis,
                                               worker: WorkerProcess) -> None:
    """SIGTERM: drain, DEL of the heartbeat; last, since it stops the module's worker."""
    server.client().execute_command("ACL", "LOG", "RESET")
    assert worker.terminate(timeout=60) == 0
    assert server.client().exists(KEYS.worker("tiny", "w1")) == 0
    assert server.acl_log() == []
