"""Jobs/s and token events/s through one Redis against a 3-master Redis Cluster, side by side in
one run, and the memory a finished job holds (during --result-ttl) in each: three models, then
one model spread over 3 shards (`--shards 3`: on the cluster, one shard per master).

No model: each model's worker is a process that does what a worker does to Redis (XREADGROUP,
then the fenced token writes of every step and the fenced finishes, through the worker's own
Writer), while one producer process per model submits its jobs (Client.submit_many) and waits
for their results (Client.results). On the cluster the models' queues live on different
masters (their hash tags are chosen so); a sharded model's queue is served per shard the same
way (a worker and a producer per shard, the producer's job ids naming the shard). Times are
wall-clock from the first submit to the last result; all setups run on the same host, one after
the other.

    python -m benchmarks.cluster_throughput --jobs 400 --tokens 32 --json out.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import tempfile
import time
from pathlib import Path
from typing import Any

import msgpack

from producer.client import Client, make_job_spec
from producer.connection import connect
from producer.events import done_event, encode_event, tokens_event
from producer.protocol import SUBMIT_LUA, Keys, as_str, new_job_id
from worker.batch import Batch, EventWrite, FinishWrite
from worker.io_thread import Writer
from worker.streams import JobStream

STEP_JOBS = 64  # jobs a simulated worker holds at once (its --max-num-seqs)


def fake_worker(url: str, model: str, shard: int, jobs: int, tokens: int, ready: Any) -> None:
    """Read `jobs` jobs of `model`'s `shard`, STEP_JOBS at a time: one tokens event per job per
    step, then the finishes."""
    keys = Keys(model=model)
    conn = connect(url, socket_timeout=30)
    jobs_key = keys.jobs(model, shard)
    writer = Writer(conn, [JobStream(jobs_key, keys.dead(model, shard),
                                     keys.fence(model, "w", shard))], keys.group, "w", 600, 600)
    done = encode_event(done_event(1, [{"index": 0, "token_ids": [7] * tokens,
                                        "text": "x" * tokens, "finish_reason": "length"}],
                                   {"prompt_tokens": 2, "completion_tokens": tokens}, {}))
    served = 0
    ready.wait()
    while served < jobs:
        got: Any = conn.xreadgroup(keys.group, "w", {jobs_key: ">"}, count=STEP_JOBS, block=1000)
        held = [(as_str(eid), fields) for _k, rows in got or [] for eid, fields in rows]
        if not held:
            continue
        ids = [_job_id(fields) for _eid, fields in held]
        for pos in range(tokens):
            writer.write_batches([Batch(events=[
                EventWrite(eid, 1, keys.reply(job_id), [tokens_event(1, 0, pos, [7], "x")])
                for (eid, _f), job_id in zip(held, ids, strict=True)])])
        writer.write_batches([Batch(finishes=[
            FinishWrite(eid, 1, keys.reply(job_id), done, idem_key=keys.idem(job_id))
            for (eid, _f), job_id in zip(held, ids, strict=True)])])
        served += len(held)


def _job_id(fields: dict[bytes, bytes]) -> str:
    return str(msgpack.unpackb(fields[b"job"], raw=False)["id"])


def producer(url: str, model: str, shard: int, jobs: int, tokens: int, ready: Any,
             times: Any) -> None:
    """`jobs` jobs into `model`'s `shard` (as Client.submit_many, with ids naming the shard),
    then their results."""
    params = {"temperature": 0, "max_tokens": tokens}
    with Client(url) as client:
        client.redis.script_load(SUBMIT_LUA)  # (the pipelined EVALSHAs below need it)
        ready.wait()  # (every process has started and imported: the clock starts now)
        start = time.perf_counter()
        submitted = []
        for lo in range(0, jobs, 256):
            specs = [make_job_spec("a prompt", params, model, new_job_id(model, shard), None,
                                   True) for _ in range(min(256, jobs - lo))]
            client.submit_pipeline(client.redis, specs).execute()
            submitted += [client.job(spec.id, model) for spec in specs]
        client.results(submitted, timeout=600)
        times.put((start, time.perf_counter()))


Queue = tuple[str, int]  # a model and one of its shards


def run(url: str, queues: list[Queue], jobs: int, tokens: int) -> float:
    """Seconds from the first submit to the last result, every queue at once."""
    conn = connect(url)
    keys = Keys()
    for model, shard in queues:
        conn.xgroup_create(keys.jobs(model, shard), keys.group, id="0", mkstream=True)
    ctx = multiprocessing.get_context("spawn")
    ready, times = ctx.Barrier(2 * len(queues)), ctx.Queue()
    procs = [ctx.Process(target=fake_worker, args=(url, m, s, jobs, tokens, ready))
             for m, s in queues]
    procs += [ctx.Process(target=producer, args=(url, m, s, jobs, tokens, ready, times))
              for m, s in queues]
    for p in procs:
        p.start()
    spans = [times.get() for _ in queues]
    for p in procs:
        p.join()
    return max(end for _, end in spans) - min(start for start, _ in spans)


def used_memory(nodes: list[Any]) -> int:
    return sum(int(n.client().info("memory")["used_memory"]) for n in nodes)


def measure(url: str, nodes: list[Any], queues: list[Queue], args: argparse.Namespace,
            ) -> dict[str, float]:
    for node in nodes:  # (the test servers fsync every write: here Redis's CPU is measured)
        node.client().config_set("appendfsync", "no")
    base = used_memory(nodes)
    seconds = run(url, queues, args.jobs, args.tokens)
    total = args.jobs * len(queues)
    return {"jobs_per_s": total / seconds, "token_events_per_s": total * args.tokens / seconds,
            "memory_per_finished_job_bytes": (used_memory(nodes) - base) / total}


def main() -> None:
    from tests.harness.clusters import RedisClusterSet
    from tests.harness.fleet import RedisServer

    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=int, default=400, help="jobs per model")
    p.add_argument("--tokens", type=int, default=32, help="token events per job")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="genq-cluster-bench-"))
    out: dict[str, dict[str, float]] = {}
    (root / "one").mkdir()
    single = RedisServer(root / "one")
    single.start()
    try:
        out["one Redis, 3 models"] = measure(single.url, [single],
                                             [("m0", 0), ("m1", 0), ("m2", 0)], args)
        out["one Redis, 1 model x 3 shards"] = measure(single.url, [single],
                                                       [("hot", s) for s in range(3)], args)
    finally:
        single.kill()
    cluster = RedisClusterSet(root / "cluster", masters=3)
    cluster.start()
    try:
        out["3-master cluster, 3 models"] = measure(
            cluster.url, cluster.masters, [(m, 0) for m in spread_models(cluster)], args)
        hot = spread_shards(cluster)
        out["3-master cluster, 1 model x 3 shards"] = measure(
            cluster.url, cluster.masters, [(hot, s) for s in range(3)], args)
    finally:
        cluster.kill()
    print(f"3 queues x {args.jobs} jobs x {args.tokens} token events, appendfsync no")
    print("| Redis | jobs/s | token events/s | memory per finished job |")
    print("|---|---:|---:|---:|")
    for name, row in out.items():
        print(f"| {name} | {row['jobs_per_s']:.0f} | {row['token_events_per_s']:.0f} | "
              f"{row['memory_per_finished_job_bytes'] / 1024:.1f} KB |")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


def spread_models(cluster: Any) -> list[str]:
    """One model name per master: each queue on its own node."""
    keys, by_port = Keys(), {}
    for k in range(100):
        port = cluster.owner(keys.jobs(f"m{k}")).port
        by_port.setdefault(port, f"m{k}")
        if len(by_port) == len(cluster.masters):
            break
    return list(by_port.values())


def spread_shards(cluster: Any) -> str:
    """A model name whose 3 shards three different masters hold."""
    keys = Keys()
    return next(m for m in (f"hot{k}" for k in range(1000))
                if len({cluster.owner(keys.jobs(m, s)).port for s in range(3)}) == 3)


if __name__ == "__main__":
    main()
