"""Priority lanes: a model's queued jobs wait in one of a few streams by priority, so a worker
reads the urgent ones first and a priority-0 job never waits behind a backlog of priority-10 jobs
that no worker has read yet (inside a worker the engine orders what it holds by priority).

    lane      priority   stream
    high      < 0        <p>:jobs:{m}:high
    default   0          <p>:jobs:{m}        (the key of a plain deployment: unchanged)
    low       > 0        <p>:jobs:{m}:low

All three carry the model's hash tag (of its queue shard, producer/shards.py: {m#i} in the
keys above for shard i): one Cluster slot, so a worker reads them in one script and every fenced
script touches one slot. A lane is where a job waits, nothing more: its reply,
cancel and idempotency keys are the job's, whatever its lane, and a job id runs once across lanes.
Every producer (Client, AsyncClient, gateway, Celery bridge, batches, run-batch) enqueues
through `job_stream`.
"""

from __future__ import annotations

from producer.protocol import JobSpec, Keys, job_shard

LANES = ("default", "high", "low")  # stream index order: index 0 is the plain deployment's key
URGENCY = (1, 0, 2)  # the lanes' indexes, most urgent first (a worker reads in this order)
_SUFFIX = ("", ":high", ":low")


def lane_of(priority: int) -> int:
    """The lane (an index into LANES) of a job of this priority (lower is sooner)."""
    return 1 if priority < 0 else 0 if priority == 0 else 2


def lane_key(keys: Keys, model: str, lane: int, shard: int = 0) -> str:
    return keys.jobs(model, shard) + _SUFFIX[lane]


def lane_keys(keys: Keys, model: str, shard: int = 0) -> list[str]:
    """The lane streams of one shard of the model, in LANES order."""
    return [lane_key(keys, model, lane, shard) for lane in range(len(LANES))]


def job_stream(keys: Keys, spec: JobSpec) -> str:
    """The stream a job is enqueued on: its model's lane for its priority, in the shard its id
    names."""
    return lane_key(keys, spec.model, lane_of(spec.priority), job_shard(spec.id))


def split_lane(key: str, keys: Keys) -> tuple[str, int, str] | None:
    """(model, shard, lane name) of a job-stream key, None when it is not one."""
    head = keys.jobs("m")[:-len("{m}")]
    if not key.startswith(head + "{"):
        return None
    tag, _, suffix = key[len(head) + 1:].rpartition("}")
    model, _, shard = tag.partition("#")
    lane = next((LANES[i] for i, s in enumerate(_SUFFIX) if s == suffix), None)
    if not model or lane is None or not (shard == "" or shard.isdigit()):
        return None
    return model, int(shard or 0), lane
