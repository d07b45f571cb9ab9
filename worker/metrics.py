"""Prometheus metrics for the worker, in the text exposition format (version 0.0.4), with no
dependency: Counter / Gauge / Histogram with labels (thread-safe), a Registry that renders them,
and a tiny http.server thread serving GET /metrics.

The worker loop updates counters and histograms in memory only (no Redis round trip); engine
gauges are read from the loop's last engine.stats() at scrape time; queue lag and tokens/s are
sampled by the heartbeat thread, which talks to Redis anyway.
"""

from __future__ import annotations

import bisect
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import redis

from producer.protocol import waiting_entries

log = logging.getLogger("genq.worker")
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
LabelKey = tuple[str, ...]


def format_value(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if float(value).is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(float(value))


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _labels(pairs: Iterable[tuple[str, str]]) -> str:
    inner = ",".join(f'{k}="{_escape_label(v)}"' for k, v in pairs)
    return f"{{{inner}}}" if inner else ""


class _Metric:
    kind = "untyped"

    def __init__(self, name: str, help_text: str, labelnames: Sequence[str] = ()) -> None:
        self.name = name
        self.help = help_text
        self.labelnames = tuple(labelnames)
        self._lock = threading.Lock()

    def _key(self, labels: dict[str, str]) -> LabelKey:
        if not labels and not self.labelnames:
            return ()  # the per-token hot path: no label set to build
        if set(labels) != set(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}, got {sorted(labels)}")
        return tuple(str(labels[n]) for n in self.labelnames)

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {_escape_help(self.help)}", f"# TYPE {self.name} {self.kind}"]

    def samples(self, const: list[tuple[str, str]]) -> list[str]:
        raise NotImplementedError


class _Scalar(_Metric):
    def __init__(self, name: str, help_text: str, labelnames: Sequence[str] = ()) -> None:
        super().__init__(name, help_text, labelnames)
        self._values: dict[LabelKey, float] = {}
        if not self.labelnames:
            self._values[()] = 0.0

    def get(self, **labels: str) -> float:
        with self._lock:
            return self._values.get(self._key(labels), 0.0)

    def samples(self, const: list[tuple[str, str]]) -> list[str]:
        with self._lock:
            items = sorted(self._values.items())
        return [f"{self.name}{_labels([*const, *zip(self.labelnames, key, strict=True)])} "
                f"{format_value(v)}" for key, v in items]


class Counter(_Scalar):
    """Monotonic. `name` should end in _total."""

    kind = "counter"

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        if amount < 0:
            raise ValueError(f"{self.name}: a counter only goes up (got {amount})")
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def mirror(self, total: float, **labels: str) -> None:
        """Set from a cumulative count kept elsewhere (e.g. the engine's counters)."""
        key = self._key(labels)
        with self._lock:
            self._values[key] = max(self._values.get(key, 0.0), float(total))


class Gauge(_Scalar):
    kind = "gauge"

    def set(self, value: float, **labels: str) -> None:
        key = self._key(labels)
        with self._lock:
            self._values[key] = float(value)


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, name: str, help_text: str, buckets: Sequence[float],
                 labelnames: Sequence[str] = ()) -> None:
        super().__init__(name, help_text, labelnames)
        if "le" in self.labelnames:
            raise ValueError("a histogram cannot have a label named le")
        self.buckets = tuple(sorted(float(b) for b in buckets if not math.isinf(b)))
        self._data: dict[LabelKey, tuple[list[int], list[float]]] = {}  # counts, [sum]
        if not self.labelnames:
            self._data[()] = ([0] * (len(self.buckets) + 1), [0.0])

    def observe(self, value: float, **labels: str) -> None:
        self.observe_many(value, 1, **labels)

    def observe_many(self, value: float, times: int, **labels: str) -> None:
        """`times` observations of the same value (jobs that got tokens in the same step)."""
        key = self._key(labels)
        i = bisect.bisect_left(self.buckets, value)  # the first bucket with value <= le
        with self._lock:
            counts, total = self._data.setdefault(key, ([0] * (len(self.buckets) + 1), [0.0]))
            counts[i] += times
            total[0] += value * times

    def count(self, **labels: str) -> int:
        with self._lock:
            data = self._data.get(self._key(labels))
            return sum(data[0]) if data else 0

    def samples(self, const: list[tuple[str, str]]) -> list[str]:
        with self._lock:
            items = sorted((k, (list(c), s[0])) for k, (c, s) in self._data.items())
        lines = []
        for key, (counts, total) in items:
            base = [*const, *zip(self.labelnames, key, strict=True)]
            cumulative = 0
            for bound, n in zip([*self.buckets, math.inf], counts, strict=True):
                cumulative += n
                lines.append(f"{self.name}_bucket{_labels([*base, ('le', format_value(bound))])}"
                             f" {cumulative}")
            lines.append(f"{self.name}_sum{_labels(base)} {format_value(total)}")
            lines.append(f"{self.name}_count{_labels(base)} {cumulative}")
        return lines


class Registry:
    def __init__(self, const_labels: dict[str, str] | None = None) -> None:
        self.const = sorted((const_labels or {}).items())
        self._metrics: list[_Metric] = []
        self._hooks: list[Callable[[], None]] = []

    def register(self, metric: _Metric) -> Any:
        if any(m.name == metric.name for m in self._metrics):
            raise ValueError(f"metric {metric.name} registered twice")
        self._metrics.append(metric)
        return metric

    def counter(self, name: str, help_text: str, labelnames: Sequence[str] = ()) -> Counter:
        return self.register(Counter(name, help_text, labelnames))  # type: ignore[no-any-return]

    def gauge(self, name: str, help_text: str, labelnames: Sequence[str] = ()) -> Gauge:
        return self.register(Gauge(name, help_text, labelnames))  # type: ignore[no-any-return]

    def histogram(self, name: str, help_text: str, buckets: Sequence[float],
                  labelnames: Sequence[str] = ()) -> Histogram:
        return self.register(  # type: ignore[no-any-return]
            Histogram(name, help_text, buckets, labelnames))

    def on_collect(self, hook: Callable[[], None]) -> None:
        """Called at each scrape before rendering (for values read from elsewhere)."""
        self._hooks.append(hook)

    def render(self) -> str:
        for hook in self._hooks:
            try:
                hook()
            except Exception:  # a broken hook must not break the scrape
                log.exception("metrics collect hook failed")
        lines: list[str] = []
        for metric in self._metrics:
            lines += metric.header()
            lines += metric.samples(self.const)
        return "\n".join(lines) + "\n"


class MetricsServer:
    """GET /metrics on a daemon thread. The socket is bound at construction (so `genq worker`
    can fail on a taken port before it loads a model); `registry` may be swapped before start."""

    def __init__(self, registry: Registry, host: str, port: int) -> None:
        self.registry = registry
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                if self.path.split("?", 1)[0] not in ("/metrics", "/metrics/"):
                    self.send_error(404, "try /metrics")
                    return
                body = server.registry.render().encode()
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self.port = int(self.httpd.server_address[1])
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="genq-metrics",
                                       daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class WorkerMetrics:
    """Every metric the worker exports; the loop calls the on_* methods (memory only)."""

    def __init__(self, model: str, worker: str, jobs_key: str, group: str) -> None:
        self.registry = r = Registry({"model": model, "worker": worker})
        self.jobs_key = jobs_key
        self.group = group
        self.queue_lag = r.gauge(
            "genq_queue_lag", "Entries in the model's job stream not yet delivered to any worker "
            "(consumer group lag), sampled by the heartbeat thread")
        self.queue_pending = r.gauge(
            "genq_queue_pending", "Entries delivered to workers and not yet acknowledged "
            "(the consumer group's pending entries), sampled by the heartbeat thread")
        self.running = r.gauge("genq_engine_running_requests", "Requests the engine is running")
        self.waiting = r.gauge("genq_engine_waiting_requests", "Requests waiting in the engine")
        self.swapped = r.gauge("genq_engine_swapped_requests",
                               "Requests swapped out to host memory")
        self.kv_usage = r.gauge("genq_engine_kv_cache_usage_ratio",
                                "Fraction of device KV cache blocks in use (0..1)")
        self.free_blocks = r.gauge("genq_engine_free_kv_blocks", "Free device KV cache blocks")
        self.total_blocks = r.gauge("genq_engine_total_kv_blocks", "Device KV cache blocks")
        self.held = r.gauge("genq_worker_held_jobs",
                            "Job entries this worker holds (running or being finished)")
        self.preemptions = r.counter("genq_engine_preemptions_total",
                                     "Preemptions by mode (recompute or swap)", ["mode"])
        self.swaps = r.counter("genq_engine_swaps_total",
                               "Sequence groups swapped out to or in from host memory",
                               ["direction"])
        self.prompt_tokens = r.counter(
            "genq_engine_prompt_tokens_total", "Prompt tokens of the requests the engine "
            "scheduled (a re-prefill after a recompute preemption counts again)")
        self.cached_tokens = r.counter(
            "genq_engine_prefix_cache_hit_tokens_total", "Of those, tokens whose KV came from "
            "the prefix cache (genq worker --enable-prefix-caching)")
        self.tokens = r.counter("genq_worker_generated_tokens_total",
                                "Output tokens generated and handed to the writer")
        self.tokens_per_s = r.gauge(
            "genq_worker_generated_tokens_per_second",
            "Output tokens per second over the last heartbeat interval")
        self.jobs_finished = r.counter(
            "genq_worker_jobs_finished_total", "Job attempts that ended on this worker, by "
            "outcome (done, engine_error, cancelled, deadline_exceeded, rejected, lost, "
            "handed_back)", ["outcome"])
        self.ttft = r.histogram("genq_worker_time_to_first_token_seconds",
                                "Seconds from admission to the first output token",
                                TTFT_BUCKETS)
        self.itl = r.histogram("genq_worker_inter_token_latency_seconds",
                               "Seconds between consecutive steps that gave a job new tokens",
                               ITL_BUCKETS)
        self._stats: Callable[[], tuple[dict[str, Any], int]] = lambda: ({}, 0)
        self._rate_at = time.monotonic()
        self._rate_tokens = 0.0
        r.on_collect(self._collect)

    def read_stats_from(self, source: Callable[[], tuple[dict[str, Any], int]]) -> None:
        """`source` returns (the loop's last engine.stats(), held jobs) at scrape time."""
        self._stats = source

    def _collect(self) -> None:
        stats, held = self._stats()
        self.running.set(stats.get("num_running", 0))
        self.waiting.set(stats.get("num_waiting", 0))
        self.swapped.set(stats.get("num_swapped", 0))
        self.kv_usage.set(stats.get("kv_usage", 0.0))
        self.free_blocks.set(stats.get("num_free_blocks", 0))
        self.total_blocks.set(stats.get("num_total_blocks", 0))
        self.held.set(held)
        self.preemptions.mirror(stats.get("num_recompute_preemptions", 0), mode="recompute")
        self.preemptions.mirror(stats.get("num_swap_outs", 0), mode="swap")
        self.swaps.mirror(stats.get("num_swap_outs", 0), direction="out")
        self.swaps.mirror(stats.get("num_swap_ins", 0), direction="in")
        self.prompt_tokens.mirror(stats.get("num_prompt_tokens", 0))
        self.cached_tokens.mirror(stats.get("num_cached_tokens", 0))

    def sample(self, conn: redis.Redis) -> None:
        """From the heartbeat thread: queue lag (one round trip) and tokens/s."""
        now, tokens = time.monotonic(), self.tokens.get()
        if now > self._rate_at:
            self.tokens_per_s.set((tokens - self._rate_tokens) / (now - self._rate_at))
        self._rate_at, self._rate_tokens = now, tokens
        pipe = conn.pipeline(transaction=False)
        pipe.xlen(self.jobs_key)
        pipe.xinfo_groups(self.jobs_key)
        length, groups = pipe.execute(raise_on_error=False)
        if isinstance(length, Exception) or isinstance(groups, Exception):
            return  # no stream yet (or it expired): leave the last sample
        for g in groups:
            name = g.get("name")
            if (name.decode() if isinstance(name, bytes) else name) != self.group:
                continue
            pending = int(g.get("pending") or 0)
            self.queue_lag.set(waiting_entries(g.get("lag"), pending, int(length)))
            self.queue_pending.set(pending)
