"""/v1/chat/completions end to end: the official openai client -> a live gateway -> Redis -> a
worker process that applies the served model's chat template -> the engine.

The oracle is the offline engine (LLM.generate) on exactly the token ids that the tokenizer's
`apply_chat_template(..., add_generation_prompt=True)` produces. The chat model is a copy of the
committed demo model with another simple Jinja template in its tokenizer_config.json (its
generation prompt opens a `def`, so that this model trained on Python answers readable text
rather than newlines; a template of the tests' own, so these claims do not rest on the demo
model's); a copy with no template at all is served too, to answer the "no chat template" error.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from producer.async_client import AsyncClient
from producer.client import Client
from tests.harness.fleet import RedisServer
from tests.harness.gateway import (
    CHAT,
    MODEL_DIR,
    REPO,
    GatewayProcess,
    gateway_fleet,
)
from tests.harness.gateway import chat_model as harness_chat_model
from tests.harness.oracle import OracleOf

Outputs = list[tuple[list[int], str, str | None]]
Oracle = Callable[[list[dict[str, str]], dict[str, Any]], Outputs]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return harness_chat_model(tmp_path_factory.mktemp("chat-model") / "genq-tiny-chat")


@pytest.fixture(scope="module")
def plain_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo model without a chat template."""
    model = tmp_path_factory.mktemp("plain-model") / "genq-tiny-plain"
    shutil.copytree(MODEL_DIR, model)
    config_path = model / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    del config["chat_template"]
    config_path.write_text(json.dumps(config, indent=2))
    return model


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, chat_model: Path,
          plain_model: Path) -> Iterator[tuple[RedisServer, GatewayProcess]]:
    workers = [(chat_model, "chat-worker", "chat"), (plain_model, "plain-worker", "plain")]
    with gateway_fleet(tmp_path_factory.mktemp("chat-fleet"), workers,
                       "--resume-grace", "0.2") as pair:
        yield pair


@pytest.fixture(scope="module")
def template_ids(chat_model: Path) -> Callable[[list[dict[str, str]]], list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(chat_model))

    def ids(messages: list[dict[str, str]]) -> list[int]:
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                            return_dict=False)
        assert isinstance(out, list) and all(isinstance(t, int) for t in out)
        return out

    return ids


@pytest.fixture(scope="module")
def offline(chat_model: Path, oracle_of: OracleOf,
            template_ids: Callable[[list[dict[str, str]]], list[int]]) -> Oracle:
    """(token ids, text, finish_reason) per sequence, from the offline oracle on the template's
    ids."""
    oracle = oracle_of(chat_model)

    def run(messages: list[dict[str, str]], params: dict[str, Any]) -> Outputs:
        [outputs] = oracle.outputs([template_ids(messages)], params)
        assert all(c.text.strip() for c in outputs), "an empty text would make the claim vacuous"
        return [(list(c.token_ids), c.text, c.finish_reason) for c in outputs]

    return run


def test_the_template_renders_the_chat_and_opens_the_assistant_turn(
        chat_model: Path, template_ids: Callable[[list[dict[str, str]]], list[int]]) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(chat_model))
    assert tokenizer.decode(template_ids(CHAT)) == (
        "<|system|>You write Python.\n<|user|>def main(\n<|assistant|>\ndef")


def test_greedy_chat_equals_the_offline_engine_on_the_template_ids(
        client: openai.OpenAI, offline: Oracle,
        template_ids: Callable[[list[dict[str, str]]], list[int]]) -> None:
    resp = client.chat.completions.create(model="chat", messages=CHAT,  # type: ignore[arg-type]
                                          max_tokens=12, temperature=0)
    [(token_ids, text, reason)] = offline(CHAT, {"max_tokens": 12, "temperature": 0})
    assert resp.object == "chat.completion" and resp.model == "chat"
    assert resp.id.startswith("chatcmpl-")
    assert [(c.index, c.message.role, c.message.content, c.finish_reason)
            for c in resp.choices] == [(0, "assistant", text, reason)]
    assert resp.usage is not None
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (
        len(template_ids(CHAT)), len(token_ids))


def test_streamed_chat_chunks_concatenate_to_the_offline_text(client: openai.OpenAI,
                                                              offline: Oracle) -> None:
    [(token_ids, text, reason)] = offline(CHAT, {"max_tokens": 12, "temperature": 0})
    chunks = list(client.chat.completions.create(
        model="chat", messages=CHAT, max_completion_tokens=12,  # type: ignore[arg-type]
        temperature=0, stream=True, stream_options={"include_usage": True}))
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    with_choices = [c for c in chunks if c.choices]
    assert with_choices[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in with_choices) == text
    assert [c.choices[0].finish_reason for c in with_choices][-1] == reason
    assert all(c.choices[0].finish_reason is None for c in with_choices[:-1])
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(token_ids)


def test_seeded_n2_chat_equals_the_offline_engine_streamed_or_not(client: openai.OpenAI,
                                                                  offline: Oracle) -> None:
    params = {"n": 2, "temperature": 0.9, "seed": 1234, "max_tokens": 10}
    expected = [(text, reason) for _ids, text, reason in offline(CHAT, params)]
    assert expected[0] != expected[1], "two equal samples would make the claim weak"
    resp = client.chat.completions.create(model="chat", messages=CHAT,  # type: ignore[arg-type]
                                          n=2, temperature=0.9, seed=1234, max_tokens=10)
    assert [(c.message.content, c.finish_reason) for c in
            sorted(resp.choices, key=lambda c: c.index)] == expected
    texts = ["", ""]
    reasons: list[str | None] = [None, None]
    for chunk in client.chat.completions.create(
            model="chat", messages=CHAT, n=2, temperature=0.9,  # type: ignore[arg-type]
            seed=1234, max_tokens=10, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            reasons[c.index] = c.finish_reason or reasons[c.index]
    assert list(zip(texts, reasons, strict=True)) == expected


def test_a_stop_string_ends_the_chat_where_the_offline_engine_does(client: openai.OpenAI,
                                                                   offline: Oracle) -> None:
    [(_ids, full, _reason)] = offline(CHAT, {"max_tokens": 12, "temperature": 0})
    stop = "(self"
    assert stop in full, full
    [(_ids, text, reason)] = offline(CHAT, {"max_tokens": 12, "temperature": 0, "stop": [stop]})
    assert reason == "stop" and stop not in text
    resp = client.chat.completions.create(model="chat", messages=CHAT,  # type: ignore[arg-type]
                                          max_tokens=12, temperature=0, stop=stop)
    assert [(c.message.content, c.finish_reason) for c in resp.choices] == [(text, "stop")]


def test_a_model_without_a_chat_template_is_a_400_that_says_so(client: openai.OpenAI) -> None:
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="plain", messages=CHAT,  # type: ignore[arg-type]
                                           max_tokens=4, stream=stream)
        assert (err.value.status_code, err.value.code) == (400, "no_chat_template")
        assert err.value.body["message"] == (  # type: ignore[index]
            "the model served as 'plain' has no chat template (its tokenizer_config.json sets no "
            "'chat_template'), so it cannot take chat messages: send a prompt instead "
            "(/v1/completions), or serve a model whose tokenizer has a chat template")
    # the same worker still serves prompts
    resp = client.completions.create(model="plain", prompt="def main(", max_tokens=4,
                                     temperature=0)
    assert resp.choices[0].finish_reason == "length"


def test_client_and_async_client_submit_messages(fleet: tuple[RedisServer, GatewayProcess],
                                                 offline: Oracle) -> None:
    server = fleet[0]
    params = {"max_tokens": 8, "temperature": 0}
    [expected] = offline(CHAT, params)
    with Client(server.url) as sync_client:
        result = sync_client.submit(messages=CHAT, params=params, model="chat").result(120)
    assert [(o["token_ids"], o["text"], o["finish_reason"]) for o in result["outputs"]] == [
        expected]

    async def run() -> dict[str, Any]:
        async with AsyncClient(server.url) as async_client:
            job = await async_client.submit(params=params, model="chat", messages=CHAT)
            return await job.result(120)

    result = asyncio.run(run())
    assert [(o["token_ids"], o["text"], o["finish_reason"]) for o in result["outputs"]] == [
        expected]


def genq_submit(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "producer.cli", "submit", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120, input=stdin,
                          env={**os.environ, "PYTHONPATH": str(REPO)})


def test_genq_submit_messages_inline_from_a_file_or_stdin(
        fleet: tuple[RedisServer, GatewayProcess], offline: Oracle, tmp_path: Path) -> None:
    server = fleet[0]
    [(token_ids, text, reason)] = offline(CHAT, {"max_tokens": 8, "temperature": 0})
    common = ("--model", "chat", "--max-tokens", "8", "--temperature", "0",
              "--redis", server.url)
    inline = genq_submit("--messages", json.dumps(CHAT), *common, "--json")
    assert inline.returncode == 0, inline.stderr
    done = json.loads(inline.stdout)
    assert [(o["token_ids"], o["text"], o["finish_reason"]) for o in done["outputs"]] == [
        (token_ids, text, reason)]

    chat_file = tmp_path / "chat.json"
    chat_file.write_text(json.dumps(CHAT))
    streamed = genq_submit("--messages", str(chat_file), *common)  # the text as it streams
    assert streamed.returncode == 0, streamed.stderr
    assert streamed.stdout == text + "\n"
    piped = genq_submit("--messages", "-", *common, stdin=json.dumps(CHAT))
    assert (piped.returncode, piped.stdout) == (0, text + "\n")


def test_genq_submit_messages_errors_are_one_line_and_exit_2(
        fleet: tuple[RedisServer, GatewayProcess], tmp_path: Path) -> None:
    common = ("--model", "chat", "--redis", fleet[0].url)
    both = genq_submit("hello", "--messages", json.dumps(CHAT), *common)
    assert both.returncode == 2
    assert both.stderr.splitlines()[-1] == (
        "genq submit: error: give a prompt or --messages, not both")
    neither = genq_submit(*common)
    assert neither.returncode == 2 and neither.stderr.endswith("not both\n")
    bad_json = genq_submit("--messages", "[{", *common)
    assert (bad_json.returncode, bad_json.stderr) == (
        2, "genq submit: --messages is not valid JSON: Expecting property name enclosed in "
           "double quotes: line 1 column 3 (char 2)\n")
    not_a_list = genq_submit("--messages", "-", *common, stdin='{"role": "user"}')
    assert (not_a_list.returncode, not_a_list.stderr) == (
        2, 'genq submit: --messages - (stdin) must be a JSON list of {"role", "content"} maps, '
           'got {"role": "user"}\n')
    missing = genq_submit("--messages", str(tmp_path / "nope.json"), *common)
    assert (missing.returncode, missing.stderr) == (
        2, f"genq submit: --messages: cannot read {tmp_path / 'nope.json'}: No such file or "
           "directory (give inline JSON starting with '[', a file, or '-' for stdin)\n")
    no_content = genq_submit("--messages", '[{"role": "user"}]', *common)  # the protocol's check
    assert (no_content.returncode, no_content.stderr) == (
        2, "genq submit: messages[0] needs the field 'content'\n")


def test_a_chat_without_max_tokens_runs_to_the_context_or_eos_not_16_tokens(
        client: openai.OpenAI, offline: Oracle) -> None:
    """OpenAI and vLLM chat without max_tokens generate until the model stops or its context
    is full; the engine's own default is 16. The job carries max_tokens null: the worker's cap
    (4096, over this model's context), so the context decides."""
    resp = client.chat.completions.create(model="chat", messages=CHAT,  # type: ignore[arg-type]
                                          temperature=0)
    [(token_ids, text, reason)] = offline(CHAT, {"max_tokens": 4096, "temperature": 0})
    assert len(token_ids) > 16
    assert [(c.message.content, c.finish_reason) for c in resp.choices] == [(text, reason)]
    assert resp.usage is not None and resp.usage.completion_tokens == len(token_ids)
