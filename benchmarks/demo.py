"""The fleet demo (`make demo`): a redis-server and two CPU workers of its own, a batch of jobs.

It starts redis-server (temp dir, free port) and two `genq worker` processes serving the committed
model models/genq-tiny-stdlib, streams one job's text live, runs a batch of jobs with a progress
bar, prints throughput and latency, and stops every process it started (also on Ctrl-C or error).

    python -m benchmarks.demo [--jobs 32] [--max-tokens 48] [--workers 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from tqdm import tqdm

from producer import AsyncClient, Client
from producer.protocol import Keys

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = REPO / "models" / "genq-tiny-stdlib"
# Prompts end where Python text goes on (a trailing space would split the tokenizer's merges).
PROMPTS = ["def main(", "    def __init__(self", "class Foo(", "with open(", "import os\n",
           "try:\n    ", "raise ValueError(", "    @property\n    def", "for name in", "if not",
           "from . import", "    return self."]
# What the tiny stdlib model writes best: greedy with a repetition penalty, or seeded sampling.
LIVE_PARAMS = {"temperature": 0.0, "repetition_penalty": 1.3}
BATCH_PARAMS = {"temperature": 0.7, "top_p": 0.95, "repetition_penalty": 1.2}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Fleet:
    """Every process the demo starts, so that `stop` can end all of them."""

    tmp: Path
    model: Path
    served_name: str
    port: int = field(default_factory=free_port)
    procs: list[tuple[str, subprocess.Popen[bytes], Path]] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start_redis(self) -> None:
        server = shutil.which("redis-server")
        if server is None:
            raise SystemExit("redis-server is missing: run `make setup` (or apt-get install "
                             "redis-server) and retry")
        self._spawn("redis", [server, "--port", str(self.port), "--bind", "127.0.0.1",
                              "--dir", str(self.tmp), "--save", "", "--appendonly", "no"])
        conn = redis.Redis(port=self.port, socket_timeout=1)
        self._wait(lambda: _pings(conn), 10, "redis-server")

    def start_workers(self, count: int, max_num_seqs: int) -> list[str]:
        names = [f"demo-worker-{i + 1}" for i in range(count)]
        for name in names:
            self._spawn(name, [sys.executable, "-m", "producer.cli", "worker", "--redis", self.url,
                               "--model", str(self.model), "--served-model-name",
                               self.served_name, "--device", "cpu", "--name", name,
                               "--num-threads", "1", "--max-num-seqs", str(max_num_seqs),
                               "--num-gpu-blocks-override", "512", "--swap-space", "0.05",
                               "--drain-timeout", "5"])
        conn = redis.Redis(port=self.port, socket_timeout=5)
        beats = [Keys().worker(self.served_name, n) for n in names]
        self._wait(lambda: all(conn.exists(key) for key in beats), 300,
                   "the workers to load the model")
        return names

    def stop(self) -> None:
        """SIGTERM everything (workers drain), then SIGKILL what is still alive after 15 s."""
        for _name, proc, _log in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        end = time.monotonic() + 15
        for _name, proc, _log in reversed(self.procs):
            try:
                proc.wait(max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def _spawn(self, name: str, args: list[str]) -> None:
        log = self.tmp / f"{name}.log"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO),
                                                           os.environ.get("PYTHONPATH")]))}
        with open(log, "wb") as out:
            # A session of its own: Ctrl-C reaches only the demo, which then stops them in order.
            proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        self.procs.append((name, proc, log))

    def _wait(self, ready: Any, timeout: float, what: str) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for name, proc, log in self.procs:
                if proc.poll() is not None:
                    tail = log.read_text(errors="replace")[-3000:]
                    raise RuntimeError(f"{name} exited with code {proc.returncode}:\n{tail}")
            if ready():
                return
            time.sleep(0.1)
        raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")


def _pings(conn: redis.Redis) -> bool:
    try:
        return bool(conn.ping())
    except redis.ConnectionError:
        return False


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), q in [0, 100]."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def stream_live(url: str, model: str, prompt: str, max_tokens: int) -> None:
    print(f"\n--- streaming one job live (greedy, repetition_penalty 1.3): {prompt!r}\n")
    with Client(url) as client:
        job = client.submit(prompt, {**LIVE_PARAMS, "max_tokens": max_tokens}, model=model)
        print(prompt, end="", flush=True)
        for event in job.stream(timeout=120):
            if event["type"] == "tokens":
                print(event["text"], end="", flush=True)
            elif event["type"] == "error":
                raise RuntimeError(f"live job failed: {event['message']}")
    print("\n")


async def run_batch(url: str, model: str, num_jobs: int, max_tokens: int,
                    seed: int) -> dict[str, Any]:
    """Submit every job at once, wait for all; per job: latency, tokens, worker."""
    records: list[dict[str, Any]] = []

    async with AsyncClient(url) as client:
        async def one(i: int) -> None:
            prompt = PROMPTS[i % len(PROMPTS)]
            params = {**BATCH_PARAMS, "seed": seed + i, "max_tokens": max_tokens}
            submitted = time.perf_counter()
            job = await client.submit(prompt, params, model=model)
            record: dict[str, Any] = {"index": i, "prompt": prompt, "params": params,
                                      "ok": False}
            async for event in job.stream(timeout=600):
                if event["type"] == "started":
                    record["worker"] = event["worker"]
                elif event["type"] == "tokens" and "ttft_s" not in record:
                    record["ttft_s"] = time.perf_counter() - submitted
                elif event["type"] == "done":
                    out = event["outputs"][0]
                    record.update(ok=True, text=out["text"], token_ids=out["token_ids"],
                                  tokens=event["usage"]["completion_tokens"])
                elif event["type"] == "error":
                    record["error"] = f"{event['code']}: {event['message']}"
            record["latency_s"] = time.perf_counter() - submitted
            records.append(record)
            bar.update(1)

        with tqdm(total=num_jobs, desc="jobs", unit="job", dynamic_ncols=True) as bar:
            start = time.perf_counter()
            await asyncio.gather(*(one(i) for i in range(num_jobs)))
            wall = time.perf_counter() - start
    return summarize(records, wall)


def summarize(records: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    done = [r for r in records if r["ok"]]
    latencies = [r["latency_s"] for r in done]
    ttfts = [r["ttft_s"] for r in done if "ttft_s" in r]
    tokens = sum(r["tokens"] for r in done)
    per_worker: dict[str, int] = {}
    for r in done:
        per_worker[r.get("worker", "?")] = per_worker.get(r.get("worker", "?"), 0) + 1
    return {"jobs": len(records), "done": len(done), "failed": len(records) - len(done),
            "wall_s": wall, "jobs_per_s": len(done) / wall, "tokens": tokens,
            "tokens_per_s": tokens / wall,
            "latency_p50_s": percentile(latencies, 50), "latency_p99_s": percentile(latencies, 99),
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
            "per_worker": dict(sorted(per_worker.items())),
            "errors": sorted({r["error"] for r in records if "error" in r}),
            "samples": [{"prompt": r["prompt"], "text": r["text"]} for r in done[:3]],
            "completions": [{k: r.get(k) for k in ("index", "prompt", "params", "worker",
                                                   "token_ids", "text")}
                            for r in sorted(done, key=lambda r: r["index"])]}


def print_summary(s: dict[str, Any]) -> None:
    print("\n--- three of the batch's completions (temperature 0.7, top_p 0.95, seeded)")
    for sample in s["samples"]:
        text = (sample["prompt"] + sample["text"]).replace("\n", "\n    ")
        print(f"  > {text}\n")
    print("--- results")
    print(f"jobs: {s['done']} done, {s['failed']} failed in {s['wall_s']:.2f} s")
    print(f"throughput: {s['jobs_per_s']:.2f} jobs/s, {s['tokens_per_s']:.1f} tokens/s "
          f"({s['tokens']} tokens)")
    print(f"latency submit->done: p50 {s['latency_p50_s']:.3f} s, p99 {s['latency_p99_s']:.3f} s")
    print(f"time to first token: p50 {s['ttft_p50_s']:.3f} s, p99 {s['ttft_p99_s']:.3f} s")
    print("jobs per worker: " + ", ".join(f"{w} {n}" for w, n in s["per_worker"].items()))
    for error in s["errors"]:
        print(f"error: {error}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--max-num-seqs", type=int, default=8,
                   help="per worker: small, so that the batch spreads over the workers")
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--live-prompt", default="    def __init__(self")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = p.parse_args(argv)
    if args.jobs < 1 or args.max_tokens < 1 or args.workers < 1:
        p.error("--jobs, --max-tokens and --workers must be at least 1")
    served = args.model.resolve().name

    tmp = Path(tempfile.mkdtemp(prefix="genq-demo-"))
    fleet = Fleet(tmp, args.model.resolve(), served)
    try:
        print(f"starting redis-server on port {fleet.port} and {args.workers} CPU worker(s) "
              f"serving {served} ...", flush=True)
        fleet.start_redis()
        loaded = time.perf_counter()
        names = fleet.start_workers(args.workers, args.max_num_seqs)
        print(f"workers ready in {time.perf_counter() - loaded:.1f} s: {', '.join(names)}",
              flush=True)
        stream_live(fleet.url, served, args.live_prompt, args.max_tokens)
        print(f"--- {args.jobs} jobs, max_tokens {args.max_tokens}, over {args.workers} worker(s)")
        summary = asyncio.run(run_batch(fleet.url, served, args.jobs, args.max_tokens, args.seed))
        print_summary(summary)
        if args.json is not None:
            args.json.write_text(json.dumps(summary, indent=2) + "\n")
        return 0 if summary["failed"] == 0 else 1
    except KeyboardInterrupt:
        print("\ninterrupted: stopping the fleet", file=sys.stderr)
        return 130
    except RuntimeError as exc:
        print(f"demo failed: {exc}", file=sys.stderr)
        return 1
    finally:
        fleet.stop()
        shutil.rmtree(tmp, ignore_errors=True)
        print(f"stopped the {len(fleet.procs)} process(es) the demo started", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
