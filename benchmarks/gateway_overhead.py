"""What the OpenAI gateway and the Celery bridge cost on top of `producer.Client`, in one run.

(1) latency: one-token requests (max_tokens=1, temperature 0) sent one at a time, each waiting
    for its answer, (a) as POST /v1/completions to `genq gateway` over one keep-alive httpx
    connection and (b) as `Client.submit` + `Job.result`. Client-side wall clock per request;
    the gateway overhead is the difference of the p50s.
(2) throughput: a burst of N max_tokens=1 jobs (a) as `genq.generate` Celery tasks that
    `genq celery-bridge` (threads, --concurrency 64) turns into genq jobs, all sent, then
    collected with one AsyncResult.get each, and (b) the same burst submitted with
    `Client.submit_many` and collected with `Job.result`. Tasks (jobs) / client wall clock from
    the first send to the last result.

Everything runs against its own redis-server on a free port and ONE genq worker process on the
CPU (the tiny random Llama of tests/harness/models.py); every process started here is stopped at
the end. Rounds alternate the four measurements so all see the same machine; (1)'s two orders
swap every round. Nothing is asserted here.

    python -m benchmarks.gateway_overhead [--requests 500] [--rounds 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import redis

from benchmarks.fleet_vs_celery import (
    REPO,
    free_port,
    percentiles,
    start_genq,
    start_redis,
    stop_all,
    tiny_model,
    wait_until,
)

PROMPT = "the quick brown fox"
PARAMS: dict[str, Any] = {"temperature": 0, "max_tokens": 1}
BRIDGE_CONCURRENCY = 64


def start_gateway(url: str, procs: list[subprocess.Popen[bytes]], logdir: Path) -> str:
    """`genq gateway` on a free port; returns its base URL once /health answers."""
    port = free_port()
    log = open(logdir / "gateway.log", "wb")  # noqa: SIM115 (closed with the process)
    procs.append(subprocess.Popen(
        [sys.executable, "-m", "producer.cli", "gateway", "--redis", url, "--host", "127.0.0.1",
         "--port", str(port), "--log-level", "warning"], cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=log, stderr=subprocess.STDOUT))
    base = f"http://127.0.0.1:{port}"

    def up() -> bool:
        if procs[-1].poll() is not None:
            raise RuntimeError((logdir / "gateway.log").read_text(errors="replace"))
        try:
            return httpx.get(f"{base}/health", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    wait_until(up, 60, "the gateway")
    return base


def start_bridge(url: str, procs: list[subprocess.Popen[bytes]], logdir: Path) -> Any:
    """`genq celery-bridge` on the same redis-server; returns a Celery app that calls it."""
    from celery import Celery

    log = open(logdir / "bridge.log", "wb")  # noqa: SIM115
    procs.append(subprocess.Popen(
        [sys.executable, "-m", "producer.cli", "celery-bridge", "--broker", url, "--redis", url,
         "--concurrency", str(BRIDGE_CONCURRENCY), "--loglevel", "WARNING"], cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=log, stderr=subprocess.STDOUT))
    conn = redis.Redis.from_url(url)  # up once its consumer has declared the queue
    wait_until(lambda: procs[-1].poll() is None and conn.exists("_kombu.binding.celery"), 60,
               "the bridge to declare its queue")
    app = Celery("genq_bench_app", broker=url, backend=url)
    app.conf.update(task_serializer="json", accept_content=["json", "msgpack"],
                    result_accept_content=["json", "msgpack"])
    return app


def gateway_sequential(http: httpx.Client, requests: int) -> list[float]:
    body = {"model": "tiny", "prompt": PROMPT, **PARAMS}
    times = []
    for _ in range(requests):
        start = time.perf_counter()
        reply = http.post("/v1/completions", json=body)
        reply.raise_for_status()
        reply.json()
        times.append((time.perf_counter() - start) * 1000)
    return times


def client_sequential(client: Any, requests: int) -> list[float]:
    times = []
    for _ in range(requests):
        start = time.perf_counter()
        client.submit(PROMPT, PARAMS, model="tiny").result(timeout=120)
        times.append((time.perf_counter() - start) * 1000)
    return times


def celery_burst(app: Any, tasks: int) -> dict[str, Any]:
    kwargs = {"prompt": PROMPT, "model": "tiny", "params": PARAMS}
    start = time.perf_counter()
    results = [app.send_task("genq.generate", kwargs=kwargs) for _ in range(tasks)]
    sent = time.perf_counter()
    # One get per result, in order. Not ResultSet.get: its join_native drains the result
    # backend in 0.5 s polls, ~0.4 s of idle wait per burst that is the client's, not the bridge's.
    outs = [res.get(timeout=600) for res in results]
    wall = time.perf_counter() - start
    for res in results:
        res.forget()
    tokens = sum(o["usage"]["completion_tokens"] for o in outs)
    return {"tasks": tasks, "wall_s": wall, "send_s": sent - start, "per_s": tasks / wall,
            "completion_tokens": tokens}


def direct_burst(client: Any, jobs: int) -> dict[str, Any]:
    start = time.perf_counter()
    handles = []
    for first in range(0, jobs, 500):  # as producer.bench.run_bench does
        handles += client.submit_many([PROMPT] * min(500, jobs - first), PARAMS, model="tiny")
    sent = time.perf_counter()
    outs = [job.result(timeout=600) for job in handles]
    wall = time.perf_counter() - start
    tokens = sum(o["usage"]["completion_tokens"] for o in outs)
    return {"tasks": jobs, "wall_s": wall, "send_s": sent - start, "per_s": jobs / wall,
            "completion_tokens": tokens}


def one_round(i: int, http: httpx.Client, client: Any, app: Any, n: int) -> dict[str, Any]:
    row: dict[str, Any] = {}
    order = ("gateway", "client") if i % 2 == 0 else ("client", "gateway")
    for name in order:  # swapped every round: neither always runs on a warmer machine
        times = gateway_sequential(http, n) if name == "gateway" else client_sequential(client, n)
        row[name] = {"requests": n, **percentiles(times), "mean": statistics.fmean(times)}
    row["overhead_p50_ms"] = row["gateway"]["p50"] - row["client"]["p50"]
    row["celery_bridge"] = celery_burst(app, n)
    row["submit_many"] = direct_burst(client, n)
    row["direct_over_bridge"] = row["submit_many"]["per_s"] / row["celery_bridge"]["per_s"]
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=500,
                        help="sequential requests per path and tasks per burst, each round")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds")
    parser.add_argument("--model", default=None, help="model dir (default: a tiny random Llama)")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="genq-gw-bench-"))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        url = start_redis(tmp, procs)
        model = Path(args.model) if args.model else tiny_model(tmp)
        client = start_genq(url, model, procs, tmp)
        base = start_gateway(url, procs, tmp)
        app = start_bridge(url, procs, tmp)
        with httpx.Client(base_url=base, timeout=120) as http:
            gateway_sequential(http, 20)  # warm up every path
            client_sequential(client, 20)
            celery_burst(app, 50)
            rounds = [one_round(i, http, client, app, args.requests) for i in range(args.rounds)]
        figures = {"requests": args.requests, "params": PARAMS, "prompt": PROMPT,
                   "bridge_concurrency": BRIDGE_CONCURRENCY, "rounds": rounds}
        report(figures)
        if args.json:
            Path(args.json).write_text(json.dumps(figures, indent=2))
    finally:
        stop_all(procs)
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


def report(f: dict[str, Any]) -> None:
    n = f["requests"]
    print(f"(1) {n} sequential one-token requests per path, latency ms")
    print(f"{'':<24}{'gateway p50':>12}{'p99':>7}{'Client p50':>12}{'p99':>7}{'overhead':>10}")
    for i, row in enumerate(f["rounds"], 1):
        g, c = row["gateway"], row["client"]
        print(f"{f'round {i}':<24}{g['p50']:>12.1f}{g['p99']:>7.1f}{c['p50']:>12.1f}"
              f"{c['p99']:>7.1f}{row['overhead_p50_ms']:>+10.1f}")
    rows = f["rounds"]
    g50 = statistics.median(r["gateway"]["p50"] for r in rows)
    c50 = statistics.median(r["client"]["p50"] for r in rows)
    over = statistics.median(r["overhead_p50_ms"] for r in rows)
    ratio = statistics.median(r["gateway"]["p50"] / r["client"]["p50"] for r in rows)
    print(f"median of rounds: gateway p50 {g50:.1f} ms, Client p50 {c50:.1f} ms; overhead "
          f"{over:+.1f} ms, gateway / Client {ratio:.2f}x")
    print(f"(2) bursts of {n} max_tokens=1 jobs, per second")
    print(f"{'':<24}{'celery bridge':>14}{'submit_many':>13}{'ratio':>8}")
    for i, row in enumerate(rows, 1):
        print(f"{f'round {i}':<24}{row['celery_bridge']['per_s']:>14.0f}"
              f"{row['submit_many']['per_s']:>13.0f}{row['direct_over_bridge']:>7.1f}x")
    b = statistics.median(r["celery_bridge"]["per_s"] for r in rows)
    d = statistics.median(r["submit_many"]["per_s"] for r in rows)
    ratio = statistics.median(r["direct_over_bridge"] for r in rows)
    print(f"median of rounds: celery bridge {b:.0f} tasks/s, submit_many {d:.0f} jobs/s; "
          f"submit_many / bridge {ratio:.1f}x")


if __name__ == "__main__":
    sys.exit(main())
