"""The worker loop: Redis <-> engine for one served model.

One iteration: take the writer's feedback (finished writes, entries reclaimed from us) -> apply
cancels and deadlines -> read at most `free capacity` new entries (and, every reclaim_interval,
claim dead workers' entries) -> engine.step() -> hand the step's events to the writer thread,
which writes them in one pipelined round trip while the next step runs. While the engine runs,
the next iteration's read is sent as soon as the model has run, and its answer taken at the
start of that iteration (worker/reader.py): its round trip overlaps the sampling.

Ownership: an entry is "held" (worker/held.py, which also ends attempts) from the read/claim
until its finish write (terminal event + XACK, fenced in Lua) is done; held entries never exceed
max_num_seqs. Losing Redis never loses engine
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

from producer.connection import RETRYABLE, connect
from producer.events import started_event
from producer.protocol import Keys
from worker.admission import Admission, Admitted, Rejection, free_capacity
from worker.batch import Batch, EventWrite
from worker.cancel import CancelListener, Cancels
from worker.config import WorkerConfig
from worker.heartbeat import Heartbeat, Registry, name_in_use
from worker.held import Held
from worker.io_thread import Writer
from worker.jobs import ActiveJob
from worker.metrics import MetricsServer, WorkerMetrics
from worker.quarantine import EXIT_ENGINE_BROKEN, EngineBroken, Quarantine
from worker.reader import Entry, JobReader
from worker.scripts import flatten_fields
from worker.streams import WorkerKeys
from worker.writer_process import WriterProcess

log = logging.getLogger("genq.worker")
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
        self.keys = Keys(cfg.prefix, cfg.served_model_name)  # (the jobs' keys: this model's)
        self.me = cfg.name
        self.wkeys = WorkerKeys(self.keys, cfg.served_model_name, self.me, cfg.shards)
        self.conn = connect(cfg.redis_url, socket_timeout=10)
        self.reader = JobReader(cfg, self.wkeys, self.conn)
        self.admission = Admission(cfg, self.keys, engine.tokenizer, engine.max_model_len,
                                   getattr(engine, "vocab_size", None))
        self.max_num_seqs = int(engine.config.max_num_seqs)
        writer_args = (self.wkeys.streams, self.keys.group, self.me, cfg.result_ttl,
                       cfg.dead_ttl)
        self.writer: Writer | WriterProcess = \
            WriterProcess(cfg.redis_url, *writer_args, min_replicas=cfg.min_replicas) \
            if cfg.writer == "process" else Writer(self.conn, *writer_args,
                                                   min_replicas=cfg.min_replicas)
        self.metrics = WorkerMetrics(cfg.served_model_name, self.me, self.wkeys.jobs,
                                     self.keys.group)
        self.metrics.read_stats_from(lambda: (self._stats, len(self.held)))
        self.metrics_server = metrics_server  # bound already (genq worker), or bound in run()
        self.heartbeat = Heartbeat(self.conn, self.wkeys.heartbeat,
                                   cfg.heartbeat_ttl, cfg.heartbeat_interval,
                                   self._heartbeat_info, self.wkeys.jobs, cfg.stream_ttl,
                                   sample=self.metrics.sample if cfg.metrics_port else None,
                                   registry=Registry.of(self.keys, cfg.served_model_name, self.me),
                                   shards=None if cfg.shards == 1 else (
                                       self.keys.shards(cfg.served_model_name), cfg.shards,
                                       self.wkeys.shard_heartbeats))
        self.cancel_listener = CancelListener(cfg.redis_url, self.wkeys.cancel_channel)
        self.cancels = Cancels(self.cancel_listener, self.conn, self.keys,
                               cfg.cancel_poll_interval)
        self.stop_requested = threading.Event()
        self.counters = {"admitted": 0, "completed": 0, "rejected": 0, "reclaimed": 0,
                         "lost": 0, "cancelled": 0, "handed_back": 0, "engine_failures": 0,
                         "culprits": 0, "steps": 0,
                         "read_ahead": 0}  # (entries that came in through a read sent ahead)
        self.held = Held(engine, self.keys, self.me, self.writer, self.metrics, self.counters)
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
        clash = name_in_use(self.conn, self.wkeys.heartbeat, self.me)
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
            self._admit(self.reader.collect() or [])  # (a read sent ahead: run or hand back)
            self._drain()
        except EngineBroken as exc:  # not a job's fault: other workers reclaim our jobs
            log.critical("the engine is broken: %s; exiting with status %d, this worker's %d "
                         "held job(s) go to other workers once its heartbeat is gone", exc,
                         EXIT_ENGINE_BROKEN, len(self.held.jobs))
            self._stop_threads()
            return EXIT_ENGINE_BROKEN
        return 0

    def _drain(self) -> None:
        """Stop reading, finish in-flight work within drain_timeout, hand back the rest."""
        log.info("draining %d job(s) (up to %.1f s)", len(self.held.jobs),
                 self.cfg.drain_timeout)
        self._drain_end = time.monotonic() + self.cfg.drain_timeout
        # (jobs may be held outside the engine: those an isolation had not re-run yet)
        while self.engine.has_unfinished() and not self._drain_expired():
            self._iteration(reading=False)
        batch = Batch()
        for job in list(self.held.jobs.values()):
            self.engine.abort(job.entry_id)
            readd = {b"v": job.fields[b"v"], b"job": job.fields[b"job"],
                     b"a": str(job.attempt).encode()}
            self.held.finish(job, None, batch, readd_fields=flatten_fields(readd))
            self.counters["handed_back"] += 1
            self.metrics.jobs_finished.inc(outcome="handed_back")
        self.writer.submit(batch)
        self._stop_threads()

    def _stop_threads(self) -> None:
        """Land what the writer holds, then stop the threads (the heartbeat key goes last)."""
        if not self.writer.flush(timeout=self.cfg.flush_timeout):
            log.warning("Redis did not take the last writes within %.0f s; the unacked jobs "
                        "will be reclaimed once this worker's heartbeat expires",
                        self.cfg.flush_timeout)
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
        self.housekeeping()
        if reading:
            self._read_new()
        if self.engine.has_unfinished():
            try:
                outputs = self.engine.step(on_forward=self._read_ahead if reading else None)
            except Exception as exc:  # a bad job never stops the worker: find it, end it
                self.quarantine.isolate(exc)
            else:
                self.held.emit(outputs)
            self.counters["steps"] += 1  # (the heartbeat's: e.g. how long a job waited)
        elif not reading or self._capacity() == 0:
            time.sleep(0.002)  # nothing to step; wait for the writer to finish what is held
        self.after_step()

    def housekeeping(self) -> None:
        """Before a step: the writer's feedback, cancels, deadlines."""
        self.held.take_writer_feedback()
        self._apply_cancels()
        self.held.expire_deadlines()

    def after_step(self) -> None:
        """After a step: refresh the stats; while the writer is behind (e.g. Redis is down),
        wait for it, until a stop request (the drain that follows bounds the rest)."""
        self._stats = self.engine.stats()
        while self.writer.backlog() > 8 and not self.stopping():
            time.sleep(0.002)
            self.held.take_writer_feedback()

    def stopping(self) -> bool:
        """Whether to stop what runs now: the drain's time is up, or a stop was requested and
        the drain has not begun (it runs what is in the engine and hands back the rest)."""
        return self._drain_expired() or (self.stop_requested.is_set() and self._drain_end is None)

    def _drain_expired(self) -> bool:
        return self._drain_end is not None and time.monotonic() > self._drain_end

    def _capacity(self) -> int:
        return free_capacity(self.max_num_seqs, len(self.held), self._stats)

    def _read_ahead(self) -> None:
        """The model has run (the engine samples next): send the next iteration's read, for
        the capacity the engine leaves now."""
        if not self.stop_requested.is_set():
            self._stats = self.engine.stats()
            self.reader.send(self._capacity())

    def _read_new(self) -> None:
        # The read sent during the last step first: an entry in it is not an orphan.
        ahead = self.reader.collect()
        if ahead:
            self.counters["read_ahead"] += len(ahead)
            self._admit(ahead)
        capacity = self._capacity()
        now = time.monotonic()
        if now >= self._next_reclaim or self.reader.failed:
            self._next_reclaim = now + self.cfg.reclaim_interval
            self.reader.failed = False
            scan = 2 * self.max_num_seqs + 64
            pending = self.reader.own_pending(scan)
            if pending is not None:
                self.held.check_ownership(pending, complete=len(pending) < scan)
            if capacity > 0 and pending:
                orphans = self.reader.orphans(pending, set(self.held.jobs) | self.held.finishing,
                                              capacity)
                self._admit(orphans)
                capacity -= len(orphans)
            if capacity > 0:
                capacity -= self._claim(include_self=False, count=capacity)
        # Running requests: take what is there and step on (the read sent ahead took it).
        # Nothing to run: wait in Redis for work, briefly while finish writes are in flight
        # (their acks free capacity), rather than spinning on empty reads.
        if self.engine.has_unfinished():
            if ahead is not None:
                return
            block_ms: int | None = None
        else:
            block_ms = min(_BUSY_BLOCK_MS, self.cfg.block_ms) if self.held.finishing \
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

    def priority_of(self, job: ActiveJob) -> int:
        """The job's priority for the engine: its own under --scheduling-policy priority, else
        0 (an FCFS engine takes none)."""
        return job.spec.priority if self.engine.config.scheduling_policy == "priority" else 0

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
            prev = self.held.jobs.get(d.job.entry_id if isinstance(d, Admitted) else d.entry_id)
            if prev is not None:  # Redis delivered an entry we run again: the new delivery
                # is the one this worker owns now (e.g. it came back to us through another
                # worker's claim, or Redis restarted from a snapshot older than our read)
                self.held.drop_lost(prev, "delivered to this worker again")
            if isinstance(d, Admitted) and d.job.job_id in cancelled:
                d = self.held.rejection(d.job, "cancelled", "cancelled by the client")
            if isinstance(d, Admitted):
                try:
                    self.engine.add_request(d.job.entry_id, d.prompt, d.params,
                                            self.priority_of(d.job))
                except Exception as exc:  # the engine's ValueError, or a job it chokes on
                    d = self.held.rejection(d.job, "bad_prompt", f"{type(exc).__name__}: {exc}")
            if isinstance(d, Rejection):
                self.held.reject(d, batch)
                continue
            self.held.hold(d.job)
            self.counters["admitted"] += 1
            batch.events.append(EventWrite(d.job.entry_id, d.job.deliveries, d.job.reply_key,
                                           [started_event(d.job.attempt, self.me)]))
        self.writer.submit(batch)

    def _apply_cancels(self) -> None:
        held = self.held
        for job_id in self.cancels.due(held.by_job_id):
            job = held.jobs.get(held.by_job_id[job_id])
            if job is not None:
                self.counters["cancelled"] += 1
                held.end_early(job, "cancelled", "cancelled by the client")

    def _heartbeat_info(self) -> dict[str, Any]:
        stats = self._stats
        return {"model": self.cfg.served_model_name, "device": self.cfg.device,
                "pid": os.getpid(), "host": socket.gethostname(),
                "capacity": self.max_num_seqs,
                "held": len(self.held),
                "running": stats.get("num_running", 0), "waiting": stats.get("num_waiting", 0),
                "swapped": stats.get("num_swapped", 0),
                "num_free_blocks": stats.get("num_free_blocks", 0),
                "num_total_blocks": stats.get("num_total_blocks", 0),
                "num_preemptions": stats.get("num_preemptions", 0),
                "prefix_caching": bool(self.engine.config.enable_prefix_caching),
                "prefix_cache_hit_rate": stats.get("prefix_cache_hit_rate", 0.0),
                "events_written": self.writer.num_events_written, **self.counters}

