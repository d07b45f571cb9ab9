"""Logprobs and echo through the gateway, with the official openai client against a live gateway
+ worker + redis-server.

The oracle is the offline engine (LLM.generate with `logprobs=k`) on the same model: the token
ids and the top-k ids must match exactly; logprob values to 1e-5 (the worker and the offline
engine run the same kernels, but in batches that need not be shaped alike). Token strings are
checked against the tokenizer: the model is the committed genq-tiny-stdlib (byte-level BPE, and
its greedy texts here are ASCII), so a token's text is `tokenizer.decode([id])` and the tokens of
a choice concatenate to its text. The worker serves a copy of the model with a chat template, so
one worker answers completions and chat.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.harness.fleet import RedisServer, reply_events
from tests.harness.gateway import CHAT, PROMPT, GatewayProcess, chat_model, gateway_fleet
from tests.harness.oracle import OracleOf

# (token id, {id: logprob} of the sampled token and the top-k) per position, per sequence
Positions = list[tuple[int, dict[int, float]]]
Oracle = Callable[[str | list[int], dict[str, Any]], list[tuple[str, Positions]]]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return chat_model(tmp_path_factory.mktemp("logprobs-model") / "genq-tiny-chat")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory,
          model: Path) -> Iterator[tuple[RedisServer, GatewayProcess]]:
    with gateway_fleet(tmp_path_factory.mktemp("logprobs-fleet"),
                       [(model, "lp-worker", "tiny")]) as pair:
        yield pair


@pytest.fixture(scope="module")
def tokenizer(model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model))


@pytest.fixture(scope="module")
def offline(model: Path, oracle_of: OracleOf) -> Oracle:
    oracle = oracle_of(model)

    def run(prompt: str | list[int], params: dict[str, Any]) -> list[tuple[str, Positions]]:
        [outputs] = oracle.outputs([prompt], params)
        assert all(c.text.strip() and c.text.isascii() for c in outputs), [
            c.text for c in outputs]
        assert all(c.logprobs is not None for c in outputs)
        return [(c.text, list(zip(c.token_ids, c.logprobs or [], strict=True)))
                for c in outputs]

    return run


def close(value: float, expected: float) -> bool:
    return abs(value - expected) <= 1e-5


def check_completion_logprobs(lp: Any, text: str, positions: Positions, k: int, tokenizer: Any,
                              offset: int = 0) -> None:
    """An OpenAI completions logprobs object against the offline engine's positions."""
    assert lp.tokens == [tokenizer.decode([t]) for t, _ in positions]
    assert "".join(lp.tokens) == text
    assert all(close(v, top[t]) for v, (t, top) in zip(lp.token_logprobs, positions, strict=True))
    starts = [offset + len("".join(lp.tokens[:i])) for i in range(len(positions))]
    assert lp.text_offset == starts
    for got, (_token, top) in zip(lp.top_logprobs, positions, strict=True):
        # the sampled token and the top k: k + 1 entries, or k when the sampled one is among them
        assert len(top) in (k, k + 1)
        want = {tokenizer.decode([t]): v for t, v in top.items()}
        assert sorted(got) == sorted(want)
        assert all(close(got[s], want[s]) for s in want)


def test_completion_logprobs_equal_the_offline_engine(client: openai.OpenAI, offline: Oracle,
                                                      tokenizer: Any) -> None:
    params = {"max_tokens": 8, "temperature": 0, "logprobs": 3}
    [(text, positions)] = offline(PROMPT, params)
    resp = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0,
                                     logprobs=3)
    [choice] = resp.choices
    assert choice.text == text
    assert choice.logprobs is not None
    check_completion_logprobs(choice.logprobs, text, positions, 3, tokenizer)


def test_streamed_completion_logprobs_join_to_the_whole_answer_for_each_choice(
        client: openai.OpenAI, offline: Oracle, tokenizer: Any) -> None:
    params = {"n": 2, "temperature": 0.9, "seed": 5, "max_tokens": 8}
    expected = offline(PROMPT, {**params, "logprobs": 2})
    whole = client.completions.create(model="tiny", prompt=PROMPT, logprobs=2, **params)
    joined: dict[int, dict[str, list[Any]]] = {}
    texts = {0: "", 1: ""}
    for chunk in client.completions.create(model="tiny", prompt=PROMPT, logprobs=2, stream=True,
                                           **params):
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.logprobs is None:
                assert c.finish_reason is not None and c.text == ""  # the finish-only chunk
                continue
            fields = joined.setdefault(c.index, {})
            for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                fields.setdefault(name, []).extend(getattr(c.logprobs, name))
    for choice, (text, positions) in zip(sorted(whole.choices, key=lambda c: c.index), expected,
                                         strict=True):
        assert choice.text == texts[choice.index] == text
        assert choice.logprobs is not None
        check_completion_logprobs(choice.logprobs, text, positions, 2, tokenizer)
        # streamed or not, the same numbers and offsets (the offsets run on across chunks)
        assert joined[choice.index] == choice.logprobs.model_dump()


def test_a_best_of_stream_brings_the_chosen_sequence_and_its_logprobs_whole_at_the_end(
        client: openai.OpenAI, offline: Oracle, tokenizer: Any) -> None:
    params = {"n": 1, "best_of": 3, "temperature": 0.8, "seed": 11, "max_tokens": 5}
    [(text, positions)] = offline(PROMPT, {**params, "logprobs": 1})
    chunks = [c.choices[0] for c in client.completions.create(
        model="tiny", prompt=PROMPT, logprobs=1, stream=True, **params) if c.choices]
    assert len(chunks) == 1 and chunks[0].text == text
    assert chunks[0].logprobs is not None
    check_completion_logprobs(chunks[0].logprobs, text, positions, 1, tokenizer)


def test_the_reply_stream_carries_each_tokens_text_beside_its_logprob(
        fleet: tuple[RedisServer, GatewayProcess], client: openai.OpenAI, offline: Oracle,
        tokenizer: Any) -> None:
    [(_text, positions)] = offline(PROMPT, {"max_tokens": 4, "temperature": 0, "logprobs": 1})
    resp = client.completions.with_raw_response.create(model="tiny", prompt=PROMPT, max_tokens=4,
                                                       temperature=0, logprobs=1)
    job_id = resp.headers["Genq-Job-Id"]
    [done] = [e for e in reply_events(fleet[0], job_id) if e["type"] == "done"]
    rows = done["outputs"][0]["logprobs"]
    assert [[(t, s) for t, _lp, s in row] for row in rows] == [
        [(t, tokenizer.decode([t])) for t in top] for _, top in positions]
    assert [row[0][0] for row in rows] == [t for t, _ in positions]  # the sampled token first


def test_echo_puts_the_prompt_before_each_completion_streamed_or_not(
        client: openai.OpenAI, offline: Oracle) -> None:
    prompts = [PROMPT, "class Foo("]
    texts = [offline(p, {"max_tokens": 6, "temperature": 0, "logprobs": 0})[0][0]
             for p in prompts]
    resp = client.completions.create(model="tiny", prompt=prompts, max_tokens=6, temperature=0,
                                     echo=True)
    assert [(c.index, c.text) for c in resp.choices] == [
        (0, PROMPT + texts[0]), (1, "class Foo(" + texts[1])]
    chunks = [c.choices[0] for c in client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, echo=True, stream=True)
        if c.choices]
    assert chunks[0].text.startswith(PROMPT) and not chunks[1].text.startswith(PROMPT)
    assert "".join(c.text for c in chunks) == PROMPT + texts[0]


def test_chat_logprobs_list_the_top_tokens_most_likely_first(client: openai.OpenAI,
                                                             offline: Oracle,
                                                             tokenizer: Any) -> None:
    ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True,
                                        return_dict=False)
    [(text, positions)] = offline(ids, {"max_tokens": 8, "temperature": 0, "logprobs": 2})
    resp = client.chat.completions.create(model="tiny", messages=CHAT,  # type: ignore[arg-type]
                                          max_tokens=8, temperature=0, logprobs=True,
                                          top_logprobs=2)
    [choice] = resp.choices
    assert choice.message.content == text
    assert choice.logprobs is not None and choice.logprobs.content is not None
    content = choice.logprobs.content
    assert [c.token for c in content] == [tokenizer.decode([t]) for t, _ in positions]
    assert "".join(c.token for c in content) == text
    for entry, (token, top) in zip(content, positions, strict=True):
        assert close(entry.logprob, top[token])
        assert entry.bytes == list(entry.token.encode())
        best = sorted(top.items(), key=lambda kv: -kv[1])[:2]
        assert [t.token for t in entry.top_logprobs] == [tokenizer.decode([t]) for t, _ in best]
        assert all(close(t.logprob, v) for t, (_, v) in zip(entry.top_logprobs, best,
                                                            strict=True))
        assert all(t.bytes == list(t.token.encode()) for t in entry.top_logprobs)

    chunks = [c.choices[0] for c in client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=8, temperature=0,  # type: ignore[arg-type]
        logprobs=True, top_logprobs=2, stream=True) if c.choices]
    streamed = [e for c in chunks if c.logprobs and c.logprobs.content
                for e in c.logprobs.content]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]

    plain = client.chat.completions.create(model="tiny", messages=CHAT,  # type: ignore[arg-type]
                                           max_tokens=8, temperature=0, logprobs=True)
    assert plain.choices[0].logprobs is not None and plain.choices[0].logprobs.content is not None
    assert [(c.token, c.top_logprobs) for c in plain.choices[0].logprobs.content] == [
        (c.token, []) for c in content]


def test_without_logprobs_a_choice_has_none(client: openai.OpenAI) -> None:
    resp = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, temperature=0)
    assert resp.choices[0].logprobs is None
    chat = client.chat.completions.create(model="tiny", messages=CHAT,  # type: ignore[arg-type]
                                          max_tokens=2, temperature=0)
    assert chat.choices[0].logprobs is None


BAD: list[tuple[str, dict[str, Any], str | None, str | None, str]] = [
    ("echo+logprobs", {"prompt": PROMPT, "echo": True, "logprobs": 1}, "echo", None,
     "echo with logprobs is not supported: it needs the prompt's logprobs, which the genq engine "
     "does not compute; ask for echo or logprobs"),
    ("echo of ids", {"prompt": [5, 6, 7], "echo": True}, "echo", None,
     "echo needs a text prompt: the gateway has no tokenizer to turn prompt token ids into text"),
    ("beam", {"prompt": PROMPT, "logprobs": 1, "use_beam_search": True, "best_of": 2,
              "temperature": 0}, "logprobs", None,
     "logprobs with use_beam_search is not supported: beam search keeps no per-token logprobs"),
    ("over 20", {"prompt": PROMPT, "logprobs": 21}, None, "invalid_params",
     "logprobs must be in [0, 20], got 21"),
    ("negative", {"prompt": PROMPT, "logprobs": -1}, "logprobs", None,
     "logprobs: Input should be greater than or equal to 0"),
    ("suffix", {"prompt": PROMPT, "suffix": "x"}, "suffix", None,
     "suffix is not supported by the genq gateway"),
]


@pytest.mark.parametrize("why, body, param, code, message", BAD, ids=[b[0] for b in BAD])
def test_unsupported_combinations_are_a_400_that_says_why(
        client: openai.OpenAI, why: str, body: dict[str, Any], param: str | None,
        code: str | None, message: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", max_tokens=2, extra_body=body,
                                  prompt=body["prompt"])
    assert (err.value.status_code, err.value.param, err.value.code) == (400, param, code)
    assert err.value.body["message"] == message  # type: ignore[index]


def test_chat_top_logprobs_without_logprobs_is_a_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=CHAT,  # type: ignore[arg-type]
                                       max_tokens=2, top_logprobs=2)
    assert (err.value.param, err.value.body["message"]) == (  # type: ignore[index]
        "top_logprobs", "top_logprobs needs logprobs: true")
