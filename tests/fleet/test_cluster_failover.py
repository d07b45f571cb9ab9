"""A 3-master, 3-replica Redis Cluster with two models whose queues live on different nodes:
the fleet goes on through a CLUSTER FAILOVER of the node that holds a model's stream, and
through the migration of its slot to another node (MOVED/ASK) with a worker killed -9 in
between. Every job completes exactly once and every token position arrives once."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from producer import Client, Job
from producer.connection import ClusterNodeError, connect
from producer.protocol import Keys, job_shard
from tests.harness.clusters import ClusterNodeServer, RedisClusterSet
from tests.harness.fleet import (
    Expected,
    WorkerFactory,
    WorkerProcess,
    freeze_when,
    reply_events,
    streamed_tokens,
    wait_for,
    wait_heartbeats,
)
from tests.harness.models import corpus

Oracle = Callable[[list[str], Any], list[Expected]]
KEYS = Keys()
TOKENS = 200  # (long enough that no job ends before the failover or the kill)
LONG = {"temperature": 0, "max_tokens": TOKENS, "ignore_eos": True}


class Fleet:
    def __init__(self, nodes: RedisClusterSet, factory: WorkerFactory, models: list[str],
                 workers: dict[str, WorkerProcess]) -> None:
        self.nodes = nodes
        self.factory = factory
        self.models = models
        self.workers = workers

    def owner(self, model: str) -> ClusterNodeServer:
        return self.nodes.owner(KEYS.jobs(model))


def models_on_different_nodes(nodes: RedisClusterSet) -> list[str]:
    """Two model names whose slots two different masters hold."""
    names = [f"tiny-{k}" for k in range(20)]
    first = names[0]
    other = next(n for n in names
                 if nodes.owner(KEYS.jobs(n)).port != nodes.owner(KEYS.jobs(first)).port)
    return [first, other]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path) -> Iterator[Fleet]:
    nodes = RedisClusterSet(tmp_path_factory.mktemp("cluster3"), masters=3, replicas=1)
    nodes.start()
    factory = WorkerFactory(tmp_path_factory.mktemp("cluster3-workers"))
    try:
        models = models_on_different_nodes(nodes)
        workers = {m: factory.start(nodes.url, tiny_llama, f"w-{m}", "--result-ttl", "600",
                                    served_name=m) for m in models}
        wait_heartbeats(nodes, list(workers.values()))  # type: ignore[arg-type]
        yield Fleet(nodes, factory, models, workers)
    finally:
        factory.stop_all()
        nodes.kill()


def check_once(fleet: Fleet, jobs: list[Job], expected: list[Expected]) -> list[int]:
    """Each job's stream: every position once, the offline tokens, one terminal event in its
    reply stream. Returns the attempt of each job's end."""
    attempts = []
    for job, want in zip(jobs, expected, strict=True):
        events = list(job.stream(timeout=240))
        positions, tokens = streamed_tokens(events)
        assert positions == list(range(TOKENS)) and tokens == want[0][0], job.id
        assert events[-1]["type"] == "done", events[-1]
        raw = reply_events(fleet.nodes, job.id, job.model)  # type: ignore[arg-type]
        assert sum(e["type"] in ("done", "error") for e in raw) == 1, job.id
        attempts.append(events[-1]["attempt"])
    return attempts


def ended(fleet: Fleet, job: Job) -> bool:
    return any(e["type"] in ("done", "error") for e in reply_events(  # type: ignore[arg-type]
        fleet.nodes, job.id, job.model))


def started(fleet: Fleet, jobs: list[Job]) -> bool:
    return all(any(e["type"] == "tokens" for e in reply_events(  # type: ignore[arg-type]
        fleet.nodes, j.id, j.model)) for j in jobs)


def test_two_models_live_on_two_nodes_and_both_serve(fleet: Fleet, offline: Oracle) -> None:
    a, b = fleet.models
    assert fleet.owner(a).port != fleet.owner(b).port
    prompts = corpus(4, seed=31)
    params = {"temperature": 0, "max_tokens": 8}
    with Client(fleet.nodes.url) as client:
        jobs = [client.submit(p, params, model=m)
                for p, m in zip(prompts, [a, b, a, b], strict=True)]
        results = client.results(jobs, timeout=120)
    want = offline(prompts, params)
    assert [[o["token_ids"] for o in r["outputs"]] for r in results] == \
        [[seq[0] for seq in w] for w in want]


def test_a_sharded_model_spreads_over_the_three_masters(fleet: Fleet, tiny_llama: Path,
                                                        offline: Oracle) -> None:
    """--shards 3 for a model whose three shards' slots three different masters hold: its jobs
    go to all three, and each completes once with the offline tokens."""
    model = next(m for m in (f"hot-{k}" for k in range(200))
                 if len({fleet.nodes.owner(KEYS.jobs(m, s)).port for s in range(3)}) == 3)
    worker = fleet.factory.start(fleet.nodes.url, tiny_llama, "w-hot", "--shards", "3",
                                 served_name=model)
    wait_heartbeats(fleet.nodes, [worker])  # type: ignore[arg-type]
    prompts = corpus(12, seed=33)
    params = {"temperature": 0, "max_tokens": 8}
    with Client(fleet.nodes.url) as client:
        jobs = client.submit_many(prompts, params, model=model)
        results = client.results(jobs, timeout=120)
    assert sorted({job_shard(j.id) for j in jobs}) == [0, 1, 2]
    want = offline(prompts, params)
    assert [[o["token_ids"] for o in r["outputs"]] for r in results] == \
        [[seq[0] for seq in w] for w in want]
    for job in jobs:
        raw = reply_events(fleet.nodes, job.id, model)  # type: ignore[arg-type]
        assert [e["type"] for e in raw].count("started") == 1, job.id
    worker.terminate()


def test_a_plain_url_at_a_cluster_node_names_the_cluster_url(fleet: Fleet) -> None:
    b = fleet.models[1]
    other = next(m for m in fleet.nodes.masters if m.port != fleet.owner(b).port)
    conn = connect(f"redis://127.0.0.1:{other.port}/0")
    with pytest.raises(ClusterNodeError) as err:
        conn.xlen(KEYS.jobs(b))
    assert str(err.value).startswith(f"127.0.0.1:{other.port} is a node of a Redis Cluster (it "
                                     "answered 'MOVED ")
    assert str(err.value).endswith(f"connect with redis+cluster://127.0.0.1:{other.port} "
                                   "(rediss+cluster:// for TLS) instead")


def test_a_failover_of_the_node_holding_a_stream_mid_run(fleet: Fleet, offline: Oracle) -> None:
    a = fleet.models[0]
    old = fleet.owner(a)
    replica = next(r for r in fleet.nodes.replicas
                   if r.client().info("replication").get("master_port") == old.port)
    prompts = corpus(3, seed=32)
    with Client(fleet.nodes.url) as client:
        jobs = [client.submit(p, LONG, model=a) for p in prompts]
        wait_for(lambda: started(fleet, jobs), timeout=120, what="every job's first tokens")
        replica.client().execute_command("CLUSTER", "FAILOVER")
        wait_for(lambda: fleet.owner(a).port == replica.port, timeout=60,
                 what="the replica to take over the slot")
        check_once(fleet, jobs, offline(prompts, LONG))
    assert fleet.workers[a].alive()


def test_a_slot_migrated_mid_stream_with_its_worker_killed(fleet: Fleet, tiny_llama: Path,
                                                           offline: Oracle) -> None:
    """The worker of model b is killed -9 holding jobs (stopped the moment it holds them,
    whether or not their first tokens reached Redis yet: on a quiet host it streams all of a
    job between two polls, on a loaded one its writer lags); the slot of b's keys moves to
    another master key by key (clients meet ASK, then MOVED); a new worker reclaims the jobs
    there and every token position arrives once."""
    b = fleet.models[1]
    source = fleet.owner(b)
    target = next(m for m in fleet.nodes.nodes if m.port != source.port
                  and m.client().info("replication")["role"] == "master")
    prompts = corpus(3, seed=33)
    with Client(fleet.nodes.url) as client:
        jobs = [client.submit(p, LONG, model=b) for p in prompts]
        node, key = source.client(), KEYS.jobs(b)  # (one round trip a poll: the window is short)
        freeze_when(fleet.workers[b], lambda: node.xpending(key, KEYS.group)["pending"] == 3,
                    "the worker holding the jobs")
        assert not any(ended(fleet, job) for job in jobs), "a job ended before its worker stopped"
        fleet.workers[b].kill9()
        migrate_slot(KEYS.jobs(b), source, target, fleet.nodes)
        wait_for(lambda: fleet.owner(b).port == target.port, timeout=60,
                 what="every node to name the slot's new owner")
        fleet.factory.start(fleet.nodes.url, tiny_llama, f"w2-{b}", "--result-ttl", "600",
                            served_name=b)
        assert check_once(fleet, jobs, offline(prompts, LONG)) == [2, 2, 2]


def migrate_slot(key: str, source: ClusterNodeServer, target: ClusterNodeServer,
                 nodes: RedisClusterSet) -> None:
    """Redis's resharding steps for the slot of `key`: IMPORTING / MIGRATING, MIGRATE of its
    keys a few at a time (REPLACE: a key a client made on the target meanwhile), then the slot's
    new owner told to every master."""
    src, dst = source.client(), target.client()
    slot = int(src.execute_command("CLUSTER", "KEYSLOT", key))
    dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", source.node_id())
    src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", target.node_id())
    while keys := src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 2):
        src.execute_command("MIGRATE", "127.0.0.1", target.port, "", 0, 10_000, "REPLACE",
                            "KEYS", *keys)
    masters = [n for n in nodes.nodes if n.client().info("replication")["role"] == "master"]
    for node in [target, source] + [m for m in masters if m not in (target, source)]:
        node.client().execute_command("CLUSTER", "SETSLOT", slot, "NODE", target.node_id())
