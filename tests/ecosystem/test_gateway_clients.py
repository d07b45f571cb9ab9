"""What OpenAI clients meet at the gateway's door, against a live gateway + worker + redis-server
serving the committed demo model as "tiny": streams that every SSE parser reads, errors in
OpenAI's shape for any route or body, models.retrieve, the context check, and chat on the demo
model's own template."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import httpx_sse
import openai
import pytest

from tests.ecosystem.gateway_harness import MODEL_DIR, GatewayProcess, gateway_fleet
from tests.fleet.harness import RedisServer

PROMPT = "def main("
BODY = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RedisServer, GatewayProcess]]:
    with gateway_fleet(tmp_path_factory.mktemp("gateway-clients"),
                       [(MODEL_DIR, "gw-clients", "tiny")]) as pair:
        yield pair


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
