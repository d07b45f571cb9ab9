"""Chat jobs on the wire: `messages` decoding, one prompt form per job, the byte cap, clients."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest

from producer.client import make_job_spec
from producer.limits import Limits, check_limits
from producer.protocol import (
    JobSpec,
    ProtocolError,
    check_job_spec,
    decode_job_entry,
    encode_job_entry,
)

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def main("}]
BASE: dict[str, object] = {"id": "job-1", "model": "tiny", "params": {"temperature": 0}}


def entry(job: dict[str, object]) -> dict[bytes, bytes]:
    return {b"v": b"2", b"job": msgpack.packb(job)}


def error_of(job: dict[str, object]) -> tuple[str, str, str | None]:
    with pytest.raises(ProtocolError) as err:
        decode_job_entry(entry(job))
    return err.value.code, err.value.message, err.value.job_id


def test_a_chat_job_round_trips_through_the_wire() -> None:
    spec = JobSpec(id="job-1", model="tiny", messages=CHAT, params={"temperature": 0},
                   created=2.5)
    fields = encode_job_entry(spec)
    assert msgpack.unpackb(fields["job"])["messages"] == CHAT
    assert "prompt" not in msgpack.unpackb(fields["job"])
    assert "prompt_token_ids" not in msgpack.unpackb(fields["job"])
    decoded, attempt_base = decode_job_entry(fields)
    assert (decoded, attempt_base) == (spec, 0)
    assert decoded.messages == CHAT and decoded.prompt is None
    assert decoded.prompt_token_ids is None


def test_old_prompt_jobs_still_decode_with_no_messages() -> None:
    spec, _ = decode_job_entry(entry({**BASE, "prompt": "hello"}))
    assert (spec.prompt, spec.prompt_token_ids, spec.messages) == ("hello", None, None)
    spec, _ = decode_job_entry(entry({**BASE, "prompt_token_ids": [1, 2, 3]}))
    assert (spec.prompt, spec.prompt_token_ids, spec.messages) == (None, [1, 2, 3], None)


@pytest.mark.parametrize("given", [
    {},
    {"prompt": "hi", "messages": CHAT},
    {"prompt_token_ids": [1], "messages": CHAT},
    {"prompt": "hi", "prompt_token_ids": [1], "messages": CHAT},
])
def test_a_job_carries_exactly_one_of_prompt_token_ids_and_messages(
        given: dict[str, object]) -> None:
    code, message, job_id = error_of({**BASE, **given})
    assert (code, job_id) == ("missing_field", "job-1")
    assert message.startswith("a job needs exactly one of 'prompt', 'prompt_token_ids' and "
                              f"'messages' (got {len(given)}")


@pytest.mark.parametrize(("messages", "code", "message"), [
    ("hi", "wrong_type", "job field 'messages' must be list of maps, got str"),
    ({"role": "user"}, "wrong_type", "job field 'messages' must be list of maps, got dict"),
    ([], "bad_prompt", "the chat has no messages"),
    (["hi"], "wrong_type", "messages[0] must be a map with 'role' and 'content', got str"),
    ([{"role": "user", "content": "a"}, {"role": "user"}], "missing_field",
     "messages[1] needs the field 'content'"),
    ([{"content": "a"}], "missing_field", "messages[0] needs the field 'role'"),
    ([{"role": 1, "content": "a"}], "wrong_type", "messages[0].role must be str, got int"),
    ([{"role": "user", "content": None}], "wrong_type",
     "messages[0].content must be str, got NoneType"),
    ([{"role": "user", "content": [{"type": "text", "text": "a"}]}], "wrong_type",
     "messages[0].content must be str, got list"),
    ([{"role": "", "content": "a"}], "wrong_type", "messages[0].role is empty"),
    ([{"role": "user", "content": "a", "name": "bob"}], "unknown_field",
     "messages[0] has unknown field(s): name; a message has only 'role' and 'content'"),
])
def test_malformed_messages_are_a_clear_error_naming_the_message(
        messages: object, code: str, message: str) -> None:
    assert error_of({**BASE, "messages": messages}) == (code, message, "job-1")


def test_check_limits_caps_the_total_bytes_of_message_contents() -> None:
    limits = Limits(max_prompt_bytes=10)
    at_cap = JobSpec(id="j", model="tiny", messages=[{"role": "system", "content": "héllo"},
                                                      {"role": "user", "content": "worl"}])
    check_limits(at_cap, limits)  # 6 + 4 = 10 bytes (é is two); roles do not count
    over = dataclasses.replace(at_cap, messages=[{"role": "user", "content": "worl"},
                                                 {"role": "user", "content": "héllo!"}])
    with pytest.raises(ProtocolError) as err:
        check_limits(over, limits)
    assert (err.value.code, err.value.message, err.value.job_id) == (
        "limit_exceeded", "the messages' contents are 11 bytes in all, over the prompt cap of 10",
        "j")


def test_make_job_spec_takes_messages_instead_of_a_prompt() -> None:
    spec = make_job_spec(None, {"temperature": 0}, "tiny", "chat-1", None, True, messages=CHAT)
    assert (spec.id, spec.prompt, spec.prompt_token_ids, spec.messages, spec.seed) == (
        "chat-1", None, None, CHAT, None)
    assert check_job_spec(spec) == spec
    with pytest.raises(ValueError, match="exactly one of a prompt"):
        make_job_spec("hi", None, "tiny", None, None, True, messages=CHAT)
    with pytest.raises(ValueError, match="exactly one of a prompt"):
        make_job_spec(None, None, "tiny", None, None, True)
    with pytest.raises(ProtocolError, match=r"messages\[0\]\.content must be str, got int"):
        make_job_spec(None, None, "tiny", None, None, True,
                      messages=[{"role": "user", "content": 5}])  # type: ignore[dict-item]
