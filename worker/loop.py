"""The worker loop: Redis <-> engine for one served model.

One iteration: take the writer's feedback (finished writes, entries reclaimed from us) -> apply
cancels and deadlines -> read at most `free capacity` new entries (and, every reclaim_interval,
claim dead workers' entries) -> engine.step() -> hand the step's events to the writer thread,
which writes them in one pipelined round trip while the next step runs.

Ownership: an entry is "held" from the read/claim until its finish write (terminal event + XACK,
fenced in Lua) is done; held entries never exceed max_num_seqs. Losing Redis never loses engine
state: reads are retried with backoff while the engine keeps stepping, and the writer retries
its writes until they land.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Any

import redis

from engine.outputs import RequestOutput
from producer.protocol import Keys, encode_event, error_event, started_event
from worker.admission import Admission, Admitted, Rejection, free_capacity
from worker.cancel import CancelListener, Cancels
from worker.config import WorkerConfig
from worker.heartbeat import Heartbeat, name_in_use
from worker.io_thread import Batch, EventWrite, FinishWrite, Writer
from worker.jobs import ActiveJob, terminal_event, token_events
from worker.metrics import MetricsServer, WorkerMetrics
from worker.quarantine import EXIT_ENGINE_BROKEN, EngineBroken, Quarantine
from worker.reader import RETRYABLE, Entry, JobReader
from worker.scripts import flatten_fields
from worker.writer_process import WriterProcess

log = logging.getLogger("genq.worker")
_FINAL_FLUSH_S = 15.0
_BUSY_BLOCK_MS = 2
EXIT_NAME_IN_USE = 4  # genq worker's exit status when its --name is taken on this host


class Worker:
    def __init__(self, engine: Any, cfg: WorkerConfig,
                 metrics_server: MetricsServer | None = None) -> None:
        if not getattr(engine, "delta_outputs", False):
            raise ValueError("the worker streams the engine's delta outputs: build the engine "
                             "with EngineConfig(output_kind='delta')")
        self.engine = engine
        self.cfg = cfg
        self.keys = Keys(cfg.prefix)
        self.me = cfg.name
        self.jobs_key = self.keys.jobs(cfg.served_model_name)
        self.conn = redis.Redis.from_url(cfg.redis_url, protocol=2, socket_timeout=10,
                                         socket_connect_timeout=5)
        self.reader = JobReader(cfg, self.keys, self.conn)
        self.admission = Admission(cfg, self.keys, engine.tokenizer, engine.max_model_len,
                                   getattr(engine, "vocab_size", None))
        self.max_num_seqs = int(engine.config.max_num_seqs)
        writer_args = (self.jobs_key, self.keys.dead(cfg.served_model_name), self.keys.group,
                       self.me, cfg.result_ttl, cfg.dead_ttl)
        fence = self.keys.fence(cfg.served_model_name, self.me)
        self.writer: Writer | WriterProcess = \
            WriterProcess(cfg.redis_url, *writer_args, fence_key=fence) \
            if cfg.writer == "process" else Writer(self.conn, *writer_args, fence_key=fence)
        self.metrics = WorkerMetrics(cfg.served_model_name, self.me, self.jobs_key,
                                     self.keys.group)
        self.metrics.read_stats_from(lambda: (self._stats, len(self.jobs) + len(self.finishing)))
        self.metrics_server = metrics_server  # bound already (genq worker), or bound in run()
        self._last_tokens_at: dict[str, float] = {}  # entry id -> monotonic time of last tokens
        self.heartbeat = Heartbeat(self.conn, self.keys.worker(self.me), cfg.heartbeat_ttl,
                                   cfg.heartbeat_interval, self._heartbeat_info, self.jobs_key,
                                   cfg.stream_ttl,
                                   sample=self.metrics.sample if cfg.metrics_port else None)
        self.cancel_listener = CancelListener(cfg.redis_url, self.keys.cancel_channel)
        self.cancels = Cancels(self.cancel_listener, self.conn, self.keys,
                               cfg.cancel_poll_interval)
        self.jobs: dict[str, ActiveJob] = {}  # entry id -> the attempt running in the engine
        self.by_job_id: dict[str, str] = {}  # job id -> entry id
        self.finishing: set[str] = set()  # entries whose finish write is with the writer
        self.stop_requested = threading.Event()
        self.counters = {"admitted": 0, "completed": 0, "rejected": 0, "reclaimed": 0,
                         "lost": 0, "cancelled": 0, "handed_back": 0, "engine_failures": 0,
                         "culprits": 0}
        self.quarantine = Quarantine(self)  # engine.step() raised: find the job(s) at fault
        self._stats: dict[str, Any] = {}
        self._next_reclaim = 0.0
        self._drain_end: float | None = None

    # ------------------------------------------------------------------ lifecycle

    def request_stop(self) -> None:
        self.stop_requested.set()

    def run(self) -> int:
        if not self.reader.ensure_group(wait=True, stop=self.stop_requested):
            log.info("worker %s stopped before Redis answered; it held no jobs", self.me)
            return 0
        clash = name_in_use(self.conn, self.keys.worker(self.me), self.me)
        if clash:
            log.critical("%s", clash)
            return EXIT_NAME_IN_USE
        self._stats = self.engine.stats()
        if self.cfg.metrics_port:
            if self.metrics_server is None:
                self.metrics_server = MetricsServer(self.metrics.registry, self.cfg.metrics_host,
                                                    self.cfg.metrics_port)
            self.metrics_server.registry = self.metrics.registry
            self.metrics_server.start()
            log.info("metrics at http://%s:%d/metrics", self.cfg.metrics_host,
                     self.metrics_server.port)
        try:
            self.heartbeat.beat()
        except RETRYABLE as exc:  # the heartbeat thread keeps trying
            log.warning("first heartbeat failed: %s", exc)
        for thread in (self.heartbeat, self.cancel_listener, self.writer):
            thread.start()
        log.info("worker %s serving %s on %s", self.me, self.cfg.served_model_name,
                 self.cfg.device)
        # A restart under the same name re-reads its own pending entries first.
        self._claim(include_self=True, count=self.max_num_seqs)
        self._next_reclaim = time.monotonic() + self.cfg.reclaim_interval
        try:
            while not self.stop_requested.is_set():
                self._iteration(reading=True)
            self._drain()
        except EngineBroken as exc:  # not a job's fault: other workers reclaim our jobs
            log.critical("the engine is broken: %s; exiting with status %d, this worker's %d "
                         "held job(s) go to other workers once its heartbeat is gone", exc,
                         EXIT_ENGINE_BROKEN, len(self.jobs))
            self._stop_threads()
            return EXIT_ENGINE_BROKEN
        return 0

    def _drain(self) -> None:
        """Stop reading, finish in-flight work within drain_timeout, hand back the rest."""
        log.info("draining %d job(s) (up to %.1f s)", len(self.jobs), self.cfg.drain_timeout)
        self._drain_end = time.monotonic() + self.cfg.drain_timeout
        # (jobs may be held outside the engine: those an isolation had not re-run yet)
        while self.engine.has_unfinished() and not self._drain_expired():
            self._iteration(reading=False)
        batch = Batch()
        for job in list(self.jobs.values()):
            self.engine.abort(job.entry_id)
            readd = {b"v": job.fields[b"v"], b"job": job.fields[b"job"],
                     b"a": str(job.attempt).encode()}
            self._finish(job, None, batch, readd_fields=flatten_fields(readd))
            self.counters["handed_back"] += 1
            self.metrics.jobs_finished.inc(outcome="handed_back")
        self.writer.submit(batch)
        self._stop_threads()

    def _stop_threads(self) -> None:
        """Land what the writer holds, then stop the threads (the heartbeat key goes last)."""
        if not self.writer.flush(timeout=_FINAL_FLUSH_S):
            log.warning("Redis did not take the last writes within %.0f s; the unacked jobs "
                        "will be reclaimed once this worker's heartbeat expires", _FINAL_FLUSH_S)
            self.writer.abandon()
        else:
            self.writer.stop()
        self.cancel_listener.stop()
        self.heartbeat.stop(delete=True)
        if self.metrics_server is not None:
            self.metrics_server.stop()
        log.info("worker %s stopped: %s", self.me, self.counters)

    # ------------------------------------------------------------------ one iteration

    def _iteration(self, reading: bool) -> None:
        self._housekeeping()
        if reading:
            self._read_new()
        if self.engine.has_unfinished():
            try:
                outputs = self.engine.step()
            except Exception as exc:  # a bad job never stops the worker: find it, end it
                self.quarantine.isolate(exc)
            else:
                self._emit(outputs)
        elif not reading or self._capacity() == 0:
            time.sleep(0.002)  # nothing to step; wait for the writer to finish what is held
        self._stats = self.engine.stats()
        self._wait_for_writer()

    def _housekeeping(self) -> None:
        """Before a step: the writer's feedback, cancels, deadlines."""
        self._take_writer_feedback()
        self._apply_cancels()
        self._expire_deadlines()

    def _wait_for_writer(self) -> None:
        """After a step: while the writer is behind (e.g. Redis is down), wait for it; a stop
        request ends the wait (the drain that follows bounds the rest)."""
        while self.writer.backlog() > 8 and not self._drain_expired() and not (
                self._drain_end is None and self.stop_requested.is_set()):
            time.sleep(0.002)
            self._take_writer_feedback()

    def _drain_expired(self) -> bool:
        return self._drain_end is not None and time.monotonic() > self._drain_end

    def _capacity(self) -> int:
        return free_capacity(self.max_num_seqs, len(self.jobs) + len(self.finishing), self._stats)

    def _read_new(self) -> None:
        capacity = self._capacity()
        now = time.monotonic()
        if now >= self._next_reclaim or self.reader.failed:
            self._next_reclaim = now + self.cfg.reclaim_interval
            self.reader.failed = False
            scan = 2 * self.max_num_seqs + 64
            pending = self.reader.own_pending(scan)
            if pending is not None:
                self._check_ownership(pending, complete=len(pending) < scan)
            if capacity > 0 and pending:
                orphans = self.reader.orphans(pending, set(self.jobs) | self.finishing,
                                              capacity)
                self._admit(orphans)
                capacity -= len(orphans)
            if capacity > 0:
                capacity -= self._claim(include_self=False, count=capacity)
        # Running requests: take what is there and step on. Nothing to run: wait in Redis for
        # work, briefly while finish writes are in flight (their acks free capacity), rather
        # than spinning on empty reads.
        if self.engine.has_unfinished():
            block_ms: int | None = None
        else:
            block_ms = min(_BUSY_BLOCK_MS, self.cfg.block_ms) if self.finishing \
                else self.cfg.block_ms
        self._admit(self.reader.read(capacity, block_ms))

    def _claim(self, include_self: bool, count: int) -> int:
        claimed = self.reader.claim(count, include_self)
        if claimed:
            log.info("claimed %d pending job(s)%s", len(claimed),
                     " at start (this worker's own from a previous run, or a dead worker's)"
                     if include_self else " of dead workers")
            self.counters["reclaimed"] += len(claimed)
        self._admit(claimed)
        return len(claimed)

    # ------------------------------------------------------------------ admission

    def _admit(self, entries: list[Entry]) -> None:
        if not entries:
            return
        self._apply_cancels()  # take in cancels published while we blocked on the read
        decided = [self.admission.admit(eid, fields, n) for eid, fields, n in entries]
        # Cancels published before the job reached us (no Redis round trip here: a cancel whose
        # publish we missed is found by the next key sweep, within cancel_poll_interval).
        cancelled = self.cancels.early
        batch = Batch()
        for d in decided:
            prev = self.jobs.get(d.job.entry_id if isinstance(d, Admitted) else d.entry_id)
            if prev is not None:  # Redis delivered an entry we run again: the new delivery
                # is the one this worker owns now (e.g. it came back to us through another
                # worker's claim, or Redis restarted from a snapshot older than our read)
                self._drop_lost(prev, "delivered to this worker again")
            if isinstance(d, Admitted) and d.job.job_id in cancelled:
                d = self._rejection(d.job, "cancelled", "cancelled by the client")
            if isinstance(d, Admitted):
                try:
                    self.engine.add_request(d.job.entry_id, d.prompt, d.params)
                except Exception as exc:  # the engine's ValueError, or a job it chokes on
                    d = self._rejection(d.job, "bad_prompt", f"{type(exc).__name__}: {exc}")
            if isinstance(d, Rejection):
                self._reject(d, batch)
                continue
            self.jobs[d.job.entry_id] = d.job
            self.by_job_id[d.job.job_id] = d.job.entry_id
            self.counters["admitted"] += 1
            batch.events.append(EventWrite(d.job.entry_id, d.job.deliveries, d.job.reply_key,
                                           [started_event(d.job.attempt, self.me)]))
        self.writer.submit(batch)

    def _rejection(self, job: ActiveJob, code: str, message: str) -> Rejection:
        return Rejection(job.entry_id, job.deliveries, job.attempt, job.reply_key, code, message,
                         dead=False, raw_job=job.fields.get(b"job"),
                         idem_key=self.keys.idem(job.job_id))

    def _reject(self, r: Rejection, batch: Batch) -> None:
        log.info("rejected entry %s (%s): %s", r.entry_id, r.code, r.message)
        self.counters["rejected"] += 1
        self.metrics.jobs_finished.inc(outcome="cancelled" if r.code == "cancelled" else "rejected")
        dead: list[object] = []
        if r.dead:
            dead = ["reason", r.message, "code", r.code, "entry", r.entry_id, "worker", self.me]
            if r.raw_job is not None:
                dead += ["job", r.raw_job]
        event = encode_event(error_event(r.attempt, r.code, r.message)) if r.reply_key else None
        self.finishing.add(r.entry_id)
        batch.finishes.append(FinishWrite(r.entry_id, r.deliveries, r.reply_key, event,
                                          dead_fields=dead, idem_key=r.idem_key))

    # ------------------------------------------------------------------ outputs and endings

    def _emit(self, outputs: list[RequestOutput]) -> None:
        batch = Batch()
        events_out = batch.events
        now = time.monotonic()
        m = self.metrics
        step_tokens = 0
        last_at = self._last_tokens_at
        intervals: dict[float, int] = {}  # time of a job's previous tokens -> jobs (ITL)
        for out in outputs:
            job = self.jobs.get(out.request_id)
            if job is None:
                continue
            try:
                had_first = job.first_token_at is not None
                events, new_tokens = token_events(job, out)
                if new_tokens:
                    step_tokens += new_tokens
                    previous = last_at.get(job.entry_id)
                    if not had_first and job.first_token_at is not None:
                        m.ttft.observe(job.first_token_at - job.admitted_at)
                    elif previous is not None:
                        intervals[previous] = intervals.get(previous, 0) + 1
                    last_at[job.entry_id] = now
                if events:
                    events_out.append(EventWrite(job.entry_id, job.deliveries, job.reply_key,
                                                 events))
                if out.finished:
                    self.counters["completed"] += 1
                    failed = out.error is not None or any(c.finish_reason == "error"
                                                         for c in out.outputs)
                    m.jobs_finished.inc(outcome="engine_error" if failed else "done")
                    self._finish(job, terminal_event(job, out), batch)
            except Exception as exc:  # building this job's events failed: end it, not us
                self._output_failed(job, exc, batch)
        for previous, count in intervals.items():  # most jobs share the previous step's time
            m.itl.observe_many(now - previous, count)
        if step_tokens:
            m.tokens.inc(step_tokens)
        self.writer.submit(batch)

    def _output_failed(self, job: ActiveJob, exc: Exception, batch: Batch) -> None:
        log.exception("building the events of job %s (entry %s) failed; ending it with "
                      "engine_error", job.job_id, job.entry_id, exc_info=exc)
        if job.entry_id not in self.jobs:
            return  # it was finished already (the error came after its terminal event)
        self.engine.abort(job.entry_id)
        self.metrics.jobs_finished.inc(outcome="engine_error")
        message = f"the worker failed on this job's output: {type(exc).__name__}: {exc}"
        # In this step's batch, after its events: the terminal event stays the last one.
        self._finish(job, encode_event(error_event(job.attempt, "engine_error",
                                                   message[:500])), batch)

    def _finish(self, job: ActiveJob, event: bytes | None, batch: Batch,
                readd_fields: list[object] | None = None) -> None:
        self.jobs.pop(job.entry_id, None)
        self._last_tokens_at.pop(job.entry_id, None)
        if self.by_job_id.get(job.job_id) == job.entry_id:
            del self.by_job_id[job.job_id]
        self.finishing.add(job.entry_id)
        batch.finishes.append(FinishWrite(job.entry_id, job.deliveries, job.reply_key, event,
                                          readd_fields=readd_fields or [],
                                          idem_key=self.keys.idem(job.job_id)))

    def _end_early(self, job: ActiveJob, code: str, message: str) -> None:
        self.engine.abort(job.entry_id)
        self.metrics.jobs_finished.inc(outcome=code)
        batch = Batch()
        self._finish(job, encode_event(error_event(job.attempt, code, message)), batch)
        self.writer.submit(batch)

    def _take_writer_feedback(self) -> None:
        self.writer.check()
        while not self.writer.finished.empty():
            self.finishing.discard(self.writer.finished.get())
        while not self.writer.lost.empty():
            entry_id, deliveries = self.writer.lost.get()
            job = self.jobs.get(entry_id)
            if job is not None and job.deliveries == deliveries:  # (not a newer delivery)
                self._drop_lost(job, "reclaimed by another worker while we were away")

    def _drop_lost(self, job: ActiveJob, why: str) -> None:
        """Stop running an attempt this worker no longer owns (no finish: not ours to write)."""
        log.warning("job %s (entry %s, delivery %d) is no longer ours (%s); aborting it",
                    job.job_id, job.entry_id, job.deliveries, why)
        self.engine.abort(job.entry_id)
        self.jobs.pop(job.entry_id, None)
        self._last_tokens_at.pop(job.entry_id, None)
        if self.by_job_id.get(job.job_id) == job.entry_id:
            del self.by_job_id[job.job_id]
        self.counters["lost"] += 1
        self.metrics.jobs_finished.inc(outcome="lost")

    def _check_ownership(self, pending: dict[str, int], complete: bool) -> None:
        """Held attempts that this worker's pending list (XPENDING, `complete` when it was read
        whole) no longer shows as ours: claimed away, acked by another. A job that writes
        nothing while it runs (stream=False, held back by --stream-interval, waiting in the
        engine) would otherwise run to its end for no one."""
        for job in list(self.jobs.values()):
            deliveries = pending.get(job.entry_id)
            if deliveries is None and complete:
                self._drop_lost(job, "not pending for this worker any more")
            elif deliveries is not None and deliveries != job.deliveries:
                self._drop_lost(job, f"delivered again since (delivery {deliveries})")

    def _apply_cancels(self) -> None:
        for job_id in self.cancels.due(self.by_job_id):
            entry_id = self.by_job_id[job_id]
            if entry_id in self.jobs:
                self.counters["cancelled"] += 1
                self._end_early(self.jobs[entry_id], "cancelled", "cancelled by the client")

    def _expire_deadlines(self) -> None:
        now = time.time()
        for job in [j for j in self.jobs.values()
                    if j.spec.deadline is not None and j.spec.deadline <= now]:
            self._end_early(job, "deadline_exceeded", "the job's deadline passed while it ran")

    def _heartbeat_info(self) -> dict[str, Any]:
        stats = self._stats
        return {"model": self.cfg.served_model_name, "device": self.cfg.device,
                "pid": os.getpid(), "host": socket.gethostname(),
                "capacity": self.max_num_seqs,
                "held": len(self.jobs) + len(self.finishing),
                "running": stats.get("num_running", 0), "waiting": stats.get("num_waiting", 0),
                "swapped": stats.get("num_swapped", 0),
                "num_free_blocks": stats.get("num_free_blocks", 0),
                "num_total_blocks": stats.get("num_total_blocks", 0),
                "num_preemptions": stats.get("num_preemptions", 0),
                "prefix_caching": bool(self.engine.config.enable_prefix_caching),
                "prefix_cache_hit_rate": stats.get("prefix_cache_hit_rate", 0.0),
                "events_written": self.writer.num_events_written, **self.counters}

