"""The JSON Schemas structured-output tests and benchmarks/structured_outputs.py constrain to: the
kinds extraction jobs use, seeded, bounded so a small model can finish them."""

from __future__ import annotations

import random


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A JSON Schema of the kinds extraction jobs use, bounded so a model can finish it."""
    kinds = ["object", "array", "enum", "integer", "number", "string", "boolean"]
    kind = rng.choice(kinds[:1] if depth == 0 else kinds if depth < 2 else kinds[2:])
    if kind == "object":
        names = rng.sample(["id", "name", "age", "tags", "score", "ok", "kind", "items"],
                           rng.randint(1, 3))
        props = {n: random_schema(rng, depth + 1) for n in names}
        required = [n for n in names if rng.random() < 0.6]
        return {"type": "object", "properties": props, "required": required,
                "additionalProperties": False}
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1),
                "minItems": rng.randint(0, 1), "maxItems": rng.randint(1, 3)}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "x", "yes", "no"], 3)}
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 100)}
    if kind == "number":
        return {"type": "number", "minimum": 0, "exclusiveMaximum": rng.choice([1, 10, 1000])}
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 8)}
    return {"type": "boolean"}


SCHEMAS = [random_schema(random.Random(k)) for k in range(40)]
