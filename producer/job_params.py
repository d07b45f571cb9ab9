"""What a job may ask for, checked by producers before enqueueing and by workers on decode:
the sampling params (names, wire types, the ranges a producer can judge alone) and chat
messages."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from producer.errors import ProtocolError
from producer.wire_types import (
    Check,
    is_big_int,
    is_bool,
    is_int,
    is_num,
    is_str,
    is_uint64,
    list_of,
    opt,
)

_GRAMMAR_KINDS = {"json": lambda v: isinstance(v, (dict, str)), "regex": is_str,
                  "choice": list_of(is_str), "grammar": is_str, "json_object": is_bool}


def _is_structured(v: object) -> bool:
    """{"json": schema} or {"regex" | "grammar": str} or {"choice": [str]} or
    {"json_object": true}: exactly one (the engine checks the grammar itself)."""
    return (isinstance(v, dict) and len(v) == 1 and next(iter(v)) in _GRAMMAR_KINDS
            and _GRAMMAR_KINDS[next(iter(v))](next(iter(v.values()))))


def _is_logit_bias(v: object) -> bool:
    """Token id -> bias: keys are the ids' digits (JSON's form, all MessagePack maps here take:
    check_params turns int keys into them)."""
    return isinstance(v, dict) and all(
        (is_uint64(k) or (isinstance(k, str) and k.isascii() and k.isdigit())) and is_num(b)
        for k, b in v.items())


# The SamplingParams fields (engine/sampling_params.py) and the wire types each accepts. The engine
# does the full value validation; this table lets a producer fail fast without importing the engine
# (a test holds it equal to the engine's dataclass fields).
SAMPLING_PARAM_CHECKS: dict[str, tuple[Check, str]] = {
    "n": (is_int, "int"),
    "best_of": (opt(is_int), "int or None"),
    "temperature": (is_num, "number"),
    "top_p": (is_num, "number"),
    "top_k": (is_int, "int"),
    "min_p": (is_num, "number"),
    "seed": (opt(is_int), "int or None"),
    "max_tokens": (opt(is_int), "int or None"),
    "min_tokens": (is_int, "int"),
    "stop": (lambda v: is_str(v) or list_of(is_str)(v), "str or list of str"),
    "stop_token_ids": (list_of(is_int), "list of int"),
    "ignore_eos": (is_bool, "bool"),
    "logprobs": (opt(is_int), "int or None"),
    "presence_penalty": (is_num, "number"),
    "frequency_penalty": (is_num, "number"),
    "repetition_penalty": (is_num, "number"),
    "use_beam_search": (is_bool, "bool"),
    "length_penalty": (is_num, "number"),
    "early_stopping": (lambda v: is_bool(v) or is_str(v), "bool or str"),
    "include_stop_str_in_output": (is_bool, "bool"),
    "skip_special_tokens": (is_bool, "bool"),
    "structured_outputs": (opt(_is_structured), "a map with one of json (a schema), regex, "
                           "choice (a list of str), grammar, json_object (true)"),
    "logit_bias": (opt(_is_logit_bias), "a map of token id -> number"),
    "allowed_token_ids": (opt(list_of(is_uint64)), "list of int"),
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
            if is_big_int(value):
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

