"""The OpenAI wire shapes the gateway speaks: requests in (pydantic), responses and errors out.

Requests map onto genq's sampling params (vLLM's names); fields genq does not implement are a 400
with the field's name, never silently ignored. Fields outside OpenAI's set that are genq sampling
params (top_k, min_p, repetition_penalty, min_tokens, ignore_eos, stop_token_ids, ...) pass
through, so the openai client's `extra_body` reaches the engine.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from producer.job_params import SAMPLING_PARAM_NAMES

# OpenAI fields with a direct genq counterpart (same name, same meaning).
_SHARED = ("n", "temperature", "top_p", "seed", "presence_penalty", "frequency_penalty")
# genq sampling params a request may add beyond OpenAI's set (what vLLM calls extra params).
EXTRA_PARAM_NAMES = SAMPLING_PARAM_NAMES - {"max_tokens", "stop", "logprobs", "best_of", *_SHARED}


class GatewayError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Request(BaseModel):
    # Extra fields are kept so that genq params arrive and unknown ones get a named 400.
    model_config = ConfigDict(extra="allow")

    model: str
    n: int = Field(1, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=-2**63, lt=2**64)  # (any 64-bit int, as vLLM takes)
    priority: int = Field(0, ge=-2**31, lt=2**31)  # vLLM's extra field: lower runs sooner
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None

    @field_validator("n", "temperature", "top_p", "presence_penalty", "frequency_penalty",
                     mode="before")
    @classmethod
    def _null_is_the_default(cls, value: Any, info: ValidationInfo) -> Any:
        """OpenAI takes null for these: the default."""
        return cls.model_fields[info.field_name or ""].default if value is None else value

    @property
    def logprobs_k(self) -> int | None:
        """The engine's `logprobs` (top-k per position) this request asks for; None: none."""
        return None

    def sampling_params(self, max_tokens: int | None) -> dict[str, Any]:
        params: dict[str, Any] = {name: getattr(self, name) for name in _SHARED}
        if self.logit_bias:
            params["logit_bias"] = logit_bias(self.logit_bias)
        if params["seed"] is None:
            del params["seed"]
        else:  # folded into the engine's [0, 2**63): -1 and 2**63 - 1 sample alike
            params["seed"] %= 2**63
        if self.stop is not None:
            params["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if max_tokens is not None:
            params["max_tokens"] = max_tokens
        for name, value in (self.model_extra or {}).items():
            if name not in EXTRA_PARAM_NAMES:
                raise GatewayError(400, f"unknown or unsupported parameter {name!r}", param=name)
            params[name] = value
        if self.response_format is not None:
            grammar = response_format(self.response_format)
            if grammar is not None:
                if "structured_outputs" in params:
                    raise GatewayError(400, "give response_format or structured_outputs, not "
                                       "both", param="response_format")
                params["structured_outputs"] = grammar
        if self.logprobs_k is not None:
            if params.get("use_beam_search"):
                raise GatewayError(400, "logprobs with use_beam_search is not supported: beam "
                                   "search keeps no per-token logprobs", param="logprobs")
            params["logprobs"] = self.logprobs_k
        return params

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


def logit_bias(value: dict[str, float]) -> dict[str, float]:
    """OpenAI's logit_bias: token id (as a JSON key) -> a bias in [-100, 100]."""
    for key, bias in value.items():
        if not (key.isascii() and key.isdigit()):
            raise GatewayError(400, f"logit_bias keys are token ids, got {key!r}",
                               param="logit_bias")
        if not -100.0 <= bias <= 100.0:
            raise GatewayError(400, f"logit_bias[{key}] is {bias}, outside [-100, 100]",
                               param="logit_bias")
    return dict(value)


def response_format(value: dict[str, Any]) -> dict[str, Any] | None:
    """OpenAI's response_format as genq's structured_outputs (None: plain text)."""
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise GatewayError(400, "response_format json_schema needs json_schema.schema, a "
                               "JSON Schema object", param="response_format")
        return {"json": spec["schema"]}  # (strict or not, the output follows the schema)
    raise GatewayError(400, f"response_format.type {kind!r} is not supported: use text, "
                       "json_object or json_schema", param="response_format")


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    best_of: int | None = Field(None, ge=1)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0)
    suffix: str | None = None

    @property
    def logprobs_k(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        """One entry per job: text or token ids."""
        prompt: Any = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and all(isinstance(p, int) for p in prompt):
            return [list(prompt)]
        if not prompt:
            raise GatewayError(400, "the prompt is empty", param="prompt")
        return list(prompt)

    def to_params(self) -> dict[str, Any]:
        if self.suffix is not None:
            raise GatewayError(400, "suffix is not supported by the genq gateway", param="suffix")
        if self.echo and self.logprobs is not None:
            raise GatewayError(400, "echo with logprobs is not supported: it needs the prompt's "
                               "logprobs, which the genq engine does not compute; ask for "
                               "echo or logprobs", param="echo")
        if self.echo and any(not isinstance(p, str) for p in self.prompts()):
            raise GatewayError(400, "echo needs a text prompt: the gateway has no tokenizer to "
                               "turn prompt token ids into text", param="echo")
        params = self.sampling_params(self.max_tokens)
        if self.best_of is not None:
            params["best_of"] = self.best_of
        return params


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise GatewayError(400, "only text content parts are supported",
                                   param="messages")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)

    @property
    def logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def to_params(self) -> dict[str, Any]:
        if self.top_logprobs is not None and not self.logprobs:
            raise GatewayError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        params = self.sampling_params(self.max_completion_tokens or self.max_tokens)
        # Neither given: as long as the model's context (and the worker's cap) allows, as
        # OpenAI and vLLM do for chat; the engine's default would stop at 16 tokens.
        params.setdefault("max_tokens", None)
        return params

    def wire_messages(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


# --------------------------------------------------------------------------- responses

def finish_reason(reason: str | None) -> str | None:
    """Engine finish reasons are OpenAI's for stop and length; anything else passes through."""
    return reason


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_response(response_id: str, model: str, choices: list[dict[str, Any]],
                        usage_: dict[str, int], chat: bool) -> dict[str, Any]:
    return {"id": response_id, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": choices, "usage": usage_}


def choice(index: int, text: str, reason: str | None, chat: bool,
           logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    if chat:
        return {"index": index, "message": {"role": "assistant", "content": text},
                "logprobs": logprobs, "finish_reason": finish_reason(reason)}
    return {"index": index, "text": text, "logprobs": logprobs,
            "finish_reason": finish_reason(reason)}


def chunk(response_id: str, model: str, created: int, index: int, text: str | None,
          reason: str | None, chat: bool, first: bool = False,
          logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """One streamed choice delta (text None: a finish-only chunk)."""
    if chat:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text is not None:
            delta["content"] = text
        body: dict[str, Any] = {"index": index, "delta": delta, "logprobs": logprobs,
                                "finish_reason": finish_reason(reason)}
    else:
        body = {"index": index, "text": text or "", "logprobs": logprobs,
                "finish_reason": finish_reason(reason)}
    return {"id": response_id, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created, "model": model, "choices": [body]}


def usage_chunk(response_id: str, model: str, created: int, usage_: dict[str, int],
                chat: bool) -> dict[str, Any]:
    return {"id": response_id, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created, "model": model, "choices": [], "usage": usage_}
