"""Redis Cluster: every script and multi-key call stays in one slot, and the fleet's core paths
(submit, stream, idempotent resubmit, results, cancel, dead letters, kill -9 and reclaim, status)
run against a one-node cluster, which refuses any call whose keys cross slots (CROSSSLOT)."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
from redis.crc import key_slot

from producer import Client
from producer.client import ClientSettings, make_job_spec
from producer.connection import connect, parse
from producer.errors import JobError
from producer.flags import redis_url
from producer.lanes import lane_keys
from producer.protocol import Keys, new_job_id
from producer.results import _slot_chunks
from producer.status import queue_rows, worker_rows
from tests.harness.clusters import RedisClusterSet
from tests.harness.fleet import (
    Expected,
    WorkerFactory,
    WorkerProcess,
    as_expected,
    blocked_xreads,
    freeze_when,
    reply_events,
    streamed_tokens,
    wait_for,
    wait_heartbeats,
)
from tests.harness.models import corpus
from worker.batch import FinishWrite, finish_keys
from worker.scripts import reclaim_call

Oracle = Callable[[list[str], Any], list[Expected]]
GREEDY = {"temperature": 0, "max_tokens": 12}


def one_slot(keys: list[str]) -> bool:
    return len({key_slot(k.encode()) for k in keys}) == 1


def test_every_script_calls_keys_map_to_one_slot() -> None:
    """The keys of SUBMIT, WRITE_EVENTS, FINISH (with dead letters and idem marks), RECLAIM, a
    cancel (flag and shard channel) and results' reads, for jobs whose ids name their model and
    ids of the caller's own."""
    keys = Keys("app")
    for model in ("tiny", "Qwen2.5-0.5B", "m:x"):
        ids = [new_job_id(model), new_job_id(model) + "-1", "order-17"]
        submit = [ClientSettings().submit_call(_spec(model, job_id))[0] for job_id in ids]
        assert all(one_slot(k) for k in submit)
        worker = Keys("app", model)  # (a worker's: the model it serves)
        events = [worker.jobs(model), worker.fence(model, "w1"), *map(worker.reply, ids)]
        read = lane_keys(worker, model)  # (the reader's script reads the lanes in one call)
        finishes = [FinishWrite(f"1-{i}", 1, worker.reply(j), b"e", idem_key=worker.idem(j))
                    for i, j in enumerate(ids)]
        finish = finish_keys(finishes, worker.jobs(model), worker.dead(model))
        reclaim, _ = reclaim_call(worker, model, worker.jobs(model), "w1",
                                  ["w1", "gone", "bad name"], 5, True)
        cancel = [keys.cancel(j, model) for j in ids] + [keys.cancel_channel(model)]
        heartbeats = [keys.workers(model), keys.worker(model, "w1"), keys.worker(model, "w2")]
        for call in (events, finish, reclaim, cancel, heartbeats, read):
            assert one_slot(call + [keys.jobs(model)]), call
        assert len(reclaim) == 2 + 2 * 2  # (a name no worker could have is left out)
    replies = [keys.reply(new_job_id(m)) for m in ("a", "b", "a", "c", "b")]
    chunks = _slot_chunks(replies, {r: key_slot(r.encode()) for r in replies})
    assert [len(chunk) for chunk in chunks] == [2, 2, 1]
    assert all(one_slot(chunk) for chunk in chunks)


def _spec(model: str, job_id: str) -> Any:
    return make_job_spec("hi", GREEDY, model, job_id, None, True)


def test_cluster_urls_parse_into_nodes_and_credentials() -> None:
    t = parse("rediss+cluster://u:p%40ss@10.0.0.1:7000,[::1]:7001,h3?ssl_cert_reqs=none")
    assert t.is_cluster and not t.is_sentinel
    assert t.cluster_nodes == (("10.0.0.1", 7000), ("::1", 7001), ("h3", 6379))
    assert t.node_kwargs == {"username": "u", "password": "p@ss", "ssl_cert_reqs": "none",
                             "ssl": True}
    with pytest.raises(argparse.ArgumentTypeError, match="a cluster has only database 0"):
        redis_url("redis+cluster://h:1/2")
    with pytest.raises(ValueError, match=r"^min_replicas: waiting for replicas \(WAIT\) is not "
                                         "supported with a redis\\+cluster:// URL"):
        Client("redis+cluster://h:1", min_replicas=1)


def tokens_written(nodes: RedisClusterSet, job_id: str) -> bool:
    raw = reply_events(nodes, job_id)  # type: ignore[arg-type]
    return any(e["type"] == "tokens" for e in raw)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory,
            tiny_llama: Path) -> Iterator[tuple[RedisClusterSet, WorkerFactory, WorkerProcess]]:
    nodes = RedisClusterSet(tmp_path_factory.mktemp("cluster"), masters=1)
    nodes.start()
    factory = WorkerFactory(tmp_path_factory.mktemp("cluster-workers"))
    try:
        worker = factory.start(nodes.url, tiny_llama, "c1", "--result-ttl", "600")
        wait_heartbeats(nodes, [worker])  # type: ignore[arg-type]
        yield nodes, factory, worker
    finally:
        factory.stop_all()
        nodes.kill()


def test_submit_stream_resubmit_results_and_status_on_a_cluster(
        cluster: tuple[RedisClusterSet, WorkerFactory, WorkerProcess], offline: Oracle) -> None:
    nodes, _, _ = cluster
    prompts = corpus(4, seed=21)
    expected = offline(prompts, GREEDY)
    with Client(nodes.url) as client:
        job = client.submit(prompts[0], GREEDY, model="tiny", job_id="mine-1")
        events = list(job.stream(timeout=120))
        assert streamed_tokens(events)[1] == expected[0][0][0]
        again = client.submit(prompts[0], GREEDY, model="tiny", job_id="mine-1")
        assert (job.created, again.created) == (True, False)
        many = client.submit_many(prompts[1:], GREEDY, model="tiny")
        assert [as_expected(r) for r in client.results(many, timeout=120)] == expected[1:]
        # handles made elsewhere: a genq-made id names its model, one's own id needs it
        assert as_expected(client.job(many[0].id).result(timeout=30)) == expected[1]
        assert as_expected(client.job("mine-1", "tiny").result(timeout=30)) == expected[0]
    conn = connect(nodes.url)
    keys = Keys()
    assert [(w["name"], w["model"]) for w in worker_rows(conn, keys)] == [("c1", "tiny")]
    assert [(q["model"], q["lane"], q["length"], q["pending"], q["consumers"])
            for q in queue_rows(conn, keys)] == [("tiny", lane, 0, 0, 1)
                                                 for lane in ("default", "high", "low")]
    raw = reply_events(nodes, "mine-1")  # type: ignore[arg-type]
    assert [e["type"] for e in raw].count("started") == 1


def test_cancel_and_dead_letters_on_a_cluster(
        cluster: tuple[RedisClusterSet, WorkerFactory, WorkerProcess]) -> None:
    nodes, _, _ = cluster
    with Client(nodes.url) as client:
        job = client.submit("a long one", {"temperature": 0, "max_tokens": 400,
                                           "ignore_eos": True}, model="tiny")
        wait_for(lambda: tokens_written(nodes, job.id), timeout=120, what="its first tokens")
        client.cancel(job.id)  # (the id names its model)
        with pytest.raises(JobError) as err:
            job.result(timeout=120)
        assert err.value.code == "cancelled"
    conn = nodes.client()
    keys = Keys()
    entry = conn.xadd(keys.jobs("tiny"), {"v": b"2", "job": msgpack.packb({"id": "a b"})})
    dead = wait_for(lambda: conn.xrange(keys.dead("tiny")), timeout=120, what="a dead letter")
    assert [(f[b"entry"], f[b"code"]) for _id, f in dead] == [(entry, b"bad_id")]


def test_the_gateway_serves_a_completion_from_a_cluster(
        cluster: tuple[RedisClusterSet, WorkerFactory, WorkerProcess], offline: Oracle) -> None:
    """In process: it finds the worker in the registry, submits, and reads the reply stream."""
    import asyncio

    import httpx

    from producer.gateway import GatewayConfig
    from producer.gateway_app import create_app

    nodes, _, _ = cluster

    async def complete() -> httpx.Response:
        app = create_app(GatewayConfig(redis_url=nodes.url))
        async with app.router.lifespan_context(app), httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://gateway") as http:
            return await http.post("/v1/completions", timeout=120, json={
                "model": "tiny", "prompt": "the quick brown fox", **GREEDY})

    resp = asyncio.run(complete())
    assert resp.status_code == 200, resp.text
    [want] = offline(["the quick brown fox"], GREEDY)
    assert resp.json()["choices"][0]["text"] == want[0][1]


def test_an_async_client_waits_on_one_xread_per_slot_on_a_cluster(
        cluster: tuple[RedisClusterSet, WorkerFactory, WorkerProcess]) -> None:
    """60 AsyncJobs of model tiny (one slot: its hash tag) wait on one blocked XREAD on the
    slot's node, not on one each; each gets its own result, written afterwards."""
    import asyncio

    from producer import AsyncClient
    from producer.events import done_event, encode_event, started_event
    from producer.protocol import REPLY_FIELD

    nodes, _, _ = cluster
    ids = [f"slot-{k}" for k in range(60)]
    node = nodes.owner(Keys().reply(ids[0], "tiny")).client()

    def blocked_reads() -> int:
        return len(blocked_xreads(node))

    def finish() -> None:
        conn = nodes.client()
        for k, job_id in enumerate(ids):
            for event in (started_event(1, "w"), done_event(1, [{
                    "index": 0, "token_ids": [k], "text": "", "finish_reason": "length",
                    "cumulative_logprob": 0.0}], {}, {})):
                conn.xadd(Keys().reply(job_id, "tiny"), {REPLY_FIELD: encode_event(event)})

    async def scenario() -> tuple[list[list[int]], int]:
        async with AsyncClient(nodes.url) as client:
            reads = [asyncio.ensure_future(client.job(i, "tiny").result(timeout=60))
                     for i in ids]
            for _ in range(3000):
                if client.hub().subscriptions == len(ids):
                    break
                await asyncio.sleep(0.01)
            blocked = -1
            for _ in range(300):  # (readers superseded as jobs came in end within 1 s)
                blocked = await asyncio.to_thread(blocked_reads)
                if blocked == 1:
                    break
                await asyncio.sleep(0.1)
            await asyncio.to_thread(finish)
            results = await asyncio.gather(*reads)
            return [r["outputs"][0]["token_ids"] for r in results], blocked  # type: ignore[index]

    results, blocked = asyncio.run(scenario())
    assert results == [[k] for k in range(60)]
    assert blocked == 1


def test_kill_9_and_reclaim_on_a_cluster_run_each_job_once(
        cluster: tuple[RedisClusterSet, WorkerFactory, WorkerProcess], tiny_llama: Path,
        offline: Oracle) -> None:
    """Last: it kills the module's worker. Its held jobs are reclaimed by a worker started after
    the kill; every job ends once and every token position arrives once."""
    nodes, factory, victim = cluster
    params = {"temperature": 0, "max_tokens": 160, "ignore_eos": True}
    prompts = corpus(3, seed=23)
    with Client(nodes.url) as client:
        jobs = [client.submit(p, params, model="tiny") for p in prompts]
        key = Keys().jobs("tiny")  # (its node's client made once: one round trip a poll)
        node = nodes.owner(key).client()
        freeze_when(victim, lambda: node.xpending(key, Keys().group)["pending"] == 3,
                    "the worker holding the jobs")
        assert not any(e["type"] == "done" for j in jobs for e in reply_events(
            nodes, j.id)), "a job ended before its worker stopped"  # type: ignore[arg-type]
        victim.kill9()
        survivor = factory.start(nodes.url, tiny_llama, "c2", "--result-ttl", "600")
        results = [list(job.stream(timeout=240)) for job in jobs]
    expected = offline(prompts, params)
    for job, events, want in zip(jobs, results, expected, strict=True):
        positions, tokens = streamed_tokens(events)
        assert positions == list(range(160)) and tokens == want[0][0], job.id
        assert (events[-1]["type"], events[-1]["attempt"]) == ("done", 2)
        raw = reply_events(nodes, job.id)  # type: ignore[arg-type]
        assert sum(e["type"] in ("done", "error") for e in raw) == 1
    assert survivor.alive()
