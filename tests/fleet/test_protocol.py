"""The wire protocol: key names, strict decoding, events, caps, and what a client sees."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from producer.events import (
    decode_event,
    decode_reply_entry,
    done_event,
    encode_event,
    error_event,
    started_event,
    tokens_event,
)
from producer.job_params import SAMPLING_PARAM_NAMES
from producer.limits import Limits, check_job_bytes, check_limits
from producer.protocol import (
    JobSpec,
    Keys,
    ProtocolError,
    check_job_spec,
    decode_job_entry,
    encode_job_entry,
    new_job_id,
    waiting_entries,
)
from producer.replies import ReplyDeduper
from tests.harness.fleet import REPO

GOOD = JobSpec(id="job-1", model="tiny", prompt="hello", params={"temperature": 0,
                                                                  "max_tokens": 4},
               seed=None, created=1.5, deadline=None, stream=True)


def entry(job: dict[str, object], **extra: bytes) -> dict[bytes, bytes]:
    fields = {b"v": b"2", b"job": msgpack.packb(job)}
    fields.update({k.encode(): v for k, v in extra.items()})
    return fields


def test_keys_live_under_the_prefix_with_the_models_hash_tag() -> None:
    keys = Keys("app")
    assert keys.jobs("tiny") == "app:jobs:{tiny}"
    assert keys.dead("tiny") == "app:dead:{tiny}"
    assert keys.reply("a.b:c-d_1", "tiny") == "app:reply:{tiny}:a.b:c-d_1"
    assert keys.cancel("x", "tiny") == "app:cancel:{tiny}:x"
    assert keys.worker("tiny", "w1") == "app:worker:{tiny}:w1"
    assert keys.workers("tiny") == "app:worker:{tiny}"
    assert keys.models == "app:worker:models"
    assert keys.fence("tiny", "w1") == "app:fence:{tiny}:w1"
    assert keys.idem("x", "tiny") == "app:idem:{tiny}:x"
    assert keys.cancel_channel("tiny") == "app:cancel:{tiny}"


def test_a_job_ids_model_comes_from_the_call_then_the_keys_then_the_id() -> None:
    made = new_job_id("Qwen2.5-0.5B")
    assert re.fullmatch(r"Qwen2\.5-0\.5B\.[0-9a-f]{32}", made)
    assert Keys().reply(made) == f"genq:reply:{{Qwen2.5-0.5B}}:{made}"
    assert Keys().reply(made + "-3") == f"genq:reply:{{Qwen2.5-0.5B}}:{made}-3"  # (gateway's)
    assert Keys(model="tiny").reply(made) == f"genq:reply:{{tiny}}:{made}"  # (a worker's)
    assert Keys(model="tiny").reply(made, "m") == f"genq:reply:{{m}}:{made}"
    with pytest.raises(ValueError, match=r"^job id 'j1' does not name its model .*pass "
                                         r"model=\.\.\. to find its job$"):
        Keys().reply("j1")
    assert re.fullmatch(r"[0-9a-f]{32}", new_job_id("m" * 100))  # (too long to name it)


@pytest.mark.parametrize("bad", ["", "a b", "../x", "x\n", "é", "a*", "a" * 129, "{x}"])
def test_reply_keys_only_from_valid_ids(bad: str) -> None:
    with pytest.raises(ProtocolError) as exc:
        Keys().reply(bad, "tiny")
    assert exc.value.code == "bad_id"


def test_job_entry_round_trips() -> None:
    spec, base = decode_job_entry(encode_job_entry(GOOD, attempt_base=3))
    assert spec == GOOD
    assert base == 3


def test_token_id_prompt_round_trips() -> None:
    spec = dataclasses.replace(GOOD, prompt=None, prompt_token_ids=[5, 6, 7])
    assert decode_job_entry(encode_job_entry(spec))[0] == spec


def test_producer_param_names_equal_the_engine_dataclass_fields() -> None:
    from engine.sampling_params import SamplingParams

    assert SAMPLING_PARAM_NAMES == {f.name for f in dataclasses.fields(SamplingParams)}


JOB = GOOD.to_wire()


@pytest.mark.parametrize("fields, code, job_id", [
    ({b"v": b"2"}, "missing_field", None),
    ({b"v": b"1", b"job": msgpack.packb(JOB)}, "bad_version", None),  # (protocol 1)
    (entry(JOB, extra=b"1"), "unknown_field", None),
    (entry(JOB, a=b"-1"), "wrong_type", None),
    (entry(JOB, a="\u00b2".encode()), "wrong_type", None),  # '²'.isdigit(), int('²') raises
    (entry(JOB, a="\u0663".encode()), "wrong_type", None),  # Arabic-Indic 3: int() takes it
    ({b"v": b"2", b"job": b"\xc1\xc1"}, "malformed", None),
    ({b"v": b"2", b"job": msgpack.packb([1, 2])}, "wrong_type", None),
    (entry({**JOB, "id": "bad id"}), "bad_id", None),
    (entry({**JOB, "id": 7}), "bad_id", None),
    (entry({**JOB, "colour": "red"}), "unknown_field", "job-1"),
    (entry({k: v for k, v in JOB.items() if k != "params"}), "missing_field", "job-1"),
    (entry({**JOB, "prompt_token_ids": [1]}), "missing_field", "job-1"),
    (entry({**JOB, "prompt": ""}), "bad_prompt", "job-1"),
    (entry({**JOB, "stream": "yes"}), "wrong_type", "job-1"),
    (entry({**JOB, "seed": -1}), "wrong_type", "job-1"),
    (entry({**JOB, "model": "a/b"}), "unknown_model", "job-1"),
    (entry({**JOB, "params": {"temprature": 0}}), "unknown_field", "job-1"),
    (entry({**JOB, "params": {"max_tokens": "4"}}), "wrong_type", "job-1"),
    (entry({**JOB, "params": {"max_tokens": 0}}), "invalid_params", "job-1"),
    (entry({**JOB, "params": {"n": True}}), "wrong_type", "job-1"),
])
def test_bad_entries_are_protocol_errors_with_a_code(fields: dict[bytes, bytes], code: str,
                                                      job_id: str | None) -> None:
    with pytest.raises(ProtocolError) as exc:
        decode_job_entry(fields)
    assert (exc.value.code, exc.value.job_id) == (code, job_id)


def test_oversized_payload_is_rejected_before_decoding() -> None:
    big = entry({**JOB, "prompt": "x" * 2000})
    with pytest.raises(ProtocolError) as exc:
        decode_job_entry(big, max_job_bytes=1000)
    size = len(big[b"job"])
    assert (exc.value.code, exc.value.message, exc.value.job_id) == (
        "too_large", f"job payload is {size} bytes, over the limit of 1000", JOB["id"])


@pytest.mark.parametrize("payload, job_id", [
    ({"model": "tiny", "prompt": "x" * 2000, "id": "late-id"}, "late-id"),  # (not first)
    ({"id": "a b", "prompt": "x" * 2000}, None),  # not a valid id: no reply key
    ({"prompt": "x" * 2000}, None),
    (["id", "x" * 2000], None),  # not a map
])
def test_an_oversized_payload_names_its_job_when_it_can(payload: object,
                                                        job_id: str | None) -> None:
    """Read without decoding the rest: the worker can answer on the job's reply stream."""
    with pytest.raises(ProtocolError) as exc:
        decode_job_entry({b"v": b"2", b"job": msgpack.packb(payload)}, max_job_bytes=1000)
    assert (exc.value.code, exc.value.job_id) == ("too_large", job_id)


def test_a_producer_can_check_the_encoded_size_before_enqueueing() -> None:
    spec = dataclasses.replace(GOOD, prompt=None, prompt_token_ids=list(range(1000, 3000)))
    payload = encode_job_entry(spec)["job"]
    size = len(payload)
    with pytest.raises(ProtocolError) as exc:
        check_job_bytes(spec.id, payload, Limits(max_job_bytes=size - 1))
    assert (exc.value.code, exc.value.message, exc.value.job_id) == (
        "limit_exceeded", f"the job is {size} bytes encoded, over the cap of {size - 1}",
        "job-1")
    check_job_bytes(spec.id, payload, Limits(max_job_bytes=size))  # at the cap: fine


@pytest.mark.parametrize("lag, pending, length, waiting", [
    (7, 3, 10, 7),  # Redis knows
    (None, 3, 10, 7),  # Redis cannot tell: the stream less what is held
    (None, 3, 2, 0),  # (trimmed below the pending count: none waits)
])
def test_waiting_entries_from_the_group_lag_or_the_stream_length(
        lag: int | None, pending: int, length: int, waiting: int) -> None:
    assert waiting_entries(lag, pending, length) == waiting


def test_a_reply_entry_without_its_event_field_is_a_protocol_error() -> None:
    assert decode_reply_entry({b"e": encode_event(started_event(1, "w"))}) == \
        started_event(1, "w")
    with pytest.raises(ProtocolError) as exc:
        decode_reply_entry({b"x": b"1", b"y": b"2"})
    assert (exc.value.code, exc.value.message) == (
        "missing_field", "a reply entry needs the field 'e' (it has x, y)")


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from([b"v", b"job", b"a", b"x"]), st.binary(max_size=64)))
def test_random_bytes_never_crash_decoding(fields: dict[bytes, bytes]) -> None:
    try:
        decode_job_entry(fields)
    except ProtocolError:
        pass


_leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(),
                  st.text(max_size=8), st.binary(max_size=8))
_values = st.recursive(_leaf, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                      st.dictionaries(st.text(max_size=8), inner,
                                                                      max_size=4)), max_leaves=12)


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(st.sampled_from(list(JOB) + ["prompt_token_ids", "zzz"]), _values))
def test_random_job_maps_never_crash_decoding(job: dict[str, object]) -> None:
    try:
        spec, _ = decode_job_entry(entry(job))
    except ProtocolError:
        return
    assert spec.id == job["id"]


@pytest.mark.parametrize("params, message", [
    ({"max_tokens": 2**64}, "params.max_tokens = 18446744073709551616 is out of range"),
    ({"n": -(2**63) - 1}, "params.n = -9223372036854775809 is out of range"),
    ({"top_k": 10**30}, "params.top_k = 1000000000000000000000000000000 is out of range"),
    ({"min_p": 10**400}, "params.min_p = 1000000000"),  # (float() of it overflows)
    ({"stop_token_ids": [1, 2**64]}, "params.stop_token_ids must be list of int"),
])
def test_integers_the_wire_cannot_carry_are_protocol_errors(params: dict[str, object],
                                                             message: str) -> None:
    with pytest.raises(ProtocolError) as exc:
        check_job_spec(dataclasses.replace(GOOD, params=params))
    assert (exc.value.code, exc.value.job_id) == ("wrong_type", "job-1")
    assert exc.value.message.startswith(message)


def test_caps_are_limit_errors() -> None:
    limits = Limits(max_prompt_bytes=10, max_tokens=8, max_n=2, max_prompt_tokens=3)
    cases = [
        dataclasses.replace(GOOD, prompt="x" * 11),
        dataclasses.replace(GOOD, prompt=None, prompt_token_ids=[1, 2, 3, 4]),
        dataclasses.replace(GOOD, params={"max_tokens": 9}),
        dataclasses.replace(GOOD, params={"n": 3}),
        dataclasses.replace(GOOD, params={"stop": ["s"] * 17}),
    ]
    for spec in cases:
        with pytest.raises(ProtocolError) as exc:
            check_limits(spec, limits)
        assert (exc.value.code, exc.value.job_id) == ("limit_exceeded", "job-1")
    check_limits(dataclasses.replace(GOOD, params={"max_tokens": 8, "n": 2}), limits)
    check_limits(dataclasses.replace(GOOD, params={"max_tokens": None}), limits)  # (the cap)


def test_events_round_trip() -> None:
    events = [started_event(1, "w1"), tokens_event(1, 0, 3, [4, 5], "ab", [[[4, -0.5]]]),
              tokens_event(1, 1, 0, [2 ** 64 - 1], "\u00e9"),
              done_event(1, [{"index": 0, "token_ids": [4], "text": "a", "finish_reason": "stop",
                              "cumulative_logprob": -1.0}], {"prompt_tokens": 2}, {"total_s": 1.0}),
              error_event(2, "cancelled", "cancelled by the client")]
    assert [decode_event(encode_event(e)) for e in events] == events


@pytest.mark.parametrize("event, code", [
    ({"type": "bogus", "attempt": 1}, "wrong_type"),
    ({"type": [1], "attempt": 1}, "wrong_type"),  # (unhashable)
    ({"type": {"a": 1}, "attempt": 1}, "wrong_type"),
    ({"type": "started", "attempt": 1}, "missing_field"),
    ({"type": "started", "attempt": 1, "worker": "w", "x": 1}, "unknown_field"),
    ({"type": "tokens", "attempt": 1, "index": 0, "pos": 0, "token_ids": ["a"], "text": ""},
     "wrong_type"),
    # (tokens events take a fast path first: what it lets through, check_map would have)
    ({"type": "tokens", "attempt": 1, "index": True, "pos": 0, "token_ids": [], "text": ""},
     "wrong_type"),
    ({"type": "tokens", "attempt": 1, "index": 0, "pos": 0.0, "token_ids": [], "text": ""},
     "wrong_type"),
    ({"type": "tokens", "attempt": 1, "index": 0, "pos": 0, "token_ids": [1, False],
      "text": ""}, "wrong_type"),
    ({"type": "tokens", "attempt": 1, "index": 0, "pos": 0, "token_ids": [], "text": b"x"},
     "wrong_type"),
    ({"type": "tokens", "attempt": 1, "index": 0, "pos": 0, "token_ids": [], "text": "",
      "logprobs": {}}, "wrong_type"),
    ({"type": "tokens", "attempt": 1, "index": 0, "pos": 0, "token_ids": []}, "missing_field"),
    ({"type": "tokens", "attempt": 1, "index": 0, "pos": 0, "token_ids": [], "text": "",
      "more": 1}, "unknown_field"),
    ({"type": "tokens", "attempt": 1, "index": 0, "pos": 0, "token_ids": [2 ** 64 - 1],
      "text": "", "logprobs": None}, "wrong_type"),
])
def test_bad_events_are_protocol_errors(event: dict[str, object], code: str) -> None:
    with pytest.raises(ProtocolError) as exc:
        decode_event(msgpack.packb(event))
    assert exc.value.code == code


def feed_all(events: list[dict[str, object]]) -> list[dict[str, object]]:
    dedupe = ReplyDeduper()
    return [out for e in events for out in dedupe.feed(e)]


def tok(attempt: int, pos: int, ids: list[int], text: str, index: int = 0) -> dict[str, object]:
    return tokens_event(attempt, index, pos, ids, text)


def test_replay_delivers_each_position_once() -> None:
    seen = feed_all([started_event(1, "a"), tok(1, 0, [1], "a"), tok(1, 1, [2], "b"),
                     started_event(2, "b"), tok(2, 0, [1], "a"), tok(2, 1, [2], "b"),
                     tok(2, 2, [3], "c"), tok(1, 2, [9], "z"),
                     done_event(2, [], {}, {})])
    tokens = [(e["pos"], e["token_ids"], e["text"]) for e in seen if e["type"] == "tokens"]
    assert tokens == [(0, [1], "a"), (1, [2], "b"), (2, [3], "c")]
    assert [e["type"] for e in seen] == ["started", "tokens", "tokens", "started", "tokens",
                                         "done"]


def test_replay_chunk_overlapping_delivered_yields_only_the_suffix() -> None:
    seen = feed_all([tok(1, 0, [1, 2], "ab"), tok(2, 0, [1], "a"), tok(2, 1, [2, 3], "bc")])
    assert [(e["pos"], e["token_ids"], e["text"]) for e in seen] == [(0, [1, 2], "ab"),
                                                                     (2, [3], "c")]


def test_retried_write_within_an_attempt_is_dropped() -> None:
    seen = feed_all([tok(1, 0, [1], "a"), tok(1, 0, [1], "a"), tok(1, 1, [2], "b")])
    assert [e["pos"] for e in seen] == [0, 1]


def test_divergent_replay_yields_restart_then_the_new_tokens() -> None:
    seen = feed_all([tok(1, 0, [1], "a"), tok(1, 1, [2], "b"), tok(2, 0, [1], "a"),
                     tok(2, 1, [7], "q")])
    assert [e["type"] for e in seen] == ["tokens", "tokens", "restart", "tokens"]
    assert (seen[-1]["pos"], seen[-1]["token_ids"], seen[-1]["text"]) == (0, [1, 7], "aq")


def test_first_terminal_ends_the_stream() -> None:
    seen = feed_all([error_event(1, "cancelled", "x"), tok(1, 0, [1], "a"),
                     error_event(1, "other", "y")])
    assert [e["type"] for e in seen] == ["error"]


def test_producer_never_imports_torch_or_engine() -> None:
    code = ("import sys, producer, producer.cli, producer.client, producer.async_client; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'engine', 'cupy', 'transformers', 'worker')); print(bad)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"


def test_text_only_the_done_event_carries_comes_as_a_last_chunk_without_tokens() -> None:
    done = done_event(1, [{"index": 0, "token_ids": [1, 2], "text": "abcd"},
                          {"index": 1, "token_ids": [3], "text": "x"},
                          {"index": 2, "token_ids": [4], "text": "never streamed"}], {}, {})
    seen = feed_all([tok(1, 0, [1], "a"), tok(1, 1, [2], "b"), tok(1, 0, [3], "x", index=1),
                     done])
    assert [(e["type"], e.get("index"), e.get("pos"), e.get("token_ids"), e.get("text"))
            for e in seen] == [("tokens", 0, 0, [1], "a"), ("tokens", 0, 1, [2], "b"),
                               ("tokens", 1, 0, [3], "x"), ("tokens", 0, 2, [], "cd"),
                               ("done", None, None, None, None)]


class _PlainDeduper(ReplyDeduper):
    """The deduper's rules with no fast path (every event through the general algorithm)."""

    fast_path = False


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 3), st.integers(0, 1), st.integers(0, 6),
                          st.lists(st.integers(0, 3), min_size=0, max_size=3)),
                min_size=1, max_size=40))
def test_the_fast_path_delivers_exactly_what_the_general_rules_do(raw) -> None:
    # Attempts that move forward and back, retried and overlapping chunks, gaps, divergence.
    events = [tok(attempt, pos, ids, "".join(chr(97 + t) for t in ids), index)
              for attempt, index, pos, ids in raw]
    plain = _PlainDeduper()
    fast = ReplyDeduper()
    for event in events:
        assert fast.feed(dict(event)) == plain.feed(dict(event))
        assert (fast._current, fast._delivered) == (plain._current, plain._delivered)
