"""Job ids and the names that become parts of Redis keys: what is valid, and what an id genq
makes tells about its job (its model and its queue shard), so its keys are found from the id."""

from __future__ import annotations

import re
import uuid

from producer.errors import ProtocolError

MAX_NAME_LEN = 128
_NAME_RE = re.compile(r"[A-Za-z0-9_.:-]+")


def validate_name(value: object, what: str = "job id") -> str:
    """A name that may become part of a Redis key: 1..128 chars of [A-Za-z0-9_.:-]."""
    if not isinstance(value, str):
        raise ProtocolError("bad_id", f"{what} must be a string, got {type(value).__name__}")
    if not 1 <= len(value) <= MAX_NAME_LEN or not _NAME_RE.fullmatch(value):
        raise ProtocolError("bad_id", f"{what} {value[:MAX_NAME_LEN]!r} must be 1-{MAX_NAME_LEN} "
                                      "characters from [A-Za-z0-9_.:-]")
    return value


# Ids genq makes: "<model>.<32 hex digits>", ".<shard>" after it for a job of shard 1..999 of
# its model (--shards), and "-<k>" after that for the k-th job of one gateway request. The model
# and shard in the id are what find its keys' slot from the id alone.
_MADE_ID_RE = re.compile(r"(?P<model>[A-Za-z0-9_.:-]+)\.[0-9a-f]{32}"
                         r"(?:\.(?P<shard>[1-9][0-9]{0,2}))?(?:-[0-9]+)?")
_MADE_ID_TAIL = 1 + 32 + 4 + 8  # ".<hex>", room for ".<shard>" and "-<k>"
MAX_SHARDS = 1000


def new_job_id(model: str, shard: int = 0) -> str:
    """A fresh job id that names its model (and its shard), so `Client.job(id)` and
    `cancel(id)` find its keys without being told the model. A model name too long to fit gets
    a bare id (its jobs are found with model=..., in shard 0)."""
    hex_part = uuid.uuid4().hex
    if len(model) + _MADE_ID_TAIL > MAX_NAME_LEN:
        return hex_part
    if not 0 <= shard < MAX_SHARDS:
        raise ValueError(f"shard must be in [0, {MAX_SHARDS}), got {shard}")
    return f"{validate_name(model, 'model name')}.{hex_part}" + (f".{shard}" if shard else "")


def job_shard(job_id: str) -> int:
    """The shard of its model's queue a job went to: the one its id names, else 0."""
    made = _MADE_ID_RE.fullmatch(job_id)
    return int(made["shard"]) if made is not None and made["shard"] else 0


def job_model(job_id: str) -> str:
    """The model a job id names (new_job_id); ValueError when it names none."""
    made = _MADE_ID_RE.fullmatch(job_id)
    if made is None:
        raise ValueError(f"job id {job_id[:MAX_NAME_LEN]!r} does not name its model (ids genq "
                         "makes do: <model>.<hex>); pass model=... to find its job")
    return made["model"]
