"""Prefix caching on vs off: the same requests sharing a long system prompt, in one process.

    python -m benchmarks.prefix_caching [--requests 256] [--system 320] [--rounds 3]

The tests' tiny random Llama (2 layers, hidden 64, 512 positions; tests/harness/models.py). Each
request is one system prompt of --system random tokens plus a distinct suffix of 8-32 random
tokens, greedy, --max-tokens output tokens, all submitted at once. Two engines with the same
configuration but enable_prefix_caching, rounds alternating between them (the order flips each
round) so both see the same machine; each round starts from an empty cache (Engine.abort_all)
and a new set of suffixes, after a warm-up round each. Prints prefill tokens computed, output
tokens/s and time to first token (from the burst's submission), and the ratios; --json writes
the figures.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.chart import save_bars


def workload(num: int, system_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(3, 400) for _ in range(system_len)]  # (the same in every round)
    rng = random.Random(seed * 1000 + num)
    return [system + [rng.randrange(3, 400) for _ in range(rng.randint(8, 32))]
            for _ in range(num)]


def one_round(engine: Any, prompts: list[list[int]], max_tokens: int, tag: str) -> dict[str, Any]:
    from engine.sampling_params import SamplingParams

    engine.abort_all()  # an empty cache: the round's first requests compute the system prompt
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    before = engine.stats()
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    first: dict[str, float] = {}
    outputs: dict[str, list[int]] = {f"{tag}-{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:  # (delta outputs: each step's new tokens)
            if out.outputs and out.outputs[0].token_ids:
                first.setdefault(out.request_id, now)
                outputs[out.request_id] += out.outputs[0].token_ids
    wall = time.perf_counter() - start
    after = engine.stats()
    ttft = sorted((t - start) * 1000 for t in first.values())
    prompt_tokens = after["num_prompt_tokens"] - before["num_prompt_tokens"]
    cached = after["num_cached_tokens"] - before["num_cached_tokens"]
    num_out = sum(len(t) for t in outputs.values())
    return {"wall_s": wall, "prompt_tokens": prompt_tokens, "cached_tokens": cached,
            "prefill_tokens_computed": prompt_tokens - cached, "output_tokens": num_out,
            "output_tokens_per_s": num_out / wall,
            "ttft_ms_mean": statistics.fmean(ttft), "ttft_ms_p50": ttft[len(ttft) // 2],
            "ttft_ms_p90": ttft[int(len(ttft) * 0.9)],
            "outputs": [outputs[f"{tag}-{i}"] for i in range(len(prompts))]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--system", type=int, default=320, help="system prompt tokens")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", default=None, help="model dir (default: the tiny Llama)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.system + 32 + args.max_tokens > 512 and args.model is None:
        parser.error("the tiny Llama has 512 positions: lower --system or --max-tokens")

    from benchmarks.fleet_vs_celery import tiny_model
    from engine.config import EngineConfig
    from engine.engine import Engine

    with tempfile.TemporaryDirectory(prefix="genq-bench-") as tmp:
        model = Path(args.model) if args.model else tiny_model(Path(tmp))
        engines = {on: Engine(EngineConfig(
            model=str(model), block_size=args.block_size, num_threads=args.threads,
            num_gpu_blocks_override=8192, swap_space=0.01, max_num_seqs=256,
            max_num_batched_tokens=2048, output_kind="delta", enable_prefix_caching=on))
            for on in (False, True)}
        rounds: list[dict[bool, dict[str, Any]]] = []
        for r in range(args.rounds + 1):  # round 0 warms both up
            prompts = workload(args.requests, args.system, seed=r + 1)
            order = (False, True) if r % 2 else (True, False)
            row = {on: one_round(engines[on], prompts, args.max_tokens, f"r{r}")
                   for on in order}
            if row[True].pop("outputs") != row[False].pop("outputs"):
                raise SystemExit("prefix caching changed the greedy outputs")
            if r:
                rounds.append(row)
    report(rounds, args)
    save_bars("prefix_caching", "output tokens/s, median of rounds", [
        (label, statistics.median(row[on]["output_tokens_per_s"] for row in rounds))
        for label, on in (("genq, prefix caching on", True), ("prefix caching off", False))],
        title=f"{args.requests} requests sharing a {args.system}-token system prompt")
    if args.json:
        Path(args.json).write_text(json.dumps(
            [{"off": row[False], "on": row[True]} for row in rounds], indent=2))
    return 0


def report(rounds: list[dict[bool, dict[str, Any]]], args: argparse.Namespace) -> None:
    print(f"{args.requests} requests: a {args.system}-token system prompt + 8-32 distinct "
          f"tokens each, {args.max_tokens} greedy output tokens, block size {args.block_size}")
    print("| round | prefix caching | prefill tokens computed | cached | output tok/s "
          "| TTFT mean / p50 / p90 ms | wall s |")
    print("|---|---|---:|---:|---:|---|---:|")
    for i, row in enumerate(rounds, 1):
        for on in (False, True):
            f = row[on]
            print(f"| {i} | {'on' if on else 'off'} | {f['prefill_tokens_computed']:,} | "
                  f"{f['cached_tokens']:,} | {f['output_tokens_per_s']:,.0f} | "
                  f"{f['ttft_ms_mean']:.0f} / {f['ttft_ms_p50']:.0f} / {f['ttft_ms_p90']:.0f} | "
                  f"{f['wall_s']:.2f} |")

    def ratios(key: str, invert: bool = False) -> str:
        values = [row[False][key] / row[True][key] if invert
                  else row[True][key] / row[False][key] for row in rounds]
        median = statistics.median(values)
        return ", ".join(f"{v:.2f}x" for v in values) + f" (median {median:.2f}x)"

    print(f"prefill tokens computed, off / on: {ratios('prefill_tokens_computed', True)}")
    print(f"output tokens/s, on / off: {ratios('output_tokens_per_s')}")
    print(f"TTFT mean, off / on: {ratios('ttft_ms_mean', True)}")
    print(f"TTFT p90, off / on: {ratios('ttft_ms_p90', True)}")


if __name__ == "__main__":
    raise SystemExit(main())
