"""Reply events: what a worker writes to a job's reply stream (field "e", one event per entry)
and a client reads back. Each type is a TypedDict built only by its constructor here, and
decoded strictly: an unknown field, a wrong type or a missing field is a ProtocolError.

A job's stream holds, per attempt, a started event, tokens events (each a chunk of one
sequence's output from position `pos` on) and one terminal event (done or error), the last
entry of the stream. A client adds restart events of its own (producer/replies.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, TypedDict

import msgpack

from producer.errors import ProtocolError
from producer.protocol import DEFAULT_MAX_EVENT_BYTES, REPLY_FIELD, as_str
from producer.wire_types import Check, check_map, is_int, is_num, is_str, list_of, opt, pack

EVENT_TYPES = ("started", "tokens", "done", "error")
TERMINAL_EVENT_TYPES = ("done", "error")
_REPLY_FIELD_BYTES = REPLY_FIELD.encode()

# Per position of a tokens event (and a done output): [[token_id, logprob, text], ...], the
# sampled token first, then the top-k; text is the token's text after the tokens before it.
Logprobs = list[list[list[Any]]]


class StartedEvent(TypedDict):
    type: Literal["started"]
    attempt: int
    worker: str


class _TokensFields(TypedDict):
    type: Literal["tokens"]
    attempt: int
    index: int  # the sequence (n > 1 has several)
    pos: int  # the position of token_ids[0] in that sequence's output
    token_ids: list[int]
    text: str  # the text these tokens add


class TokensEvent(_TokensFields, total=False):
    logprobs: Logprobs  # only when the job asked for logprobs


class _OutputFields(TypedDict):
    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None


class Output(_OutputFields, total=False):
    """One sequence's whole output, in a done event."""

    cumulative_logprob: float | None
    stop_reason: int | str | None
    logprobs: Logprobs | None


class DoneEvent(TypedDict):
    type: Literal["done"]
    attempt: int
    outputs: list[Output]
    usage: dict[str, int]
    timing: dict[str, float]


class ErrorEvent(TypedDict):
    type: Literal["error"]
    attempt: int
    code: str
    message: str


class RestartEvent(TypedDict):
    """A client's own event, never on the wire: what was streamed is void, the newest attempt's
    tokens follow from pos 0."""

    type: Literal["restart"]
    attempt: int
    reason: str


Event = StartedEvent | TokensEvent | DoneEvent | ErrorEvent
TerminalEvent = DoneEvent | ErrorEvent
ClientEvent = Event | RestartEvent


def started_event(attempt: int, worker: str) -> StartedEvent:
    return {"type": "started", "attempt": attempt, "worker": worker}


def tokens_event(attempt: int, index: int, pos: int, token_ids: list[int], text: str,
                 logprobs: Logprobs | None = None) -> TokensEvent:
    event: TokensEvent = {"type": "tokens", "attempt": attempt, "index": index, "pos": pos,
                          "token_ids": token_ids, "text": text}
    if logprobs is not None:
        event["logprobs"] = logprobs
    return event


def done_event(attempt: int, outputs: list[Output], usage: dict[str, int],
               timing: dict[str, float]) -> DoneEvent:
    return {"type": "done", "attempt": attempt, "outputs": outputs, "usage": usage,
            "timing": timing}


def error_event(attempt: int, code: str, message: str) -> ErrorEvent:
    return {"type": "error", "attempt": attempt, "code": code, "message": message}


def restart_event(attempt: int, reason: str) -> RestartEvent:
    return {"type": "restart", "attempt": attempt, "reason": reason}


_OUTPUT_FIELDS: dict[str, tuple[Check, str]] = {
    "index": (is_int, "int"),
    "token_ids": (list_of(is_int), "list of int"),
    "text": (is_str, "str"),
    "finish_reason": (opt(is_str), "str or None"),
    "cumulative_logprob": (opt(is_num), "number or None"),
    "stop_reason": (lambda v: v is None or is_int(v) or is_str(v), "int, str or None"),
    "logprobs": (lambda v: v is None or isinstance(v, list), "list or None"),
}
_EVENT_FIELDS: dict[str, dict[str, tuple[Check, str]]] = {
    "started": {"worker": (is_str, "str")},
    "tokens": {"index": (is_int, "int"), "pos": (is_int, "int"),
               "token_ids": (list_of(is_int), "list of int"), "text": (is_str, "str"),
               "logprobs": (lambda v: isinstance(v, list), "list")},
    "done": {"outputs": (list_of(lambda o: isinstance(o, dict)), "list of maps"),
             "usage": (lambda v: isinstance(v, dict), "map"),
             "timing": (lambda v: isinstance(v, dict), "map")},
    "error": {"code": (is_str, "str"), "message": (is_str, "str")},
}
_OPTIONAL_EVENT_FIELDS = {"logprobs"}
_EVENT_SPECS = {kind: {"type": (is_str, "str"), "attempt": (is_int, "int"), **fields}
                for kind, fields in _EVENT_FIELDS.items()}
_TOKENS_KEYS = frozenset(_EVENT_SPECS["tokens"]) - {"logprobs"}
_TOKENS_KEYS_LOGPROBS = frozenset(_EVENT_SPECS["tokens"])


def _plain_tokens_event(event: dict[Any, Any]) -> bool:
    """check_map's verdict on a well-formed tokens event, reached with a few type tests (the
    gateway decodes one per streamed token). MessagePack's ints are all within is_int's range.
    False sends the event through check_map, which names what is wrong."""
    keys = event.keys()
    if keys != _TOKENS_KEYS and keys != _TOKENS_KEYS_LOGPROBS:
        return False
    ids = event["token_ids"]
    return (type(event["attempt"]) is int and type(event["index"]) is int
            and type(event["pos"]) is int and type(event["text"]) is str
            and type(ids) is list and all(type(t) is int for t in ids)
            and type(event.get("logprobs", [])) is list)


def encode_event(event: Event) -> bytes:
    return pack(event)


def decode_event(data: bytes, max_bytes: int = DEFAULT_MAX_EVENT_BYTES) -> Event:
    """Strictly decode one reply event. Raises ProtocolError."""
    if len(data) > max_bytes:
        raise ProtocolError("too_large", f"event is {len(data)} bytes, over {max_bytes}")
    try:
        event = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:
        raise ProtocolError("malformed", f"event is not valid MessagePack: {exc}"[:300]) from None
    if not isinstance(event, dict):
        raise ProtocolError("wrong_type", "an event must be a map")
    kind = event.get("type")
    if kind == "tokens" and _plain_tokens_event(event):
        return event  # type: ignore[return-value]  # (checked: as check_map would)
    if not isinstance(kind, str) or kind not in _EVENT_FIELDS:
        raise ProtocolError("wrong_type", f"unknown event type {kind!r:.40}")
    check_map(event, _EVENT_SPECS[kind], f"{kind} event", _OPTIONAL_EVENT_FIELDS)
    if kind == "done":
        for out in event["outputs"]:
            check_map(out, _OUTPUT_FIELDS, "done output",
                      {"cumulative_logprob", "stop_reason", "logprobs"})
    return event  # type: ignore[return-value]  # (its fields were checked just above)


def decode_reply_entry(fields: Mapping[bytes, bytes]) -> Event:
    """The event of one reply-stream entry (its field 'e'). Raises ProtocolError."""
    data = fields.get(_REPLY_FIELD_BYTES)
    if data is None:
        raise ProtocolError("missing_field", f"a reply entry needs the field {REPLY_FIELD!r} "
                            f"(it has {', '.join(sorted(as_str(k) for k in fields)) or 'none'})")
    return decode_event(data)
