"""What OpenAI clients meet at the gateway's door, against a live gateway + worker + redis-server
serving the committed demo model as "tiny": streams that every SSE parser reads, errors in
OpenAI's shape for any route or body, models.retrieve, the context check, and chat on the demo
model's own template."""

from __future__ import annotations

import json

import httpx
import httpx_sse
import openai
import pytest

from tests.harness.fleet import RedisServer
from tests.harness.gateway import MODEL_DIR, GatewayProcess

PROMPT = "def main("
BODY = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def fleet(demo_fleet: tuple[RedisServer, GatewayProcess]) -> tuple[RedisServer, GatewayProcess]:
    return demo_fleet


@pytest.fixture(scope="module")
def whole_text(client: openai.OpenAI) -> str:
    """The greedy text of BODY, not streamed (what every parser's stream must add up to)."""
    text = client.completions.create(**BODY).choices[0].text  # type: ignore[call-overload]
    assert text.strip(), "an empty text would make the stream claims vacuous"
    return text


def naive_texts(raw: str) -> list[str]:
    """A hand-written client as vLLM's load generator has: split on blank lines, strip a leading
    `data: `, and parse JSON."""
    texts = []
    for block in raw.split("\n\n"):
        if not block.strip():
            continue
        data = block.removeprefix("data: ")
        if data == "[DONE]":
            break
        texts.append(json.loads(data)["choices"][0]["text"])
    return texts


def test_a_default_stream_is_plain_data_events_that_every_parser_reads(
        fleet: tuple[RedisServer, GatewayProcess], client: openai.OpenAI,
        whole_text: str) -> None:
    gateway = fleet[1]
    raw = httpx.post(f"{gateway.url}/v1/completions", json={**BODY, "stream": True},
                     timeout=120).text
    assert [line for line in raw.splitlines() if line and not line.startswith("data: ")] == []
    assert "".join(naive_texts(raw)) == whole_text

    with httpx.Client(timeout=120) as http, httpx_sse.connect_sse(
            http, "POST", f"{gateway.url}/v1/completions",
            json={**BODY, "stream": True}) as source:
        events = list(source.iter_sse())
    assert [e.id for e in events] == [""] * len(events)
    assert events[-1].data == "[DONE]"
    assert "".join(json.loads(e.data)["choices"][0]["text"] for e in events[:-1]) == whole_text

    stream = client.completions.create(**BODY, stream=True)  # type: ignore[call-overload]
    assert "".join(chunk.choices[0].text for chunk in stream) == whole_text


def test_a_stream_that_opts_in_gets_an_id_line_before_each_event(
        fleet: tuple[RedisServer, GatewayProcess], whole_text: str) -> None:
    with httpx.Client(timeout=120) as http, httpx_sse.connect_sse(
            http, "POST", f"{fleet[1].url}/v1/completions", json={**BODY, "stream": True},
            headers={"Genq-Resumable": "1"}) as source:
        events = list(source.iter_sse())
    data_events = events[:-1]
    assert all(e.id.count("-") == 1 for e in data_events), [e.id for e in data_events]
    assert "".join(json.loads(e.data)["choices"][0]["text"] for e in data_events) == whole_text


@pytest.mark.parametrize("method, path, content, message, code", [
    ("GET", "/v1/nothing", None, "no route GET /v1/nothing: the gateway serves /v1/completions, "
     "/v1/chat/completions, /v1/models and /health", "not_found"),
    ("POST", "/v1/completions", b'{"model": "tiny",, "prompt": "x"}', "the request body is not "
     "valid JSON: Expecting property name enclosed in double quotes (at character 17)",
     "invalid_json"),
    ("POST", "/v1/completions", b"", "the request body must be a JSON object, sent with "
     "Content-Type: application/json", "invalid_json"),
])
def test_every_error_comes_in_openais_shape(fleet: tuple[RedisServer, GatewayProcess],
                                            method: str, path: str, content: bytes | None,
                                            message: str, code: str) -> None:
    resp = httpx.request(method, f"{fleet[1].url}{path}", content=content, timeout=30,
                         headers={"content-type": "application/json"})
    assert (resp.status_code, resp.json()) == (404 if code == "not_found" else 400, {"error": {
        "message": message, "type": "invalid_request_error", "param": None, "code": code}})


def test_models_retrieve_gives_a_served_model_and_404s_another(client: openai.OpenAI) -> None:
    model = client.models.retrieve("tiny")
    assert (model.id, model.object, model.owned_by) == ("tiny", "model", "genq")
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("tiny-typo")
    assert err.value.code == "model_not_found"


def test_prompt_plus_max_tokens_over_the_context_is_a_400_in_vllms_words(
        client: openai.OpenAI) -> None:
    """The demo model's context is 512 tokens: 3 prompt tokens leave room for 509; a short text
    prompt fits with 500."""
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=510)
    assert err.value.code == "context_length_exceeded"
    assert err.value.body["message"] == (  # type: ignore[index]
        "This model's maximum context length is 512 tokens. However, you requested 513 tokens "
        "(3 in the messages, 510 in the completion). Please reduce the length of the messages "
        "or completion.")
    fits = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=500, stop=",",
                                     temperature=0)
    assert fits.choices[0].finish_reason == "stop"


def test_chat_works_on_the_demo_model_out_of_the_box(client: openai.OpenAI) -> None:
    """The README's chat call: the worker applies the demo model's own template, exactly as
    transformers renders it (the same ids sent as a prompt give the same greedy text)."""
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": "Write a function that reads a file."}]
    ids = AutoTokenizer.from_pretrained(MODEL_DIR).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    chat = client.chat.completions.create(model="tiny", messages=messages,  # type: ignore[arg-type]
                                          max_tokens=24, temperature=0)
    prompt = client.completions.create(model="tiny", prompt=ids, max_tokens=24, temperature=0)
    assert chat.choices[0].message.content == prompt.choices[0].text
    assert chat.choices[0].message.content.strip()  # type: ignore[union-attr]
    assert chat.usage.prompt_tokens == len(ids)  # type: ignore[union-attr]
