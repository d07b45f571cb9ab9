"""The writer: each engine step's events go to Redis in ONE pipelined round trip while the loop
runs the next step. It runs as a thread of the worker (--writer thread) or, driven through
`write_batches`, in a child process of its own (worker/writer_process.py, the default).

Batches queued while a round trip is in flight are merged into the next one. A write that fails
on a lost connection is retried (backoff) until it succeeds, so nothing is lost: the fenced
scripts make a retried write either a duplicate the client drops by (index, pos) or a no-op.

Writes name entries by their ref (worker/streams.py); each script call is about the entries of
one stream (and slot), so a step's writes are one call per stream that has some.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

import redis

from producer.connection import RETRYABLE
from producer.protocol import as_str
from worker.batch import (
    Batch,
    EventWrite,
    FinishWrite,
    finish_args,
    finish_keys,
    first_tokens_first,
    merge,
)
from worker.event_calls import EventsCall, Fence, by_stream, event_calls, raw_finish
from worker.scripts import Scripts
from worker.streams import JobStream, ref, split_ref

log = logging.getLogger("genq.worker")
_GONE_KEEP_S = 10.0
REPLICA_WAIT_MS = 1000  # the longest a write that ends jobs waits for --min-replicas


class Writer(threading.Thread):
    def __init__(self, conn: redis.Redis, streams: list[JobStream], group: str, me: str,
                 reply_ttl: int, dead_ttl: int, max_events_per_call: int = 1024,
                 min_replicas: int = 0) -> None:
        super().__init__(name="genq-writer", daemon=True)
        self.conn = conn
        self.scripts = Scripts(conn)
        # Per stream (index: the refs'): its keys, and its fence counter (JobStream.fence, this
        # worker's; WRITE_EVENTS_LUA): while it reads as at the last full ownership check, token
        # writes skip the check. None: check every write.
        self.streams = streams
        self.fences = [Fence() for _ in streams]
        self.group = group
        self.me = me
        self.reply_ttl = reply_ttl
        self.dead_ttl = dead_ttl
        self.max_events_per_call = max_events_per_call
        # --min-replicas: a write that ends jobs waits (WAIT, REPLICA_WAIT_MS) until this many
        # replicas hold it, so a failover right after loses no end a client may have read.
        self.min_replicas = min_replicas
        self.short_acks = 0  # writes that ended jobs before min_replicas acknowledged them
        # Attempts found lost, or finished here: events still queued for them are dropped (a
        # write that skips the ownership check would let them through, after the terminal
        # event). (entry, deliveries) -> when, oldest first; kept _GONE_KEEP_S.
        self._gone: dict[tuple[str, int], float] = {}
        self._gone_ids: dict[str, int] = {}  # entry id -> its attempts in _gone (a quick test)
        # Attempts no longer ours, as (entry id, deliveries): the attempt, not just the entry (a
        # newer delivery of the entry to this worker may be running by the time this is read).
        self.lost: queue.SimpleQueue[tuple[str, int]] = queue.SimpleQueue()
        self.finished: queue.SimpleQueue[str] = queue.SimpleQueue()  # finish writes done
        self.num_events_written = 0  # after coalescing
        self._queue: queue.Queue[Batch | None] = queue.Queue()
        self._ttl_set_at: dict[str, float] = {}  # reply key -> when this writer last set its TTL
        self.error: BaseException | None = None
        self._unwritable: set[str] = set()  # entries whose reply key is not a stream (logged)
        self.mark_ended = True  # idem keys' ended marks (FINISH_LUA); off if the ACL refuses
        self._abandoned = False

    def submit(self, batch: Batch) -> None:
        if batch:
            self._queue.put(batch)

    def backlog(self) -> int:
        return self._queue.qsize()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything submitted so far is written; False if `timeout` ran out."""
        end = None if timeout is None else time.monotonic() + timeout
        done = self._queue.all_tasks_done  # notified by task_done() when the last task ends
        with done:
            while self._queue.unfinished_tasks and self.error is None:
                left = 0.05 if end is None else end - time.monotonic()
                if left <= 0:
                    return False
                done.wait(min(left, 0.05))  # bounded: a failed writer notifies nobody
        self.check()
        return True

    def check(self) -> None:
        if self.error is not None:
            raise RuntimeError("the writer thread failed; stopping the worker") from self.error

    def stop(self, timeout: float = 30.0) -> None:
        self._queue.put(None)
        self.join(timeout=timeout)

    def abandon(self) -> None:
        """Give up what is held (Redis would not take it): the retries stop."""
        self._abandoned = True
        self._queue.put(None)

    def run(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # a bug here must stop the worker, not hang it
            log.exception("writer thread failed")
            self.error = exc
            self.finished.put("")  # wake nothing in particular; the loop checks .error

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            batches = [first]
            while True:  # merge whatever queued up behind the round trip in flight
                try:
                    batches.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            self.write_batches([b for b in batches if b is not None])
            for _ in batches:
                self._queue.task_done()
            if any(b is None for b in batches):
                return

    def write_batches(self, batches: list[Batch]) -> None:
        """Write `batches` (queued in this order) as one, retrying until Redis takes them."""
        merged = merge(batches)
        if merged:
            merged.events = first_tokens_first(merged.events)
            self._write_until_done(merged)

    def _write_until_done(self, batch: Batch) -> None:
        backoff = 0.05
        while True:
            try:
                self._write(batch)
                return
            except RETRYABLE as exc:  # (dropping the write would leave a gap in the tokens,
                # or a finished job unacked and run again)
                self._forget_fences()  # Redis may have restarted: check ownership again
                hint = " (Redis is out of memory: raise its maxmemory or free some)" \
                    if isinstance(exc, redis.exceptions.OutOfMemoryError) else ""
                log.warning("redis write failed (%s)%s; retrying in %.2f s", exc, hint, backoff)
            except (redis.ResponseError, redis.exceptions.RedisClusterException) as exc:
                # (refused for good: NOGROUP after Redis lost its data, an ACL, a cluster's
                # CROSSSLOT, found by redis-py before it sends)
                if isinstance(exc, redis.exceptions.NoPermissionError) and self.mark_ended \
                        and batch.finishes:
                    # A worker user whose ACL predates the ended marks (no ~genq:idem:*):
                    # finish without them from now on (rerunning the batch is safe: fenced).
                    self.mark_ended = False
                    log.warning("this worker's Redis user may not use genq:idem:* keys (%s): "
                                "jobs finish without the mark that lets clients tell an expired "
                                "result from a queued job; add ~genq:idem:* to its ACL "
                                "(docs/security.md)", exc)
                    continue
                if "NOGROUP" in str(exc) or not self._refused(batch, exc):
                    log.error("redis refused a write (%s); dropping it", exc)
                    for fin in batch.finishes:
                        if fin.reply_key is not None:
                            self._ttl_set_at.pop(fin.reply_key, None)
                        self.finished.put(fin.entry_id)
                return
            if self._abandoned:
                return
            time.sleep(backoff)
            backoff = min(backoff * 2, 2.0)

    def _refused(self, batch: Batch, exc: Exception) -> bool:
        """A write Redis refuses for good. Written again attempt by attempt, so that one job's
        refusal is not the others'. An attempt refused on its own counts as failed
        (FAIL_ATTEMPTS_LUA: a delivery more) and goes back to the loop as lost, which adopts it
        again as its next attempt: past --max-attempts it ends in the dead letters. A
        dead-letter finish refused on its own is written again as the dead letter and the ack
        alone (its reply key may be what Redis refuses). False: nothing left to try (a bare
        dead letter refused): the caller drops the write."""
        attempts: dict[tuple[str, int], Batch] = {}
        for w in batch.events:
            attempts.setdefault((w.entry_id, w.deliveries), Batch()).events.append(w)
        for fin in batch.finishes:
            attempts.setdefault((fin.entry_id, fin.deliveries), Batch()).finishes.append(fin)
        if len(attempts) > 1:
            for one in attempts.values():
                self._write_until_done(one)
            return True
        [(entry_ref, deliveries)] = attempts
        stream, entry_id = split_ref(entry_ref)
        dead = [fin for fin in batch.finishes if fin.dead_fields]
        if dead and all(fin.reply_key is None for fin in dead):
            return False
        if dead:
            log.error("redis refused the dead-lettering of entry %s (%s); writing the dead letter "
                      "alone", entry_id, exc)
            self._write_until_done(Batch(finishes=[
                fin._replace(reply_key=None, event=None, idem_key=None) for fin in dead]))
            return True
        log.error("redis refused the writes of entry %s (%s): its delivery %d counts as a failed "
                  "attempt", entry_id, exc, deliveries)
        try:
            self.scripts.fail_attempts(keys=[self.streams[stream].jobs],
                                       args=[self.group, self.me, entry_id, deliveries])
        except (*RETRYABLE, redis.ResponseError) as again:  # (its next write is fenced out)
            log.error("entry %s: counting its failed attempt failed too (%s)", entry_id, again)
        self._mark_gone(entry_ref, deliveries, time.monotonic())
        for fin in batch.finishes:
            if fin.reply_key is not None:
                self._ttl_set_at.pop(fin.reply_key, None)
            self.finished.put(fin.entry_id)
        self.lost.put((entry_ref, deliveries))
        return True

    def _write(self, batch: Batch) -> None:
        try:
            self._write_once(batch)
        except redis.exceptions.NoScriptError:  # Redis restarted or flushed its scripts
            self._forget_fences()
            self.scripts.load()
            self._write_once(batch)

    def _write_once(self, batch: Batch) -> None:
        pipe = self.conn.pipeline(transaction=False)
        now = time.monotonic()
        refreshed: list[str] = []  # reply keys whose TTL this write sets
        calls: list[EventsCall] = []
        for stream, events in by_stream(batch.events).items():
            calls += self._queue_events(pipe, stream, events, now, refreshed)
        finishes: list[FinishWrite] = []  # in the order of their calls
        step = self.max_events_per_call
        for stream, fins_of in by_stream(batch.finishes).items():
            keys = self.streams[stream]
            for lo in range(0, len(fins_of), step):
                fins = fins_of[lo:lo + step]
                finishes += fins
                self.scripts.queue(pipe, self.scripts.finish,
                                   finish_keys(fins, keys.jobs, keys.dead, self.mark_ended),
                                   finish_args([raw_finish(f) for f in fins], self.group, self.me,
                                               self.reply_ttl, self.dead_ttl))
        waits = bool(self.min_replicas and batch.finishes)
        if waits:
            pipe.wait(self.min_replicas, REPLICA_WAIT_MS)
        results = pipe.execute()
        if waits:
            self._check_acks(int(results.pop()), len(batch.finishes))
        for key in refreshed:  # only now: a retried write must set them again
            self._ttl_set_at[key] = now
        walked: set[int] = set()
        for call, result in zip(calls, results, strict=False):  # (events calls come first)
            self._take_events_result(call, result, now, walked)
        for fin, wrote in zip(finishes, (w for r in results[len(calls):] for w in r),
                              strict=True):
            if wrote == 2:
                log.warning("entry %s: its reply key %s is not a stream; the job is "
                            "dead-lettered (code reply_unwritable) instead of ending there",
                            fin.entry_id, fin.reply_key)
        for fin in batch.finishes:
            if fin.reply_key is not None:
                self._ttl_set_at.pop(fin.reply_key, None)
            self._mark_gone(fin.entry_id, fin.deliveries, now)
            verified = self.fences[split_ref(fin.entry_id)[0]].verified
            if verified.get(fin.entry_id) == fin.deliveries:
                del verified[fin.entry_id]
            self.finished.put(fin.entry_id)
        self._forget_gone(now)

    def _queue_events(self, pipe: Any, stream: int, events: list[EventWrite], now: float,
                      refreshed: list[str]) -> list[EventsCall]:
        """WRITE_EVENTS_LUA calls in `pipe` for one stream's `events`."""
        calls = []
        for call, keys, args in event_calls(
                self.streams[stream], stream, self.fences[stream], events, now,
                (self._gone_ids, self._gone), self._ttl_set_at, self.reply_ttl,
                self.max_events_per_call, refreshed):
            calls.append(call)
            self.scripts.queue(pipe, self.scripts.write_events, keys,
                               [self.group, self.me, *args])
        return calls

    def _take_events_result(self, call: EventsCall, result: Any, now: float,
                            walked: set[int]) -> None:
        stream, chunk, check = call.stream, call.writes, call.check
        fence_state = self.fences[stream]
        seen = as_str(result[0])
        lost = {ref(stream, as_str(e)) for e in result[1]}
        if seen != call.fence:  # the counter moved, or a periodic or first check: the script
            # walked every held entry of the stream, but only those of this write are known to
            # be ours now (the others are checked at their next write)
            if stream not in walked:
                walked.add(stream)
                fence_state.verified = {}
                fence_state.seen, fence_state.checked_at = seen, now
            check = [(w.entry_id, w.deliveries) for w in chunk]
        verified = fence_state.verified
        for entry_id, deliveries in check:  # (none at steady state)
            if entry_id not in lost:
                verified[entry_id] = deliveries
        if result[2]:  # a reply key that is not a stream: once per attempt in the log
            self._warn_unwritable(chunk, {ref(stream, as_str(e)) for e in result[2]})
        num_written = sum(len(w.events) for w in chunk)
        if lost:  # rare: entries reclaimed from us
            for w in chunk:
                if w.entry_id in lost:
                    self._ttl_set_at.pop(w.reply_key, None)
                    self._mark_gone(w.entry_id, w.deliveries, now)
                    if verified.get(w.entry_id) == w.deliveries:
                        del verified[w.entry_id]
                    self.lost.put((w.entry_id, w.deliveries))
        self.num_events_written += num_written

    def _forget_fences(self) -> None:
        for fence in self.fences:
            fence.seen = ""

    def _check_acks(self, acks: int, num_finishes: int) -> None:
        if acks >= self.min_replicas:
            return
        self.short_acks += 1
        if self.short_acks == 1 or self.short_acks % 100 == 0:
            log.warning("%d replica(s) of the %d wanted (--min-replicas) acknowledged the end "
                        "of %d job(s) within %d ms (%d such writes so far): a failover now "
                        "could lose those ends, and the jobs would run again", acks,
                        self.min_replicas, num_finishes, REPLICA_WAIT_MS, self.short_acks)

    def _warn_unwritable(self, chunk: list[EventWrite], entry_ids: set[str]) -> None:
        for w in chunk:
            if w.entry_id in entry_ids and w.entry_id not in self._unwritable:
                self._unwritable.add(w.entry_id)
                log.warning("entry %s: its reply key %s holds something other than a stream "
                            "(not genq's writing); its events are not written", w.entry_id,
                            w.reply_key)

    def _mark_gone(self, entry_id: str, deliveries: int, now: float) -> None:
        self._unwritable.discard(entry_id)
        key = (entry_id, deliveries)
        if self._gone.pop(key, None) is None:  # (popped: it moves to the newest end)
            self._gone_ids[entry_id] = self._gone_ids.get(entry_id, 0) + 1
        self._gone[key] = now

    def _forget_gone(self, now: float) -> None:
        """Attempts that ended or were lost long enough ago that nothing is queued for them."""
        gone, ids = self._gone, self._gone_ids
        while gone:
            oldest = next(iter(gone))
            if now - gone[oldest] <= _GONE_KEEP_S:
                return
            del gone[oldest]
            if ids[oldest[0]] == 1:
                del ids[oldest[0]]
            else:
                ids[oldest[0]] -= 1

