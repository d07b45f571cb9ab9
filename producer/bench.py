"""`genq bench`: round trips through a running fleet, timed by Redis itself.

Every stream entry id starts with the Redis server's clock in ms, so submit -> started and
submit -> done are read from the job entry's id and the reply entries' ids: no client polling
bias. Throughput is jobs / (last done - first submit); over first started -> last done, tokens/s
counts the tokens streamed and token events/s the tokens entries in the reply streams (a worker
that falls behind Redis sends several steps' tokens of a sequence in one entry).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any

from producer.cli import unserved_warning
from producer.client import Client
from producer.events import decode_event
from producer.flags import DefaultsHelpFormatter, add_redis_args
from producer.protocol import REPLY_FIELD


def bench_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="genq bench", description=__doc__,
                                     formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--model", required=True, help="served model name")
    add_redis_args(parser)
    parser.add_argument("--jobs", type=int, default=1000, help="(default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=1, help="(default: %(default)s)")
    parser.add_argument("--prompt", default="the quick brown fox", help="every job's prompt")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--no-stream", action="store_true", help="done events only")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds to wait for all results")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")
    params = {"temperature": 0, "max_tokens": args.max_tokens, "ignore_eos": args.ignore_eos}
    client = Client(args.redis, prefix=args.prefix)
    unserved = unserved_warning(client, args.model)
    if unserved:
        print(f"genq bench: {unserved}", file=sys.stderr)
    figures = run_bench(client, args.model, args.jobs, params, args.prompt, not args.no_stream,
                        args.timeout)
    print_figures(figures)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(figures, out, indent=2)
    return 0 if figures["failed"] == 0 else 1


def run_bench(client: Client, model: str, num_jobs: int, params: dict[str, Any], prompt: str,
              stream: bool, timeout: float) -> dict[str, Any]:
    jobs = []
    for start in range(0, num_jobs, 500):
        count = min(500, num_jobs - start)
        jobs += client.submit_many([prompt] * count, params, model=model, stream=stream)
    # One XREAD over many reply streams, not one per job: the client's CPU is the box's.
    results = client.results(jobs, timeout, return_exceptions=True)
    failed = sum(isinstance(r, Exception) for r in results)
    for job, r in zip(jobs, results, strict=True):
        if isinstance(r, TimeoutError):  # given up on: it must not run later for no one
            client.cancel(job.id)
    reasons: dict[str, int] = {}  # why jobs failed -> how many
    for r in results:
        if isinstance(r, Exception):
            why = f"{type(r).__name__}: {r}"
            reasons[why] = reasons.get(why, 0) + 1
    to_started, to_done, submits, starts, dones = [], [], [], [], []
    token_times: list[tuple[int, int]] = []  # (ms, tokens) of every tokens event
    pipe = client.redis.pipeline(transaction=False)
    for job in jobs:
        pipe.xrange(job.reply_key)
    for job, entries in zip(jobs, pipe.execute(), strict=True):
        submitted = _ms(job.entry_id or "0-0")
        submits.append(submitted)
        for entry_id, fields in entries:
            event = decode_event(fields[REPLY_FIELD.encode()])
            if event["type"] == "started":
                starts.append(_ms(entry_id))
                to_started.append(_ms(entry_id) - submitted)
            elif event["type"] == "tokens":
                token_times.append((_ms(entry_id), len(event["token_ids"])))
            else:
                dones.append(_ms(entry_id))
                to_done.append(_ms(entry_id) - submitted)
    wall_ms = max(max(dones, default=0) - min(submits, default=0), 1)
    gen_ms = max(max(dones, default=0) - min(starts, default=0), 1)
    num_token_events = len(token_times)
    num_tokens = sum(n for _, n in token_times)
    # While every job runs: from the last start to the first end (none when they overlap less
    # than a millisecond).
    first_done, last_start = min(dones, default=0), max(starts, default=0)
    steady = [n for t, n in token_times if last_start <= t <= first_done]
    steady_s = (first_done - last_start) / 1000
    return {"jobs": num_jobs, "failed": failed, "failures": reasons, "params": params,
            "wall_s": wall_ms / 1000,
            "jobs_per_s": len(dones) / (wall_ms / 1000),
            "submit_to_started_ms": _percentiles(to_started),
            "submit_to_done_ms": _percentiles(to_done),
            "token_events": num_token_events,
            "token_events_per_s": num_token_events / (gen_ms / 1000),
            "tokens": num_tokens, "tokens_per_s": num_tokens / (gen_ms / 1000),
            "all_running_s": steady_s,
            "all_running_token_events_per_s": len(steady) / steady_s if steady_s > 0 else None,
            "all_running_tokens_per_s": sum(steady) / steady_s if steady_s > 0 else None}


def print_figures(f: dict[str, Any]) -> None:
    print(f"jobs {f['jobs']} (failed {f['failed']}) in {f['wall_s']:.2f} s: "
          f"{f['jobs_per_s']:.0f} jobs/s")
    failures = sorted(f.get("failures", {}).items(), key=lambda kv: -kv[1])
    for why, count in failures[:5]:
        print(f"  {count} failed: {why[:300]}")
    if len(failures) > 5:
        print(f"  ({len(failures) - 5} more reasons: see --json)")
    for name in ("submit_to_started_ms", "submit_to_done_ms"):
        p = f[name]
        print(f"{name:<22} p50 {p['p50']:.0f}  p99 {p['p99']:.0f}  max {p['max']:.0f}")
    print(f"tokens streamed {f['tokens']}: {f['tokens_per_s']:.0f}/s in {f['token_events']} "
          f"tokens events ({f['token_events_per_s']:.0f}/s)")
    if f["all_running_token_events_per_s"] is not None:
        print(f"while all {f['jobs']} ran ({f['all_running_s']:.2f} s): "
              f"{f['all_running_tokens_per_s']:.0f} tokens/s in "
              f"{f['all_running_token_events_per_s']:.0f} tokens events/s")


def _ms(entry_id: bytes | str) -> int:
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(text.split("-")[0])


def _percentiles(values: list[int]) -> dict[str, float]:
    if not values:
        return {"p50": 0.0, "p99": 0.0, "max": 0.0}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return {"p50": float(statistics.median(ordered)), "p99": float(p99),
            "max": float(ordered[-1])}


if __name__ == "__main__":
    sys.exit(bench_main(sys.argv[1:]))
