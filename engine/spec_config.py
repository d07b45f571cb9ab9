"""SpeculativeConfig: the engine's speculative_config dict (vLLM's keys), validated once.

Two methods: "ngram" (prompt lookup: the tokens that followed the longest earlier match of the
sequence's last n-gram) and "draft_model" (`model`: a small model directory with the target's
vocabulary; the method is implied by `model`). Either way speculation never changes an output:
verification accepts exactly the tokens plain decoding would draw (engine/spec_decode.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "draft_model")
KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
        "disable_by_batch_size")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int  # the longest n-gram looked up (default 5)
    prompt_lookup_min: int  # the shortest one that may propose (default 1)
    # Speculate only while this many requests or fewer are in the engine (vLLM's "enqueued":
    # running, waiting or swapped); None: always.
    disable_by_batch_size: int | None = None
    model: str | None = None  # the draft model's directory ("draft_model")

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> SpeculativeConfig:
        if not isinstance(config, dict):
            raise ValueError(f"speculative_config must be a dict (e.g. {{'method': 'ngram', "
                             f"'num_speculative_tokens': 4}}), got {type(config).__name__}")
        unknown = sorted(set(config) - set(KEYS))
        if unknown:
            raise ValueError(f"speculative_config has unknown key(s) {unknown}; the keys are "
                             f"{list(KEYS)}")
        model = config.get("model")
        if model is not None and not isinstance(model, str):
            raise ValueError(f"speculative_config 'model' must be a model directory (a "
                             f"string), got {model!r}")
        method = config.get("method", "draft_model" if model else None)
        if method == "draft_model" and not model:
            raise ValueError("speculative_config method 'draft_model' needs 'model': the draft "
                             "model's directory")
        if method == "ngram" and model:
            raise ValueError("speculative_config method 'ngram' takes no 'model' (give "
                             "'model' without 'method' for a draft model)")
        if method not in METHODS:
            raise ValueError(f"speculative_config 'method' must be one of {list(METHODS)}, "
                             f"got {method!r}")
        k = _int(config, "num_speculative_tokens", None)
        if k < 1:
            raise ValueError(f"speculative_config 'num_speculative_tokens' must be at least 1, "
                             f"got {k}")
        hi = _int(config, "prompt_lookup_max", 5)
        lo = _int(config, "prompt_lookup_min", 1)
        if not 1 <= lo <= hi:
            raise ValueError(f"speculative_config needs 1 <= prompt_lookup_min <= "
                             f"prompt_lookup_max, got min {lo} and max {hi}")
        limit = config.get("disable_by_batch_size")
        if limit is not None:
            limit = _int(config, "disable_by_batch_size", None)
            if limit < 1:
                raise ValueError("speculative_config 'disable_by_batch_size' must be at least "
                                 f"1 (or absent: never disabled), got {limit}")
        return cls(method, k, hi, lo, limit, model)


def _int(config: dict[str, Any], key: str, default: int | None) -> int:
    value = config.get(key, default)
    if value is None:
        raise ValueError(f"speculative_config needs {key!r} (an integer)")
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"speculative_config {key!r} must be an integer, got {value!r}")
    return value
