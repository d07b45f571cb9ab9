"""Payload caps a worker enforces on what it reads, and the gateway on what it enqueues: a job
over a cap ends with the error code "limit_exceeded", naming the cap."""

from __future__ import annotations

import json
from dataclasses import dataclass

from producer.errors import ProtocolError
from producer.protocol import DEFAULT_MAX_JOB_BYTES, JobSpec


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

