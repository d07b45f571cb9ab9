"""Reply keys are built only from validated ids: raw job entries (XADD straight onto the job
stream, as a hostile producer could) with ids meant to escape genq:reply:* never make the worker
write a key outside genq:reply:<valid id> / genq:dead:<model> / its heartbeat. Entries without a
valid id are dead-lettered with the reason; odd but valid ids (genq:jobs:tiny is one) stay under
genq:reply:.

The worker here connects as the default user (tls_fleet): no ACL stands in the way, so the keys
found afterwards are what the code wrote, not what Redis let through."""

from __future__ import annotations

import time
from typing import Any

import msgpack

from producer.events import decode_event
from producer.lanes import lane_keys
from producer.protocol import REPLY_FIELD, Keys
from tests.harness.fleet import WorkerProcess, wait_for
from tests.harness.oracle import Oracle
from tests.harness.secure_redis import SecureRedis

KEYS = Keys(model="tiny")  # (the jobs of the replies here: model tiny's)
JOBS_KEY = KEYS.jobs("tiny")
DEAD_KEY = KEYS.dead("tiny")
PARAMS = {"temperature": 0, "max_tokens": 2}
PROMPT = "the quick brown fox"
RULE = "must be 1-128 characters from [A-Za-z0-9_.:-]"
_MISSING = object()

# id -> the dead letter's exact reason
INVALID_IDS: list[tuple[object, str]] = [
    ("../x", f"job id '../x' {RULE}"),
    ("a b", f"job id 'a b' {RULE}"),
    ("x" * 1000, f"job id {'x' * 128!r} {RULE}"),
    ("y" * 129, f"job id {'y' * 128!r} {RULE}"),
    ("", f"job id '' {RULE}"),
    ("id\r\nFLUSHALL", f"job id 'id\\r\\nFLUSHALL' {RULE}"),
    ("genq:*", f"job id 'genq:*' {RULE}"),
    ("genq:reply:x/../../y", f"job id 'genq:reply:x/../../y' {RULE}"),
    ("\u00efd", f"job id '\u00efd' {RULE}"),
    (7, "job id must be a string, got int"),
    (None, "job id must be a string, got NoneType"),
    (_MISSING, "job id must be a string, got NoneType"),
    (b"bytes-id", "job id must be a string, got bytes"),
    (["list"], "job id must be a string, got list"),
]
VALID_ODD_IDS = ["genq:jobs:tiny", "z" * 128, "..", "-", "genq:reply:nested", "genq:dead:tiny"]
# valid ids whose model names a stream this worker does not serve: an error on their reply
BAD_MODELS = [("model-escape", "../../x", f"model name '../../x' {RULE}"),
              ("model-other", "other",
               "model 'other' is not served here (this stream's worker serves 'tiny')")]


def job(job_id: object, model: str = "tiny") -> bytes:
    body: dict[str, Any] = {"model": model, "prompt": PROMPT, "params": PARAMS, "seed": None,
                            "created": time.time(), "deadline": None, "stream": True}
    if job_id is not _MISSING:
        body["id"] = job_id
    return msgpack.packb(body, use_bin_type=True)


def reply(conn: Any, job_id: str) -> list[dict[str, Any]]:
    return [decode_event(f[REPLY_FIELD.encode()]) for _id, f in conn.xrange(KEYS.reply(job_id))]


def all_keys(conn: Any) -> set[str]:
    return {k.decode() for k in conn.scan_iter(count=1000)}


def test_hostile_ids_never_lead_the_worker_outside_its_keys(
        tls_fleet: tuple[SecureRedis, WorkerProcess], offline: Oracle) -> None:
    server, worker = tls_fleet
    conn = server.client()
    before = all_keys(conn)
    invalid = {conn.xadd(JOBS_KEY, {"v": b"2", "job": job(i)}).decode(): (i, reason)
               for i, reason in INVALID_IDS}
    for job_id in VALID_ODD_IDS:
        conn.xadd(JOBS_KEY, {"v": b"2", "job": job(job_id)})
    for job_id, model, _ in BAD_MODELS:
        conn.xadd(JOBS_KEY, {"v": b"2", "job": job(job_id, model)})
    ends = [*VALID_ODD_IDS, *(m[0] for m in BAD_MODELS)]

    def finished() -> bool:
        return (conn.xlen(JOBS_KEY) == 0 and conn.xpending(JOBS_KEY, "workers")["pending"] == 0
                and all(reply(conn, i) and reply(conn, i)[-1]["type"] in ("done", "error")
                        for i in ends))

    wait_for(finished, timeout=120, interval=0.1, what="every entry finished")

    # entries without a valid id: dead-lettered, with the reason, the raw payload, and no reply
    dead = {f[b"entry"].decode(): f for _id, f in conn.xrange(DEAD_KEY)}
    assert sorted(dead) == sorted(invalid)
    for entry, (job_id, reason) in invalid.items():
        fields = dead[entry]
        assert (fields[b"code"], fields[b"reason"].decode(), fields[b"worker"]) == (
            b"bad_id", reason, b"tls-w"), job_id
        assert msgpack.unpackb(fields[b"job"], raw=False).get("id", _MISSING) == job_id

    # odd but valid ids: the job ran and answered on genq:reply:<id>, nowhere else
    expected = offline([PROMPT], PARAMS)[0]
    for job_id in VALID_ODD_IDS:
        events = reply(conn, job_id)
        assert (events[0]["type"], events[-1]["type"]) == ("started", "done"), job_id
        tokens = [t for e in events[1:-1] if e["type"] == "tokens" for t in e["token_ids"]]
        assert tokens == expected[0][0], job_id
        assert [(o["token_ids"], o["text"], o["finish_reason"])
                for o in events[-1]["outputs"]] == expected
    for job_id, _model, message in BAD_MODELS:
        assert [(e["type"], e.get("code"), e.get("message")) for e in reply(conn, job_id)] == [
            ("error", "unknown_model", message)]

    # the whole keyspace: only the reply streams of valid ids (and the dead-letter stream) are
    # new; every key is genq's, and every key has a TTL
    new = all_keys(conn) - before
    assert new == {KEYS.reply(i) for i in ends} | ({DEAD_KEY} - before)
    assert conn.xlen(KEYS.dead("other")) == 0 and conn.xlen(KEYS.jobs("other")) == 0
    after = all_keys(conn)
    assert {k for k in after if not k.startswith(("genq:reply:", "genq:idem:"))} == {
        *lane_keys(KEYS, "tiny"), DEAD_KEY, KEYS.worker("tiny", worker.name),
        KEYS.workers("tiny"), KEYS.models}
    assert [k for k in after if conn.ttl(k) < 0] == []
    assert list(conn.info("keyspace")) == ["db0"]
