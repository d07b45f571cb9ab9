"""The wire's type checks, shared by the job entry, the sampling params and the reply events:
predicates for what MessagePack carries, a strict check of one map against a table of fields,
and the packer every payload goes through."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Any

import msgpack

from producer.errors import ProtocolError

Check = Callable[[object], bool]
_INT64_MAX = 2**63 - 1


def is_int(v: object) -> bool:
    """An int MessagePack can carry (a 64-bit one): larger ones fail to encode."""
    return isinstance(v, int) and not isinstance(v, bool) and -2**63 <= v < 2**64


def is_num(v: object) -> bool:
    if isinstance(v, float):
        return math.isfinite(v)
    return is_int(v)  # (every 64-bit int is a finite float)


def is_big_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and not is_int(v)


def opt(check: Check) -> Check:
    return lambda v: v is None or check(v)


def list_of(check: Check) -> Check:
    return lambda v: isinstance(v, list) and all(check(x) for x in v)


def is_uint64(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= _INT64_MAX


def is_bool(v: object) -> bool:
    return isinstance(v, bool)


def is_str(v: object) -> bool:
    return isinstance(v, str)


def check_map(obj: dict[Any, Any], spec: dict[str, tuple[Check, str]], what: str,
              optional: set[str] | frozenset[str] = frozenset()) -> None:
    """`obj` holds only the fields of `spec`, each of its type, and all but the `optional`
    ones; else ProtocolError says which field is wrong and how."""
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


_PACKERS = threading.local()  # one Packer per thread: msgpack.packb builds one on every call


def pack(obj: object) -> bytes:
    packer = getattr(_PACKERS, "packer", None)
    if packer is None:
        packer = _PACKERS.packer = msgpack.Packer(use_bin_type=True)
    data = packer.pack(obj)  # resets itself when packing raises
    assert isinstance(data, bytes)
    return data

