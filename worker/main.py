"""`genq worker`: serve one model on one device from a Redis job stream."""

from __future__ import annotations

import argparse
import errno
import gc
import json
import logging
import os
import re
import signal
import socket
import sys
from pathlib import Path
from types import FrameType

from prometheus_client import CollectorRegistry

from producer.flags import DefaultsHelpFormatter, add_limit_args, add_redis_args, limits_from_args
from worker.config import WorkerConfig
from worker.metrics import MetricsServer


def tune_gc() -> None:
    """The garbage collector for a serving loop, once the engine is loaded. The hundreds of
    thousands of objects torch and transformers leave behind at start-up are never garbage: keep
    them out of every later collection, where a full collection would walk them all (vLLM
    freezes its heap the same way). Each step allocates thousands of short-lived objects per
    running request (outputs, events), nearly all freed by reference counting: collect the
    young generation every 20,000 allocations instead of every 700."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 20, 100)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="genq worker", description=__doc__,
                                formatter_class=DefaultsHelpFormatter)
    add_redis_args(p)
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--served-model-name", default=None,
                   help="name jobs route by (default: the model directory's basename)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:<i> (default: %(default)s)")
    p.add_argument("--name", default=None,
                   help="consumer name and heartbeat key; stable across restarts "
                        "(default: the host name)")
    e = p.add_argument_group("engine")
    e.add_argument("--dtype", default="auto",
                   help="auto, float32, float16 or bfloat16; auto is the checkpoint's dtype, "
                        "and bfloat16 on CUDA for a float32 checkpoint (default: %(default)s)")
    e.add_argument("--block-size", type=int, default=16,
                   help="tokens per KV cache block (default: %(default)s)")
    e.add_argument("--num-gpu-blocks-override", type=int, default=None,
                   help="KV cache blocks on the device (default: sized from the GPU's free "
                        "memory, or 4 GiB of KV cache on the CPU)")
    e.add_argument("--max-num-seqs", type=int, default=256,
                   help="sequences running at once; also caps the jobs this worker holds "
                        "(default: %(default)s)")
    e.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="tokens per engine step, prefill chunks included (default: %(default)s)")
    e.add_argument("--prefills-first", action=argparse.BooleanOptionalAction, default=False,
                   help="a step that can admit new prompts while others decode runs them alone, "
                        "at most every other step (TGI's and SGLang's schedule): first tokens "
                        "come sooner, decoding slows (docs/serving.md has the trade-off); off: "
                        "new prompts join the decode step, as vLLM V1 runs them "
                        "(default: %(default)s)")
    e.add_argument("--max-model-len", type=int, default=None,
                   help="prompt + output tokens per sequence (default: the model's)")
    e.add_argument("--preemption-mode", default="auto", choices=["auto", "recompute", "swap"],
                   help="when the KV cache is full, recompute preempted requests later or swap "
                        "their blocks to host memory (auto: swap requests with several sequences, "
                        "recompute single ones; default: %(default)s)")
    e.add_argument("--scheduling-policy", default="priority", choices=["priority", "fcfs"],
                   help="priority: the jobs this worker holds run in (priority, arrival) order, "
                        "and a more urgent job preempts less urgent running ones when the KV "
                        "cache is full (with every priority 0, the same as fcfs); fcfs: arrival "
                        "order, job priorities ignored (default: %(default)s)")
    e.add_argument("--swap-space", type=float, default=4.0,
                   help="GiB of host swap space (default: %(default)s)")
    e.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=None, help="reuse the KV cache of prompt prefixes that earlier "
                   "requests computed (vLLM's automatic prefix caching; default: off)")
    e.add_argument("--speculative-config", type=json_object, default=None,
                   help="speculative decoding, as JSON with vLLM's keys, e.g. "
                        "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
                        "\"prompt_lookup_max\": 4, \"disable_by_batch_size\": 8}'; outputs "
                        "stay exactly as without it (default: off)")
    e.add_argument("--seed", type=int, default=0,
                   help="seeds the sampling of requests without a seed of their own (jobs from "
                        "the producer that sample always carry one; default: %(default)s)")
    e.add_argument("--num-threads", type=int, default=1,
                   help="torch threads on the CPU. One, as vLLM serves: the worker shares the "
                        "host with Redis and the gateway, and a second thread costs them more "
                        "than it gains a small model. Raise it to the cores the worker has to "
                        "itself (a host or container for it alone, a model whose matrices are "
                        "large enough to split; 0: torch's default, one per core) "
                        "(default: %(default)s)")
    e.add_argument("--attention-backend", default=None, choices=["torch", "cupy", "cuda-shim"],
                   help="torch; cupy (genq's CUDA kernels on a GPU); cuda-shim (the same kernels "
                        "on the CPU, for checks; slow) (default: cupy on a GPU when it can "
                        "serve the model, else torch)")
    r = p.add_argument_group("reliability")
    r.add_argument("--heartbeat-ttl", type=float, default=10.0,
                   help="seconds without a heartbeat before other workers may reclaim this "
                        "one's jobs (default: %(default)s)")
    r.add_argument("--reclaim-interval", type=float, default=5.0,
                   help="seconds between looks for dead workers' jobs (default: %(default)s)")
    r.add_argument("--max-attempts", type=int, default=3,
                   help="deliveries of a job before it is dead-lettered (default: %(default)s)")
    r.add_argument("--result-ttl", type=int, default=3600,
                   help="reply stream TTL in seconds (default: %(default)s)")
    r.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds SIGTERM lets running jobs finish before the rest are handed "
                        "back to the queue (default: %(default)s)")
    r.add_argument("--flush-timeout", type=float, default=15.0,
                   help="seconds a stopping worker, once drained, waits for Redis to take its "
                        "last writes (acks, jobs handed back); what it could not write stays "
                        "pending under its name, for its next run or a reclaim "
                        "(default: %(default)s)")
    r.add_argument("--min-replicas", type=int, default=0,
                   help="writes that end jobs wait (up to 1 s, Redis WAIT) until this many "
                        "replicas hold them, so a failover loses no result a client may have "
                        "read; short acknowledgements are logged (default: 0, no wait)")
    r.add_argument("--shards", type=int, default=1,
                   help="spread the model's queue over this many streams (hash tags {m}, "
                        "{m#1}, ...: on a Redis Cluster, different slots and nodes); producers "
                        "learn it from Redis; give every worker of the model the same value "
                        "(default: 1)")
    s = p.add_argument_group("streaming")
    s.add_argument("--stream-interval", type=int, default=1,
                   help="tokens per sequence per tokens event: each sequence's first token is "
                        "sent at once, then every N tokens and the rest when it ends (fewer, "
                        "larger events: less worker and Redis CPU per token; default 1: every "
                        "token as it comes)")
    s.add_argument("--writer", default="process", choices=["process", "thread"],
                   help="write token events from a child process with a GIL of its own "
                        "(default: the engine's thread never waits for the writer's Python) or "
                        "from a thread of the worker")
    m = p.add_argument_group("metrics")
    m.add_argument("--metrics-port", type=int, default=0,
                   help="serve Prometheus metrics at http://HOST:PORT/metrics (default: 0, off)")
    m.add_argument("--metrics-host", default="0.0.0.0",
                   help="address the metrics server binds (default: %(default)s)")
    add_limit_args(p, "this worker")
    return p


def json_object(text: str) -> dict[str, object]:
    """A flag's JSON object (argparse reports the ValueError as the flag's fault)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object is needed, got {text!r}")
    return value


def default_name() -> str:
    return re.sub(r"[^A-Za-z0-9_.:-]", "-", socket.gethostname())[:128] or "worker"


def check_device(device: str) -> None:
    """--device names a device this machine's torch can use; ValueError (one line) if not."""
    import torch

    match = re.fullmatch(r"cpu|cuda(?::(\d+))?", device)
    if match is None:
        raise ValueError(f"--device must be cpu, cuda or cuda:<index>, got {device!r}")
    if device == "cpu":
        return
    if not torch.cuda.is_available():
        raise ValueError(f"--device {device}: no CUDA device is usable here (torch "
                         f"{torch.__version__}, CUDA build: {torch.version.cuda or 'no'}); "
                         "use --device cpu")
    index = int(match.group(1) or 0)
    if index >= torch.cuda.device_count():
        raise ValueError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA "
                         f"device(s) (cuda:0 to cuda:{torch.cuda.device_count() - 1})")


def metrics_bind_error(host: str, port: int, exc: OSError) -> str:
    """One line saying why the metrics server could not bind, and what to do about it."""
    if exc.errno == errno.EADDRINUSE:
        return (f"--metrics-port {port} is already in use on {host}: pick a free port, stop the "
                "process that holds it, or pass --metrics-port 0 to serve no metrics")
    return f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # The worker encodes one prompt at a time on its step thread: the tokenizer's thread pool
    # would only add a hand-off per call and wake threads on the cores Redis needs. A value the
    # user set wins.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s {args.name or default_name()} %(levelname)s "
                               "%(message)s")
    served = args.served_model_name or Path(args.model.rstrip("/")).name
    limits = limits_from_args(args)
    try:
        cfg = WorkerConfig(redis_url=args.redis, served_model_name=served,
                           name=args.name or default_name(), prefix=args.prefix,
                           device=args.device, heartbeat_ttl=args.heartbeat_ttl,
                           reclaim_interval=args.reclaim_interval, max_attempts=args.max_attempts,
                           result_ttl=args.result_ttl, drain_timeout=args.drain_timeout,
                           flush_timeout=args.flush_timeout,
                           limits=limits, metrics_port=args.metrics_port,
                           metrics_host=args.metrics_host,
                           stream_interval=args.stream_interval, writer=args.writer,
                           min_replicas=args.min_replicas, shards=args.shards)
    except ValueError as exc:
        print(f"genq worker: {exc}", file=sys.stderr)
        return 2
    # Bind the metrics port before loading the model: a taken port fails in a second, not after
    # minutes of loading weights.
    metrics_server = None
    if cfg.metrics_port:
        try:
            metrics_server = MetricsServer(CollectorRegistry(), cfg.metrics_host, cfg.metrics_port)
        except OSError as exc:
            print(f"genq worker: {metrics_bind_error(cfg.metrics_host, cfg.metrics_port, exc)}",
                  file=sys.stderr)
            return 1

    from engine.config import EngineConfig
    from engine.engine import Engine
    from worker.loop import Worker

    try:  # the options first: a wrong one is the flag's fault, not the model's
        engine_config = EngineConfig(
            model=args.model, device=args.device, dtype=args.dtype, block_size=args.block_size,
            num_gpu_blocks_override=args.num_gpu_blocks_override,
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            prefills_first=args.prefills_first,
            max_model_len=args.max_model_len, preemption_mode=args.preemption_mode,
            scheduling_policy=args.scheduling_policy,
            swap_space=args.swap_space, seed=args.seed, num_threads=args.num_threads,
            output_kind="delta", attention_backend=args.attention_backend,
            speculative_config=args.speculative_config,
            enable_prefix_caching=EngineConfig.enable_prefix_caching
            if args.enable_prefix_caching is None else args.enable_prefix_caching)
        check_device(args.device)
    except ValueError as exc:
        print(f"genq worker: {exc}", file=sys.stderr)
        return 2
    from engine.attention.kernel_check import KernelCheckError

    try:
        engine = Engine(engine_config)
    except (ValueError, OSError) as exc:  # a wrong path, an unsupported model
        print(f"genq worker: cannot load {args.model!r}: {exc}", file=sys.stderr)
        return 2
    except KernelCheckError as exc:  # --attention-backend cupy on a GPU its kernels fail on
        print(f"genq worker: {exc}", file=sys.stderr)
        return 1
    worker = Worker(engine, cfg, metrics_server=metrics_server)
    tune_gc()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        worker.request_stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return worker.run()


if __name__ == "__main__":
    sys.exit(main())
