"""The gateway's less travelled paths against a live gateway + worker + redis-server: a stream
resumed with Last-Event-ID late in the stream, text that is not valid Unicode, a request of
several prompts one of which is refused, and a reply reader while Redis is down."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from producer.protocol import Keys
from tests.harness.fleet import RedisServer, reply_events
from tests.harness.gateway import (
    MODEL_DIR,
    PROMPT,
    GatewayProcess,
    chat_model,
    entry_key,
    gateway_fleet,
    sse,
)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RedisServer, GatewayProcess]]:
    """The demo model as "tiny", and a copy with a chat template as "chat"."""
    chat = chat_model(tmp_path_factory.mktemp("edges-chat-model") / "genq-tiny-chat")
    workers = [(MODEL_DIR, "gw-edges", "tiny"), (chat, "gw-edges-chat", "chat")]
    with gateway_fleet(tmp_path_factory.mktemp("gateway-edges"), workers,
                       "--resume-grace", "0.2") as pair:
        yield pair


def chat_sse(gateway: GatewayProcess, body: dict[str, Any],
             headers: dict[str, str]) -> list[tuple[str | None, Any]]:
    return sse(gateway, body, headers, route="/v1/chat/completions")


def after(events: list[tuple[str | None, Any]], cut: str) -> list[tuple[str | None, Any]]:
    return [e for e in events if e[0] is None or entry_key(e[0]) > entry_key(cut)]


@pytest.mark.parametrize("echo", [False, True])
def test_a_resume_after_the_last_tokens_event_sends_only_the_finish(
        fleet: tuple[RedisServer, GatewayProcess], echo: bool) -> None:
    """A client cut right after the last tokens chunk resumes into just the finish: the finish
    chunk does not bring the whole text again (nor the echoed prompt a second time)."""
    _, gateway = fleet
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "echo": echo}
    headers = {"Genq-Job-Id": f"resume-late-{echo}"}
    events = sse(gateway, body, headers)
    data_ids = [eid for eid, data in events if data != "[DONE]"]
    finish_id = data_ids[-1]
    last_tokens = [eid for eid in data_ids if eid != finish_id][-1]
    assert events[-2] == (finish_id, {**events[-2][1], "choices": [
        {"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}]})
    for cut in (last_tokens, data_ids[0]):
        resumed = sse(gateway, body, {**headers, "Last-Event-ID": cut})
        assert resumed == after(events, cut)


def test_a_resumed_chat_stream_sends_the_role_only_in_the_first_chunk(
        fleet: tuple[RedisServer, GatewayProcess]) -> None:
    _, gateway = fleet
    body = {"model": "chat", "messages": [{"role": "user", "content": "def main("}],
            "max_tokens": 6, "temperature": 0}
    headers = {"Genq-Job-Id": "chat-resume-1"}
    events = chat_sse(gateway, body, headers)
    data_ids = [eid for eid, data in events if data != "[DONE]"]
    roles = [eid for eid, data in events
             if data != "[DONE]" and "role" in data["choices"][0]["delta"]]
    assert len(data_ids) >= 3 and roles == data_ids[:1]
    for cut in (data_ids[0], data_ids[-2]):
        resumed = chat_sse(gateway, body, {**headers, "Last-Event-ID": cut})
        assert resumed == after(events, cut)


SURROGATES = [
    ("prompt", "/v1/completions", {"prompt": "def \\ud800main("}),
    ("stop", "/v1/completions", {"prompt": PROMPT, "stop": "\\udc00"}),
    ("messages", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "\\ud83d"}]}),
]


@pytest.mark.parametrize("field, path, extra", SURROGATES, ids=[s[0] for s in SURROGATES])
def test_a_lone_surrogate_is_a_400_naming_the_field(
        fleet: tuple[RedisServer, GatewayProcess], field: str, path: str,
        extra: dict[str, Any]) -> None:
    """JSON may escape half a UTF-16 pair ("\\ud800"), which is no Unicode text at all: the
    gateway answers 400 with a reason instead of a 500 from deep in the encoder."""
    server, gateway = fleet
    job_id = f"surrogate-{field}"
    fields = ", ".join(f'"{k}": {json.dumps(v, ensure_ascii=False)}' for k, v in extra.items())
    raw = ('{"model": "tiny", "max_tokens": 2, ' + fields + "}").replace("\\\\u", "\\u")
    resp = httpx.post(f"{gateway.url}{path}", content=raw.encode(),
                      headers={"content-type": "application/json", "Genq-Job-Id": job_id},
                      timeout=60)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["code"] == "bad_text"
    assert field in error["message"] and "surrogate" in error["message"]
    assert server.client().exists(Keys().idem(job_id, "tiny")) == 0


def test_several_prompts_one_over_a_cap_enqueue_nothing(
        fleet: tuple[RedisServer, GatewayProcess]) -> None:
    """The 400 for the second prompt comes before any job is enqueued: the first prompt's job
    would otherwise run for nobody."""
    server, gateway = fleet
    resp = httpx.post(f"{gateway.url}/v1/completions",
                      json={"model": "tiny", "prompt": [PROMPT, "x" * 300_000], "max_tokens": 2},
                      headers={"Genq-Job-Id": "multi-cap"}, timeout=60)
    assert resp.status_code == 400
    assert resp.json()["error"]["code"] == "limit_exceeded"
    conn = server.client()
    assert [conn.exists(Keys().idem(f"multi-cap-{k}", "tiny")) for k in (0, 1)] == [0, 0]
    assert reply_events(server, "multi-cap-0") == []


def test_a_reply_reader_waits_out_a_redis_outage_without_spinning(tmp_path: Path) -> None:
    """While Redis is down a refused connect fails at once: the reader backs off (0.05 s
    doubling) instead of retrying in a tight loop, and reads on once Redis is back."""
    from producer.events import done_event, encode_event
    from producer.gateway_fleet import GatewayRedis, JobReader
    from producer.protocol import Keys

    server = RedisServer(tmp_path)
    server.start()
    calls = 0

    async def scenario() -> list[str]:
        nonlocal calls
        gw = GatewayRedis(server.url, Keys(), 8)
        xread = gw.blocking_conn.xread

        async def counted(*args: Any, **kwargs: Any) -> Any:
            nonlocal calls
            calls += 1
            return await xread(*args, **kwargs)

        gw.blocking_conn.xread = counted  # type: ignore[method-assign]
        reader = JobReader(gw.blocking_conn, Keys().reply("outage", "tiny"), "outage", None, 60)
        server.kill()
        loop = asyncio.get_running_loop()
        down = loop.run_in_executor(None, time.sleep, 1.5)

        async def restart_and_finish() -> None:
            await down
            server.start()
            server.client().xadd(Keys().reply("outage", "tiny"), {"e": encode_event(done_event(
                1, [{"index": 0, "token_ids": [1], "text": "a", "finish_reason": "length"}],
                {"prompt_tokens": 1, "completion_tokens": 1}, {}))})

        task = asyncio.ensure_future(restart_and_finish())
        kinds = [event["type"] async for _, event in reader.events()]
        await task
        await gw.close()
        return kinds

    try:
        assert asyncio.run(scenario()) == ["done"]
    finally:
        server.kill()
    # Tries at about 0, 0.05, 0.15, 0.35, 0.75 and 1.55 s (+ the read that finds the event);
    # the loop without a backoff made thousands. (At least one failed try, then the read.)
    assert 2 <= calls <= 8


@pytest.mark.parametrize("last_event_id", ["abc", "12-x", "-1-0", "1-2-3"])
def test_a_malformed_last_event_id_is_a_400_and_submits_nothing(
        fleet: tuple[RedisServer, GatewayProcess], last_event_id: str) -> None:
    server, gateway = fleet
    job_id = f"bad-resume-{abs(hash(last_event_id)) % 10_000}"
    resp = httpx.post(f"{gateway.url}/v1/completions",
                      json={"model": "tiny", "prompt": PROMPT, "max_tokens": 2, "stream": True},
                      headers={"Genq-Job-Id": job_id, "Last-Event-ID": last_event_id},
                      timeout=60)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"] == {
        "message": f"Last-Event-ID {last_event_id!r} is not a reply entry id (<ms>-<seq>, as "
                   "the id: lines of this stream)", "type": "invalid_request_error",
        "param": "Last-Event-ID", "code": "bad_last_event_id"}
    assert server.client().exists(Keys().idem(job_id, "tiny")) == 0


def test_while_redis_is_down_answers_are_openai_shaped_503s(tmp_path: Path) -> None:
    server = RedisServer(tmp_path)
    server.start()
    gateway = GatewayProcess(server.url, tmp_path / "gateway-no-redis.log")
    try:
        server.kill()
        for method, path, body in [("POST", "/v1/completions", {"model": "tiny", "prompt": "x"}),
                                   ("GET", "/v1/models", None)]:
            resp = httpx.request(method, f"{gateway.url}{path}", json=body, timeout=60)
            assert resp.status_code == 503, resp.text
            error = resp.json()["error"]
            assert (error["type"], error["code"], error["param"]) == (
                "server_error", "redis_unavailable", None)
            assert error["message"].startswith("the gateway cannot reach Redis (")
    finally:
        gateway.stop()


def test_the_gateway_checks_the_caps_it_is_given(fleet: tuple[RedisServer, GatewayProcess],
                                                 tmp_path: Path) -> None:
    """`genq gateway --max-tokens-cap` (and the other cap flags, as `genq worker` takes them):
    a fleet whose workers allow more than the defaults is not refused at the gateway."""
    server, _ = fleet
    gateway = GatewayProcess(server.url, tmp_path / "gateway-caps.log", "--max-tokens-cap",
                             "8000", "--max-n", "2")
    try:
        body = {"model": "tiny", "prompt": PROMPT, "temperature": 0}
        over = httpx.post(f"{gateway.url}/v1/completions", json={**body, "n": 3}, timeout=60)
        assert over.status_code == 400
        assert over.json()["error"]["code"] == "limit_exceeded"
        assert over.json()["error"]["message"] == "n=3 is over the cap of 2"
        # 6000 is over the default cap (4096) but not this gateway's: it reaches a worker,
        # whose own default cap refuses it, as a worker's error answered through the gateway.
        big = httpx.post(f"{gateway.url}/v1/completions", json={**body, "max_tokens": 6000},
                         timeout=60)
        assert big.status_code == 400
        assert big.json()["error"]["message"] == "max_tokens=6000 is over the cap of 4096"
    finally:
        gateway.stop()


@pytest.mark.parametrize("field, value", [("max_tokens", 10**20), ("n", 2**64), ("top_k", 10**30),
                                          ("min_p", 10**400)])
def test_an_integer_too_big_for_the_wire_is_a_400_that_names_it(
        fleet: tuple[RedisServer, GatewayProcess], field: str, value: int) -> None:
    _, gateway = fleet
    raw = json.dumps({"model": "tiny", "prompt": PROMPT, field: value})
    resp = httpx.post(f"{gateway.url}/v1/completions", content=raw.encode(),
                      headers={"content-type": "application/json"}, timeout=60)
    assert resp.status_code == 400, resp.text
    assert field in resp.json()["error"]["message"]


def test_null_sampling_fields_take_their_defaults_as_openai_does(
        fleet: tuple[RedisServer, GatewayProcess]) -> None:
    _, gateway = fleet
    nulls = {"n": None, "temperature": None, "top_p": None, "presence_penalty": None,
             "frequency_penalty": None}
    base = {"model": "tiny", "prompt": PROMPT, "max_tokens": 6, "seed": 5}
    with_nulls = httpx.post(f"{gateway.url}/v1/completions", json={**base, **nulls}, timeout=60)
    defaults = httpx.post(f"{gateway.url}/v1/completions", json=base, timeout=60)
    assert with_nulls.status_code == 200, with_nulls.text
    assert [c["text"] for c in with_nulls.json()["choices"]] == \
        [c["text"] for c in defaults.json()["choices"]]


def test_a_cut_requests_delayed_cancel_spares_a_job_that_a_retry_reads(tmp_path: Path) -> None:
    """A client that times out and retries at once with the same Genq-Job-Id: the first
    request notices the disconnect and schedules the job's cancel after the resume grace; by
    then the retry reads the job, so the cancel must not fire. Once no request reads it, a cut
    request's cancel does."""
    from producer.gateway import Gateway, GatewayConfig

    server = RedisServer(tmp_path)
    server.start()

    async def scenario() -> tuple[int, int]:
        gateway = Gateway(GatewayConfig(redis_url=server.url, resume_grace_s=0.1))
        conn = server.client()
        with gateway._reading(["job-r"]):  # the retry is reading the job
            gateway.cancel_later(["job-r"], "tiny")  # the first request, cut, schedules its cancel
            await asyncio.sleep(0.4)
            spared = conn.exists(Keys().cancel("job-r", "tiny"))
        gateway.cancel_later(["job-r"], "tiny")  # the retry is cut too: nobody reads the job now
        await asyncio.sleep(0.4)
        cancelled = conn.exists(Keys().cancel("job-r", "tiny"))
        await gateway.redis.close()
        return spared, cancelled

    try:
        assert asyncio.run(scenario()) == (0, 1)
    finally:
        server.kill()
