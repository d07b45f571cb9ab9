"""Held: the attempts a worker holds, and how each one ends.

An entry is held from its read/claim until its finish write (terminal event + XACK, fenced in
Lua) is done: first in `jobs` while it runs (or waits to be re-run by an isolation), then in
`finishing` while the writer has its finish. Every ending goes through here: done or an
engine error (emit), rejected at admission, cancelled or past its deadline (end_early), lost to
another worker (drop_lost, no finish: not ours to write), handed back by a draining worker.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from engine.outputs import RequestOutput
from producer.events import encode_event, error_event
from producer.protocol import Keys
from worker.admission import Rejection
from worker.batch import Batch, EventWrite, FinishWrite
from worker.io_thread import Writer
from worker.jobs import ActiveJob, terminal_event, token_events
from worker.metrics import WorkerMetrics
from worker.streams import split_ref
from worker.writer_process import WriterProcess

log = logging.getLogger("genq.worker")


class Held:
    def __init__(self, engine: Any, keys: Keys, me: str, writer: Writer | WriterProcess,
                 metrics: WorkerMetrics, counters: dict[str, int]) -> None:
        self.engine = engine
        self.keys = keys
        self.me = me
        self.writer = writer
        self.metrics = metrics
        self.counters = counters
        self.jobs: dict[str, ActiveJob] = {}  # entry id -> the attempt running in the engine
        self.by_job_id: dict[str, str] = {}  # job id -> entry id
        self.finishing: set[str] = set()  # entries whose finish write is with the writer
        self.last_tokens_at: dict[str, float] = {}  # entry id -> monotonic time of last tokens

    def __len__(self) -> int:
        return len(self.jobs) + len(self.finishing)

    def hold(self, job: ActiveJob) -> None:
        self.jobs[job.entry_id] = job
        self.by_job_id[job.job_id] = job.entry_id

    def _release(self, job: ActiveJob) -> None:
        self.jobs.pop(job.entry_id, None)
        self.last_tokens_at.pop(job.entry_id, None)
        if self.by_job_id.get(job.job_id) == job.entry_id:
            del self.by_job_id[job.job_id]

    # ------------------------------------------------------------------ outputs

    def emit(self, outputs: list[RequestOutput]) -> None:
        """One step's delta outputs: their events, and the finishes of the attempts that
        ended, to the writer in one batch."""
        batch = Batch()
        events_out = batch.events
        now = time.monotonic()
        m = self.metrics
        step_tokens = 0
        last_at = self.last_tokens_at
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
                    self.finish(job, terminal_event(job, out), batch)
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
        self.finish(job, encode_event(error_event(job.attempt, "engine_error",
                                                  message[:500])), batch)

    # ------------------------------------------------------------------ endings

    def finish(self, job: ActiveJob, event: bytes | None, batch: Batch,
               readd_fields: list[object] | None = None) -> None:
        """End the attempt with `event` (None: no event, e.g. a hand-back re-adding it)."""
        self._release(job)
        self.finishing.add(job.entry_id)
        batch.finishes.append(FinishWrite(job.entry_id, job.deliveries, job.reply_key, event,
                                          readd_fields=readd_fields or [],
                                          idem_key=self.keys.idem(job.job_id)))

    def end_early(self, job: ActiveJob, code: str, message: str) -> None:
        """Abort a running attempt with an error event (cancelled, deadline, engine error)."""
        self.engine.abort(job.entry_id)
        self.metrics.jobs_finished.inc(outcome=code)
        batch = Batch()
        self.finish(job, encode_event(error_event(job.attempt, code, message)), batch)
        self.writer.submit(batch)

    def rejection(self, job: ActiveJob, code: str, message: str) -> Rejection:
        return Rejection(job.entry_id, job.deliveries, job.attempt, job.reply_key, code, message,
                         dead=False, raw_job=job.fields.get(b"job"),
                         idem_key=self.keys.idem(job.job_id))

    def reject(self, r: Rejection, batch: Batch) -> None:
        """An entry admission refused (never in the engine): its error event or dead letter."""
        log.info("rejected entry %s (%s): %s", r.entry_id, r.code, r.message)
        self.counters["rejected"] += 1
        self.metrics.jobs_finished.inc(outcome="cancelled" if r.code == "cancelled"
                                       else "rejected")
        dead: list[object] = []
        if r.dead:
            dead = ["reason", r.message, "code", r.code, "entry", split_ref(r.entry_id)[1],
                    "worker", self.me]
            if r.raw_job is not None:
                dead += ["job", r.raw_job]
        event = encode_event(error_event(r.attempt, r.code, r.message)) if r.reply_key else None
        self.finishing.add(r.entry_id)
        batch.finishes.append(FinishWrite(r.entry_id, r.deliveries, r.reply_key, event,
                                          dead_fields=dead, idem_key=r.idem_key))

    def drop_lost(self, job: ActiveJob, why: str) -> None:
        """Stop running an attempt this worker no longer owns (no finish: not ours to write)."""
        log.warning("job %s (entry %s, delivery %d) is no longer ours (%s); aborting it",
                    job.job_id, job.entry_id, job.deliveries, why)
        self.engine.abort(job.entry_id)
        self._release(job)
        self.counters["lost"] += 1
        self.metrics.jobs_finished.inc(outcome="lost")

    def take_writer_feedback(self) -> None:
        """Finish writes that landed free their entries; attempts reclaimed from us stop."""
        self.writer.check()
        while not self.writer.finished.empty():
            self.finishing.discard(self.writer.finished.get())
        while not self.writer.lost.empty():
            entry_id, deliveries = self.writer.lost.get()
            job = self.jobs.get(entry_id)
            if job is not None and job.deliveries == deliveries:  # (not a newer delivery)
                self.drop_lost(job, "reclaimed by another worker while we were away")

    def check_ownership(self, pending: dict[str, int], complete: bool) -> None:
        """Held attempts that this worker's pending list (XPENDING, `complete` when it was read
        whole) no longer shows as ours: claimed away, acked by another. A job that writes
        nothing while it runs (stream=False, held back by --stream-interval, waiting in the
        engine) would otherwise run to its end for no one."""
        for job in list(self.jobs.values()):
            deliveries = pending.get(job.entry_id)
            if deliveries is None and complete:
                self.drop_lost(job, "not pending for this worker any more")
            elif deliveries is not None and deliveries != job.deliveries:
                self.drop_lost(job, f"delivered again since (delivery {deliveries})")

    def expire_deadlines(self) -> None:
        now = time.time()
        for job in [j for j in self.jobs.values()
                    if j.spec.deadline is not None and j.spec.deadline <= now]:
            self.end_early(job, "deadline_exceeded", "the job's deadline passed while it ran")
