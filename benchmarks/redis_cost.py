"""What genq costs Redis: CPU per operation and memory per finished job.

Runs the real code paths against a fresh redis-server (no model: the worker's side is its
Writer, driven with the events a worker would write):
  submit     Client.submit_many (the idempotent submit script), per job
  tokens     Writer token writes (WRITE_EVENTS_LUA, fenced), one event of one token, per event
  finish     Writer finish writes (FINISH_LUA: done event, XACK, XDEL, ended mark), per job
  results    Client.results over finished jobs (LAST_ENTRIES_LUA), per job
Redis CPU is read from INFO cpu (user + system) around each phase. Memory per job is
used_memory after the jobs finished (reply stream and idempotency key, during --result-ttl),
less the empty server's, divided by the jobs, for two stream-node-max-bytes settings side by
side in one run.

    python -m benchmarks.redis_cost --jobs 2000 --tokens 64
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

from producer.client import Client
from producer.events import done_event, encode_event, tokens_event
from producer.protocol import Keys, as_str
from worker.batch import Batch, EventWrite, FinishWrite
from worker.io_thread import Writer
from worker.streams import JobStream


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def cpu_s(conn: redis.Redis) -> float:
    """Redis's CPU seconds so far (INFO cpu: getrusage, microseconds; /proc/<pid>/stat counts
    10 ms ticks, too coarse for a phase)."""
    info = conn.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def run_once(jobs: int, tokens: int, node_bytes: int) -> dict[str, float]:
    tmp = Path(tempfile.mkdtemp(prefix="genq-redis-cost-"))
    port = free_port()
    proc = subprocess.Popen([shutil.which("redis-server") or "redis-server", "--port", str(port),
                             "--save", "", "--appendonly", "no", "--dir", str(tmp),
                             "--stream-node-max-bytes", str(node_bytes)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"redis://127.0.0.1:{port}/0"
        conn = redis.Redis(port=port, protocol=2)
        for _ in range(200):
            try:
                conn.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.02)
        keys = Keys()
        jobs_key, model = keys.jobs("tiny"), "tiny"
        conn.xgroup_create(jobs_key, keys.group, id="0", mkstream=True)
        base_memory = int(conn.info("memory")["used_memory"])
        out: dict[str, float] = {}
        client = Client(url)
        writer = Writer(conn, [JobStream(jobs_key, keys.dead(model), keys.fence(model, "w1"))],
                        keys.group, "w1", 3600, 3600)

        before = cpu_s(conn)
        submitted = []
        for lo in range(0, jobs, 256):
            submitted += client.submit_many(["a prompt"] * min(256, jobs - lo),
                                            {"temperature": 0, "max_tokens": tokens},
                                            model=model)
        out["submit_us"] = (cpu_s(conn) - before) / jobs * 1e6
        [(_key, rows)] = conn.xreadgroup(keys.group, "w1", {jobs_key: ">"}, count=jobs)
        pairs = [(as_str(entry_id), job) for (entry_id, _f), job in
                 zip(rows, submitted, strict=True)]  # (entries in submit order)

        before = cpu_s(conn)
        for pos in range(tokens):  # one step: a token for every job
            writer.write_batches([Batch(events=[
                EventWrite(entry_id, 1, job.reply_key, [tokens_event(1, 0, pos, [7], "x")])
                for entry_id, job in pairs])])
        out["tokens_us"] = (cpu_s(conn) - before) / (jobs * tokens) * 1e6

        before = cpu_s(conn)
        done = encode_event(done_event(1, [{"index": 0, "token_ids": [7] * tokens,
                                            "text": "x" * tokens, "finish_reason": "length"}],
                                       {"prompt_tokens": 2, "completion_tokens": tokens}, {}))
        for lo in range(0, len(pairs), 256):
            writer.write_batches([Batch(finishes=[
                FinishWrite(entry_id, 1, job.reply_key, done, idem_key=keys.idem(job.id))
                for entry_id, job in pairs[lo:lo + 256]])])
        out["finish_us"] = (cpu_s(conn) - before) / jobs * 1e6

        before = cpu_s(conn)
        client.results(submitted, timeout=60)
        out["results_us"] = (cpu_s(conn) - before) / jobs * 1e6
        out["memory_per_job_bytes"] = (int(conn.info("memory")["used_memory"]) - base_memory) \
            / jobs
        client.close()
        return out
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=int, default=2000)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds per setting")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    settings = {"stream-node-max-bytes 4096 (Redis's default)": 4096,
                "stream-node-max-bytes 1024": 1024}
    results: dict[str, list[dict[str, float]]] = {name: [] for name in settings}
    for _ in range(args.rounds):
        for name, node_bytes in settings.items():
            results[name].append(run_once(args.jobs, args.tokens, node_bytes))
    cols = ["submit_us", "tokens_us", "finish_us", "results_us", "memory_per_job_bytes"]
    print(f"{args.jobs} jobs x {args.tokens} tokens, median of {args.rounds} rounds; Redis CPU "
          "in us per operation, memory per finished job in bytes")
    print("| setting | submit | token event | finish | results | memory/job |")
    print("|---|---:|---:|---:|---:|---:|")
    summary: dict[str, Any] = {}
    for name, rows in results.items():
        med = {c: sorted(r[c] for r in rows)[len(rows) // 2] for c in cols}
        summary[name] = med
        print(f"| {name} | {med['submit_us']:.1f} | {med['tokens_us']:.2f} | "
              f"{med['finish_us']:.1f} | {med['results_us']:.1f} | "
              f"{med['memory_per_job_bytes']:.0f} |")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
