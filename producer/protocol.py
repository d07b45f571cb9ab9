"""The genq wire protocol: the ONE definition of key names, job entries and reply events.

Everything that crosses Redis is MessagePack (never pickle) and is decoded strictly: an unknown
field, a wrong type, a missing field, an oversized payload or an id outside [A-Za-z0-9_.:-] is a
`ProtocolError` with a code and a message a person can act on, never a crash.

Keys (prefix configurable, default "genq"): producer/keys.py.

Job entry field `a` (optional) is the number of attempts that ran before this entry was (re-)added,
so attempt numbers keep increasing when a draining worker hands a job back.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack

from producer.errors import ProtocolError
from producer.job_ids import MAX_NAME_LEN as MAX_NAME_LEN
from producer.job_ids import MAX_SHARDS as MAX_SHARDS
from producer.job_ids import job_model as job_model
from producer.job_ids import job_shard as job_shard
from producer.job_ids import new_job_id as new_job_id
from producer.job_ids import validate_name as validate_name
from producer.job_params import check_messages, check_params
from producer.keys import CONSUMER_GROUP as CONSUMER_GROUP
from producer.keys import DEFAULT_PREFIX as DEFAULT_PREFIX
from producer.keys import Keys as Keys
from producer.wire_types import Check
from producer.wire_types import is_bool as _is_bool
from producer.wire_types import is_int as _is_int
from producer.wire_types import is_num as _is_num
from producer.wire_types import is_str as _is_str
from producer.wire_types import is_uint64 as _is_uint64
from producer.wire_types import list_of as _list_of
from producer.wire_types import opt as _opt
from producer.wire_types import pack as _pack

PROTOCOL_VERSION = 2
REPLY_FIELD = "e"
DEFAULT_MAX_JOB_BYTES = 1 << 20
DEFAULT_MAX_EVENT_BYTES = 64 << 20


# --------------------------------------------------------------------------- queues

def waiting_entries(lag: object, pending: int, length: int) -> int:
    """Jobs in a model's stream no worker has read yet: the group's `lag` (XINFO GROUPS), or,
    when Redis cannot tell (nil: an entry after the oldest pending one was deleted, as every
    finished entry is), the stream's length less the pending entries (finished entries are
    deleted, so the stream holds just the waiting and the held)."""
    if isinstance(lag, int):
        return lag
    return max(0, length - pending)


# --------------------------------------------------------------------------- jobs

@dataclass(frozen=True)
class JobSpec:
    """One generation job as it travels in the job stream."""

    id: str
    model: str
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict[str, str]] | None = None  # chat: the worker applies the chat template
    params: dict[str, Any] = field(default_factory=dict)
    seed: int | None = None
    created: float = 0.0
    deadline: float | None = None
    stream: bool = True
    priority: int = 0  # lower is sooner (vLLM's meaning); on the wire only when not 0
    # The prompt plus max_tokens must fit the model's context, else the job is refused
    # (context_length_exceeded, OpenAI's rule: the gateway sets it); False: the engine stops at
    # the context with finish_reason "length".
    fit_context: bool = False

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"id": self.id, "model": self.model, "params": self.params,
                                "seed": self.seed, "created": self.created,
                                "deadline": self.deadline, "stream": self.stream}
        if self.prompt is not None:
            wire["prompt"] = self.prompt
        if self.prompt_token_ids is not None:
            wire["prompt_token_ids"] = self.prompt_token_ids
        if self.messages is not None:
            wire["messages"] = self.messages
        if self.priority:
            wire["priority"] = self.priority
        if self.fit_context:
            wire["fit_context"] = True
        return wire


PRIORITY_LIMIT = 2**31
_JOB_FIELDS: dict[str, tuple[Check, str]] = {
    "id": (_is_str, "str"),
    "model": (_is_str, "str"),
    "prompt": (_is_str, "str"),
    "prompt_token_ids": (_list_of(_is_uint64), "list of int"),
    "messages": (lambda v: isinstance(v, list), "list of maps"),
    "params": (lambda v: isinstance(v, dict), "map"),
    "seed": (_opt(_is_uint64), "int in [0, 2**63) or None"),
    "created": (_is_num, "number"),
    "deadline": (_opt(_is_num), "number or None"),
    "stream": (_is_bool, "bool"),
    "priority": (lambda v: _is_int(v) and -PRIORITY_LIMIT <= v < PRIORITY_LIMIT,  # type: ignore
                 "int in [-2**31, 2**31)"),
    "fit_context": (_is_bool, "bool"),
}
_REQUIRED_JOB_FIELDS = ("id", "model", "params")


def check_job_spec(spec: JobSpec) -> JobSpec:
    """What a producer checks before enqueueing (the worker checks the same on decode), and that
    its text can travel at all: MessagePack strings are UTF-8, which a lone surrogate is not."""
    wire = spec.to_wire()
    checked = _job_from_map(wire)
    try:
        _pack(wire)  # encodes every string as UTF-8 in C, cheaply; the walk below names the bad one
    except UnicodeEncodeError:
        _check_text(wire, "", checked.id)
        raise
    except (OverflowError, ValueError, TypeError) as exc:  # (the checks above should catch all)
        raise ProtocolError("wrong_type", f"the job cannot be encoded: {exc}"[:300],
                            checked.id) from None
    return checked


def _check_text(value: object, where: str, job_id: str) -> None:
    """Every string in `value` (keys too) encodes as UTF-8, or a ProtocolError names it."""
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError as exc:
            bad = value[exc.start:exc.end]
            raise ProtocolError("bad_text", f"{where or 'a name'} is not valid Unicode text: "
                                f"it holds the lone surrogate {bad!r} at character "
                                f"{exc.start} (half a UTF-16 pair, which UTF-8 cannot "
                                "encode)", job_id) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_text(key, where, job_id)
            _check_text(item, f"{where}.{key}" if where else str(key), job_id)
    elif isinstance(value, list):
        for k, item in enumerate(value):
            _check_text(item, f"{where}[{k}]", job_id)


def encode_job_entry(spec: JobSpec, attempt_base: int = 0) -> dict[str, bytes]:
    """The fields of one job-stream entry."""
    fields = {"v": str(PROTOCOL_VERSION).encode(), "job": _pack(spec.to_wire())}
    if attempt_base:
        fields["a"] = str(attempt_base).encode()
    return fields


def attempt_base(fields: Mapping[bytes, bytes] | Mapping[str, bytes]) -> int | None:
    """The entry field 'a' (attempts before a hand-back re-added the job): 0 when absent, None
    when it is not a small integer."""
    raw = next((v for k, v in fields.items() if as_str(k) == "a"), None)
    if raw is None:
        return 0
    a = as_str(raw)
    if not (a.isascii() and a.isdigit()) or len(a) > 9:  # ('²'.isdigit(): int() refuses)
        return None
    return int(a)


def decode_job_entry(fields: Mapping[bytes, bytes] | Mapping[str, bytes],
                     max_job_bytes: int = DEFAULT_MAX_JOB_BYTES) -> tuple[JobSpec, int]:
    """Strictly decode one job-stream entry -> (spec, attempt_base). Raises ProtocolError."""
    raw: dict[str, bytes | str] = {as_str(k): v for k, v in fields.items()}
    unknown = sorted(set(raw) - {"v", "job", "a"})
    if unknown:
        raise ProtocolError("unknown_field", f"unknown entry field(s): {', '.join(unknown)}")
    if "v" not in raw or "job" not in raw:
        raise ProtocolError("missing_field", "a job entry needs the fields 'v' and 'job'")
    if as_str(raw["v"]) != str(PROTOCOL_VERSION):
        raise ProtocolError("bad_version", f"protocol version {as_str(raw['v'])[:20]!r} is not "
                            f"supported (this worker speaks {PROTOCOL_VERSION})")
    base = attempt_base(fields)
    if base is None:
        raise ProtocolError("wrong_type", f"entry field 'a' must be a small integer, got "
                            f"{as_str(raw['a'])!r}")
    payload = raw["job"]
    if isinstance(payload, str):
        payload = payload.encode()
    if len(payload) > max_job_bytes:
        raise ProtocolError("too_large", f"job payload is {len(payload)} bytes, over the limit of "
                            f"{max_job_bytes}", _peek_id(payload))
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises a zoo of types on garbage
        raise ProtocolError("malformed", f"job payload is not valid MessagePack: "
                            f"{type(exc).__name__}: {exc}"[:300]) from None
    if not isinstance(obj, dict):
        raise ProtocolError("wrong_type", f"job payload must be a map, got {type(obj).__name__}")
    return _job_from_map(obj), base


def _peek_id(payload: bytes) -> str | None:
    """The valid id of a job payload too large to decode, read without decoding the rest (the
    other entries of its map are skipped, in C): the reply key of its too_large error. None
    when the payload does not start as a job map or its id is not valid."""
    try:
        unpacker = msgpack.Unpacker(raw=False, max_buffer_size=len(payload))
        unpacker.feed(payload)
        for _ in range(min(unpacker.read_map_header(), len(_JOB_FIELDS))):
            if unpacker.unpack() == "id":  # (first, as producers write it)
                return validate_name(unpacker.unpack())
            unpacker.skip()
    except Exception:  # not a map, truncated, a bad id: no reply key to be had
        return None
    return None


def _job_from_map(obj: dict[Any, Any]) -> JobSpec:
    job_id = obj.get("id")
    valid_id: str | None = None
    try:
        valid_id = validate_name(job_id)
    except ProtocolError as exc:
        raise ProtocolError("bad_id", str(exc)) from None
    unknown = sorted(str(k) for k in obj if k not in _JOB_FIELDS)
    if unknown:
        raise ProtocolError("unknown_field", f"unknown job field(s): {', '.join(unknown)}",
                            valid_id)
    for name in _REQUIRED_JOB_FIELDS:
        if name not in obj:
            raise ProtocolError("missing_field", f"job field {name!r} is required", valid_id)
    for name, value in obj.items():
        check, kind = _JOB_FIELDS[name]
        if not check(value):
            raise ProtocolError("wrong_type", f"job field {name!r} must be {kind}, "
                                f"got {type(value).__name__}", valid_id)
    try:
        validate_name(obj["model"], "model name")
    except ProtocolError as exc:
        raise ProtocolError("unknown_model", str(exc), valid_id) from None
    given = [name for name in ("prompt", "prompt_token_ids", "messages") if name in obj]
    if len(given) != 1:
        raise ProtocolError("missing_field", "a job needs exactly one of 'prompt', "
                            f"'prompt_token_ids' and 'messages' (got {len(given)}"
                            f"{': ' + ', '.join(given) if given else ''})", valid_id)
    if (obj.get("prompt") == "") or ("prompt_token_ids" in obj and not obj["prompt_token_ids"]):
        raise ProtocolError("bad_prompt", "the prompt is empty", valid_id)
    messages = None if "messages" not in obj else check_messages(obj["messages"], valid_id)
    return JobSpec(id=valid_id, model=obj["model"], prompt=obj.get("prompt"),
                   prompt_token_ids=obj.get("prompt_token_ids"), messages=messages,
                   params=check_params(obj["params"], valid_id), seed=obj.get("seed"),
                   created=float(obj.get("created", 0.0)),
                   deadline=None if obj.get("deadline") is None else float(obj["deadline"]),
                   stream=obj.get("stream", True), priority=obj.get("priority", 0),
                   fit_context=obj.get("fit_context", False))


# --------------------------------------------------------------------------- heartbeat

def encode_heartbeat(info: dict[str, Any]) -> bytes:
    return _pack(info)


def decode_heartbeat(data: bytes) -> dict[str, Any]:
    try:
        info = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:
        raise ProtocolError("malformed", f"heartbeat is not valid MessagePack: {exc}") from None
    if not isinstance(info, dict):
        raise ProtocolError("wrong_type", "a heartbeat must be a map")
    return info


# --------------------------------------------------------------------------- submit

# Idempotent enqueue: the job id's idem key is set NX; only the first submit of an id adds an
# entry. The stream's TTL is refreshed by producers and by live workers' heartbeats.
# KEYS: idem key, jobs stream. ARGV: idem ttl, v, job payload, stream ttl.
SUBMIT_LUA = """
if redis.call('SET', KEYS[1], '1', 'NX', 'EX', ARGV[1]) then
  local id = redis.call('XADD', KEYS[2], '*', 'v', ARGV[2], 'job', ARGV[3])
  redis.call('EXPIRE', KEYS[2], ARGV[4])
  return id
end
return false
"""


def as_str(value: bytes | str) -> str:
    """A Redis reply's bytes (ids, names, fields) as text; str passes through."""
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return value
