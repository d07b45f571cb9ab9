"""The genq wire protocol: the ONE definition of key names, job entries and reply events.

Everything that crosses Redis is MessagePack (never pickle) and is decoded strictly: an unknown
field, a wrong type, a missing field, an oversized payload or an id outside [A-Za-z0-9_.:-] is a
`ProtocolError` with a code and a message a person can act on, never a crash.

Keys (prefix configurable, default "genq"; {m} is the hash tag of the job's model, so a model's
keys share one Redis Cluster slot):
    <p>:jobs:{m}            stream of job entries, consumer group "workers"; fields v, job [, a]
    <p>:dead:{m}            dead-letter stream: fields reason, code, entry, worker [, job]
    <p>:reply:{m}:<id>      reply stream of one job; field e = one event
    <p>:cancel:{m}:<id>     cancel flag (with TTL) + an SPUBLISH of <id> on channel <p>:cancel:{m}
    <p>:idem:{m}:<id>       idempotency key set by submit (a job id runs once): "1", then "ended"
                            from the job's terminal event on (its TTL kept; producer.results)
    <p>:worker:{m}:<name>   heartbeat of one worker (value: msgpack map, short TTL)
    <p>:worker:{m}          set of the names of the model's workers (the registry)
    <p>:worker:models       set of the served models
    <p>:fence:{m}:<name>    a worker's fence counter (worker/scripts.py)

Job entry field `a` (optional) is the number of attempts that ran before this entry was (re-)added,
so attempt numbers keep increasing when a draining worker hands a job back.
"""

from __future__ import annotations

import json
import math
import re
import threading
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack

PROTOCOL_VERSION = 2
DEFAULT_PREFIX = "genq"
CONSUMER_GROUP = "workers"
REPLY_FIELD = "e"
_REPLY_FIELD_BYTES = REPLY_FIELD.encode()
MAX_NAME_LEN = 128
DEFAULT_MAX_JOB_BYTES = 1 << 20
DEFAULT_MAX_EVENT_BYTES = 64 << 20
_INT64_MAX = 2**63 - 1
_NAME_RE = re.compile(r"[A-Za-z0-9_.:-]+")

EVENT_TYPES = ("started", "tokens", "done", "error")
TERMINAL_EVENT_TYPES = ("done", "error")


class ProtocolError(ValueError):
    """A payload or name that does not follow the wire protocol.

    `code` is machine-readable (e.g. "unknown_field"); `job_id` is set when the payload's id was
    itself valid, so a worker can answer on that job's reply stream.
    """

    def __init__(self, code: str, message: str, job_id: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.job_id = job_id


def validate_name(value: object, what: str = "job id") -> str:
    """A name that may become part of a Redis key: 1..128 chars of [A-Za-z0-9_.:-]."""
    if not isinstance(value, str):
        raise ProtocolError("bad_id", f"{what} must be a string, got {type(value).__name__}")
    if not 1 <= len(value) <= MAX_NAME_LEN or not _NAME_RE.fullmatch(value):
        raise ProtocolError("bad_id", f"{what} {value[:MAX_NAME_LEN]!r} must be 1-{MAX_NAME_LEN} "
                                      "characters from [A-Za-z0-9_.:-]")
    return value


# Ids genq makes: "<model>.<32 hex digits>", and "-<k>" after it for the k-th job of one gateway
# request. The model in the id is what finds its keys' slot from the id alone.
_MADE_ID_RE = re.compile(r"(?P<model>[A-Za-z0-9_.:-]+)\.[0-9a-f]{32}(?:-[0-9]+)?")
_MADE_ID_TAIL = 1 + 32 + 8  # ".<hex>" and room for "-<k>"


def new_job_id(model: str) -> str:
    """A fresh job id that names its model, so `Client.job(id)` and `cancel(id)` find its keys
    without being told the model. A model name too long to fit gets a bare id (its jobs are
    found with model=...)."""
    hex_part = uuid.uuid4().hex
    if len(model) + _MADE_ID_TAIL > MAX_NAME_LEN:
        return hex_part
    return f"{validate_name(model, 'model name')}.{hex_part}"


def job_model(job_id: str) -> str:
    """The model a job id names (new_job_id); ValueError when it names none."""
    made = _MADE_ID_RE.fullmatch(job_id)
    if made is None:
        raise ValueError(f"job id {job_id[:MAX_NAME_LEN]!r} does not name its model (ids genq "
                         "makes do: <model>.<hex>); pass model=... to find its job")
    return made["model"]


@dataclass(frozen=True)
class Keys:
    """Every Redis key and channel genq uses, built from validated names only.

    Each key of a queue carries the hash tag of its model, `{<model>}`: a job's stream, its
    dead letters, its workers' heartbeats and fence counters, and the reply, cancel and idem
    keys of every job sent to it live in one Redis Cluster slot, so every script and every
    multi-key command touches one slot. The kind comes first (`genq:reply:{tiny}:<id>`), so an
    ACL pattern per kind (`~genq:reply:*`) still covers all models.

    A job's keys need its model: the one a call names, else `model` (a worker's keys: the
    model it serves), else the one its id names (ids genq makes name it: `new_job_id`)."""

    prefix: str = DEFAULT_PREFIX
    model: str | None = None

    def __post_init__(self) -> None:
        validate_name(self.prefix, "key prefix")
        if self.model is not None:
            validate_name(self.model, "model name")

    @property
    def group(self) -> str:
        return CONSUMER_GROUP

    @property
    def models(self) -> str:
        """The set of model names workers serve(d): what `genq status` and the gateway look
        through instead of a SCAN (which sees one node of a cluster). Under worker: so the
        workers' ACL key pattern covers it."""
        return f"{self.prefix}:worker:models"

    def _queue(self, kind: str, model: str) -> str:
        return f"{self.prefix}:{kind}:{{{validate_name(model, 'model name')}}}"

    def jobs(self, model: str) -> str:
        return self._queue("jobs", model)

    def dead(self, model: str) -> str:
        return self._queue("dead", model)

    def workers(self, model: str) -> str:
        """The set of worker names that served `model` (each beat adds its own; reclaim drops
        the gone ones): the per-model registry. A name's heartbeat is `worker(model, name)`."""
        return self._queue("worker", model)

    def worker(self, model: str, name: str) -> str:
        return f"{self.workers(model)}:{validate_name(name, 'worker name')}"

    def fence_prefix(self, model: str) -> str:
        """Followed by a worker name: a counter bumped whenever pending entries of `model`'s
        stream are claimed from that worker (worker/scripts.py)."""
        return self._queue("fence", model) + ":"

    def fence(self, model: str, name: str) -> str:
        return self.fence_prefix(model) + validate_name(name, "worker name")

    def cancel_channel(self, model: str) -> str:
        """The shard channel (SPUBLISH) on which cancels of `model`'s jobs are announced: it
        lives on the node of the model's slot."""
        return self._queue("cancel", model)

    def reply(self, job_id: str, model: str | None = None) -> str:
        return self._job("reply", job_id, model)

    def cancel(self, job_id: str, model: str | None = None) -> str:
        return self._job("cancel", job_id, model)

    def idem(self, job_id: str, model: str | None = None) -> str:
        return self._job("idem", job_id, model)

    def _job(self, kind: str, job_id: str, model: str | None) -> str:
        validate_name(job_id)
        return f"{self._queue(kind, model or self.model or job_model(job_id))}:{job_id}"

    @property
    def batches(self) -> str:
        """A sorted set of the gateway's batch ids, scored by creation time."""
        return f"{self.prefix}:batches"

    @property
    def batches_active(self) -> str:
        """The set of batch ids not ended yet (what gateways look through to take over)."""
        return f"{self.prefix}:batches:active"

    def batch(self, batch_id: str) -> str:
        return f"{self.prefix}:batch:{validate_name(batch_id, 'batch id')}"

    def batch_lease(self, batch_id: str) -> str:
        """Held (SET NX PX, renewed) by the gateway process that drives the batch."""
        return f"{self.prefix}:batch-lease:{validate_name(batch_id, 'batch id')}"

    def file(self, file_id: str) -> str:
        return f"{self.prefix}:file:{validate_name(file_id, 'file id')}"


# --------------------------------------------------------------------------- type checks

Check = Callable[[object], bool]


def waiting_entries(lag: object, pending: int, length: int) -> int:
    """Jobs in a model's stream no worker has read yet: the group's `lag` (XINFO GROUPS), or,
    when Redis cannot tell (nil: an entry after the oldest pending one was deleted, as every
    finished entry is), the stream's length less the pending entries (finished entries are
    deleted, so the stream holds just the waiting and the held)."""
    if isinstance(lag, int):
        return lag
    return max(0, length - pending)


def _is_int(v: object) -> bool:
    """An int MessagePack can carry (a 64-bit one): larger ones fail to encode."""
    return isinstance(v, int) and not isinstance(v, bool) and -2**63 <= v < 2**64


def _is_num(v: object) -> bool:
    if isinstance(v, float):
        return math.isfinite(v)
    return _is_int(v)  # (every 64-bit int is a finite float)


def _is_big_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and not _is_int(v)


def _opt(check: Check) -> Check:
    return lambda v: v is None or check(v)


def _list_of(check: Check) -> Check:
    return lambda v: isinstance(v, list) and all(check(x) for x in v)


def _is_uint64(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= _INT64_MAX


def _is_bool(v: object) -> bool:
    return isinstance(v, bool)


def _is_str(v: object) -> bool:
    return isinstance(v, str)


_GRAMMAR_KINDS = {"json": lambda v: isinstance(v, (dict, str)), "regex": _is_str,
                  "choice": _list_of(_is_str), "grammar": _is_str, "json_object": _is_bool}


def _is_structured(v: object) -> bool:
    """{"json": schema} or {"regex" | "grammar": str} or {"choice": [str]} or
    {"json_object": true}: exactly one (the engine checks the grammar itself)."""
    return (isinstance(v, dict) and len(v) == 1 and next(iter(v)) in _GRAMMAR_KINDS
            and _GRAMMAR_KINDS[next(iter(v))](next(iter(v.values()))))


def _is_logit_bias(v: object) -> bool:
    """Token id -> bias: keys are the ids' digits (JSON's form, all MessagePack maps here take:
    check_params turns int keys into them)."""
    return isinstance(v, dict) and all(
        (_is_uint64(k) or (isinstance(k, str) and k.isascii() and k.isdigit())) and _is_num(b)
        for k, b in v.items())


# The SamplingParams fields (engine/sampling_params.py) and the wire types each accepts. The engine
# does the full value validation; this table lets a producer fail fast without importing the engine
# (a test holds it equal to the engine's dataclass fields).
SAMPLING_PARAM_CHECKS: dict[str, tuple[Check, str]] = {
    "n": (_is_int, "int"),
    "best_of": (_opt(_is_int), "int or None"),
    "temperature": (_is_num, "number"),
    "top_p": (_is_num, "number"),
    "top_k": (_is_int, "int"),
    "min_p": (_is_num, "number"),
    "seed": (_opt(_is_int), "int or None"),
    "max_tokens": (_opt(_is_int), "int or None"),
    "min_tokens": (_is_int, "int"),
    "stop": (lambda v: _is_str(v) or _list_of(_is_str)(v), "str or list of str"),
    "stop_token_ids": (_list_of(_is_int), "list of int"),
    "ignore_eos": (_is_bool, "bool"),
    "logprobs": (_opt(_is_int), "int or None"),
    "presence_penalty": (_is_num, "number"),
    "frequency_penalty": (_is_num, "number"),
    "repetition_penalty": (_is_num, "number"),
    "use_beam_search": (_is_bool, "bool"),
    "length_penalty": (_is_num, "number"),
    "early_stopping": (lambda v: _is_bool(v) or _is_str(v), "bool or str"),
    "include_stop_str_in_output": (_is_bool, "bool"),
    "skip_special_tokens": (_is_bool, "bool"),
    "structured_outputs": (_opt(_is_structured), "a map with one of json (a schema), regex, "
                           "choice (a list of str), grammar, json_object (true)"),
    "logit_bias": (_opt(_is_logit_bias), "a map of token id -> number"),
    "allowed_token_ids": (_opt(_list_of(_is_uint64)), "list of int"),
}
SAMPLING_PARAM_NAMES = frozenset(SAMPLING_PARAM_CHECKS)


def check_params(params: object, job_id: str | None = None) -> dict[str, Any]:
    """Names and wire types of sampling params, plus the few values a producer can judge alone."""
    if not isinstance(params, dict):
        raise ProtocolError("wrong_type", f"params must be a map, got {type(params).__name__}",
                            job_id)
    unknown = sorted(str(k) for k in params if k not in SAMPLING_PARAM_CHECKS)
    if unknown:
        raise ProtocolError("unknown_field", f"unknown sampling parameter(s): {', '.join(unknown)};"
                            f" known: {', '.join(sorted(SAMPLING_PARAM_NAMES))}", job_id)
    for name, value in params.items():
        check, kind = SAMPLING_PARAM_CHECKS[name]
        if not check(value):
            if _is_big_int(value):
                raise ProtocolError("wrong_type", f"params.{name} = {value!r:.80} is out of "
                                    "range: the wire carries 64-bit integers", job_id)
            raise ProtocolError("wrong_type", f"params.{name} must be {kind}, "
                                f"got {type(value).__name__} {value!r:.80}", job_id)
    if params.get("logit_bias"):  # (the wire's maps have str keys; Python callers give ints)
        params["logit_bias"] = {str(k): v for k, v in params["logit_bias"].items()}
    for name in ("n", "max_tokens"):
        if params.get(name) is not None and params[name] < 1:
            raise ProtocolError("invalid_params", f"params.{name} must be at least 1, "
                                f"got {params[name]}", job_id)
    for name, (in_range, what) in _PARAM_RANGES.items():
        if params.get(name) is not None and not in_range(params[name]):
            raise ProtocolError("invalid_params", f"{name} must be {what}, got {params[name]}",
                                job_id)
    return params


# Value ranges a producer can judge alone, in the engine's words (SamplingParams checks the
# same), so a bad value is refused before it is enqueued rather than by a worker.
_PARAM_RANGES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "temperature": (lambda v: v >= 0, ">= 0 (0 means greedy)"),
    "top_p": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "top_k": (lambda v: v >= -1, "-1 or 0 (disable) or at least 1"),
    "min_p": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "min_tokens": (lambda v: v >= 0, ">= 0"),
    "logprobs": (lambda v: 0 <= v <= 20, "in [0, 20]"),
    "presence_penalty": (lambda v: -2 <= v <= 2, "in [-2, 2]"),
    "frequency_penalty": (lambda v: -2 <= v <= 2, "in [-2, 2]"),
    "repetition_penalty": (lambda v: v > 0, "> 0"),
}


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
        _pack(wire)  # encodes every string as UTF-8 in C (~1 us); the walk below names the bad one
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


MESSAGE_FIELDS = ("role", "content")


def check_messages(messages: object, job_id: str | None = None) -> list[dict[str, str]]:
    """A chat: a non-empty list of {"role": str, "content": str} maps, nothing else in them."""
    def bad(message: str) -> ProtocolError:
        return ProtocolError("wrong_type", message, job_id)

    if not isinstance(messages, list):
        raise bad(f"job field 'messages' must be a list of maps, got {type(messages).__name__}")
    if not messages:
        raise ProtocolError("bad_prompt", "the chat has no messages", job_id)
    out: list[dict[str, str]] = []
    for k, message in enumerate(messages):
        if not isinstance(message, dict):
            raise bad(f"messages[{k}] must be a map with 'role' and 'content', got "
                      f"{type(message).__name__}")
        unknown = sorted(str(key) for key in message if key not in MESSAGE_FIELDS)
        if unknown:
            raise ProtocolError("unknown_field", f"messages[{k}] has unknown field(s): "
                                f"{', '.join(unknown)}; a message has only 'role' and "
                                "'content'", job_id)
        for name in MESSAGE_FIELDS:
            if name not in message:
                raise ProtocolError("missing_field", f"messages[{k}] needs the field {name!r}",
                                    job_id)
            if not isinstance(message[name], str):
                raise bad(f"messages[{k}].{name} must be str, got "
                          f"{type(message[name]).__name__}")
        if not message["role"]:
            raise bad(f"messages[{k}].role is empty")
        out.append({"role": message["role"], "content": message["content"]})
    return out


@dataclass(frozen=True)
class Limits:
    """Payload caps a worker (and the gateway, before enqueueing) enforces."""

    max_job_bytes: int = DEFAULT_MAX_JOB_BYTES
    max_prompt_bytes: int = 256 << 10
    max_prompt_tokens: int | None = None  # None: the model's max_model_len decides
    max_tokens: int = 4096
    max_n: int = 16
    max_stop: int = 16
    max_stop_bytes: int = 256
    max_grammar_bytes: int = 64 << 10  # structured_outputs, as compact JSON


def check_limits(spec: JobSpec, limits: Limits) -> None:
    """Raise ProtocolError(code "limit_exceeded") when a job is over a cap."""
    def over(message: str) -> ProtocolError:
        return ProtocolError("limit_exceeded", message, spec.id)

    if spec.prompt is not None and len(spec.prompt.encode()) > limits.max_prompt_bytes:
        raise over(f"prompt is {len(spec.prompt.encode())} bytes, over the cap of "
                   f"{limits.max_prompt_bytes}")
    if spec.messages is not None:
        num_bytes = sum(len(m["content"].encode()) for m in spec.messages)
        if num_bytes > limits.max_prompt_bytes:
            raise over(f"the messages' contents are {num_bytes} bytes in all, over the prompt "
                       f"cap of {limits.max_prompt_bytes}")
    if (limits.max_prompt_tokens is not None and spec.prompt_token_ids is not None
            and len(spec.prompt_token_ids) > limits.max_prompt_tokens):
        raise over(f"prompt has {len(spec.prompt_token_ids)} tokens, over the cap of "
                   f"{limits.max_prompt_tokens}")
    p = spec.params
    # (max_tokens None: as many as the cap and the model's context allow; the worker sets it)
    if (p.get("max_tokens") or 0) > limits.max_tokens:
        raise over(f"max_tokens={p['max_tokens']} is over the cap of {limits.max_tokens}")
    for name in ("n", "best_of"):
        if (p.get(name) or 0) > limits.max_n:
            raise over(f"{name}={p[name]} is over the cap of {limits.max_n}")
    stop = [p["stop"]] if isinstance(p.get("stop"), str) else p.get("stop", [])
    if len(stop) > limits.max_stop or any(len(s.encode()) > limits.max_stop_bytes for s in stop):
        raise over(f"at most {limits.max_stop} stop strings of at most {limits.max_stop_bytes} "
                   "bytes each")
    if len(p.get("stop_token_ids", [])) > limits.max_stop:
        raise over(f"at most {limits.max_stop} stop_token_ids")
    if p.get("structured_outputs") is not None:
        size = len(_json_text(p["structured_outputs"]).encode())
        if size > limits.max_grammar_bytes:
            raise over(f"structured_outputs is {size} bytes (as compact JSON), over the cap of "
                       f"{limits.max_grammar_bytes} (--max-grammar-bytes)")


def _json_text(value: object) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, default=repr)


def check_job_bytes(job_id: str, payload: bytes, limits: Limits) -> None:
    """Raise ProtocolError("limit_exceeded") when a job's encoded payload (encode_job_entry's
    "job") is over limits.max_job_bytes (a producer's check: the worker measures what it reads)."""
    if len(payload) > limits.max_job_bytes:
        raise ProtocolError("limit_exceeded", f"the job is {len(payload)} bytes encoded, over the "
                            f"cap of {limits.max_job_bytes}", job_id)


# --------------------------------------------------------------------------- reply events

def started_event(attempt: int, worker: str) -> dict[str, Any]:
    return {"type": "started", "attempt": attempt, "worker": worker}


def tokens_event(attempt: int, index: int, pos: int, token_ids: list[int], text: str,
                 logprobs: list[list[list[Any]]] | None = None) -> dict[str, Any]:
    event: dict[str, Any] = {"type": "tokens", "attempt": attempt, "index": index, "pos": pos,
                             "token_ids": token_ids, "text": text}
    if logprobs is not None:
        # Per position: [[token_id, logprob, text], ...], the sampled token first, then the
        # top-k; text is the token's text after the tokens before it (what the gateway shows).
        event["logprobs"] = logprobs
    return event


def done_event(attempt: int, outputs: list[dict[str, Any]], usage: dict[str, int],
               timing: dict[str, float]) -> dict[str, Any]:
    return {"type": "done", "attempt": attempt, "outputs": outputs, "usage": usage,
            "timing": timing}


def error_event(attempt: int, code: str, message: str) -> dict[str, Any]:
    return {"type": "error", "attempt": attempt, "code": code, "message": message}


_OUTPUT_FIELDS: dict[str, tuple[Check, str]] = {
    "index": (_is_int, "int"),
    "token_ids": (_list_of(_is_int), "list of int"),
    "text": (_is_str, "str"),
    "finish_reason": (_opt(_is_str), "str or None"),
    "cumulative_logprob": (_opt(_is_num), "number or None"),
    "stop_reason": (lambda v: v is None or _is_int(v) or _is_str(v), "int, str or None"),
    "logprobs": (lambda v: v is None or isinstance(v, list), "list or None"),
}
_EVENT_FIELDS: dict[str, dict[str, tuple[Check, str]]] = {
    "started": {"worker": (_is_str, "str")},
    "tokens": {"index": (_is_int, "int"), "pos": (_is_int, "int"),
               "token_ids": (_list_of(_is_int), "list of int"), "text": (_is_str, "str"),
               "logprobs": (lambda v: isinstance(v, list), "list")},
    "done": {"outputs": (_list_of(lambda o: isinstance(o, dict)), "list of maps"),
             "usage": (lambda v: isinstance(v, dict), "map"),
             "timing": (lambda v: isinstance(v, dict), "map")},
    "error": {"code": (_is_str, "str"), "message": (_is_str, "str")},
}
_OPTIONAL_EVENT_FIELDS = {"logprobs"}


def encode_event(event: dict[str, Any]) -> bytes:
    return _pack(event)


def decode_event(data: bytes, max_bytes: int = DEFAULT_MAX_EVENT_BYTES) -> dict[str, Any]:
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
    if not isinstance(kind, str) or kind not in _EVENT_FIELDS:
        raise ProtocolError("wrong_type", f"unknown event type {kind!r:.40}")
    spec = {"type": (_is_str, "str"), "attempt": (_is_int, "int"), **_EVENT_FIELDS[kind]}
    _check_map(event, spec, f"{kind} event", _OPTIONAL_EVENT_FIELDS)
    if kind == "done":
        for out in event["outputs"]:
            _check_map(out, _OUTPUT_FIELDS, "done output",
                       {"cumulative_logprob", "stop_reason", "logprobs"})
    return event


def decode_reply_entry(fields: Mapping[bytes, bytes]) -> dict[str, Any]:
    """The event of one reply-stream entry (its field 'e'). Raises ProtocolError."""
    data = fields.get(_REPLY_FIELD_BYTES)
    if data is None:
        raise ProtocolError("missing_field", f"a reply entry needs the field {REPLY_FIELD!r} "
                            f"(it has {', '.join(sorted(as_str(k) for k in fields)) or 'none'})")
    return decode_event(data)


def _check_map(obj: dict[Any, Any], spec: dict[str, tuple[Check, str]], what: str,
               optional: set[str] | frozenset[str] = frozenset()) -> None:
    unknown = sorted(str(k) for k in obj if k not in spec)
    if unknown:
        raise ProtocolError("unknown_field", f"unknown {what} field(s): {', '.join(unknown)}")
    for name, (check, kind) in spec.items():
        if name not in obj:
            if name in optional:
                continue
            raise ProtocolError("missing_field", f"{what} field {name!r} is required")
        if not check(obj[name]):
            raise ProtocolError("wrong_type", f"{what} field {name!r} must be {kind}")


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


_PACKERS = threading.local()  # msgpack.packb builds a Packer per call: 4x the cost of packing


def _pack(obj: object) -> bytes:
    packer = getattr(_PACKERS, "packer", None)
    if packer is None:
        packer = _PACKERS.packer = msgpack.Packer(use_bin_type=True)
    data = packer.pack(obj)  # resets itself when packing raises
    assert isinstance(data, bytes)
    return data


def as_str(value: bytes | str) -> str:
    """A Redis reply's bytes (ids, names, fields) as text; str passes through."""
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return value
