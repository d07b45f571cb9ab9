"""Queue shards (producer/shards.py, `genq worker --shards k`): a model's jobs spread over k
streams under hash tags of their own; the job id names its shard, so its keys are found from
the id; workers read every shard. On one Redis and on a one-node cluster (which refuses any
command or script that crosses slots)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from redis.crc import key_slot

from producer import Client
from producer.client import ClientSettings, make_job_spec
from producer.errors import JobError
from producer.lanes import lane_key
from producer.protocol import Keys, job_model, job_shard, new_job_id
from producer.status import queue_rows
from tests.harness.clusters import RedisClusterSet
from tests.harness.fleet import (
    Expected,
    RedisServer,
    WorkerFactory,
    WorkerProcess,
    as_expected,
    reply_events,
    wait_for,
    wait_heartbeats,
)
from tests.harness.models import corpus
from tests.harness.oracle import OracleOf
from worker.batch import FinishWrite, finish_keys
from worker.scripts import reclaim_call
from worker.streams import WorkerKeys

Oracle = Callable[[list[str], Any], list[Expected]]
KEYS = Keys()
GREEDY = {"temperature": 0, "max_tokens": 8}


def test_a_job_id_names_its_shard_and_each_shards_scripts_touch_one_slot() -> None:
    job_id = new_job_id("tiny.v2", 2)
    assert (job_model(job_id), job_shard(job_id)) == ("tiny.v2", 2)
    assert (job_shard(new_job_id("tiny.v2")), job_shard(job_id + "-3"), job_shard("own-1")) == (
        0, 2, 0)
    assert KEYS.reply(job_id) == f"genq:reply:{{tiny.v2#2}}:{job_id}"
    assert KEYS.jobs("tiny", 2) == "genq:jobs:{tiny#2}"
    worker = WorkerKeys(Keys(model="tiny"), "tiny", "w1", shards=3)
    assert worker.jobs[6:] == ["genq:jobs:{tiny#2}", "genq:jobs:{tiny#2}:high",
                               "genq:jobs:{tiny#2}:low"]
    slots = set()
    for shard in range(3):
        job = new_job_id("tiny", shard)
        submit, _ = ClientSettings().submit_call(make_job_spec("x", GREEDY, "tiny", job, None,
                                                               True, priority=5))
        stream = lane_key(KEYS, "tiny", 2, shard)
        fin = finish_keys([FinishWrite("1-0", 1, KEYS.reply(job), b"e", idem_key=KEYS.idem(job))],
                          stream, KEYS.dead("tiny", shard))
        reclaim, _ = reclaim_call(KEYS, "tiny", stream, "w1", ["w1", "w2"], 5, True, shard)
        copies = [k for pair in worker.shard_heartbeats[shard - 1:shard] for k in pair] \
            if shard else [worker.heartbeat]
        keys = [*submit, *fin, *reclaim, KEYS.cancel(job), KEYS.fence("tiny", "w1", shard),
                *copies]
        assert submit[1] == stream
        assert len({key_slot(k.encode()) for k in keys}) == 1, keys
        slots.add(key_slot(stream.encode()))
    assert len(slots) == 3


@pytest.fixture(scope="module", params=["redis", "cluster"])
def fleet(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
          long_llama: Path) -> Iterator[tuple[Any, WorkerFactory, WorkerProcess]]:
    """A worker serving `tiny` over 3 shards, on one Redis or on a one-node cluster."""
    root = tmp_path_factory.mktemp(request.param)
    server: Any = RedisServer(root) if request.param == "redis" else \
        RedisClusterSet(root, masters=1)
    server.start()
    factory = WorkerFactory(tmp_path_factory.mktemp("shard-workers"))
    try:
        worker = factory.start(server.url, long_llama, "s1", "--shards", "3")
        wait_heartbeats(server, [worker])
        yield server, factory, worker
    finally:
        factory.stop_all()
        server.kill()


def test_jobs_spread_over_the_shards_and_complete_once(
        fleet: tuple[Any, WorkerFactory, WorkerProcess], oracle_of: OracleOf,
        long_llama: Path) -> None:
    server, _, _ = fleet
    prompts = corpus(30, seed=31)
    with Client(server.url) as client:
        jobs = client.submit_many(prompts, GREEDY, model="tiny")
        results = client.results(jobs, timeout=240)
        again = client.submit(prompts[0], GREEDY, model="tiny", job_id=jobs[0].id)
        assert again.created is False  # (an idempotent resubmit: the id names the same shard)
        assert as_expected(client.job(jobs[-1].id).result(timeout=30)) == as_expected(
            results[-1])
    assert sorted({job_shard(j.id) for j in jobs}) == [0, 1, 2]
    assert [as_expected(r) for r in results] == oracle_of(long_llama)(prompts, GREEDY)
    for job in jobs:
        assert [e["type"] for e in reply_events(server, job.id)] .count("started") == 1
    rows = queue_rows(server.client(), KEYS)
    assert [(r["shard"], r["lane"], r["length"], r["pending"]) for r in rows] == [
        (shard, lane, 0, 0) for shard in range(3) for lane in ("default", "high", "low")]


def test_a_job_in_shard_2_is_cancelled(fleet: tuple[Any, WorkerFactory, WorkerProcess]) -> None:
    server, _, _ = fleet
    params = {"temperature": 0, "max_tokens": 3000, "ignore_eos": True}
    with Client(server.url) as client:
        job = client.submit("a long one", params, model="tiny", job_id=new_job_id("tiny", 2),
                            priority=4)
        wait_for(lambda: any(e["type"] == "tokens" for e in reply_events(server, job.id)),
                 timeout=120, interval=0.01, what="its first tokens")
        client.cancel(job.id)
        with pytest.raises(JobError) as err:
            job.result(timeout=120)
    assert err.value.code == "cancelled"
    stream = lane_key(KEYS, "tiny", 2, 2)
    wait_for(lambda: server.client().xlen(stream) == 0, what="the entry acked and deleted")


def test_a_job_in_shard_2_of_a_killed_worker_is_reclaimed(
        fleet: tuple[Any, WorkerFactory, WorkerProcess], oracle_of: OracleOf,
        long_llama: Path) -> None:
    """(Last in the module: it kills the module's worker.)"""
    server, factory, worker = fleet
    prompt = corpus(1, seed=32)[0]
    params = {"temperature": 0, "max_tokens": 1500, "ignore_eos": True}
    with Client(server.url) as client:
        job = client.submit(prompt, params, model="tiny", job_id=new_job_id("tiny", 2))
        wait_for(lambda: any(e["type"] == "tokens" for e in reply_events(server, job.id)),
                 timeout=120, interval=0.01, what="its first tokens")
        worker.kill9()
        other = factory.start(server.url, long_llama, "s2", "--shards", "3")
        result = job.result(timeout=300)
    assert result["outputs"][0]["token_ids"] == oracle_of(long_llama)([prompt], params)[0][0][0]
    started = [e for e in reply_events(server, job.id) if e["type"] == "started"]
    assert [(e["attempt"], e["worker"]) for e in started] == [(1, "s1"), (2, "s2")]
    assert server.client().xlen(KEYS.jobs("tiny", 2)) == 0
    assert other.alive()
