"""Speculative decoding vs none: the demo model completing code from Python's stdlib.

    python -m benchmarks.speculative [--batches 1,8,64] [--rounds 2] [--max-tokens 128]

The demo model (models/genq-tiny-stdlib, 4 layers, hidden 128) continues prompts cut from the
running Python's stdlib sources (--prompt-tokens tokens each, from random .py files), greedy,
--max-tokens output tokens with ignore_eos. Three engines with the same configuration: no
speculation, n-gram (prompt lookup, k=4, n-grams of 1-4 tokens) and a draft model (the demo
model's first 2 of its 4 layers, k=3); both speculating ones with disable_by_batch_size
--disable-above. At each batch size the requests run --batch at a time; the engines take turns
(the order rotates each round) so all see the same machine, after a warm-up round. Prints output
tokens/s, the ratio to no speculation and the acceptance rate; outputs must be identical.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "models" / "genq-tiny-stdlib"
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
         "prompt_lookup_min": 1}


def stdlib_prompts(tokenizer: Any, num: int, num_tokens: int, seed: int) -> list[list[int]]:
    """`num` prompts of `num_tokens` tokens, each a window of a random stdlib module that
    starts at a line."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    rng = random.Random(seed)
    prompts: list[list[int]] = []
    while len(prompts) < num:
        lines = rng.choice(files).read_text(errors="replace").splitlines(keepends=True)
        if len(lines) < 200:
            continue
        start = rng.randrange(len(lines) - 150)
        ids = tokenizer("".join(lines[start:start + 150]))["input_ids"]
        if len(ids) >= num_tokens:
            prompts.append(ids[:num_tokens])
    return prompts


def one_round(engine: Any, prompts: list[list[int]], batch: int,
              max_tokens: int) -> dict[str, Any]:
    from engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    before = engine.stats()
    outputs: list[list[int]] = []
    start = time.perf_counter()
    for first in range(0, len(prompts), batch):
        ids = [f"b{first}-{i}" for i in range(len(prompts[first:first + batch]))]
        for request_id, prompt in zip(ids, prompts[first:first + batch]):
            engine.add_request(request_id, prompt, params)
        done: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for out in engine.step(finished_only=True):
                done[out.request_id] = list(out.outputs[0].token_ids)
        outputs += [done[i] for i in ids]
    wall = time.perf_counter() - start
    after = engine.stats()
    draft = after.get("spec_decode_num_draft_tokens", 0) - before.get(
        "spec_decode_num_draft_tokens", 0)
    accepted = after.get("spec_decode_num_accepted_tokens", 0) - before.get(
        "spec_decode_num_accepted_tokens", 0)
    num_out = sum(map(len, outputs))
    return {"wall_s": wall, "output_tokens": num_out, "output_tokens_per_s": num_out / wall,
            "draft_tokens": draft, "accepted_tokens": accepted,
            "acceptance_rate": accepted / draft if draft else None, "outputs": outputs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--requests", type=int, default=None,
                        help="requests per batch size (default: 4 at batch 1, else the batch)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--disable-above", type=int, default=8,
                        help="disable_by_batch_size of the speculating engines")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]

    from engine.config import EngineConfig
    from engine.engine import Engine
    from tests.harness.models import build_truncated

    with tempfile.TemporaryDirectory(prefix="genq-bench-") as tmp:
        draft = build_truncated(DEMO, Path(tmp) / "draft", 2)
        limit = {"disable_by_batch_size": args.disable_above}
        configs = {"none": None, "ngram": {**NGRAM, **limit},
                   "draft": {"model": str(draft), "num_speculative_tokens": 3, **limit}}
        engines = {name: Engine(EngineConfig(
            model=str(DEMO), num_threads=args.threads, num_gpu_blocks_override=4096,
            swap_space=0.01, speculative_config=spec)) for name, spec in configs.items()}
        tokenizer = engines["none"].tokenizer
        results: dict[int, list[dict[str, dict[str, Any]]]] = {}
        for batch in batches:
            num = args.requests or (4 if batch == 1 else batch)
            results[batch] = []
            for r in range(args.rounds + 1):  # round 0 warms up
                prompts = stdlib_prompts(tokenizer, num, args.prompt_tokens, seed=r + 1)
                names = list(configs)
                order = names[r % 3:] + names[:r % 3]
                row = {name: one_round(engines[name], prompts, batch, args.max_tokens)
                       for name in order}
                expected = row["none"].pop("outputs")
                for name in ("ngram", "draft"):
                    if row[name].pop("outputs") != expected:
                        raise SystemExit(f"{name} speculation changed the greedy outputs")
                if r:
                    results[batch].append(row)
            report(batch, results[batch])
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


def report(batch: int, rounds: list[dict[str, dict[str, Any]]]) -> None:
    print(f"batch {batch}:")
    print("| speculation | output tok/s per round | vs none (median) | acceptance rate |")
    print("|---|---|---:|---:|")
    for name in ("none", "ngram", "draft"):
        speeds = [row[name]["output_tokens_per_s"] for row in rounds]
        ratio = statistics.median(row[name]["output_tokens_per_s"]
                                  / row["none"]["output_tokens_per_s"] for row in rounds)
        draft = sum(row[name]["draft_tokens"] for row in rounds)
        accepted = sum(row[name]["accepted_tokens"] for row in rounds)
        rate = f"{accepted / draft:.2f}" if draft else "off"
        print(f"| {name} | {', '.join(f'{s:,.0f}' for s in speeds)} | {ratio:.2f}x | {rate} |")


if __name__ == "__main__":
    raise SystemExit(main())
