"""Interactive time to first token while a large batch runs: priority lanes vs one priority.

One worker (tiny Llama on the CPU, --max-num-seqs 64) and one redis-server. Each run submits a
batch of --batch jobs at once, then --interactive jobs one every --every seconds while the
batch runs; it ends when every job is done. Two runs, side by side:
- lanes: the batch at priority 10 (the low lane), the interactive jobs at 0;
- one priority: the same load, all at priority 0 (one stream, first in, first out).
Time to first token is read from Redis stream ids (the server's clock, ms): the job entry's id
(submitted) to the first tokens entry of its reply stream.

    python -m benchmarks.priority_ttft [--batch 10000] [--interactive 50] [--max-tokens 8]
                                       [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

from benchmarks.fleet_vs_celery import (
    percentiles,
    start_genq,
    start_redis,
    stop_all,
    tiny_model,
    wait_until,
)
from producer.events import decode_event
from producer.lanes import lane_keys
from producer.protocol import REPLY_FIELD, Keys

KEYS = Keys()


def _ms(entry_id: bytes | str) -> int:
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(text.split("-")[0])


def first_token_ms(conn: redis.Redis, job_id: str) -> int | None:
    for entry_id, fields in conn.xrange(KEYS.reply(job_id, "tiny")):
        if decode_event(fields[REPLY_FIELD.encode()])["type"] == "tokens":
            return _ms(entry_id)
    return None


def one_run(client: Any, conn: redis.Redis, args: argparse.Namespace,
            batch_priority: int) -> dict[str, Any]:
    params = {"temperature": 0, "max_tokens": args.max_tokens, "ignore_eos": True}
    prompts = [f"batch line {i}: summarise the quick brown fox" for i in range(args.batch)]
    start = time.time()
    for lo in range(0, args.batch, 1000):
        client.submit_many(prompts[lo:lo + 1000], params, model="tiny", priority=batch_priority)
    interactive = []
    for k in range(args.interactive):
        interactive.append(client.submit(f"interactive {k}: the quick brown fox", params,
                                         model="tiny"))
        time.sleep(args.every)
    wait_until(lambda: all(first_token_ms(conn, j.id) is not None for j in interactive), 1800,
               "the interactive jobs' first tokens")
    ttft = [(first_token_ms(conn, j.id) or 0) - _ms(str(j.entry_id)) for j in interactive]
    wait_until(lambda: sum(conn.xlen(k) for k in lane_keys(KEYS, "tiny")) == 0, 1800,
               "the batch to finish")
    wall = time.time() - start
    t = percentiles([float(v) for v in ttft])
    return {"batch_priority": batch_priority, "ttft_ms_p50": t["p50"], "ttft_ms_p99": t["p99"],
            "wall_s": wall, "jobs_per_s": (args.batch + args.interactive) / wall}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=10_000)
    parser.add_argument("--interactive", type=int, default=50)
    parser.add_argument("--every", type=float, default=0.1, help="seconds between interactive "
                        "submits")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    procs: list[Any] = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            url = start_redis(Path(tmp), procs)
            model = tiny_model(Path(tmp), minimal=True)
            client = start_genq(url, model, procs, Path(tmp), "tiny", "--max-num-seqs", "64")
            conn = redis.Redis.from_url(url)
            runs = [one_run(client, conn, args, p) for p in (10, 0)]
        finally:
            stop_all(procs)
    print(f"{args.batch} batch jobs + {args.interactive} interactive jobs (one every "
          f"{args.every} s), {args.max_tokens} tokens each, one CPU worker, 64 at a time")
    print(f"{'batch priority':>16} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12} {'wall s':>8} "
          f"{'jobs/s':>8}")
    for r in runs:
        print(f"{r['batch_priority']:>16} {r['ttft_ms_p50']:>12.0f} {r['ttft_ms_p99']:>12.0f} "
              f"{r['wall_s']:>8.1f} {r['jobs_per_s']:>8.0f}")
    lanes, flat = runs
    print(f"p50 {flat['ttft_ms_p50'] / max(lanes['ttft_ms_p50'], 1):.0f}x, p99 "
          f"{flat['ttft_ms_p99'] / max(lanes['ttft_ms_p99'], 1):.0f}x lower with lanes")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "runs": runs}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
