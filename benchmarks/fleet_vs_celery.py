"""genq round trips vs Celery round trips on the same redis-server, in one run.

(a) genq: jobs with max_tokens=1 on a tiny model through ONE worker process; submit -> started and
    submit -> done come from Redis stream-entry ids (server clock, ms).
(b) Celery: an echo task, msgpack serializer, Redis broker and result backend, a prefork worker
    with 2 processes; submit -> started is the task's own start time, submit -> done is when the
    client holds the result.
(c) token events: 256 running requests on one worker (engine-bound on a CPU): tokens streamed/s
    and the tokens entries/s that carried them (when the writer falls behind Redis it sends a
    sequence's tokens of several steps in one entry); the writer thread alone with 256 owned
    entries (the Redis-side ceiling of the fenced writes); the same 256 requests on the engine
    alone in this process, with no Redis (the model's own ceiling on this machine); and the 256
    requests again through a worker run with --stream-interval 4 (4 tokens per event) and one
    with --writer thread (the writer in the worker's process), rounds alternating. Each
    streaming round also gives the rate while all 256 ran (from the last started event to the
    first done: no ramp up or down) and the CPU the worker (with its writer process) and
    redis-server spent per token, read from /proc: on a small machine that shares its cores
    with Redis and the client, the sum of those is what bounds the rate.

    python -m benchmarks.fleet_vs_celery [--jobs 2000] [--rounds 3] [--model DIR | --minimal-model]
                                         [--json out.json]

Throughput in both cases is jobs / (last done - first submit). Rounds of (a) and (b) alternate,
so both see the same machine; the ratio is reported per round. Nothing is asserted here.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

from benchmarks.chart import save_bars

REPO = Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------- the Celery side (imported by
# the Celery worker process too, so it must stay importable without side effects)
try:
    from celery import Celery
    from celery.result import ResultSet

    celery_app = Celery("genq_bench", broker=os.environ.get("GENQ_BENCH_REDIS", "redis://"),
                        backend=os.environ.get("GENQ_BENCH_REDIS", "redis://"))
    celery_app.conf.update(task_serializer="msgpack", result_serializer="msgpack",
                           accept_content=["msgpack"], worker_prefetch_multiplier=64,
                           broker_connection_retry_on_startup=True)

    @celery_app.task(name="genq_bench.echo")
    def echo(value: int) -> list[float]:
        return [value, time.time()]
except ImportError:  # the genq half still runs
    celery_app = None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": 0.0, "p99": 0.0}
    ordered = sorted(values)
    return {"p50": float(statistics.median(ordered)),
            "p99": float(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))])}


def wait_until(predicate: Any, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(0.1)
    raise RuntimeError(f"timed out waiting for {what}")


def start_genq(url: str, model_dir: Path, procs: list[subprocess.Popen[bytes]],
               logdir: Path, name: str = "tiny", *extra: str) -> Any:
    """One genq worker process serving `name` (also its worker name), warmed up; returns a
    Client."""
    from producer.bench import run_bench
    from producer.client import Client
    from producer.protocol import Keys

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    log = open(logdir / f"genq-worker-{name}.log", "wb")  # noqa: SIM115 (closed with it)
    proc = subprocess.Popen(
        [sys.executable, "-m", "producer.cli", "worker", "--redis", url, "--model",
         str(model_dir), "--served-model-name", name, "--name", name, "--num-threads", "1",
         "--num-gpu-blocks-override", "8192", "--swap-space", "0.01", *extra],
        cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    procs.append(proc)
    conn = redis.Redis.from_url(url)
    heartbeat = Keys().worker(name, name)
    wait_until(lambda: conn.exists(heartbeat) or proc.poll() is not None, 300,
               "the genq worker")
    if proc.poll() is not None:
        raise RuntimeError(f"the genq worker exited ({proc.returncode}); see {log.name}")
    client = Client(url)
    run_bench(client, name, 100, {"temperature": 0, "max_tokens": 1}, "warm up", True, 300)
    return client


def genq_round_trips(client: Any, jobs: int) -> dict[str, Any]:
    from producer.bench import run_bench

    return run_bench(client, "tiny", jobs, {"temperature": 0, "max_tokens": 1},
                     "the quick brown fox", True, 600)


def genq_running_256(client: Any, name: str = "tiny", worker_pid: int | None = None,
                     redis_pid: int | None = None) -> dict[str, Any]:
    """256 x 64 tokens streamed; with the pids, also the CPU each side spent per token: the
    worker (its process and its writer process) and redis-server."""
    from producer.bench import run_bench

    sides = (_family(worker_pid) if worker_pid else [], [redis_pid] if redis_pid else [])
    before = [_cpu_seconds(pids) for pids in sides]
    figures = run_bench(client, name, 256, {"temperature": 0, "max_tokens": 64,
                                              "ignore_eos": True}, "the quick brown fox", True,
                        600)
    after = [_cpu_seconds(pids) for pids in sides]
    tokens = max(figures["tokens"], 1)
    for key, b, a in zip(("worker", "redis"), before, after, strict=True):
        figures[f"{key}_cpu_us_per_token"] = None if a is None or b is None \
            else (a - b) / tokens * 1e6
    return figures


def _family(pid: int) -> list[int]:
    """A process and its children (the worker and its writer process); Linux only."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [pid, *(int(k) for k in f.read().split())]
    except OSError:
        return []


def _cpu_seconds(pids: list[int]) -> float | None:
    """User + system CPU seconds of `pids` from /proc (None where that cannot be read)."""
    if not pids:
        return None
    total = 0.0
    try:
        for pid in pids:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
    return total


def bench_writer(url: str, steps: int = 200, num_jobs: int = 256) -> dict[str, Any]:
    """The writer thread alone: `num_jobs` owned entries, one token per job per step. `per_step`
    waits for each step's round trip (no coalescing: one XADD per event); `free_running` lets
    steps queue up while a round trip is in flight (merged into one tokens event per job)."""
    from producer.events import tokens_event
    from producer.protocol import Keys
    from worker.batch import Batch, EventWrite
    from worker.io_thread import Writer
    from worker.streams import JobStream

    conn = redis.Redis.from_url(url, protocol=2)
    keys = Keys("genqbench", "w")  # (the jobs of its replies: model w's)
    jobs_key = keys.jobs("w")
    conn.xgroup_create(jobs_key, "workers", id="0", mkstream=True)
    for _ in range(num_jobs):
        conn.xadd(jobs_key, {"v": "1", "job": "x"})
    got = conn.xreadgroup("workers", "me", {jobs_key: ">"}, count=num_jobs)
    entry_ids = [eid.decode() for eid, _ in got[0][1]]
    figures = {}
    for mode in ("per_step", "free_running"):
        writer = Writer(conn, [JobStream(jobs_key, keys.dead("w"), keys.fence("w", "me"))],
                        "workers", "me", 60, 60)  # as a worker's
        writer.start()
        start = time.perf_counter()
        for step in range(steps):
            writer.submit(Batch(events=[
                EventWrite(eid, 1, keys.reply(f"j{i}"), [tokens_event(1, 0, step, [5], "x")])
                for i, eid in enumerate(entry_ids)]))
            if mode == "per_step":
                writer.flush()
        writer.flush()
        elapsed = time.perf_counter() - start
        writer.stop()
        figures[mode] = {"token_events": steps * num_jobs, "seconds": elapsed,
                         "token_events_per_s": steps * num_jobs / elapsed,
                         "xadds": writer.num_events_written}
        conn.delete(*[keys.reply(f"j{i}") for i in range(num_jobs)])
    conn.delete(jobs_key, keys.fence("w", "me"))
    return figures


def start_celery(url: str, procs: list[subprocess.Popen[bytes]], logdir: Path) -> bool:
    if celery_app is None:
        return False
    env = {**os.environ, "GENQ_BENCH_REDIS": url, "PYTHONPATH": str(REPO)}
    log = open(logdir / "celery-worker.log", "wb")  # noqa: SIM115
    procs.append(subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "benchmarks.fleet_vs_celery:celery_app", "worker",
         "-P", "prefork", "-c", "2", "--without-gossip", "--without-mingle",
         "--without-heartbeat", "-l", "WARNING"], cwd=REPO, env=env, stdout=log,
        stderr=subprocess.STDOUT))
    celery_app.conf.update(broker_url=url, result_backend=url)
    echo.delay(-1).get(timeout=120)  # the worker is up
    for res in [echo.apply_async(args=(i,)) for i in range(100)]:  # warm up
        res.get(timeout=120)
    return True


def celery_round_trips(jobs: int) -> dict[str, Any]:
    submitted: list[float] = []
    results = []
    for i in range(jobs):
        submitted.append(time.time())
        results.append(echo.apply_async(args=(i,)))
    # Celery's batch wait (as genq's side uses Client.results): the Redis result backend
    # reads many results per round trip and calls back as each one lands.
    held: dict[str, tuple[float, float]] = {}  # task id -> (task start, when the client held it)

    def on_result(task_id: str, value: list[float]) -> None:
        held[task_id] = (value[1], time.time())

    ResultSet(results).join_native(timeout=600, callback=on_result)
    to_started = [(held[r.id][0] - sent) * 1000 for sent, r in zip(submitted, results)]
    to_done = [(held[r.id][1] - sent) * 1000 for sent, r in zip(submitted, results)]
    wall = max(t for _, t in held.values()) - submitted[0]
    return {"jobs": jobs, "wall_s": wall, "jobs_per_s": jobs / wall,
            "submit_to_started_ms": percentiles(to_started),
            "submit_to_done_ms": percentiles(to_done)}


def engine_alone(model_dir: Path, num_jobs: int = 256, max_tokens: int = 64,
                 rounds: int = 2) -> list[dict[str, Any]]:
    """The same 256 requests on the worker's engine configuration, in this process, with no
    Redis: the ceiling the fleet's streaming figure is measured against (one thread, as the
    worker has). Run while the worker is idle."""
    import torch

    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.sampling_params import SamplingParams
    from worker.main import tune_gc

    threads = torch.get_num_threads()
    engine = Engine(EngineConfig(model=str(model_dir), num_gpu_blocks_override=8192,
                                 swap_space=0.01, num_threads=1, output_kind="delta"))
    thresholds = gc.get_threshold()
    tune_gc()  # as `genq worker` does after loading its engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    figures = []
    for r in range(rounds + 1):  # the first round warms up
        for i in range(num_jobs):
            engine.add_request(f"r{r}-{i}", "the quick brown fox", params)
        tokens = 0
        start = time.perf_counter()
        while engine.has_unfinished():
            for out in engine.step():
                tokens += sum(len(c.token_ids) for c in out.outputs)
        elapsed = time.perf_counter() - start
        if r:
            figures.append({"tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed})
    torch.set_num_threads(threads)
    gc.set_threshold(*thresholds)
    gc.unfreeze()
    return figures


def tiny_model(tmp: Path, minimal: bool = False) -> Path:
    """The tests' tiny random Llama (2 layers, hidden 64); `minimal`: 1 layer, hidden 16, one
    head, so the forward pass costs next to nothing and what is left is the fleet's own work."""
    from tests.harness.models import build_model, build_tokenizer

    tok = tmp / "tokenizer"
    tok.mkdir()
    build_tokenizer(tok)
    path = build_model("llama", tmp / "tiny", tok)
    if minimal:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        cfg = AutoConfig.from_pretrained(str(path))
        cfg.update({"hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 1,
                    "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 16})
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        with torch.no_grad():  # sharpened as build_model does, so greedy is not a coin toss
            for p in model.parameters():
                p.mul_(3.0) if p.dim() > 1 else None
        model.save_pretrained(str(path))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2000, help="jobs per round trip round")
    parser.add_argument("--rounds", type=int, default=3, help="alternating genq/Celery rounds")
    parser.add_argument("--model", default=None, help="model dir (default: a tiny random Llama)")
    parser.add_argument("--minimal-model", action="store_true",
                        help="a 1-layer, 16-wide random Llama instead: the fleet's own ceiling")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="genq-bench-"))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        url = start_redis(tmp, procs)
        model = Path(args.model) if args.model else tiny_model(tmp, args.minimal_model)
        client = start_genq(url, model, procs, tmp)
        # The same worker with --stream-interval 4, and with --writer thread (each idle until
        # its streaming rounds, which alternate with the default worker's).
        start_genq(url, model, procs, tmp, "tiny-si4", "--stream-interval", "4")
        start_genq(url, model, procs, tmp, "tiny-thread", "--writer", "thread")
        has_celery = start_celery(url, procs, tmp)
        rounds: list[dict[str, Any]] = []
        for _ in range(args.rounds):  # alternating, so both see the same machine
            row = {"genq": genq_round_trips(client, args.jobs)}
            if has_celery:
                row["celery"] = celery_round_trips(args.jobs)
            rounds.append(row)
        figures: dict[str, Any] = {"rounds": rounds,
                                   "running_256": [], "running_256_si4": [],
                                   "running_256_thread": [],
                                   "writer": bench_writer(url),
                                   "engine_alone_256": engine_alone(model)}
        pids = {name: proc.pid for name, proc in zip(("tiny", "tiny-si4", "tiny-thread"),
                                                        procs[1:4], strict=True)}
        for _ in range(args.rounds):  # alternating, as the round trips
            for key, name in (("running_256", "tiny"), ("running_256_si4", "tiny-si4"),
                              ("running_256_thread", "tiny-thread")):
                figures[key].append(genq_running_256(client, name, pids[name], procs[0].pid))
        report(figures)
        chart(figures)
        if args.json:
            Path(args.json).write_text(json.dumps(figures, indent=2))
    finally:
        stop_all(procs)
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


def start_redis(tmp: Path, procs: list[subprocess.Popen[bytes]]) -> str:
    """A throwaway redis-server on a free port (no persistence), appended to `procs`."""
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    procs.append(subprocess.Popen(
        [shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind",
         "127.0.0.1", "--dir", str(tmp), "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    wait_until(lambda: _ping(url), 10, "redis-server")
    return url


def stop_all(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM each process, newest first, each once the one after it has exited (a worker
    drains while its redis-server is still up); kill what has not exited within 20 s."""
    for proc in reversed(procs):
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _ping(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_timeout=1).ping())
    except redis.ConnectionError:
        return False


def _streaming(many: dict[str, Any]) -> str:
    line = (f"{many['tokens_per_s']:.0f} tokens/s streamed in "
            f"{many['token_events_per_s']:.0f} tokens events/s "
            f"({many['tokens'] / max(many['token_events'], 1):.2f} tokens per event)")
    if many.get("all_running_token_events_per_s") is not None:
        line += (f"; while all 256 ran: {many['all_running_tokens_per_s']:.0f} tokens/s, "
                 f"{many['all_running_token_events_per_s']:.0f} events/s")
    if many.get("worker_cpu_us_per_token") is not None:
        line += (f"; CPU per token: worker {many['worker_cpu_us_per_token']:.1f} us, "
                 f"redis {many['redis_cpu_us_per_token']:.1f} us")
    return line


def report(f: dict[str, Any]) -> None:
    print(f"{'round trips, max_tokens=1':<30}{'jobs/s':>8}{'started p50':>13}{'p99':>7}"
          f"{'done p50':>10}{'p99':>7}")
    ratios = []
    for i, row in enumerate(f["rounds"], 1):
        names = [("genq, 1 worker", "genq"), ("celery echo, 2 prefork", "celery")]
        for label, key in names:
            if key not in row:
                continue
            r = row[key]
            s, d = r["submit_to_started_ms"], r["submit_to_done_ms"]
            print(f"{f'round {i}: {label}':<30}{r['jobs_per_s']:>8.0f}{s['p50']:>13.0f}"
                  f"{s['p99']:>7.0f}{d['p50']:>10.0f}{d['p99']:>7.0f}")
        if "celery" in row:
            ratios.append(row["genq"]["jobs_per_s"] / row["celery"]["jobs_per_s"])
    if ratios:
        print(f"genq / celery per round: {', '.join(f'{r:.1f}x' for r in ratios)}; "
              f"median {statistics.median(ratios):.1f}x")
    for key, label in (("running_256", "256 running requests on one CPU worker"),
                       ("running_256_si4", "the same with --stream-interval 4"),
                       ("running_256_thread", "the same with --writer thread")):
        for many in f[key]:
            print(f"{label}: {_streaming(many)}")
    for alone in f["engine_alone_256"]:
        print(f"the same 256 requests on the engine alone (no Redis, one thread): "
              f"{alone['tokens_per_s']:.0f} tokens/s")
    w = f["writer"]
    for mode in ("per_step", "free_running"):
        m = w[mode]
        print(f"token events/s into the writer alone, 256 owned entries, {mode}: "
              f"{m['token_events_per_s']:.0f} ({m['xadds']} XADDs for {m['token_events']} "
              "events)")


def chart(f: dict[str, Any]) -> None:
    """Median jobs/s of each side's rounds (they alternated, so both saw the same machine)."""
    bars = [(label, statistics.median(row[key]["jobs_per_s"] for row in f["rounds"]))
            for label, key in (("genq, 1 CPU worker", "genq"), ("Celery echo, 2 prefork", "celery"))
            if all(key in row for row in f["rounds"])]
    save_bars("fleet_vs_celery", "round trips/s (max_tokens=1), median of rounds", bars,
              title="genq fleet vs Celery on the same Redis")


if __name__ == "__main__":
    sys.exit(main())
