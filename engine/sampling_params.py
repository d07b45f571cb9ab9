"""SamplingParams: what one request asks the engine to generate (vLLM's field names)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Literal, get_args

_INT_LIMIT = 2**63 - 1
GrammarKind = Literal["json", "regex", "choice", "grammar", "json_object"]
_GRAMMAR_KINDS: tuple[GrammarKind, ...] = get_args(GrammarKind)
MIN_TEMPERATURE = 0.01  # a positive temperature below this samples at this one (vLLM)


@dataclass
class StructuredOutputsParams:
    """What the output must match (vLLM's names); exactly one is given. `json` is a JSON Schema
    (a map, or its text), `regex` a regular expression the whole output matches, `choice` the
    strings it may be, `grammar` a Lark or GBNF grammar, `json_object` any JSON object."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [k for k in _GRAMMAR_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs takes exactly one of json, regex, choice, "
                             f"grammar, json_object; got {', '.join(given) or 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError("structured_outputs.json must be a JSON Schema (a map or its text)")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of strings")
        if self.json_object not in (None, True):
            raise ValueError("structured_outputs.json_object must be true when given")

    @property
    def kind(self) -> GrammarKind:
        return next(k for k in _GRAMMAR_KINDS if getattr(self, k) not in (None, False))

    def to_dict(self) -> dict[str, Any]:
        return {self.kind: getattr(self, self.kind)}


@dataclass
class SamplingParams:
    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    allowed_token_ids: list[int] | None = None  # only these may be sampled

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = _structured(self.structured_outputs)
        if self.logit_bias is not None:
            self.logit_bias = _logit_bias(self.logit_bias)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = _as_list(self.stop, "stop must be a string or a list of non-empty strings")
        self.stop_token_ids = _as_list(self.stop_token_ids,
                                       "stop_token_ids must be a list of non-negative integers")
        if self.best_of is None:
            self.best_of = self.n
        self._validate()
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            # vLLM's rule: dividing logits by a tinier temperature overflows to inf (NaN
            # probabilities); 0.01 already samples the top token unless others are within ~0.1.
            self.temperature = MIN_TEMPERATURE

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SamplingParams:
        """Build from a plain mapping (the wire form); unknown keys are a ValueError."""
        known = _FIELD_NAMES
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(known))}")
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        if self.structured_outputs is not None:
            data["structured_outputs"] = self.structured_outputs.to_dict()
        return data

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 and not self.use_beam_search

    def _validate(self) -> None:
        _check_type("n", self.n, int)
        _check_type("best_of", self.best_of, int)
        _check_type("top_k", self.top_k, int)
        _check_type("min_tokens", self.min_tokens, int)
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", "length_penalty"):
            _check_type(name, getattr(self, name), (int, float))
            if math.isnan(getattr(self, name)):  # NaN passes every range check below
                raise ValueError(f"{name} must be a number, got nan")
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        assert self.best_of is not None
        if self.best_of < self.n:
            raise ValueError(f"best_of must be >= n, got best_of={self.best_of} and n={self.n}")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:  # (0 disables too, as in vLLM: generation configs say "top_k": 0)
            raise ValueError(f"top_k must be -1 or 0 (disable) or at least 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            _check_type("seed", self.seed, int)
            if not 0 <= self.seed <= _INT_LIMIT:
                raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if self.max_tokens is not None:
            _check_type("max_tokens", self.max_tokens, int)
            if self.max_tokens < 1:
                raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens "
                             f"({self.max_tokens})")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError("stop must be a string or a list of non-empty strings")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be a list of non-negative integers")
        if self.logprobs is not None:
            _check_type("logprobs", self.logprobs, int)
            if not 0 <= self.logprobs <= 20:
                raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.use_beam_search:
            if self.best_of < 2:
                raise ValueError("beam search needs best_of (the beam width) of at least 2")
            if self.temperature != 0.0 and self.temperature != 1.0:
                raise ValueError("beam search is deterministic: leave temperature at 0 or 1")
            if self.early_stopping not in (True, False, "never"):
                raise ValueError("early_stopping must be True, False or 'never'")
            if self.structured_outputs is not None or self.logit_bias or \
                    self.allowed_token_ids is not None:
                raise ValueError("beam search does not take structured_outputs, logit_bias or "
                                 "allowed_token_ids: it ranks the model's own distribution; "
                                 "use sampling (n, best_of) with them instead")
        if self.structured_outputs is not None and \
                not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a map such as {\"json\": {...}}")
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, list) or not ids or not all(
                    isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
                raise ValueError("allowed_token_ids must be a non-empty list of token ids")


_FIELD_NAMES = frozenset(f.name for f in fields(SamplingParams))


def _structured(data: dict[str, Any]) -> StructuredOutputsParams:
    unknown = sorted(str(k) for k in data if k not in _GRAMMAR_KINDS)
    if unknown:
        raise ValueError(f"unknown structured_outputs field(s): {', '.join(unknown)}; known: "
                         f"{', '.join(_GRAMMAR_KINDS)}")
    return StructuredOutputsParams(**data)


def _logit_bias(value: object) -> dict[int, float]:
    """Token id (an int, or its digits as JSON keys carry it) -> a bias in [-100, 100]."""
    if not isinstance(value, dict):
        raise ValueError(f"logit_bias must be a map of token id -> bias, got "
                         f"{type(value).__name__}")
    out: dict[int, float] = {}
    for key, bias in value.items():
        if isinstance(key, str) and key.isascii() and key.isdigit():
            key = int(key)
        if isinstance(key, bool) or not isinstance(key, int) or key < 0:
            raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) \
                or not -100.0 <= bias <= 100.0:
            raise ValueError(f"logit_bias[{key}] must be a number in [-100, 100], got {bias!r}")
        out[key] = float(bias)
    return out


def _as_list(value: object, message: str) -> list[Any]:
    """None (vLLM's default) is an empty list; any other iterable a list of its items."""
    if value is None:
        return []
    try:
        return list(value)  # type: ignore[call-overload]
    except TypeError:
        raise ValueError(f"{message}, got {type(value).__name__} {value!r}") from None


def _check_type(name: str, value: object, kind: type | tuple[type, ...]) -> None:
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ValueError(f"{name} must be of type {getattr(kind, '__name__', kind)}, "
                         f"got {type(value).__name__} {value!r}")
