"""Every Redis key and channel genq uses (re-exported by producer.protocol, the wire
protocol's one definition).

Keys (prefix configurable, default "genq"; {m} is the hash tag of the job's model, so a model's
keys share one Redis Cluster slot):
    <p>:jobs:{m}            stream of job entries, consumer group "workers"; fields v, job [, a]
    <p>:jobs:{m}:high       the same, for jobs of priority < 0; ...:low for priority > 0 (the
                            priority lanes: producer/lanes.py)
    <p>:dead:{m}            dead-letter stream (all lanes'): fields reason, code, entry, worker
                            [, job]
    <p>:reply:{m}:<id>      reply stream of one job; field e = one event
    <p>:cancel:{m}:<id>     cancel flag (with TTL) + an SPUBLISH of <id> on channel <p>:cancel:{m}
    <p>:idem:{m}:<id>       idempotency key set by submit (a job id runs once): "1", then "ended"
                            from the job's terminal event on (its TTL kept; producer.results)
    <p>:worker:{m}:<name>   heartbeat of one worker (value: msgpack map, short TTL)
    <p>:worker:{m}          set of the names of the model's workers (the registry)
    <p>:worker:models       set of the served models
    <p>:fence:{m}:<name>    a worker's fence counter (worker/scripts.py)
"""

from __future__ import annotations

from dataclasses import dataclass

from producer.job_ids import job_model, job_shard, validate_name

DEFAULT_PREFIX = "genq"
CONSUMER_GROUP = "workers"


@dataclass(frozen=True)
class Keys:
    """Every Redis key and channel genq uses, built from validated names only.

    Each key of a queue carries the hash tag of its model, `{<model>}`: a job's stream, its
    dead letters, its workers' heartbeats and fence counters, and the reply, cancel and idem
    keys of every job sent to it live in one Redis Cluster slot, so every script and every
    multi-key command touches one slot. The kind comes first (`genq:reply:{tiny}:<id>`), so an
    ACL pattern per kind (`~genq:reply:*`) still covers all models.

    A job's keys need its model: the one a call names, else `model` (a worker's keys: the
    model it serves), else the one its id names (ids genq makes name it: `new_job_id`)."""

    prefix: str = DEFAULT_PREFIX
    model: str | None = None

    def __post_init__(self) -> None:
        validate_name(self.prefix, "key prefix")
        if self.model is not None:
            validate_name(self.model, "model name")

    @property
    def group(self) -> str:
        return CONSUMER_GROUP

    @property
    def models(self) -> str:
        """The set of model names workers serve(d): what `genq status` and the gateway look
        through instead of a SCAN (which sees one node of a cluster). Under worker: so the
        workers' ACL key pattern covers it."""
        return f"{self.prefix}:worker:models"

    def _queue(self, kind: str, model: str, shard: int = 0) -> str:
        """A key of `model`'s queue shard: its hash tag is {<model>} for shard 0 (a model of
        one shard), {<model>#<shard>} for the others ('#' is in no name: no tag collides)."""
        tag = validate_name(model, "model name") + (f"#{shard}" if shard else "")
        return f"{self.prefix}:{kind}:{{{tag}}}"

    def jobs(self, model: str, shard: int = 0) -> str:
        return self._queue("jobs", model, shard)

    def dead(self, model: str, shard: int = 0) -> str:
        return self._queue("dead", model, shard)

    def shards(self, model: str) -> str:
        """The number of shards of `model`'s queue (--shards, set by its workers; none: 1)."""
        return self._queue("shards", model)

    def workers(self, model: str, shard: int = 0) -> str:
        """The set of worker names that served `model` (each beat adds its own; reclaim drops
        the gone ones): the per-model registry. A name's heartbeat is `worker(model, name)`.
        A sharded model's workers beat in every shard (the reclaim of a shard looks there)."""
        return self._queue("worker", model, shard)

    def worker(self, model: str, name: str, shard: int = 0) -> str:
        return f"{self.workers(model, shard)}:{validate_name(name, 'worker name')}"

    def fence_prefix(self, model: str, shard: int = 0) -> str:
        """Followed by a worker name: a counter bumped whenever pending entries of the shard's
        streams are claimed from that worker (worker/scripts.py)."""
        return self._queue("fence", model, shard) + ":"

    def fence(self, model: str, name: str, shard: int = 0) -> str:
        return self.fence_prefix(model, shard) + validate_name(name, "worker name")

    def cancel_channel(self, model: str) -> str:
        """The shard channel (SPUBLISH) on which cancels of `model`'s jobs are announced: it
        lives on the node of the model's slot (shard 0's: one channel for all of its shards)."""
        return self._queue("cancel", model)

    def reply(self, job_id: str, model: str | None = None) -> str:
        return self._job("reply", job_id, model)

    def cancel(self, job_id: str, model: str | None = None) -> str:
        return self._job("cancel", job_id, model)

    def idem(self, job_id: str, model: str | None = None) -> str:
        return self._job("idem", job_id, model)

    def _job(self, kind: str, job_id: str, model: str | None) -> str:
        validate_name(job_id)
        return (f"{self._queue(kind, model or self.model or job_model(job_id), job_shard(job_id))}"
                f":{job_id}")

    @property
    def batches(self) -> str:
        """A sorted set of the gateway's batch ids, scored by creation time."""
        return f"{self.prefix}:batches"

    @property
    def batches_active(self) -> str:
        """The set of batch ids not ended yet (what gateways look through to take over)."""
        return f"{self.prefix}:batches:active"

    def batch(self, batch_id: str) -> str:
        return f"{self.prefix}:batch:{validate_name(batch_id, 'batch id')}"

    def batch_lease(self, batch_id: str) -> str:
        """Held (SET NX PX, renewed) by the gateway process that drives the batch."""
        return f"{self.prefix}:batch-lease:{validate_name(batch_id, 'batch id')}"

    def file(self, file_id: str) -> str:
        return f"{self.prefix}:file:{validate_name(file_id, 'file id')}"
