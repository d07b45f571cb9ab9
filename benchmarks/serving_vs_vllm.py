"""genq (Redis + worker + OpenAI gateway) against `vllm serve`, under vLLM's own load generator.

The same stock `vllm bench serve` command (`/work/shared/tools/vllm-bench-serve`, or
--bench-cmd) runs against genq and against vLLM's server in one run: both are up, measured in
turns, the order swapped each round (so both see the same machine),
on the same model under the same served name: random prompts of --input-len tokens, exactly
--output-len output tokens (ignore_eos), --num-prompts requests, at each --rates (inf: all at
once). It prints request and output throughput, TTFT, TPOT and ITL (mean and p99), failed
requests, and each side's CPU seconds per output token: the HTTP front alone (genq's gateway,
vLLM's API server process) and everything (genq: gateway + worker + redis-server; vLLM: the API
server and its engine process). After the rounds it prints each side's TTFT percentiles over
the requests of all rounds together: a p99 of one round's 200 requests is its second-slowest
request, which one stall of a shared host moves; pooled over four rounds it is the eighth.
Nothing is asserted here.

    python -m benchmarks.serving_vs_vllm [--model models/genq-tiny-stdlib] [--rates inf,20]
        [--num-prompts 200] [--rounds 2] [--json out.json] [--skip-vllm]

The first use of vLLM's tools installs its CPU build (~3 minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

from benchmarks.chart import save_bars
from benchmarks.demo import percentile
from benchmarks.fleet_vs_celery import REPO, free_port, start_redis, stop_all, wait_until

TOOLS = Path("/work/shared/tools")
NAME = "genq-tiny-stdlib"
METRICS = ("request_throughput", "output_throughput", "mean_ttft_ms", "p99_ttft_ms",
           "mean_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "p99_itl_ms")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree(pid: int) -> list[int]:
    """The process and its descendants."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*/children"):
            try:
                todo += [int(c) for c in task.read_text().split()]
            except OSError:
                pass
    return out


def spawn(cmd: list[str], log: Path, procs: list[subprocess.Popen[bytes]],
          **env: str) -> subprocess.Popen[bytes]:
    out = open(log, "wb")  # noqa: SIM115 (closed with the process)
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": str(REPO), **env})
    procs.append(proc)
    return proc


def wait_http(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float) -> None:
    def up() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited:\n{log.read_text(errors='replace')[-3000:]}")
        try:
            return httpx.get(url, timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    wait_until(up, timeout, url)


def start_genq(tmp: Path, model: Path, procs: list[subprocess.Popen[bytes]],
               worker_args: list[str], gateway_args: list[str]) -> tuple[str, list[int], int]:
    """redis-server, one worker and the gateway -> (base URL, pids of all, gateway pid)."""
    url = start_redis(tmp, procs)
    spawn([sys.executable, "-m", "producer.cli", "worker", "--redis", url, "--model", str(model),
           "--served-model-name", NAME, "--name", "bench-worker", *worker_args],
          tmp / "worker.log", procs)
    port = free_port()
    gateway = spawn([sys.executable, "-m", "producer.cli", "gateway", "--redis", url, "--port",
                     str(port), "--log-level", "warning", *gateway_args],
                    tmp / "gateway.log", procs)
    base = f"http://127.0.0.1:{port}"
    wait_http(f"{base}/health", gateway, tmp / "gateway.log", 120)
    wait_until(lambda: any(m["id"] == NAME for m in httpx.get(f"{base}/v1/models").json()["data"]),
               300, "the genq worker's heartbeat")
    return base, [p.pid for p in procs], gateway.pid


def start_vllm(tmp: Path, model: Path, procs: list[subprocess.Popen[bytes]],
               vllm_args: list[str]) -> tuple[str, int]:
    port = free_port()
    server = spawn([str(TOOLS / "vllm-cli"), "serve", str(model), "--served-model-name", NAME,
                    "--dtype", "float32", "--port", str(port), "--host", "127.0.0.1",
                    *vllm_args], tmp / "vllm.log", procs)
    base = f"http://127.0.0.1:{port}"
    wait_http(f"{base}/health", server, tmp / "vllm.log", 900)
    return base, server.pid


def bench(base: str, model: Path, rate: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """One `vllm bench serve` run -> its result JSON."""
    cmd = [*args.bench_cmd.split(), "--backend", "openai", "--base-url", base, "--endpoint",
           "/v1/completions", "--model", NAME, "--tokenizer", str(model), "--dataset-name",
           "random", "--random-input-len", str(args.input_len), "--random-output-len",
           str(args.output_len), "--ignore-eos", "--num-prompts", str(args.num_prompts),
           "--request-rate", rate, "--seed", "0", "--percentile-metrics", "ttft,tpot,itl",
           "--metric-percentiles", "99", "--save-result", "--result-dir", str(out.parent),
           "--result-filename", out.name, "--save-detailed", "--disable-tqdm"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(f"vllm bench serve failed ({done.returncode}):\n{done.stdout[-3000:]}"
                           f"\n{done.stderr[-3000:]}")
    return dict(json.loads(out.read_text()))


def measured(base: str, model: Path, rate: str, args: argparse.Namespace, out: Path,
             front: int, everything: list[int]) -> dict[str, Any]:
    pids = sorted({p for root in everything for p in tree(root)})
    before = (cpu_seconds(front), sum(cpu_seconds(p) for p in pids))
    result = bench(base, model, rate, args, out)
    after = (cpu_seconds(front), sum(cpu_seconds(p) for p in pids))
    tokens = max(1, int(result.get("total_output_tokens") or 0))
    row = {k: result.get(k) for k in (*METRICS, "completed", "failed", "total_output_tokens")}
    row["front_cpu_ms_per_token"] = 1000 * (after[0] - before[0]) / tokens
    row["all_cpu_ms_per_token"] = 1000 * (after[1] - before[1]) / tokens
    row["ttfts_ms"] = [1000 * t for t in result.get("ttfts") or [] if t]  # (failed ones: 0)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", type=Path, default=REPO / "models" / "genq-tiny-stdlib")
    p.add_argument("--rates", default="inf,20", help="request rates, one run each")
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--bench-cmd", default=str(TOOLS / "vllm-bench-serve"))
    p.add_argument("--worker-args", default="", help="extra `genq worker` flags")
    p.add_argument("--gateway-args", default="", help="extra `genq gateway` flags")
    p.add_argument("--vllm-args", default="", help="extra `vllm serve` flags")
    p.add_argument("--rounds", type=int, default=2, help="rounds, the order swapped each round")
    p.add_argument("--warmup-prompts", type=int, default=32,
                   help="requests each side serves at rate inf before the first round "
                        "(not measured: a server's first requests pay its start-up)")
    p.add_argument("--skip-vllm", action="store_true", help="measure genq only")
    p.add_argument("--json", default=None, help="also write the figures to this file")
    args = p.parse_args(argv)
    rates = args.rates.split(",")
    tmp = Path(tempfile.mkdtemp(prefix="genq-vs-vllm-"))
    rounds: list[dict[str, Any]] = []
    procs: list[subprocess.Popen[bytes]] = []
    try:
        base, pids, gateway = start_genq(tmp, args.model, procs, args.worker_args.split(),
                                         args.gateway_args.split())
        sides: dict[str, tuple[str, int, list[int]]] = {"genq": (base, gateway, pids)}
        if not args.skip_vllm:  # (up together, measured in turns: both see the same machine)
            vllm_base, server = start_vllm(tmp, args.model, procs, args.vllm_args.split())
            sides["vllm"] = (vllm_base, server, [server])
        if args.warmup_prompts:
            warm = argparse.Namespace(**{**vars(args), "num_prompts": args.warmup_prompts})
            for side, (url, _, _) in sides.items():
                bench(url, args.model, "inf", warm, tmp / f"{side}-warmup.json")
        for k in range(args.rounds):
            order = list(sides) if k % 2 == 0 else list(reversed(sides))
            row: dict[str, Any] = {side: {} for side in sides}
            for rate in rates:
                for side in order:
                    url, front, everything = sides[side]
                    row[side][rate] = measured(url, args.model, rate, args,
                                               tmp / f"{side}-{rate}-{k}.json", front, everything)
            rounds.append(row)
            report(row, rates, f"round {k + 1} ({' then '.join(order)} at each rate)")
    finally:
        stop_all(procs)
    if rounds:
        report_pooled(rounds, rates)
    save_bars("serving_vs_vllm", "output tokens/s, mean of rounds", [
        (f"{side} at rate {rate}", statistics.mean(r[side][rate]["output_throughput"]
                                                    for r in rounds))
        for rate in rates for side in (rounds[0] if rounds else {})],
        title=f"gateway vs vllm serve, {args.num_prompts} prompts of {args.input_len} tokens")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                               "rounds": rounds}, indent=2))
    print(f"(logs and raw results: {tmp})")
    return 0


def report(figures: dict[str, Any], rates: list[str], title: str) -> None:
    print(title)
    cols = [("req/s", "request_throughput", 1), ("out tok/s", "output_throughput", 0),
            ("TTFT mean", "mean_ttft_ms", 1), ("p99", "p99_ttft_ms", 1),
            ("TPOT mean", "mean_tpot_ms", 2), ("p99", "p99_tpot_ms", 2),
            ("ITL mean", "mean_itl_ms", 2), ("p99", "p99_itl_ms", 2),
            ("failed", "failed", 0), ("front ms/tok", "front_cpu_ms_per_token", 3),
            ("all ms/tok", "all_cpu_ms_per_token", 3)]
    print(f"{'':<16}" + "".join(f"{c[0]:>13}" for c in cols) + "   (times in ms)")
    for rate in rates:
        for side in ("genq", "vllm"):
            row = figures.get(side, {}).get(rate)
            if row is None:
                continue
            print(f"{side + ' @ ' + rate:<16}" + "".join(
                f"{float(row[k] or 0):>13.{digits}f}" for _, k, digits in cols))
        g, v = figures["genq"].get(rate), figures.get("vllm", {}).get(rate)
        if g and v:
            print(f"{'genq / vllm':<16}{g['request_throughput'] / v['request_throughput']:>13.2f}"
                  f"{g['output_throughput'] / v['output_throughput']:>13.2f}"
                  f"{g['mean_ttft_ms'] / v['mean_ttft_ms']:>13.2f}"
                  f"{g['p99_ttft_ms'] / v['p99_ttft_ms']:>13.2f}")


def report_pooled(rounds: list[dict[str, Any]], rates: list[str]) -> None:
    """TTFT percentiles of every request of every round, per side and rate (numpy's
    interpolation, as `vllm bench serve` computes its own)."""
    qs = (50, 90, 99)
    print(f"TTFT over all {len(rounds)} rounds' requests (ms)")
    print(f"{'':<16}{'requests':>10}" + "".join(f"{'p' + str(q):>10}" for q in qs)
          + f"{'max':>10}{'rounds won at p99':>20}")
    for rate in rates:
        pooled = {side: [t for r in rounds for t in r[side][rate]["ttfts_ms"]]
                  for side in rounds[0]}
        for side, ttfts in pooled.items():
            print(f"{side + ' @ ' + rate:<16}{len(ttfts):>10}"
                  + "".join(f"{percentile(ttfts, q):>10.1f}" for q in qs)
                  + f"{max(ttfts, default=0):>10.1f}")
        if len(pooled) == 2 and all(pooled.values()):
            won = sum(r["genq"][rate]["p99_ttft_ms"] <= r["vllm"][rate]["p99_ttft_ms"]
                      for r in rounds)
            print(f"{'genq / vllm':<16}{'':>10}" + "".join(
                f"{percentile(pooled['genq'], q) / percentile(pooled['vllm'], q):>10.2f}"
                for q in qs) + f"{'':>10}{f'{won} of {len(rounds)}':>20}")


if __name__ == "__main__":
    sys.exit(main())
