"""Prometheus metrics: a real worker process with --metrics-port, scraped over HTTP and parsed
by a small text-format parser of the test's own (independent of prometheus_client, which the
worker renders with)."""

from __future__ import annotations

import math
import re
import socket
import urllib.request
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from producer import Client, JobError
from tests.harness.fleet import (
    RedisServer,
    WorkerFactory,
    free_port,
    reply_events,
    wait_for,
    wait_heartbeats,
)
from worker.metrics import WorkerMetrics, render

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"(?:,|$)')
HISTOGRAMS = ("genq_worker_time_to_first_token_seconds", "genq_worker_inter_token_latency_seconds")


class Scrape:
    def __init__(self, text: str) -> None:
        self.text = text
        self.help: dict[str, str] = {}
        self.type: dict[str, str] = {}
        self.samples: Samples = {}
        self.order: list[tuple[str, dict[str, str], float]] = []
        for line in text.splitlines():
            if line.startswith("# HELP "):
                name, _, doc = line[7:].partition(" ")
                assert name not in self.help, f"two HELP lines for {name}"
                self.help[name] = doc
            elif line.startswith("# TYPE "):
                name, _, kind = line[7:].partition(" ")
                assert kind in ("counter", "gauge", "histogram", "summary", "untyped"), line
                assert name in self.help and name not in self.type, f"TYPE out of place: {line}"
                self.type[name] = kind
            else:
                m = _SAMPLE.match(line)
                assert m, f"not a sample line: {line!r}"
                name, raw_labels, value = m.groups()
                labels: dict[str, str] = {}
                if raw_labels:
                    pairs = _LABEL.findall(raw_labels)
                    assert ",".join(f'{k}="{v}"' for k, v in pairs) == raw_labels, line
                    labels = {k: re.sub(r"\\(.)", lambda c: {"n": "\n"}.get(c[1], c[1]), v)
                              for k, v in pairs}
                family = re.sub(r"_(bucket|sum|count)$", "", name)
                family = family if family in self.type else name
                assert family in self.type, f"sample before its TYPE: {line}"
                self.order.append((name, labels, float(value)))
                key = (name, tuple(sorted(labels.items())))
                assert key not in self.samples, f"duplicate sample {line}"
                self.samples[key] = float(value)

    def get(self, name: str, **labels: str) -> float:
        full = {"model": "tiny", "worker": "metered", **labels}
        return self.samples[(name, tuple(sorted(full.items())))]

    def has(self, name: str, **labels: str) -> bool:
        full = {"model": "tiny", "worker": "metered", **labels}
        return (name, tuple(sorted(full.items()))) in self.samples

    def buckets(self, name: str) -> list[tuple[float, float]]:
        return [(float(lab["le"]), v) for n, lab, v in self.order if n == f"{name}_bucket"]

    def check_format(self) -> None:
        assert self.text.endswith("\n")
        for name, kind in self.type.items():
            if kind == "counter":
                assert name.endswith("_total"), name
        for name in HISTOGRAMS:
            assert self.type[name] == "histogram"
            buckets = self.buckets(name)
            bounds = [b for b, _ in buckets]
            assert bounds == sorted(bounds) and bounds[-1] == math.inf
            counts = [c for _, c in buckets]
            assert counts == sorted(counts), f"{name} buckets not cumulative: {counts}"
            assert counts[-1] == self.get(f"{name}_count")


def scrape(port: int) -> Scrape:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
        result = Scrape(resp.read().decode())
    result.check_format()
    return result


@pytest.fixture
def long_llama(tiny_llama: Path, tmp_path: Path) -> Path:
    """The tiny llama with room for 8,192 positions (RoPE tables have no weights), so a job of
    4,000 tokens (the job cap; 256 blocks hold 4,096) holds the worker's only slot for seconds
    however fast the machine is."""
    import shutil

    from transformers import AutoConfig

    path = tmp_path / "llama"
    shutil.copytree(tiny_llama, path)
    config = AutoConfig.from_pretrained(str(path))
    config.max_position_embeddings = 8192
    config.save_pretrained(str(path))
    return path


def test_metrics_count_exactly_what_the_worker_did(
        redis_server: RedisServer, workers: WorkerFactory, long_llama: Path) -> None:
    port = free_port()
    proc = workers.start(redis_server.url, long_llama, "metered", "--max-num-seqs", "1",
                         "--metrics-port", str(port))
    wait_heartbeats(redis_server, [proc])
    first = wait_for(lambda: scrape(port).has("genq_queue_lag") and scrape(port), timeout=10,
                     what="a first queue lag sample")
    assert first.get("genq_engine_total_kv_blocks") == 256
    assert first.get("genq_engine_free_kv_blocks") == 256
    assert first.get("genq_engine_kv_cache_usage_ratio") == 0
    for name in ("running", "waiting", "swapped"):
        assert first.get(f"genq_engine_{name}_requests") == 0
    assert first.get("genq_worker_generated_tokens_total") == 0
    assert first.get("genq_worker_time_to_first_token_seconds_count") == 0
    assert first.get("genq_queue_lag") == 0 and first.get("genq_queue_pending") == 0
    assert not any(n == "genq_worker_jobs_finished_total" for n, _ in first.samples)

    # One slot: a long job holds it while three more wait in the stream (exactly 3 lag).
    client = Client(redis_server.url)
    long_job = client.submit("the quick brown", {"temperature": 0, "max_tokens": 4000,
                                                 "ignore_eos": True}, model="tiny")
    stream = long_job.stream(timeout=60)
    assert next(stream)["type"] == "started"
    assert next(stream)["type"] == "tokens"
    short = [client.submit(f"prompt number {i}", {"temperature": 0, "max_tokens": 3 + i},
                           model="tiny") for i in range(3)]
    busy = wait_for(lambda: (s := scrape(port)).get("genq_queue_lag") == 3 and s, timeout=20,
                    what="queue lag 3 while the long job holds the only slot")
    assert busy.get("genq_queue_pending") == 1
    assert busy.get("genq_engine_running_requests") == 1
    assert busy.get("genq_worker_held_jobs") == 1
    assert busy.get("genq_engine_kv_cache_usage_ratio") > 0
    assert busy.get("genq_worker_time_to_first_token_seconds_count") == 1
    long_job.cancel()
    with pytest.raises(JobError) as exc:
        long_job.result(timeout=30)
    assert exc.value.code == "cancelled"
    results = [job.result(timeout=60) for job in short]

    idle = wait_for(lambda: (s := scrape(port)).get("genq_worker_held_jobs") == 0
                    and s.get("genq_queue_lag") == 0 and s.get("genq_queue_pending") == 0 and s,
                    timeout=20, what="an idle worker and an empty queue in the metrics")
    jobs = [long_job, *short]
    tokens_events = [e for job in jobs for e in reply_events(redis_server, job.id)
                     if e["type"] == "tokens"]
    streamed = sum(len(e["token_ids"]) for e in tokens_events)
    assert sum(r["usage"]["completion_tokens"] for r in results) == sum(
        len(e["token_ids"]) for job in short for e in reply_events(redis_server, job.id)
        if e["type"] == "tokens")
    assert idle.get("genq_worker_generated_tokens_total") == streamed
    assert idle.get("genq_worker_jobs_finished_total", outcome="done") == 3
    assert idle.get("genq_worker_jobs_finished_total", outcome="cancelled") == 1
    assert sum(v for (n, _), v in idle.samples.items()
               if n == "genq_worker_jobs_finished_total") == 4
    # One first token per job; one inter-token gap per later step that gave a job tokens, and
    # a step gives an n=1 job exactly one token (the writer may coalesce events, so count tokens).
    assert idle.get("genq_worker_time_to_first_token_seconds_count") == 4
    assert idle.get("genq_worker_inter_token_latency_seconds_count") == streamed - 4
    ttft_done = sum(r["timing"]["ttft_s"] for r in results)
    assert idle.get("genq_worker_time_to_first_token_seconds_sum") >= ttft_done - 1e-9
    for name in ("running", "waiting", "swapped"):
        assert idle.get(f"genq_engine_{name}_requests") == 0
    assert idle.get("genq_engine_free_kv_blocks") == 256
    assert idle.get("genq_engine_kv_cache_usage_ratio") == 0
    assert idle.get("genq_engine_preemptions_total", mode="recompute") == 0
    assert idle.get("genq_engine_preemptions_total", mode="swap") == 0
    long_prompt = len(AutoTokenizer.from_pretrained(str(long_llama))("the quick brown").input_ids)
    assert idle.get("genq_engine_prompt_tokens_total") == long_prompt + sum(
        r["usage"]["prompt_tokens"] for r in results)
    assert idle.get("genq_engine_prefix_cache_hit_tokens_total") == 0  # (caching is off)
    assert idle.get("genq_engine_swaps_total", direction="out") == 0
    assert idle.get("genq_engine_swaps_total", direction="in") == 0
    assert proc.terminate() == 0


EXPORTED = [  # every metric, in the order of a scrape
    "genq_queue_lag", "genq_queue_pending", "genq_worker_generated_tokens_total",
    "genq_worker_generated_tokens_per_second", "genq_worker_jobs_finished_total",
    "genq_engine_running_requests", "genq_engine_waiting_requests",
    "genq_engine_swapped_requests", "genq_engine_kv_cache_usage_ratio",
    "genq_engine_free_kv_blocks", "genq_engine_total_kv_blocks", "genq_worker_held_jobs",
    "genq_engine_preemptions_total", "genq_engine_swaps_total", "genq_engine_prompt_tokens_total",
    "genq_engine_prefix_cache_hit_tokens_total", "genq_worker_time_to_first_token_seconds",
    "genq_worker_inter_token_latency_seconds"]


def families(text: str) -> dict[str, list[str]]:
    """A scrape's lines by metric family (the name of its HELP line)."""
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name = line.split(" ")[2]
        out.setdefault(name, []).append(line)
    return out


def test_rendering_is_the_text_format_exactly() -> None:
    metrics = WorkerMetrics('a"b\\c\nd', "w", ["genq:jobs:tiny"], "genq")
    metrics.read_stats_from(lambda: ({"num_running": 2, "kv_usage": 0.25, "num_swap_outs": 3},
                                     1))
    metrics.jobs_finished.inc(2, outcome="done")
    metrics.jobs_finished.inc(0.5, outcome="done")
    for value in (0.0005, 0.001, 0.5, 30.0):
        metrics.itl.observe(value)
    with pytest.raises(ValueError, match="Counters can only be incremented by non-negative"):
        metrics.jobs_finished.inc(-1, outcome="done")
    with pytest.raises(ValueError, match="Incorrect label names"):
        metrics.jobs_finished.inc(1)  # the outcome is missing
    labels = 'model="a\\"b\\\\c\\nd",worker="w"'
    text = render(metrics.registry)
    parts = families(text)
    assert list(parts) == EXPORTED
    assert parts["genq_worker_jobs_finished_total"] == [
        "# HELP genq_worker_jobs_finished_total Job attempts that ended on this worker, by "
        "outcome (done, engine_error, cancelled, deadline_exceeded, rejected, lost, handed_back)",
        "# TYPE genq_worker_jobs_finished_total counter",
        'genq_worker_jobs_finished_total{model="a\\"b\\\\c\\nd",outcome="done",worker="w"} 2.5']
    assert parts["genq_engine_preemptions_total"][2:] == [
        f'genq_engine_preemptions_total{{mode="recompute",{labels}}} 0.0',
        f'genq_engine_preemptions_total{{mode="swap",{labels}}} 3.0']
    assert parts["genq_engine_kv_cache_usage_ratio"][2:] == [
        f"genq_engine_kv_cache_usage_ratio{{{labels}}} 0.25"]
    assert parts["genq_worker_held_jobs"][2:] == [f"genq_worker_held_jobs{{{labels}}} 1.0"]
    bounds = ["0.001", "0.0025", "0.005", "0.01", "0.025", "0.05", "0.1", "0.25", "0.5", "1.0",
              "2.5", "10.0", "+Inf"]
    counts = [2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 4]
    name = "genq_worker_inter_token_latency_seconds"
    assert parts[name] == [
        f"# HELP {name} Seconds between consecutive steps that gave a job new tokens",
        f"# TYPE {name} histogram",
        *(f'{name}_bucket{{le="{b}",{labels}}} {c}.0' for b, c in zip(bounds, counts, strict=True)),
        f"{name}_count{{{labels}}} 4.0", f"{name}_sum{{{labels}}} 30.5015"]
    parsed = Scrape(text)
    assert parsed.samples[("genq_worker_jobs_finished_total", (
        ("model", 'a"b\\c\nd'), ("outcome", "done"), ("worker", "w")))] == 2.5


def test_a_taken_metrics_port_stops_the_worker_with_one_line_before_it_loads_the_model(
        redis_server: RedisServer, workers: WorkerFactory, tmp_path: Path) -> None:
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        # No model at this path: the worker must fail on the port before it tries to load one.
        proc = workers.start(redis_server.url, tmp_path / "never-loaded", "clash",
                             "--metrics-port", str(port), "--metrics-host", "127.0.0.1")
        assert proc.proc.wait(timeout=60) == 1
    finally:
        holder.close()
    assert proc.output() == (
        f"genq worker: --metrics-port {port} is already in use on 127.0.0.1: pick a free port, "
        "stop the process that holds it, or pass --metrics-port 0 to serve no metrics\n")
    assert redis_server.client().keys("genq:*") == []  # it never reached Redis either


def test_observe_many_counts_as_that_many_observations() -> None:
    one, many = (WorkerMetrics("tiny", "metered", ["genq:jobs:tiny"], "genq") for _ in range(2))
    for value, times in ((0.0005, 3), (0.05, 256), (0.5, 1)):
        for _ in range(times):
            one.itl.observe(value)
        many.itl.observe_many(value, times)

    def lines(metrics: WorkerMetrics) -> list[str]:
        return [line for line in families(render(metrics.registry))[
            "genq_worker_inter_token_latency_seconds"] if "_sum" not in line]

    assert lines(many) == lines(one)  # buckets and count exactly; the sum up to rounding
    assert Scrape(render(many.registry)).get("genq_worker_inter_token_latency_seconds_sum") == (
        pytest.approx(3 * 0.0005 + 256 * 0.05 + 0.5))
    assert many.itl.count() == 260
