"""The gateway's checks before it enqueues (queue depth, job size), and `genq status`'s queue
figures, against a real redis-server, the gateway app in-process: the test plays the worker's
part (its heartbeat, its reads of the job stream, its reply events)."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import httpx
import pytest

from producer import Client
from producer.events import done_event, encode_event, started_event, tokens_event
from producer.gateway import GatewayConfig
from producer.gateway_app import create_app
from producer.limits import Limits
from producer.openai_schema import CompletionRequest
from producer.protocol import REPLY_FIELD, Keys, encode_heartbeat
from producer.status import queue_rows
from tests.harness.fleet import RedisServer, free_port, register_heartbeat

KEYS = Keys(model="tiny")  # (the jobs of the replies here: model tiny's)
JOBS = KEYS.jobs("tiny")
BODY = {"model": "tiny", "prompt": "hi", "temperature": 0, "max_tokens": 1, "stream": True}


def held_job(server: RedisServer, job_id: str) -> str:
    """A live worker "w1" serving tiny holds job `job_id` (read, not acked), which has streamed
    one token and ended; -> the id of its tokens entry."""
    conn = server.client()
    register_heartbeat(conn, "tiny", "w1", encode_heartbeat({"model": "tiny"}))
    conn.xgroup_create(JOBS, KEYS.group, id="0", mkstream=True)
    Client(server.url).submit("hi", {"temperature": 0, "max_tokens": 1}, model="tiny",
                              job_id=job_id)
    conn.xreadgroup(KEYS.group, "w1", {JOBS: ">"}, count=1)
    conn.xadd(KEYS.reply(job_id), {REPLY_FIELD: encode_event(started_event(1, "w1"))})
    tokens = conn.xadd(KEYS.reply(job_id), {REPLY_FIELD: encode_event(
        tokens_event(1, 0, 0, [5], "x"))}).decode()
    conn.xadd(KEYS.reply(job_id), {REPLY_FIELD: encode_event(done_event(1, [
        {"index": 0, "token_ids": [5], "text": "x", "finish_reason": "length"}],
        {"prompt_tokens": 1, "completion_tokens": 1}, {}))})
    return tokens


def post(server: RedisServer, headers: dict[str, str], cut_job: str | None = None,
         body: dict[str, Any] = BODY, **cfg: Any) -> tuple[httpx.Response, int]:
    """POST one streamed completion; with `cut_job`, that job's stream was cut just before (its
    cancel is due after the grace). -> the response and, after the grace, whether the cut
    job's cancel was sent."""
    async def scenario() -> tuple[httpx.Response, int]:
        app = create_app(GatewayConfig(redis_url=server.url, resume_grace_s=0.3, **cfg))
        gateway = app.state.gateway
        if cut_job is not None:
            gateway.cancel_later([cut_job], "tiny")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://gateway") as http:
            resp = await http.post("/v1/completions", json=body, headers=headers)
        await asyncio.sleep(0.5)
        await gateway.redis.close()
        return resp, int(server.client().exists(KEYS.cancel(cut_job or "none")))

    return asyncio.run(scenario())


def test_a_resume_is_not_refused_by_a_full_queue_its_own_job_fills(
        redis_server: RedisServer) -> None:
    """The queue is at its depth (1: the job itself). A resume of the cut stream (Genq-Job-Id +
    Last-Event-ID) enqueues nothing: it gets the rest of its stream, and the cut request's
    delayed cancel does not fire."""
    tokens = held_job(redis_server, "J")
    resp, cancelled = post(redis_server, {"Genq-Job-Id": "J", "Last-Event-ID": tokens}, "J",
                           max_queue_depth=1)
    assert resp.status_code == 200
    data = [line[len("data: "):] for line in resp.text.splitlines()
            if line.startswith("data: ")]
    # (its one token came before the resume point: only the finish follows)
    assert data[-1] == "[DONE]"
    assert [json.loads(d)["choices"] for d in data[:-1]] == [
        [{"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}]]
    assert cancelled == 0


def test_a_new_job_is_refused_with_429_when_the_queue_is_full(
        redis_server: RedisServer) -> None:
    held_job(redis_server, "J")
    resp, _ = post(redis_server, {"Genq-Job-Id": "other"}, max_queue_depth=1)
    assert resp.status_code == 429
    assert resp.json()["error"]["code"] == "queue_full"
    assert redis_server.client().xlen(JOBS) == 1  # (nothing enqueued)


def test_a_job_over_the_byte_cap_is_refused_before_it_is_enqueued(
        redis_server: RedisServer) -> None:
    """(The worker would refuse it too, as too_large: better a 400 now than an error later.)"""
    held_job(redis_server, "J")
    body = {**BODY, "prompt": list(range(1000, 1300))}
    resp, _ = post(redis_server, {"Genq-Job-Id": "big"}, body=body,
                   limits=Limits(max_job_bytes=500))
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["code"] == "limit_exceeded"
    assert error["message"].startswith("the job is ") and error["message"].endswith(
        " bytes encoded, over the cap of 500")
    assert redis_server.client().xlen(JOBS) == 1


def test_queue_figures_count_the_waiting_when_redis_cannot_tell_the_lag(
        redis_server: RedisServer) -> None:
    """A worker holds two jobs and 50 wait; the newer held one finishes (XACK + XDEL, as the
    finish script does): Redis reports the group's lag as nil. `genq status` shows 50 waiting
    and the gateway's depth is 51, so its 429 still sees the backlog."""
    conn = redis_server.client()
    conn.xgroup_create(JOBS, KEYS.group, id="0", mkstream=True)
    held = [conn.xadd(JOBS, {"v": "2", "job": b"x"}) for _ in range(2)]
    conn.xreadgroup(KEYS.group, "w1", {JOBS: ">"}, count=2)
    for _ in range(50):
        conn.xadd(JOBS, {"v": "2", "job": b"x"})
    conn.xack(JOBS, KEYS.group, held[1])
    conn.xdel(JOBS, held[1])
    assert conn.xinfo_groups(JOBS)[0]["lag"] is None  # (what the figures work around)
    row = queue_rows(conn, KEYS)[0]
    assert (row["model"], row["length"], row["lag"], row["pending"]) == ("tiny", 51, 50, 1)

    async def depth() -> int | None:
        app = create_app(GatewayConfig(redis_url=redis_server.url))
        gateway = app.state.gateway
        try:
            return await gateway.fleet.queue_depth("tiny")  # type: ignore[no-any-return]
        finally:
            await gateway.redis.close()

    assert asyncio.run(depth()) == 51


@pytest.mark.parametrize("seed, folded", [(7, 7), (-1, 2**63 - 1), (-2**63, 0),
                                          (2**64 - 1, 2**63 - 1)])
def test_any_64_bit_seed_is_taken_and_folded_into_the_engines_range(seed: int,
                                                                     folded: int) -> None:
    """OpenAI's seed is any integer and vLLM takes any 64-bit one; the engine's is in
    [0, 2**63)."""
    request = CompletionRequest(model="tiny", prompt="hi", seed=seed)
    assert request.sampling_params(4)["seed"] == folded


def test_a_seed_outside_64_bits_is_refused() -> None:
    with pytest.raises(ValueError, match="seed"):
        CompletionRequest(model="tiny", prompt="hi", seed=2**64)


def test_a_gateway_that_cannot_reach_redis_says_so_at_start_up(
        caplog: pytest.LogCaptureFixture) -> None:
    port = free_port()  # nothing listens there
    app = create_app(GatewayConfig(redis_url=f"redis://127.0.0.1:{port}/0"))

    async def start_and_stop() -> None:
        async with app.router.lifespan_context(app):
            pass

    with caplog.at_level(logging.WARNING, logger="uvicorn.error"):
        asyncio.run(start_and_stop())
    (line,) = [r.getMessage() for r in caplog.records if r.name == "uvicorn.error"]
    assert line.startswith(f"genq gateway: cannot reach Redis (Error 111 connecting to "
                           f"127.0.0.1:{port}.") and line.endswith(
        "); requests answer 503 redis_unavailable until it is up")


def test_the_priority_extra_field_reaches_the_job(redis_server: RedisServer) -> None:
    """vLLM's `priority` extra field is the job's priority (and lane); out of range it is a
    400."""
    from producer.lanes import lane_key
    from producer.protocol import decode_job_entry

    high = lane_key(KEYS, "tiny", 1)

    held_job(redis_server, "J")
    conn = redis_server.client()

    async def scenario() -> None:
        app = create_app(GatewayConfig(redis_url=redis_server.url))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://gateway") as http:
            wrong = await http.post("/v1/completions", json={**BODY, "priority": 2**31})
            assert (wrong.status_code, wrong.json()["error"]["param"]) == (400, "priority")
            waiting = asyncio.create_task(http.post(  # (no worker answers: it waits)
                "/v1/completions", json={**BODY, "stream": False, "priority": -7},
                headers={"Genq-Job-Id": "urgent"}))
            for _ in range(1200):
                if conn.xlen(high) == 1:
                    break
                await asyncio.sleep(0.05)
            waiting.cancel()
        await app.state.gateway.redis.close()

    asyncio.run(scenario())
    [(_, fields)] = conn.xrange(high)
    spec, _ = decode_job_entry(fields)
    assert (spec.id, spec.priority) == ("urgent", -7)
