"""The OpenAI Batch API on the gateway: /v1/files (purpose "batch") and /v1/batches.

Where things live:
- File bodies: in the gateway's --files-dir, one file per id (share the folder between
  replicas). File objects: `<prefix>:file:<id>` in Redis.
- Batches: `<prefix>:batch:<id>`, a hash with the batch object (`obj`, JSON; only the process
  that drives the batch writes it once created) and the cancel request (`cancel`, written by the
  cancel route). `<prefix>:batches` lists every batch by creation time, `<prefix>:batches:active`
  the ones not ended.
- Results: `<files-dir>/<batch id>.output.jsonl` and `.errors.jsonl`, appended to line by line,
  registered as the batch's output and error files once it ends.

Who runs a batch: a gateway process that holds its lease (`<prefix>:batch-lease:<id>`, SET NX
with a TTL, renewed while it runs). Every gateway process looks for active batches without a
lease every LOOK_S and takes them over. A takeover after a crash re-reads what the results files
hold and re-attaches to the running jobs, whose ids derive from (batch id, line): no line runs
twice, and none is lost. Lines run as jobs at the gateway's --batch-priority, below interactive
requests.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from pathlib import Path
from typing import Any

import redis

from producer.client import Client
from producer.connection import RETRYABLE, connect
from producer.openai_schema import GatewayError
from producer.protocol import Keys, as_str
from producer.run_batch import ENDPOINTS, Batch, done_ids, parse

log = logging.getLogger("genq.gateway")
LEASE_MS = 10_000
LOOK_S = 2.0
WINDOW_S = 24 * 3600
KEEP_S = 30 * 24 * 3600  # file objects, and batches once ended, live this long in Redis
TERMINAL = ("completed", "failed", "cancelled", "expired")


def new_id(kind: str) -> str:
    return f"{kind}-{secrets.token_hex(12)}" if kind == "file" else f"batch_{secrets.token_hex(12)}"


class Files:
    """File bodies on disk, file objects in Redis (sync: the routes call it through a thread)."""

    def __init__(self, url: str, keys: Keys, directory: Path) -> None:
        self.conn = connect(url)
        self.keys = keys
        self.dir = directory  # (made on the first upload)

    def path(self, file_id: str) -> Path:
        return self.dir / f"{file_id}.jsonl"

    def register(self, file_id: str, size: int, filename: str, purpose: str) -> dict[str, Any]:
        now = int(time.time())
        obj = {"id": file_id, "object": "file", "bytes": size, "created_at": now,
               "expires_at": now + KEEP_S, "filename": filename, "purpose": purpose}
        self.conn.set(self.keys.file(file_id), json.dumps(obj), ex=KEEP_S)
        return obj

    def create(self, content: bytes, filename: str, purpose: str) -> dict[str, Any]:
        if purpose != "batch":
            raise GatewayError(400, f"purpose {purpose!r} is not supported: the gateway keeps "
                               "files for the Batch API only (purpose 'batch')", param="purpose")
        file_id = new_id("file")
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path(file_id).write_bytes(content)
        return self.register(file_id, len(content), filename, purpose)

    def get(self, file_id: str) -> dict[str, Any]:
        try:
            raw = self.conn.get(self.keys.file(file_id))
        except ValueError:  # (a ProtocolError: not a valid id)
            raw = None
        if raw is None:
            raise GatewayError(404, f"no file {file_id!r}", param="file_id", code="not_found")
        obj: dict[str, Any] = json.loads(raw)
        return obj

    def delete(self, file_id: str) -> dict[str, Any]:
        self.get(file_id)
        self.conn.delete(self.keys.file(file_id))
        self.path(file_id).unlink(missing_ok=True)
        return {"id": file_id, "object": "file", "deleted": True}


class Batches:
    """Batch objects in Redis, and the threads that run them in this process."""

    def __init__(self, url: str, keys: Keys, files: Files, priority: int) -> None:
        self.url = url
        self.conn = connect(url)
        self.keys = keys
        self.files = files
        self.priority = priority
        self.token = secrets.token_hex(8)  # this process's lease token
        self.running: set[str] = set()
        self._lock = threading.Lock()
        self._halt = threading.Event()

    def start(self) -> None:
        """Look for orphaned batches from now on (the app's start-up)."""
        self._halt.clear()
        threading.Thread(target=self._look, name="genq-batches", daemon=True).start()

    def stop(self) -> None:
        self._halt.set()

    # ------------------------------------------------------------------ the routes' side

    def create(self, body: dict[str, Any]) -> dict[str, Any]:
        endpoint = body.get("endpoint")
        if endpoint not in ENDPOINTS:
            raise GatewayError(400, f"endpoint must be one of {', '.join(ENDPOINTS)}, got "
                               f"{endpoint!r}", param="endpoint")
        if body.get("completion_window", "24h") != "24h":
            raise GatewayError(400, "completion_window must be '24h'", param="completion_window")
        source = self.files.get(str(body.get("input_file_id")))
        if source["purpose"] != "batch":
            raise GatewayError(400, f"file {source['id']} has purpose {source['purpose']!r}, "
                               "not 'batch'", param="input_file_id")
        now = int(time.time())
        obj = {"id": new_id("batch"), "object": "batch", "endpoint": endpoint, "errors": None,
               "input_file_id": source["id"], "completion_window": "24h",
               "status": "validating", "output_file_id": None, "error_file_id": None,
               "created_at": now, "in_progress_at": None, "expires_at": now + WINDOW_S,
               "finalizing_at": None, "completed_at": None, "failed_at": None,
               "expired_at": None, "cancelling_at": None, "cancelled_at": None,
               "request_counts": {"total": 0, "completed": 0, "failed": 0},
               "metadata": body.get("metadata")}
        pipe = self.conn.pipeline(transaction=True)
        pipe.hset(self.keys.batch(obj["id"]), "obj", json.dumps(obj))
        pipe.zadd(self.keys.batches, {obj["id"]: now})
        pipe.sadd(self.keys.batches_active, obj["id"])
        pipe.expire(self.keys.batches, KEEP_S)  # (both refreshed by every batch created)
        pipe.expire(self.keys.batches_active, KEEP_S)
        pipe.execute()
        self._take(obj["id"])
        return obj

    def get(self, batch_id: str) -> dict[str, Any]:
        try:
            raw = self.conn.hmget(self.keys.batch(batch_id), "obj", "cancel")
        except ValueError:
            raw = [None, None]
        if raw[0] is None:
            raise GatewayError(404, f"no batch {batch_id!r}", param="batch_id", code="not_found")
        obj: dict[str, Any] = json.loads(raw[0])
        if raw[1] is not None and obj["status"] not in TERMINAL:
            obj["status"], obj["cancelling_at"] = "cancelling", int(raw[1])
        return obj

    def list(self, limit: int, after: str | None) -> dict[str, Any]:
        ids = [as_str(i) for i in self.conn.zrevrange(self.keys.batches, 0, -1)]  # type: ignore[arg-type]
        if after is not None and after in ids:
            ids = ids[ids.index(after) + 1:]
        page = []
        for batch_id in ids[:limit]:
            try:
                page.append(self.get(batch_id))
            except GatewayError:  # expired (KEEP_S after its end): out of the list too
                self.conn.zrem(self.keys.batches, batch_id)
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(ids) > limit}

    def cancel(self, batch_id: str) -> dict[str, Any]:
        obj = self.get(batch_id)
        if obj["status"] not in TERMINAL:
            self.conn.hsetnx(self.keys.batch(batch_id), "cancel", int(time.time()))
        return self.get(batch_id)

    # ------------------------------------------------------------------ running batches

    def _look(self) -> None:
        """Take over active batches that no process holds (at start, and every LOOK_S)."""
        while not self._halt.is_set():
            try:
                for raw in self.conn.smembers(self.keys.batches_active):
                    batch_id = as_str(raw)
                    if batch_id not in self.running and not self.conn.exists(
                            self.keys.batch_lease(batch_id)):
                        self._take(batch_id)
            except RETRYABLE as exc:
                log.warning("looking for batches to run failed: %s", exc)
            except redis.ResponseError as exc:  # e.g. an ACL without the batch keys
                log.warning("the Batch API is off in this gateway process: Redis refused its "
                            "keys (%s); grant its user the batch and file keys "
                            "(docs/security.md)", exc)
                return
            self._halt.wait(LOOK_S)

    def _take(self, batch_id: str) -> None:
        with self._lock:
            if batch_id in self.running:
                return
            if not self.conn.set(self.keys.batch_lease(batch_id), self.token, nx=True,
                                 px=LEASE_MS):
                return  # another process runs it
            self.running.add(batch_id)
        threading.Thread(target=self._drive, args=(batch_id,), name=f"genq-{batch_id}",
                         daemon=True).start()

    def _renew(self, batch_id: str) -> bool:
        """Keep the lease; False if it is someone else's now (this process stops driving)."""
        key = self.keys.batch_lease(batch_id)
        if self.conn.get(key) != self.token.encode():
            return False
        return bool(self.conn.set(key, self.token, xx=True, px=LEASE_MS))

    def _save(self, obj: dict[str, Any]) -> None:
        self.conn.hset(self.keys.batch(obj["id"]), "obj", json.dumps(obj))

    def _drive(self, batch_id: str) -> None:
        try:
            BatchRun(self, batch_id).run()
        except Exception:  # a bug must not kill the gateway; another look retries it
            log.exception("batch %s failed to run", batch_id)
        finally:
            with self._lock:
                self.running.discard(batch_id)
            key = self.keys.batch_lease(batch_id)
            try:
                if self.conn.get(key) == self.token.encode():
                    self.conn.delete(key)
            except RETRYABLE:
                pass


class BatchRun:
    """One batch, driven by the process that holds its lease."""

    def __init__(self, owner: Batches, batch_id: str) -> None:
        self.owner = owner
        self.obj = json.loads(owner.conn.hget(owner.keys.batch(batch_id), "obj") or "{}")
        self.out = owner.files.dir / f"{batch_id}.output.jsonl"
        self.err = owner.files.dir / f"{batch_id}.errors.jsonl"
        self._renewed = time.monotonic()
        self._saved = 0.0
        self._unsaved = False

    def run(self) -> None:
        obj, owner = self.obj, self.owner
        if obj["status"] in TERMINAL:
            owner.conn.srem(owner.keys.batches_active, obj["id"])
            return
        try:
            raw_lines = owner.files.path(obj["input_file_id"]).read_text().splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            return self._end("failed", errors={"object": "list", "data": [
                {"code": "invalid_file", "message": f"the input file cannot be read: {exc}"}]})
        seen: set[str] = set()
        lines = [parse(n, raw, None, seen, salt=obj["id"], endpoint=obj["endpoint"])
                 for n, raw in enumerate(raw_lines, 1) if raw.strip()]
        done = done_ids(self.out) | done_ids(self.err)
        counts = obj["request_counts"]
        counts["total"] = len(lines)
        counts["completed"] = len(done_ids(self.out))
        counts["failed"] = len(done_ids(self.err))
        todo = [line for line in lines if line.line_id not in done]
        if obj["status"] == "validating":
            obj["status"], obj["in_progress_at"] = "in_progress", int(time.time())
        self._save(force=True)
        with Client(owner.url, prefix=owner.keys.prefix) as client, \
                open(self.out, "a") as out, open(self.err, "a") as err:
            def emit(output: dict[str, Any]) -> None:
                ok = output["response"] is not None and output["response"]["status_code"] == 200
                (out if ok else err).write(json.dumps(output) + "\n")
                (out if ok else err).flush()
                counts["completed" if ok else "failed"] += 1
                self._save()

            batch = Batch(client, todo, emit, owner.priority, ordered=False)
            finished = batch.run(stop=self._stop)
            if not finished:
                if self._cancel_requested() or time.time() > obj["expires_at"]:
                    batch.cancel_unfinished()
                    self._end("cancelled" if self._cancel_requested() else "expired")
                return  # (the lease went to another process: it goes on)
        obj["status"], obj["finalizing_at"] = "finalizing", int(time.time())
        self._save(force=True)
        self._end("completed")

    def _stop(self) -> bool:
        if self._unsaved:
            self._save()
        if time.monotonic() - self._renewed > LEASE_MS / 3000:
            self._renewed = time.monotonic()
            if not self.owner._renew(self.obj["id"]):
                return True
        return self._cancel_requested() or time.time() > self.obj["expires_at"]

    def _cancel_requested(self) -> bool:
        return bool(self.owner.conn.hexists(self.owner.keys.batch(self.obj["id"]), "cancel"))

    def _save(self, force: bool = False) -> None:
        """Write the batch object, at most every 0.2 s unless forced; a write held back goes out
        at the next stop check (so the counts never wait for a line that has not ended)."""
        now = time.monotonic()
        if force or now - self._saved > 0.2:
            self._saved, self._unsaved = now, False
            self.owner._save(self.obj)
        else:
            self._unsaved = True

    def _end(self, status: str, errors: dict[str, Any] | None = None) -> None:
        obj, owner = self.obj, self.owner
        for path, field in ((self.out, "output_file_id"), (self.err, "error_file_id")):
            if path.exists() and path.stat().st_size:
                file_id = new_id("file")
                path.rename(owner.files.path(file_id))
                owner.files.register(file_id, owner.files.path(file_id).stat().st_size,
                                     path.name, "batch_output")
                obj[field] = file_id
        obj["status"], obj[f"{status}_at"] = status, int(time.time())
        if errors is not None:
            obj["errors"] = errors
        self._save(force=True)
        owner.conn.expire(owner.keys.batch(obj["id"]), KEEP_S)
        owner.conn.srem(owner.keys.batches_active, obj["id"])
