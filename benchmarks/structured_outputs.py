"""Structured outputs: output tokens/s with none, half and all requests JSON-schema constrained,
side by side in one process; and the schema compile time, cold and cached.

    python -m benchmarks.structured_outputs [--requests 256] [--max-tokens 48] [--rounds 2]
        [--overlap auto|on|off]

The demo model (models/genq-tiny-stdlib, a 4-layer Llama, vocabulary 4096). Every request is
greedy with --max-tokens output tokens, all submitted at once; a constrained one follows one of 8
array-of-objects schemas long enough that it ends at the cap too, so every mix generates the
same number of tokens and tokens/s compares the steps themselves. One engine runs the three
mixes per round, in an order that rotates each round, after a warm-up round, with the garbage
collector tuned as `genq worker` tunes it. Wall-clock tokens/s (the target: all constrained at
least 0.85 of none) and tokens per CPU-second of this process (the masks' thread included).
The masks are made while the model runs where the engine does so by default (a core its torch
threads leave over: --overlap auto), or as --overlap says.
Compile: the 40 schemas of tests/engine/test_structured_outputs.py, each compiled on a fresh
cache (cold: grammar check + matcher build), then looked up again (cached). --json writes the
figures.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
MIXES = ("none", "half", "all")


def schema(k: int) -> dict[str, Any]:
    item = {"type": "object", "additionalProperties": False, "required": ["id", "name"],
            "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 10 ** (k % 4 + 1)},
                           "name": {"type": "string", "maxLength": 4 + k}}}
    return {"type": "array", "items": item, "minItems": 40}


def one_round(engine: Any, prompts: list[str], mix: str, max_tokens: int,
              tag: str) -> dict[str, Any]:
    from engine.sampling_params import SamplingParams

    plain = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start, cpu = time.perf_counter(), time.process_time()
    for i, prompt in enumerate(prompts):
        constrained = mix == "all" or (mix == "half" and i % 2 == 0)
        params = SamplingParams(temperature=0, max_tokens=max_tokens,
                                structured_outputs={"json": schema(i % 8)}) \
            if constrained else plain
        engine.add_request(f"{tag}-{i}", prompt, params)
    num_out = 0
    while engine.has_unfinished():
        for out in engine.step():
            num_out += sum(len(c.token_ids) for c in out.outputs)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    return {"wall_s": wall, "cpu_s": cpu, "output_tokens": num_out,
            "output_tokens_per_s": num_out / wall, "output_tokens_per_cpu_s": num_out / cpu}


def compile_times(engine: Any) -> dict[str, float]:
    from engine.grammar import _checked_grammar, grammar_of
    from engine.sampling_params import StructuredOutputsParams
    from engine.structured_outputs import StructuredOutputs
    from tests.harness.schemas import SCHEMAS

    start = time.perf_counter()
    fresh = StructuredOutputs(engine.tokenizer, engine.vocab_size, engine.eos_token_ids)
    fresh.compiler.ll_tokenizer()
    tokenizer_s = time.perf_counter() - start
    cold, cached = [], []
    for k, s in enumerate(SCHEMAS):
        spec = StructuredOutputsParams(json={**s, "title": f"bench-{k}"})  # (never seen)
        _checked_grammar.cache_clear()
        start = time.perf_counter()
        fresh.compiler.compile(grammar_of(spec)).result()
        cold.append(time.perf_counter() - start)
        start = time.perf_counter()
        fresh.compiler.compile(grammar_of(spec)).result()
        cached.append(time.perf_counter() - start)
    return {"tokenizer_s": tokenizer_s, "cold_ms_mean": 1000 * statistics.fmean(cold),
            "cold_ms_max": 1000 * max(cold), "cached_ms_mean": 1000 * statistics.fmean(cached)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: on a shared machine more threads than free "
                             "cores turn every OpenMP barrier into a wait)")
    parser.add_argument("--overlap", choices=("auto", "on", "off"), default="auto",
                        help="make the masks on a thread of their own while the model runs "
                             "(auto: as the engine decides, where a core is left over)")
    parser.add_argument("--model", default=str(REPO / "models" / "genq-tiny-stdlib"))
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    from engine.config import EngineConfig
    from engine.engine import Engine

    engine = Engine(EngineConfig(model=args.model, num_threads=args.threads,
                                 num_gpu_blocks_override=4096, swap_space=0.01,
                                 max_num_seqs=args.requests, max_num_batched_tokens=4096,
                                 output_kind="delta", stream_text=False))
    if args.overlap != "auto":
        engine.structured.overlap = args.overlap == "on"
    args.overlap = engine.structured.overlap
    from worker.main import tune_gc

    tune_gc()  # (as the worker does once its engine is loaded)
    rng = random.Random(0)
    words = ["def", "import", "class", "return", "for", "x =", "print(", "if"]
    prompts = [" ".join(rng.choice(words) for _ in range(rng.randint(2, 8)))
               for _ in range(args.requests)]
    rounds: list[dict[str, dict[str, Any]]] = []
    for r in range(args.rounds + 1):  # round 0 warms up (and compiles the 8 schemas)
        order = MIXES[r % 3:] + MIXES[: r % 3]
        row = {mix: one_round(engine, prompts, mix, args.max_tokens, f"r{r}{mix}")
               for mix in order}
        if r:
            rounds.append(row)
    compiles = compile_times(engine)
    report(rounds, compiles, args)
    if args.json:
        Path(args.json).write_text(json.dumps({"rounds": rounds, "compile": compiles}, indent=2))
    return 0


def report(rounds: list[dict[str, dict[str, Any]]], compiles: dict[str, float],
           args: argparse.Namespace) -> None:
    print(f"{args.requests} greedy requests, {args.max_tokens} output tokens each, "
          f"{args.threads} torch threads{', masks overlapping the model' if args.overlap else ''}")
    print("| round | constrained | output tokens | output tok/s | vs none | tok per CPU-s "
          "| vs none |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for i, row in enumerate(rounds, 1):
        base = row["none"]["output_tokens_per_s"]
        base_cpu = row["none"]["output_tokens_per_cpu_s"]
        for mix in MIXES:
            f = row[mix]
            print(f"| {i} | {mix} | {f['output_tokens']:,} | {f['output_tokens_per_s']:,.0f} | "
                  f"{f['output_tokens_per_s'] / base:.2f} | "
                  f"{f['output_tokens_per_cpu_s']:,.0f} | "
                  f"{f['output_tokens_per_cpu_s'] / base_cpu:.2f} |")
    for mix in MIXES[1:]:
        medians = [statistics.median(row[mix][key] / row["none"][key] for row in rounds)
                   for key in ("output_tokens_per_s", "output_tokens_per_cpu_s")]
        print(f"{mix} constrained vs none, median: output tok/s {medians[0]:.2f}, tokens per "
              f"CPU-second {medians[1]:.2f}")
    print(f"compile (40 schemas): llguidance tokenizer "
          f"{compiles['tokenizer_s'] * 1000:.0f} ms once per worker; cold mean "
          f"{compiles['cold_ms_mean']:.1f} ms (max {compiles['cold_ms_max']:.1f}); cached "
          f"{compiles['cached_ms_mean'] * 1000:.0f} us")


if __name__ == "__main__":
    raise SystemExit(main())
