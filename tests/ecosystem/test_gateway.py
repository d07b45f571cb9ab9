"""`genq gateway` with the official openai client against a live gateway + worker + redis-server.

Every generated text is checked against the offline engine (LLM.generate) on the same model:
greedy and seeded jobs are deterministic, whichever worker runs them. The model is the committed
genq-tiny-stdlib (trained, so its texts are non-empty Python-like text: comparing texts means
something, which a random model's byte tokens that decode to "" would not).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from producer.events import encode_event, tokens_event
from producer.protocol import Keys
from tests.harness.fleet import (
    RedisServer,
    reply_events,
    wait_for,
)
from tests.harness.gateway import (
    MODEL_DIR,
    PROMPT,
    REPO,
    GatewayProcess,
    entry_key,
    sse,
)
from tests.harness.oracle import OracleOf

Oracle = Callable[[str, dict[str, Any]], list[tuple[str, str | None, int]]]


@pytest.fixture(scope="module")
def fleet(demo_fleet: tuple[RedisServer, GatewayProcess]) -> tuple[RedisServer, GatewayProcess]:
    return demo_fleet


@pytest.fixture(scope="module")
def offline(oracle_of: OracleOf) -> Oracle:
    """(text, finish_reason, number of tokens) per sequence, from the offline oracle."""
    oracle = oracle_of(MODEL_DIR)

    def run(prompt: str, params: dict[str, Any]) -> list[tuple[str, str | None, int]]:
        [outputs] = oracle.outputs([prompt], params)
        assert all(c.text.strip() for c in outputs), "an empty text would make the claim vacuous"
        return [(c.text, c.finish_reason, len(c.token_ids)) for c in outputs]

    return run


def test_models_lists_the_served_name_of_each_live_worker(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_greedy_completion_equals_the_offline_engine(client: openai.OpenAI,
                                                     offline: Oracle) -> None:
    resp = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
    [(text, reason, num_tokens)] = offline(PROMPT, {"max_tokens": 8, "temperature": 0})
    assert [(c.index, c.text, c.finish_reason) for c in resp.choices] == [(0, text, reason)]
    assert resp.usage is not None and resp.usage.completion_tokens == num_tokens
    assert resp.object == "text_completion" and resp.model == "tiny"


def test_only_streamed_requests_have_tokens_events_written(
        fleet: tuple[RedisServer, GatewayProcess], offline: Oracle) -> None:
    """A plain request's answer needs only the done event: its job does not stream, so the
    worker writes no tokens events for it; a streamed request's job does."""
    server, gateway = fleet
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    resp = httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    [(text, _, num_tokens)] = offline(PROMPT, {"max_tokens": 8, "temperature": 0})
    assert resp.json()["choices"][0]["text"] == text
    events = reply_events(server, resp.headers["Genq-Job-Id"])
    assert [e["type"] for e in events] == ["started", "done"]
    assert len(events[-1]["outputs"][0]["token_ids"]) == num_tokens
    streamed = sse(gateway, body, headers={"Genq-Job-Id": "gw-streamed-tokens"})
    assert "".join(d["choices"][0]["text"] for _, d in streamed
                   if d != "[DONE]" and d["choices"]) == text
    kinds = [e["type"] for e in reply_events(server, "gw-streamed-tokens")]
    assert kinds[0] == "started" and kinds[-1] == "done"
    assert sum(len(e["token_ids"]) for e in reply_events(server, "gw-streamed-tokens")
               if e["type"] == "tokens") == num_tokens


def test_streamed_completion_concatenates_to_the_offline_text(client: openai.OpenAI,
                                                              offline: Oracle) -> None:
    stream = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    [(text, reason, num_tokens)] = offline(PROMPT, {"max_tokens": 8, "temperature": 0})
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == reason
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == num_tokens


def test_seeded_n3_choices_equal_the_offline_engine_streamed_or_not(client: openai.OpenAI,
                                                                    offline: Oracle) -> None:
    params = {"n": 3, "temperature": 0.9, "seed": 7, "max_tokens": 6}
    expected = [(i, text, reason) for i, (text, reason, _) in enumerate(offline(PROMPT, params))]
    resp = client.completions.create(model="tiny", prompt=PROMPT, **params)
    assert [(c.index, c.text, c.finish_reason) for c in resp.choices] == expected
    again = client.completions.create(model="tiny", prompt=PROMPT, **params)
    assert [c.text for c in again.choices] == [c.text for c in resp.choices]

    texts: dict[int, str] = {}
    reasons: dict[int, str | None] = {}
    for chunk in client.completions.create(model="tiny", prompt=PROMPT, stream=True, **params):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            reasons[c.index] = c.finish_reason or reasons.get(c.index)
    assert [(i, texts[i], reasons[i]) for i in sorted(texts)] == expected


def test_stop_string_ends_the_text_where_the_offline_engine_does(client: openai.OpenAI,
                                                                 offline: Oracle) -> None:
    params: dict[str, Any] = {"max_tokens": 12, "temperature": 0, "repetition_penalty": 1.3}
    [(full, _, _)] = offline(PROMPT, params)
    # A string the greedy text reaches after its start, and not before.
    cut = next(k for k in range(3, len(full) - 2)
               if full.index(full[k:k + 3]) == k and full[k:k + 3].strip())
    stop = full[cut:cut + 3]
    [(text, reason, _)] = offline(PROMPT, {**params, "stop": [stop]})
    resp = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0,
                                     stop=[stop], extra_body={"repetition_penalty": 1.3})
    assert (resp.choices[0].text, resp.choices[0].finish_reason) == (text, reason)
    assert reason == "stop" and text == full[:cut]


def test_several_prompts_give_n_choices_each_in_prompt_order(client: openai.OpenAI,
                                                             offline: Oracle) -> None:
    prompts = [PROMPT, "    def __init__(self"]
    params = {"n": 2, "temperature": 0.8, "seed": 3, "max_tokens": 4}
    resp = client.completions.create(model="tiny", prompt=prompts, **params)
    expected = [text for p in prompts for text, _, _ in offline(p, params)]
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    assert [c.text for c in resp.choices] == expected


def test_extra_body_params_reach_the_engine(client: openai.OpenAI, offline: Oracle) -> None:
    params = {"max_tokens": 8, "temperature": 0, "repetition_penalty": 1.3, "min_tokens": 8}
    resp = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0,
                                     extra_body={"repetition_penalty": 1.3, "min_tokens": 8})
    assert resp.choices[0].text == offline(PROMPT, params)[0][0]


def test_sse_event_ids_are_reply_entry_ids_and_last_event_id_resumes(
        fleet: tuple[RedisServer, GatewayProcess]) -> None:
    server, gateway = fleet
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    headers = {"Genq-Job-Id": "resume-1"}
    events = sse(gateway, body, headers)
    assert events[-1] == (None, "[DONE]")
    entry_ids = [eid.decode()
                 for eid, _ in server.client().xrange(Keys().reply("resume-1", "tiny"))]
    token_ids = [eid for eid, data in events if data != "[DONE]"]
    assert set(token_ids) <= set(entry_ids) and token_ids == sorted(token_ids, key=entry_key)

    cut = token_ids[2]
    resumed = sse(gateway, body, {**headers, "Last-Event-ID": cut})
    assert resumed == [e for e in events if e[0] is None or entry_key(e[0]) > entry_key(cut)]
    # The second request found the job id taken: the job ran once.
    assert [e["type"] for e in reply_events(server, "resume-1")].count("started") == 1


def cancels_published(server: RedisServer, job_id: str, hang_up: Callable[[], None]) -> None:
    """Run hang_up; then the gateway must publish a cancel of job_id and set its cancel key
    (what a worker acts on: tests/fleet holds that it aborts the job and frees its blocks)."""
    pubsub = server.client().pubsub(ignore_subscribe_messages=True)
    pubsub.ssubscribe(Keys().cancel_channel("tiny"))
    try:
        hang_up()
        end = time.monotonic() + 120  # a cap on waiting for the event, not a claim about speed
        seen: list[bytes] = []
        while job_id.encode() not in seen and time.monotonic() < end:
            message = pubsub.get_message(timeout=0.5)
            if message is not None and message["type"] == "smessage":
                seen.append(message["data"])
        assert job_id.encode() in seen
        assert server.client().exists(Keys().cancel(job_id, "tiny")) == 1
    finally:
        pubsub.close()


def test_a_client_that_disconnects_mid_stream_cancels_its_job(
        fleet: tuple[RedisServer, GatewayProcess]) -> None:
    server, gateway = fleet
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 480, "temperature": 0,
            "ignore_eos": True, "stream": True}

    def hang_up() -> None:
        with httpx.stream("POST", f"{gateway.url}/v1/completions", json=body,
                          headers={"Genq-Job-Id": "gone-1"}, timeout=60) as resp:
            assert resp.status_code == 200
            next(resp.iter_lines())  # the first token arrived; now hang up

    cancels_published(server, "gone-1", hang_up)


def test_openai_errors_have_the_right_status_and_shape(
        fleet: tuple[RedisServer, GatewayProcess], client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as not_found:
        client.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=2)
    assert not_found.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="tiny", prompt=PROMPT, top_p=3.0)
    assert bad.value.param == "top_p"
    with pytest.raises(openai.BadRequestError) as unknown:
        client.completions.create(model="tiny", prompt=PROMPT, extra_body={"mirostat": 1})
    assert unknown.value.param == "mirostat"
    with pytest.raises(openai.BadRequestError) as out_of_range:  # (the protocol checks the range)
        client.completions.create(model="tiny", prompt=PROMPT, extra_body={"top_k": -5})
    assert out_of_range.value.code == "invalid_params"
    resp = httpx.post(f"{fleet[1].url}/v1/completions", json={"model": "tiny"}, timeout=30)
    assert resp.status_code == 400
    assert set(resp.json()["error"]) == {"message", "type", "param", "code"}


def test_a_queue_without_live_workers_is_503(fleet: tuple[RedisServer, GatewayProcess],
                                             client: openai.OpenAI) -> None:
    from producer import Client

    server, _ = fleet
    with Client(server.url) as genq:  # a model whose workers are all gone: its queue remains
        genq.submit(PROMPT, {"max_tokens": 1}, model="orphan")
    with pytest.raises(openai.InternalServerError) as err:
        client.completions.create(model="orphan", prompt=PROMPT, max_tokens=2)
    assert err.value.status_code == 503 and err.value.code == "no_worker"


def test_queue_at_its_depth_is_429_and_a_passed_deadline_is_504(
        fleet: tuple[RedisServer, GatewayProcess], tmp_path: Path) -> None:
    from producer import Client

    server, _ = fleet
    strict = GatewayProcess(server.url, tmp_path / "strict.log", "--max-queue-depth", "1",
                            "--timeout", "0.001")
    try:
        api = strict.openai()
        with Client(server.url) as genq:
            long_job = genq.submit(PROMPT, {"max_tokens": 400, "ignore_eos": True,
                                            "temperature": 0}, model="tiny")
            with pytest.raises(openai.RateLimitError) as full:
                api.completions.create(model="tiny", prompt=PROMPT, max_tokens=2)
            assert full.value.code == "queue_full"
            long_job.cancel()
            wait_for(lambda: server.client().xinfo_groups(Keys().jobs("tiny"))[0]["pending"] == 0,
                     timeout=30, what="the long job to end")
        time.sleep(0.01)
        with pytest.raises(openai.APIStatusError) as late:
            api.completions.create(model="tiny", prompt=PROMPT, max_tokens=2)
        assert (late.value.status_code, late.value.code) == (504, "deadline_exceeded")
    finally:
        strict.stop()


def test_gateway_and_celery_bridge_import_no_torch_cupy_or_engine() -> None:
    code = ("import sys, producer.gateway, producer.celery_bridge; "
            "print(sorted(m for m in ('torch', 'cupy', 'engine') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, check=True)
    assert out.stdout.strip() == "[]"


def test_best_of_streams_the_chosen_text_whole_at_the_end(client: openai.OpenAI,
                                                          offline: Oracle) -> None:
    params = {"n": 1, "best_of": 3, "temperature": 0.8, "seed": 11, "max_tokens": 5}
    [(text, reason, _)] = offline(PROMPT, params)
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, stream=True, **params))
    assert "".join(c.choices[0].text for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == reason


def test_a_client_that_hangs_up_on_a_plain_request_cancels_its_job(
        fleet: tuple[RedisServer, GatewayProcess]) -> None:
    server, gateway = fleet
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 480, "temperature": 0,
            "ignore_eos": True}

    def hang_up() -> None:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{gateway.url}/v1/completions", json=body,
                       headers={"Genq-Job-Id": "gone-2"}, timeout=0.3)

    cancels_published(server, "gone-2", hang_up)


def test_more_concurrent_requests_than_redis_connections_all_succeed(
        fleet: tuple[RedisServer, GatewayProcess], tmp_path: Path, offline: Oracle) -> None:
    server, _ = fleet
    narrow = GatewayProcess(server.url, tmp_path / "narrow.log", "--max-connections", "8")
    prompts = [PROMPT, "    def __init__(self", "class Foo(", "with open(", "import os\n",
               "raise ValueError("]
    expected = {p: offline(p, {"max_tokens": 2, "temperature": 0})[0][0] for p in prompts}

    async def run_all() -> list[tuple[str, int, Any]]:
        limits = httpx.Limits(max_connections=300, max_keepalive_connections=300)
        async with httpx.AsyncClient(base_url=narrow.url, timeout=120, limits=limits) as http:
            async def one(k: int) -> tuple[str, int, Any]:
                prompt = prompts[k % len(prompts)]
                resp = await http.post("/v1/completions", json={
                    "model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0})
                return prompt, resp.status_code, resp.json()
            return await asyncio.gather(*(one(k) for k in range(240)))

    try:
        answers = asyncio.run(run_all())
    finally:
        narrow.stop()
    assert [status for _, status, _ in answers] == [200] * 240
    assert all(body["choices"][0]["text"] == expected[p] for p, _, body in answers)


def test_when_one_prompt_of_several_fails_the_others_are_cancelled(
        fleet: tuple[RedisServer, GatewayProcess]) -> None:
    server, gateway = fleet
    body = {"model": "tiny", "prompt": [[5, 6, 7], [10**9]], "max_tokens": 480,
            "temperature": 0, "ignore_eos": True}

    def fail() -> None:
        resp = httpx.post(f"{gateway.url}/v1/completions", json=body,
                          headers={"Genq-Job-Id": "pair"}, timeout=60)
        assert resp.status_code == 400, resp.text
        assert "10000000" in resp.json()["error"]["message"]  # the bad token id is named

    cancels_published(server, "pair-0", fail)


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_text_no_tokens_event_carried_is_sent_with_the_finish(chat: bool) -> None:
    # A request the engine ends itself (it outgrew the KV cache) releases the text it held back
    # for a stop string only in the done event: the stream must still add up to the done text.
    from producer import openai_schema as oa
    from producer.events import done_event, tokens_event
    from producer.openai_choices import Choices
    from producer.replies import ReplyDeduper

    req = (oa.ChatCompletionRequest(model="tiny", messages=[{"role": "user", "content": "hi"}])
           if chat else oa.CompletionRequest(model="tiny", prompt="hi"))
    shaper = Choices(req, chat, "cmpl-1", 0, ["hi"])
    events = [tokens_event(1, 0, 0, [5], "ab"), tokens_event(1, 0, 1, [6], "c"),
              done_event(1, [{"index": 0, "token_ids": [5, 6], "text": "abcde",
                              "finish_reason": "length"}], {}, {})]
    dedupe = ReplyDeduper()  # the gateway's path: reply stream -> deduper -> SSE chunks
    chunks = [c for e in events for d in dedupe.feed(e) for c in shaper.sse_payloads(d)]
    key = "delta" if chat else None
    texts = [(c["choices"][0][key].get("content") if key else c["choices"][0]["text"]) or ""
             for c in chunks]
    assert texts == ["ab", "c", "de", ""]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "length"]


def test_a_request_again_after_its_result_expired_gets_410(
        fleet: tuple[RedisServer, GatewayProcess]) -> None:
    """The same Genq-Job-Id after the job's reply stream expired: the job does not run again
    (the id is taken) and its result is gone, so the answer says so at once."""
    server, gateway = fleet
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    headers = {"Genq-Job-Id": "expired-1"}
    first = httpx.post(f"{gateway.url}/v1/completions", json=body, headers=headers, timeout=60)
    assert first.status_code == 200
    conn = server.client()
    assert conn.get(Keys().idem("expired-1", "tiny")) == b"ended"  # the finish script's mark
    conn.delete(Keys().reply("expired-1", "tiny"))  # what its TTL would do
    again = httpx.post(f"{gateway.url}/v1/completions", json=body, headers=headers, timeout=60)
    assert again.status_code == 410
    error = again.json()["error"]
    assert error["code"] == "result_expired"
    assert error["message"].startswith("job expired-1 ended, but its reply stream has expired")


def test_a_replay_that_diverges_after_text_was_streamed_ends_the_stream_with_an_error(
        fleet: tuple[RedisServer, GatewayProcess]) -> None:
    """Attempt 2 of the job (written here as a reclaiming worker would) starts with another
    token than attempt 1 streamed: the stream ends with stream_restarted, and the job is not
    cancelled (its result stays the new run's)."""
    server, gateway = fleet
    conn = server.client()
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 480, "temperature": 0,
            "ignore_eos": True, "stream": True}
    lines: list[str] = []
    with httpx.stream("POST", f"{gateway.url}/v1/completions", json=body,
                      headers={"Genq-Job-Id": "diverged-1"}, timeout=60) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            lines.append(line)
            if len(lines) == 1:  # text is out: now a replay that disagrees with it
                first = next(e for e in reply_events(server, "diverged-1")
                             if e["type"] == "tokens")
                other = (first["token_ids"][0] + 1) % 100
                conn.xadd(Keys().reply("diverged-1", "tiny"), {"e": encode_event(tokens_event(
                    first["attempt"] + 1, 0, 0, [other], "zz"))})
    data = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert "choices" in data[0]
    assert data[-1]["error"]["code"] == "stream_restarted"
    assert data[-1]["error"]["message"].startswith("the job was run again after a worker failed")
    assert "data: [DONE]" not in lines
    assert not conn.exists(Keys().cancel("diverged-1", "tiny"))
