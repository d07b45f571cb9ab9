"""OpenAI's response_format, vLLM's structured_outputs, logit_bias and allowed_token_ids through
a live gateway with the official openai client: plain and streamed answers equal the offline
engine's and follow their schema; bad grammars are a 400 naming the problem."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from tests.harness.fleet import RedisServer
from tests.harness.gateway import CHAT, GatewayProcess, gateway_fleet
from tests.harness.gateway import chat_model as harness_chat_model
from tests.harness.oracle import OracleOf

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "size"],
          "properties": {"name": {"type": "string", "maxLength": 10},
                         "size": {"enum": ["small", "large"]},
                         "count": {"type": "integer", "minimum": 0, "maximum": 99}}}
RESPONSE_FORMAT = {"type": "json_schema",
                   "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return harness_chat_model(tmp_path_factory.mktemp("structured-model") / "genq-tiny-chat")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory,
          chat_model: Path) -> Iterator[tuple[RedisServer, GatewayProcess]]:
    with gateway_fleet(tmp_path_factory.mktemp("structured-fleet"),
                       [(chat_model, "so-worker", "chat")],
                       "--max-grammar-bytes", "1000") as pair:
        yield pair


@pytest.fixture(scope="module")
def offline(chat_model: Path, oracle_of: OracleOf) -> Any:
    """The offline oracle's text for a chat (templated as the worker does) or a prompt."""
    oracle = oracle_of(chat_model)

    def run(prompt: str | None, params: dict[str, Any]) -> list[str]:
        ids = oracle.llm.tokenizer.apply_chat_template(
            CHAT, add_generation_prompt=True, tokenize=True,
            return_dict=False) if prompt is None else prompt
        [outputs] = oracle.outputs([ids], params)
        return [c.text for c in outputs]

    return run


def test_response_format_json_schema_plain_and_streamed_equal_the_offline_output(
        client: openai.OpenAI, offline: Any) -> None:
    kwargs: dict[str, Any] = dict(model="chat", messages=CHAT, temperature=0.8, seed=4, n=2,
                                  max_tokens=48, response_format=RESPONSE_FORMAT)
    plain = client.chat.completions.create(**kwargs)
    texts = [c.message.content for c in plain.choices]
    assert texts == offline(None, {"temperature": 0.8, "seed": 4, "n": 2, "max_tokens": 48,
                                   "structured_outputs": {"json": SCHEMA}})
    for text, choice in zip(texts, plain.choices):
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(text or ""), SCHEMA)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in
                       client.chat.completions.create(**{**kwargs, "n": 1}, stream=True)
                       if chunk.choices)
    assert streamed == texts[0]


def test_json_object_structured_outputs_logit_bias_and_allowed_token_ids(
        client: openai.OpenAI, offline: Any) -> None:
    obj = client.chat.completions.create(model="chat", messages=CHAT, temperature=0,
                                         max_tokens=40, response_format={"type": "json_object"})
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content or ""), dict)
    else:  # (the cap is the one way out)
        assert (obj.choices[0].message.content or "").startswith("{")
    regex = client.completions.create(model="chat", prompt="port = ", temperature=0,
                                      max_tokens=12,
                                      extra_body={"structured_outputs": {"regex": "[0-9]{4}"}})
    assert regex.choices[0].text == offline("port = ", {
        "temperature": 0, "max_tokens": 12, "structured_outputs": {"regex": "[0-9]{4}"}})[0]
    assert len(regex.choices[0].text) == 4 and regex.choices[0].text.isdigit()
    biased = client.completions.create(model="chat", prompt="def main(", temperature=0,
                                       max_tokens=6, logit_bias={"300": 100},
                                       extra_body={"ignore_eos": True})
    assert biased.choices[0].text == offline("def main(", {
        "temperature": 0, "max_tokens": 6, "ignore_eos": True, "logit_bias": {"300": 100}})[0]
    allowed = client.completions.create(model="chat", prompt="def main(", temperature=1.0,
                                        seed=3, max_tokens=6, logprobs=0,
                                        extra_body={"allowed_token_ids": [300, 301],
                                                    "ignore_eos": True})
    assert allowed.choices[0].text == offline("def main(", {
        "temperature": 1.0, "seed": 3, "max_tokens": 6, "ignore_eos": True,
        "allowed_token_ids": [300, 301]})[0]


@pytest.mark.parametrize("extra, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "strin"}}}}, "Invalid type: strin"),
    ({"response_format": {"type": "yaml"}}, "response_format.type 'yaml' is not supported"),
    ({"structured_outputs": {"regex": "(ab"}}, "unclosed group"),
    ({"structured_outputs": {"choice": ["x" * 600, "y" * 600]}}, "over the cap of 1000"),
    ({"logit_bias": {"5": 101}}, "logit_bias[5] is 101.0, outside [-100, 100]"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "not both"),
])
def test_a_bad_grammar_is_a_400_naming_the_problem_and_the_worker_serves_on(
        client: openai.OpenAI, extra: dict[str, Any], words: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="chat", prompt="x", max_tokens=4, extra_body=extra)
    assert err.value.status_code == 400 and words in str(err.value)
    ok = client.completions.create(model="chat", prompt="x", temperature=0, max_tokens=4,
                                   extra_body={"structured_outputs": {"choice": ["a", "b"]}})
    assert ok.choices[0].text in ("a", "b")
