"""The writer tests' Redis set-up: a job stream of model "m" with entries read by a consumer, and
the events a reply stream holds."""

from __future__ import annotations

import msgpack

from producer.events import decode_event
from producer.protocol import REPLY_FIELD, Keys
from tests.harness.fleet import RedisServer
from worker.streams import JobStream

KEYS = Keys(model="m")  # (the jobs of the replies here: model m's)
JOBS = KEYS.jobs("m")
STREAMS = [JobStream(JOBS, KEYS.dead("m"), None)]  # a writer that checks every write
FENCED = [JobStream(JOBS, KEYS.dead("m"), KEYS.fence("m", "me"))]


def setup_group(server: RedisServer, consumer: str, count: int) -> list[str]:
    conn = server.client()
    conn.xgroup_create(JOBS, "workers", id="0", mkstream=True)
    for i in range(count):
        conn.xadd(JOBS, {"v": b"2", "job": msgpack.packb({"id": f"j{i}"})})
    got = conn.xreadgroup("workers", consumer, {JOBS: ">"}, count=count)
    return [eid.decode() for eid, _ in got[0][1]]


def events_of(server: RedisServer, job_id: str) -> list[dict[str, object]]:
    return [decode_event(f[REPLY_FIELD.encode()])
            for _, f in server.client().xrange(KEYS.reply(job_id))]
