"""Speculative decoding through a real worker (genq worker --speculative-config): a job streams
each output position once, in order, and equals the offline output without speculation; the
worker's Prometheus metrics count what verification accepted."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

from producer import Client
from tests.harness.fleet import (
    RedisServer,
    WorkerFactory,
    as_expected,
    free_port,
    reply_events,
    streamed_tokens,
    wait_for,
    wait_heartbeats,
)
from tests.harness.oracle import OracleOf

DEMO = Path(__file__).resolve().parents[2] / "models" / "genq-tiny-stdlib"
ACCEPTED = "genq_engine_spec_decode_num_accepted_tokens_total"
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}


def _counter(text: str, name: str, **labels: str) -> float:
    wanted = {"model": "tiny", "worker": "spec", **labels}
    for line in text.splitlines():
        m = re.match(rf"^{name}\{{(.*)\}} (\S+)$", line)
        if m and dict(re.findall(r'(\w+)="([^"]*)"', m[1])) == wanted:
            return float(m[2])
    raise AssertionError(f"no sample {name} {wanted}")


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        return resp.read().decode()  # type: ignore[no-any-return]


def test_a_speculated_job_streams_each_position_once_and_equals_offline(
        redis_server: RedisServer, workers: WorkerFactory, oracle_of: OracleOf) -> None:
    port = free_port()
    proc = workers.start(redis_server.url, DEMO, "spec", "--speculative-config",
                         json.dumps(SPEC), "--metrics-port", str(port))
    wait_heartbeats(redis_server, [proc])
    prompt = "def __init__(self, name):\n    self.name = "
    params = {"temperature": 0, "max_tokens": 96, "ignore_eos": True}
    job = Client(redis_server.url).submit(prompt, params, model="tiny")
    result = job.result(timeout=300)
    expected = oracle_of(DEMO)([prompt], params)[0]
    assert as_expected(result) == expected
    events = reply_events(redis_server, job.id)
    positions, tokens = streamed_tokens(events)
    assert positions == list(range(96)) and tokens == expected[0][0]
    assert sum(e["type"] == "started" for e in events) == 1

    def accepted_scrape() -> str | None:  # (the stats refresh after the step that ended it)
        text = _scrape(port)
        return text if _counter(text, ACCEPTED) > 0 else None

    text = wait_for(accepted_scrape, what="accepted tokens in the metrics")
    accepted = _counter(text, ACCEPTED)
    drafts = _counter(text, "genq_engine_spec_decode_num_drafts_total")
    assert accepted > 0
    assert _counter(text, "genq_engine_spec_decode_num_emitted_tokens_total") == \
        drafts + accepted
    assert sum(_counter(text, "genq_engine_spec_decode_num_accepted_tokens_per_pos_total",
                        position=str(j)) for j in range(4)) == accepted
