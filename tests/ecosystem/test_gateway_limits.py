"""The gateway's request-level limits, checked before anything is enqueued, and its behaviour
under a flood and at SIGTERM. Against a real redis-server; the test plays the worker (its
heartbeat, and its reply events where a stream must have begun), so no model is loaded."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from producer.events import encode_event, started_event, tokens_event
from producer.gateway import GatewayConfig
from producer.gateway_app import create_app
from producer.protocol import REPLY_FIELD, Keys, encode_heartbeat
from tests.harness.fleet import RedisServer, register_heartbeat, wait_for
from tests.harness.gateway import GatewayProcess

KEYS = Keys(model="tiny")  # (the jobs of the replies here: model tiny's)
JOBS = KEYS.jobs("tiny")


def serve_tiny(server: RedisServer) -> None:
    """A live worker "w1" serving tiny, as far as the gateway can tell."""
    register_heartbeat(server.client(), "tiny", "w1", encode_heartbeat({"model": "tiny"}), ex=600)


def post(server: RedisServer, body: Any, **cfg: Any) -> httpx.Response:
    """One POST /v1/completions to the app in-process; `body` bytes are sent as they are, an
    async iterator of bytes chunked (no Content-Length)."""
    async def scenario() -> httpx.Response:
        app = create_app(GatewayConfig(redis_url=server.url, **cfg))
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://gateway") as http:
                content = body if not isinstance(body, dict) else json.dumps(body).encode()
                return await http.post("/v1/completions", content=content,
                                       headers={"content-type": "application/json"})
        finally:
            await app.state.gateway.redis.close()

    return asyncio.run(scenario())


def test_more_prompts_than_the_cap_is_a_400_and_enqueues_nothing(
        redis_server: RedisServer) -> None:
    serve_tiny(redis_server)
    resp = post(redis_server, {"model": "tiny", "prompt": ["ab"] * 5, "max_tokens": 4},
                max_prompts_per_request=4)
    assert (resp.status_code, resp.json()["error"]["code"]) == (400, "too_many_prompts")
    assert resp.json()["error"]["message"] == (
        "the request holds 5 prompts, over the gateway's cap of 4 per request "
        "(--max-prompts-per-request); split it into several requests")
    assert redis_server.client().exists(JOBS) == 0


def test_a_body_over_the_byte_cap_is_a_400_declared_or_chunked(
        redis_server: RedisServer) -> None:
    serve_tiny(redis_server)
    body = json.dumps({"model": "tiny", "prompt": ["ab"] * 300, "max_tokens": 4}).encode()

    async def chunked() -> AsyncIterator[bytes]:
        for k in range(0, len(body), 100):
            yield body[k:k + 100]

    declared = post(redis_server, body, max_body_bytes=1000)
    assert declared.status_code == 400
    assert declared.json()["error"] == {
        "message": f"the request body is {len(body)} bytes, over the gateway's cap of 1000 "
                   "(--max-body-bytes); send fewer or shorter prompts per request",
        "type": "invalid_request_error", "param": None, "code": "request_too_large"}
    streamed = post(redis_server, chunked(), max_body_bytes=1000)
    assert (streamed.status_code, streamed.json()["error"]["code"]) == (400, "request_too_large")
    assert redis_server.client().exists(JOBS) == 0


def test_prompts_times_n_count_against_the_queue_depth(redis_server: RedisServer) -> None:
    serve_tiny(redis_server)
    never = post(redis_server, {"model": "tiny", "prompt": ["a", "b"], "n": 3},
                 max_queue_depth=5)
    assert (never.status_code, never.json()["error"]["code"]) == (400, "request_too_large")
    redis_server.client().xadd(JOBS, {"v": 2, "job": b"held"})  # the queue holds one job
    now = post(redis_server, {"model": "tiny", "prompt": ["a", "b"], "n": 2},
               max_queue_depth=4)
    assert (now.status_code, now.json()["error"]["code"]) == (429, "queue_full")
    assert redis_server.client().xlen(JOBS) == 1


def counted_reads(fleet: Any) -> list[int | None]:
    """The counts of the queue the gateway's FleetView reads from now on, in order."""
    counted = fleet.queue_depth
    reads: list[int | None] = []

    async def queue_depth(model: str) -> int | None:
        reads.append(await counted(model))
        return reads[-1]

    fleet.queue_depth = queue_depth
    return reads


def test_a_flood_is_admitted_against_one_count_of_the_queue_and_refused_on_a_fresh_one(
        redis_server: RedisServer) -> None:
    """40 requests at once cost one count of the queue, not 40; what was admitted counts
    against the cap until the next count; a refusal comes only from a count read for it, so a
    queue found empty admits at once."""
    serve_tiny(redis_server)

    async def scenario() -> list[Any]:
        from producer.openai_schema import GatewayError

        app = create_app(GatewayConfig(redis_url=redis_server.url))
        fleet = app.state.gateway.fleet
        fleet.depth_cache_s = 600.0  # (no count falls due by age within the test)
        reads = counted_reads(fleet)

        async def admit(cap: int) -> str:
            try:
                await fleet.require_model("tiny", cap)
                return "ok"
            except GatewayError as exc:
                return exc.code or ""

        try:
            flood = await asyncio.gather(*(admit(1000) for _ in range(40)))
            steps = [list(reads)]
            # 40 admitted as far as this gateway knows (none enqueued): 41, 42 fit a cap of
            # 42, the next is counted anew (no job in Redis) and fits
            steps += [[await admit(42) for _ in range(3)], list(reads)]
            for _ in range(5):
                redis_server.client().xadd(JOBS, {"v": 2, "job": b"held"})
            # 1 admitted since the count: 2, 3, 4, 5 fit a cap of 5 (a count 600 s stale, as
            # far as it knows); the next is counted anew: 5 in Redis, so it is refused
            steps += [[await admit(5) for _ in range(5)], list(reads)]
            return [flood] + steps
        finally:
            await app.state.gateway.redis.close()

    flood, first, then, second, five, third = asyncio.run(scenario())
    assert flood == ["ok"] * 40 and first == [None]  # (None: no job stream yet)
    assert then == ["ok"] * 3 and second == [None, None]
    assert five == ["ok"] * 4 + ["queue_full"] and third == [None, None, 5]


def test_no_request_waits_on_a_stale_read_of_the_fleet(redis_server: RedisServer) -> None:
    """Every read is stale at once here (cache_s = depth_cache_s = 0): a request is answered
    from the last read of the live models and the last count of the queue while a new read
    runs behind it; a model missing from the last read is looked up again before a refusal."""
    serve_tiny(redis_server)

    async def scenario() -> list[Any]:
        app = create_app(GatewayConfig(redis_url=redis_server.url))
        fleet = app.state.gateway.fleet
        fleet.cache_s = fleet.depth_cache_s = 0.0
        reads = counted_reads(fleet)
        try:
            first = dict(await fleet.live_models())  # never read: read now
            conn = redis_server.client()
            register_heartbeat(conn, "tiny", "w2", encode_heartbeat({"model": "tiny"}), ex=600)
            register_heartbeat(conn, "other", "w3", encode_heartbeat({"model": "other"}), ex=600)
            stale = dict(await fleet.live_models())  # the last read; a new one starts
            await fleet.require_model("other", 10)  # not in the last read: read again, found
            await fleet.require_model("tiny", 10)  # (both never counted: counted now)
            for _ in range(3):
                conn.xadd(JOBS, {"v": 2, "job": b"held"})
            await fleet.require_model("tiny", 3)  # 1 admitted since the count: admitted at once
            at_once = list(reads)
            await wait_async(lambda: len(reads) == 3)  # the count started behind that request
            return [first, stale, dict(await fleet.live_models()), at_once, list(reads)]
        finally:
            await app.state.gateway.fleet.close()
            await app.state.gateway.redis.close()

    first, stale, fresh, at_once, reads = asyncio.run(scenario())
    assert first == stale == {"tiny": 1}
    assert fresh == {"tiny": 2, "other": 1}
    assert at_once == [None, None] and reads == [None, None, 3]  # (None: no stream yet)


async def wait_async(predicate: Any, timeout: float = 120.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not predicate():
        assert loop.time() < end, "timed out"
        await asyncio.sleep(0.01)


@pytest.fixture
def gateway(redis_server: RedisServer, tmp_path: Path) -> Iterator[GatewayProcess]:
    serve_tiny(redis_server)
    proc = GatewayProcess(redis_server.url, tmp_path / "gateway.log", "--drain-timeout", "1")
    yield proc
    if proc.proc.poll() is None:
        proc.stop()


def begin_streams(server: RedisServer, job_ids: list[str]) -> None:
    """Play the worker: once the gateway has enqueued these jobs, each streams one token "x"
    (and never ends)."""
    conn = server.client()
    wait_for(lambda: conn.exists(*(KEYS.idem(j) for j in job_ids)) == len(job_ids),
             timeout=120, what="the gateway to enqueue the jobs")
    for job_id in job_ids:
        conn.xadd(KEYS.reply(job_id), {REPLY_FIELD: encode_event(started_event(1, "w1"))})
        conn.xadd(KEYS.reply(job_id), {REPLY_FIELD: encode_event(tokens_event(1, 0, 0, [5],
                                                                              "x"))})


def open_streams(gateway: GatewayProcess, server: RedisServer,
                 job_ids: list[str]) -> tuple[list[threading.Thread], threading.Event]:
    """A streamed request per job id, each left open after its first chunk; -> their threads
    and an event to set to hang them up."""
    release = threading.Event()
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 4, "stream": True}

    def one(job_id: str) -> None:
        with httpx.stream("POST", f"{gateway.url}/v1/completions", json=body,
                          headers={"Genq-Job-Id": job_id}, timeout=120) as resp:
            next(resp.iter_lines())
            release.wait(120)

    threads = [threading.Thread(target=one, args=(job_id,), daemon=True) for job_id in job_ids]
    for t in threads:
        t.start()
    begin_streams(server, job_ids)
    return threads, release


def test_health_answers_while_a_flood_is_in_flight(gateway: GatewayProcess,
                                                   redis_server: RedisServer) -> None:
    threads, release = open_streams(gateway, redis_server, [f"flood-{k}" for k in range(32)])
    huge = json.dumps({"model": "tiny", "prompt": ["ab"] * 300_000, "max_tokens": 4})
    refused: list[int] = []

    def flood() -> None:
        for _ in range(2):
            refused.append(httpx.post(f"{gateway.url}/v1/completions", content=huge,
                                      headers={"content-type": "application/json"},
                                      timeout=120).status_code)

    flooders = [threading.Thread(target=flood, daemon=True) for _ in range(4)]
    for t in flooders:
        t.start()
    try:
        while any(t.is_alive() for t in flooders):
            assert httpx.get(f"{gateway.url}/health", timeout=60).json() == {"status": "ok"}
    finally:
        release.set()
        for t in flooders + threads:
            t.join(60)
    assert refused == [400] * 8
    assert redis_server.client().xlen(JOBS) == 32


def test_sigterm_mid_stream_stops_the_gateway_and_cancels_the_cut_job(
        gateway: GatewayProcess, redis_server: RedisServer) -> None:
    threads, release = open_streams(gateway, redis_server, ["cut-1"])
    try:
        gateway.proc.send_signal(signal.SIGTERM)
        # uvicorn drains, then re-raises the signal it caught: the exit is by SIGTERM
        assert gateway.proc.wait(120) == -signal.SIGTERM
    finally:
        release.set()
        threads[0].join(60)
    assert redis_server.client().exists(KEYS.cancel("cut-1")) == 1


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_a_client_gone_before_its_first_token_cancels_its_job(
        stream: bool, redis_server: RedisServer, tmp_path: Path) -> None:
    """The request awaits its client's disconnect while its job waits in the queue (no worker
    takes it here): a client that hangs up has the job cancelled after the resume grace."""
    serve_tiny(redis_server)
    proc = GatewayProcess(redis_server.url, tmp_path / "gateway.log", "--resume-grace", "0.1")
    job_id = f"gone-{'s' if stream else 'w'}"
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 4, "stream": stream}
    conn = redis_server.client()
    try:
        with pytest.raises(httpx.ReadTimeout):  # (then httpx closes the connection)
            httpx.post(f"{proc.url}/v1/completions", json=body, headers={"Genq-Job-Id": job_id},
                       timeout=httpx.Timeout(60.0, read=1.0))
        assert conn.exists(KEYS.idem(job_id)) == 1  # (it was enqueued)
        wait_for(lambda: conn.exists(KEYS.cancel(job_id)) == 1, timeout=60,
                 what="the gateway to cancel the job of the client that hung up")
    finally:
        proc.stop()
