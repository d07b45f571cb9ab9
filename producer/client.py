"""Client and Job: submit generation jobs to a genq fleet and read their replies (blocking API)."""

from __future__ import annotations

import hashlib
import secrets
import time
from collections.abc import Iterator, Sequence
from typing import Any

import redis

from producer import connection
from producer.errors import NotReplicated, ResultExpired
from producer.events import ClientEvent, DoneEvent
from producer.lanes import job_stream
from producer.protocol import (
    DEFAULT_PREFIX,
    PROTOCOL_VERSION,
    SUBMIT_LUA,
    JobSpec,
    Keys,
    as_str,
    check_job_spec,
    encode_job_entry,
    job_model,
    new_job_id,
)
from producer.reply_reader import (
    BLOCK_MS,
    REPLY_READ_COUNT,
    ReplyReader,
    result_from_events,
)
from producer.results import reply_expired, wait_results
from producer.shards import ShardCounts, sharded_job_id

DEFAULT_URL = "redis://127.0.0.1:6379/0"
DEFAULT_IDEMPOTENCY_TTL = 24 * 3600
DEFAULT_STREAM_TTL = 7 * 24 * 3600
DEFAULT_CANCEL_TTL = 3600
SUBMIT_SHA = hashlib.sha1(SUBMIT_LUA.encode()).hexdigest()


def connect(url: str, *, blocking: bool = False) -> redis.Redis:
    """A Redis client; a blocking one gets a socket timeout well above the BLOCK time."""
    return connection.connect(url, socket_timeout=BLOCK_MS / 1000 + 10 if blocking else 5.0)


Prompt = str | Sequence[int]
Messages = Sequence[dict[str, str]]


def make_job_spec(prompt: Prompt | None, params: dict[str, Any] | None, model: str,
                  job_id: str | None, deadline: float | None, stream: bool,
                  messages: Messages | None = None, priority: int = 0) -> JobSpec:
    """Build and check a job: a prompt (text or token ids) or chat `messages` ([{"role",
    "content"}, ...], templated by the worker), not both. Sampling without a seed gets a seed
    here, so a replay after a failover samples the same tokens."""
    if (prompt is None) == (messages is None):
        raise ValueError("give exactly one of a prompt (text or token ids) and messages=[...]")
    params = dict(params or {})
    seed = None
    if params.get("seed") is None and params.get("temperature", 1.0) != 0:
        seed = secrets.randbits(63)
    text = prompt if isinstance(prompt, str) else None
    ids = None if prompt is None or isinstance(prompt, str) else list(prompt)
    chat = None if messages is None else [dict(m) for m in messages]
    spec = JobSpec(id=job_id or new_job_id(model), model=model, prompt=text, prompt_token_ids=ids,
                   messages=chat, params=params, seed=seed, created=time.time(), deadline=deadline,
                   stream=stream, priority=priority)
    return check_job_spec(spec)


class ClientSettings:
    """What Client and AsyncClient share: the URL, key names, TTLs, the durability settings,
    and the submit script's arguments for a job.

    min_replicas: after a submit, wait (WAIT) until this many replicas hold it, for at most
    replica_timeout seconds, else raise NotReplicated. failover_timeout: with a
    redis+sentinel:// URL, how long a submit keeps retrying a lost or demoted primary (a
    failover) before it raises; plain URLs raise at once."""

    def __init__(self, url: str = DEFAULT_URL, *, prefix: str = DEFAULT_PREFIX,
                 idempotency_ttl: int = DEFAULT_IDEMPOTENCY_TTL,
                 stream_ttl: int = DEFAULT_STREAM_TTL,
                 cancel_ttl: int = DEFAULT_CANCEL_TTL, min_replicas: int = 0,
                 replica_timeout: float = 1.0, failover_timeout: float = 30.0) -> None:
        if min_replicas < 0 or replica_timeout <= 0 or failover_timeout < 0:
            raise ValueError("min_replicas must be >= 0, replica_timeout > 0 and "
                             "failover_timeout >= 0")
        if min_replicas and connection.parse(url).is_cluster:
            raise ValueError(f"min_replicas: {connection.NO_REPLICA_WAIT_ON_CLUSTER}")
        self.url = url
        self.keys = Keys(prefix)
        self.shard_counts = ShardCounts(self.keys)  # (producer/shards.py)
        self.idempotency_ttl = idempotency_ttl
        self.stream_ttl = stream_ttl
        self.cancel_ttl = cancel_ttl
        self.min_replicas = min_replicas
        self.replica_timeout = replica_timeout
        self.retry_for = failover_timeout if connection.parse(url).is_sentinel else 0.0

    def submit_call(self, spec: JobSpec) -> tuple[list[Any], list[Any]]:
        """The keys and args of SUBMIT_LUA for `spec`."""
        return ([self.keys.idem(spec.id, spec.model), job_stream(self.keys, spec)],
                [self.idempotency_ttl, PROTOCOL_VERSION, encode_job_entry(spec)["job"],
                 self.stream_ttl])

    def failover_delays(self) -> Iterator[float]:
        """The waits between a submit's attempts while a failover may be under way; exhausted
        (the caller re-raises) past failover_timeout. A submit is idempotent per job id, so
        retrying one that landed before the connection broke is safe."""
        end = time.monotonic() + self.retry_for
        delay = 0.05
        while time.monotonic() + delay <= end:
            yield delay
            delay = min(delay * 2, 1.0)

    def replicated(self, results: list[Any], specs: Sequence[JobSpec]) -> list[Any]:
        """The submit pipeline's results less the WAIT's count, which must reach min_replicas
        (else NotReplicated)."""
        if self.min_replicas:
            acks = int(results.pop())
            if acks < self.min_replicas:
                raise NotReplicated([s.id for s in specs], acks, self.min_replicas,
                                    self.replica_timeout)
        return results

    def submit_pipeline(self, conn: Any, specs: Sequence[JobSpec]) -> Any:
        """A pipeline (not run yet) of SUBMIT_LUA for each of `specs`, then the WAIT."""
        pipe = conn.pipeline(transaction=False)
        for spec in specs:
            keys, args = self.submit_call(spec)
            pipe.execute_command("EVALSHA", SUBMIT_SHA, len(keys), *keys, *args)
        self.queue_wait(pipe)
        return pipe

    def queue_wait(self, pipe: Any) -> None:
        """Add the WAIT for min_replicas to a pipeline (same connection as its writes)."""
        if self.min_replicas:
            pipe.wait(self.min_replicas, max(1, int(self.replica_timeout * 1000)))


class Client(ClientSettings):
    """Blocking client. `submit` is idempotent per job id (the id runs once). Keyword settings:
    prefix, idempotency_ttl, stream_ttl, cancel_ttl (ClientSettings)."""

    def __init__(self, url: str = DEFAULT_URL, **settings: Any) -> None:
        super().__init__(url, **settings)
        self.redis = connect(url)
        self.blocking_redis = connect(url, blocking=True)
        self._submit_script = self.redis.register_script(SUBMIT_LUA)

    def submit(self, prompt: Prompt | None = None, params: dict[str, Any] | None = None, *,
               model: str, messages: Messages | None = None, job_id: str | None = None,
               deadline: float | None = None, stream: bool = True,
               priority: int = 0) -> Job:
        """Enqueue one job: a prompt (text or token ids), or a chat as `messages=[{"role": ...,
        "content": ...}, ...]` that the worker renders with the model's chat template.
        `priority`: lower runs sooner (vLLM's meaning; workers under --scheduling-policy
        priority, the default, order their admitted jobs by it)."""
        job_id = job_id or sharded_job_id(model, self.shard_counts.get(self.redis, model))
        spec = make_job_spec(prompt, params, model, job_id, deadline, stream, messages,
                             priority)
        (entry_id,) = self._submit([spec])
        return Job(self, spec.id, model, created=entry_id is not None,
                   entry_id=None if entry_id is None else as_str(entry_id))

    def submit_many(self, prompts: Sequence[str | Sequence[int]],
                    params: dict[str, Any] | None = None, *, model: str,
                    stream: bool = True, priority: int = 0) -> list[Job]:
        """Submit many jobs in one pipelined round trip (fresh ids)."""
        shards = self.shard_counts.get(self.redis, model)
        specs = [make_job_spec(p, params, model, sharded_job_id(model, shards), None, stream,
                               priority=priority) for p in prompts]
        ids = self._submit(specs)
        return [Job(self, spec.id, model, created=eid is not None,
                    entry_id=None if eid is None else as_str(eid))
                for spec, eid in zip(specs, ids, strict=True)]

    def _submit(self, specs: Sequence[JobSpec]) -> list[Any]:
        """SUBMIT_LUA per job, across a failover: the entry ids (None: the id existed)."""
        delays = self.failover_delays()
        while True:
            try:
                if len(specs) == 1 and not self.min_replicas:  # (no pipeline: one round trip)
                    keys, args = self.submit_call(specs[0])
                    return [self._submit_script(keys=keys, args=args)]
                return self._submit_pipelined(specs)
            except connection.RETRYABLE:
                delay = next(delays, None)
                if delay is None:
                    raise
                time.sleep(delay)

    def _submit_pipelined(self, specs: Sequence[JobSpec]) -> list[Any]:
        """The submits in one pipeline, as EVALSHA commands (a cluster's pipeline routes each by
        its keys; it refuses redis-py's script objects). A NOSCRIPT loads the script and runs
        the pipeline again (a submit is idempotent per job id)."""
        try:
            return self.replicated(self.submit_pipeline(self.redis, specs).execute(), specs)
        except redis.exceptions.NoScriptError:
            self.redis.script_load(SUBMIT_LUA)
            return self.replicated(self.submit_pipeline(self.redis, specs).execute(), specs)

    def results(self, jobs: Sequence[Job], timeout: float | None = 60.0, *,
                return_exceptions: bool = False) -> list[Any]:
        """[job.result() for job in jobs] in a few round trips: one XREAD reads up to 512
        reply streams. A failed job raises its JobError once all have ended (the first in
        order), or with `return_exceptions` takes its place in the list (as does a TimeoutError
        for each job still unfinished at `timeout`)."""
        return wait_results(self.blocking_redis, jobs, timeout, return_exceptions)

    def job(self, job_id: str, model: str = "") -> Job:
        """A handle on a job submitted elsewhere (to stream or cancel it). `model` may be left
        out for ids genq made (they name their model)."""
        return Job(self, job_id, model, created=False)

    def cancel(self, job_id: str, model: str | None = None) -> None:
        """Cancel a job (`model`: as for job()). The flag is the cancel; the shard publish
        tells the model's workers at once."""
        model = model or job_model(job_id)
        pipe = self.redis.pipeline(transaction=False)
        pipe.set(self.keys.cancel(job_id, model), 1, ex=self.cancel_ttl)
        pipe.spublish(self.keys.cancel_channel(model), job_id)
        pipe.execute()

    def close(self) -> None:
        self.redis.close()
        self.blocking_redis.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Job:
    """One submitted job. `created` is False when the id had already been submitted."""

    def __init__(self, client: Client, job_id: str, model: str, created: bool,
                 entry_id: str | None = None) -> None:
        self.client = client
        self.id = job_id
        self.model = model
        self.created = created
        self.entry_id = entry_id  # the job-stream entry (its ms part is the enqueue time)
        self.reply_key = client.keys.reply(job_id, model or None)

    def __repr__(self) -> str:
        return f"Job(id={self.id!r}, model={self.model!r})"

    def raw_events(self, timeout: float | None = None,
                   last_id: str = "0-0") -> Iterator[ClientEvent]:
        """Every event in the reply stream, in order, across reconnects (resumes from the last
        id read). Raises TimeoutError when `timeout` seconds pass without the stream ending."""
        reader = ReplyReader(timeout, time.monotonic(), dedupe=False, cursor=last_id)
        for _entry_id, event in self._read(reader):
            yield event

    def stream(self, timeout: float | None = None) -> Iterator[ClientEvent]:
        """started / tokens / restart / done / error events; each (index, pos) once."""
        for _entry_id, event in self._read(ReplyReader(timeout, time.monotonic())):
            yield event

    def result(self, timeout: float | None = 60.0) -> DoneEvent:
        """The done event: outputs[i]["token_ids"/"text"/"finish_reason"], usage, timing.
        Raises JobError if the job ended with an error."""
        reader = ReplyReader(timeout, time.monotonic())
        for _item in self._read(reader):
            pass
        return result_from_events(self.id, reader.terminal)

    def _read(self, reader: ReplyReader) -> Iterator[tuple[str, ClientEvent]]:
        """The reads and waits around `reader` (producer/reply_reader.py has the rules)."""
        conn = self.client.blocking_redis
        while True:
            try:
                resp = conn.xread({self.reply_key: reader.cursor}, count=REPLY_READ_COUNT,
                                  block=reader.block_ms(time.monotonic()))
            except redis.RedisError as exc:
                if not connection.retryable(exc):
                    raise
                time.sleep(reader.read_failed(time.monotonic()))
            else:
                yield from reader.feed(_entries(resp))
            if reader.finished:
                return
            if reader.expiry_check_due(time.monotonic()) and reply_expired(
                    self.client.redis, self.client.keys.idem(self.id, self.model or None),
                    self.reply_key):
                raise ResultExpired(self.id)
            if reader.timed_out(time.monotonic()):
                raise reader.timeout_error(self.id)

    def cancel(self) -> None:
        self.client.cancel(self.id, self.model or None)


def _entries(resp: Any) -> list[Any]:
    """The entries of an XREAD answer on one stream."""
    return [entry for _key, entries in resp or [] for entry in entries]
