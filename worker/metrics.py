"""Prometheus metrics for the worker, on prometheus_client, in the text exposition format
(version 0.0.4) on GET /metrics from a small http.server thread.

The worker loop updates counters and histograms in memory only (no Redis round trip); engine
gauges and counters are read from the loop's last engine.stats() at scrape time (a collector);
queue lag and tokens/s are sampled by the heartbeat thread, which talks to Redis anyway. Every
sample carries the labels model and worker.
"""

from __future__ import annotations

import bisect
import itertools
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import redis
from prometheus_client import CollectorRegistry, Counter, Gauge, disable_created_metrics
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from producer.protocol import waiting_entries

# No `_created` series beside each counter and histogram: the worker exports its metrics' own
# samples only (as Prometheus' text format 0.0.4 clients did before that series existed).
disable_created_metrics()
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
# Read from engine.stats() at scrape time: (name, help, stats key).
ENGINE_GAUGES = (
    ("genq_engine_running_requests", "Requests the engine is running", "num_running"),
    ("genq_engine_waiting_requests", "Requests waiting in the engine", "num_waiting"),
    ("genq_engine_swapped_requests", "Requests swapped out to host memory", "num_swapped"),
    ("genq_engine_kv_cache_usage_ratio", "Fraction of device KV cache blocks in use (0..1)",
     "kv_usage"),
    ("genq_engine_free_kv_blocks", "Free device KV cache blocks", "num_free_blocks"),
    ("genq_engine_total_kv_blocks", "Device KV cache blocks", "num_total_blocks"),
)
# The engine's cumulative counts: (name, help, the label the samples differ in, {label value:
# stats key}).
ENGINE_COUNTERS = (
    ("genq_engine_preemptions_total", "Preemptions by mode (recompute or swap)", "mode",
     {"recompute": "num_recompute_preemptions", "swap": "num_swap_outs"}),
    ("genq_engine_swaps_total", "Sequence groups swapped out to or in from host memory",
     "direction", {"out": "num_swap_outs", "in": "num_swap_ins"}),
    ("genq_engine_prompt_tokens_total", "Prompt tokens of the requests the engine scheduled "
     "(a re-prefill after a recompute preemption counts again)", None,
     {"": "num_prompt_tokens"}),
    ("genq_engine_prefix_cache_hit_tokens_total", "Of those, tokens whose KV came from the "
     "prefix cache (genq worker --enable-prefix-caching)", None, {"": "num_cached_tokens"}),
)
# Speculative decoding's counts (vLLM's spec_decode_* names), exported when it is on
# (genq worker --speculative-config); per position: proposals accepted at position j.
SPEC_COUNTERS = (
    ("genq_engine_spec_decode_num_drafts_total", "Sequences verified with proposals",
     "spec_decode_num_drafts"),
    ("genq_engine_spec_decode_num_draft_tokens_total", "Proposed tokens verified",
     "spec_decode_num_draft_tokens"),
    ("genq_engine_spec_decode_num_accepted_tokens_total", "Proposed tokens accepted",
     "spec_decode_num_accepted_tokens"),
    ("genq_engine_spec_decode_num_emitted_tokens_total", "Tokens verification emitted (the "
     "accepted ones and the target's own token after them)", "spec_decode_num_emitted_tokens"),
)
SPEC_PER_POS = ("genq_engine_spec_decode_num_accepted_tokens_per_pos_total",
                "Proposed tokens accepted, by position in the proposal (0: the first)",
                "spec_decode_num_accepted_tokens_per_pos")


def render(registry: CollectorRegistry) -> str:
    return generate_latest(registry).decode()


class StepHistogram:
    """A histogram whose observations come in groups: the jobs a step gave tokens after the same
    interval. observe_many(value, times) is one bucket search, where prometheus_client's
    Histogram takes one observation per call; WorkerMetrics exports it at scrape time."""

    def __init__(self, name: str, help_text: str, buckets: Sequence[float]) -> None:
        self.name = name
        self.help = help_text
        self.bounds = tuple(sorted(float(b) for b in buckets if not math.isinf(b)))
        self._counts = [0] * (len(self.bounds) + 1)  # the last: above every bound
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        self.observe_many(value, 1)

    def observe_many(self, value: float, times: int) -> None:
        i = bisect.bisect_left(self.bounds, value)  # the first bucket with value <= le
        with self._lock:
            self._counts[i] += times
            self._sum += value * times

    def count(self) -> int:
        with self._lock:
            return sum(self._counts)

    def family(self, labels: dict[str, str]) -> HistogramMetricFamily:
        with self._lock:
            counts, total = list(self._counts), self._sum
        bounds = [floatToGoString(b) for b in (*self.bounds, math.inf)]
        family = HistogramMetricFamily(self.name, self.help, labels=list(labels))
        family.add_metric(list(labels.values()),
                          list(zip(bounds, itertools.accumulate(counts), strict=True)), total)
        return family


class LabelledCounter:
    """A counter with the worker's labels bound: inc(amount, **labels) names the others."""

    def __init__(self, counter: Counter, const: dict[str, str]) -> None:
        self._counter = counter
        self._const = const

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        self._counter.labels(**self._const, **labels).inc(amount)


class MetricsServer:
    """GET /metrics on a daemon thread. The socket is bound at construction (so `genq worker`
    can fail on a taken port before it loads a model); `registry` may be swapped before start."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        self.registry = registry
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                if self.path.split("?", 1)[0] not in ("/metrics", "/metrics/"):
                    self.send_error(404, "try /metrics")
                    return
                body = generate_latest(server.registry)
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


class WorkerMetrics(Collector):
    """Every metric the worker exports; the loop calls the instruments (memory only)."""

    def __init__(self, model: str, worker: str, jobs_keys: list[str], group: str) -> None:
        self.registry = r = CollectorRegistry()
        self.labels = labels = {"model": model, "worker": worker}
        self.jobs_keys = jobs_keys  # the model's priority lanes: the queue gauges sum them
        self.group = group

        def gauge(name: str, help_text: str) -> Any:
            return Gauge(name, help_text, list(labels), registry=r).labels(**labels)

        self.queue_lag = gauge(
            "genq_queue_lag", "Entries in the model's job stream not yet delivered to any worker "
            "(consumer group lag), sampled by the heartbeat thread")
        self.queue_pending = gauge(
            "genq_queue_pending", "Entries delivered to workers and not yet acknowledged "
            "(the consumer group's pending entries), sampled by the heartbeat thread")
        self.tokens = Counter("genq_worker_generated_tokens_total",
                              "Output tokens generated and handed to the writer", list(labels),
                              registry=r).labels(**labels)
        self.tokens_per_s = gauge("genq_worker_generated_tokens_per_second",
                                  "Output tokens per second over the last heartbeat interval")
        self.jobs_finished = LabelledCounter(Counter(
            "genq_worker_jobs_finished_total", "Job attempts that ended on this worker, by "
            "outcome (done, engine_error, cancelled, deadline_exceeded, rejected, lost, "
            "handed_back)", [*labels, "outcome"], registry=r), labels)
        self.ttft = StepHistogram("genq_worker_time_to_first_token_seconds",
                                  "Seconds from admission to the first output token",
                                  TTFT_BUCKETS)
        self.itl = StepHistogram("genq_worker_inter_token_latency_seconds",
                                 "Seconds between consecutive steps that gave a job new tokens",
                                 ITL_BUCKETS)
        self._stats: Callable[[], tuple[dict[str, Any], int]] = lambda: ({}, 0)
        self._rate_at = time.monotonic()
        self._rate_tokens = 0.0
        r.register(self)

    def read_stats_from(self, source: Callable[[], tuple[dict[str, Any], int]]) -> None:
        """`source` returns (the loop's last engine.stats(), held jobs) at scrape time."""
        self._stats = source

    def collect(self) -> Iterator[Metric]:
        """The engine's state at scrape time, and the two histograms."""
        stats, held = self._stats()
        names, values = list(self.labels), list(self.labels.values())
        gauges = [*ENGINE_GAUGES, ("genq_worker_held_jobs", "Job entries this worker holds "
                                   "(running or being finished)", None)]
        for name, help_text, key in gauges:
            gauge = GaugeMetricFamily(name, help_text, labels=names)
            gauge.add_metric(values, held if key is None else stats.get(key, 0))
            yield gauge
        for name, help_text, label, keys in ENGINE_COUNTERS:
            counter = CounterMetricFamily(name, help_text,
                                          labels=names + ([label] if label else []))
            for value, key in keys.items():
                counter.add_metric(values + ([value] if label else []), stats.get(key, 0))
            yield counter
        if "spec_decode_num_drafts" in stats:
            yield from self._spec_counters(stats)
        yield self.ttft.family(self.labels)
        yield self.itl.family(self.labels)

    def _spec_counters(self, stats: dict[str, Any]) -> Iterator[Metric]:
        names, values = list(self.labels), list(self.labels.values())
        for name, help_text, key in SPEC_COUNTERS:
            counter = CounterMetricFamily(name, help_text, labels=names)
            counter.add_metric(values, stats[key])
            yield counter
        name, help_text, key = SPEC_PER_POS
        counter = CounterMetricFamily(name, help_text, labels=[*names, "position"])
        for position, count in enumerate(stats[key]):
            counter.add_metric([*values, str(position)], count)
        yield counter

    def sample(self, conn: redis.Redis) -> None:
        """From the heartbeat thread: queue lag (one round trip) and tokens/s."""
        now = time.monotonic()
        tokens = self.registry.get_sample_value("genq_worker_generated_tokens_total",
                                                self.labels) or 0.0
        if now > self._rate_at:
            self.tokens_per_s.set((tokens - self._rate_tokens) / (now - self._rate_at))
        self._rate_at, self._rate_tokens = now, tokens
        pipe = conn.pipeline(transaction=False)
        for key in self.jobs_keys:
            pipe.xlen(key)
            pipe.xinfo_groups(key)
        replies = pipe.execute(raise_on_error=False)
        lag = pending = 0
        for length, groups in zip(replies[::2], replies[1::2], strict=True):
            if isinstance(length, Exception) or isinstance(groups, Exception):
                continue  # no stream yet (or it expired)
            for g in groups:
                name = g.get("name")
                if (name.decode() if isinstance(name, bytes) else name) == self.group:
                    held = int(g.get("pending") or 0)
                    lag += waiting_entries(g.get("lag"), held, int(length))
                    pending += held
        self.queue_lag.set(lag)
        self.queue_pending.set(pending)
