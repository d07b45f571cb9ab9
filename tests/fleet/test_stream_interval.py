"""--stream-interval N: each sequence's first token goes out at once, then every N tokens, and
what is left when the sequence ends; the client reassembles exactly what the offline engine
generates. (The writer may merge chunks when it falls behind Redis; merged chunks still start
and end on the interval's boundaries, which is what these tests check of the raw events.)"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.outputs import CompletionOutput, RequestOutput
from producer import Client
from producer.protocol import JobSpec
from tests.harness.fleet import (
    RedisServer,
    WorkerProcess,
    reply_events,
    serving_worker,
)
from tests.harness.oracle import Oracle
from worker.config import WorkerConfig
from worker.jobs import ActiveJob, token_events
from worker.main import main as worker_main

INTERVAL = 4


@pytest.fixture(scope="module")
def worker(server: RedisServer, tiny_llama: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    yield from serving_worker(server, tiny_llama, tmp_path_factory.mktemp("workers"), "chunky",
                              "--stream-interval", str(INTERVAL))


def chunks(server: RedisServer, job_id: str) -> dict[int, list[tuple[int, list[int]]]]:
    """Per sequence index: (pos, token_ids) of each raw tokens event, in stream order."""
    out: dict[int, list[tuple[int, list[int]]]] = {}
    for e in reply_events(server, job_id):
        if e["type"] == "tokens":
            out.setdefault(e["index"], []).append((e["pos"], e["token_ids"]))
    return out


def on_boundaries(pieces: list[tuple[int, list[int]]], total: int) -> bool:
    """Contiguous from 0 to `total`, every piece starting and ending at 0, 1 + k * INTERVAL or
    the sequence's end."""
    bounds = {0, total} | set(range(1, total, INTERVAL))
    pos = 0
    for start, ids in pieces:
        if start != pos or start not in bounds or start + len(ids) not in bounds or not ids:
            return False
        pos = start + len(ids)
    return pos == total


def test_tokens_go_out_every_interval_and_add_up_to_the_offline_output(
        server: RedisServer, worker: WorkerProcess,
        offline: Callable[[list[str], Any], list[Any]]) -> None:
    params = {"temperature": 0, "max_tokens": 10, "ignore_eos": True}
    [expected] = offline(["the quick brown fox"], params)
    job = Client(server.url).submit("the quick brown fox", params, model="tiny")
    events = list(job.stream(timeout=60))
    streamed = [t for e in events if e["type"] == "tokens" for t in e["token_ids"]]
    text = "".join(e["text"] for e in events if e["type"] == "tokens")
    assert (streamed, text, events[-1]["outputs"][0]["finish_reason"]) == expected[0]
    pieces = chunks(server, job.id)[0]
    assert on_boundaries(pieces, 10), pieces


def test_the_worker_sends_the_first_token_at_once_then_every_interval() -> None:
    """What the worker hands its writer per step (the writer may merge steps that queue up
    behind a round trip, so the raw stream alone cannot show this)."""
    job = ActiveJob(entry_id="1-0", deliveries=1, attempt=1, spec=JobSpec(id="j", model="m"),
                    fields={}, reply_key="r", stream_tokens=True, stream_interval=INTERVAL)
    sent = []
    for step in range(10):
        done = step == 9
        out = RequestOutput("1-0", [1, 2], [CompletionOutput(
            0, [100 + step], f"t{step}", "length" if done else None)], finished=done)
        events, new = token_events(job, out)
        assert new == 1
        sent.append([(e["pos"], e["token_ids"], e["text"]) for e in events])
    assert sent == [[(0, [100], "t0")], [], [], [],
                    [(1, [101, 102, 103, 104], "t1t2t3t4")], [], [], [],
                    [(5, [105, 106, 107, 108], "t5t6t7t8")], [(9, [109], "t9")]]


def test_a_sequence_that_ends_early_sends_its_rest_when_it_ends(
        server: RedisServer, worker: WorkerProcess,
        offline: Callable[[list[str], Any], list[Any]]) -> None:
    """n=2: the sequence that stops first sends its held tokens at its own end, not at the
    request's."""
    free = {"temperature": 0.8, "seed": 11, "n": 2, "max_tokens": 40, "ignore_eos": True}
    [runs] = offline(["the quick"], free)
    # A token both sequences produce, first at positions far apart: stopping on it ends them
    # at lengths far apart.
    firsts = [{t: runs[i][0].index(t) for t in set(runs[i][0])} for i in (0, 1)]
    stop_id = max(set(firsts[0]) & set(firsts[1]),
                  key=lambda t: (abs(firsts[0][t] - firsts[1][t]), t))
    params = {**free, "stop_token_ids": [stop_id]}
    [expected] = offline(["the quick"], params)
    lengths = [len(ids) for ids, _text, _reason in expected]
    short, long_ = sorted((0, 1), key=lambda i: lengths[i])
    assert lengths[long_] - lengths[short] > 2 * INTERVAL, lengths
    job = Client(server.url).submit("the quick", params, model="tiny")
    result = job.result(timeout=60)
    assert [(o["token_ids"], o["text"], o["finish_reason"]) for o in result["outputs"]] == \
        expected
    got = chunks(server, job.id)
    for index in (0, 1):
        assert on_boundaries(got[index], lengths[index]), (index, got[index])
        assert [t for _pos, ids in got[index] for t in ids] == expected[index][0]
    # In stream order, the short one's last chunk comes before the long one's chunks made
    # INTERVAL steps or more after the short one ended.
    order = [(e["index"], e["pos"]) for e in reply_events(server, job.id)
             if e["type"] == "tokens"]
    last_short = order.index((short, got[short][-1][0]))
    later = [k for k, (i, pos) in enumerate(order)
             if i == long_ and pos >= lengths[short] + INTERVAL]
    assert later and last_short < min(later), order


def test_logprobs_travel_with_their_tokens(server: RedisServer, worker: WorkerProcess,
                                          offline: Oracle) -> None:
    params = {"temperature": 0, "max_tokens": 7, "ignore_eos": True, "logprobs": 2}
    job = Client(server.url).submit("the quick brown", params, model="tiny")
    result = job.result(timeout=60)
    done = result["outputs"][0]["logprobs"]
    pieces = [e for e in reply_events(server, job.id) if e["type"] == "tokens"]
    assert [p for e in pieces for p in e["logprobs"]] == done
    assert all(len(e["logprobs"]) == len(e["token_ids"]) for e in pieces)
    # ... and they are the offline engine's (to float noise: another batch, other shapes)
    [[want]] = offline.outputs(["the quick brown"], params)
    expected = want.logprobs
    assert expected is not None and len(done) == len(expected) == 7
    for got, top in zip(done, expected, strict=True):
        assert sorted(t for t, *_ in got) == sorted(top)
        assert all(math.isclose(lp, top[t], rel_tol=1e-5, abs_tol=1e-6) for t, lp, *_ in got)


def test_a_stream_interval_below_one_is_refused_before_anything_loads(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="--stream-interval must be at least 1 token, got 0"):
        WorkerConfig(redis_url="redis://", served_model_name="m", name="w", stream_interval=0)
    rc = worker_main(["--model", "/nonexistent", "--stream-interval", "0"])
    assert (rc, capsys.readouterr().err) == (
        2, "genq worker: --stream-interval must be at least 1 token, got 0\n")
